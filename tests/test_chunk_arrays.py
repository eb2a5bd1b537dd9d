"""TrajectoryChunk.arrays(): the fast check of the usual chunk gives exactly what the
reference check (``_checked_arrays``) gives: the same arrays (values and dtypes) for a
valid chunk, the same error for a broken one, whatever is broken."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from schemas import TrajectoryChunk, arrays
from schemas.events import _fast_arrays


def random_chunk(rng: np.random.Generator) -> TrajectoryChunk:
    n = int(rng.integers(1, 40))
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    capped = (mask & (rng.random(n) < 0.2)).astype(np.uint8)
    lengths = np.where(mask == 1, rng.integers(1, 6, size=n), 0)
    # A capped set records part of it: its size is larger, or -1 (unknown).
    sizes = np.where(capped == 1, np.where(rng.random(n) < 0.5, lengths + rng.integers(0, 4, size=n), -1), lengths)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    spans = int(rng.integers(1, 4))
    versions = np.sort(rng.integers(0, 3, size=n)) if spans > 1 else np.full(n, 5)
    starts, packed_versions = arrays.pack_spans(versions)
    routes = {}
    if rng.random() < 0.3:
        shape = [n, int(rng.integers(1, 3)), 2]
        routes = dict(routed_experts=arrays.pack(rng.integers(-1, 8, size=shape), arrays.INT16),
                      routed_experts_shape=shape)
    return TrajectoryChunk(
        trajectory_id="t", task_id="k", group_id="g", sample_index=0, group_size=2, attempt="a", chunk_index=0,
        token_ids=arrays.pack(rng.integers(0, 100, size=n), arrays.INT32),
        logprobs=arrays.pack(-rng.random(n), arrays.FLOAT32), loss_mask=arrays.pack(mask, arrays.UINT8),
        kept_offsets=arrays.pack(offsets, arrays.INT32),
        kept_ids=arrays.pack(rng.integers(0, 100, size=int(offsets[-1])), arrays.INT32),
        kept_capped=arrays.pack(capped, arrays.UINT8) if rng.random() < 0.9 else b"",
        kept_sizes=arrays.pack(sizes, arrays.INT32) if rng.random() < 0.9 else b"",
        version_starts=starts, versions=packed_versions, **routes,
    )


def _int32(data: bytes, i: int, value: int) -> bytes:
    a = np.frombuffer(data, dtype=arrays.INT32).copy()
    a[i] = value
    return a.tobytes()


def broken(chunk: TrajectoryChunk, rng: np.random.Generator) -> TrajectoryChunk:
    """``chunk`` with one thing changed (most changes break it; some leave it valid)."""
    n = chunk.num_tokens
    kind = int(rng.integers(0, 14))
    replace = msgspec.structs.replace
    if kind == 0:
        return replace(chunk, token_ids=chunk.token_ids + b"\x00")
    if kind == 1:
        return replace(chunk, logprobs=chunk.logprobs[:-4])
    if kind == 2:
        return replace(chunk, loss_mask=chunk.loss_mask + b"\x01")
    if kind == 3:
        return replace(chunk, kept_offsets=_int32(chunk.kept_offsets, 0, 1))
    if kind == 4:
        return replace(chunk, kept_offsets=_int32(chunk.kept_offsets, int(rng.integers(1, n + 1)), -1))
    if kind == 5:
        return replace(chunk, kept_ids=chunk.kept_ids + b"\x00\x00\x00\x00")
    if kind == 6:
        return replace(chunk, kept_offsets=chunk.kept_offsets[:-4], kept_ids=b"")
    if kind == 7:
        return replace(chunk, kept_capped=chunk.kept_capped[:-1] if chunk.kept_capped else b"\x00")
    if kind == 8 and chunk.kept_sizes:
        return replace(chunk, kept_sizes=_int32(chunk.kept_sizes, int(rng.integers(0, n)), int(rng.integers(-3, 7))))
    if kind == 9:
        return replace(chunk, kept_sizes=chunk.kept_sizes + b"\x00\x00\x00\x00")
    if kind == 10:
        return replace(chunk, version_starts=_int32(chunk.version_starts, 0, int(rng.integers(1, 3))))
    if kind == 11:
        return replace(chunk, versions=chunk.versions[:-8] if len(chunk.versions) > 8 else b"")
    if kind == 12:
        return replace(chunk, routed_experts_shape=[n, 1, 3] if chunk.routed_experts_shape else [n + 1, 1, 1])
    if kind == 13 and chunk.routed_experts:
        routes = np.frombuffer(chunk.routed_experts, dtype=arrays.INT16).copy()
        routes[int(rng.integers(0, routes.size))] = -2
        return replace(chunk, routed_experts=routes.tobytes())
    return replace(chunk, kept_capped=b"\x02" * n)  # 2 is not "capped": those sets must be complete


def outcome(check) -> tuple:
    try:
        a = check()
    except ValueError as exc:
        return ("error", str(exc))
    return ("ok", *((None,) if v is None else (v.dtype.str, v.shape, v.tobytes())
                   for v in (getattr(a, f) for f in a.__struct_fields__)))


@pytest.mark.parametrize("seed", range(3))
def test_fast_check_agrees_with_the_reference_check(seed):
    rng = np.random.default_rng(seed)
    seen = {"fast": 0, "errors": set()}
    for _ in range(300):
        chunk = random_chunk(rng)
        for c in (chunk, broken(chunk, rng)):
            want = outcome(c._checked_arrays)
            assert outcome(c.arrays) == want
            if want[0] == "error":
                seen["errors"].add(want[1].split(" ")[0])
            elif _fast_arrays(c) is not None:
                seen["fast"] += 1
    # The fast path took most valid chunks, and the broken ones failed in many ways.
    assert seen["fast"] > 200 and len(seen["errors"]) >= 7, seen


def wrapping_chunk() -> TrajectoryChunk:
    """A chunk whose CSR offsets descend (0, 2**31 - 1, -2, 2), so malformed, but whose
    row lengths computed in int32 wrap around to 2**31 - 1, 2**31 - 1 and 4, all >= 0,
    matching its recorded kept sizes."""
    return TrajectoryChunk(
        trajectory_id="t", task_id="k", group_id="g", sample_index=0, group_size=2, attempt="a", chunk_index=0,
        token_ids=arrays.pack([1, 2, 3], arrays.INT32), logprobs=arrays.pack([-0.5] * 3, arrays.FLOAT32),
        loss_mask=bytes([0, 1, 1]), kept_offsets=arrays.pack([0, 2**31 - 1, -2, 2], arrays.INT32),
        kept_ids=arrays.pack([2, 3], arrays.INT32), kept_capped=bytes(3),
        kept_sizes=arrays.pack([2**31 - 1, 2**31 - 1, 4], arrays.INT32),
        version_starts=b"\0\0\0\0", versions=arrays.pack([1], arrays.INT64), final=True,
    )


def test_offsets_whose_int32_row_lengths_wrap_around_are_malformed():
    # (Taken for valid, the chunk reached the assembly, whose numpy pass raised a bare
    # ValueError there instead of refusing the trajectory: the intake crashed.)
    c = wrapping_chunk()
    want = outcome(c._checked_arrays)
    assert want[0] == "error" and want[1].startswith("malformed CSR")
    assert _fast_arrays(c) is None
    assert outcome(c.arrays) == want
