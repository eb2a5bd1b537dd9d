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
from tests.waiting import wait_until_async
from trainer.audit import GroupEnd, audit_groups, format_audit
from trainer.publishing import RecordingSink
from trainer.service import Trainer
from trainer.steplog import StepLogError, group_ends, read_step_log

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


async def test_drops_are_logged_when_held_too_many_and_when_the_trainer_stops(kafka_config, tiny_model_path,
                                                                             tmp_path, sampled):
    # Review finding (issue 13): a drop waited for the next step's TrainStep.dropped.
    # A trainer that cannot step held drops (and their records) without bound, and
    # those held when it stopped were never logged: `rollway audit` of a cleanly
    # stopped run showed them unaccounted. Now: more than held_drops_max are logged at
    # once in a GroupsDropped entry, and a clean stop logs the rest.
    trainable, *zero = sampled[:4]
    async with EventProducer(kafka_config) as producer:
        for i in range(4):
            await producer.publish(task(i))
    cfg = RollwayConfig(kafka=kafka_config, trainer=trainer_config(tmp_path, tiny_model_path, max_staleness=4,
                                                                   held_drops_max=2, held_drops_max_s=3600.0))
    trainer = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    run = asyncio.create_task(trainer.run())
    await publish_trajectories(kafka_config, trainable)
    await wait_for_steps(kafka_config, 1, run)
    await publish_trajectories(kafka_config, zero[0] + zero[1], score=1.0)  # equal rewards: dropped

    async def logged_drops(n: int):
        drops = (await read_step_log(kafka_config)).drops
        return drops if len(drops) >= n else None

    # Two held: logged at once, while the trainer runs on (it cannot step).
    held = await wait_until_async(lambda: logged_drops(2), 120, "two drops logged without a step", task=run,
                                  poll_s=0.3)
    assert sorted(held, key=lambda d: d[1].task_id) == [(1, GroupDrop("task-1", "g1", "zero_variance")),
                                                        (1, GroupDrop("task-2", "g2", "zero_variance"))]
    await publish_trajectories(kafka_config, zero[2], score=1.0)
    await wait_until_async(lambda: trainer.assembler.counters["groups_dropped_zero_variance"] == 3, 120,
                           "the third drop", task=run, poll_s=0.2)
    trainer.stop()  # what SIGTERM does
    assert await asyncio.wait_for(run, 120) == 1

    steps = await read_step_log(kafka_config)
    assert list(steps) == [1] and steps[1].event.dropped == []
    assert steps.drops[2:] == [(1, GroupDrop("task-3", "g3", "zero_variance"))]
    result = await audit_groups(kafka_config)
    assert (result.issued, result.trained, result.dropped) == (4, 1, {"zero_variance": 3})
    assert result.unaccounted == [] and result.ended_twice == [] and result.ok

    # Their records were acknowledged with the entries: a restarted trainer reads none again.
    restarted = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    assert await asyncio.wait_for(restarted.run(exit_when_idle_s=1.0), 120) == 1
    assert restarted.assembler is not None
    counters = restarted.assembler.counters
    assert counters["dropped_late"] == 0 and counters["records_already_done"] == 0
    assert restarted.assembler.closed[("task-3", "g3")] == "zero_variance"
    assert (await read_step_log(kafka_config)).drops == steps.drops


async def test_a_step_logged_twice_with_other_contents_is_an_error_naming_both_entries(kafka_config):
    # Review finding (issue 13): read_step_log kept the first of two entries of a step
    # and only warned, so the trainer, replay and the audit went on over a log holding
    # two histories (an audit could not see the second one's groups). Now readers stop
    # with StepLogError naming both entries; `rollway audit` exits 2 with it. The same
    # bytes twice (a retried publish) are one step.
    async with EventProducer(kafka_config) as producer:
        one = TrainStep(step=1, weight_version=1, weights_hash="ab" * 32, groups=[GroupRef("task-0", "g0")])
        first = await producer.publish(one)
        value, headers = codec.encode(one)
        await producer.publish_raw(first.topic, value, key=b"trainer", headers=headers)
    steps = await read_step_log(kafka_config)
    assert list(steps) == [1] and steps[1].ref == first
    async with EventProducer(kafka_config) as producer:
        other = await producer.publish(TrainStep(step=1, weight_version=1, weights_hash="cd" * 32,
                                                 groups=[GroupRef("task-1", "g1")]))
    where = f"{first.topic}:0@{first.offset} and {first.topic}:0@{other.offset}"
    with pytest.raises(StepLogError, match=f"step 1 is logged twice with different contents, at {where}"):
        await read_step_log(kafka_config)
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=kafka_config.bootstrap_servers,
               ROLLWAY_KAFKA__TOPIC_PREFIX=kafka_config.topic_prefix, ROLLWAY_CONFIG="/dev/null")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollway.cli", "audit", env=env, cwd=Path(__file__).resolve().parents[1],
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2 and out == b""
    assert f"step 1 is logged twice with different contents, at {where}" in err.decode()
