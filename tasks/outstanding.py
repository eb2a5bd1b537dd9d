"""Published groups not yet fully rewarded: the feeder's backpressure signal.

A group of ``group_size`` samples is complete when a reward has arrived for every sample
index. Rewards are delivered at least once and a rollout may be retried by another
sampler, so completion counts distinct sample indexes, not reward events. Pure (the
caller passes the clock), so it is unit-testable.
"""

from __future__ import annotations

import msgspec


class Group(msgspec.Struct, kw_only=True):
    task_id: str
    group_size: int
    published_at: float
    rewarded: set[int] = msgspec.field(default_factory=set)


class OutstandingGroups:
    def __init__(self) -> None:
        self._groups: dict[str, Group] = {}

    def add(self, group_id: str, task_id: str, group_size: int, now: float) -> None:
        if group_id in self._groups:
            raise ValueError(f"group {group_id!r} is already outstanding")
        self._groups[group_id] = Group(task_id=task_id, group_size=group_size, published_at=now)

    def rewarded(self, group_id: str, sample_index: int) -> bool:
        """Count a reward; True when it completed the group (which then stops counting).
        Rewards of unknown groups (earlier runs, expired groups) are ignored."""
        group = self._groups.get(group_id)
        if group is None or not 0 <= sample_index < group.group_size:
            return False
        group.rewarded.add(sample_index)
        if len(group.rewarded) == group.group_size:
            del self._groups[group_id]
            return True
        return False

    def expire(self, now: float, timeout_s: float) -> list[tuple[str, Group]]:
        """Drop groups published more than ``timeout_s`` ago; returns them."""
        old = [(gid, g) for gid, g in self._groups.items() if now - g.published_at > timeout_s]
        for gid, _ in old:
            del self._groups[gid]
        return old

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._groups
