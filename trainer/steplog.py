"""The train-step log (``rollway.train-steps``): writing entries, reading them back, and
turning an entry into exactly the groups that step trained on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import structlog

from bus import RecordMissing, codec, fetch_records, read_topic
from bus.config import KafkaConfig
from schemas import RecordRef, Reward, TrainedTrajectory, TrainStep, TrajectoryChunk, now
from trainer.trajectory import Group, InvalidTrajectory, assemble, groups_from_trajectories

log = structlog.get_logger(__name__)


class StepLogError(RuntimeError):
    """The train-step log is inconsistent (a gap, an unreadable entry, missing records)."""


@dataclass(frozen=True)
class LoggedStep:
    event: TrainStep
    ref: RecordRef


def step_event(step: int, weights_hash: str, groups: Sequence[Group], metrics: dict[str, float], seed: int) -> TrainStep:
    return TrainStep(
        step=step,
        weight_version=step,
        weights_hash=weights_hash,
        trajectories=[
            TrainedTrajectory(trajectory_id=t.trajectory_id, chunks=list(t.chunk_refs), reward=t.reward_ref)
            for g in groups
            for t in g.members
        ],
        metrics={k: float(v) for k, v in metrics.items()},
        seed=seed,
        created_at=now(),
    )


async def read_step_log(cfg: KafkaConfig, timeout_ms: int = 10_000) -> dict[int, LoggedStep]:
    """Every logged step, by step number (the first entry wins if a step was logged twice)."""
    try:
        envelopes = await read_topic(cfg, "train-steps", timeout_ms=timeout_ms)
    except RecordMissing as exc:
        raise StepLogError(str(exc)) from None
    except codec.DecodeFailure as exc:
        raise StepLogError(f"undecodable train-step record at {exc}") from None
    steps: dict[int, LoggedStep] = {}
    for env in envelopes:
        event = env.event
        if not isinstance(event, TrainStep):
            raise StepLogError(f"{type(event).__name__} record on the train-step log at "
                               f"{env.topic}:{env.partition}@{env.offset}")
        if event.step in steps:
            log.warning("step logged twice; first entry wins", step=event.step, offset=env.offset)
            continue
        steps[event.step] = LoggedStep(event, env.ref)
    return steps


def last_contiguous_step(steps: dict[int, LoggedStep]) -> int:
    """The last step N of a log holding exactly steps 1..N; raises on a gap."""
    if not steps:
        return 0
    n = max(steps)
    missing = [s for s in range(1, n + 1) if s not in steps]
    if missing:
        raise StepLogError(f"train-step log has gaps: steps {missing[:10]} missing below {n}")
    return n


def trained_ids(steps: dict[int, LoggedStep]) -> set[str]:
    return {t.trajectory_id for s in steps.values() for t in s.event.trajectories}


async def fetch_step_groups(cfg: KafkaConfig, event: TrainStep) -> list[Group]:
    """The groups a logged step trained on, rebuilt from exactly its records."""
    refs: list[RecordRef] = []
    for t in event.trajectories:
        refs.extend(t.chunks)
        refs.append(t.reward)
    envelopes = await fetch_records(cfg, refs)
    trajectories = []
    i = 0
    for t in event.trajectories:
        chunk_envs = envelopes[i : i + len(t.chunks)]
        reward_env = envelopes[i + len(t.chunks)]
        i += len(t.chunks) + 1
        chunks = [e.event for e in chunk_envs]
        if not all(isinstance(c, TrajectoryChunk) for c in chunks) or not isinstance(reward_env.event, Reward):
            raise StepLogError(f"step {event.step}: records of {t.trajectory_id} are not chunks + reward")
        try:
            traj = assemble(chunks, [e.ref for e in chunk_envs], reward_env.event, reward_env.ref)
        except InvalidTrajectory as exc:
            raise StepLogError(f"step {event.step}: {exc}") from None
        if traj.trajectory_id != t.trajectory_id:
            raise StepLogError(f"step {event.step}: records of {t.trajectory_id} belong to {traj.trajectory_id}")
        trajectories.append(traj)
    return groups_from_trajectories(trajectories)
