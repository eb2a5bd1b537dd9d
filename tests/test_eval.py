"""``rollway eval`` and ``rollway evaluator`` against a live stack: real Kafka, the real
sandbox service (HTTP, bubblewrap, the grader publishing to Kafka), the real torch
engine with the tiny agent model, weights from a real store.

The agent's turn is prefilled with a complete ``<tool>submit</tool>`` and the model adds
one token, so every rollout submits the untouched repository: tasks whose repository
already passes its hidden tests are solved, the others are not, and pass@1, per-kind
pass@1, rewards and token counts are known exactly whatever the model samples.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from bus import EventProducer
from bus.config import KafkaConfig
from rollway.cli import main
from rollway.config import EvalConfig, RollwayConfig
from sampler.config import SamplerConfig
from sandbox.client import SandboxClient
from sandbox.config import SandboxConfig
from schemas import EvalResult, Heartbeat
from syncer.config import SyncerConfig
from tasks.spec import TaskSpec
from tests.events import read_all, read_until
from tests.sampler_helpers import agent_model_dir
from tests.sandbox_helpers import live_sandbox, write_task_dir

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
MODEL = "eval-test"
ADD_TEST = {"test_add.py": "from solution import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"}
UPPER_TEST = {"test_up.py": "from solution import up\n\n\ndef test_up():\n    assert up('ab') == 'AB'\n"}
TASKS = [  # (task, kind, solved by submitting the repo as it is)
    TaskSpec(task_id="add_ok", instruction="Make add work.", metadata={"kind": "arith"},
             files={"solution.py": "def add(x, y):\n    return x + y\n"}, hidden_tests=ADD_TEST),
    TaskSpec(task_id="add_bug", instruction="Fix add.", metadata={"kind": "arith"},
             files={"solution.py": "def add(x, y):\n    return x - y\n"}, hidden_tests=ADD_TEST),
    TaskSpec(task_id="up_ok", instruction="Make up work.", metadata={"kind": "text"},
             files={"solution.py": "def up(s):\n    return s.upper()\n"}, hidden_tests=UPPER_TEST),
]
SOLVED = {"add_ok": 1, "add_bug": 0, "up_ok": 1}


def stack_config(kafka: KafkaConfig, tmp: Path, sandbox_url: str, **eval_fields) -> RollwayConfig:
    return RollwayConfig(
        model_name=MODEL,
        kafka=kafka,
        syncer=SyncerConfig(store_url=f"file://{tmp}/weights", keyframe_every=2),
        sampler=SamplerConfig(
            engine="torch", model_path=str(agent_model_dir()), sandbox_url=sandbox_url, max_model_len=512,
            max_turns=1, max_tokens_per_turn=1, assistant_prefill="<tool>submit</tool>",
        ),
        eval=EvalConfig(**{"split": f"dir:{tmp}/tasks", "samples": 2, "concurrency": 3, **eval_fields}),
    )


def write_config(cfg: RollwayConfig, tmp: Path) -> Path:
    path = tmp / "rollway.toml"
    path.write_bytes(msgspec.toml.encode(cfg))
    return path


async def rollway(config: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the real CLI as a process (this loop keeps serving the sandbox meanwhile)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollway.cli", "--config", str(config), *args, cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=240)
    return proc.returncode, out.decode(), err.decode()


class Weights:
    """Versions of the base model's weights published to the store (and announced on
    rollway.weights when there is a producer), each with a small change."""

    def __init__(self, cfg: RollwayConfig, producer: EventProducer | None = None) -> None:
        self.cfg = cfg
        self.producer = producer

    async def __aenter__(self) -> "Weights":
        from safetensors.torch import load_file

        from syncer.publisher import WeightPublisher
        from syncer.store import open_store

        self.state = load_file(str(agent_model_dir() / "model.safetensors"))
        self.store = open_store(self.cfg.syncer.store_url, self.cfg.syncer)
        await self.store.start()
        self.publisher = WeightPublisher(self.cfg.syncer, MODEL, self.store, self.producer)
        return self

    async def __aexit__(self, *exc) -> None:
        self.publisher.close()
        await self.store.close()

    async def publish(self, *versions: int) -> None:
        for v in versions:
            self.state = {**self.state, "model.norm.weight": self.state["model.norm.weight"] * 1.0078125}
            await self.publisher.publish(v, self.state, trainer_step=v)


@pytest_asyncio.fixture(loop_scope="session")
async def stack(kafka_config: KafkaConfig, tmp_path: Path):
    """The sandbox service (grader publishing rewards to Kafka, as in training) knowing
    none of the eval tasks, and a task folder with them."""
    for spec in TASKS:
        write_task_dir(tmp_path / "tasks", spec)
    (tmp_path / "train_tasks").mkdir()
    async with EventProducer(kafka_config) as producer:
        sandbox_cfg = SandboxConfig(tasks_dir=str(tmp_path / "train_tasks"), workspace_root=str(tmp_path / "ws"))
        async with live_sandbox(sandbox_cfg, publisher=producer) as sb:
            yield sb, producer


def expected_result(version: int, evaluator: str, samples: int = 2) -> dict:
    return {
        "split": "", "weight_version": version, "model": MODEL, "tasks": 3, "samples": samples,
        "pass_at_1": 2 / 3, "mean_reward": 2 / 3, "mean_generated_tokens": 1.0, "cheated": 0,
        "per_kind": {"arith": 0.5, "text": 1.0}, "evaluator": evaluator,
        "errors": 0, "temperature": 1.0, "seed": 0,
    }


def strip_timing(result: dict) -> dict:
    assert result.pop("seconds") > 0 and result.pop("created_at") > 0
    return result


async def assert_nothing_trainable(kafka: KafkaConfig) -> None:
    """No eval trajectory and no eval reward ever reaches the trainer's (or feeder's) input."""
    assert await read_all(kafka, "trajectories") == []
    assert await read_all(kafka, "rewards") == []


def table_rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.count("│") >= 2]


async def test_eval_cli_publishes_the_result_and_nothing_trainable(stack, kafka_config, tmp_path):
    sb, _ = stack
    cfg = stack_config(kafka_config, tmp_path, sb.url)
    config = write_config(cfg, tmp_path)
    async with Weights(cfg) as weights:
        await weights.publish(1, 2)
    code, out, err = await rollway(config, "eval", "--tasks", str(tmp_path / "tasks"), "--version", "latest", "--json")
    assert code == 0, err
    doc = msgspec.json.decode(out)
    split = f"dir:{tmp_path}/tasks"
    assert list(doc) == ["result", "record", "tasks"]
    assert strip_timing(dict(doc["result"])) == {**expected_result(2, "cli"), "split": split}
    assert doc["tasks"] == [
        {"task_id": t.task_id, "kind": t.metadata["kind"], "samples": 2, "solved": 2 * SOLVED[t.task_id],
         "pass_at_1": float(SOLVED[t.task_id]), "rewards": [float(SOLVED[t.task_id])] * 2,
         "generated_tokens": [1, 1], "cheated": 0, "errors": 0}
        for t in sorted(TASKS, key=lambda t: t.task_id)
    ]
    events = [e for e in await read_all(kafka_config, "evals") if isinstance(e, EvalResult)]
    assert [msgspec.to_builtins(e) for e in events] == [doc["result"]]
    assert doc["record"] == {"topic": kafka_config.topic_prefix + "evals", "partition": 0, "offset": 0}
    await assert_nothing_trainable(kafka_config)

    # A family split the sandbox resolves by id, shown as a table; --no-publish publishes
    # nothing. Every untouched family repository fails its hidden tests.
    code, out, err = await rollway(config, "eval", "--split", "heldout", "--max-tasks", "4", "--version", "0",
                                   "--samples", "1", "--no-publish")
    assert code == 0, err
    assert out.splitlines()[0].startswith(f"family:heldout: {MODEL} v0, 4 tasks x 1 samples, temperature 1, ")
    assert table_rows(out) == [["arith", "1", "0.000"], ["fix", "1", "0.000"], ["lists", "1", "0.000"],
                               ["text", "1", "0.000"], ["all", "4", "0.000"]], out
    assert "mean reward 0.0000   mean generated tokens 1.0   cheated 0   errors 0" in out
    assert "published" not in out
    assert len([e for e in await read_all(kafka_config, "evals") if isinstance(e, EvalResult)]) == 1
    await assert_nothing_trainable(kafka_config)

    # Control: the same sandbox does publish the reward of an ordinary (training) submit,
    # so the empty topics above are the eval path's doing. (add_ok: registered by the eval.)
    async with SandboxClient(sb.url) as client:
        session = await client.create_session("add_ok")
        await client.submit(session, trajectory_id="control", task_id="add_ok")
    assert [r.trajectory_id for r in await read_all(kafka_config, "rewards")] == ["control"]


async def test_evaluator_follows_weights_and_evaluates_every_n_versions(stack, kafka_config, tmp_path):
    sb, producer = stack
    cfg = stack_config(kafka_config, tmp_path, sb.url, samples=1, every_n_versions=2, heartbeat_interval_s=0.5)
    config = write_config(cfg, tmp_path)

    def versions(events) -> list[int]:
        return sorted(e.weight_version for e in events if isinstance(e, EvalResult))

    async def start() -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollway.cli", "--config", str(config), "evaluator", "--replica-id", "ev-1",
            cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            stdout=asyncio.subprocess.DEVNULL, stderr=(tmp_path / "evaluator.log").open("ab"),
        )

    async def stop(proc) -> None:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), timeout=60)
        assert code == 0, (tmp_path / "evaluator.log").read_text(errors="replace")[-3000:]

    proc = await start()
    try:
        async with Weights(cfg, producer) as weights:
            # The base model first; then of versions 1..5 only 2 and 4 are due.
            await read_until(kafka_config, "evals", lambda evs: versions(evs) == [0], timeout_s=120)
            await weights.publish(1, 2)
            await read_until(kafka_config, "evals", lambda evs: versions(evs) == [0, 2], timeout_s=60)
            await weights.publish(3, 4, 5)
            events = await read_until(kafka_config, "evals", lambda evs: versions(evs) == [0, 2, 4], timeout_s=60)
    finally:
        await stop(proc)
    split = f"dir:{tmp_path}/tasks"
    for event, version in zip(sorted(events, key=lambda e: e.weight_version), [0, 2, 4]):
        assert strip_timing(msgspec.to_builtins(event)) == {**expected_result(version, "ev-1", samples=1), "split": split}
    beats = [e for e in await read_all(kafka_config, "health") if isinstance(e, Heartbeat) and e.role == "evaluator"]
    assert beats[-1].status == "stopped" and beats[-1].weight_version == 4 and beats[-1].replica_id == "ev-1"
    assert "evaluating" in {b.status for b in beats}
    await assert_nothing_trainable(kafka_config)

    # Restarted, it finds 0, 2 and 4 in the evals log and its group's offsets past 5:
    # it goes straight to waiting and evaluates nothing again.
    proc = await start()
    try:
        await read_until(kafka_config, "health", lambda evs: any(
            isinstance(e, Heartbeat) and e.pid == proc.pid and e.status == "waiting" for e in evs), timeout_s=120)
    finally:
        await stop(proc)
    again = [e for e in await read_all(kafka_config, "evals") if isinstance(e, EvalResult)]
    assert versions(again) == [0, 2, 4]
    beats = [e for e in await read_all(kafka_config, "health") if isinstance(e, Heartbeat) and e.pid == proc.pid]
    assert "evaluating" not in {b.status for b in beats} and beats[-1].status == "stopped"


async def test_bad_input_is_one_clear_line_and_a_nonzero_exit(kafka_config, tmp_path):
    """Each case fails before any model is loaded; the sandbox and Kafka serve on."""
    from rollway.broker import free_ports

    write_task_dir(tmp_path / "tasks", TASKS[2])
    write_task_dir(tmp_path / "clash", TASKS[0])
    # The sandbox knows a task "add_ok" with other hidden tests: a registration must not change it.
    write_task_dir(tmp_path / "sandbox_tasks", msgspec.structs.replace(TASKS[0], hidden_tests=UPPER_TEST))
    closed_port = free_ports(1)[0]
    sandbox_cfg = SandboxConfig(tasks_dir=str(tmp_path / "sandbox_tasks"), workspace_root=str(tmp_path / "ws"))
    async with live_sandbox(sandbox_cfg) as sb:
        cfg = stack_config(kafka_config, tmp_path, sb.url)
        config = write_config(cfg, tmp_path)
        tasks = ("--tasks", str(tmp_path / "tasks"))
        no_kafka = {"KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{closed_port}"}
        cases = [
            (("eval", "--split", "nope"), {},
             "rollway eval: cannot load the tasks of 'nope': unknown split 'nope'; valid splits: train, heldout"),
            (("eval", "--split", "swe:heldout"), {},
             "rollway eval: unknown task family 'swe' in split 'swe:heldout' (use family:train, family:heldout "
             "or --tasks DIR)"),
            (("eval", "--tasks", str(tmp_path / "absent")), {},
             f"rollway eval: cannot load the tasks of 'dir:{tmp_path}/absent': tasks folder {tmp_path}/absent "
             "does not exist"),
            (("eval", *tasks, "--model", str(tmp_path / "no-model")), {},
             f"rollway eval: no model at {tmp_path}/no-model (set sampler.model_path or --model; "
             "`rollway model` builds one)"),
            (("eval", *tasks, "--version", "7"), {},
             f"rollway eval: {MODEL} v7 is not in file://{tmp_path}/weights; the store is empty"),
            (("eval", *tasks, "--version", "seven"), {},
             "rollway eval: --version must be a version number >= 0 or 'latest', not 'seven'"),
            (("eval", *tasks, "--samples", "0"), {}, "rollway eval: eval.samples must be at least 1, got 0"),
            (("eval", *tasks, "--sandbox-url", f"http://127.0.0.1:{closed_port}"), {},
             f"rollway eval: no sandbox service at http://127.0.0.1:{closed_port}: "),
            (("eval", "--tasks", str(tmp_path / "clash")), {},
             f"rollway eval: the sandbox at {sb.url} refused task 'add_ok': task 'add_ok' is already known with "
             "other files or hidden tests"),
            # Every CLI tool's line for a missing broker (bus.connect), exit 1.
            (("eval", *tasks), no_kafka,
             f"cannot reach Kafka at 127.0.0.1:{closed_port} — start one with rollway broker start or set "
             "KAFKA_BOOTSTRAP_SERVERS"),
            (("evaluator", "--split", "family:nope"), {},
             "rollway evaluator: cannot load the tasks of 'family:nope': unknown split 'nope'; valid splits: "
             "train, heldout"),
        ]
        runs = await asyncio.gather(*(rollway(config, *args, env=env) for args, env, _ in cases))
        for (args, env, message), (code, out, err) in zip(cases, runs):
            assert code == (1 if env is no_kafka else 2), (args, out, err)
            assert out == "", (args, out)
            assert len(err.splitlines()) == 1 and err.startswith(message), (args, err)
        assert sb.service.store.get("add_ok").hidden_tests == UPPER_TEST
        async with SandboxClient(sb.url) as client:  # no session left open by the failed runs
            assert (await client.health())["sessions"] == 0
    assert await read_all(kafka_config, "evals") == []
