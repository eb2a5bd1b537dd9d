"""From a stream of chunk and reward records to complete groups ready to train.

Rules (each drop is counted in :attr:`Assembler.counters`):

* A trajectory is complete when its final chunk, every chunk before it and its reward
  have arrived. Records of trajectories already trained (the train-step log says so)
  or already dropped are released at once.
* A group is the G samples of one ``(task_id, group_id)``; its members may come from
  different attempts (a task delivered again after its sampler died). The first
  complete trajectory for a sample index takes its slot; a later complete one (another
  attempt) is a duplicate and is dropped (``dropped_duplicate``) unless its oldest
  token is newer than the slot holder's: then it replaces it (the holder is the
  duplicate), so a retry is not blocked by a dying attempt's older samples. After the
  group was trained (also in an earlier process: the step log records its key, see
  ``trained_groups``) every trajectory of it is a duplicate.
* A live retry wins over what a killed attempt left, in any arrival order (also when a
  restarted trainer re-reads both in one batch): a member too old for the version the
  next step trains (``current``) never completes a group while anything fresh of the
  group is held; it is evicted (``trajectories_dropped_stale``) and its slot waits for
  the retry's sample. A group that is ready but not yet taken stays open to a fresher
  sample of a slot (the group is reopened, the older sample is ``dropped_duplicate``),
  and a ready group that went stale while a retry of it streams is reopened without
  its stale members instead of dropped. An ``abandoned`` drop not yet in the step log
  is undone when a record of the group arrives (a retry streaming after its killed
  attempt was evicted): the group is decided again, once; after the drop is logged a
  retry is late.
* A complete group whose rewards are all equal carries no signal: dropped
  (``dropped_zero_variance``). A complete group whose rewards name more than one phase
  (attempts of a retried group graded on either side of a phase boundary) is dropped
  ``invalid`` (``dropped_mixed_phase``): its advantages would rank phases, not behaviour.
* Staleness, against the version the next step trains (``current``): with
  ``drop_group`` a group whose oldest generated token is more than ``max_staleness``
  versions old is dropped (``dropped_stale``); with ``mask_tokens`` its stale tokens
  are masked later and the group is dropped only when every token is stale. Unfinished
  trajectories and members of incomplete groups are evicted one by one by the same rule
  (``trajectories_dropped_stale``), so a dead sampler cannot hold records (and the
  committed offsets) forever. Evicting a trajectory does not close the group key while
  anything of the group is still held: a retry already streaming its samples completes
  and trains the group. An incomplete group left with no trajectory at all is dropped
  (``abandoned``) and its key closed: a retry arriving after that is late
  (``dropped_late``), so the group ends once, never dropped and later trained. A
  complete group that is too old is dropped and its key closed (``dropped_stale``): it
  was sampled in full, no retry of it is coming.
* Every group ends exactly once: trained (``mark_trained``) or dropped with a reason
  (``zero_variance``, ``stale``, ``invalid``, ``abandoned``) that is counted
  (``groups_dropped_<reason>``), logged (``group dropped``) and handed to the step log
  (:meth:`Assembler.take_drops`: ``TrainStep.dropped`` of the next step). A dropped
  group's records are released only with that step (in its transaction), so a crash
  before it re-reads them and decides the group again: a drop is never acknowledged
  without being in the log. Keys the log says ended (trained or dropped, also in an
  earlier process) are closed at start.
* Buffer policy: a group is filed under its newest token version. Groups from a
  version older than the newest published one fill at most
  ``max(1, floor(max_version_fraction * groups_per_step))`` slots of a batch; the rest
  wait for a later batch (or go stale). Groups from the newest published version are
  never capped, so the trainer cannot deadlock waiting for versions that do not exist
  yet; when more than ``max_buffered_groups`` groups are waiting the cap is lifted for
  that batch (``version_cap_relaxed``).

The assembler never touches Kafka: it hands back the records it is done with
(:meth:`Assembler.released`) and the invalid ones (:attr:`Assembler.invalid`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import structlog

from schemas import GroupDrop, Reward, TrajectoryChunk
from trainer.config import TrainerConfig
from trainer.batch_check import check_chunks
from trainer.loss import has_reward_variance
from trainer.trajectory import CheckedChunk, Group, InvalidTrajectory, Trajectory, assemble, check_chunk, chunks_complete

if TYPE_CHECKING:
    from bus import Envelope

log = structlog.get_logger(__name__)

GroupKey = tuple[str, str]
CLOSED_MEMORY = 1_000_000  # group keys remembered as closed (duplicates after that still go stale)


@dataclass
class _Pending:
    chunks: dict[tuple[int, int], tuple[CheckedChunk, Envelope]] = field(default_factory=dict)
    reward: tuple[Reward, Envelope] | None = None
    group: GroupKey | None = None
    # A final chunk is among ``chunks`` (the order is checked only once one is: not at
    # every record of a long trajectory).
    has_final: bool = False

    def envelopes(self) -> list[Envelope]:
        out = [env for _, env in self.chunks.values()]
        if self.reward is not None:
            out.append(self.reward[1])
        return out

    def complete(self) -> bool:
        return (self.reward is not None and self.has_final
                and chunks_complete([c.chunk for c, _ in self.chunks.values()]))

    def attempt(self) -> str:
        for c, _ in self.chunks.values():
            return c.chunk.attempt
        return self.reward[0].attempt if self.reward is not None else ""

    def versions(self) -> tuple[int, int] | None:
        """(oldest, newest) version of the generated tokens seen so far. With none
        generated yet: the newest version loaded while its prompt and tool output were
        recorded, as both (an attempt killed before generating must still go stale;
        tokens it might still generate come from at least that version)."""
        checked = [c for c, _ in self.chunks.values()]
        oldest = [c.oldest_generated for c in checked if c.oldest_generated is not None]
        if oldest:
            return min(oldest), max(c.newest_generated for c in checked if c.newest_generated is not None)
        if self.reward is not None and self.reward[0].weight_version >= 0:
            return self.reward[0].weight_version, self.reward[0].weight_version
        loaded = [c.newest_loaded for c in checked if c.newest_loaded is not None]
        return (max(loaded), max(loaded)) if loaded else None


@dataclass
class _PendingDrop:
    """A group dropped in this process, not yet in the step log."""

    drop: GroupDrop
    trajectory_ids: list[str]
    envelopes: list[Envelope]
    # Counters this drop incremented: a drop undone (forget_unfinished) takes them back,
    # so a group decided again after a redelivery is counted once.
    counted: Counter[str] = field(default_factory=Counter)


@dataclass
class _OpenGroup:
    size: int
    members: dict[int, Trajectory] = field(default_factory=dict)


def _ref(env: Envelope):
    return getattr(env, "ref", None)


class Assembler:
    def __init__(self, cfg: TrainerConfig, trained_ids: Iterable[str] = (),
                 trained_groups: Iterable[GroupKey] = (),
                 dropped_groups: Iterable[tuple[GroupKey, str]] = (), current: int | None = None) -> None:
        """``current``: the version the next step trains (a restored trainer's step), so
        records re-read at start are judged for staleness before the first eviction."""
        self.cfg = cfg
        self.current = current
        self.trained_ids: set[str] = set(trained_ids)
        self.finished_ids: set[str] = set()  # dropped in this process
        self.partial: dict[str, _Pending] = {}
        self.open_groups: dict[GroupKey, _OpenGroup] = {}
        self.ready: list[Group] = []
        self.closed: OrderedDict[GroupKey, str] = OrderedDict()
        self.drops: list[_PendingDrop] = []  # dropped since the last take_drops, in order
        self.counters: Counter[str] = Counter()
        self.invalid: list[tuple[Envelope, str]] = []  # (envelope, error) to dead-letter
        self.training: dict[str, GroupKey] = {}  # trajectories of batches taken, not yet logged
        self._held: dict[GroupKey, list[Envelope]] = {}
        # Records of each complete trajectory held (in an open group, ready or training),
        # acknowledged when it is trained or dropped.
        self._records: dict[str, list[Envelope]] = {}
        self._released: list[Envelope] = []
        # Groups the step log says were trained (by any earlier process): a retry of one
        # under a new attempt id must not be trained a second time.
        for key in trained_groups:
            self._mark_closed(tuple(key), "trained")
        # Groups the log says were dropped: their end is final too (a retry is late, and
        # records re-read after a restart do not drop the group a second time).
        for key, reason in dropped_groups:
            self._mark_closed(tuple(key), reason)

    # -- input ----------------------------------------------------------------------------
    def add(self, env: Envelope) -> None:
        self._add(env, None)

    def add_many(self, envs: Sequence[Envelope]) -> None:
        """:meth:`add` each of ``envs``, in order, with their chunks checked as one
        batch (``trainer.batch_check.check_chunks``: the same verdict for each chunk as
        its own check, a bad one refused with the same error), so a ``getmany`` batch
        pays the check's numpy calls once, not per chunk."""
        chunks = [env.event for env in envs if isinstance(env.event, TrajectoryChunk)]
        if len(chunks) < 2:
            for env in envs:
                self._add(env, None)
            return
        verdicts = iter(check_chunks(chunks))
        for env in envs:
            self._add(env, next(verdicts) if isinstance(env.event, TrajectoryChunk) else None)

    def _add(self, env: Envelope, verdict: CheckedChunk | ValueError | None) -> None:
        """``add``; ``verdict``: a chunk's check, already done (None: check it here)."""
        event = env.event
        if not isinstance(event, (TrajectoryChunk, Reward)):
            self.counters["ignored_events"] += 1
            self._released.append(env)
            return
        tid = event.trajectory_id
        if tid in self.training:
            # Delivered again (a rebalance) while its step is being trained: acked
            # with the step, never before it is logged.
            self.counters["records_redelivered"] += 1
            self._held.setdefault(self.training[tid], []).append(env)
            return
        if tid in self.trained_ids or tid in self.finished_ids:
            self.counters["records_already_done"] += 1
            self._released.append(env)
            return
        held = self._records.get(tid)
        if held is not None:
            # Complete already and waiting in its group: this is a copy of one of its
            # records (a producer retry). Its records stay the held ones, so they are
            # acknowledged when the group is trained or dropped.
            self.counters["duplicate_records"] += 1
            if _ref(env) not in [_ref(e) for e in held]:
                self._released.append(env)
            return
        key = (event.task_id, event.group_id)
        pending = self.partial.get(tid)
        if pending is None:
            if self.closed.get(key) == "abandoned":
                self._revive(key)
            # A ready group not yet taken stays open to a fresher sample (see _place).
            if key in self.closed and self.closed[key] != "ready":
                self._drop_late(tid, key, [env])
                return
            pending = self.partial[tid] = _Pending(group=key)
        if isinstance(event, TrajectoryChunk):
            try:
                if verdict is None:
                    checked = check_chunk(event)  # the one check; its arrays are kept
                elif isinstance(verdict, ValueError):
                    raise verdict
                else:
                    checked = verdict
            except ValueError as exc:
                self._invalidate(tid, env, f"chunk {event.chunk_index}: {exc}")
                return
            ck = (event.segment_index, event.chunk_index)
            if ck in pending.chunks:
                self._duplicate_record(pending.chunks[ck][1], env)
                return
            pending.chunks[ck] = (checked, env)
            if event.final:
                pending.has_final = True
        else:
            if pending.reward is not None:
                self._duplicate_record(pending.reward[1], env)
                return
            pending.reward = (event, env)
        if pending.complete():
            self._complete(tid, pending, env)

    def _duplicate_record(self, held: Envelope, env: Envelope) -> None:
        """The same chunk or reward again. A copy at another offset is released (the
        held one, earlier in the log, keeps the commit back until it is done); the same
        record delivered again (after a rebalance) is not released at all, so the
        commit cannot move past work still in progress."""
        self.counters["duplicate_records"] += 1
        if _ref(held) != _ref(env):
            self._released.append(env)

    def forget_unfinished(self) -> None:
        """Drop everything not yet trained or dropped, after partitions were revoked:
        none of it was committed, so the consumer delivers it again. A batch being
        trained right now is kept (it is logged and acknowledged as usual)."""
        self.partial.clear()
        self.open_groups.clear()
        self.ready.clear()
        self._records = {tid: records for tid, records in self._records.items() if tid in self.training}
        for key in [k for k, reason in self.closed.items() if reason == "ready"]:
            del self.closed[key]
        # Drops not yet logged are undone: none of their records was acknowledged, so
        # they are delivered again and the group is decided again (and logged once).
        for pending in self.drops:
            key = (pending.drop.task_id, pending.drop.group_id)
            if self.closed.get(key) == pending.drop.reason:
                del self.closed[key]
            self.finished_ids.difference_update(pending.trajectory_ids)
            self.counters.subtract(pending.counted)
        self.drops.clear()
        self._released.clear()
        self.invalid.clear()

    def _complete(self, tid: str, pending: _Pending, last_env: Envelope) -> None:
        items = sorted(pending.chunks.items())
        chunks = [c for _, (c, _) in items]
        refs = [_ref(e) for _, (_, e) in items]
        reward, reward_env = pending.reward  # type: ignore[misc]
        try:
            traj = assemble(chunks, refs, reward, _ref(reward_env))
        except InvalidTrajectory as exc:
            self._invalidate(tid, last_env, str(exc))
            return
        del self.partial[tid]
        self._records[tid] = pending.envelopes()
        self.counters["trajectories_complete"] += 1
        self._place(traj)

    def _revive(self, key: GroupKey) -> bool:
        """Undo the ``abandoned`` drop of ``key`` while it is not in the step log yet:
        a record of the group arrived after all, so it is decided again. The evicted
        trajectories stay finished (their records are released now)."""
        for i, pending in enumerate(self.drops):
            if (pending.drop.task_id, pending.drop.group_id) == key and pending.drop.reason == "abandoned":
                del self.drops[i]
                del self.closed[key]
                self.counters["groups_dropped_abandoned"] -= 1
                self.counters["groups_revived"] += 1
                self._released.extend(pending.envelopes)
                log.info("abandoned group revived: a record of it arrived before the drop was logged",
                         task_id=key[0], group_id=key[1])
                return True
        return False

    def _fresher(self, traj: Trajectory, holder: Trajectory) -> bool:
        return traj.oldest_version > holder.oldest_version

    def _reopen(self, key: GroupKey) -> _OpenGroup | None:
        """Take a ready group (not yet in a batch) back into the open groups."""
        for i, g in enumerate(self.ready):
            if g.key == key:
                del self.ready[i]
                del self.closed[key]
                group = self.open_groups[key] = _OpenGroup(size=len(g.members))
                group.members = {t.sample_index: t for t in g.members}
                return group
        return None

    def _is_stale(self, t: Trajectory) -> bool:
        return self.current is not None and self._too_old(t.oldest_version, t.newest_version, self.current)

    def _retry_streaming(self, key: GroupKey, members: Iterable[Trajectory]) -> bool:
        """Whether another attempt than the stale members' holds something fresh of the
        group: a member, or an unfinished trajectory (one with no version yet counts:
        it is just starting)."""
        members = list(members)
        dead = {t.attempt for t in members if self._is_stale(t)}
        if any(not self._is_stale(t) and t.attempt not in dead for t in members):
            return True
        for pending in self.partial.values():
            if pending.group == key and pending.attempt() not in dead:
                versions = pending.versions()
                if versions is None or self.current is None or not self._too_old(*versions, self.current):
                    return True
        return False

    def _place(self, traj: Trajectory) -> None:
        key = (traj.task_id, traj.group_id)
        if self.closed.get(key) == "ready":
            ready = next((g for g in self.ready if g.key == key), None)
            members = ready.members if ready is not None else []
            holder = next((t for t in members if t.sample_index == traj.sample_index), None)
            if holder is not None and self._fresher(traj, holder):
                # A retry's sample, fresher than the one holding its slot: the group
                # is not taken yet, so it is reopened and decided with the fresher one.
                self._reopen(key)
        if key in self.closed:
            self._drop_late(traj.trajectory_id, key, self._take(traj.trajectory_id))
            return
        group = self.open_groups.setdefault(key, _OpenGroup(size=traj.group_size))
        if traj.group_size != group.size:
            records = self._take(traj.trajectory_id)
            self._invalidate(traj.trajectory_id, records[-1] if records else None,
                             f"group_size {traj.group_size} differs from the group's {group.size}",
                             envelopes=records)
            return
        holder = group.members.get(traj.sample_index)
        if holder is not None:
            # Keep the fresher attempt: the older one would go stale first and leave a
            # hole that the retry's (already dropped) sample could no longer fill.
            loser = holder if self._fresher(traj, holder) else traj
            self.counters["dropped_duplicate"] += 1
            self._finish(loser.trajectory_id, self._take(loser.trajectory_id))
            log.info("duplicate attempt dropped", trajectory_id=loser.trajectory_id, task_id=traj.task_id,
                     group_id=traj.group_id, sample_index=traj.sample_index)
            if loser is traj:
                return
        group.members[traj.sample_index] = traj
        if len(group.members) < group.size:
            return
        stale = [t for t in group.members.values() if self._is_stale(t)]
        if stale and self._retry_streaming(key, group.members.values()):
            # What a killed attempt left never completes a group a retry is streaming:
            # its stale samples go, their slots wait for the retry's.
            for t in stale:
                del group.members[t.sample_index]
                self.counters["trajectories_dropped_stale"] += 1
                self._finish(t.trajectory_id, self._take(t.trajectory_id))
            log.info("stale samples of a killed attempt evicted; the group waits for its retry", task_id=key[0],
                     group_id=key[1], evicted=[t.trajectory_id for t in stale])
            return
        del self.open_groups[key]
        complete = Group(traj.task_id, traj.group_id, [group.members[i] for i in sorted(group.members)])
        phases = sorted({t.reward.phase for t in complete.members})
        if len(phases) > 1:
            # Rewards of two phases are not comparable: advantages would reward the phase,
            # not the behaviour. Samplers grade a group in one phase, but attempts of a
            # retried group (or graders with reward.phase_unit = "version") may not agree.
            self._end_untrained(key, "invalid", self._take_members(complete.members),
                                counted=["dropped_mixed_phase"], error=f"mixed reward phases {phases}")
            return
        import torch

        if not has_reward_variance(torch.tensor(complete.rewards(), dtype=torch.float64)):
            self._end_untrained(key, "zero_variance", self._take_members(complete.members),
                                counted=["dropped_zero_variance"], members=len(complete.members))
            return
        self._mark_closed(key, "ready")
        self.ready.append(complete)

    def _take(self, tid: str) -> list[Envelope]:
        """The records of a complete trajectory, which leaves the assembler's hold."""
        return self._records.pop(tid, [])

    def _take_members(self, members: Iterable[Trajectory]) -> list[tuple[str, list[Envelope]]]:
        return [(t.trajectory_id, self._take(t.trajectory_id)) for t in members]

    def _drop_late(self, tid: str, key: GroupKey, envelopes: list[Envelope]) -> None:
        reason = self.closed.get(key, "")
        name = "dropped_duplicate" if reason in ("ready", "training", "trained") else "dropped_late"
        self.counters[name] += 1
        self._finish(tid, envelopes)

    def _invalidate(self, tid: str, env: Envelope | None, error: str, envelopes: list[Envelope] | None = None) -> None:
        self.counters["dropped_invalid"] += 1
        log.warning("invalid trajectory dropped", trajectory_id=tid, error=error)
        pending = self.partial.pop(tid, None)
        others = envelopes if envelopes is not None else (pending.envelopes() if pending else [])
        others = [e for e in others if e is not env]
        if env is not None:
            self.invalid.append((env, error))
        if pending is not None and pending.group is not None and pending.group not in self.closed:
            # A group missing a member can never be trained (a sampler that produced one
            # invalid trajectory of a task would produce it again on a retry). A group
            # that already ended (or is being trained) keeps its end.
            self._close_group(pending.group, "invalid", [(tid, others)], trajectory_id=tid, error=error)
        else:
            self._finish(tid, others)

    def _end_untrained(self, key: GroupKey, reason: str, trajectories: Iterable[tuple[str, list[Envelope]]],
                       counted: Iterable[str] = (), **why: Any) -> None:
        """End a group without training it: close its key (final), count the drop
        (``groups_dropped_<reason>`` and ``counted``), log it, and hold its records until
        the drop is in the step log (take_drops)."""
        self._mark_closed(key, reason)
        tids: list[str] = []
        held: list[Envelope] = []
        for tid, envelopes in trajectories:
            self.finished_ids.add(tid)
            tids.append(tid)
            held.extend(envelopes)
        counts = Counter(counted)
        counts[f"groups_dropped_{reason}"] += 1
        self.counters.update(counts)
        self.drops.append(_PendingDrop(GroupDrop(key[0], key[1], reason), tids, held, counts))
        log.warning("group dropped", task_id=key[0], group_id=key[1], reason=reason, **why)

    def _finish(self, tid: str, envelopes: Iterable[Envelope]) -> None:
        self.finished_ids.add(tid)
        self._released.extend(envelopes)

    def _mark_closed(self, key: GroupKey, reason: str) -> None:
        self.closed[key] = reason
        self.closed.move_to_end(key)
        while len(self.closed) > CLOSED_MEMORY:
            self.closed.popitem(last=False)

    def _close_group(self, key: GroupKey, reason: str, extra: list[tuple[str, list[Envelope]]], **why: Any) -> None:
        """Drop a group that is not complete: its members and unfinished trajectories go
        with it (and ``extra``, the trajectory that caused it)."""
        group = self.open_groups.pop(key, None)
        trajectories = list(extra)
        trajectories += self._take_members(group.members.values() if group else [])
        counted: list[str] = []
        for tid, pending in list(self.partial.items()):
            if pending.group == key:
                del self.partial[tid]
                counted.append(f"unfinished_dropped_{reason}")
                trajectories.append((tid, pending.envelopes()))
        self._end_untrained(key, reason, trajectories, counted=counted, **why)

    # -- output ----------------------------------------------------------------------------
    def released(self) -> list[Envelope]:
        """Records this assembler is done with (safe to acknowledge), drained."""
        out, self._released = self._released, []
        return out

    def take_invalid(self) -> list[tuple[Envelope, str]]:
        out, self.invalid = self.invalid, []
        return out

    def take_drops(self) -> tuple[list[GroupDrop], list[Envelope]]:
        """Groups dropped since the last call (for ``TrainStep.dropped``) and their
        records, to acknowledge in the transaction that logs them; drained."""
        drops, self.drops = self.drops, []
        return [d.drop for d in drops], [e for d in drops for e in d.envelopes]

    def _too_old(self, oldest: int, newest: int, current: int) -> bool:
        bound = current - self.cfg.max_staleness
        return (oldest if self.cfg.stale_policy == "drop_group" else newest) < bound

    def evict_stale(self, current: int) -> None:
        """Drop ready groups that are too old, and every unfinished trajectory or member
        of an incomplete group that is too old on its own. A ready (complete) group
        closes its key; an incomplete one only when nothing of it is left (abandoned)."""
        self.current = current
        keep: list[Group] = []
        for g in list(self.ready):
            if self._too_old(g.oldest_version, g.newest_version, current) and self._retry_streaming(g.key, g.members):
                # A retry of it is streaming: reopened without its stale members.
                del self.closed[g.key]
                group = self.open_groups[g.key] = _OpenGroup(size=len(g.members))
                for t in g.members:
                    if self._is_stale(t):
                        self.counters["trajectories_dropped_stale"] += 1
                        self._finish(t.trajectory_id, self._take(t.trajectory_id))
                    else:
                        group.members[t.sample_index] = t
                continue
            if self._too_old(g.oldest_version, g.newest_version, current):
                self._end_untrained(g.key, "stale", self._take_members(g.members),
                                    counted=["dropped_stale"], oldest_version=g.oldest_version,
                                    newest_version=g.newest_version, current=current)
            else:
                keep.append(g)
        self.ready = keep
        evicted: dict[GroupKey, list[tuple[str, list[Envelope]]]] = {}
        # Counted with the group's drop when the eviction abandons it (so a drop undone
        # by a revoke takes them back), else at once.
        evicted_counts: dict[GroupKey, Counter[str]] = {}
        for key, group in self.open_groups.items():
            for index, t in list(group.members.items()):
                if self._too_old(t.oldest_version, t.newest_version, current):
                    del group.members[index]
                    evicted_counts.setdefault(key, Counter())["trajectories_dropped_stale"] += 1
                    evicted.setdefault(key, []).append((t.trajectory_id, self._take(t.trajectory_id)))
        for tid, pending in list(self.partial.items()):
            versions = pending.versions()
            if versions is None or not self._too_old(*versions, current):
                continue
            del self.partial[tid]
            key = pending.group or ("", "")
            evicted_counts.setdefault(key, Counter()).update(["trajectories_dropped_stale", "unfinished_dropped_stale"])
            evicted.setdefault(key, []).append((tid, pending.envelopes()))
        if evicted:
            self._abandon_empty(evicted, evicted_counts, current)

    def _abandon_empty(self, evicted: dict[GroupKey, list[tuple[str, list[Envelope]]]],
                       evicted_counts: dict[GroupKey, Counter[str]], current: int) -> None:
        """Release the evicted trajectories; a group left with nothing held (every
        trajectory went stale, no retry streaming) is dropped as ``abandoned`` with the
        trajectories evicted last, whose records then wait for the step log (earlier
        evictions were released: after a crash the group is decided again from the
        records not yet acknowledged)."""
        live = {p.group for p in self.partial.values()}
        for key in sorted(evicted):
            trajectories = evicted[key]
            group = self.open_groups.get(key)
            if (group is not None and group.members) or key in live or key in self.closed or key == ("", ""):
                # Still alive, or it already ended (a leftover of another attempt of a
                # group trained or dropped before): only the trajectories go.
                self.counters.update(evicted_counts[key])
                for tid, envelopes in trajectories:
                    self._finish(tid, envelopes)
                continue
            self.open_groups.pop(key, None)
            self._end_untrained(key, "abandoned", trajectories, counted=evicted_counts[key], current=current,
                                max_staleness=self.cfg.max_staleness,
                                why="every trajectory of it went stale, no retry streaming")

    def take_batch(self, current: int, published: int) -> list[Group] | None:
        """``groups_per_step`` groups for the step that trains version ``current``, or
        None (nothing removed) when not enough are eligible yet."""
        self.evict_stale(current)
        want = self.cfg.groups_per_step
        frac = self.cfg.max_version_fraction
        limit = want if frac >= 1.0 else max(1, int(frac * want))
        relax = len(self.ready) > self.cfg.max_buffered_groups
        per_version: Counter[int] = Counter()
        chosen: list[int] = []
        deferred = relaxed = 0
        for i, g in enumerate(self.ready):
            v = g.newest_version
            if v < published and per_version[v] >= limit:
                if not relax:
                    deferred += 1
                    continue
                relaxed += 1
            chosen.append(i)
            per_version[v] += 1
            if len(chosen) == want:
                break
        if len(chosen) < want:
            return None
        self.counters["version_cap_deferred"] += deferred
        self.counters["version_cap_relaxed"] += relaxed
        picked = set(chosen)
        batch = [self.ready[i] for i in chosen]
        self.ready = [g for i, g in enumerate(self.ready) if i not in picked]
        for g in batch:
            self._mark_closed(g.key, "training")
            for t in g.members:
                self.training[t.trajectory_id] = g.key
        return batch

    def mark_trained(self, groups: Iterable[Group]) -> list[Envelope]:
        """Record a logged step's groups as trained; returns their records to ack."""
        out: list[Envelope] = []
        for g in groups:
            self._mark_closed(g.key, "trained")
            for t in g.members:
                self.trained_ids.add(t.trajectory_id)
                self.training.pop(t.trajectory_id, None)
                out.extend(self._take(t.trajectory_id))
            out.extend(self._held.pop(g.key, []))
        return out

    def buffered(self) -> dict[str, int]:
        return {"partial": len(self.partial), "open_groups": len(self.open_groups), "ready": len(self.ready)}
