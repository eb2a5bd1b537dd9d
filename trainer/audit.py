"""Group accounting from the log alone (``rollway audit``).

The promise (docs/contracts.md, "Failure modes: group accounting"): every group the
feeder issued ends exactly once, trained or dropped with a reason. This reads

* ``rollway.tasks``: what was issued (one ``Task`` = one group, key ``(task_id, group_id)``);
* ``rollway.train-steps``: what ended (``TrainStep.groups`` trained, ``TrainStep.dropped``
  dropped with a reason; schema-1 entries' groups derived from their reward records);
* ``rollway.dlq``: tasks a sampler dead-lettered (never sampled, so never seen by the
  trainer: an end of their own, ``dead_lettered``, when the trainer has none for them),

and reports issued / trained / dropped by reason / unaccounted, and every group that
ended more than once. Nothing is written; no group is joined, nothing committed.
Records that do not decode (garbage, a newer schema) are counted and skipped, except
on the step log, where ``read_step_log``'s rules apply.

While the stack runs, groups still in flight show as unaccounted: audit a stopped run
(or read unaccounted as "in flight or lost").
"""

from __future__ import annotations

from collections import Counter

import msgspec
import structlog

from bus import codec
from bus.config import KafkaConfig
from bus.consumer import envelope_of
from bus.reader import read_topic_records
from bus.topics import topic_spec
from schemas import DeadLetter, GroupRef, Task
from trainer.steplog import group_ends, read_step_log

log = structlog.get_logger(__name__)

GroupKey = tuple[str, str]


class GroupEnd(msgspec.Struct, kw_only=True):
    """One end of a group: ``trained`` or a drop reason, and the step whose entry says so."""

    end: str
    step: int


class EndedTwice(msgspec.Struct, kw_only=True):
    group: GroupRef
    ends: list[GroupEnd]


class GroupAudit(msgspec.Struct, kw_only=True):
    issued: int  # distinct groups on the tasks topic
    trained: int  # issued groups whose (first) end is trained
    dropped: dict[str, int]  # reason -> issued groups whose (first) end is that drop
    dead_lettered: int  # issued groups with no trainer end whose task a sampler dead-lettered
    unaccounted: list[GroupRef]  # issued, no end at all (in flight or lost)
    ended_twice: list[EndedTwice]  # trained twice, trained and dropped, dropped twice
    not_issued: list[GroupRef]  # ended in the log, never seen on the tasks topic
    issued_twice: int  # groups published more than once (same key)
    steps: int  # step-log entries read
    unknown_steps: list[int]  # schema-1 steps whose group keys could not be derived
    undecodable: int  # records of tasks / dlq that did not decode (skipped)

    @property
    def ok(self) -> bool:
        """Every issued group ended exactly once, and the log could tell for every step."""
        return not self.unaccounted and not self.ended_twice and not self.unknown_steps


async def _read_decoded(cfg: KafkaConfig, short: str) -> tuple[list, int]:
    """Events of a whole topic (to its end offsets now) and how many records did not decode."""
    topic = topic_spec(short, cfg.topic_prefix).name(cfg.topic_prefix)
    events: list = []
    bad = 0
    for record in await read_topic_records(cfg, topic):
        try:
            events.append(envelope_of(record).event)
        except codec.DecodeFailure:
            bad += 1
    return events, bad


async def audit_groups(cfg: KafkaConfig) -> GroupAudit:
    """Issued vs ended groups, from the log (see the module doc)."""
    tasks, bad_tasks = await _read_decoded(cfg, "tasks")
    issued: Counter[GroupKey] = Counter()
    for event in tasks:
        if isinstance(event, Task):
            issued[(event.task_id, event.group_id)] += 1
    letters, bad_letters = await _read_decoded(cfg, "dlq")
    tasks_topic = topic_spec("tasks", cfg.topic_prefix).name(cfg.topic_prefix)
    dead: set[GroupKey] = set()
    for letter in letters:
        if not isinstance(letter, DeadLetter) or letter.topic != tasks_topic:
            continue
        try:
            task = codec.decode(letter.value, letter.headers, expect=Task)
        except codec.DecodeFailure:
            continue  # garbage dead-lettered from the tasks topic: no group of it was issued
        dead.add((task.task_id, task.group_id))

    steps = await read_step_log(cfg)
    logged = await group_ends(cfg, steps)
    ends: dict[GroupKey, list[GroupEnd]] = {}
    for step, key in logged.trained:
        ends.setdefault(key, []).append(GroupEnd(end="trained", step=step))
    for step, key, reason in logged.dropped:
        ends.setdefault(key, []).append(GroupEnd(end=reason, step=step))

    trained = 0
    dropped: Counter[str] = Counter()
    dead_lettered = 0
    unaccounted: list[GroupRef] = []
    for key in issued:
        first = ends.get(key)
        if first:
            if first[0].end == "trained":
                trained += 1
            else:
                dropped[first[0].end] += 1
        elif key in dead:
            dead_lettered += 1
        else:
            unaccounted.append(GroupRef(*key))
    result = GroupAudit(
        issued=len(issued),
        trained=trained,
        dropped=dict(sorted(dropped.items())),
        dead_lettered=dead_lettered,
        unaccounted=unaccounted,
        ended_twice=[EndedTwice(group=GroupRef(*k), ends=e) for k, e in ends.items() if len(e) > 1],
        not_issued=[GroupRef(*k) for k in ends if k not in issued],
        issued_twice=sum(1 for n in issued.values() if n > 1),
        steps=len(steps),
        unknown_steps=logged.unknown_steps,
        undecodable=bad_tasks + bad_letters,
    )
    log.info("group audit", issued=result.issued, trained=result.trained, dropped=result.dropped,
             dead_lettered=result.dead_lettered, unaccounted=len(result.unaccounted),
             ended_twice=len(result.ended_twice), ok=result.ok)
    return result


def format_audit(a: GroupAudit, limit: int = 20) -> str:
    """A readable table of the audit, at most ``limit`` keys per list."""
    dropped = sum(a.dropped.values())
    lines = [
        f"step-log entries      {a.steps}",
        f"groups issued         {a.issued}" + (f"  ({a.issued_twice} issued more than once)" if a.issued_twice else ""),
        f"  trained             {a.trained}",
        f"  dropped             {dropped}" + (" (" + ", ".join(f"{k} {v}" for k, v in a.dropped.items()) + ")"
                                              if dropped else ""),
        f"  dead-lettered task  {a.dead_lettered}",
        f"  unaccounted         {len(a.unaccounted)}",
        f"ended more than once  {len(a.ended_twice)}",
        f"ended, not issued     {len(a.not_issued)}",
    ]
    if a.unknown_steps:
        lines.append(f"schema-1 steps with unknown groups: {len(a.unknown_steps)} "
                     f"({a.unknown_steps[0]}..{a.unknown_steps[-1]}; their reward records are gone)")
    if a.undecodable:
        lines.append(f"undecodable records skipped (tasks, dlq): {a.undecodable}")
    for g in a.unaccounted[:limit]:
        lines.append(f"unaccounted: {g.task_id} {g.group_id}")
    for t in a.ended_twice[:limit]:
        lines.append(f"ended twice: {t.group.task_id} {t.group.group_id}: "
                     + ", ".join(f"{e.end}@step {e.step}" for e in t.ends))
    lines.append("OK: every issued group ended exactly once" if a.ok else "NOT OK")
    return "\n".join(lines)
