"""Windows by record time, for consumers that read several partitions.

Records of different partitions arrive interleaved, not in time order. Like Kafka
Streams, a window keeps *stream time* (the newest record time seen) and closes a window
only once stream time has passed its end by ``grace_s``: records up to ``grace_s`` out
of order still land in the right window; later ones are counted in ``late`` and dropped.

    per_minute = TumblingWindows(size_s=60, grace_s=10)

    @consumer("rewards")
    async def on_reward(reward: Reward, env):
        for window in per_minute.add(env.timestamp_ms, reward):
            print(window.start_ms, len(window.items))

    @on_reward.on_stop
    def flush():
        for window in per_minute.flush(): ...
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass
class Window(Generic[T]):
    start_ms: int  # inclusive
    end_ms: int  # exclusive
    items: list[T] = field(default_factory=list)


class TumblingWindows(Generic[T]):
    """Back-to-back windows of ``size_s`` seconds, aligned to the epoch."""

    def __init__(self, size_s: float, grace_s: float = 0.0) -> None:
        if size_s <= 0 or grace_s < 0:
            raise ValueError("TumblingWindows: size_s must be > 0 and grace_s >= 0")
        self.size_ms = int(size_s * 1000)
        self.grace_ms = int(grace_s * 1000)
        self.stream_time_ms: int | None = None
        self.late = 0  # records dropped because their window had closed
        self._open: dict[int, Window[T]] = {}
        self._closed_before_ms: int | None = None  # windows starting before this are closed

    def add(self, timestamp_ms: int, item: T) -> list[Window[T]]:
        """Add a record; returns the windows that closed because of it, oldest first."""
        start = timestamp_ms - timestamp_ms % self.size_ms
        if self._closed_before_ms is not None and start < self._closed_before_ms:
            self.late += 1
            return []
        self._open.setdefault(start, Window(start, start + self.size_ms)).items.append(item)
        if self.stream_time_ms is None or timestamp_ms > self.stream_time_ms:
            self.stream_time_ms = timestamp_ms
        return self._close_until(self.stream_time_ms - self.grace_ms)

    def _close_until(self, watermark_ms: int) -> list[Window[T]]:
        closed = [self._open.pop(s) for s in sorted(self._open) if self._open[s].end_ms <= watermark_ms]
        if closed:
            self._closed_before_ms = max(self._closed_before_ms or 0, closed[-1].end_ms)
        return closed

    def flush(self) -> list[Window[T]]:
        """Close every open window (at the end of the input), oldest first."""
        closed = [self._open.pop(s) for s in sorted(self._open)]
        if closed:
            self._closed_before_ms = max(self._closed_before_ms or 0, closed[-1].end_ms)
        return closed


class RollingWindow(Generic[T]):
    """The records of the last ``span_s`` seconds of stream time, in record-time order."""

    def __init__(self, span_s: float) -> None:
        if span_s <= 0:
            raise ValueError("RollingWindow: span_s must be > 0")
        self.span_ms = int(span_s * 1000)
        self.stream_time_ms: int | None = None
        self.late = 0  # records older than the window when they arrived
        self._times: list[int] = []
        self._items: list[Any] = []

    def add(self, timestamp_ms: int, item: T) -> None:
        if self.stream_time_ms is not None and timestamp_ms <= self.stream_time_ms - self.span_ms:
            self.late += 1
            return
        at = bisect.bisect_right(self._times, timestamp_ms)  # equal times keep arrival order
        self._times.insert(at, timestamp_ms)
        self._items.insert(at, item)
        if self.stream_time_ms is None or timestamp_ms > self.stream_time_ms:
            self.stream_time_ms = timestamp_ms
            drop = bisect.bisect_right(self._times, self.stream_time_ms - self.span_ms)
            del self._times[:drop], self._items[:drop]

    @property
    def items(self) -> list[T]:
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)
