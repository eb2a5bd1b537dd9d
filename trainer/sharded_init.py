"""Meta-device init for the sharded trainer: no rank ever holds the whole model.

``load_policy`` (``trainer/model.py``) materialises every float32 parameter, so a rank of
an N-rank trainer used to peak at the whole model before ``fully_shard`` freed the rest.
Here the model is built with its parameters on the meta device (buffers, e.g. rotary
``inv_freq``, are computed for real: they are derived, not stored in the checkpoint),
sharded, given empty local shards, and each shard is filled with only its rows, read
through safetensors' lazy ``safe_open`` slices (one tensor at a time; the file is
memory-mapped, so only those rows' pages are read).

The values are the ones ``from_pretrained(dtype=float32)`` gives (the same checkpoint
bits cast to float32), so the sharded trainer stays bit-identical to the single-process
one (tests/test_fsdp.py). A checkpoint whose tensor names are not the model's parameter
names one for one (a key-renaming conversion such as an MoE checkpoint's per-expert
tensors, which transformers fuses into one parameter a layer; a missing weight that
from_pretrained would initialise), or a checkpoint without .safetensors files (a
``pytorch_model.bin``), falls back to the full load (:func:`meta_policy`). Names in the
checkpoint that the model lacks are ignored, as from_pretrained ignores them.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import structlog

if TYPE_CHECKING:
    import torch

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


def checkpoint_index(model_path: str) -> dict[str, Path]:
    """Tensor name -> the .safetensors file holding it (one file or an index's shards)."""
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no .safetensors files")
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({name: file for name in f.keys()})
    return out


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


def missing_from_checkpoint(model: "torch.nn.Module", index: dict[str, Path]) -> list[str]:
    return [name for name, _ in model.named_parameters() if name not in index]


def materialize_shards(model: "torch.nn.Module", model_path: str, device: "torch.device",
                       index: dict[str, Path] | None = None, *, cpu_offload: bool = False) -> int:
    """Give every (sharded) meta parameter of ``model`` real local storage on ``device``
    (on the CPU with ``cpu_offload``: FSDP2's CPUOffloadPolicy keeps the shards in host
    memory and refuses parameters materialised elsewhere; buffers still go to
    ``device``, where the forward runs) and fill it with its rows of the checkpoint.
    Returns the bytes of parameter data read from the checkpoint (this rank's rows only)."""
    import torch
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    index = index or checkpoint_index(model_path)
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
        # One open a tensor: safe_open memory-maps the file, and the pages read stay in
        # this process's RSS while it is open; closed after each tensor, the mapped
        # pages at any time are one tensor's rows, not the whole checkpoint.
        with safe_open(str(index[name]), framework="pt") as f:
            tensor_slice = f.get_slice(name)
            rows = _my_rows(param, tensor_slice.get_shape())
            piece = tensor_slice[:] if rows is None else tensor_slice[rows[0]:rows[1]]
        if tuple(piece.shape) != tuple(local.shape):
            raise ValueError(f"{name}: rows {rows} of the checkpoint have shape {tuple(piece.shape)}, "
                             f"this rank's shard {tuple(local.shape)}")
        read += piece.numel() * piece.element_size()
        with torch.no_grad():
            local.copy_(piece.to(torch.float32))
        del piece
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
                cpu_offload: bool = False) -> tuple["torch.nn.Module", dict[str, Path] | None]:
    """The policy model to shard: (model, index). With an index its parameters are on the
    meta device: shard it, then :func:`materialize_shards` with the index. None: the
    checkpoint's names are not the parameters' one for one, or it has no .safetensors
    files, so the whole model was loaded (``load_policy``), as before meta init: such a
    checkpoint still trains, at the old peak memory. With ``cpu_offload`` that whole
    model is loaded into host memory (FSDP2 keeps the shards there; a model offloaded
    for want of GPU memory must not pass through the GPU whole) and only its buffers go
    to ``device``."""
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"trainer.model_path {model_path!r} is not a model directory")
    model = build_on_meta(model_path)
    try:
        index = checkpoint_index(model_path)
    except FileNotFoundError:
        # No .safetensors (a pytorch_model.bin checkpoint): nothing to read rows from
        # lazily; from_pretrained reads it whole.
        log.warning("no .safetensors checkpoint; loading the whole model on every rank", model_path=model_path)
        return _whole(model_path, device, cpu_offload), None
    missing = missing_from_checkpoint(model, index)
    if missing:
        log.warning("checkpoint names differ from the model's; loading the whole model on every rank",
                    missing=missing[:5], missing_count=len(missing))
        return _whole(model_path, device, cpu_offload), None
    return model, index


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
