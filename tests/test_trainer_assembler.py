"""Batching rules (trainer/assembler.py) on real chunk/reward events sampled from the
tiny model. No Kafka here: envelopes carry made-up positions (the Kafka path is in
tests/test_trainer_kafka.py)."""

from __future__ import annotations

import dataclasses
import itertools

import msgspec
import pytest

from bus import Envelope
from schemas import GroupDrop
from tests.synthetic import SampledTrajectory, load_tiny, make_task_groups, to_events
from tests.trainer_helpers import one_thread  # noqa: F401  autouse fixture
from trainer.assembler import Assembler
from trainer.config import TrainerConfig

_offsets = itertools.count()


@pytest.fixture(scope="module")
def sampled(tiny_model_path) -> list[list[SampledTrajectory]]:
    model, tok = load_tiny(str(tiny_model_path))
    return make_task_groups(model, tok, 3, group_size=4, max_new_tokens=8, env_after=3, seed=7)


def envs(traj: SampledTrajectory, *, reward: float | None = None, chunk_tokens: int = 16):
    chunks, rew = to_events(traj, reward=reward, chunk_tokens=chunk_tokens)
    out = [Envelope(c, "t.trajectories", 0, next(_offsets), 0, None, ()) for c in chunks]
    out.append(Envelope(rew, "t.rewards", 0, next(_offsets), 0, None, ()))
    return out


def with_versions(traj: SampledTrajectory, versions: list[int]) -> SampledTrajectory:
    return dataclasses.replace(traj, versions=versions)


def feed(asm: Assembler, items) -> None:
    for env in items:
        asm.add(env)


def cfg(**kw) -> TrainerConfig:
    base = dict(groups_per_step=1, max_staleness=4)
    base.update(kw)
    return TrainerConfig(**base)


def test_complete_group_is_ready_with_records_in_order(sampled):
    asm = Assembler(cfg())
    group = sampled[0]
    all_envs = [envs(t) for t in group]
    # Interleave: every trajectory's first chunk, then the rest, rewards first for one.
    feed(asm, [e[0] for e in all_envs])
    assert asm.take_batch(0, 0) is None
    feed(asm, [all_envs[2][-1]])  # a reward before its trajectory's last chunks
    fed = {e[0].offset for e in all_envs} | {all_envs[2][-1].offset}
    feed(asm, [x for e in all_envs for x in e if x.offset not in fed])
    batch = asm.take_batch(0, 0)
    assert batch is not None and len(batch) == 1
    (g,) = batch
    assert [t.sample_index for t in g.members] == [0, 1, 2, 3]
    for t, e in zip(g.members, all_envs):
        assert t.chunk_refs == [x.ref for x in e[:-1]]
        assert t.reward_ref == e[-1].ref
        assert sum(s.num_tokens for s in t.segments) == len(group[t.sample_index].token_ids)
    assert asm.released() == []  # nothing is acked before the step is logged
    acked = asm.mark_trained(batch)
    assert sorted(x.offset for x in acked) == sorted(x.offset for e in all_envs for x in e)
    # Records of a trained trajectory seen again (re-read after a restart) are released.
    feed(asm, all_envs[0])
    assert len(asm.released()) == len(all_envs[0])
    assert asm.counters["records_already_done"] == len(all_envs[0])


def test_first_complete_attempt_wins_and_duplicates_are_counted(sampled):
    asm = Assembler(cfg())
    group = sampled[1]
    retry = dataclasses.replace(group[1], attempt="a1")  # another sampler redid sample 1
    slow = envs(group[1])
    fast = envs(retry)
    feed(asm, slow[:1])  # the first attempt started first ...
    feed(asm, fast)  # ... but the retry completed first: it wins
    feed(asm, slow[1:])
    assert asm.counters["dropped_duplicate"] == 1
    assert {e.offset for e in asm.released()} == {e.offset for e in slow}
    for i in (0, 2, 3):
        feed(asm, envs(group[i]))
    (g,) = asm.take_batch(0, 0)
    assert g.members[1].attempt == "a1"
    asm.mark_trained([g])
    # A third attempt arriving after the group was trained is a late duplicate.
    late = envs(dataclasses.replace(group[1], attempt="a2"))
    feed(asm, late)
    assert asm.counters["dropped_duplicate"] == 2
    assert {e.offset for e in asm.released()} == {e.offset for e in late}
    # A redelivered record of a trajectory in progress is ignored, not double counted.
    asm2 = Assembler(cfg())
    e = envs(group[0])
    feed(asm2, [e[0], e[0]])
    assert asm2.counters["duplicate_records"] == 1
    assert asm2.released() == []  # the same position again: nothing may be acked yet
    copy = Envelope(e[0].event, "t.trajectories", 0, next(_offsets), 0, None, ())
    feed(asm2, [copy])  # the same chunk published twice: the later copy is released
    assert asm2.released() == [copy]


def test_a_copy_of_a_complete_trajectory_waiting_in_its_group_keeps_the_original_records(sampled):
    """Every record of a complete trajectory published again (a producer retry) while
    its group is still open: the copies are released as duplicates, and training the
    group acknowledges the original records (a copy that replaced them left the
    originals unacknowledged and the partition's commit stuck)."""
    asm = Assembler(cfg())
    group = sampled[2]
    original = [envs(t) for t in group]
    feed(asm, original[0])  # complete, waiting for its three siblings
    copies = [Envelope(e.event, e.topic, e.partition, next(_offsets), 0, None, ()) for e in original[0]]
    feed(asm, copies)
    assert asm.counters["duplicate_records"] == len(copies)
    assert asm.counters["dropped_duplicate"] == 0
    assert {e.offset for e in asm.released()} == {e.offset for e in copies}
    feed(asm, original[0][:1])  # the same record again (a redelivery): not released
    assert asm.released() == []
    for e in original[1:]:
        feed(asm, e)
    (g,) = asm.take_batch(0, 0)
    assert [t.sample_index for t in g.members] == [0, 1, 2, 3]
    acked = asm.mark_trained([g])
    assert sorted(x.offset for x in acked) == sorted(x.offset for e in original for x in e)


def test_revoked_partitions_drop_unfinished_work_but_not_the_batch_in_training(sampled):
    asm = Assembler(cfg())
    first = [envs(t) for t in sampled[0]]
    second = [envs(t) for t in sampled[1]]
    for e in first + second:
        feed(asm, e)
    (training,) = asm.take_batch(0, 0)
    feed(asm, envs(sampled[2][0])[:1])
    asm.forget_unfinished()
    assert not asm.ready and not asm.partial and not asm.open_groups
    # Everything is delivered again from the committed offsets: the group that was
    # ready is rebuilt, the one in training is not offered twice.
    for e in first + second:
        feed(asm, e)
    (again,) = asm.take_batch(0, 0)
    assert {again.key, training.key} == {("task-0", "g0"), ("task-1", "g1")}
    # The training group's records, delivered again, are held until its step is logged.
    redelivered = [x for e in (first if training.key == ("task-0", "g0") else second) for x in e]
    assert asm.counters["records_redelivered"] == len(redelivered)
    assert asm.counters["dropped_duplicate"] == 0
    assert not any(x in asm.released() for x in redelivered)
    acked = asm.mark_trained([training])
    assert sum(x in acked for x in redelivered) == len(redelivered)
    assert len(acked) == 2 * len(redelivered)


def test_zero_variance_group_is_dropped_and_counted(sampled):
    asm = Assembler(cfg())
    all_envs = [envs(t, reward=0.5) for t in sampled[2]]
    for e in all_envs:
        feed(asm, e)
    assert asm.take_batch(0, 0) is None
    assert asm.counters["dropped_zero_variance"] == 1
    assert asm.counters["groups_dropped_zero_variance"] == 1
    # The drop goes into the next step's log entry; its records are acked with it.
    assert asm.released() == []
    drops, held = asm.take_drops()
    assert drops == [GroupDrop("task-2", "g2", "zero_variance")]
    assert sorted(x.offset for x in held) == sorted(x.offset for e in all_envs for x in e)
    assert asm.take_drops() == ([], [])


@pytest.mark.parametrize("policy", ["drop_group", "mask_tokens"])
def test_stale_groups_are_dropped_and_counted(sampled, policy):
    n = len(sampled[0][0].token_ids)
    asm = Assembler(cfg(max_staleness=2, stale_policy=policy))
    # Per-token versions come from the spans: sample 3 began at version 1, ended at 4.
    versions = [[4] * n, [4] * n, [3] * n, [1] * (n - 3) + [4] * 3]
    for t, v in zip(sampled[0], versions):
        feed(asm, envs(with_versions(t, v)))
    assert asm.ready[0].oldest_version == 1 and asm.ready[0].newest_version == 4
    if policy == "drop_group":
        # Training version 4: tokens of version 1 are 3 > 2 behind.
        assert asm.take_batch(4, 4) is None
        assert asm.counters["dropped_stale"] == 1
        drops, held = asm.take_drops()
        assert drops == [GroupDrop("task-0", "g0", "stale")]
        assert len(held) == sum(len(envs(t)) for t in sampled[0]) and asm.released() == []
    else:
        # mask_tokens keeps the group while any token is fresh enough.
        assert asm.take_batch(4, 4) is not None
        assert asm.counters["dropped_stale"] == 0
    # Training version 3 would have been fine in both policies.
    asm = Assembler(cfg(max_staleness=2, stale_policy=policy))
    for t, v in zip(sampled[0], versions):
        feed(asm, envs(with_versions(t, v)))
    assert asm.take_batch(3, 3) is not None


def test_unfinished_stale_trajectories_are_evicted(sampled):
    asm = Assembler(cfg(max_staleness=1))
    n = len(sampled[0][0].token_ids)
    e = envs(with_versions(sampled[0][0], [0] * n), chunk_tokens=8)
    feed(asm, e[:2])  # never finishes: its sampler died
    done = envs(with_versions(sampled[0][1], [0] * n))
    feed(asm, done)
    assert asm.take_batch(1, 1) is None and asm.partial  # 1 behind: still fine
    assert asm.take_batch(2, 2) is None
    assert not asm.partial and not asm.open_groups
    assert asm.counters["trajectories_dropped_stale"] == 2  # the unfinished one and the complete one
    assert asm.counters["unfinished_dropped_stale"] == 1
    # Nothing of the group is held any more: dropped (abandoned), once, key closed.
    assert asm.counters["groups_dropped_abandoned"] == 1
    assert asm.counters["dropped_stale"] == 0  # no complete group was dropped
    assert asm.released() == []
    drops, held = asm.take_drops()
    assert drops == [GroupDrop("task-0", "g0", "abandoned")]
    assert {x.offset for x in held} == {x.offset for x in e[:2] + done}
    assert asm.closed[("task-0", "g0")] == "abandoned"
    # The dead attempt's last chunks arriving later are released at once.
    feed(asm, e[2:])
    assert {x.offset for x in asm.released()} == {x.offset for x in e[2:]}
    assert asm.counters["records_already_done"] == len(e) - 2


@pytest.mark.parametrize("leftover", ["unfinished", "complete"])
def test_a_retry_after_a_stale_leftover_of_a_killed_attempt_is_trained(sampled, leftover):
    # Issue 13: attempt a0 of a group was killed; what it left (an unfinished
    # trajectory, or one complete sample) goes stale while the retry a1 streams. The
    # leftover alone is evicted, the key stays open, the retry completes the group and
    # it is trained.
    asm = Assembler(cfg(max_staleness=1))
    n = len(sampled[0][0].token_ids)
    dead = envs(with_versions(sampled[0][0], [0] * n), chunk_tokens=8)
    feed(asm, dead[:2] if leftover == "unfinished" else dead)
    retry = [envs(dataclasses.replace(t, attempt="a1", versions=[2] * n)) for t in sampled[0]]
    feed(asm, retry[0][:1])  # the retry's first chunk
    assert asm.take_batch(2, 2) is None  # the leftover is 2 > 1 versions behind: evicted
    assert asm.counters["trajectories_dropped_stale"] == 1
    assert asm.take_drops() == ([], [])  # the group is not dropped: the retry holds it
    assert ("task-0", "g0") not in asm.closed
    assert {x.offset for x in asm.released()} == {x.offset for x in (dead[:2] if leftover == "unfinished" else dead)}
    feed(asm, retry[0][1:])
    for e in retry[1:]:
        feed(asm, e)
    (g,) = asm.take_batch(2, 2)
    assert g.key == ("task-0", "g0")
    assert [t.attempt for t in g.members] == ["a1"] * 4
    assert asm.counters["dropped_late"] == 0 and asm.counters["dropped_duplicate"] == 0


def test_an_abandoned_group_is_final_a_later_retry_is_late(sampled):
    # Issue 13: every trajectory of attempt a0 went stale before anything of a retry
    # arrived: the group is dropped (abandoned) once. A retry arriving after that is
    # late: the group is never both dropped and trained.
    asm = Assembler(cfg(max_staleness=1))
    n = len(sampled[0][0].token_ids)
    dead = envs(with_versions(sampled[0][0], [0] * n), chunk_tokens=8)
    feed(asm, dead[:2])
    assert asm.take_batch(2, 2) is None
    drops, _ = asm.take_drops()
    assert drops == [GroupDrop("task-0", "g0", "abandoned")]
    retry = [envs(dataclasses.replace(t, attempt="a1", versions=[2] * n)) for t in sampled[0]]
    for e in retry:
        feed(asm, e)
    assert asm.take_batch(2, 2) is None and not asm.ready and not asm.open_groups and not asm.partial
    assert asm.counters["dropped_late"] == 4
    assert {x.offset for x in asm.released()} == {x.offset for e in retry for x in e}
    assert asm.take_drops() == ([], [])  # not dropped a second time
    assert asm.counters["groups_dropped_abandoned"] == 1


def test_a_stale_leftover_of_a_trained_group_does_not_drop_it(sampled):
    # An attempt that started before the group completed (and was trained) goes stale
    # later: only its records go, the trained group is not also dropped.
    asm = Assembler(cfg(max_staleness=1))
    n = len(sampled[0][0].token_ids)
    other = envs(dataclasses.replace(sampled[0][0], attempt="a1", versions=[0] * n), chunk_tokens=8)
    feed(asm, other[:1])
    for t in sampled[0]:
        feed(asm, envs(with_versions(t, [0] * n)))
    (g,) = asm.take_batch(0, 0)
    asm.mark_trained([g])
    assert asm.take_batch(3, 3) is None
    assert asm.counters["trajectories_dropped_stale"] == 1
    assert asm.take_drops() == ([], []) and asm.closed[g.key] == "trained"
    assert [x.offset for x in asm.released()] == [other[0].offset]


def test_a_drop_not_yet_logged_is_undone_by_a_revoke_and_decided_once_again(sampled):
    # Partitions revoked before the next step logged the drop: none of its records was
    # acknowledged, they come again, and the group is dropped once (not twice).
    asm = Assembler(cfg())
    all_envs = [envs(t, reward=0.5) for t in sampled[2]]
    for e in all_envs:
        feed(asm, e)
    asm.forget_unfinished()
    assert ("task-2", "g2") not in asm.closed
    for e in all_envs:
        feed(asm, e)
    drops, held = asm.take_drops()
    assert drops == [GroupDrop("task-2", "g2", "zero_variance")]
    assert len(held) == sum(len(e) for e in all_envs)


@pytest.mark.parametrize("reason", ["zero_variance", "abandoned"])
def test_a_drop_decided_again_after_a_redelivery_is_counted_once(sampled, reason):
    # Review finding (issue 13): the counters behind count_groups_dropped_<reason> (and
    # the view's drop figures) counted an undone drop and its re-decision: 2 drops of 1 group.
    asm = Assembler(cfg(max_staleness=1))
    n = len(sampled[2][0].token_ids)
    if reason == "zero_variance":
        records = [x for t in sampled[2] for x in envs(t, reward=0.5)]
        per_drop = {"groups_dropped_zero_variance": 1, "dropped_zero_variance": 1}
    else:
        records = envs(with_versions(sampled[2][0], [0] * n), chunk_tokens=8)[:2]  # its sampler died
        per_drop = {"groups_dropped_abandoned": 1, "trajectories_dropped_stale": 1, "unfinished_dropped_stale": 1}

    def decide() -> None:
        feed(asm, records)
        assert asm.take_batch(2, 2) is None

    decide()
    assert {k: asm.counters[k] for k in per_drop} == per_drop
    asm.forget_unfinished()  # revoked before the next step logged the drop
    assert {k: asm.counters[k] for k in per_drop} == {k: 0 for k in per_drop}
    decide()  # the same records delivered again: the same drop, decided once more
    assert {k: asm.counters[k] for k in per_drop} == per_drop
    drops, _ = asm.take_drops()
    assert drops == [GroupDrop("task-2", "g2", reason)]


def test_groups_dropped_before_a_restart_are_not_dropped_again(sampled):
    # TrainStep.dropped of earlier steps: the restarted assembler closes those keys;
    # their records re-read (the commit had not passed them) are released as late.
    asm = Assembler(cfg(), dropped_groups=[(("task-2", "g2"), "zero_variance")])
    again = [envs(t, reward=0.5) for t in sampled[2]]
    for e in again:
        feed(asm, e)
    assert asm.take_drops() == ([], [])
    assert asm.counters["dropped_late"] == 4 and asm.counters["groups_dropped_zero_variance"] == 0
    assert len(asm.released()) == sum(len(e) for e in again)


def test_a_fresher_attempt_replaces_an_older_sample_in_its_slot(sampled):
    # Sample 1 of attempt a0 finished at version 0; the retry's sample 1 (version 2)
    # takes the slot. Before, the retry's sample was dropped as a duplicate and the
    # group, holding the old sample, went stale as a whole.
    asm = Assembler(cfg(max_staleness=1))
    n = len(sampled[1][0].token_ids)
    old = envs(with_versions(sampled[1][1], [0] * n))
    feed(asm, old)
    retry = [dataclasses.replace(t, attempt="a1", versions=[2] * n) for t in sampled[1]]
    for t in retry:
        feed(asm, envs(t))
    assert asm.counters["dropped_duplicate"] == 1
    assert {x.offset for x in asm.released()} == {x.offset for x in old}
    (g,) = asm.take_batch(2, 2)
    assert [t.attempt for t in g.members] == ["a1"] * 4
    assert asm.counters["dropped_stale"] == 0


def test_groups_trained_before_a_restart_are_not_trained_again(sampled):
    # The step log's TrainStep.groups: a restarted trainer's assembler gets the keys,
    # and the group re-sampled under a new attempt id is a duplicate, never trained.
    asm = Assembler(cfg(), trained_ids=[t.trajectory_id for t in sampled[0]], trained_groups=[("task-0", "g0")])
    again = [envs(dataclasses.replace(t, attempt="a9")) for t in sampled[0]]
    for e in again:
        feed(asm, e)
    assert asm.take_batch(0, 0) is None and not asm.open_groups and not asm.partial
    assert asm.counters["dropped_duplicate"] == 4
    assert len(asm.released()) == sum(len(e) for e in again)


def test_version_cap_limits_one_old_version_per_batch(sampled):
    n = len(sampled[0][0].token_ids)
    c = cfg(groups_per_step=4, max_version_fraction=0.5, max_staleness=10)

    def fill(asm: Assembler, version: int, copies: int, tag: str) -> None:
        for k in range(copies):
            for t in sampled[k % 3]:
                t = dataclasses.replace(t, group_id=f"{tag}{k}", versions=[version] * n)
                feed(asm, envs(t))

    asm = Assembler(c)
    fill(asm, 0, 5, "old")
    fill(asm, 1, 2, "new")
    batch = asm.take_batch(current=1, published=1)
    assert sorted(g.newest_version for g in batch) == [0, 0, 1, 1]
    assert asm.counters["version_cap_deferred"] >= 1
    # Only old-version groups left (3 of v0): at most 2 per batch -> wait.
    assert asm.take_batch(current=1, published=1) is None
    # Groups of the newest published version are never capped (no deadlock at start).
    asm = Assembler(c)
    fill(asm, 0, 4, "v0")
    assert len(asm.take_batch(current=0, published=0)) == 4
    # A backlog beyond max_buffered_groups lifts the cap for that batch.
    asm = Assembler(msgspec.structs.replace(c, max_buffered_groups=3))
    fill(asm, 0, 5, "old")
    assert len(asm.take_batch(current=1, published=1)) == 4
    assert asm.counters["version_cap_relaxed"] == 2


def test_invalid_chunk_is_dead_lettered_and_its_group_closed(sampled):
    asm = Assembler(cfg())
    group = sampled[0]
    bad = envs(group[0])
    broken = msgspec.structs.replace(bad[0].event, logprobs=b"\x00\x00")
    bad[0] = Envelope(broken, "t.trajectories", 0, next(_offsets), 0, None, ())
    feed(asm, bad)
    (env, error), = asm.take_invalid()
    assert env is bad[0] and "logprobs" in error
    assert asm.counters["dropped_invalid"] == 1
    for t in group[1:]:
        feed(asm, envs(t))
    assert asm.take_batch(0, 0) is None  # the group lost a member for good
    assert asm.counters["dropped_late"] == 3
    drops, _ = asm.take_drops()
    assert drops == [GroupDrop("task-0", "g0", "invalid")]


def test_generated_token_outside_its_kept_set_is_refused(sampled):
    asm = Assembler(cfg())
    t = sampled[0][0]
    i = t.loss_mask.index(1)
    kept = [list(k) for k in t.kept]
    kept[i] = [x for x in kept[i] if x != t.token_ids[i]] or [t.token_ids[i] + 1]
    feed(asm, envs(dataclasses.replace(t, kept=kept)))
    (env, error), = asm.take_invalid()
    assert "not in its kept set" in error


def test_group_with_rewards_of_two_phases_is_dropped_invalid(sampled):
    """Attempts of a retried group graded on either side of a phase boundary: their
    rewards are not comparable, so the group is never trained (issue #14 item 3)."""
    asm = Assembler(cfg())
    all_envs = [envs(t, reward=float(t.sample_index)) for t in sampled[1]]
    last = all_envs[3][-1]
    budget = msgspec.structs.replace(last.event, phase="budget")
    all_envs[3][-1] = Envelope(budget, last.topic, last.partition, last.offset, 0, None, ())
    for e in all_envs:
        feed(asm, e)
    assert asm.take_batch(0, 0) is None
    assert asm.counters["dropped_mixed_phase"] == 1 and asm.counters["groups_dropped_invalid"] == 1
    drops, held = asm.take_drops()
    assert drops == [GroupDrop("task-1", "g1", "invalid")]
    assert sorted(x.offset for x in held) == sorted(x.offset for e in all_envs for x in e)


# -- a live retry against what a killed attempt left (issue #30, point 4) --------------------
def _retry_pieces(sampled):
    """A group of 2: attempt a0 was killed (its sample 0 complete at version 0, stale
    for the step training version 2; its sample 1 unfinished), attempt a1 retries both
    at version 2 (sample 0 in two parts: its first chunk, then the rest)."""
    def traj(i: int, attempt: str, version: int):
        base = sampled[0][i]
        return dataclasses.replace(base, group_size=2, attempt=attempt, versions=[version] * len(base.token_ids))

    def records(i, attempt, version):
        return envs(traj(i, attempt, version), reward=float(i), chunk_tokens=8)

    r0 = records(0, "a1", 2)
    return {"K0": records(0, "a0", 0), "K1": records(1, "a0", 0)[:1], "R0a": r0[:1], "R0b": r0[1:],
            "R1": records(1, "a1", 2)}


class _Run:
    """An assembler driven like the trainer's loop: records in, eviction ticks
    (``take_batch``), a batch taken is trained and logged at once with the drops held
    (``mark_trained`` + ``take_drops``), the acknowledged records kept."""

    def __init__(self, **kw) -> None:
        self.asm = Assembler(cfg(max_staleness=1), current=2, **kw)
        self.trained: list = []
        self.drops: list = []
        self.acked: list = []

    def feed(self, records) -> None:
        feed(self.asm, records)
        self.acked += self.asm.released()

    def tick(self) -> None:
        batch = self.asm.take_batch(2, 2)
        self.acked += self.asm.released()
        if batch is not None:
            self.trained += batch
            self.acked += self.asm.mark_trained(batch)
            drops, held = self.asm.take_drops()
            self.drops += drops
            self.acked += held


@pytest.mark.parametrize("cut", ["none", "revoke", "restart"])
def test_a_live_retry_beats_a_killed_attempts_stale_sample_in_every_arrival_order(sampled, cut):
    """Every order of: the killed attempt's stale complete sample (K0) and unfinished one
    (K1), the retry's samples (R0 in two parts, R1) and an eviction tick (E). The group
    trains the retry's two samples exactly once, is never dropped, and every record is
    acknowledged. ``revoke``/``restart``: half-way, the partitions are revoked (or the
    trainer restarts) and every record not yet acknowledged is read again in one batch.
    Before: K0 took its slot, completed the group with R1 and the group was dropped
    stale (or abandoned at E), the retry's R0 thrown away."""
    pieces = _retry_pieces(sampled)
    everything = {e.offset for records in pieces.values() for e in records}
    retry_ids = {pieces[k][0].event.trajectory_id for k in ("R0a", "R1")}
    orders = list(itertools.permutations([*pieces, "E"]))
    for order in orders:
        run = _Run()
        fed: list = []
        for i, step in enumerate(order):
            if cut != "none" and i == len(order) // 2:
                unacked = [e for e in fed if e.offset not in {a.offset for a in run.acked}]
                if cut == "revoke":
                    run.asm.forget_unfinished()
                else:
                    trained = run.trained
                    old, run = run, _Run(trained_ids=[t.trajectory_id for g in trained for t in g.members],
                                         trained_groups=[g.key for g in trained])
                    run.trained, run.acked, run.drops = old.trained, old.acked, old.drops
                run.feed(unacked)  # re-read from the committed offsets, one batch
            if step == "E":
                run.tick()
            else:
                run.feed(pieces[step])
                fed += pieces[step]
        run.tick()
        where = f"order {' '.join(order)}, {cut}"
        assert len(run.trained) == 1, where
        (group,) = run.trained
        assert {t.trajectory_id for t in group.members} == retry_ids, where
        assert [t.attempt for t in group.members] == ["a1", "a1"], where
        assert run.drops == [] and run.asm.take_drops() == ([], []), where
        assert {e.offset for e in run.acked} == everything, where
        if cut == "none":
            assert sorted(e.offset for e in run.acked) == sorted(everything), f"acked twice: {where}"
    assert len(orders) == 720
