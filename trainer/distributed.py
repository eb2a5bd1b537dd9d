"""torch.distributed for the trainer: process group, FSDP2 sharding, the batch split.

One logical trainer runs as ``world_size`` ranks (launched by ``torchrun`` /
``torch.distributed.run``, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT). Parameters, gradients and optimizer state are sharded over the ranks with
PyTorch FSDP2 (``fully_shard``): one FSDP group per transformer block and one for the
root (embeddings, final norm, head: tied weights must share a group).

Precision replay under FSDP2 (``trainer/precision.py``): the single-process trainer
casts the float32 masters to ``publish_dtype`` with ``functional_call``; sharded, the
same cast is FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``: every rank all-gathers
its float32 shard cast to the samplers' dtype and runs the forward there, and gradients
are reduce-scattered in float32 (``reduce_dtype``) onto the float32 master shards. The
optimizer never sees anything but float32.

Gradients are SUMMED over ranks, not averaged: each rank's loss is already divided by
the whole step's loss-token count (as in one process), so the sum over ranks is the
step's gradient. FSDP2's default (average over ranks) would scale it by 1/world_size.

The batch split (:func:`split_groups`) is a pure function of the groups' token counts
and the world size, so a logged step is re-split exactly the same way on replay; the
world size is a hashed training setting (``TrainStep.config_hash``), so a log written at
N ranks refuses to replay at another N instead of failing on the weights hash.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, NoReturn, Sequence

import structlog

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.trajectory import Group

log = structlog.get_logger(__name__)

# The name of the rule split_groups implements. A change to the rule is a new name.
SPLIT_RULE = "tokens-lpt-v1"

_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Set when this process joined a process group (init_distributed): it ends by exit_rank.
_joined = False


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: "torch.device"
    mesh: "DeviceMesh"
    # The process group has a gloo backend for CPU tensors beside NCCL (CPU offload).
    cpu_offload: bool = False

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that consumes Kafka, logs steps and publishes weights."""
        return self.rank == 0


def backend_for(device: "torch.device", cpu_offload: bool = False) -> str:
    """gloo on CPU, NCCL on CUDA; with CPU offload NCCL for CUDA tensors and gloo for
    CPU ones: the offloaded shards are CPU tensors, and the collectives over them (the
    optimizer's Muon gather, the gradient norm, the weights hash, DCP, the publish
    gather) would fail on NCCL, which reduces device tensors only."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def offload_error(cpu_offload: bool, device: "torch.device") -> str | None:
    """Why ``trainer.fsdp.cpu_offload`` cannot apply to ranks on ``device``; None when
    it can (CUDA) or is off. On CPU ranks parameters, gradients and optimizer state are
    in host memory already: offloading them is meaningless, and a user who set it
    expects GPU memory saved, so the trainer refuses instead of ignoring it."""
    if cpu_offload and device.type != "cuda":
        return (f"trainer.fsdp.cpu_offload = true needs CUDA ranks, but this trainer runs on {device.type}, where "
                "parameters, gradients and optimizer state are in host memory already; set it to false")
    return None


def offload_policy(cpu_offload: bool, device: "torch.device"):
    """The ``offload_policy`` for ``fully_shard``: torch's ``CPUOffloadPolicy`` (pinned
    host memory, for asynchronous copies to the GPU) when offloading, else the default
    ``OffloadPolicy`` (no offload). Raises RuntimeError where offload cannot apply."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    error = offload_error(cpu_offload, device)
    if error:
        raise RuntimeError(error)
    return CPUOffloadPolicy(pin_memory=True) if cpu_offload else OffloadPolicy()


def init_distributed(device_name: str = "auto", expected_world_size: int | None = None, *,
                     cpu_offload: bool = False) -> DistContext:
    """Join the process group torchrun described in the environment (idempotent).

    gloo on CPU, NCCL on CUDA (one device per local rank; with ``cpu_offload``, gloo
    too, for the offloaded CPU shards). ``expected_world_size`` (``trainer.world_size``)
    must match the launcher's: a config trained at N ranks that starts at M would split
    batches differently from its log. ``cpu_offload`` on a CPU rank is refused
    (RuntimeError, before joining)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.model import pick_device

    missing = [k for k in _LAUNCH_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"sharded trainer needs the torchrun environment; missing {', '.join(missing)} "
                           "(launch with `torchrun --nproc-per-node N ...` or `python -m torch.distributed.run`)")
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if expected_world_size is not None and expected_world_size != world_size:
        raise RuntimeError(f"trainer.world_size = {expected_world_size} but the launcher started {world_size} ranks "
                           "(WORLD_SIZE); the batch split and the step log's config hash depend on it")
    device = pick_device(device_name)
    error = offload_error(cpu_offload, device)
    if error:
        raise RuntimeError(error)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend_for(device, cpu_offload), rank=rank, world_size=world_size,
                                device_id=device if device.type == "cuda" else None)
    global _joined
    _joined = True
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))
    log.info("distributed trainer rank up", rank=rank, world_size=world_size, local_rank=local_rank, pid=os.getpid(),
             device=str(device), backend=dist.get_backend(), cpu_offload=cpu_offload)
    return DistContext(rank, world_size, local_rank, device, mesh, cpu_offload)


def joined() -> bool:
    """Whether this process joined a process group as a rank (and so ends by exit_rank)."""
    return _joined


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank's process with ``code`` once its work is done, without Python's
    interpreter teardown: leave the process group, flush stdout, stderr and logging, then
    ``os._exit``.

    Why not a plain return: gloo's worker threads outlive ``destroy_process_group``. Its
    ``shutdown`` is a no-op for gloo and the C++ process group is only destroyed (its
    threads joined) when its last reference goes, and once a DTensor has existed torch
    holds one that neither ``del`` nor ``gc.collect()`` releases. So every FSDP rank
    finalizes its interpreter with gloo threads alive. A thread that takes the GIL during
    ``Py_FinalizeEx`` (pytorch#190489: a gloo worker releasing a finished all-gather's
    tensors) is ended by CPython with ``pthread_exit``, whose unwinding through a noexcept
    C++ destructor calls std::terminate: "terminate called without an active exception",
    SIGABRT, no Python traceback, and torchrun counts the rank as failed after it finished
    its work. Skipping the teardown takes that window away; a rank has nothing left for it
    to do (its files, checkpoints and Kafka clients are closed by then)."""
    import logging
    import sys

    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # a peer already gone: the process ends anyway
        log.warning("leaving the process group failed", error=str(exc))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe: nothing more can be said there
            pass
    logging.shutdown()
    os._exit(code)


def decoder_blocks(model: "torch.nn.Module") -> list["torch.nn.Module"]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers``)."""
    base = getattr(model, model.base_model_prefix, None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no transformer blocks at {model.base_model_prefix}.layers; "
                         "cannot shard it per block")
    return list(layers)


def shard_policy(root: "torch.nn.Module", model: "torch.nn.Module", mesh: "DeviceMesh",
                 forward_dtype: "torch.dtype | None", offload: "object | None" = None) -> None:
    """``fully_shard`` each block of ``model``, then ``root`` (the module whose forward
    the step calls: ``SelectedLogits``, which reaches the embeddings and head without
    going through ``model.forward``, so the root group must be the wrapper).
    ``offload``: :func:`offload_policy`'s (None: no offload)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=forward_dtype, reduce_dtype=torch.float32,
                              output_dtype=None, cast_forward_inputs=False)
    offload = offload if offload is not None else OffloadPolicy()
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(root, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for module in root.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            # Sum over ranks (see the module docstring); force plain SUM collectives:
            # gloo has no PREMUL_SUM, and a sum of two addends is order-free (bit-exact).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


# -- the batch split ---------------------------------------------------------------------

def group_tokens(group: "Group") -> int:
    """A group's cost in the split: every token its segments forward."""
    return sum(seg.num_tokens for traj in group.members for seg in traj.segments)


def split_groups(tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of the groups each rank trains (``SPLIT_RULE``): longest first to the
    rank with the fewest tokens so far (ties: the lower index, the lower rank); each
    rank's groups in batch order. A pure function of (token counts, world size): replay
    re-splits a logged batch exactly as the live step did.

    A rank may get no group (fewer groups than ranks); it still takes part in every
    collective (see ``ShardedTrainCore``)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(tokens)), key=lambda i: (-int(tokens[i]), i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += int(tokens[index])
        out[rank].append(index)
    return [sorted(part) for part in out]


def rank_groups(groups: Sequence["Group"], rank: int, world_size: int) -> list["Group"]:
    """This rank's share of a step's groups, in batch order."""
    parts = split_groups([group_tokens(g) for g in groups], world_size)
    return [groups[i] for i in parts[rank]]


# -- collectives over plain values -------------------------------------------------------

def all_gather_objects(obj: object) -> list[object]:
    """``obj`` of every rank, in rank order (pickled; small things only)."""
    import torch.distributed as dist

    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def full_tensors(named: Iterable[tuple[str, "torch.Tensor"]]) -> Iterable[tuple[str, "torch.Tensor"]]:
    """(name, full tensor) one at a time: a DTensor is all-gathered (every rank must
    iterate in the same order), a plain tensor passes through."""
    from torch.distributed.tensor import DTensor

    for name, t in named:
        t = t.detach()
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t)
