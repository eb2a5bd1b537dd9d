"""The trainer's chunk check and assembly (``trainer/trajectory.py``) give exactly what
they gave before issue #29's intake work (``benchmarks/trajectory_baseline.py``, a frozen
copy): the same arrays (values and dtypes) and version bookkeeping for random
trajectories over several seeds, and the same errors for broken ones.

The trajectories are recorded by the real recorder: several segments, weight versions
changing inside chunks, capped and greedy kept sets, MoE routes on some chunks only,
chunks in either index layout (across the trajectory or per segment), shuffled."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from benchmarks import trajectory_baseline as before
from sampler.engine import SampledToken
from sampler.recorder import TrajectoryIdentity, TrajectoryRecorder
from schemas import Cost, RecordRef, Reward, TrajectoryChunk
from trainer import trajectory as after

VOCAB = 5_000
SEGMENT_FIELDS = ["token_ids", "loss_mask", "behaviour", "kept_offsets", "kept_ids", "capped", "versions",
                  "temperature", "kept_size", "routes"]


def record(seed: int, *, routes: bool = True, greedy: bool = False) -> tuple[list[TrajectoryChunk], Reward]:
    """One trajectory's chunks (shuffled) and reward, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    temperature = 0.0 if greedy else float(rng.choice([1.0, 0.7]))
    ident = TrajectoryIdentity(trajectory_id=f"traj-{seed}", task_id="task", group_id="g", sample_index=1,
                               group_size=4, attempt="a", replica_id="r", temperature=temperature)
    chunks: list[TrajectoryChunk] = []

    async def publish(chunk: TrajectoryChunk) -> None:
        chunks.append(chunk)

    rec = TrajectoryRecorder(ident, publish, chunk_tokens=int(rng.integers(8, 64)))
    version = int(rng.integers(0, 5))
    layers, top_k = 2, 3

    async def run() -> None:
        nonlocal version
        for segment in range(int(rng.integers(1, 4))):
            if segment:
                await rec.new_segment()
            for _ in range(int(rng.integers(1, 4))):
                await rec.add_env(rng.integers(0, VOCAB, size=int(rng.integers(1, 40))).tolist(), version)
                for _ in range(int(rng.integers(1, 90))):
                    if rng.random() < 0.03:
                        version += 1  # a weight update mid-chunk: a new version span
                    if greedy:
                        size, capped = 1, False
                    else:
                        size = int(rng.choice([1, 2, 5, 17, 40, 70]))
                        capped = size > 64
                    kept = rng.choice(VOCAB, size=65 if capped else size, replace=False).astype(np.int32)
                    routed = (rng.integers(0, 8, size=(layers, top_k)).astype(np.int16)
                              if routes and rng.random() < 0.5 else None)
                    token = SampledToken(0, int(kept[int(rng.integers(0, kept.size))]),
                                         float(-rng.exponential()), kept, capped, version, routed_experts=routed,
                                         kept_size=-1 if capped else size)
                    await rec.add_sampled(token)
        await rec.finish("stop", Cost(generated_tokens=rec.generated_tokens, env_tokens=rec.env_tokens))

    asyncio.run(run())
    if rng.random() < 0.5:  # the other index layout: chunk_index counts within each segment
        counts: dict[int, int] = {}
        relaid = []
        for c in chunks:
            relaid.append(msgspec.structs.replace(c, chunk_index=counts.get(c.segment_index, 0)))
            counts[c.segment_index] = counts.get(c.segment_index, 0) + 1
        chunks = relaid
    order = rng.permutation(len(chunks))
    reward = Reward(trajectory_id=ident.trajectory_id, task_id="task", group_id="g", sample_index=1, attempt="a",
                    score=1.0, reward=0.5, weight_version=version)
    return [chunks[i] for i in order], reward


def assemble_both(chunks: list[TrajectoryChunk], reward: Reward):
    refs = [RecordRef("t", 0, i) for i in range(len(chunks))]
    results = []
    for module in (before, after):
        checked = [module.check_chunk(c) for c in chunks]
        results.append((checked, module.assemble(checked, refs, reward, RecordRef("r", 0, 0))))
    return results


def assert_same_segment(old, new) -> None:
    for name in SEGMENT_FIELDS:
        a, b = getattr(old, name), getattr(new, name)
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert np.array_equal(a, b), name


@pytest.mark.parametrize("seed", range(12))
def test_assembly_is_unchanged(seed):
    chunks, reward = record(seed, routes=seed % 3 != 0, greedy=seed % 5 == 4)
    (old_checked, old), (new_checked, new) = assemble_both(chunks, reward)
    for o, n in zip(old_checked, new_checked):
        assert (o.oldest_generated, o.newest_generated, o.newest_loaded) == (
            n.oldest_generated, n.newest_generated, n.newest_loaded)
    assert len(new.segments) == len(old.segments) >= 1
    for o, n in zip(old.segments, new.segments):
        assert_same_segment(o, n)
    assert msgspec.structs.astuple(after.key_of(new)) == msgspec.structs.astuple(after.key_of(old))
    assert (new.chunk_refs, new.reward_ref, new.reward, new.finish_reason) == (
        old.chunk_refs, old.reward_ref, old.reward, old.finish_reason)
    assert (new.generated_tokens, new.oldest_version, new.newest_version) == (
        old.generated_tokens, old.oldest_version, old.newest_version)
    assert np.array_equal(new.generated_versions(), old.generated_versions())


def test_versions_of_a_trajectory_without_generated_tokens_are_the_rewards():
    chunks, reward = record(3)
    env_only = [msgspec.structs.replace(c, loss_mask=bytes(c.num_tokens),
                                        kept_offsets=bytes(4 * (c.num_tokens + 1)), kept_ids=b"",
                                        kept_sizes=bytes(4 * c.num_tokens), kept_capped=b"")
                for c in chunks]
    (old_checked, old), (new_checked, new) = assemble_both(env_only, reward)
    assert all(c.oldest_generated is None and c.newest_generated is None for c in new_checked)
    assert [c.newest_loaded for c in new_checked] == [c.newest_loaded for c in old_checked]
    assert new.generated_tokens == old.generated_tokens == 0
    assert new.oldest_version == new.newest_version == reward.weight_version == old.oldest_version


def _break(kind: str, chunk: TrajectoryChunk) -> TrajectoryChunk:
    mask = np.frombuffer(chunk.loss_mask, dtype=np.uint8)
    offsets = np.frombuffer(chunk.kept_offsets, dtype="<i4")
    ids = np.frombuffer(chunk.kept_ids, dtype="<i4").copy()
    t = int(np.flatnonzero(mask)[0])  # the chunk's first generated token
    if kind == "not_in_kept_set":
        tokens = np.frombuffer(chunk.token_ids, dtype="<i4").copy()
        tokens[t] = VOCAB + 1  # no kept set draws it
        return msgspec.structs.replace(chunk, token_ids=tokens.tobytes())
    if kind == "non_finite":
        lps = np.frombuffer(chunk.logprobs, dtype="<f4").copy()
        lps[t] = np.nan
        return msgspec.structs.replace(chunk, logprobs=lps.tobytes())
    if kind == "empty_kept_set":
        a, b = int(offsets[t]), int(offsets[t + 1])
        new_offsets = offsets.copy()
        new_offsets[t + 1:] -= b - a
        sizes = np.frombuffer(chunk.kept_sizes, dtype="<i4").copy()
        sizes[t] = 0
        capped = bytearray(chunk.kept_capped)
        capped[t] = 0
        return msgspec.structs.replace(chunk, kept_offsets=new_offsets.tobytes(),
                                       kept_ids=np.delete(ids, range(a, b)).tobytes(), kept_sizes=sizes.tobytes(),
                                       kept_capped=bytes(capped))
    if kind == "identity":
        return msgspec.structs.replace(chunk, group_size=chunk.group_size + 1)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["not_in_kept_set", "non_finite", "empty_kept_set", "identity"])
def test_broken_trajectories_fail_with_the_same_error(kind):
    chunks, reward = record(7, routes=False)
    victim = next(i for i, c in enumerate(chunks) if np.frombuffer(c.loss_mask, dtype=np.uint8).any())
    chunks[victim] = _break(kind, chunks[victim])
    errors = []
    for module in (before, after):
        checked = [module.check_chunk(c) for c in chunks]
        with pytest.raises(module.InvalidTrajectory) as exc:
            module.assemble(checked, [RecordRef("t", 0, i) for i in range(len(chunks))], reward,
                            RecordRef("r", 0, 0))
        errors.append(str(exc.value))
    assert errors[0] == errors[1]
    assert "traj-7" in errors[1]


def test_greedy_kept_set_of_two_fails_with_the_same_error():
    chunks, reward = record(4, routes=False, greedy=True)
    victim = next(i for i, c in enumerate(chunks) if np.frombuffer(c.loss_mask, dtype=np.uint8).any())
    c = chunks[victim]
    mask = np.frombuffer(c.loss_mask, dtype=np.uint8)
    offsets = np.frombuffer(c.kept_offsets, dtype="<i4").copy()
    ids = np.frombuffer(c.kept_ids, dtype="<i4")
    t = int(np.flatnonzero(mask)[0])
    ids = np.insert(ids, int(offsets[t + 1]), 7)  # a second id in a greedy token's set
    offsets[t + 1:] += 1
    sizes = np.frombuffer(c.kept_sizes, dtype="<i4").copy()
    sizes[t] = 2
    chunks[victim] = msgspec.structs.replace(c, kept_offsets=offsets.tobytes(), kept_ids=ids.astype("<i4").tobytes(),
                                             kept_sizes=sizes.tobytes())
    errors = []
    for module in (before, after):
        checked = [module.check_chunk(x) for x in chunks]
        with pytest.raises(module.InvalidTrajectory) as exc:
            module.assemble(checked, [RecordRef("t", 0, i) for i in range(len(chunks))], reward,
                            RecordRef("r", 0, 0))
        errors.append(str(exc.value))
    assert errors[0] == errors[1] and "greedy token" in errors[1] and "kept set of 2, not 1" in errors[1]


@pytest.mark.parametrize("seed", range(4))
def test_kept_set_membership_names_the_first_token_whose_set_lacks_it(seed):
    """The vectorized membership check against a loop over tokens, on random CSR
    layouts with empty rows (environment tokens) between and at the ends."""
    rng = np.random.default_rng(seed)
    outcomes = set()
    for _ in range(100):
        n = int(rng.integers(1, 40))
        mask = rng.random(n) < 0.6
        lengths = np.where(mask, rng.integers(1, 6, size=n), 0).astype(np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = rng.integers(0, 20, size=n).astype(np.int64)
        kept = rng.integers(0, 20, size=int(offsets[-1])).astype(np.int32)
        for t in np.flatnonzero(mask & (rng.random(n) < 0.97)):  # most sets hold their token, anywhere
            kept[offsets[t] + rng.integers(0, lengths[t])] = tokens[t]
        want = next((t for t in range(n) if mask[t] and tokens[t] not in kept[offsets[t]:offsets[t + 1]]), None)
        greedy = np.zeros(n, dtype=bool)
        outcomes.add(want is None)
        if want is None:
            after._check_kept_sets(tokens, mask, greedy, offsets, kept, "x")
            continue
        with pytest.raises(after.InvalidTrajectory, match=rf"generated token {want} \({tokens[want]}\) is not in"):
            after._check_kept_sets(tokens, mask, greedy, offsets, kept, "x")
    assert outcomes == {True, False}
