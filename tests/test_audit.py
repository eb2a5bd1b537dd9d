"""Group accounting from the log alone (issue 13): the step log records every group's
end (``TrainStep.groups`` trained, ``TrainStep.dropped`` dropped with a reason), an
abandoned group stays dropped across a restart when a late retry arrives, and
``rollway audit`` (``trainer.audit.audit_groups``) compares what the feeder issued
with those ends. Against a real broker."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from bus import EventProducer, codec
from rollway.config import RollwayConfig
from schemas import DeadLetter, GroupDrop, GroupRef, RecordRef, Task, TrainedTrajectory, TrainStep
from tests.synthetic import load_tiny, make_task_groups, to_events
from tests.test_trainer_kafka import trainer_config, wait_for_steps
from tests.trainer_helpers import one_thread, publish_trajectories  # noqa: F401  one_thread: autouse fixture
from trainer.audit import GroupEnd, audit_groups, format_audit
from trainer.publishing import RecordingSink
from trainer.service import Trainer
from trainer.steplog import group_ends, read_step_log

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def sampled(tiny_model_path):
    model, tok = load_tiny(str(tiny_model_path))
    return make_task_groups(model, tok, 6, group_size=4, max_new_tokens=8, env_after=3, seed=11)


def task(i: int) -> Task:
    return Task(task_id=f"task-{i}", group_id=f"g{i}", group_size=4, instruction=f"fix f{i}")


def fresh(group, version: int, attempt: str | None = None):
    n = len(group[0].token_ids)
    return [dataclasses.replace(t, versions=[version] * n, **({"attempt": attempt} if attempt else {}))
            for t in group]


async def test_every_issued_group_ends_once_in_the_log_and_the_audit_says_so(kafka_config, tiny_model_path,
                                                                               tmp_path, sampled):
    a, b, zero, abandoned, c, d = sampled
    prefix = kafka_config.topic_prefix
    async with EventProducer(kafka_config) as producer:
        # The feeder's view: 8 groups issued. task-6 is never sampled (in flight for
        # ever); task-7's Task was dead-lettered by a sampler; one garbage record.
        for i in range(8):
            await producer.publish(task(i))
        value, headers = codec.encode(task(7))
        await producer.publish(DeadLetter(topic=prefix + "tasks", partition=0, offset=7, value=value,
                                          headers=headers, error="sandbox down", error_kind="handler"))
        await producer.publish_raw(prefix + "tasks", b"\xffgarbage", key=b"x")

    cfg = RollwayConfig(kafka=kafka_config, trainer=trainer_config(tmp_path, tiny_model_path, max_staleness=1))
    run = asyncio.create_task(Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink()).run(max_steps=3))
    await publish_trajectories(kafka_config, a + b)
    await publish_trajectories(kafka_config, zero, score=1.0)  # equal rewards: dropped
    # A sampler died after the first chunk of task-3: it goes stale at version 2 with
    # nothing else of the group held (abandoned).
    chunks, _ = to_events(abandoned[0], chunk_tokens=8)
    async with EventProducer(kafka_config) as producer:
        await producer.publish(chunks[0])
    await wait_for_steps(kafka_config, 2, run)
    await publish_trajectories(kafka_config, fresh(c, 2))
    assert await asyncio.wait_for(run, 120) == 3

    steps = await read_step_log(kafka_config)
    drops = [d for s in (1, 2, 3) for d in steps[s].event.dropped]
    assert sorted(drops, key=lambda d: d.task_id) == [GroupDrop("task-2", "g2", "zero_variance"),
                                                      GroupDrop("task-3", "g3", "abandoned")]
    assert GroupDrop("task-3", "g3", "abandoned") in steps[3].event.dropped  # decided at version 2

    # Restart; a retry of the abandoned group arrives (fresh, complete, trainable on its
    # own) before another group. Its end is final: it is late, the other is trained.
    await publish_trajectories(kafka_config, fresh(abandoned, 3, attempt="a1"))
    await publish_trajectories(kafka_config, fresh(d, 3))
    restarted = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    assert await asyncio.wait_for(restarted.run(max_steps=4), 120) == 4
    steps = await read_step_log(kafka_config)
    assert steps[4].event.groups == [GroupRef("task-5", "g5")] and steps[4].event.dropped == []
    assert steps[4].event.metrics["count_dropped_late"] == 4
    assert restarted.assembler is not None and restarted.assembler.closed[("task-3", "g3")] == "abandoned"

    result = await audit_groups(kafka_config)
    assert result.issued == 8 and result.steps == 4
    assert result.trained == 4
    assert result.dropped == {"abandoned": 1, "zero_variance": 1}
    assert result.dead_lettered == 1
    assert result.unaccounted == [GroupRef("task-6", "g6")]
    assert result.ended_twice == [] and result.not_issued == [] and result.unknown_steps == []
    assert result.undecodable == 1
    assert not result.ok
    text = format_audit(result)
    assert "unaccounted: task-6 g6" in text and "dropped             2 (abandoned 1, zero_variance 1)" in text

    # A second history (e.g. a trainer that was not fenced) trained task-0 again: the
    # audit names the group and both ends. Through the CLI, as JSON, exit 1.
    first = next(s for s in (1, 2) if GroupRef("task-0", "g0") in steps[s].event.groups)
    async with EventProducer(kafka_config) as producer:
        await producer.publish(TrainStep(step=5, weight_version=5, weights_hash="x",
                                         groups=[GroupRef("task-0", "g0")]))
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=kafka_config.bootstrap_servers,
               ROLLWAY_KAFKA__TOPIC_PREFIX=prefix, ROLLWAY_CONFIG="/dev/null")
    root = Path(__file__).resolve().parents[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollway.cli", "audit", "--json", env=env, cwd=root,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 1, err.decode()[-2000:]
    report = json.loads(out)
    assert report["ok"] is False and report["trained"] == 4
    assert report["unaccounted"] == [["task-6", "g6"]]
    assert report["ended_twice"] == [{"group": ["task-0", "g0"], "ends": [{"end": "trained", "step": first},
                                                                         {"end": "trained", "step": 5}]}]
    again = await audit_groups(kafka_config)
    assert again.ended_twice[0].ends == [GroupEnd(end="trained", step=first), GroupEnd(end="trained", step=5)]


async def test_schema1_steps_get_their_group_keys_from_their_reward_records(kafka_config, sampled):
    # A schema-1 entry names trajectories, not groups: the keys come from the reward
    # records it points at. When those are gone, the step's groups are unknown (and
    # the audit is not OK), never guessed.
    chunks, reward = to_events(sampled[0][0])
    async with EventProducer(kafka_config) as producer:
        ref = await producer.publish(reward)
        legacy = TrainStep(step=1, weight_version=1, weights_hash="h", trajectories=[
            TrainedTrajectory(trajectory_id=reward.trajectory_id, chunks=[], reward=ref)])
        await producer.publish(legacy)
        gone = RecordRef(ref.topic, ref.partition, ref.offset + 1000)
        await producer.publish(TrainStep(step=2, weight_version=2, weights_hash="h", trajectories=[
            TrainedTrajectory(trajectory_id="task-9/g9/0/a0", chunks=[], reward=gone)]))
    steps = await read_step_log(kafka_config)
    ends = await group_ends(kafka_config, {1: steps[1]})
    assert ends.trained == [(1, ("task-0", "g0"))] and ends.unknown_steps == []
    ends = await group_ends(kafka_config, steps)
    assert ends.unknown_steps == [1, 2] and ends.trained == []
    result = await audit_groups(kafka_config)
    assert result.unknown_steps == [1, 2] and not result.ok
