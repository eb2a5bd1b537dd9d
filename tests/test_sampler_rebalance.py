"""Two sampler replicas and a rebalance while groups are in flight, on a real broker: no
group is sampled to completion twice (the fmt-qwen3 run sampled 3 of 148 groups twice
after its start-up rebalance), none is lost, and the group of the partition that stays
with its replica (sticky assignment) is not cancelled. The timing engine and timing
sandbox stand in for the model and the sandbox; the engine's steps wait until the test
lets them go, so replica A's groups are mid-rollout when replica B joins."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from bus import EventProducer, encode
from bus.reader import read_topic
from sampler.config import SamplerConfig, TimingConfig
from sampler.service import SamplerService
from sampler.timing_engine import TimingEngine
from sampler.tiny_model import tiny_model_dir
from sandbox.timing import TimingSandbox, TimingSandboxConfig
from schemas import Reward, Task, TrajectoryChunk
from syncer.config import SyncerConfig
from tests.waiting import wait_until_async

pytestmark = [pytest.mark.kafka]

GROUP_SIZE = 2
TASKS = 5  # t0, t2, t4 on partition 0; t1, t3 on partition 1


async def no_wait(_seconds: float) -> None:
    await asyncio.sleep(0)


def complete_attempts(chunks: list[TrajectoryChunk]) -> dict[str, set[str]]:
    """group_id -> the attempts whose every sample has its final chunk."""
    finals: dict[tuple[str, str], set[int]] = defaultdict(set)
    for c in chunks:
        if c.final:
            finals[(c.group_id, c.attempt)].add(c.sample_index)
    out: dict[str, set[str]] = defaultdict(set)
    for (group, attempt), samples in finals.items():
        if samples == set(range(GROUP_SIZE)):
            out[group].add(attempt)
    return out


def track(service: SamplerService, name: str, starts: dict, cancels: dict) -> None:
    """Record the groups the replica's task handler starts and those cancelled in it."""
    handle = service._handle

    async def tracked(env) -> None:
        starts[name].append(env.event.group_id)
        try:
            await handle(env)
        except asyncio.CancelledError:
            cancels[name].append(env.event.group_id)
            raise

    service._handle = tracked


async def test_groups_in_flight_at_a_rebalance_are_sampled_to_completion_once(kafka_config):
    release = asyncio.Event()

    async def gated(_seconds: float) -> None:  # the engine's steps wait for the test
        await release.wait()

    scfg = SamplerConfig(engine="timing", model_path=str(tiny_model_dir()), group_id=f"{kafka_config.topic_prefix}s",
                         max_tasks_in_flight=2, max_in_flight=4, max_turns=1, follow_weights=False,
                         timing=TimingConfig(median_tokens=8, length_sigma=0.0, submit_probability=1.0))
    # t0 and t1 (partitions 0 and 1) start on A alone; t2 and t3 come after, and one of
    # them is fetched and waits for a task slot when B joins.
    partition_of = {f"t{i}/g": i % 2 for i in range(TASKS)}
    groups = sorted(partition_of)
    starts: dict[str, list[str]] = defaultdict(list)
    cancels: dict[str, list[str]] = defaultdict(list)

    async def publish(producer, tasks) -> None:
        for i in tasks:
            value, headers = encode(Task(task_id=f"t{i}", group_id=f"t{i}/g", group_size=GROUP_SIZE, instruction="x"))
            await producer.publish_raw(kafka_config.topic_prefix + "tasks", value, headers=headers,
                                       partition=i % 2)

    async with EventProducer(kafka_config) as producer:
        await publish(producer, (0, 1))
        replicas = {}
        for name, rid in (("a", "r1"), ("b", "r2")):
            engine = await TimingEngine(scfg.model_path, scfg.timing, sleep=gated).start()
            replicas[name] = SamplerService(scfg, engine, kafka=kafka_config, syncer=SyncerConfig(), model_name="m",
                                            replica_id=rid, sandbox=TimingSandbox(TimingSandboxConfig(), producer,
                                                                                  sleep=no_wait))
            track(replicas[name], name, starts, cancels)
        a, b = replicas["a"], replicas["b"]
        runs = {"a": asyncio.create_task(a.run(install_signals=False))}
        try:
            await wait_until_async(lambda: a.in_flight == 2 * GROUP_SIZE, 60, "A with t0 and t1 in flight",
                                   task=runs["a"])
            await publish(producer, range(2, TASKS))
            await wait_until_async(lambda: a._consumer.in_flight() == 3, 60, "a third task waiting on A",
                                   task=runs["a"])
            runs["b"] = asyncio.create_task(b.run(install_signals=False))
            await wait_until_async(lambda: b.status == "serving" and len(a._consumer.raw.assignment()) == 1
                                   and len(b._consumer.raw.assignment()) == 1, 60, "one partition each",
                                   task=runs["b"])
            (stay,) = {tp.partition for tp in a._consumer.raw.assignment()}
            kept, moved = (("t0/g", "t1/g") if stay == 0 else ("t1/g", "t0/g"))
            # A cancels the moved partition's group once it has its new assignment.
            await wait_until_async(lambda: moved in cancels["a"], 30, "A to cancel the moved group",
                                   task=runs["a"])
            release.set()

            async def all_complete() -> bool:
                chunks = [e.event for e in await read_topic(kafka_config, "trajectories")]
                return set(groups) <= set(complete_attempts(chunks))

            await wait_until_async(all_complete, 120, "every group complete")
            await wait_until_async(lambda: a.tasks_done + b.tasks_done >= TASKS and a.in_flight == 0
                                   and b.in_flight == 0 and a._consumer.in_flight() == 0
                                   and b._consumer.in_flight() == 0, 60, "nothing left in flight")
        finally:
            release.set()
            for service in (a, b):
                service.request_stop()
            await asyncio.wait_for(asyncio.gather(*runs.values()), 60)
    chunks = [e.event for e in await read_topic(kafka_config, "trajectories") if isinstance(e.event, TrajectoryChunk)]
    rewards = [e.event for e in await read_topic(kafka_config, "rewards") if isinstance(e.event, Reward)]
    complete = complete_attempts(chunks)
    # Once each: one complete attempt per group, graded once per sample.
    assert {g: len(attempts) for g, attempts in complete.items()} == {g: 1 for g in groups}
    graded = defaultdict(set)
    for r in rewards:
        graded[(r.group_id, r.attempt)].add(r.sample_index)
    assert {(g, a, frozenset(s)) for (g, a), s in graded.items()} == \
        {(g, next(iter(complete[g])), frozenset(range(GROUP_SIZE))) for g in groups}
    # The group of the partition that stayed with A went on through the rebalance: started
    # once, never cancelled. Only the moved partition's group was cancelled on A (no
    # sample of it finished there) and B sampled it; every group by its partition's owner.
    assert cancels == {"a": [moved]}
    owner = {stay: a, 1 - stay: b}
    assert sorted(starts["a"]) == sorted([moved] + [g for g in groups if partition_of[g] == stay])
    assert sorted(starts["b"]) == sorted(g for g in groups if partition_of[g] != stay)
    assert {c.attempt for c in chunks if c.final} == {att for attempts in complete.values() for att in attempts}
    assert all(next(iter(complete[g])).startswith(owner[partition_of[g]].replica_id + "-") for g in groups)
    assert kept in starts["a"] and starts["a"].count(kept) == 1
    assert a.tasks_done + b.tasks_done == TASKS
