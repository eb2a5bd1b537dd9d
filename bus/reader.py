"""Reading the log without a consumer group: exact records by position (trainer replay),
a whole topic up to its current end (the train-step log), and raw offset ranges (tail,
analytics catching up). The one place that reads "up to an end offset"."""

from __future__ import annotations

from collections import defaultdict
from typing import AsyncIterator, Sequence

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from bus import codec
from bus.config import KafkaConfig
from bus.connect import start_client
from bus.consumer import Envelope, envelope_of
from bus.topics import topic_spec
from schemas import RecordRef


class RecordMissing(LookupError):
    """A referenced record is not in the log (deleted by retention or never written)."""


def plain_reader(cfg: KafkaConfig, role: str) -> AIOKafkaConsumer:
    """A consumer that joins no group, commits nothing and sees committed records only."""
    return AIOKafkaConsumer(
        bootstrap_servers=cfg.bootstrap_servers,
        client_id=f"{cfg.client_id}-{role}",
        enable_auto_commit=False,
        isolation_level="read_committed",
        request_timeout_ms=cfg.request_timeout_ms,
    )


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
        for tp, offsets in wanted.items():
            # Read the span [min, max] of wanted offsets once, in order: the records of
            # one train step sit close together in the log.
            consumer.assign([tp])
            consumer.seek(tp, min(offsets))
            last = max(offsets)
            position = min(offsets)
            while position <= last:
                batch = await consumer.getmany(tp, timeout_ms=timeout_ms)
                records = batch.get(tp, [])
                if not records:
                    break
                for record in records:
                    position = record.offset + 1
                    if record.offset in offsets:
                        found[(tp.topic, tp.partition, record.offset)] = envelope_of(record)
            for offset in sorted(offsets):
                if (tp.topic, tp.partition, offset) not in found:
                    raise RecordMissing(f"no record at {tp.topic}:{tp.partition}@{offset}")
    finally:
        await consumer.stop()
    return [found[(r.topic, r.partition, r.offset)] for r in refs]


async def topic_partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """The partitions of ``topic`` (full name) as the cluster knows them; [] if it does not
    exist. aiokafka's public partitions_for_topic only knows subscribed topics."""
    partitions = (await consumer._client.fetch_all_metadata()).partitions_for_topic(topic) or set()
    return [TopicPartition(topic, p) for p in sorted(partitions)]


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
                break


async def read_topic(cfg: KafkaConfig, topic: str, timeout_ms: int = 10_000) -> list[Envelope]:
    """Every record of ``topic`` (short or full name) from its beginning up to its end
    offsets at the time of the call, decoded; partition by partition, in offset order.

    Joins no group and commits nothing. A topic that does not exist reads as empty.
    Raises :class:`RecordMissing` when a partition cannot be read up to its end within
    ``timeout_ms``, and ``codec.DecodeFailure`` naming the position of an undecodable
    record.
    """
    if not topic.startswith(cfg.topic_prefix):
        topic = topic_spec(topic, cfg.topic_prefix).name(cfg.topic_prefix)
    consumer = plain_reader(cfg, "reader")
    await start_client(consumer, cfg.bootstrap_servers, "reader")
    out: list[Envelope] = []
    try:
        tps = await topic_partitions(consumer, topic)
        if not tps:
            return out
        begins = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        async for records in read_ranges(consumer, {tp: (begins[tp], ends[tp]) for tp in tps}, timeout_ms):
            for record in records:
                try:
                    out.append(envelope_of(record))
                except codec.DecodeFailure as exc:
                    raise codec.DecodeFailure(
                        exc.kind, f"{record.topic}:{record.partition}@{record.offset}: {exc}") from None
    finally:
        await consumer.stop()
    return out
