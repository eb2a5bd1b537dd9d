"""The bus against real Kafka: round trips, dead letters, redelivery, group takeover."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from aiokafka import TopicPartition

from bus import (
    DecodeFailure,
    EventConsumer,
    EventProducer,
    InvalidEvent,
    RecordTooLarge,
    encode,
    fetch_records,
    read_topic,
    spec_for,
)
from bus.config import HandlerRetry
from schemas import DeadLetter, Metrics, Task
from tests.samples import sample_events
from tests.waiting import wait_until_async

pytestmark = pytest.mark.kafka


def task(i: int) -> Task:
    return Task(task_id=f"task-{i}", group_id=f"task-{i}/g0", group_size=2, instruction=f"do {i}")


async def publish_tasks(cfg, count: int, key: bytes | None = None) -> None:
    """task(0) .. task(count - 1), in order."""
    async with EventProducer(cfg) as producer:
        for i in range(count):
            await producer.publish(task(i), key=key)


async def collect(consumer: EventConsumer, count: int, timeout: float = 20.0) -> list:
    out = []

    async def loop():
        async for env in consumer:
            out.append(env)
            if len(out) >= count:
                return

    await asyncio.wait_for(loop(), timeout)
    return out


async def test_every_event_type_round_trips_through_kafka(kafka_config):
    events = sample_events()
    async with EventProducer(kafka_config) as producer:
        refs = [await producer.publish(e) for e in events]
    for event, ref in zip(events, refs):
        assert ref.topic == spec_for(event).name(kafka_config.topic_prefix)
    got = await fetch_records(kafka_config, refs)
    assert [env.event for env in got] == events
    assert [env.ref for env in got] == refs
    # The key is the registry's key function.
    assert got[0].key == b"task-1"


async def test_read_topic_reads_every_partition_up_to_its_end(kafka_config):
    import re

    tasks_topic = kafka_config.topic_prefix + "tasks"
    async with EventProducer(kafka_config) as producer:
        for i, partition in enumerate([1, 0, 1, 0, 1]):
            value, headers = encode(task(i))
            await producer.publish_raw(tasks_topic, value, key=b"k", headers=headers, partition=partition)
    got = await read_topic(kafka_config, "tasks")
    assert [(e.partition, e.offset, e.event.task_id) for e in got] == [
        (0, 0, "task-1"), (0, 1, "task-3"), (1, 0, "task-0"), (1, 1, "task-2"), (1, 2, "task-4"),
    ]
    assert await read_topic(kafka_config, tasks_topic) == got  # the full name works too
    assert await read_topic(kafka_config, "train-steps") == []  # an empty topic
    assert await read_topic(kafka_config, kafka_config.topic_prefix + "no-such-topic") == []
    async with EventProducer(kafka_config) as producer:
        await producer.publish_raw(tasks_topic, b"\x00\xff", key=b"bad", headers=[("rollway-type", b"Task")],
                                   partition=1)
    with pytest.raises(DecodeFailure, match=re.escape(f"{tasks_topic}:1@3: cannot decode Task")):
        await read_topic(kafka_config, "tasks")


async def test_garbage_and_unknown_type_go_to_dlq_and_consumer_goes_on(kafka_config):
    tasks_topic = kafka_config.topic_prefix + "tasks"
    good_value, good_headers = encode(task(1))
    async with EventProducer(kafka_config) as producer:
        await producer.publish_raw(tasks_topic, b"\x00\xffnot msgpack", key=b"bad",
                                   headers=[("rollway-type", b"Task")], partition=0)
        await producer.publish_raw(tasks_topic, b"\x80", key=b"alien",
                                   headers=[("rollway-type", b"Alien")], partition=0)
        good = await producer.publish_raw(tasks_topic, good_value, key=b"good",
                                          headers=good_headers, partition=0)
    assert good.offset == 2
    async with EventConsumer(kafka_config, ["tasks"], group_id="g-dlq") as consumer:
        envs = await collect(consumer, 1)
        assert [e.event.task_id for e in envs] == ["task-1"]
        assert envs[0].offset == 2
        assert consumer.dead_lettered == 2
    async with EventConsumer(kafka_config, ["dlq"], group_id=None) as dlq:
        letters = await collect(dlq, 2)
    by_key = {e.event.key: e.event for e in letters}
    bad = by_key[b"bad"]
    assert isinstance(bad, DeadLetter)
    assert (bad.topic, bad.partition, bad.offset) == (tasks_topic, 0, 0)
    assert bad.error_kind == "decode" and "cannot decode Task" in bad.error
    assert bad.value == b"\x00\xffnot msgpack"
    alien = by_key[b"alien"]
    assert (alien.offset, alien.error_kind) == (1, "unknown_type")
    assert "Alien" in alien.error and alien.consumer_group == "g-dlq"


async def test_consumer_killed_before_commit_gets_records_again(kafka_config):
    await publish_tasks(kafka_config, 6)
    first = EventConsumer(kafka_config, ["tasks"], group_id="g-redeliver")
    await first.start()
    envs = await collect(first, 6)
    # Simulate a crash: handled but never acked, the client goes away without a commit.
    await first.raw.stop()
    async with EventConsumer(kafka_config, ["tasks"], group_id="g-redeliver") as second:
        again = await collect(second, 6)
        assert sorted(e.event.task_id for e in again) == sorted(e.event.task_id for e in envs)
        for env in again:
            await second.ack(env)
    async with EventConsumer(kafka_config, ["tasks"], group_id="g-redeliver") as third:
        assert await third.getmany(timeout_ms=1500) == []


async def test_acks_commit_only_the_contiguous_done_prefix(kafka_config):
    topic = kafka_config.topic_prefix + "tasks"
    await publish_tasks(kafka_config, 4, key=b"same")  # one partition, offsets 0..3
    async with EventConsumer(kafka_config, ["tasks"], group_id="g-prefix") as consumer:
        envs = await collect(consumer, 4)
        await consumer.ack(envs[1])
        await consumer.ack(envs[3])
        tp = TopicPartition(topic, envs[0].partition)
        assert await consumer.raw.committed(tp) in (None, 0)  # offset 0 still in flight
        await consumer.ack(envs[0])
        assert await consumer.raw.committed(tp) == 2  # 2 still in flight
        await consumer.ack(envs[2])
        assert await consumer.raw.committed(tp) == 4


async def test_two_consumers_split_partitions_and_survivor_takes_over(kafka_config):
    total = 40
    await publish_tasks(kafka_config, total)
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def handler_for(name: str, delay: float):
        async def handle(env):
            seen[name].append(env.event.task_id)
            await asyncio.sleep(delay)
        return handle

    a = EventConsumer(kafka_config, ["tasks"], group_id="g-split", max_poll_records=1)
    b = EventConsumer(kafka_config, ["tasks"], group_id="g-split", max_poll_records=1)
    await a.start()
    await b.start()
    run_a = asyncio.create_task(a.run(handler_for("a", 0.05)))
    run_b = asyncio.create_task(b.run(handler_for("b", 0.05)))
    await wait_until_async(lambda: seen["a"] and seen["b"], 20, "both members to get a partition")
    assignment_a = {tp.partition for tp in a.raw.assignment()}
    assignment_b = {tp.partition for tp in b.raw.assignment()}
    assert assignment_a.isdisjoint(assignment_b) and assignment_a | assignment_b == {0, 1}
    # b leaves gracefully; a must take over b's partition and finish everything.
    b.stop()
    await run_b
    await b.close()
    await wait_until_async(lambda: len(set(seen["a"]) | set(seen["b"])) == total, 30, "every task handled")
    a.stop()
    await run_a
    await a.close()
    assert set(seen["a"]) | set(seen["b"]) == {f"task-{i}" for i in range(total)}


async def test_failing_handler_is_retried_then_dead_lettered(kafka_config):
    async with EventProducer(kafka_config) as producer:
        await producer.publish(task(0), key=b"k")
        await producer.publish(task(1), key=b"k")
        await producer.publish(task(2), key=b"k")
    attempts: dict[str, int] = {}
    done: list[str] = []

    async def handle(env):
        tid = env.event.task_id
        attempts[tid] = attempts.get(tid, 0) + 1
        if tid == "task-0":
            raise RuntimeError("poison")
        if tid == "task-1":
            raise InvalidEvent("group_size must be positive")
        done.append(tid)

    # Back-off 0.01, 0.02, then 0.04 cut to 0.03: four tries over the 0.06 s window.
    cfg = msgspec.structs.replace(kafka_config, handler_retry=HandlerRetry(window_s=0.06, backoff_s=0.01))
    assert cfg.handler_retry.delays() == pytest.approx([0.01, 0.02, 0.03])
    consumer = EventConsumer(cfg, ["tasks"], group_id="g-poison")
    await consumer.start()
    runner = asyncio.create_task(consumer.run(handle))
    await wait_until_async(lambda: done, 10, "task-2 handled")
    consumer.stop()
    await runner
    await consumer.close()
    assert done == ["task-2"]
    assert attempts == {"task-0": 4, "task-1": 1, "task-2": 1}
    async with EventConsumer(kafka_config, ["dlq"], group_id=None) as dlq:
        letters = [e.event for e in await collect(dlq, 2)]
    kinds = {msgspec.msgpack.decode(l.value, type=Task).task_id: (l.error_kind, l.attempts) for l in letters}
    assert kinds == {"task-0": ("handler", 4), "task-1": ("invalid", 1)}


async def test_oversized_record_is_refused_before_the_broker(kafka_config):
    big = Metrics(source="x", values={f"k{i}": float(i) for i in range(100_000)})
    async with EventProducer(kafka_config) as producer:
        with pytest.raises(RecordTooLarge, match="max_record_bytes"):
            await producer.publish(big)


def start_slow_consumer(cfg, group: str, delay: float):
    import os
    import subprocess
    import sys

    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": cfg.bootstrap_servers}
    return subprocess.Popen([sys.executable, "-m", "tests.procs.slow_consumer", cfg.topic_prefix, group, str(delay)],
                            stdout=subprocess.PIPE, text=True, env=env)


async def read_line(proc, timeout: float = 60.0) -> str:
    return (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout)).strip()


async def test_sigkilled_consumer_process_gets_unacked_records_again(kafka_config):
    import signal

    await publish_tasks(kafka_config, 3, key=b"one-partition")
    proc = start_slow_consumer(kafka_config, "g-kill", delay=0.2)
    try:
        assert await read_line(proc) == "start task-0"
        assert await read_line(proc) == "done task-0"
        assert await read_line(proc) == "start task-1"
        proc.send_signal(signal.SIGKILL)  # task-1 in flight, never acked
        proc.wait(timeout=30)
    finally:
        proc.kill()
    async with EventConsumer(kafka_config, ["tasks"], group_id="g-kill") as again:
        envs = await collect(again, 2)
    assert [e.event.task_id for e in envs] == ["task-1", "task-2"]


async def test_sigterm_finishes_in_flight_work_commits_and_leaves(kafka_config):
    import signal

    await publish_tasks(kafka_config, 3, key=b"one-partition")
    proc = start_slow_consumer(kafka_config, "g-term", delay=1.5)
    try:
        assert await read_line(proc) == "start task-0"
        proc.send_signal(signal.SIGTERM)
        assert await read_line(proc) == "done task-0"  # in-flight work finished
        assert await read_line(proc) == "exited cleanly"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    # task-0 was committed; the group (left cleanly, so no session timeout to wait for)
    # resumes at task-1 at once.
    async with EventConsumer(kafka_config, ["tasks"], group_id="g-term") as again:
        envs = await collect(again, 2, timeout=10)
    assert [e.event.task_id for e in envs] == ["task-1", "task-2"]


async def test_transactional_commits_resend_offsets_an_aborted_transaction_carried(kafka_config):
    """A transactional writer (the trainer) commits offsets through ``commit_offsets``
    inside its step's transaction. When that transaction aborts (a broker lost) and is
    retried whole, the retry's commit must carry the same offsets again: before, they
    were recorded as committed on the first try and left out of the retry, so they were
    never committed (the records re-read after the next restart)."""
    await publish_tasks(kafka_config, 2, key=b"same")  # one partition, offsets 0..1
    sent: list[dict] = []

    async def commit_offsets(offsets) -> None:  # stands in for send_offsets_to_transaction
        sent.append({tp.partition: om.offset for tp, om in offsets.items()})

    async with EventConsumer(kafka_config, ["tasks"], group_id="g-txn-resend",
                             commit_offsets=commit_offsets) as consumer:
        envs = await collect(consumer, 2)
        for env in envs:
            await consumer.ack(env, commit=False)
        await consumer.commit()  # the first try of the transaction (then aborted)
        await consumer.commit()  # its retry
    partition = envs[0].partition
    assert sent[:2] == [{partition: 2}, {partition: 2}]
