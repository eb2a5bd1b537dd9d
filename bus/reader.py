"""Reading exact records by position: what trainer replay needs from the log."""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from aiokafka import AIOKafkaConsumer, TopicPartition

from bus import codec
from bus.config import KafkaConfig
from bus.consumer import Envelope
from schemas import RecordRef


class RecordMissing(LookupError):
    """A referenced record is not in the log (deleted by retention or never written)."""


async def fetch_records(cfg: KafkaConfig, refs: Sequence[RecordRef], timeout_ms: int = 10_000) -> list[Envelope]:
    """Decode the records at ``refs``, returned in the order of ``refs``.

    Joins no group and commits nothing. Raises :class:`RecordMissing` naming the first
    position that cannot be read, and ``codec.DecodeFailure`` for an undecodable one.
    """
    wanted: dict[TopicPartition, set[int]] = defaultdict(set)
    for ref in refs:
        wanted[TopicPartition(ref.topic, ref.partition)].add(ref.offset)
    found: dict[tuple[str, int, int], Envelope] = {}
    consumer = AIOKafkaConsumer(
        bootstrap_servers=cfg.bootstrap_servers,
        client_id=f"{cfg.client_id}-reader",
        enable_auto_commit=False,
        isolation_level="read_committed",
        request_timeout_ms=cfg.request_timeout_ms,
    )
    await consumer.start()
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
                        headers = tuple(record.headers or ())
                        found[(tp.topic, tp.partition, record.offset)] = Envelope(
                            codec.decode(record.value, headers), record.topic, record.partition,
                            record.offset, record.timestamp, record.key, headers)
            for offset in sorted(offsets):
                if (tp.topic, tp.partition, offset) not in found:
                    raise RecordMissing(f"no record at {tp.topic}:{tp.partition}@{offset}")
    finally:
        await consumer.stop()
    return [found[(r.topic, r.partition, r.offset)] for r in refs]
