"""The batch chunk check (``trainer.batch_check.check_chunks``) and what reads its result
give what the chunk-by-chunk path gives (issue #29): the same verdict for each chunk of
a batch mixing good, corrupt and other-layout chunks (the same error message, or the
same versions and arrays), the same assembled trajectories (arrays and dtypes) and the
same assembly errors, and ``Assembler.add_many`` ends in the state ``add`` one by one
ends in (dead letters and their reasons included). No Kafka, no model: a few seconds."""

from __future__ import annotations

import numpy as np
import msgspec
import pytest

from bus import Envelope
from schemas import RecordRef, Reward, TrajectoryChunk, arrays
from tests.test_chunk_arrays import broken, outcome, random_chunk
from tests.test_trajectory_assembly import _break, assert_same_segment, record
from trainer import trajectory
from trainer.assembler import Assembler
from trainer.batch_check import MIN_BATCH, check_chunks
from trainer.config import TrainerConfig


def usual(chunk: TrajectoryChunk, version: int = 3) -> TrajectoryChunk:
    """``chunk`` in the layout the batch pass takes: one version span, no routes, kept
    sizes and capped flags recorded."""
    n = chunk.num_tokens
    off = np.frombuffer(chunk.kept_offsets, dtype="<i4")
    capped = chunk.kept_capped or bytes(n)
    sizes = chunk.kept_sizes or np.where(np.frombuffer(capped, dtype=np.uint8) == 1, -1,
                                         np.diff(off)).astype("<i4").tobytes()
    return msgspec.structs.replace(chunk, version_starts=b"\0\0\0\0", versions=arrays.pack([version], arrays.INT64),
                                   routed_experts=b"", routed_experts_shape=[], kept_capped=capped, kept_sizes=sizes)


def verdict(v) -> tuple:
    if isinstance(v, ValueError):
        return ("error", str(v))
    return ("ok", v.oldest_generated, v.newest_generated, v.newest_loaded,
            outcome(lambda: trajectory.chunk_arrays(v)))


def one_by_one(chunks):
    out = []
    for c in chunks:
        try:
            out.append(trajectory.check_chunk(c))
        except ValueError as exc:
            out.append(exc)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_a_batch_of_good_and_corrupt_chunks_gets_the_verdicts_one_by_one_gives(seed):
    rng = np.random.default_rng(seed)
    batch = []
    for _ in range(150):
        c = random_chunk(rng)
        u = usual(c, int(rng.integers(-2, 9)))
        batch += [u, broken(u, rng)]
        if rng.random() < 0.3:
            batch.append(c)  # another layout: several spans, routes, schema 1
    order = rng.permutation(len(batch))
    batch = [batch[i] for i in order]
    got, want = check_chunks(batch), one_by_one(batch)
    assert [verdict(v) for v in got] == [verdict(v) for v in want]
    kinds = {verdict(v)[1].split(" ")[0] for v in want if isinstance(v, ValueError)}
    in_batch = sum(1 for v in got if not isinstance(v, ValueError) and v.arrays is None)
    # Most usual chunks were decided by the batch pass; the corrupt ones failed in many ways.
    assert in_batch > 120 and len(kinds) >= 6, (in_batch, kinds)


def test_a_small_batch_is_checked_one_by_one():
    rng = np.random.default_rng(5)
    batch = [usual(random_chunk(rng)) for _ in range(MIN_BATCH - 1)]
    got = check_chunks(batch)
    assert all(v.arrays is not None for v in got)
    assert [verdict(v) for v in got] == [verdict(v) for v in one_by_one(batch)]


def trajectories(seeds, greedy_every: int = 0):
    """Recorded trajectories (tests/test_trajectory_assembly.py's recorder runs) in the
    usual layout: chunks of one version each, no routes."""
    out = []
    for seed in seeds:
        chunks, reward = record(seed, routes=False, greedy=bool(greedy_every) and seed % greedy_every == 0)
        out.append(([usual(c, seed % 4) for c in chunks], reward))
    return out


def assemble(checked, reward):
    refs = [RecordRef("t", 0, i) for i in range(len(checked))]
    return trajectory.assemble(checked, refs, reward, RecordRef("r", 0, 0))


def test_trajectories_assembled_from_the_batch_check_are_the_same():
    trajs = trajectories(range(12), greedy_every=5)
    batch = [c for chunks, _ in trajs for c in chunks]
    verdicts = iter(check_chunks(batch))
    for chunks, reward in trajs:
        from_batch = [next(verdicts) for _ in chunks]
        assert all(v.arrays is None for v in from_batch)  # the bytes path of _segment
        new, old = assemble(from_batch, reward), assemble(one_by_one(chunks), reward)
        assert len(new.segments) == len(old.segments) >= 1
        for o, n in zip(old.segments, new.segments):
            assert_same_segment(o, n)
            assert all(getattr(n, f).flags.writeable for f in ("token_ids", "behaviour", "kept_ids", "kept_offsets"))
        assert (new.generated_tokens, new.oldest_version, new.newest_version) == (
            old.generated_tokens, old.oldest_version, old.newest_version)


@pytest.mark.parametrize("kind", ["not_in_kept_set", "non_finite", "empty_kept_set", "identity", "greedy_two"])
def test_broken_trajectories_fail_with_the_same_error_from_the_batch_check(kind):
    (chunks, reward), *others = trajectories([4 if kind == "greedy_two" else 7, 8, 9], greedy_every=4)
    victim = next(i for i, c in enumerate(chunks) if np.frombuffer(c.loss_mask, dtype=np.uint8).any())
    c = chunks[victim]
    if kind == "greedy_two":  # a second id in a greedy token's set
        mask = np.frombuffer(c.loss_mask, dtype=np.uint8)
        offsets = np.frombuffer(c.kept_offsets, dtype="<i4").copy()
        t = int(np.flatnonzero(mask)[0])
        ids = np.insert(np.frombuffer(c.kept_ids, dtype="<i4"), int(offsets[t + 1]), 7)
        offsets[t + 1:] += 1
        sizes = np.frombuffer(c.kept_sizes, dtype="<i4").copy()
        sizes[t] = 2
        chunks[victim] = msgspec.structs.replace(c, kept_offsets=offsets.tobytes(),
                                                 kept_ids=ids.astype("<i4").tobytes(), kept_sizes=sizes.tobytes())
    else:
        chunks[victim] = _break(kind, c)
    batch = chunks + [x for more, _ in others for x in more]
    from_batch = check_chunks(batch)[:len(chunks)]
    assert all(v.arrays is None for v in from_batch)
    errors = []
    for checked in (from_batch, one_by_one(chunks)):
        with pytest.raises(trajectory.InvalidTrajectory) as exc:
            assemble(checked, reward)
        errors.append(str(exc.value))
    assert errors[0] == errors[1] and reward.trajectory_id in errors[0]


def _envelopes():
    """Two groups of 4 (rewards that differ), each chunk an envelope; one chunk corrupt
    (its trajectory dead-lettered, its group invalid), one chunk twice."""
    out = []
    for g in range(2):
        for i in range(4):
            chunks, _ = record(100 + 4 * g + i, routes=False)
            chunks = sorted((usual(c, 1) for c in chunks), key=lambda c: (c.segment_index, c.chunk_index))
            tid = f"g{g}-{i}"
            chunks = [msgspec.structs.replace(c, trajectory_id=tid, task_id=f"t{g}", group_id=f"g{g}",
                                              sample_index=i) for c in chunks]
            reward = Reward(trajectory_id=tid, task_id=f"t{g}", group_id=f"g{g}", sample_index=i, attempt="a",
                            score=float(i % 2), reward=float(i % 2), weight_version=1)
            out += chunks + [reward]
    bad = next(i for i, e in enumerate(out) if isinstance(e, TrajectoryChunk) and e.trajectory_id == "g1-2")
    c = out[bad]  # an uncapped set's recorded size off by one: found by the batch pass itself
    sizes = np.frombuffer(c.kept_sizes, dtype="<i4").copy()
    t = int(np.flatnonzero(np.frombuffer(c.kept_capped, dtype=np.uint8) == 0)[0])
    sizes[t] += 1
    out[bad] = msgspec.structs.replace(c, kept_sizes=sizes.tobytes())
    out.insert(5, out[2])  # a copy of a chunk (a producer retry)
    return [Envelope(e, "t", 0, i, 0, None, ()) for i, e in enumerate(out)]


def _state(asm: Assembler, batches):
    ready = []
    while (batch := asm.take_batch(1, 1)) is not None:
        ready += [(g.key, [t.trajectory_id for t in g.members]) for g in batch]
    return (dict(asm.counters), [(env.offset, error) for env, error in asm.take_invalid()],
            sorted(e.offset for e in asm.released()), ready, batches)


def test_add_many_ends_as_add_one_by_one(monkeypatch):
    envs = _envelopes()
    cfg = TrainerConfig(groups_per_step=1, max_staleness=4)
    one = Assembler(cfg, current=1)
    for env in envs:
        one.add(env)
    many = Assembler(cfg, current=1)
    seen = []
    many_check = check_chunks

    def spy(chunks):
        out = many_check(chunks)
        seen.extend(v for v in out if not isinstance(v, ValueError) and v.arrays is None)
        return out

    monkeypatch.setattr("trainer.assembler.check_chunks", spy)
    for start in range(0, len(envs), 13):  # getmany batches
        many.add_many(envs[start:start + 13])
    assert len(seen) > len(envs) // 2  # most chunks were checked by the batch pass
    a, b = _state(one, None), _state(many, None)
    assert a == b
    assert len(a[1]) == 1 and "kept_sizes differs from the recorded ids" in a[1][0][1]  # dead-lettered, with why
    assert [key for key, _ in a[3]] == [("t0", "g0")]  # the other group is invalid


def test_a_chunk_whose_int32_row_lengths_wrap_around_is_refused_in_a_batch():
    from tests.test_chunk_arrays import wrapping_chunk

    bad = wrapping_chunk()
    rng = np.random.default_rng(11)
    batch = [usual(random_chunk(rng)) for _ in range(MIN_BATCH)] + [bad]
    got = check_chunks(batch)
    assert isinstance(got[-1], ValueError) and str(got[-1]).startswith("malformed CSR")
    assert [verdict(v) for v in got] == [verdict(v) for v in one_by_one(batch)]
