"""Reading the log without a consumer group: exact records by position (trainer replay),
a whole topic up to its current end (the train-step log, audits), raw offset ranges
(tail), and whether a consumer has read up to given end offsets (catching up on a log
before going live). The one place that reads "up to an end offset"."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError

from bus import codec
from bus.clients import cluster_metadata, new_consumer
from bus.config import KafkaConfig
from bus.connect import backoff_s, start_client, stop_consumer, waiting_for_broker
from bus.consumer import Envelope, envelope_of
from bus.topics import topic_spec
from schemas import RecordRef

log = structlog.get_logger(__name__)
T = TypeVar("T")

# How long a service asks the cluster again for metadata or end offsets while no broker
# can answer (a leader lost and not yet replaced, a 1-node cluster restarting): longer
# than a broker restart, short enough that a cluster gone for good ends the process
# loudly. CLI tools (``bus.connect.wait_for_broker`` off) do not ask again.
ASK_AGAIN_WINDOW_S = 180.0


async def _asked_again(what: str, ask: Callable[[], Awaitable[T]], window_s: float | None) -> T:
    """``await ask()``, asked again with back-off while the cluster cannot answer, for up
    to ``window_s`` (None: ``ASK_AGAIN_WINDOW_S`` in a service, 0 in a CLI tool). After
    the window the last error is raised. aiokafka retries inside one request only up to
    the client's ``request_timeout_ms`` (then ``KafkaTimeoutError``) and fails a metadata
    fetch at once when no broker answers (``KafkaError``): a broker killed while the
    feeder caught up on the rewards log ended the feeder (chaos seed 4471)."""
    if window_s is None:
        window_s = ASK_AGAIN_WINDOW_S if waiting_for_broker() else 0.0
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return await ask()
        except KafkaError as exc:
            if not _unanswered(exc):
                raise
            attempt += 1
            waited = time.monotonic() - started
            if waited >= window_s:
                raise
            delay = min(backoff_s(attempt), window_s - waited)
            log.warning(f"kafka did not answer for {what}; asking again", attempt=attempt,
                        retry_in_s=round(delay, 3), error=str(exc))
            await asyncio.sleep(delay)


def _unanswered(exc: KafkaError) -> bool:
    """No broker answered, rather than one answering no (an authorization error, an
    unknown topic): timeouts, lost connections, and the bare ``KafkaError`` of aiokafka's
    "Unable to get cluster metadata over all known brokers"."""
    return isinstance(exc, (KafkaTimeoutError, KafkaConnectionError)) or type(exc) is KafkaError


class RecordMissing(LookupError):
    """A referenced record is not in the log (deleted by retention or never written)."""


def plain_reader(cfg: KafkaConfig, role: str) -> AIOKafkaConsumer:
    """A consumer that joins no group, commits nothing and sees committed records only."""
    return new_consumer(cfg, f"{cfg.client_id}-{role}", enable_auto_commit=False, isolation_level="read_committed")


async def fetch_records(cfg: KafkaConfig, refs: Sequence[RecordRef], timeout_ms: int = 10_000) -> list[Envelope]:
    """Decode the records at ``refs``, returned in the order of ``refs``.

    Joins no group and commits nothing. Raises :class:`RecordMissing` naming the first
    position that cannot be read, and ``codec.DecodeFailure`` for an undecodable one.
    """
    wanted: dict[TopicPartition, set[int]] = defaultdict(set)
    for ref in refs:
        wanted[TopicPartition(ref.topic, ref.partition)].add(ref.offset)
    found: dict[tuple[str, int, int], Envelope] = {}
    consumer = plain_reader(cfg, "reader")
    await start_client(consumer, cfg.bootstrap_servers, "reader")
    try:
        # Read the span [min, max] of wanted offsets once, in order: the records of one
        # train step sit close together in the log.
        spans = {tp: (min(offsets), max(offsets) + 1) for tp, offsets in wanted.items()}
        async for records in read_ranges(consumer, spans, timeout_ms):
            for record in records:
                if record.offset in wanted[TopicPartition(record.topic, record.partition)]:
                    found[(record.topic, record.partition, record.offset)] = envelope_of(record)
        for tp, offsets in wanted.items():
            for offset in sorted(offsets):
                if (tp.topic, tp.partition, offset) not in found:
                    raise RecordMissing(f"no record at {tp.topic}:{tp.partition}@{offset}")
    finally:
        await stop_consumer(consumer)
    return [found[(r.topic, r.partition, r.offset)] for r in refs]


async def topic_partitions(
    consumer: AIOKafkaConsumer, topic: str, window_s: float | None = None,
) -> list[TopicPartition]:
    """The partitions of ``topic`` (full name) as the cluster knows them; [] if it does not
    exist. Asked again while no broker answers (see :func:`_asked_again`)."""
    metadata = await _asked_again("cluster metadata", lambda: cluster_metadata(consumer), window_s)
    partitions = metadata.partitions_for_topic(topic) or set()
    return [TopicPartition(topic, p) for p in sorted(partitions)]


async def partitions_of(consumer: AIOKafkaConsumer, topics: Sequence[str]) -> list[TopicPartition]:
    """The partitions of every topic of ``topics`` (full names), topic by topic."""
    return [tp for topic in topics for tp in await topic_partitions(consumer, topic)]


async def end_offsets(
    consumer: AIOKafkaConsumer, tps: Sequence[TopicPartition], window_s: float | None = None,
) -> dict[TopicPartition, int]:
    """``consumer.end_offsets(tps)``, asked again while no broker answers (see
    :func:`_asked_again` for ``window_s``)."""
    if not tps:
        return {}
    return await _asked_again("end offsets", lambda: consumer.end_offsets(list(tps)), window_s)


async def caught_up(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    """Whether ``consumer`` has read each partition of ``ends`` up to its end offset
    (records handed out by getmany/getone count as read). False while a partition with
    records to read is not assigned yet (a group consumer before its first rebalance)."""
    assigned = consumer.assignment()
    for tp, end in ends.items():
        if end <= 0:
            continue
        if tp not in assigned or await consumer.position(tp) < end:
            return False
    return True


async def read_up_to(
    consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int], timeout_ms: int = 10_000,
) -> AsyncIterator[list[ConsumerRecord]]:
    """Raw records of each assigned partition of ``ends`` from the consumer's position up
    to (not including) the end offset, partition by partition, in offset order, as
    fetched batches. Raises :class:`RecordMissing` when a partition cannot be read up to
    its end within ``timeout_ms``."""
    for tp, end in ends.items():
        # Position, not the last offset seen: compaction and transaction markers leave gaps.
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=timeout_ms)
            records = batch.get(tp, [])
            if not records:
                raise RecordMissing(f"could not read {tp.topic}:{tp.partition} up to offset {end}")
            wanted = [r for r in records if r.offset < end]
            if wanted:
                yield wanted
            if len(wanted) < len(records):
                consumer.seek(tp, end)  # fetched past the end: leave the position at it
                break


async def read_ranges(
    consumer: AIOKafkaConsumer, ranges: dict[TopicPartition, tuple[int, int]], timeout_ms: int = 10_000,
) -> AsyncIterator[list[ConsumerRecord]]:
    """Raw records of each partition in ``[start, end)``, partition by partition, in
    offset order, as fetched batches. ``consumer`` is a plain reader (:func:`plain_reader`);
    its assignment is replaced. Raises :class:`RecordMissing` when a partition cannot be
    read up to ``end`` within ``timeout_ms``."""
    for tp, (start, end) in ranges.items():
        if start >= end:
            continue
        consumer.assign([tp])
        consumer.seek(tp, start)
        async for records in read_up_to(consumer, {tp: end}, timeout_ms):
            yield records


async def read_topic_records(cfg: KafkaConfig, topic: str, timeout_ms: int = 10_000) -> list[ConsumerRecord]:
    """Every record of ``topic`` (full name) from its beginning up to its end offsets at
    the time of the call, undecoded; partition by partition, in offset order. Joins no
    group, commits nothing, reads committed records only. A topic that does not exist
    reads as empty. Raises :class:`RecordMissing` when a partition cannot be read up to
    its end within ``timeout_ms``."""
    consumer = plain_reader(cfg, "reader")
    await start_client(consumer, cfg.bootstrap_servers, "reader")
    out: list[ConsumerRecord] = []
    try:
        tps = await topic_partitions(consumer, topic)
        if not tps:
            return out
        begins = await consumer.beginning_offsets(tps)
        ends = await end_offsets(consumer, tps)
        async for records in read_ranges(consumer, {tp: (begins[tp], ends[tp]) for tp in tps}, timeout_ms):
            out.extend(records)
    finally:
        await stop_consumer(consumer)
    return out


async def read_topic(cfg: KafkaConfig, topic: str, timeout_ms: int = 10_000) -> list[Envelope]:
    """:func:`read_topic_records` decoded; ``topic`` is a short or full name. Raises
    ``codec.DecodeFailure`` naming the position of an undecodable record."""
    if not topic.startswith(cfg.topic_prefix):
        topic = topic_spec(topic, cfg.topic_prefix).name(cfg.topic_prefix)
    out: list[Envelope] = []
    for record in await read_topic_records(cfg, topic, timeout_ms):
        try:
            out.append(envelope_of(record))
        except codec.DecodeFailure as exc:
            raise codec.DecodeFailure(
                exc.kind, f"{record.topic}:{record.partition}@{record.offset}: {exc}") from None
    return out
