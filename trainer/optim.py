"""Muon for the 2-D hidden matrices, AdamW for everything else.

Muon orthogonalises each update of a weight *matrix* inside the network (attention and
MLP projections). Embeddings and the output head are lookup tables / classifiers whose
rows see very different gradient scales, and norms and biases are vectors, so those go
to AdamW (the split Muon's authors recommend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trainer.config import TrainerConfig


def is_hidden_matrix(name: str, param: "torch.nn.Parameter", model: "torch.nn.Module") -> bool:
    if param.ndim != 2:
        return False
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    special = {id(m.weight) for m in (embed, head) if m is not None}
    return id(param) not in special and "embed" not in name and "lm_head" not in name


def split_parameters(model: "torch.nn.Module") -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """(muon params, adamw params) as (name, param) lists in module order."""
    muon, adamw = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (muon if is_hidden_matrix(name, p, model) else adamw).append((name, p))
    return muon, adamw


class HybridOptimizer:
    """One object with the optimizer interface over a Muon and an AdamW."""

    def __init__(self, model: "torch.nn.Module", cfg: "TrainerConfig") -> None:
        import torch

        muon_params, adamw_params = split_parameters(model)
        self.muon_names = [n for n, _ in muon_params]
        self.adamw_names = [n for n, _ in adamw_params]
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        if muon_params:
            self.optimizers["muon"] = torch.optim.Muon(
                [p for _, p in muon_params],
                lr=cfg.muon_learning_rate,
                weight_decay=cfg.weight_decay,
                momentum=cfg.muon_momentum,
                adjust_lr_fn=cfg.muon_adjust_lr,
            )
        if adamw_params:
            self.optimizers["adamw"] = torch.optim.AdamW(
                [p for _, p in adamw_params],
                lr=cfg.learning_rate,
                betas=tuple(cfg.adam_betas),
                weight_decay=cfg.weight_decay,
                foreach=False,  # one kernel path everywhere: same numbers on every host
            )

    def zero_grad(self) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.optimizers):
            raise ValueError(f"optimizer state has {sorted(state)}, expected {sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])
