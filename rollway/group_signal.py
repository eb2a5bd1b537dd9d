"""How many sampled groups carried a learning signal, from the train-step log alone.

Dynamic sampling (DAPO's, in Rollway's asynchronous form): the assembler drops every
complete group whose rewards are all equal (``zero_variance``: its advantages are all
zero, it teaches nothing) and the trainer waits until ``groups_per_step`` groups *with*
variance are ready, while the feeder keeps sampling; so a step's batch is always full of
informative groups and the drops cost sampling time only. Every group ends once, in the
log: trained (``TrainStep.groups``) or dropped with its reason (``TrainStep.dropped``,
or ``GroupsDropped`` when the trainer stops or holds drops too long). This module counts
those ends, so the figure is what the log says, whichever process wrote it.

    informative share = trained / (trained + zero_variance)

is the share of groups decided on their rewards that had variance (the issue's "share
of sampled groups that reach the trainer with non-zero variance"). Groups that ended for
other reasons (stale, abandoned, invalid) are counted but not in that share: their
rewards were never compared. Pure: no Kafka.
"""

from __future__ import annotations

from typing import Iterable

import msgspec

from schemas import GroupsDropped, TrainStep


class GroupTally(msgspec.Struct, kw_only=True):
    trained: int = 0
    dropped: dict[str, int] = {}  # reason -> groups

    @property
    def zero_variance(self) -> int:
        return self.dropped.get("zero_variance", 0)

    @property
    def ended(self) -> int:
        return self.trained + sum(self.dropped.values())

    @property
    def informative_share(self) -> float | None:
        decided = self.trained + self.zero_variance
        return self.trained / decided if decided else None


class StepGroups(msgspec.Struct, frozen=True, kw_only=True):
    """The groups one step trained and the drops its log entry (and the ``GroupsDropped``
    written after it) recorded."""

    step: int
    at: float  # the step's created_at
    trained: int
    dropped: dict[str, int]


def _key(task_id: str, group_id: str) -> tuple[str, str]:
    return task_id, group_id


def step_groups(events: Iterable[object]) -> list[StepGroups]:
    """Per step, in step order: groups trained and dropped. A step logged twice counts
    once (its first entry, as replay reads it); a group's end counts once (a drop logged
    again after a restart is the same end)."""
    steps: dict[int, TrainStep] = {}
    extra: dict[int, list] = {}
    for e in events:
        if isinstance(e, TrainStep):
            steps.setdefault(e.step, e)
        elif isinstance(e, GroupsDropped):
            extra.setdefault(e.after_step, []).extend(e.dropped)
    seen: set[tuple[str, str]] = set()
    out: list[StepGroups] = []
    for step in sorted(set(steps) | set(extra)):
        entry = steps.get(step)
        trained = 0
        if entry is not None:
            keys = [_key(g.task_id, g.group_id) for g in entry.groups]
            fresh = [k for k in keys if k not in seen]
            seen.update(fresh)
            # A schema-1 entry names no groups: its metrics count them.
            trained = len(fresh) if entry.groups else int(entry.metrics.get("groups", 0))
        dropped: dict[str, int] = {}
        for d in [*(entry.dropped if entry is not None else []), *extra.get(step, [])]:
            key = _key(d.task_id, d.group_id)
            if key in seen:
                continue
            seen.add(key)
            dropped[d.reason] = dropped.get(d.reason, 0) + 1
        out.append(StepGroups(step=step, at=entry.created_at if entry is not None else 0.0, trained=trained,
                              dropped=dict(sorted(dropped.items()))))
    return out


def tally(rows: Iterable[StepGroups]) -> GroupTally:
    total = GroupTally(dropped={})
    for r in rows:
        total.trained += r.trained
        for reason, n in r.dropped.items():
            total.dropped[reason] = total.dropped.get(reason, 0) + n
    total.dropped = dict(sorted(total.dropped.items()))
    return total


def rolling_share(rows: list[StepGroups], window: int) -> list[tuple[int, float]]:
    """(step, informative share over the steps whose decided groups, counted back from
    this step, first reach ``window``), for every step with a decided group so far."""
    out: list[tuple[int, float]] = []
    for i, r in enumerate(rows):
        trained = zero = 0
        for prev in reversed(rows[:i + 1]):
            trained += prev.trained
            zero += prev.dropped.get("zero_variance", 0)
            if trained + zero >= window:
                break
        if trained + zero:
            out.append((r.step, trained / (trained + zero)))
    return out


def trained_per_minute(rows: list[StepGroups]) -> float | None:
    """Groups trained per minute between the first and the last logged step."""
    timed = [r for r in rows if r.at > 0]
    if len(timed) < 2 or timed[-1].at <= timed[0].at:
        return None
    return sum(r.trained for r in timed[1:]) / ((timed[-1].at - timed[0].at) / 60.0)
