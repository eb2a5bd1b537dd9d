"""Checksums: BLAKE3 (fast, SIMD, optionally multi-threaded) over raw bytes.

* ``checksum(buf)`` — of a stored chunk (what came over the wire) or of a tensor's bits.
* ``weights_hash(entries)`` — one digest of a whole state dict, computed from the
  per-tensor checksums (name, dtype, shape, checksum), so comparing two versions, or a
  reconstruction against its manifest, costs no extra pass over the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

import blake3
import msgspec

if TYPE_CHECKING:
    import torch

DIGEST_BYTES = 16  # 128 bits: collisions are not a concern at our object counts


def checksum(data, threads: int = 1) -> str:
    """Hex BLAKE3 of a bytes-like object (numpy arrays are hashed by their buffer)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    hasher = blake3.blake3(max_threads=threads if threads > 1 else 1)
    hasher.update(view)
    return hasher.hexdigest(length=DIGEST_BYTES)


def tensor_checksum(tensor: "torch.Tensor", threads: int = 1) -> str:
    from syncer.bits import bits_view

    return checksum(bits_view(tensor), threads=threads)


def weights_hash(entries: Iterable[tuple[str, str, list[int], str]]) -> str:
    """Digest of (name, dtype, shape, checksum) for every tensor, in name order."""
    canonical = sorted((name, dtype, list(shape), digest) for name, dtype, shape, digest in entries)
    return checksum(msgspec.msgpack.encode(canonical))


def state_dict_hash(state_dict: Mapping[str, "torch.Tensor"], threads: int = 1) -> str:
    """``weights_hash`` of a CPU state dict (one checksum pass over every tensor)."""
    from syncer.bits import dtype_name

    return weights_hash(
        (name, dtype_name(t.dtype), list(t.shape), tensor_checksum(t, threads))
        for name, t in state_dict.items()
    )
