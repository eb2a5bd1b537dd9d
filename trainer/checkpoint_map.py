"""Which checkpoint tensors make each model parameter, as ``from_pretrained`` decides it.

Meta-device init (``trainer/sharded_init.py``) reads each rank's rows of every parameter
straight from the weights files, so it must know where each parameter's values are.
Most parameters are one checkpoint tensor of the same name. MoE checkpoints are not:
hub checkpoints store each expert's matrices apart (``mlp.experts.3.gate_proj.weight``),
and transformers 5 fuses them into one 3-D parameter a layer (``mlp.experts.gate_up_proj``
= the experts stacked on dim 0, each expert's gate and up rows concatenated), through its
checkpoint conversion mapping (``transformers.conversion_mapping``: ``WeightConverter``
with ``MergeModulelist`` / ``Concatenate``; ``WeightRenaming`` for renamed keys such as
Mixtral's ``block_sparse_moe`` -> ``mlp``).

This module does not re-implement that mapping: it runs transformers' own key renaming
(``rename_source_key``, the function ``from_pretrained`` calls, with the same renamings,
converters and base-model-prefix rule, the keys in the same natural order) over the
checkpoint's names, and keeps the result as a plan a rank can read slices by. Only
conversions whose arithmetic is a pure rearrangement it can reproduce slice by slice are
planned (a rename; experts stacked on dim 0, optionally each expert the concatenation of
several sources on one dim). Any other conversion (a transpose, a chunk, a quantizer's
op), a parameter the checkpoint lacks (``from_pretrained`` would initialise it) or one
named twice is *unmapped*, with the reason: the caller falls back to the full load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Direct:
    """The parameter is one checkpoint tensor (``key``; the parameter's own name, or the
    name transformers renames to it), read as it is."""

    key: str
    file: Path


@dataclass(frozen=True)
class StackedExperts:
    """A fused expert parameter: row ``e`` of dim 0 is expert ``e``, whose matrix is the
    concatenation on ``concat_dim`` (a dim of one expert's matrix) of one checkpoint
    tensor per source, in ``experts[e]``'s order; one source: no concatenation."""

    experts: tuple[tuple[tuple[str, Path], ...], ...]  # [expert][source] -> (key, file)
    concat_dim: int


Plan = Direct | StackedExperts


@dataclass(frozen=True)
class CheckpointMap:
    plans: dict[str, Plan]  # parameter name -> how to read it
    unmapped: dict[str, str]  # parameter name -> why it cannot be read slice by slice

    @property
    def stacked(self) -> list[str]:
        return [name for name, plan in self.plans.items() if isinstance(plan, StackedExperts)]


def checkpoint_map(model: "torch.nn.Module", index: dict[str, Path]) -> CheckpointMap:
    """The plan for every parameter of ``model`` (a transformers ``PreTrainedModel``,
    parameters on any device, meta included) from the checkpoint ``index`` (tensor name
    -> file). Checkpoint tensors that map to no parameter are ignored, as
    ``from_pretrained`` ignores them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    # Names only: on the meta device this costs nothing. Buffers are included, as in
    # from_pretrained (a key renamed onto a buffer is not "unexpected").
    state_names = dict.fromkeys(model.state_dict())

    # target name -> (the converter, or None for a plain or renamed key; source pattern -> keys)
    sources: dict[str, tuple[object | None, dict[str, list[str]]]] = {}
    # from_pretrained's loop (core_model_loading.convert_and_load_state_dict_in_model):
    # keys in natural order (experts.2 before experts.10), which is the stacking order.
    for key in sorted(index, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, state_names)
        if target not in state_names and key in state_names:
            target, pattern = rename_source_key(key, [], [], prefix, state_names)
        if target not in state_names:
            continue
        converter = by_pattern[pattern] if pattern is not None else None
        _, keys = sources.setdefault(target, (converter, {}))
        keys.setdefault(pattern if pattern is not None else target, []).append(key)

    plans: dict[str, Plan] = {}
    unmapped: dict[str, str] = {}
    for name, param in model.named_parameters():
        if name not in sources:
            unmapped[name] = "not in the checkpoint (from_pretrained would initialise it)"
            continue
        converter, keys = sources[name]
        if converter is None:
            found = [key for group in keys.values() for key in group]
            if len(found) != 1:
                unmapped[name] = f"{len(found)} checkpoint tensors name it: {found[:3]}"
            else:
                plans[name] = Direct(found[0], index[found[0]])
            continue
        plan = _stacked(converter, keys, index, list(param.shape))
        if isinstance(plan, str):
            unmapped[name] = plan
        else:
            plans[name] = plan
    return CheckpointMap(plans, unmapped)


def _stacked(converter, keys: dict[str, list[str]], index: dict[str, Path],
             shape: list[int]) -> StackedExperts | str:
    """The plan for one converter target, or why it has none."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    patterns = list(converter.source_patterns)
    described = f"{type(converter).__name__}({patterns} -> {list(converter.target_patterns)}, {ops})"
    if converter.quantization_operation is not None or converter.distributed_operation is not None:
        return f"{described}: quantized or distributed conversion"
    # Stacking on dim 0 (FSDP2's shard dim: a rank's rows are whole experts), then
    # optionally concatenating the sources on a later dim (one expert's dim - 1).
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
        return f"{described}: not experts stacked on dim 0"
    if len(ops) == 1 and len(patterns) == 1:
        concat_dim = 0
    elif len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
        concat_dim = ops[1].dim - 1
    else:
        return f"{described}: an operation meta init does not reproduce"
    if set(keys) - set(patterns):
        return f"{described}: also named directly by {sorted(set(keys) - set(patterns))[:3]}"
    lists = [keys.get(pattern, []) for pattern in patterns]
    counts = [len(found) for found in lists]
    if not shape or any(count != shape[0] for count in counts):
        # from_pretrained would stack a different count (and fail or pad): let it.
        return f"{described}: {counts} tensors per source for {shape[0] if shape else 0} experts"
    experts = tuple(tuple((found[e], index[found[e]]) for found in lists) for e in range(shape[0]))
    return StackedExperts(experts, concat_dim)
