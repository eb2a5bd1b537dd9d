"""Re-executing logged steps: the trainer's restart path and ``rollway replay``.

A replay starts from the newest checkpoint at or before the first step to re-execute
whose weights hash agrees with the log (or from the initial model, step 0). The trainer
falls back to older checkpoints (replaying more of the log) when one does not load or
loads to other weights than its log entry (:func:`restore_newest_loadable`);
``rollway replay`` reports such a checkpoint as an error instead. It fetches
each step's exact records with ``bus.fetch_records``, trains on them and compares the
resulting weights hash with the logged one. The next step's records are fetched while
the current one trains.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

import structlog

from bus.config import KafkaConfig
from trainer.checkpoint import CheckpointInfo, list_checkpoints, load_checkpoint
from trainer.core import StepResult, TrainCore
from trainer.training_config import training_config_hash
from trainer.steplog import LoggedStep, StepLogError, fetch_step_groups

log = structlog.get_logger(__name__)


class ReplayMismatch(RuntimeError):
    """A re-executed step produced weights whose hash differs from the log."""


class ConfigDiffers(ReplayMismatch):
    """A logged step was trained under other training settings than this trainer's:
    re-executing it could not reproduce its weights."""


def check_training_config(steps: dict[int, LoggedStep], first: int, until: int, config_hash: str) -> None:
    """Raise :class:`ConfigDiffers` naming the first step in ``first .. until`` logged
    under another training config hash. Entries older than schema 4 carry none: unchecked."""
    for s in range(first, until + 1):
        logged = steps[s].event.config_hash
        if logged and logged != config_hash:
            raise ConfigDiffers(
                f"config differs: step {s} was trained with training config {logged}, this trainer's is "
                f"{config_hash}; replay with the settings that wrote the log (trainer.* except "
                "trainer.training_config.NOT_TRAINING)"
            )


class CheckpointUnusable(StepLogError):
    """A checkpoint does not load, or loads to other weights than its log entry."""


@dataclass(frozen=True)
class ReplayRow:
    step: int
    logged_hash: str
    replayed_hash: str
    seconds: float

    @property
    def match(self) -> bool:
        return self.logged_hash == self.replayed_hash


def choose_checkpoint(directory: str, steps: dict[int, LoggedStep], at_most: int) -> CheckpointInfo | None:
    """Newest checkpoint with step <= at_most whose hash the log confirms."""
    candidates = confirmed_checkpoints(directory, steps, at_most)
    return candidates[0] if candidates else None


def confirmed_checkpoints(directory: str, steps: dict[int, LoggedStep], at_most: int) -> list[CheckpointInfo]:
    """Checkpoints with step <= at_most whose metadata hash the log confirms, newest first."""
    out = []
    for info in reversed(list_checkpoints(directory)):
        if info.step > at_most:
            continue
        logged = steps.get(info.step)
        if logged is None:
            log.warning("checkpoint has no logged step; skipped", step=info.step, path=str(info.path))
            continue
        if logged.event.weights_hash != info.weights_hash:
            log.warning("checkpoint hash differs from the log; skipped", step=info.step,
                        checkpoint_hash=info.weights_hash, logged_hash=logged.event.weights_hash)
            continue
        out.append(info)
    return out


def restore_checkpoint(core: TrainCore, info: CheckpointInfo | None) -> int:
    """Load ``info`` into ``core`` (or leave the initial model); returns the step.
    Raises ``CheckpointUnusable`` when it does not load or loads to other weights
    (``core`` may then hold part of it)."""
    if info is None:
        log.info("no usable checkpoint; starting from the initial model", step=0)
        return core.step
    try:
        state = load_checkpoint(info)
        core.restore(state)
    except Exception as exc:  # truncated zip, missing file, wrong keys or shapes: all unusable
        raise CheckpointUnusable(f"checkpoint {info.path} does not load: {type(exc).__name__}: {exc}") from exc
    digest = core.weights_hash()
    if digest != info.weights_hash or core.step != info.step:
        raise CheckpointUnusable(f"checkpoint {info.path} loads to step {core.step} with hash {digest}; "
                                 f"its metadata and the log say step {info.step} with {info.weights_hash}")
    log.info("checkpoint loaded", step=info.step, path=str(info.path))
    return core.step


def restore_newest_loadable(core: TrainCore, directory: str, steps: dict[int, LoggedStep], at_most: int) -> int:
    """Restore the newest checkpoint (step <= at_most) the log confirms and that loads
    to its logged weights; older ones when it does not; else the initial model. Returns
    the step restored (the caller replays the log from there)."""
    initial = None
    for info in confirmed_checkpoints(directory, steps, at_most):
        if initial is None:
            initial = core.snapshot()  # a failed restore may leave part of a checkpoint in core
        try:
            return restore_checkpoint(core, info)
        except CheckpointUnusable as exc:
            log.error("checkpoint unusable; falling back to an older one", step=info.step, path=str(info.path),
                      error=str(exc))
            core.restore(initial)
    return restore_checkpoint(core, None)


async def replay_steps(
    kafka: KafkaConfig,
    core: TrainCore,
    steps: dict[int, LoggedStep],
    until: int,
    *,
    on_step: Callable[[StepResult, ReplayRow], None] | None = None,
    fail_on_mismatch: bool = True,
) -> list[ReplayRow]:
    """Re-execute logged steps ``core.step + 1 .. until`` and compare hashes. Steps
    logged under other training settings fail first (``ConfigDiffers``), or with
    ``fail_on_mismatch=False`` are warned about and replayed anyway."""
    import time

    rows: list[ReplayRow] = []
    first = core.step + 1
    if first > until:
        return rows
    for s in range(first, until + 1):
        if s not in steps:
            raise StepLogError(f"step {s} is not in the train-step log")
    try:
        check_training_config(steps, first, until, training_config_hash(core.cfg))
    except ConfigDiffers as exc:
        if fail_on_mismatch:
            raise
        log.warning("replaying steps logged under another training config", error=str(exc))
    pending = asyncio.create_task(fetch_step_groups(kafka, steps[first].event))
    for s in range(first, until + 1):
        groups = await pending
        if s < until:
            pending = asyncio.create_task(fetch_step_groups(kafka, steps[s + 1].event))
        logged = steps[s].event
        started = time.perf_counter()
        result = await asyncio.to_thread(core.train_step, groups, logged.seed)
        row = ReplayRow(s, logged.weights_hash, result.weights_hash, time.perf_counter() - started)
        rows.append(row)
        log.info("replayed step", step=s, match=row.match, logged_hash=row.logged_hash[:16],
                 replayed_hash=row.replayed_hash[:16])
        if on_step is not None:
            on_step(result, row)
        if not row.match and fail_on_mismatch:
            if s < until:
                pending.cancel()
            raise ReplayMismatch(
                f"step {s}: replayed weights hash {row.replayed_hash} differs from the logged {row.logged_hash}"
            )
    return rows
