"""Meta-device init for the sharded trainer: no rank ever holds the whole model.

``load_policy`` (``trainer/model.py``) materialises every float32 parameter, so a rank of
an N-rank trainer used to peak at the whole model before ``fully_shard`` freed the rest.
Here the model is built with its parameters on the meta device (buffers, e.g. rotary
``inv_freq``, are computed for real: they are derived, not stored in the checkpoint),
sharded, given empty local shards, and each shard is filled with only its rows, read
through the lazy slices of ``trainer/checkpoint_files.py`` (one tensor at a time; the
file, .safetensors or a zip-format ``pytorch_model*.bin``, is memory-mapped, so only
those rows' pages are read).

The values are the ones ``from_pretrained(dtype=float32)`` gives (the same checkpoint
bits cast to float32), so the sharded trainer stays bit-identical to the single-process
one (tests/test_fsdp.py). Where each parameter's values are is decided by transformers'
own key conversion (``trainer/checkpoint_map.py``): a parameter of the same name, a
renamed key, or a fused MoE expert parameter that the checkpoint stores per expert
(``mlp.experts.N.gate_proj.weight`` ... fused into ``mlp.experts.gate_up_proj``): a rank
reads only the per-expert tensors of the experts in its rows and writes them into its
shard. A checkpoint with a parameter that plan cannot read (a conversion meta init does
not reproduce, a missing weight that from_pretrained would initialise), or whose files
cannot be read a slice at a time (a .bin in torch's pre-1.6 format), falls back to the
full load (:func:`meta_policy`), logging which parameters and why. Names in the
checkpoint that the model lacks are ignored, as from_pretrained ignores them. A weights
file that cannot be read (truncated, corrupt, missing though its index names it) is an
error naming the file, never a fallback: the full load would fail on the same file.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Iterator

import structlog

# CheckpointUnreadable and checkpoint_index are imported from here too.
from trainer.checkpoint_files import CheckpointUnreadable, NotSliceable, checkpoint_index, open_tensors

if TYPE_CHECKING:
    import torch

    from trainer.checkpoint_map import CheckpointMap

log = structlog.get_logger(__name__)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every ``nn.Parameter`` registered inside is moved to the meta device; buffers stay
    real (what accelerate's ``init_empty_weights(include_buffers=False)`` does)."""
    import torch

    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        # A parameter already on meta is one being tied (``lm_head.weight = embed``):
        # keep the very object, so the tie survives.
        if param is not None and param.device.type != "meta":
            kwargs = dict(param.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def build_on_meta(model_path: str) -> "torch.nn.Module":
    """The policy model with meta parameters, configured as ``load_policy`` configures it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    if getattr(model.config, "use_cache", None) is not None:
        model.config.use_cache = False
    return model


def materialize_shards(model: "torch.nn.Module", model_path: str, device: "torch.device",
                       mapping: "CheckpointMap | None" = None, *, cpu_offload: bool = False) -> int:
    """Give every (sharded) meta parameter of ``model`` real local storage on ``device``
    (on the CPU with ``cpu_offload``: FSDP2's CPUOffloadPolicy keeps the shards in host
    memory and refuses parameters materialised elsewhere; buffers still go to
    ``device``, where the forward runs) and fill it with its rows of the checkpoint, as
    ``mapping`` (:func:`meta_policy`'s; every parameter planned) says where they are.
    Returns the bytes of parameter data read from the checkpoint (this rank's rows only)."""
    import torch
    from torch.distributed.tensor import DTensor

    from trainer.checkpoint_map import Direct, checkpoint_map

    if mapping is None:
        mapping = checkpoint_map(model, checkpoint_index(model_path))
    if mapping.unmapped:
        raise ValueError(f"meta init cannot read {sorted(mapping.unmapped)[:5]} from {model_path}")
    # Buffers are real already; to_empty would replace them with garbage.
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if b.device.type != "meta"}
    param_device = torch.device("cpu") if cpu_offload else device
    model.to_empty(device=param_device)
    with torch.no_grad():
        if param_device == device:
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        else:  # to_empty put the buffers on the CPU too: back to the compute device
            for prefix, module in model.named_modules():
                for name in list(module._buffers):
                    full = f"{prefix}.{name}" if prefix else name
                    if full in buffers:
                        module._buffers[name] = buffers[full].to(device)
    read = 0
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        plan = mapping.plans[name]
        with torch.no_grad():
            if isinstance(plan, Direct):
                read += _fill_direct(name, param, local, plan)
            else:
                read += _fill_stacked(name, param, local, plan)
    return read


def _fill_direct(name: str, param: "torch.Tensor", local: "torch.Tensor", plan) -> int:
    import torch

    # One open a tensor: the file is memory-mapped, and the pages read stay in
    # this process's RSS while it is open; closed after each tensor, the mapped
    # pages at any time are one tensor's rows, not the whole checkpoint.
    with open_tensors(plan.file) as f:
        tensor_slice = f.get_slice(plan.key)
        try:
            rows = _my_rows(param, tensor_slice.get_shape())
        except ValueError as err:
            raise CheckpointUnreadable(f"{plan.file}: {plan.key} (for {name}): {err}") from err
        piece = tensor_slice[:] if rows is None else tensor_slice[rows[0]:rows[1]]
    if tuple(piece.shape) != tuple(local.shape):
        raise CheckpointUnreadable(f"{plan.file}: {plan.key}: rows {rows} have shape {tuple(piece.shape)}, "
                                   f"this rank's shard of {name} {tuple(local.shape)}")
    local.copy_(piece.to(torch.float32))
    return piece.numel() * piece.element_size()


def _fill_stacked(name: str, param: "torch.Tensor", local: "torch.Tensor", plan) -> int:
    """A fused expert parameter: this rank's rows are whole experts (dim-0 shards of the
    experts stacked on dim 0); each is read from its per-expert tensors only and written
    in place, its sources side by side on ``plan.concat_dim`` (what from_pretrained's
    ``MergeModulelist(dim=0)`` + ``Concatenate`` build for the whole parameter)."""
    import torch

    experts = len(plan.experts)
    rows = _my_rows(param, [experts, *param.shape[1:]])
    start, stop = (0, experts) if rows is None else rows
    read = 0
    for row, sources in enumerate(plan.experts[start:stop]):
        slot = local[row]
        offset = 0
        for key, file in sources:
            # Opened per tensor, as in _fill_direct: one expert matrix mapped at a time.
            with open_tensors(file) as f:
                piece = f.get_slice(key)[:]
            dim = plan.concat_dim
            fits = piece.dim() == slot.dim() and offset + piece.shape[dim] <= slot.shape[dim]
            target = slot.narrow(dim, offset, piece.shape[dim]) if fits else None
            if target is None or tuple(target.shape) != tuple(piece.shape):
                raise CheckpointUnreadable(f"{file}: {key} has shape {tuple(piece.shape)}, which does not fit "
                                           f"expert {start + row} of {name} {tuple(param.shape)} at offset {offset} "
                                           f"of dim {dim + 1}")
            target.copy_(piece.to(torch.float32))
            offset += piece.shape[dim]
            read += piece.numel() * piece.element_size()
            del piece
        if offset != slot.shape[plan.concat_dim]:
            raise CheckpointUnreadable(f"{name}: expert {start + row}'s tensors {[k for k, _ in sources]} fill "
                                       f"{offset} of {slot.shape[plan.concat_dim]} on dim {plan.concat_dim + 1}")
    return read


def _my_rows(param: "torch.Tensor", full_shape: list[int]) -> tuple[int, int] | None:
    """This rank's rows [start, stop) of a dim-0 sharded DTensor (FSDP2 shards like
    ``torch.chunk``: ceil(n / world) rows a rank, the last ones short or empty); None
    for a plain (replicated) tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    if list(param.shape) != list(full_shape):
        raise ValueError(f"checkpoint shape {full_shape} != model shape {list(param.shape)}")
    (placement,) = param.placements
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise ValueError(f"unexpected placement {placement}")
    mesh = param.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    n = full_shape[0]
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    return start, min(start + chunk, n)


def meta_policy(model_path: str, device: "torch.device", *,
                cpu_offload: bool = False) -> tuple["torch.nn.Module", "CheckpointMap | None"]:
    """The policy model to shard: (model, mapping). With a mapping its parameters are on
    the meta device: shard it, then :func:`materialize_shards` with the mapping. None: a
    parameter meta init cannot read slice by slice (logged, with why), or no weights
    files it can slice (none, or a pre-1.6 .bin), so the whole model was loaded
    (``load_policy``), as before meta init: such a checkpoint still trains, at the old peak memory. With ``cpu_offload``
    that whole model is loaded into host memory (FSDP2 keeps the shards there; a model
    offloaded for want of GPU memory must not pass through the GPU whole) and only its
    buffers go to ``device``."""
    from trainer.checkpoint_map import checkpoint_map

    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"trainer.model_path {model_path!r} is not a model directory")
    model = build_on_meta(model_path)
    try:
        index = checkpoint_index(model_path)
    except (FileNotFoundError, NotSliceable) as why:
        # Nothing to read rows from lazily; from_pretrained reads it whole (or says
        # what is missing).
        log.warning("meta init fallback: no checkpoint files to read slice by slice; loading the whole model "
                    "on every rank", model_path=model_path, why=str(why))
        return _whole(model_path, device, cpu_offload), None
    mapping = checkpoint_map(model, index)
    if mapping.unmapped:
        names = sorted(mapping.unmapped)
        log.warning("meta init fallback: parameters not readable slice by slice; loading the whole model on "
                    "every rank", model_path=model_path, unmapped_count=len(names),
                    unmapped={name: mapping.unmapped[name] for name in names[:5]})
        return _whole(model_path, device, cpu_offload), None
    log.info("meta init", model_path=model_path, parameters=len(mapping.plans),
             fused_from_per_expert=len(mapping.stacked))
    return model, mapping


def _whole(model_path: str, device: "torch.device", cpu_offload: bool) -> "torch.nn.Module":
    """The fallback: ``from_pretrained`` float32 of the whole model, on ``device`` or,
    offloading, on the CPU with its buffers on ``device``."""
    import torch

    from trainer.model import load_policy

    if not cpu_offload:
        return load_policy(model_path, device)
    model = load_policy(model_path, torch.device("cpu"))
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    return model
