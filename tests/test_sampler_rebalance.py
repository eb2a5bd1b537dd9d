"""Two sampler replicas and a rebalance while groups are in flight, on a real broker: no
group is sampled to completion twice (the fmt-qwen3 run sampled 3 of 148 groups twice
after its start-up rebalance) and none is lost. The timing engine and timing sandbox
stand in for the model and the sandbox; the engine's steps wait until the test lets
them go, so replica A's groups are mid-rollout when replica B joins."""

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
TASKS = 5  # all on partition 0


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


@pytest.mark.parametrize("landing", ["a", "b"])
async def test_groups_in_flight_at_a_rebalance_are_sampled_to_completion_once(kafka_config, landing):
    release = asyncio.Event()

    async def gated(_seconds: float) -> None:  # the engine's steps wait for the test
        await release.wait()

    scfg = SamplerConfig(engine="timing", model_path=str(tiny_model_dir()), group_id=f"{kafka_config.topic_prefix}s",
                         max_tasks_in_flight=2, max_in_flight=4, max_turns=1, follow_weights=False,
                         timing=TimingConfig(median_tokens=8, length_sigma=0.0, submit_probability=1.0))
    groups = [f"t{i}/g" for i in range(TASKS)]
    # Replica ids order the members (client id = kafka client id + replica id): the first
    # gets partition 0 after the rebalance.
    a_id, b_id = ("r1", "r2") if landing == "a" else ("r2", "r1")
    async with EventProducer(kafka_config) as producer:
        for i in range(TASKS):
            value, headers = encode(Task(task_id=f"t{i}", group_id=groups[i], group_size=GROUP_SIZE, instruction="x"))
            await producer.publish_raw(kafka_config.topic_prefix + "tasks", value, headers=headers, partition=0)
        replicas = {}
        for name, rid in (("a", a_id), ("b", b_id)):
            engine = await TimingEngine(scfg.model_path, scfg.timing, sleep=gated).start()
            replicas[name] = SamplerService(scfg, engine, kafka=kafka_config, syncer=SyncerConfig(), model_name="m",
                                            replica_id=rid, sandbox=TimingSandbox(TimingSandboxConfig(), producer,
                                                                                  sleep=no_wait))
        a, b = replicas["a"], replicas["b"]
        runs = {"a": asyncio.create_task(a.run(install_signals=False))}
        try:
            # A alone: two groups mid-rollout (p0@0, p0@1), p0@2 fetched and waiting.
            await wait_until_async(lambda: a.in_flight == 2 * GROUP_SIZE and a._consumer.in_flight() == 3, 60,
                                   "A with two groups in flight and a third task waiting", task=runs["a"])
            runs["b"] = asyncio.create_task(b.run(install_signals=False))
            await wait_until_async(lambda: b.status == "serving" and len(a._consumer.raw.assignment()) == 1
                                   and len(b._consumer.raw.assignment()) == 1, 60, "one partition each",
                                   task=runs["b"])
            owner = a if any(tp.partition == 0 for tp in a._consumer.raw.assignment()) else b
            assert owner is (a if landing == "a" else b)
            release.set()

            async def all_complete() -> bool:
                chunks = [e.event for e in await read_topic(kafka_config, "trajectories")]
                return set(groups) <= set(complete_attempts(chunks))

            await wait_until_async(all_complete, 120, "every group complete")
            await wait_until_async(lambda: owner.tasks_done >= TASKS and a.in_flight == 0 and b.in_flight == 0
                                   and a._consumer.in_flight() == 0 and b._consumer.in_flight() == 0, 60,
                                   "nothing left in flight")
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
    # A's two groups of the first assignment were cancelled mid-rollout (no sample of
    # them finished), and the owner of partition 0 sampled every group.
    assert {c.attempt for c in chunks if c.final} == {att for attempts in complete.values() for att in attempts}
    assert all(next(iter(complete[g])).startswith(owner.replica_id + "-") for g in groups)
    assert owner.tasks_done == TASKS and (b if owner is a else a).tasks_done == 0
