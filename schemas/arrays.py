"""Per-token arrays travel as packed little-endian bytes, not msgpack lists.

``pack`` turns a numpy array (or anything array-like) into bytes of a fixed
little-endian dtype; ``unpack`` views bytes as a numpy array without copying (the
result is read-only when the bytes are); ``to_torch`` views them as a tensor.

Kept sets use a CSR layout: ``offsets`` (int32, n+1 entries, offsets[0] == 0) and
``ids`` (int32), so token i's kept set is ``ids[offsets[i]:offsets[i+1]]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

# Wire dtypes, always little-endian whatever the host.
INT32 = np.dtype("<i4")
INT64 = np.dtype("<i8")
FLOAT32 = np.dtype("<f4")
UINT8 = np.dtype("<u1")
INT16 = np.dtype("<i2")


def pack(values: np.ndarray | Sequence[float] | Sequence[int], dtype: np.dtype) -> bytes:
    """Bytes of ``values`` as ``dtype`` (little-endian). Refuses lossy integer casts."""
    arr = np.asarray(values)
    if arr.dtype.kind in "iu" and np.dtype(dtype).kind in "iu" and arr.size:
        info = np.iinfo(dtype)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            raise ValueError(f"values in [{lo}, {hi}] do not fit {np.dtype(dtype)}")
    return np.ascontiguousarray(arr, dtype=dtype).tobytes()


def unpack(data: bytes | bytearray | memoryview, dtype: np.dtype) -> np.ndarray:
    """Zero-copy numpy view of packed bytes (native byte order where it matches)."""
    dtype = np.dtype(dtype)
    if len(data) % dtype.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of {dtype} items")
    arr = np.frombuffer(data, dtype=dtype)
    # On big-endian hosts this converts (copies); on little-endian it stays a view.
    return arr if dtype.isnative else arr.astype(dtype.newbyteorder("="))


def to_torch(data: bytes | bytearray | memoryview, dtype: np.dtype) -> "torch.Tensor":
    """Tensor over packed bytes. Zero-copy for writable buffers; bytes are copied once
    because torch cannot hold read-only memory."""
    import torch

    arr = unpack(data, dtype)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr)


def from_torch(tensor: "torch.Tensor", dtype: np.dtype) -> bytes:
    return pack(tensor.detach().cpu().numpy(), dtype)


def csr_arrays(sets: Iterable[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, ids) int32 arrays for a list of integer sets."""
    parts = [np.asarray(s, dtype=INT32) for s in sets]
    offsets = np.zeros(len(parts) + 1, dtype=INT32)
    if parts:
        np.cumsum([a.size for a in parts], out=offsets[1:])
    ids = np.concatenate(parts) if offsets[-1] else np.zeros(0, dtype=INT32)
    return offsets, ids.astype(INT32, copy=False)


def pack_csr(sets: Iterable[Sequence[int] | np.ndarray]) -> tuple[bytes, bytes]:
    """(offsets, ids) bytes for a list of integer sets."""
    offsets, ids = csr_arrays(sets)
    return offsets.tobytes(), ids.tobytes()


def unpack_csr(offsets: bytes, ids: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, ids) arrays; checks the layout is consistent."""
    off = unpack(offsets, INT32)
    vals = unpack(ids, INT32)
    # (slice comparisons, not np.diff / np.any: this runs for every chunk the trainer reads)
    if off.size == 0 or off[0] != 0 or off[-1] != vals.size or (off[1:] < off[:-1]).any():
        raise ValueError("malformed CSR: offsets must start at 0, be non-decreasing and end at len(ids)")
    return off, vals


def csr_rows(offsets: bytes, ids: bytes) -> list[np.ndarray]:
    off, vals = unpack_csr(offsets, ids)
    return [vals[off[i] : off[i + 1]] for i in range(off.size - 1)]


def csr_take(offsets: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` of a CSR layout, still CSR: (their lengths, int64, and their ids
    concatenated in row order)."""
    rows = np.asarray(rows, dtype=np.int64)
    starts = offsets[rows].astype(np.int64)
    lengths = offsets[rows + 1].astype(np.int64) - starts
    total = int(lengths.sum())
    # Position j of the output is id starts[r] + (j - first output position of r).
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return lengths, ids[np.arange(total, dtype=np.int64) + shift]


def pack_spans(per_token_versions: Sequence[int] | np.ndarray) -> tuple[bytes, bytes]:
    """Run-length encode per-token weight versions: (starts int32, versions int64)."""
    v = np.asarray(per_token_versions, dtype=INT64)
    if v.size == 0:
        return b"", b""
    change = np.flatnonzero(np.diff(v)) + 1
    starts = np.concatenate([[0], change]).astype(INT32)
    return starts.tobytes(), v[starts].astype(INT64).tobytes()


def unpack_spans(starts: bytes, versions: bytes, length: int) -> np.ndarray:
    """Per-token versions (int64, ``length`` entries) from run-length spans."""
    s = unpack(starts, INT32)
    v = unpack(versions, INT64)
    if s.size != v.size:
        raise ValueError("span starts and versions differ in length")
    if length == 0:
        return np.zeros(0, dtype=np.int64)
    if s.size == 0 or s[0] != 0 or (s[1:] <= s[:-1]).any() or s[-1] >= length:
        raise ValueError("malformed spans: starts must begin at 0, increase, and lie inside the tokens")
    if s.size == 1:  # the usual chunk: one version
        return np.full(length, v[0], dtype=np.int64)
    counts = np.empty(s.size, dtype=np.int64)
    counts[:-1] = s[1:] - s[:-1]
    counts[-1] = length - s[-1]
    return np.repeat(v, counts)
