"""Rollway's event types and the packed-array helpers they use."""

from schemas.events import (
    EVENT_TYPES,
    Cost,
    DeadLetter,
    EvalResult,
    Event,
    GroupRef,
    Heartbeat,
    Metrics,
    RecordRef,
    Reward,
    Task,
    TrainedTrajectory,
    TrainStep,
    TrajectoryChunk,
    WeightVersion,
    now,
)

__all__ = [
    "EVENT_TYPES",
    "Cost",
    "DeadLetter",
    "EvalResult",
    "Event",
    "GroupRef",
    "Heartbeat",
    "Metrics",
    "RecordRef",
    "Reward",
    "Task",
    "TrainedTrajectory",
    "TrainStep",
    "TrajectoryChunk",
    "WeightVersion",
    "now",
]
