"""Apply verified weights (HF names, CPU tensors) to a live model, in place.

* :func:`apply_to_module` (and :class:`ModuleTarget`, the subscriber's contract around
  it: ``weight_version`` and ``await apply_weights(tensors, version) -> pause seconds``)
  — a torch ``nn.Module`` whose state-dict names are the HF names (e.g. a
  ``transformers`` model): ``copy_`` into the existing parameter storage, no
  reallocation.
* :func:`vllm_model_loader` — a live vLLM model, reached through ``apply_model``
  (``sampler.vllm_engine.VLLMEngine.apply_weights`` runs it between two engine steps;
  the engine is the subscriber's target). vLLM fuses HF tensors (q/k/v ->
  ``qkv_proj``, gate/up -> ``gate_up_proj``) and shards them across tensor-parallel
  ranks; the model class's own ``load_weights`` knows that layout (its
  ``stacked_params_mapping`` and per-parameter ``weight_loader``), so we feed it HF
  names and let it place each tensor into its slice of the fused parameter.

  Two modes, picked per engine (``auto``, :func:`detect_mode`):
  ``direct`` — the parameters hold the weights (CUDA; vLLM CPU on AVX2-only CPUs,
  which do not repack): ``load_weights`` copies into them in place; we check no
  parameter's storage moved. Refused up front where the weights were repacked.
  ``reload`` — the backend repacked weights into kernel formats after loading (vLLM's
  CPU backend on AVX-512 CPUs turns linear weights into oneDNN/sgl packed buffers and
  empties ``layer.weight``): vLLM's layerwise reload re-runs that processing on the new
  weights. It works on unpacked weights too, so it can be forced anywhere. It needs every tensor of a layer, so the target asks for the full state
  (``accepts_partial_updates`` is False) and a partial update is refused.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch


class WeightsRefused(ValueError):
    """An update was refused before any byte was written (unknown name, wrong shape
    or dtype, incomplete layer): the engine still holds its previous weights."""


class _Refused(WeightsRefused, KeyError):
    """Also a KeyError, which callers of the unknown-name check have always caught."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def dtype_fits(have: "torch.dtype", update: "torch.dtype") -> bool:
    """Whether an update of dtype ``update`` can be written into storage of dtype
    ``have`` without changing a value: the same dtype, or a float widened exactly (bf16
    and fp16 into fp32). vLLM's CPU backend on AVX-512 machines keeps some parameters
    (e.g. the fused q/k/v bias) in float32 while the trainer publishes bfloat16; a
    narrowing write (fp32 into bf16) would round and is refused."""
    if have == update:
        return True
    return have.is_floating_point and update.is_floating_point and update.itemsize < have.itemsize \
        and have.itemsize >= 4


def _spec_error(name: str, where: str, have_shape, have_dtype, src: "torch.Tensor") -> str | None:
    if not dtype_fits(have_dtype, src.dtype):
        return f"{name}: {where} holds dtype {have_dtype}, update has {src.dtype}"
    if tuple(have_shape) != tuple(src.shape):
        return f"{name}: {where} holds shape {tuple(have_shape)}, update has {tuple(src.shape)}"
    return None


# -- torch nn.Module -------------------------------------------------------------------
def apply_to_module(module: "torch.nn.Module", tensors: Mapping[str, "torch.Tensor"], *, strict: bool = True) -> int:
    """Copy ``tensors`` into the module's parameters/buffers of the same names, in
    place. Every name, shape and dtype is validated before the first copy, so a bad
    update changes nothing (``WeightsRefused``; a ``KeyError`` too, for an unknown
    name). Returns the number of bytes copied."""
    import torch

    targets = module.state_dict(keep_vars=True)
    pairs = []
    problems = []
    for name, src in tensors.items():
        dst = targets.get(name)
        if dst is None:
            if strict:
                problems.append(f"module has no parameter or buffer named {name!r}")
            continue
        # copy_ would silently cast any dtype: only exact widenings pass (dtype_fits).
        error = _spec_error(name, "module", dst.shape, dst.dtype, src)
        if error:
            problems.append(error)
        pairs.append((dst, src))
    if problems:
        raise _Refused(f"{problems[0]}" + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    copied = 0
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src, non_blocking=dst.device.type == "cuda")
            copied += src.numel() * src.element_size()
    if any(dst.device.type == "cuda" for dst, _ in pairs):
        torch.cuda.synchronize()
    return copied


class ModuleTarget:
    """A plain torch module as a weight target (trainer-side checks, torch samplers)."""

    accepts_partial_updates = True  # tensors left out of an update keep their values

    def __init__(self, module: "torch.nn.Module", weight_version: int = -1) -> None:
        self.module = module
        self.weight_version = weight_version
        self.last_pause_s = 0.0

    async def apply_weights(self, tensors: dict[str, "torch.Tensor"], version: int) -> float:
        t0 = time.perf_counter()
        apply_to_module(self.module, tensors)
        self.weight_version = version
        self.last_pause_s = time.perf_counter() - t0
        return self.last_pause_s


# -- vLLM ------------------------------------------------------------------------------
def hf_to_vllm_name(name: str, packed_modules_mapping: Mapping[str, list[str]]) -> tuple[str, int | None]:
    """The vLLM parameter an HF tensor lands in, and its shard index within a fused
    parameter (None when not fused): ``...self_attn.k_proj.weight`` ->
    (``...self_attn.qkv_proj.weight``, 1)."""
    for fused, parts in packed_modules_mapping.items():
        for index, part in enumerate(parts):
            needle = f".{part}."
            if needle in name:
                return name.replace(needle, f".{fused}.", 1), index
    return name, None


def vllm_param_name(model: "torch.nn.Module", name: str) -> str | None:
    """Where vLLM puts HF tensor ``name``: the model's own ``hf_to_vllm_mapper`` (which
    also holds the stacked q/k/v and gate/up entries) when it has one, else the
    ``packed_modules_mapping``. None = the model deliberately ignores this tensor."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "map_name"):
        mapped = mapper.map_name(name)
        if mapped is None or mapped != name:
            return mapped
    return hf_to_vllm_name(name, getattr(model, "packed_modules_mapping", {}) or {})[0]


def _params_hold_weights(model: "torch.nn.Module") -> bool:
    # Kernel-format repacking (vLLM CPU) leaves empty placeholder parameters behind.
    return all(p.numel() > 0 for p in model.parameters())


def detect_mode(model: "torch.nn.Module") -> str:
    return "direct" if _params_hold_weights(model) else "reload"


class _ModelConfigShim:
    """What vLLM's layerwise reload reads from ModelConfig (``dtype``, for attention
    layers' post-processing); ``apply_model`` hands us the model only."""

    def __init__(self, dtype) -> None:
        self.dtype = dtype


def _model_dtype(model: "torch.nn.Module"):
    import torch

    for p in model.parameters():
        if p.is_floating_point() and p.numel() > 0 and p.dtype != torch.float32:
            return p.dtype
    return next(model.parameters()).dtype


def _check_names(model: "torch.nn.Module", names: list[str], full: bool) -> None:
    """Every HF name must land in a parameter; with ``full``, every parameter (and
    every shard of a fused one) must be covered: vLLM's layerwise reload processes a
    layer from whatever it received, so a partial layer would be garbage."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    mapped: dict[str, int] = {}
    unknown = []
    for name in names:
        target = vllm_param_name(model, name)
        if target is None:
            continue  # deliberately ignored by the model (e.g. rotary caches)
        if target not in params:
            unknown.append(name)
        mapped[target] = mapped.get(target, 0) + 1
    if unknown:
        raise _Refused(f"vLLM model has no parameter for HF tensors {unknown[:5]} ({len(unknown)} unknown)")
    if not full:
        return
    unique = dict(model.named_parameters())  # tied parameters once
    missing = []
    for pname in unique:
        fused = next((f for f in packed if f".{f}." in f".{pname}"), None)
        want = len(packed[fused]) if fused else 1
        if mapped.get(pname, 0) < want:
            missing.append(pname)
    if missing:
        raise _Refused(
            f"this engine reloads whole layers (kernel-format weights); the update misses "
            f"{len(missing)} parameters or shards, e.g. {missing[:5]}: send the full state"
        )


def _loadable_spec(model: "torch.nn.Module", pname: str, param: "torch.Tensor"):
    """(shape, dtype) a parameter takes weights in: the parameter itself when it holds
    them, else the layout vLLM recorded before repacking (what layerwise reload
    restores and loads into); None when neither is known."""
    if param.numel() > 0:
        return tuple(param.shape), param.dtype
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    module_name, _, attr = pname.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        return None
    info = LAYERWISE_INFO.get(module)
    meta = info.restore_metadata[0].get(attr) if info is not None else None
    return (tuple(meta.shape), meta.dtype) if meta is not None else None


def _is_vocab(model: "torch.nn.Module", pname: str) -> bool:
    module_name = pname.rpartition(".")[0]
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        return False
    return any(c.__name__ == "VocabParallelEmbedding" for c in type(module).__mro__)


def _check_specs(model: "torch.nn.Module", items: list[tuple[str, "torch.Tensor"]]) -> None:
    """Refuse, before anything is written, an HF tensor whose dtype differs from its
    vLLM parameter's or whose shape cannot be a slice of it. vLLM fuses (q/k/v along
    dim 0), shards (tensor parallel: the parameter holds 1/tp of a dim) and pads (vocab
    rows) parameters, so a dim passes when equal, a whole multiple of the parameter's
    (a shard), or, for dim 0 of a fused slice or a vocab embedding only, smaller; the
    number of dims must match; a dtype passes when :func:`dtype_fits`. That catches
    transposed, truncated and wrong-dtype tensors,
    which load_weights would otherwise write part-way before failing."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    problems = []
    for name, src in items:
        pname = vllm_param_name(model, name)
        if pname is None or pname not in params:
            continue
        # Dim 0 may be smaller only for a slice of a fused parameter or padded vocab rows.
        short_rows = hf_to_vllm_name(name, packed)[1] is not None or _is_vocab(model, pname)
        spec = _loadable_spec(model, pname, params[pname])
        if spec is None:
            continue
        shape, dtype = spec
        if not dtype_fits(dtype, src.dtype):
            problems.append(f"{name}: vLLM parameter {pname} holds dtype {dtype}, update has {src.dtype}")
            continue
        ok = len(shape) == len(src.shape) and all(
            s == p or (p > 0 and s % p == 0) or (d == 0 and short_rows and s < p)
            for d, (s, p) in enumerate(zip(src.shape, shape))
        )
        if not ok:
            problems.append(f"{name}: shape {tuple(src.shape)} does not fit vLLM parameter {pname} {shape}")
    if problems:
        raise _Refused(problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))


def load_hf_weights_into_vllm(model: "torch.nn.Module", items: list[tuple[str, "torch.Tensor"]], mode: str = "auto") -> dict:
    """Load HF-named tensors into a live vLLM model (see the module doc for modes).
    Names (and, in reload mode, completeness) are checked before anything is written."""
    import torch

    if mode == "auto":
        mode = detect_mode(model)
    if mode not in ("direct", "reload"):
        raise ValueError(f"unknown vLLM apply mode {mode!r}")
    if mode == "direct" and not _params_hold_weights(model):
        raise _Refused(
            "direct in-place apply needs the weights in the parameters, but this engine repacked "
            "them into kernel formats after loading (vLLM CPU with AVX-512): use mode 'reload' or 'auto'"
        )
    _check_names(model, [n for n, _ in items], full=mode == "reload")
    _check_specs(model, items)
    params = dict(model.named_parameters(remove_duplicate=False))
    before = {n: p.data_ptr() for n, p in params.items()}
    with torch.no_grad():
        if mode == "direct":
            loaded = model.load_weights(iter(items))
        else:
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            initialize_layerwise_reload(model)
            try:
                loaded = model.load_weights(iter(items))
            finally:
                finalize_layerwise_reload(model, _ModelConfigShim(_model_dtype(model)))
    if any(p.is_cuda for p in params.values()):
        torch.cuda.synchronize()
    moved = sorted(n for n, p in model.named_parameters(remove_duplicate=False) if before.get(n) != p.data_ptr())
    if mode == "direct" and moved:
        raise RuntimeError(f"in-place update reallocated parameters: {moved[:5]}")
    return {"mode": mode, "loaded": len(loaded) if loaded is not None else len(items), "moved": moved}


def vllm_model_loader(tensors: Mapping[str, "torch.Tensor"], mode: str = "auto"):
    """A function for ``LLM.apply_model`` / ``LLMEngine.apply_model`` that loads
    HF-named tensors into the model (:func:`load_hf_weights_into_vllm`)."""
    items = list(tensors.items())

    def load(model: "torch.nn.Module") -> dict:
        return load_hf_weights_into_vllm(model, items, mode)

    return load
