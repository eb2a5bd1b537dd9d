"""Reading a topic's events from tests: everything up to now (:func:`read_all`), or
from the start until a condition holds (:func:`read_until`)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from bus import EventConsumer, KafkaConfig, read_topic


async def read_all(kafka_cfg: KafkaConfig, topic: str) -> list:
    """Every event of ``topic`` up to its end offsets at the time of the call."""
    return [env.event for env in await read_topic(kafka_cfg, topic)]


async def read_until(kafka_cfg: KafkaConfig, topic: str, until: Callable[[list], bool],
                     timeout_s: float = 60.0) -> list:
    """Events of ``topic`` (all partitions, from the start) until ``until(events)`` is
    true; raises TimeoutError with how many were read when it never is."""
    events: list = []
    deadline = time.monotonic() + timeout_s
    async with EventConsumer(kafka_cfg, [topic], group_id=None, dead_letters=False) as consumer:
        while not until(events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: condition not met after {timeout_s}s ({len(events)} events read)")
            events.extend(env.event for env in await consumer.getmany(timeout_ms=200))
            await asyncio.sleep(0)
    return events
