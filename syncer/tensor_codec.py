"""One tensor <-> its manifest entry and chunk payloads.

``plan_tensor`` decides how a tensor is stored (raw / xor / same, byte planes or not)
and computes its checksums; ``encode_planned_chunk`` and ``decode_into`` code single
chunks so callers can stream them (the publisher and the subscriber run chunks in
worker threads next to their uploads and downloads). ``encode_tensor`` and
``decode_tensor`` are the whole-tensor, in-memory round trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from syncer import codec
from syncer.bits import bits_view, dtype_name, torch_dtype
from syncer.hashing import checksum
from syncer.manifest import ChunkRef, TensorEntry

if TYPE_CHECKING:
    import torch


class IntegrityError(ValueError):
    """A chunk or a reconstructed tensor does not match its manifest checksum."""


@dataclass
class TensorPlan:
    name: str
    encoding: str  # raw | xor | same
    byte_planes: bool
    new_bits: np.ndarray
    base_bits: np.ndarray | None
    checksum: str
    base_checksum: str
    dtype: str
    shape: list[int]
    ranges: list[tuple[int, int]]

    @property
    def raw_bytes(self) -> int:
        return self.new_bits.nbytes

    def chunk_bits(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray | None]:
        base = None if self.base_bits is None else self.base_bits[start : start + count]
        return self.new_bits[start : start + count], base

    def entry(self, chunks: list[ChunkRef]) -> TensorEntry:
        return TensorEntry(
            name=self.name,
            dtype=self.dtype,
            shape=self.shape,
            encoding=self.encoding,
            byte_planes=self.byte_planes,
            checksum=self.checksum,
            base_checksum=self.base_checksum,
            raw_bytes=self.raw_bytes,
            stored_bytes=sum(c.stored_bytes for c in chunks),
            chunks=chunks,
        )


def plan_tensor(
    name: str,
    new: "torch.Tensor",
    base: "torch.Tensor | None",
    *,
    chunk_bytes: int,
    level: int,
    byte_planes: str = "auto",
    new_checksum: str | None = None,
    base_checksum: str | None = None,
    hash_threads: int = 1,
) -> TensorPlan:
    """How to store ``new`` against ``base`` (None = raw). Checksums may be passed in
    when the caller already knows them (the publisher remembers the base's)."""
    new_bits = bits_view(new, name)
    digest = new_checksum or checksum(new_bits, hash_threads)
    comparable = base is not None and base.dtype == new.dtype and tuple(base.shape) == tuple(new.shape)
    base_bits = bits_view(base, name) if comparable else None
    base_digest = ""
    if base_bits is not None:
        base_digest = base_checksum or checksum(base_bits, hash_threads)
    if base_bits is None:
        encoding = "raw"
    elif base_digest == digest:
        encoding = "same"
    else:
        encoding = "xor"
    planes = False
    ranges: list[tuple[int, int]] = []
    if encoding != "same":
        planes = codec.choose_byte_planes(new_bits, base_bits, mode=byte_planes, level=level)
        ranges = codec.chunk_ranges(new_bits.size, new_bits.dtype.itemsize, chunk_bytes)
    return TensorPlan(
        name=name,
        encoding=encoding,
        byte_planes=planes,
        new_bits=new_bits,
        base_bits=base_bits if encoding == "xor" else None,
        checksum=digest,
        base_checksum=base_digest,
        dtype=dtype_name(new.dtype),
        shape=list(new.shape),
        ranges=ranges,
    )


def encode_planned_chunk(plan: TensorPlan, start: int, count: int, level: int) -> bytes:
    new_bits, base_bits = plan.chunk_bits(start, count)
    return codec.encode_chunk(new_bits, base_bits, byte_planes=plan.byte_planes, level=level)


def allocate(entry: TensorEntry) -> "torch.Tensor":
    import torch

    return torch.empty(tuple(entry.shape), dtype=torch_dtype(entry.dtype))


def check_base(entry: TensorEntry, base: "torch.Tensor | None") -> None:
    """Refuse to decode a xor/same tensor against a base of the wrong dtype or shape."""
    if entry.encoding == "raw":
        return
    if base is None:
        raise IntegrityError(f"{entry.name}: delta needs a base tensor and there is none")
    if dtype_name(base.dtype) != entry.dtype or list(base.shape) != entry.shape:
        raise IntegrityError(
            f"{entry.name}: base is {dtype_name(base.dtype)}{list(base.shape)}, "
            f"delta expects {entry.dtype}{entry.shape}"
        )


def decode_into(
    entry: TensorEntry,
    chunk: ChunkRef,
    payload: bytes,
    out: "torch.Tensor",
    base: "torch.Tensor | None",
) -> None:
    """Verify one stored chunk and decode it into its slice of ``out``."""
    if len(payload) != chunk.stored_bytes:
        raise IntegrityError(f"{entry.name}: chunk {chunk.key} has {len(payload)} bytes, manifest says {chunk.stored_bytes}")
    if checksum(payload) != chunk.checksum:
        raise IntegrityError(f"{entry.name}: chunk {chunk.key} checksum mismatch (corrupt object)")
    out_bits = bits_view(out, entry.name)[chunk.start : chunk.start + chunk.count]
    base_bits = None
    if entry.encoding == "xor":
        base_bits = bits_view(base, entry.name)[chunk.start : chunk.start + chunk.count]
    try:
        codec.decode_chunk(payload, out_bits, base_bits, byte_planes=entry.byte_planes)
    except codec.ChunkCorrupt as exc:
        raise IntegrityError(f"{entry.name}: chunk {chunk.key}: {exc}") from exc


def verify_tensor(entry: TensorEntry, tensor: "torch.Tensor", hash_threads: int = 1) -> None:
    got = checksum(bits_view(tensor, entry.name), hash_threads)
    if got != entry.checksum:
        raise IntegrityError(f"{entry.name}: reconstructed tensor checksum {got} != manifest {entry.checksum}")


def encode_tensor(
    name: str,
    new: "torch.Tensor",
    base: "torch.Tensor | None" = None,
    *,
    chunk_bytes: int = 64 * 1024 * 1024,
    level: int = 3,
    byte_planes: str = "auto",
) -> tuple[TensorEntry, list[bytes]]:
    """In-memory encode: the entry (chunk keys are ``name#index``) and the payloads."""
    plan = plan_tensor(name, new, base, chunk_bytes=chunk_bytes, level=level, byte_planes=byte_planes)
    payloads, chunks = [], []
    for i, (start, count) in enumerate(plan.ranges):
        payload = encode_planned_chunk(plan, start, count, level)
        payloads.append(payload)
        chunks.append(ChunkRef(
            key=f"{name}#{i}", start=start, count=count,
            raw_bytes=count * plan.new_bits.dtype.itemsize,
            stored_bytes=len(payload), checksum=checksum(payload),
        ))
    return plan.entry(chunks), payloads


def decode_tensor(
    entry: TensorEntry,
    payloads: Sequence[bytes],
    base: "torch.Tensor | None" = None,
) -> "torch.Tensor":
    """Reconstruct a tensor bit-exactly from its entry and payloads, or raise
    IntegrityError. A ``same`` tensor returns ``base`` itself (not a copy)."""
    check_base(entry, base)
    if len(payloads) != len(entry.chunks):
        raise IntegrityError(f"{entry.name}: {len(payloads)} payloads for {len(entry.chunks)} chunks")
    if entry.encoding == "same":
        verify_tensor(entry, base)
        return base
    out = allocate(entry)
    for chunk, payload in zip(entry.chunks, payloads):
        decode_into(entry, chunk, payload, out, base)
    verify_tensor(entry, out)
    return out
