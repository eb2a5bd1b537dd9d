"""Who may write what (#32), on a real broker with SASL/SCRAM and the ACL authorizer.

One secured broker for the module (the rest of the suite runs on the open one): the
table of bus/acl.py is applied for a unique topic prefix, and every role's operations
in it are done with that role's credentials, while a forbidden one is refused by the
broker. Components started with wrong credentials or without an ACL exit at once with
one line naming the principal, the resource and the operation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from aiokafka import TopicPartition
from aiokafka.errors import TopicAuthorizationFailedError

from bus import EventProducer, ensure_topics
from bus.consumer import envelope_of
from bus.reader import read_topic_records
from bus.acl import AclNames, apply, default_users, preflight, rules, show
from bus.clients import new_consumer
from bus.config import KafkaConfig
from bus.connect import start_client, stop_consumer
from bus.security import KAFKA_ROLES, NotAuthorized, load_credentials
from rollway.broker import LocalKafka
from schemas import Reward, now
from tests.conftest import TEST_PARTITIONS, unique

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parent.parent
PROBE = b"acl-probe"


class Secured(msgspec.Struct):
    bootstrap: str
    credentials_file: str
    names: AclNames

    def cfg(self, role: str, **overrides) -> KafkaConfig:
        return KafkaConfig(bootstrap_servers=self.bootstrap, credentials_file=self.credentials_file, role=role,
                           topic_prefix=self.names.prefix, partitions=dict(TEST_PARTITIONS),
                           client_id=f"test-{role}", request_timeout_ms=10_000, **overrides)


@pytest.fixture(scope="module")
def secured_broker(tmp_path_factory: pytest.TempPathFactory):
    kafka = LocalKafka(tmp_path_factory.mktemp("kafka-secure"), nodes=1, heap="384m", secure=True)
    try:
        yield kafka.start(timeout=120), kafka.state.credentials_file
    finally:
        kafka.stop()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def secured(secured_broker) -> Secured:
    bootstrap, credentials_file = secured_broker
    prefix = f"{unique('acl-')}."
    names = AclNames(prefix=prefix, trainer_group=f"{prefix}trainer", trainer_transactional_id=f"{prefix}trainer-tx",
                     sampler_group=f"{prefix}samplers", evaluator_group=f"{prefix}evaluator",
                     analytics_group_prefix=f"{prefix}analytics")
    sec = Secured(bootstrap, credentials_file, names)
    await ensure_topics(sec.cfg("admin"))
    apply(sec.cfg("admin"), names, load_credentials(credentials_file))
    return sec


def test_credentials_file_is_the_owners_only(secured):
    assert os.stat(secured.credentials_file).st_mode & 0o777 == 0o600
    creds = load_credentials(secured.credentials_file)
    assert set(KAFKA_ROLES) <= set(creds.kafka) and set(creds.sandbox) == {"admin", "sampler", "evaluator"}
    assert "password" not in repr(creds) and creds.kafka["sampler"].password not in repr(creds)


def test_apply_is_idempotent_and_show_reads_the_table_back(secured):
    admin = secured.cfg("admin")
    users, new = apply(admin, secured.names, load_credentials(secured.credentials_file))
    assert users == [] and new == []
    held = set(show(admin))
    assert set(rules(secured.names, default_users())) <= held


async def _write(cfg: KafkaConfig, topic: str, transactional_id: str | None = None) -> None:
    async with EventProducer(cfg, transactional_id=transactional_id) as producer:
        await producer.publish_raw(topic, PROBE, key=b"k")


async def _read(cfg: KafkaConfig, topic: str, group: str | None = None) -> None:
    consumer = new_consumer(cfg, f"{cfg.client_id}-probe", group_id=group, enable_auto_commit=False,
                            auto_offset_reset="earliest")
    if group:
        consumer.subscribe([topic])
    await start_client(consumer, cfg.bootstrap_servers)
    try:
        if group is None:
            parts = [TopicPartition(topic, p) for p in range(cfg.partitions.get(topic[len(cfg.topic_prefix):], 1))]
            consumer.assign(parts)
            await consumer.seek_to_beginning()
        await consumer.getmany(timeout_ms=300)
        if group:
            await consumer.commit()
    finally:
        await stop_consumer(consumer)


def _topic(sec: Secured, short: str) -> str:
    return sec.names.prefix + short


# A write the table does not give each role (the broker must refuse it).
FORBIDDEN_WRITE = {"trainer": "rewards", "sampler": "rewards", "grader": "trajectories", "feeder": "rewards",
                   "evaluator": "weights"}


@pytest.mark.parametrize("role", [r for r in KAFKA_ROLES if r != "admin"])
async def test_each_role_may_do_its_table_rows_and_nothing_else(secured, role):
    cfg = secured.cfg(role)
    preflight(cfg, secured.names)  # the start-up check agrees with the broker
    table = rules(secured.names, {role: f"rollway-{role}"}, [role])
    readable = [r.name for r in table if r.resource == "topic" and r.operation == "READ" and r.pattern == "LITERAL"]
    if any(r.resource == "topic" and r.operation == "READ" and r.pattern == "PREFIXED" for r in table):
        readable.append(_topic(secured, "rewards"))
    for rule in table:
        if rule.resource == "topic" and rule.operation == "WRITE":
            await _write(cfg, rule.name)
        elif rule.resource == "topic" and rule.operation == "READ" and rule.pattern == "LITERAL":
            await _read(cfg, rule.name)
        elif rule.resource == "group":
            group = rule.name + ("-app" if rule.pattern == "PREFIXED" else "")
            await _read(cfg, readable[0], group=group)
        elif rule.resource == "transactional_id" and rule.operation == "WRITE":
            # The trainer's step: a record and its group's consumed offsets in one transaction.
            steps = _topic(secured, "train-steps")
            async with EventProducer(cfg, transactional_id=rule.name) as producer:
                async with producer.transaction():
                    await producer.publish_raw(steps, PROBE, key=b"k")
                    await producer.send_offsets({TopicPartition(_topic(secured, "rewards"), 0): 0},
                                                secured.names.trainer_group)
    if role == "analytics":  # may write nothing: even an idempotent producer is refused at start
        for short in ("rewards", "train-steps", "weights", "tasks"):
            with pytest.raises(NotAuthorized, match="principal User:rollway-analytics may not use this cluster-wide"):
                await _write(cfg, _topic(secured, short))
    else:
        with pytest.raises(TopicAuthorizationFailedError):
            await _write(cfg, _topic(secured, FORBIDDEN_WRITE[role]))


async def test_sampler_cannot_write_what_only_the_trainer_and_grader_write(secured):
    sampler = secured.cfg("sampler")
    for short in ("rewards", "train-steps", "weights", "evals"):
        with pytest.raises(TopicAuthorizationFailedError):
            await _write(sampler, _topic(secured, short))
    with pytest.raises(NotAuthorized, match=f"User:rollway-sampler may not READ group {secured.names.trainer_group};"):
        await _read(sampler, _topic(secured, "tasks"), group=secured.names.trainer_group)
    with pytest.raises(NotAuthorized, match="WRITE transactional_id .*trainer-tx"):
        await _write(sampler, _topic(secured, "trajectories"), transactional_id=secured.names.trainer_transactional_id)
    with pytest.raises(TopicAuthorizationFailedError):
        await _read(sampler, _topic(secured, "rewards"))  # nor read the rewards


async def test_a_forged_reward_never_reaches_the_trainer(secured):
    forged = Reward(trajectory_id="forged", task_id="t", group_id="t/g", sample_index=0, attempt="a0", score=1.0,
                    reward=1.0, created_at=now())
    async with EventProducer(secured.cfg("sampler")) as sampler:
        with pytest.raises(TopicAuthorizationFailedError):
            await sampler.publish(forged)
    real = msgspec.structs.replace(forged, trajectory_id="graded", score=0.0)
    async with EventProducer(secured.cfg("grader")) as grader:
        await grader.publish(real)
    records = await read_topic_records(secured.cfg("trainer"), _topic(secured, "rewards"))
    seen = [envelope_of(r).event for r in records if r.value != PROBE]  # not the probes of the role test
    assert [r.trajectory_id for r in seen] == ["graded"]


def _rollway(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollway.cli", "--config", "/dev/null", *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


def test_components_without_credentials_or_acls_fail_at_start_with_one_line(secured):
    creds = load_credentials(secured.credentials_file)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLWAY_", "KAFKA_"))}
    base.update(KAFKA_BOOTSTRAP_SERVERS=secured.bootstrap, ROLLWAY_KAFKA__TOPIC_PREFIX=secured.names.prefix,
                ROLLWAY_KAFKA__SASL_USERNAME=creds.kafka["sampler"].username)
    wrong = _rollway("feeder", env=dict(base, ROLLWAY_KAFKA__SASL_PASSWORD="not-the-password"))
    assert wrong.returncode == 3, wrong.stderr
    assert wrong.stderr.splitlines() == [wrong.stderr.strip()]
    assert "principal User:rollway-sampler" in wrong.stderr and "could not authenticate" in wrong.stderr
    assert "not-the-password" not in wrong.stderr
    # The sampler's own user, running as the feeder: the broker has no WRITE on tasks for it.
    missing = _rollway("feeder", env=dict(base, ROLLWAY_KAFKA__SASL_PASSWORD=creds.kafka["sampler"].password))
    assert missing.returncode == 3, missing.stderr
    assert missing.stderr.strip() == (
        f"kafka: principal User:rollway-sampler (role feeder) may not READ topic {secured.names.prefix}rewards; "
        "run rollway acl apply as admin, or check kafka.role and the credentials")


async def test_a_restarted_trainer_dead_letters_a_foreign_step_log_record_once_under_its_acls(secured):
    # Found by the chaos run with ACLs: the trainer re-reads the dead letters at start so
    # a foreign record on its step log is dead-lettered once across restarts; without
    # READ on the dlq it stopped with "may not READ topic ...dlq".
    from schemas import DeadLetter
    from trainer.steplog import read_step_log

    steps = _topic(secured, "train-steps")
    async with EventProducer(secured.cfg("admin")) as admin:
        await admin.publish_raw(steps, b"not a train step", key=b"foreign")
    trainer = secured.cfg("trainer")
    for _ in range(2):  # two starts: one letter
        await read_step_log(trainer, dead_letter=True)
    letters = [envelope_of(r).event for r in await read_topic_records(secured.cfg("admin"), _topic(secured, "dlq"))
               if r.value != PROBE]
    # (The role test's probes on the step log are foreign too, and dead-lettered alike.)
    assert [(type(x), x.topic) for x in letters if x.value == b"not a train step"] == [(DeadLetter, steps)]
