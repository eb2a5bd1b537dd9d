"""A consumer-group rebalance while ``EventConsumer.run`` has records in flight, against
real Kafka: no record is handled to the end by two members (the sampler's task ran
twice: 3 of 148 groups in the fmt-qwen3 run, docs/sampler.md "Rebalances"), none is
lost, and the work of partitions that come back to their member is kept.

Consumer A alone holds the task topic and runs two handlers of partition 0 (offsets 0
and 2) while offset 1 is done and offset 3 waits for a slot. Consumer B joins: A's
partitions are revoked (classic, eager protocol: all of them, also the one it gets
back). If partition 0 comes back to A, A's handlers go on and finish once, and the
re-read from the commit starts no second copy; if it moves to B, A's handlers are
cancelled once A knows it, and B runs 0, 2, 3, ... exactly once, skipping offset 1.
With a grace, A's handlers finish and are committed by A during the revoke.
The sticky assignor (``sticky_assignment``) moves only the partitions a join or leave
must move.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

import msgspec
import pytest
from aiokafka import TopicPartition

from bus import EventConsumer, EventProducer, encode, ensure_topics
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

    def __init__(self, instant: tuple[tuple[int, int], ...] = ((0, 1),)) -> None:
        self.instant = instant  # records whose handlers finish at once; the rest wait for release
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
                if key not in self.instant:  # (offset 1 of partition 0 by default)
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


def assert_each_task_ran_once(members: Members, most_at_once: int = 1) -> None:
    finished = [k for runs in members.finished.values() for k in runs]
    every = {(0, i) for i in range(ON_P0)} | {(1, i) for i in range(ON_P1)}
    assert Counter(finished) == Counter(every), f"finished: {dict(members.finished)}"  # once each, none lost
    # Never twice at once on one member; on two only for the moments between a moved
    # partition's new owner starting and its old owner learning the new assignment.
    assert members.most_at_once <= most_at_once


async def test_a_partition_that_comes_back_keeps_its_handlers_and_runs_each_record_once(kafka_config):
    # Partition 0 goes back to A (the fmt-qwen3 run's two repeats on sampler-0 were its own
    # records read again from the commit beside the live copies).
    members, owner = await rebalance_with_records_in_flight(kafka_config, "g-rebalance-a", grace_s=0.0, landing="a")
    assert owner == "a"
    assert_each_task_ran_once(members)
    # A's two handlers in flight went on through the rebalance (not cancelled), p0@3,
    # fetched before the revoke and not started then, was started once after it, and
    # the re-read from the commit (offset 0) started nothing twice and skipped p0@1.
    assert members.cancelled == {}
    starts = Counter(k for runs in members.started.values() for k in runs)
    assert starts == Counter({(0, i): 1 for i in range(ON_P0)} | {(1, i): 1 for i in range(ON_P1)})
    assert sorted(k for k in members.finished["a"] if k[0] == 0) == [(0, i) for i in range(ON_P0)]


async def test_a_partition_that_moves_has_its_handlers_cancelled_and_run_once_by_the_new_owner(kafka_config):
    # Partition 0 moves to B (the fmt-qwen3 run's third repeat: p5@0, waiting for a slot
    # on sampler-0, was started there after sampler-1 had it).
    members, owner = await rebalance_with_records_in_flight(kafka_config, "g-rebalance-b", grace_s=0.0, landing="b")
    assert owner == "b"
    assert_each_task_ran_once(members, most_at_once=2)
    # A's two handlers in flight were cancelled once A had its new assignment; p0@3 was
    # never started by A; B started partition 0 at offset 0 and skipped offset 1 (done,
    # named in the commit's metadata).
    assert sorted(members.cancelled["a"]) == [(0, 0), (0, 2)]
    assert members.cancelled["b"] == []
    assert sorted(k for k in members.started["b"] if k[0] == 0) == [(0, i) for i in (0, 2, 3, 4, 5)]
    assert sorted(k for k in members.started["a"] if k[0] == 0) == [(0, 0), (0, 1), (0, 2)]


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


def sticky_member(cfg, group: str, name: str) -> EventConsumer:
    return EventConsumer(cfg, ["tasks"], group_id=group, max_poll_records=1, commit_done_offsets=True,
                         sticky_assignment=True, client_id=f"{name}-{group}")


def partitions_of(consumer: EventConsumer) -> set[int]:
    return {tp.partition for tp in consumer.raw.assignment()}


async def test_with_sticky_assignment_a_join_keeps_the_work_of_partitions_that_stay(kafka_config):
    # A runs two records of each partition; B joins; the sticky assignor moves one
    # partition to B. The other one's handlers go on on A (cancelled at the revoke before,
    # and run a second time); the moved one's are cancelled on A and run once on B.
    group = "g-sticky-join"
    for partition in (0, 1):
        await publish(kafka_config, partition, 2)
    members = Members(instant=())
    a, b = sticky_member(kafka_config, group, "a"), sticky_member(kafka_config, group, "b")
    await a.start()
    run_a = asyncio.create_task(a.run(members.handler("a"), concurrency=4))
    first = [(0, 0), (0, 1), (1, 0), (1, 1)]
    await wait_until_async(lambda: sorted(members.started["a"]) == first, 30, "A running all four", task=run_a)
    run_b = asyncio.create_task(start_and_run(b, members.handler("b")))
    await wait_until_async(lambda: len(partitions_of(a)) == 1 and len(partitions_of(b)) == 1, 60,
                           "one partition each", task=run_b)
    (stay,), (moved,) = partitions_of(a), partitions_of(b)
    # A cancels the moved partition's handlers once it has its new assignment.
    await wait_until_async(lambda: {(moved, 0), (moved, 1)} <= set(members.cancelled["a"]), 30,
                           "A to cancel the moved partition's handlers", task=run_a)
    members.release.set()
    for partition in (0, 1):
        await publish(kafka_config, partition, 3)  # offsets 2-4, after the rebalance
    every = {(p, i) for p in (0, 1) for i in range(5)}
    await wait_until_async(lambda: {k for runs in members.finished.values() for k in runs} == every, 60,
                           "every record finished")
    for consumer, partition in ((a, stay), (b, moved)):
        await wait_until_async(lambda c=consumer, p=partition: committed_is(c, p, 5), 30,
                               f"partition {partition} committed to its end")
    for consumer, runner in ((a, run_a), (b, run_b)):
        consumer.stop()
        await runner
        await consumer.close()
    finished = Counter(k for runs in members.finished.values() for k in runs)
    assert finished == Counter(every)  # once each: none run again, none lost
    # The staying partition's handlers were not cancelled: started once, on A, and finished there.
    assert sorted(members.cancelled["a"]) == [(moved, 0), (moved, 1)] and members.cancelled["b"] == []
    assert sorted(members.finished["a"]) == [(stay, i) for i in range(5)]
    starts = Counter(k for runs in members.started.values() for k in runs)
    assert starts == Counter({(stay, i): 1 for i in range(5)} | {(moved, 0): 2, (moved, 1): 2}
                             | {(moved, i): 1 for i in range(2, 5)})
    # The moved partition's records ran to the end on B only, each once.
    assert sorted(members.finished["b"]) == [(moved, i) for i in range(5)]


async def test_sticky_assignment_moves_only_the_partitions_a_join_or_leave_must(kafka_config):
    cfg = msgspec.structs.replace(kafka_config, topic_prefix=kafka_config.topic_prefix + "six.",
                                  partitions={**kafka_config.partitions, "tasks": 6})
    await ensure_topics(cfg)
    group = "g-sticky-moves"

    async def idle(_env) -> None:
        return None

    names = ("a", "b", "c")
    members = {n: sticky_member(cfg, group, n) for n in names}
    runs: dict[str, asyncio.Task] = {}

    async def join(name: str) -> None:
        runs[name] = asyncio.create_task(start_and_run(members[name], idle))

    def owners() -> dict[int, str]:
        return {p: n for n in runs for p in partitions_of(members[n])}

    async def settled(sizes: dict[str, int]) -> dict[int, str]:
        await wait_until_async(lambda: {n: len(partitions_of(members[n])) for n in runs} == sizes
                               and len(owners()) == 6, 60, f"assignment {sizes}")
        return owners()

    try:
        await join("a")
        alone = await settled({"a": 6})
        await join("b")
        two = await settled({"a": 3, "b": 3})
        assert sum(alone[p] != two[p] for p in range(6)) == 3  # B took 3, A kept the other 3
        await join("c")
        three = await settled({"a": 2, "b": 2, "c": 2})
        # C took one of A's and one of B's; nothing else moved (round-robin moves 4).
        assert {p for p in range(6) if two[p] != three[p]} == {p for p, n in three.items() if n == "c"}
        members["c"].stop()
        await runs.pop("c")
        await members["c"].close()
        after = await settled({"a": 3, "b": 3})
        # Only C's two partitions moved.
        assert {p for p in range(6) if three[p] != after[p]} == {p for p, n in three.items() if n == "c"}
    finally:
        for name, runner in runs.items():
            members[name].stop()
            await runner
            await members[name].close()


async def test_acks_between_the_revoke_and_the_assignment_are_committed_when_the_partition_comes_back(kafka_config):
    # A runs p0@0 and p0@2 (p0@1 done at once); B joins and partition 0 comes back to A.
    # A's handlers finish after the revoke's commit and before the new assignment (the
    # test lets them go from A's on_revoke hook, the last step of the revoke): their acks
    # cannot be committed then, and nothing else of partition 0 is acked afterwards, so
    # only the commit made when the partition comes back moves it to 3.
    group = "g-rebalance-between"
    await publish(kafka_config, 0, 3)
    members = Members()
    tp0 = TopicPartition(kafka_config.topic_prefix + "tasks", 0)

    async def finish_during_the_rebalance(revoked) -> None:
        if tp0 in revoked and not members.release.is_set():
            members.release.set()
            await wait_until_async(lambda: {(0, 0), (0, 2)} <= set(members.finished["a"]), 10,
                                   "A's handlers to finish inside the rebalance")

    a = EventConsumer(kafka_config, ["tasks"], group_id=group, max_poll_records=1, commit_done_offsets=True,
                      client_id=f"m1-{group}", on_revoke=finish_during_the_rebalance)
    b = EventConsumer(kafka_config, ["tasks"], group_id=group, max_poll_records=1, commit_done_offsets=True,
                      client_id=f"m2-{group}")
    await a.start()
    run_a = asyncio.create_task(a.run(members.handler("a"), concurrency=2))
    await wait_until_async(lambda: sorted(members.started["a"]) == [(0, 0), (0, 1), (0, 2)], 30,
                           "A running p0@0 and p0@2, p0@1 done", task=run_a)
    run_b = asyncio.create_task(start_and_run(b, members.handler("b")))
    await wait_until_async(lambda: a.raw.assignment() == {tp0} and len(b.raw.assignment()) == 1, 60,
                           "partition 0 back on A", task=run_b)
    await wait_until_async(lambda: committed_is(a, 0, 3), 30, "partition 0 committed to 3", task=run_a)
    for consumer, runner in ((a, run_a), (b, run_b)):
        consumer.stop()
        await runner
        await consumer.close()
    assert members.cancelled == {}
    assert Counter(k for runs in members.started.values() for k in runs) == Counter({(0, i): 1 for i in range(3)})
    assert sorted(members.finished["a"]) == [(0, 0), (0, 1), (0, 2)]
