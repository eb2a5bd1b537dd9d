"""The recorder's array buffers (issue #29) write the same chunks, byte for byte, as the
per-token recorder before them (``benchmarks/recording_baseline.py``, a frozen copy),
whether tokens arrive as ``SampledToken``s or as rows of an engine step's arrays
(``StepRow``), appended without waiting (``add_sampled_now``) or awaited: held
environment tokens, version changes inside a chunk, capped kept sets, the byte limit,
MoE routes (prompt routes on the first token, per-token routes, routes at the end), new
segments, and a failed publish that is retried."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from benchmarks import recording_baseline
from sampler.engine import SampledToken, StepRow, StepTokens
from sampler.recorder import TrajectoryIdentity, TrajectoryRecorder
from sampler.vllm_kept_sets import StepKeptSets
from schemas import Cost

IDENT = dict(trajectory_id="t/g/0/a", task_id="t", group_id="g", sample_index=0, group_size=2, attempt="a",
             replica_id="r", temperature=1.0, top_p=0.95)


def _script(seed: int, *, routes: bool) -> list[tuple]:
    """A rollout as operations: ("env", ids, version), ("tok", SampledToken),
    ("segment",), ("end_routes", table)."""
    rng = np.random.default_rng(seed)
    ops: list[tuple] = []
    version = 0
    segment_len = 0
    for turn in range(int(rng.integers(2, 5))):
        if turn and rng.random() < 0.3:
            ops.append(("segment",))
            segment_len = 0
        env = rng.integers(0, 5000, size=int(rng.integers(1, 40))).tolist()
        ops.append(("env", env, version))
        segment_len += len(env)
        for i in range(int(rng.integers(1, 30))):
            if rng.random() < 0.1:
                version += 1
            size = int(rng.choice([1, 2, 5, 17, 64, 65]))
            capped = size == 65 and rng.random() < 0.7
            kept = rng.choice(5000, size=size, replace=False).astype(np.int32)
            tok = SampledToken(0, int(kept[0]), float(-rng.random()), kept, capped, version,
                               kept_size=(int(rng.integers(66, 300)) if capped and rng.random() < 0.5 else None))
            if routes:
                tok.routed_experts = rng.integers(0, 8, size=(2, 2)).astype(np.int16)
                if i == 0:
                    tok.prompt_routed_experts = rng.integers(0, 8, size=(segment_len - 1, 2, 2)).astype(np.int16)
            ops.append(("tok", tok))
            segment_len += 1
        if routes and rng.random() < 0.5:
            ops.append(("end_routes", rng.integers(0, 8, size=(segment_len, 2, 2)).astype(np.int16)))
    return ops


async def _run(recorder_cls, identity_cls, ops, *, mode: str, fail_every: int = 0, **limits) -> list[bytes]:
    chunks: list = []
    calls = {"n": 0}

    async def publish(chunk):
        calls["n"] += 1
        if fail_every and calls["n"] % fail_every == 0:
            raise ConnectionError("broker away")
        chunk.validate()
        chunks.append(msgspec.msgpack.encode(msgspec.structs.replace(chunk, created_at=0.0)))

    async def retry(fn, *args):
        while True:
            try:
                return await fn(*args)
            except ConnectionError:
                continue

    rec = recorder_cls(identity_cls(**IDENT), publish, **limits)
    for op in ops:
        if op[0] == "env":
            await rec.add_env(op[1], op[2])
        elif op[0] == "segment":
            await retry(rec.new_segment)
        elif op[0] == "end_routes":
            rec.attach_routed_experts(op[1][: len(rec.segment_tokens)])
        elif op[0] == "row":  # a StepRow as it is
            if not rec.add_sampled_now(op[1]):
                await retry(rec.add_sampled, op[1])
        else:
            token = op[1]
            if mode == "rows":  # a three-row step whose middle row is this token
                other = SampledToken(0, 1, -1.0, np.array([1, 2], dtype=np.int32), False, token.weight_version)
                if token.routed_experts is not None:
                    other.routed_experts = np.zeros_like(token.routed_experts)
                token = StepRow(StepTokens.of([other, token, other]), 1)
                if op[1].prompt_routed_experts is not None:
                    token.step.prompt_routed_experts = [None, op[1].prompt_routed_experts, None]
            if mode == "awaited" or not rec.add_sampled_now(token):
                await retry(rec.add_sampled, token)
    await retry(rec.finish, "stop", Cost(generated_tokens=rec.generated_tokens))
    return chunks


@pytest.mark.parametrize("routes", [False, True])
@pytest.mark.parametrize("limits", [dict(chunk_tokens=16), dict(chunk_tokens=256, max_chunk_bytes=2048 + 700)])
async def test_array_buffers_write_the_chunks_of_the_per_token_recorder(routes, limits):
    for seed in range(6):
        ops = _script(seed, routes=routes)
        want = await _run(recording_baseline.TrajectoryRecorder, recording_baseline.TrajectoryIdentity, ops,
                          mode="awaited", **limits)
        assert len(want) > 1
        for mode in ("awaited", "now", "rows"):
            got = await _run(TrajectoryRecorder, TrajectoryIdentity, ops, mode=mode, **limits)
            assert got == want, (seed, mode)
        failing = await _run(TrajectoryRecorder, TrajectoryIdentity, ops, mode="rows", fail_every=3, **limits)
        assert failing == want, seed


async def test_the_taps_step_arrays_are_its_kept_sets():
    """StepKeptSets.tokens / row (VLLMEngine.record's path) hold, row for row, the kept
    sets and log-probs StepKeptSets.kept_set gives the streaming path, and record the
    same chunks."""
    rng = np.random.default_rng(3)
    rows, k, cap = 40, 9, 8
    lengths = rng.integers(1, k + 1, size=rows)
    top_lps = np.sort(rng.standard_normal((rows, k)).astype(np.float32), axis=1)[:, ::-1].copy()
    top_lps[np.arange(k)[None, :] >= lengths[:, None]] = -np.inf
    top_ids = np.stack([rng.choice(1000, size=k, replace=False) for _ in range(rows)]).astype(np.int32)
    pick = (rng.random(rows) * lengths).astype(np.int64)
    sampled = top_ids[np.arange(rows), pick].astype(np.int64)
    step = StepKeptSets.from_top({f"r{i}": i for i in range(rows)}, sampled, top_lps[np.arange(rows), pick],
                                 top_ids, top_lps, cap, 1000)
    for i in range(rows):
        lp, kept = step.kept_set(f"r{i}", int(sampled[i]))
        token = step.row(f"r{i}", int(sampled[i]), 7)
        assert token.token_id == sampled[i]
        got = token.step.token(token.row)
        assert got.logprob == pytest.approx(lp, abs=0) and got.weight_version == 7
        assert got.kept_ids.tolist() == kept.ids.tolist() and got.kept_capped == kept.capped
        assert got.kept_size == kept.size
    with pytest.raises(RuntimeError, match="its sampler drew"):
        step.row("r0", int(sampled[0]) + 1, 7)
    streamed = [("env", [1, 2, 3], 7)] + [
        ("tok", SampledToken(0, int(sampled[i]), lp, kept.ids, kept.capped, 7, kept_size=kept.size))
        for i in range(rows) for lp, kept in [step.kept_set(f"r{i}", int(sampled[i]))]]
    want = await _run(recording_baseline.TrajectoryRecorder, recording_baseline.TrajectoryIdentity, streamed,
                      mode="awaited", chunk_tokens=16)
    rows_ops = [("env", [1, 2, 3], 7)] + [("row", step.row(f"r{i}", int(sampled[i]), 7)) for i in range(rows)]
    assert await _run(TrajectoryRecorder, TrajectoryIdentity, rows_ops, mode="now", chunk_tokens=16) == want
