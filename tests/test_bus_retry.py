"""Handler retries and dead-letter publishing of EventConsumer.run, against real Kafka
(issue 13, item 2): a handler failing through a dependency's outage is retried over a
configurable back-off window, not 3 tries in 0.6 s; a dead letter that cannot be
published as it is (too big for a record) is still published, so the record is acked
and the partition's commits move on."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from aiokafka import TopicPartition

from bus import EventConsumer, EventProducer, InvalidEvent, read_topic
from bus.config import HandlerRetry
from schemas import DeadLetter, Task
from tests.waiting import wait_until_async

pytestmark = pytest.mark.kafka


def task(i: int, files: dict[str, str] | None = None) -> Task:
    return Task(task_id=f"task-{i}", group_id=f"task-{i}/g0", group_size=2, instruction=f"do {i}", files=files or {})


async def run_until(consumer: EventConsumer, handle, done, what: str) -> int:
    """Run ``handle`` until ``done()``, stop, and return the committed offset of tasks:0."""
    await consumer.start()
    runner = asyncio.create_task(consumer.run(handle))
    await wait_until_async(done, 30, what)
    consumer.stop()
    await runner
    tp = TopicPartition(consumer.topics[0], 0)
    committed = await consumer.raw.committed(tp)
    await consumer.close()
    return committed


def just_under_the_limit(limit: int) -> Task:
    """task(0) whose record (body and type header) is 10 bytes under ``limit``."""
    header = len("rollway-type") + len("Task")
    n = limit
    for _ in range(2):  # the second pass corrects for msgpack's length prefix
        n += limit - 10 - header - len(msgspec.msgpack.encode(task(0, {"blob.txt": "x" * n})))
    big = task(0, {"blob.txt": "x" * n})
    assert len(msgspec.msgpack.encode(big)) + header == limit - 10
    return big


def test_default_window_spans_a_minute_of_back_off():
    delays = HandlerRetry().delays()
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0, 10.0, 4.5]
    assert sum(delays) == 60.0
    assert HandlerRetry(window_s=0).delays() == []  # dead-letter on the first failure
    with pytest.raises(ValueError, match="backoff_s"):
        HandlerRetry(backoff_s=0)


async def test_an_outage_shorter_than_the_window_costs_no_task(kafka_config):
    # The handler's dependency is down for its first 5 tries (the old policy gave up
    # after 3 and dead-lettered the task). Back-off 0.01, 0.02, 0.04, 0.08, 0.1, 0.1,
    # 0.1, 0.05: nine tries over 0.5 s; the sixth succeeds.
    cfg = msgspec.structs.replace(kafka_config, handler_retry=HandlerRetry(window_s=0.5, backoff_s=0.01,
                                                                           max_backoff_s=0.1))
    assert len(cfg.handler_retry.delays()) == 8
    async with EventProducer(cfg) as producer:
        for i in range(2):
            await producer.publish_raw(cfg.topic_prefix + "tasks", msgspec.msgpack.encode(task(i)),
                                       headers=[("rollway-type", b"Task")], partition=0)
    tries: dict[str, int] = {}
    done: list[str] = []

    async def handle(env):
        tid = env.event.task_id
        tries[tid] = tries.get(tid, 0) + 1
        if tid == "task-0" and tries[tid] <= 5:
            raise ConnectionError("sandbox unreachable")
        done.append(tid)

    committed = await run_until(EventConsumer(cfg, ["tasks"], group_id="g-outage"), handle,
                                lambda: len(done) == 2, "both tasks handled")
    assert tries == {"task-0": 6, "task-1": 1}
    assert done == ["task-0", "task-1"]
    assert committed == 2
    assert await read_topic(cfg, "dlq") == []


async def test_a_dead_letter_too_big_for_a_record_goes_without_the_value(kafka_config):
    # A poison task just under the record limit: its dead letter (the task's bytes plus
    # the error) is over it. Before, the publish raised, the record was never acked and
    # the partition's committed offset stayed at it for the rest of the process.
    big = just_under_the_limit(kafka_config.max_record_bytes)
    async with EventProducer(kafka_config) as producer:
        for t in (big, task(1)):
            await producer.publish_raw(kafka_config.topic_prefix + "tasks", msgspec.msgpack.encode(t),
                                       headers=[("rollway-type", b"Task")], partition=0)
    done: list[str] = []

    async def handle(env):
        if env.event.task_id == "task-0":
            raise InvalidEvent("refused")
        done.append(env.event.task_id)

    consumer = EventConsumer(kafka_config, ["tasks"], group_id="g-big-letter")
    committed = await run_until(consumer, handle, lambda: done and consumer.dead_lettered == 1, "task-1 handled")
    assert committed == 2
    (letter,) = [e.event for e in await read_topic(kafka_config, "dlq")]
    assert isinstance(letter, DeadLetter)
    assert (letter.topic, letter.partition, letter.offset, letter.error_kind) == (
        kafka_config.topic_prefix + "tasks", 0, 0, "invalid")
    assert letter.value is None and letter.headers == []
    assert letter.error.startswith("refused [original value (")
    assert letter.error.endswith(f"read the record at {kafka_config.topic_prefix}tasks:0@0]")


async def test_undecodable_garbage_too_big_for_a_letter_does_not_stop_the_consumer(kafka_config):
    # Garbage near the limit: its letter is too big. Before, RecordTooLarge escaped the
    # consumer's iteration and run() died on it (and again after every restart).
    topic = kafka_config.topic_prefix + "tasks"
    async with EventProducer(kafka_config) as producer:
        await producer.publish_raw(topic, b"\xc1" * (kafka_config.max_record_bytes - 100), partition=0)
        await producer.publish_raw(topic, msgspec.msgpack.encode(task(1)), headers=[("rollway-type", b"Task")],
                                   partition=0)
    done: list[str] = []

    async def handle(env):
        done.append(env.event.task_id)

    committed = await run_until(EventConsumer(kafka_config, ["tasks"], group_id="g-big-garbage"), handle,
                                lambda: done, "task-1 handled")
    assert done == ["task-1"]
    assert committed == 2
    (letter,) = [e.event for e in await read_topic(kafka_config, "dlq")]
    assert (letter.offset, letter.error_kind, letter.value) == (0, "unknown_type", None)


async def test_cancelling_run_cancels_its_handlers_and_acks_nothing(kafka_config):
    # A cancelled run() used to leave its handlers running: the sampler's producer
    # closed under them, every retry failed and good tasks were dead-lettered.
    async with EventProducer(kafka_config) as producer:
        await producer.publish_raw(kafka_config.topic_prefix + "tasks", msgspec.msgpack.encode(task(0)),
                                   headers=[("rollway-type", b"Task")], partition=0)
    started, cancelled = asyncio.Event(), []

    async def handle(env):
        started.set()
        try:
            await asyncio.Event().wait()  # a rollout that outlives the consumer
        except asyncio.CancelledError:
            cancelled.append(env.event.task_id)
            raise

    consumer = EventConsumer(kafka_config, ["tasks"], group_id="g-cancel")
    await consumer.start()
    runner = asyncio.create_task(consumer.run(handle, concurrency=2))
    await asyncio.wait_for(started.wait(), 30)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert cancelled == ["task-0"]  # already cancelled when run() returned, not later
    assert await consumer.raw.committed(TopicPartition(consumer.topics[0], 0)) is None
    await consumer.close()
    assert await read_topic(kafka_config, "dlq") == []
