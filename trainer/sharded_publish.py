"""The publishable weights of a sharded model, gathered in bounded buckets.

``trainer.model.publishable_state`` copies every weight to the samplers' dtype in one
process. Sharded, no rank holds the weights: each rank casts its float32 shard to the
publish dtype (element-wise, so casting before the gather gives the very bits casting
after would) and the shards are all-gathered one bucket of at most ``bucket_bytes``
(full size, publish dtype) at a time. Only rank 0 keeps the gathered tensors: they are
what it hands to the delta publisher (``syncer.publisher.WeightPublisher``), whose
chunks, deltas and weights hash are then byte for byte those of a one-process trainer
with the same weights. Other ranks drop each bucket once gathered.

Memory on rank 0: the publish-dtype copy it hands over (the publisher keeps it as the
next delta's base anyway: 2 bytes a parameter in bfloat16) plus one bucket in flight;
never a float32 copy of the whole model. Other ranks: one bucket.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


def buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Names grouped in order into buckets of at most ``bucket_bytes`` (a tensor larger
    than that is a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes:
        if current and used + size > bucket_bytes:
            out.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        out.append(current)
    return out


def gathered_buckets(model: "torch.nn.Module", dtype_name: str,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[dict[str, "torch.Tensor"]]:
    """HF-named full CPU tensors in ``dtype_name``, one bucket at a time, on every rank
    (collective: every rank must consume every bucket)."""
    import torch
    from torch.distributed.tensor import DTensor

    dtype = getattr(torch, dtype_name)
    state = model.state_dict()
    sizes = [(name, t.numel() * dtype.itemsize) for name, t in state.items()]
    for names in buckets(sizes, bucket_bytes):
        out: dict[str, torch.Tensor] = {}
        for name in names:
            t = state[name].detach()
            if isinstance(t, DTensor):
                out[name] = t.to(dtype).full_tensor().cpu()  # a new tensor: the gather's
            else:
                out[name] = t.to(device="cpu", dtype=dtype, copy=True)
        yield out


def publishable_state_sharded(model: "torch.nn.Module", dtype_name: str, rank: int,
                              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, "torch.Tensor"] | None:
    """``publishable_state`` of a sharded model: the dict on rank 0, None on the others.
    Collective."""
    kept: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    for bucket in gathered_buckets(model, dtype_name, bucket_bytes):
        if kept is not None:
            kept.update(bucket)
    return kept
