"""The topic registry: every Rollway topic, its layout and what travels on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from schemas import (
    DeadLetter,
    EvalResult,
    Event,
    GroupsDropped,
    Heartbeat,
    Metrics,
    Reward,
    Task,
    TrainStep,
    TrajectoryChunk,
    WeightVersion,
)

DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class TopicSpec:
    """One topic: short name (``tasks``), partitions, broker config, key and event type
    (and ``other_types``, rarer events that belong in the same log)."""

    short_name: str
    partitions: int
    event_type: type[Event]
    key: Callable[[Event], str]
    config: dict[str, str] = field(default_factory=dict)
    other_types: tuple[type[Event], ...] = ()

    def name(self, prefix: str = "rollway.") -> str:
        return prefix + self.short_name

    def key_bytes(self, event: Event) -> bytes:
        return self.key(event).encode()


# The log is the system of record (trainer replay re-reads trajectories and rewards),
# so those topics keep data for a long time; health is compacted to the latest beat.
TOPICS: dict[str, TopicSpec] = {
    spec.short_name: spec
    for spec in (
        TopicSpec("tasks", 6, Task, lambda e: e.task_id, {"retention.ms": str(7 * DAY_MS)}),
        TopicSpec(
            "trajectories", 6, TrajectoryChunk, lambda e: e.trajectory_id,
            {"retention.ms": "-1", "max.message.bytes": str(1024 * 1024)},
        ),
        TopicSpec("rewards", 6, Reward, lambda e: e.trajectory_id, {"retention.ms": "-1"}),
        TopicSpec("weights", 1, WeightVersion, lambda e: e.model, {"retention.ms": "-1"}),
        TopicSpec(
            "health", 3, Heartbeat, lambda e: e.replica_id,
            {"cleanup.policy": "compact", "segment.ms": str(3600 * 1000)},
        ),
        # Drops logged without a step (GroupsDropped) go into the same log, in order.
        TopicSpec("train-steps", 1, TrainStep, lambda e: "trainer", {"retention.ms": "-1"}, (GroupsDropped,)),
        TopicSpec("metrics", 3, Metrics, lambda e: e.source, {"retention.ms": str(30 * DAY_MS)}),
        TopicSpec("evals", 1, EvalResult, lambda e: e.split, {"retention.ms": "-1"}),
        TopicSpec(
            "dlq", 1, DeadLetter, lambda e: f"{e.topic}:{e.partition}:{e.offset}",
            {"retention.ms": str(30 * DAY_MS)},
        ),
    )
}

_BY_EVENT: dict[type[Event], TopicSpec] = {
    cls: spec for spec in TOPICS.values() for cls in (spec.event_type, *spec.other_types)
}


def spec_for(event_or_type: Event | type[Event]) -> TopicSpec:
    cls = event_or_type if isinstance(event_or_type, type) else type(event_or_type)
    try:
        return _BY_EVENT[cls]
    except KeyError:
        raise KeyError(f"no topic carries {cls.__name__}") from None


def topic_spec(short_or_full: str, prefix: str = "rollway.") -> TopicSpec:
    short = short_or_full[len(prefix):] if short_or_full.startswith(prefix) else short_or_full
    try:
        return TOPICS[short]
    except KeyError:
        raise KeyError(f"unknown topic {short_or_full!r}; known: {', '.join(TOPICS)}") from None
