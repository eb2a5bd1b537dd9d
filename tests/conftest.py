"""Shared test plumbing: real Kafka, real S3 over HTTP (moto), the tiny model.

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` when set (``scripts/test`` starts one broker for
the whole run and sets it), otherwise a broker launched here for the session. A test
that needs Kafka FAILS when no broker can be started; nothing here ever skips.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import pytest_asyncio

# Set before anything imports vLLM or transformers: no hub access, CPU-friendly vLLM.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Task folders used as test data (their hidden tests run inside the grader's sandboxes,
# never in this pytest session).
collect_ignore_glob = ["hostile/bridge_tasks/*"]

from bus.config import KafkaConfig  # noqa: E402
from rollway.broker import LocalKafka, external_bootstrap  # noqa: E402
from rollway.logging import configure_logging  # noqa: E402

# Few partitions per test topic: every test creates its own set of topics.
TEST_PARTITIONS = {"tasks": 2, "trajectories": 2, "rewards": 2, "health": 1, "metrics": 1}


def pytest_configure(config: pytest.Config) -> None:
    configure_logging("test", level=os.environ.get("ROLLWAY_TEST_LOG_LEVEL", "warning"))


# Modules whose tests share an expensive module (or session) fixture: under pytest-xdist
# (scripts/test) each runs whole on one worker, so the fixture is made once, not once per
# worker that gets one of its tests (test_grader_demo grades every shipped task: 220 s on
# each worker in the 2-worker suite at 17:00; test_kafka_broker starts a 3-node cluster).
# Every other test is its own unit, handed out as --dist load hands them out.
ONE_WORKER_MODULES = frozenset({
    "test_grader_demo", "test_grader_hostile", "test_kafka_broker", "test_fsdp", "test_tls", "test_task_family",
    "test_engine_vllm", "test_grader", "test_grader_images", "test_grader_inenv", "test_grader_deferred",
    "test_acl", "test_bridge_capabilities", "test_images", "test_grader_plain_hostile", "test_grader_restore_redteam",
})


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """For ``--dist load``: xdist's scope scheduler with a module of ONE_WORKER_MODULES
    as one unit and every other test as a unit of its own. (xdist's own ``loadgroup``
    does not group under pytest 9: it renames ``item._nodeid``, which pytest 9's
    ``nodeid`` no longer reads.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if Path(path).stem in ONE_WORKER_MODULES else nodeid

    return OneWorkerModules(config, log)


def unique(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


@pytest.fixture
def own_uid():
    """A uid for a test that runs sandboxed processes itself (a Jail without a service):
    the first uid of a range claimed like a service's (sandbox/uid_claim.py), held for the
    test. A fixed uid was shared by the parametrized copies of a test on two xdist workers
    and by services' ranges: each one's clean-up (every process of the uid killed) and
    leftover check saw the other's processes. Unprivileged hosts run as themselves."""
    from sandbox.config import SandboxConfig
    from sandbox.uid_claim import claim_uid_range

    if os.geteuid() != 0:  # what Jail.privileged reads
        yield os.geteuid()
        return
    cfg = SandboxConfig()
    claim = claim_uid_range(cfg.uid_base, 1, solution_uid_offset=cfg.grading_solution_uid_offset)
    try:
        yield claim.base
    finally:
        claim.release()


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory):
    external = external_bootstrap()
    if external:
        yield external
        return
    kafka = LocalKafka(tmp_path_factory.mktemp("kafka"), nodes=1)
    try:
        # Raises BrokerError with the broker log tail: the test errors, never skips.
        yield kafka.start(timeout=120)
    finally:
        kafka.stop()


@pytest.fixture(scope="session")
def kafka_cluster3(tmp_path_factory: pytest.TempPathFactory):
    """A 3-node cluster of our own (tests kill nodes by pid, so never an external one)."""
    kafka = LocalKafka(tmp_path_factory.mktemp("kafka3"), nodes=3, heap="384m")
    try:
        kafka.start(timeout=180)
        yield kafka
    finally:
        kafka.stop()


def make_kafka_config(bootstrap: str, **overrides) -> KafkaConfig:
    fields = dict(
        bootstrap_servers=bootstrap,
        topic_prefix=f"{unique('test-')}.",
        partitions=dict(TEST_PARTITIONS),
        client_id="rollway-test",
    )
    fields.update(overrides)
    return KafkaConfig(**fields)


@pytest_asyncio.fixture(loop_scope="session")
async def kafka_config(kafka_bootstrap: str) -> KafkaConfig:
    """A KafkaConfig whose topic prefix is unique to this test, all topics created."""
    from bus import ensure_topics

    cfg = make_kafka_config(kafka_bootstrap)
    await ensure_topics(cfg)
    return cfg


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory):
    """moto's S3 over real HTTP on loopback, in its own process; test credentials in
    the environment. (In-process, moto's flask proxies break vLLM's CPU platform
    start-up, which hasattr()s every loaded module.)"""
    import subprocess
    import sys

    from rollway.broker import free_ports, port_open
    from tests.waiting import wait_until

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)
    port = free_ports(1)[0]
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        try:
            wait_until(lambda: port_open(port), 60, "the moto S3 server", proc=server, poll_s=0.1)
        except AssertionError:
            raise RuntimeError(f"moto S3 server did not start (exit {server.poll()}); see {log.name}") from None
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from sampler.tiny_model import tiny_model_dir

    return tiny_model_dir()
