"""Following topics from their beginning for a live view: no consumer group, no commits.

Unlike :func:`bus.read_topic` (a whole topic up to its end, once) the follower keeps
reading as records arrive, so ``rollway up`` can refresh its view each second without
re-reading the log. Records that do not decode are counted and skipped: a view must
never stop on one bad record (the components dead-letter those themselves).
"""

from __future__ import annotations

from typing import Sequence

import structlog

from bus import codec
from bus.config import KafkaConfig
from bus.connect import start_client, stop_consumer
from bus.consumer import Envelope, envelope_of
from bus.reader import plain_reader, topic_partitions
from bus.topics import topic_spec

log = structlog.get_logger(__name__)


class LogFollower:
    def __init__(self, cfg: KafkaConfig, topics: Sequence[str], role: str = "view") -> None:
        self.cfg = cfg
        self.topics = [topic_spec(t, cfg.topic_prefix).name(cfg.topic_prefix) for t in topics]
        self.undecodable = 0
        self._consumer = plain_reader(cfg, role)

    async def start(self) -> None:
        consumer = self._consumer
        await start_client(consumer, self.cfg.bootstrap_servers, "view")
        tps = []
        for topic in self.topics:
            found = await topic_partitions(consumer, topic)
            if not found:
                log.warning("topic not found; not followed", topic=topic)
            tps += found
        consumer.assign(tps)
        if tps:
            await consumer.seek_to_beginning(*tps)

    async def stop(self) -> None:
        await stop_consumer(self._consumer)

    async def __aenter__(self) -> "LogFollower":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def poll(self, timeout_ms: int = 200, max_records: int | None = None) -> list[Envelope]:
        """Records that arrived since the last poll (waits up to ``timeout_ms`` for some),
        decoded, in record-timestamp order across partitions."""
        batch = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        out: list[Envelope] = []
        for records in batch.values():
            for record in records:
                try:
                    out.append(envelope_of(record))
                except codec.DecodeFailure as exc:
                    self.undecodable += 1
                    log.debug("undecodable record skipped", topic=record.topic, partition=record.partition,
                              offset=record.offset, error=str(exc))
        out.sort(key=lambda e: e.timestamp_ms)
        return out
