"""Feeder settings."""

from __future__ import annotations

import msgspec


class FeederConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tasks_dir: str = "tasks/demo"
    group_id: str = "rollway-feeder"
    group_size: int = 4
    groups_per_second: float = 1.0
    # Stop publishing while this many published groups are not yet rewarded.
    max_outstanding_groups: int = 16
    min_attempts_to_retire: int = 16
    seed: int = 0
