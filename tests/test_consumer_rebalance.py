"""A consumer-group rebalance while ``EventConsumer.run`` has records in flight, against
real Kafka: no record is handled by two members (the sampler's task ran twice: 3 of
148 groups in the fmt-qwen3 run, docs/sampler.md "Rebalances"), and none is lost.

Consumer A alone holds the task topic and runs two handlers of partition 0 (offsets 0
and 2) while offset 1 is done and offset 3 waits for a slot. Consumer B joins: A's
partitions are revoked (classic, eager protocol: all of them, also the one it gets
back). Whichever member gets partition 0 next must start at offset 0, skip offset 1
and run 0, 2, 3, ... exactly once; A's in-flight handlers are cancelled at once
(``revoke_grace_s=0``) or, with a grace, finish and are committed by A.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

import pytest
from aiokafka import TopicPartition

from bus import EventConsumer, EventProducer, encode
from bus.consumer import done_metadata, parse_done_metadata
from schemas import Task
from tests.waiting import wait_until_async

pytestmark = pytest.mark.kafka

ON_P0 = 6  # tasks on partition 0, published before A starts
ON_P1 = 3  # tasks on partition 1, published after the rebalance


def task(partition: int, i: int) -> Task:
    return Task(task_id=f"p{partition}-{i}", group_id=f"p{partition}-{i}/g", group_size=2, instruction="x")


async def publish(cfg, partition: int, count: int) -> None:
    async with EventProducer(cfg) as producer:
        for i in range(count):
            value, headers = encode(task(partition, i))
            await producer.publish_raw(cfg.topic_prefix + "tasks", value, headers=headers, partition=partition)


async def start_and_run(consumer: EventConsumer, handle) -> None:
    await consumer.start()
    await consumer.run(handle, concurrency=2)


class Members:
    """What each member's handlers did, and how many ran each record at once."""

    def __init__(self) -> None:
        self.started: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.finished: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.cancelled: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.active: Counter = Counter()
        self.most_at_once = 0
        self.release = asyncio.Event()

    def handler(self, name: str):
        async def handle(env) -> None:
            key = (env.partition, env.offset)
            self.started[name].append(key)
            self.active[key] += 1
            self.most_at_once = max(self.most_at_once, self.active[key])
            try:
                if key != (0, 1):  # offset 1 of partition 0 finishes at once; the rest waits
                    await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled[name].append(key)
                raise
            finally:
                self.active[key] -= 1
            self.finished[name].append(key)
        return handle


async def rebalance_with_records_in_flight(cfg, group: str, grace_s: float, landing: str = "a"):
    """A holds p0@0 and p0@2 in flight, p0@1 done, p0@3 waiting for a slot; B joins.
    Returns the members' runs and which of A/B got partition 0."""
    await publish(cfg, 0, ON_P0)
    members = Members()
    # The assignor hands partition 0 to the member whose id sorts first; an id begins
    # with the client id, so these choose where partition 0 lands after the rebalance.
    first, second = ("m1", "m2") if landing == "a" else ("m2", "m1")
    a = EventConsumer(cfg, ["tasks"], group_id=group, max_poll_records=1, revoke_grace_s=grace_s,
                      commit_done_offsets=True, client_id=f"{first}-{group}")
    b = EventConsumer(cfg, ["tasks"], group_id=group, max_poll_records=1, revoke_grace_s=grace_s,
                      commit_done_offsets=True, client_id=f"{second}-{group}")
    await a.start()
    run_a = asyncio.create_task(a.run(members.handler("a"), concurrency=2))
    # 0 and 2 running, 1 done, 3 delivered and waiting for one of the two slots.
    await wait_until_async(lambda: sorted(members.started["a"]) == [(0, 0), (0, 1), (0, 2)] and a.in_flight() == 3,
                           30, "A running p0@0 and p0@2, p0@1 done, p0@3 waiting", task=run_a)
    assert members.finished["a"] == [(0, 1)]
    # Not awaited here: B's start returns once it joined, i.e. after A's revoke.
    run_b = asyncio.create_task(start_and_run(b, members.handler("b")))
    tp0 = TopicPartition(a.topics[0], 0)
    if grace_s:
        # The revoke began (A starts nothing more of partition 0; private state, no event
        # says it): its handlers finish now, within the grace.
        await wait_until_async(lambda: a._progress.get(tp0) is not None and a._progress[tp0].revoked, 30,
                               "A's revoke to begin", task=run_a)
        members.release.set()
    await wait_until_async(lambda: len(a.raw.assignment()) == 1 and len(b.raw.assignment()) == 1, 60,
                           "the partitions split between A and B", task=run_b)
    owner = "a" if tp0 in a.raw.assignment() else "b"
    members.release.set()
    await publish(cfg, 1, ON_P1)
    await wait_until_async(
        lambda: len({k for runs in members.finished.values() for k in runs}) == ON_P0 + ON_P1, 60,
        "every task finished")
    # Both partitions committed to their ends: nothing is left to run again.
    for consumer in (a, b):
        for partition, end in ((0, ON_P0), (1, ON_P1)):
            if TopicPartition(consumer.topics[0], partition) in consumer.raw.assignment():
                await wait_until_async(lambda c=consumer, p=partition, e=end: committed_is(c, p, e), 30,
                                       f"partition {partition} committed to {end}")
    for consumer, runner in ((a, run_a), (b, run_b)):
        consumer.stop()
        await runner
        await consumer.close()
    return members, owner


async def committed_is(consumer: EventConsumer, partition: int, end: int) -> bool:
    return await consumer.raw.committed(TopicPartition(consumer.topics[0], partition)) == end


def assert_each_task_ran_once(members: Members) -> None:
    finished = [k for runs in members.finished.values() for k in runs]
    every = {(0, i) for i in range(ON_P0)} | {(1, i) for i in range(ON_P1)}
    assert Counter(finished) == Counter(every), f"finished: {dict(members.finished)}"  # once each, none lost
    assert members.most_at_once == 1  # never on two members (or twice on one) at once


@pytest.mark.parametrize("landing", ["a", "b"])
async def test_a_rebalance_cancels_revoked_work_and_the_next_owner_runs_it_once(kafka_config, landing):
    # Partition 0 goes back to A (which re-reads its own abandoned records: the fmt-qwen3
    # run's two repeats on sampler-0) or moves to B (the third).
    members, owner = await rebalance_with_records_in_flight(kafka_config, f"g-rebalance-{landing}", grace_s=0.0,
                                                            landing=landing)
    assert owner == landing
    assert_each_task_ran_once(members)
    # A's two handlers in flight were cancelled at the revoke; p0@3 was never started by A
    # before it; the next owner of partition 0 started at offset 0 and skipped offset 1
    # (done, named in the commit's metadata).
    assert sorted(members.cancelled["a"]) == [(0, 0), (0, 2)]
    assert members.cancelled["b"] == []
    starts = Counter(k for runs in members.started.values() for k in runs)
    assert starts == Counter({(0, 0): 2, (0, 2): 2} | {(0, i): 1 for i in (1, 3, 4, 5)}
                             | {(1, i): 1 for i in range(ON_P1)})
    # (p0@1 finished on A before the rebalance.)
    assert sorted(k for k in members.finished[owner] if k[0] == 0 and k != (0, 1)) == [(0, i) for i in (0, 2, 3, 4, 5)]


async def test_handlers_that_finish_within_the_grace_are_committed_by_the_old_owner(kafka_config):
    members, owner = await rebalance_with_records_in_flight(kafka_config, "g-rebalance-grace", grace_s=20.0,
                                                            landing="b")
    assert owner == "b"
    assert_each_task_ran_once(members)
    # Released during the revoke: A finished p0@0 and p0@2 and committed them; nothing
    # was cancelled, and the next owner of partition 0 began at offset 3.
    assert members.cancelled == {}
    assert {(0, 0), (0, 1), (0, 2)} <= set(members.finished["a"])
    assert sorted(k for k in members.started["b"] if k[0] == 0) == [(0, 3), (0, 4), (0, 5)]
    starts = Counter(k for runs in members.started.values() for k in runs)
    assert set(starts.values()) == {1}


def test_done_offsets_round_trip_through_commit_metadata():
    assert done_metadata([]) == ""
    assert done_metadata([5, 7, 8, 9, 12]) == "done:5,7-9,12"
    assert parse_done_metadata("done:5,7-9,12", 4) == {5, 7, 8, 9, 12}
    assert parse_done_metadata("done:5,7-9,12", 7) == {8, 9, 12}  # only past the committed offset
    assert parse_done_metadata("", 0) == set()
    assert parse_done_metadata("something else", 0) == set()
    assert parse_done_metadata("done:x-1", 0) == set()  # unreadable: a hint only, nothing skipped
    # Too many ranges for Kafka's metadata limit: the lowest ones are kept, whole.
    many = done_metadata(list(range(0, 4000, 2)))
    assert len(many) <= 2000 and parse_done_metadata(many, -1) == set(range(0, 2 * (many.count(",") + 1), 2))


def test_a_grace_longer_than_a_joining_replicas_request_is_refused_at_load():
    from rollway.config import ConfigError, load_config

    assert load_config(None, environ={}).sampler.revoke_grace_s == 0.0
    assert load_config(None, environ={}, overrides={"sampler": {"revoke_grace_s": 27.5}}).sampler.revoke_grace_s == 27.5
    with pytest.raises(ConfigError, match=r"sampler.revoke_grace_s = 28 must stay below kafka.request_timeout_ms "
                                          r"\(30000 ms\) less a consumer heartbeat \(2000 ms\)"):
        load_config(None, environ={}, overrides={"sampler": {"revoke_grace_s": 28}})
    with pytest.raises(ConfigError, match=r"sampler.revoke_grace_s must not be negative"):
        load_config(None, environ={}, overrides={"sampler": {"revoke_grace_s": -1}})
