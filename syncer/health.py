"""Trainer side: notice samplers that cannot apply weights, so the next publish is a keyframe.

A sampler that fails to plan or apply an update keeps its old weights and says so in
its heartbeat (``rollway.health``): status ``unhealthy`` after an apply that failed
mid-way, and a growing ``details["weight_failures"]`` after any failed update. Deltas
cannot help such a replica past whatever broke (a damaged delta, a damaged keyframe, a
wrong base); a fresh keyframe always can. :class:`TroubleWatch` follows the heartbeats
as a plain reader (no group) and answers "did any sampler report trouble after time
t?", t being when the publisher last wrote a keyframe; the publisher then writes one.
Lag alone is not trouble: a slow replica catches up through deltas.

When no publish follows the trouble (``syncer.keyframe_repair_after_s``), the publisher
stores its newest version again as a keyframe (``WeightPublisher.repair_keyframe``):
a trainer whose every replica is stuck behind damaged objects gets no fresh groups, so
it would never publish the version that lets them past (chaos seed 3, issue #30).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import structlog

from schemas import Heartbeat

if TYPE_CHECKING:
    from bus.config import KafkaConfig

log = structlog.get_logger(__name__)


class TroubleWatch:
    def __init__(self, kafka_cfg: "KafkaConfig") -> None:
        self.kafka_cfg = kafka_cfg
        self._failures: dict[str, int] = {}  # replica -> weight_failures last seen
        self.trouble_at = 0.0  # created_at of the newest heartbeat reporting trouble
        self.trouble_replica = ""
        self.trouble_noted = 0.0  # time.monotonic() here when that heartbeat was read
        self.seen = 0  # sampler heartbeats read
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="syncer-trouble-watch")

    def cancel(self) -> None:
        """Cancel without waiting (from synchronous code); the loop finishes the task."""
        if self._task is not None:
            self._task.cancel()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def trouble_since(self, t: float) -> bool:
        """Did a sampler report trouble in a heartbeat created after ``t``?"""
        return self.trouble_at > t

    def note(self, beat: Heartbeat) -> None:
        if beat.role != "sampler":
            return
        self.seen += 1
        try:
            failures = int(beat.details.get("weight_failures", "0"))
        except ValueError:
            failures = 0
        before = self._failures.get(beat.replica_id, 0)
        self._failures[beat.replica_id] = failures
        if beat.status == "unhealthy" or failures > before:
            if beat.created_at > self.trouble_at:
                self.trouble_at = beat.created_at
                self.trouble_noted = time.monotonic()
                self.trouble_replica = beat.replica_id
                log.warning("sampler reports weight trouble; the next publish is a keyframe",
                            replica=beat.replica_id, status=beat.status, weight_failures=failures,
                            weight_version=beat.weight_version)

    async def _run(self) -> None:
        from bus import EventConsumer

        try:
            async with EventConsumer(self.kafka_cfg, ["health"], group_id=None, dead_letters=False) as consumer:
                while True:
                    for env in await consumer.getmany(timeout_ms=500):
                        if isinstance(env.event, Heartbeat):
                            self.note(env.event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an aid, not a dependency: publishing goes on without it
            log.error("heartbeat watch stopped; keyframes follow syncer.keyframe_every only", error=str(exc))
