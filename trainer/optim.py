"""Muon for the hidden matrices, AdamW for everything else.

Muon orthogonalises each update of a weight *matrix* inside the network (attention and
MLP projections). Embeddings and the output head are lookup tables / classifiers whose
rows see very different gradient scales, and norms and biases are vectors, so those go
to AdamW (the split Muon's authors recommend). The MoE router (``mlp.gate.weight``, a
2-D hidden matrix) goes to Muon like every other hidden matrix.

MoE experts. transformers fuses an MoE layer's experts into 3-D tensors
(Qwen3-MoE / Mixtral: ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
[E, H, I]). Each is E independent matrices, so Muon applies per expert matrix, batched
over the expert dimension (:class:`ExpertMuon`); an ``ndim == 2`` test alone sent them,
most of an MoE's parameters, to AdamW. ``gate_up_proj`` is two matrices per expert
(gate rows, then up rows: the forward splits the output with ``chunk(2, dim=-1)``), so
it is orthogonalised as 2E matrices of [I, H], exactly as a dense model's separate
``gate_proj`` and ``up_proj``; orthogonalising the stacked [2I, H] would couple them.
2-D matrices keep ``torch.optim.Muon`` (same numbers as before for dense models).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trainer.config import TrainerConfig

# Fused expert tensors: parameter name suffix -> how many matrices each expert holds,
# stacked along dim 1 (gate_up: gate rows then up rows).
FUSED_EXPERT_MATRICES = {"experts.gate_up_proj": 2, "experts.down_proj": 1}


def _special(model: "torch.nn.Module") -> set[int]:
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    return {id(m.weight) for m in (embed, head) if m is not None}


def is_hidden_matrix(name: str, param: "torch.nn.Parameter", model: "torch.nn.Module") -> bool:
    if param.ndim != 2:
        return False
    return id(param) not in _special(model) and "embed" not in name and "lm_head" not in name


def expert_matrices(name: str, param: "torch.nn.Parameter") -> int:
    """Matrices per expert of a fused 3-D expert tensor (0: not one)."""
    if param.ndim != 3:
        return 0
    for suffix, per_expert in FUSED_EXPERT_MATRICES.items():
        if name.endswith(suffix) and param.shape[1] % per_expert == 0:
            return per_expert
    return 0


def split_parameters(
    model: "torch.nn.Module",
) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]], list[tuple[str, Any]]]:
    """(muon 2-D params, fused expert params, adamw params) as (name, param) lists in
    module order."""
    muon, experts, adamw = [], [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if is_hidden_matrix(name, p, model):
            muon.append((name, p))
        elif expert_matrices(name, p):
            experts.append((name, p))
        else:
            adamw.append((name, p))
    return muon, experts, adamw


def newton_schulz_batched(update: "torch.Tensor", steps: int, eps: float,
                          coefficients: tuple[float, float, float]) -> "torch.Tensor":
    """``torch.optim.Muon``'s quintic Newton-Schulz orthogonalisation on each matrix of a
    [B, A, C] batch (bfloat16, wide orientation, each matrix scaled by its own norm)."""
    import torch

    a, b, c = coefficients
    x = update.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


class ExpertMuon:
    """Muon over fused 3-D expert tensors, one matrix per expert (and per fused half),
    batched over the expert dimension. The update rule is ``torch.optim.Muon``'s
    (Nesterov momentum, decoupled weight decay, learning rate adjusted by the shape of
    one expert matrix), so an expert matrix trains as a dense hidden matrix would."""

    def __init__(self, params: list[tuple[str, Any]], *, lr: float, weight_decay: float, momentum: float,
                 adjust_lr_fn: str | None, nesterov: bool = True, ns_steps: int = 5, eps: float = 1e-7,
                 coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)) -> None:
        self.params = [p for _, p in params]
        self.per_expert = [expert_matrices(n, p) for n, p in params]
        self.lr, self.weight_decay, self.momentum = lr, weight_decay, momentum
        self.adjust_lr_fn, self.nesterov = adjust_lr_fn, nesterov
        self.ns_steps, self.eps, self.coefficients = ns_steps, eps, coefficients
        self.buffers: list[Any] = [None] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def _adjusted_lr(self, rows: int, cols: int) -> float:
        from torch.optim._muon import _adjust_lr
        import torch

        return _adjust_lr(self.lr, self.adjust_lr_fn, torch.Size((rows, cols)))

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for i, (p, k) in enumerate(zip(self.params, self.per_expert)):
                if p.grad is None:
                    continue
                grad = p.grad
                if self.buffers[i] is None:
                    self.buffers[i] = torch.zeros_like(grad)
                buf = self.buffers[i]
                buf.lerp_(grad, 1 - self.momentum)
                update = grad.lerp(buf, self.momentum) if self.nesterov else buf
                experts, rows, cols = update.shape
                # [E, k*R, C] -> [E*k, R, C]: one matrix per expert and fused half.
                matrices = update.reshape(experts * k, rows // k, cols)
                ortho = newton_schulz_batched(matrices, self.ns_steps, self.eps, self.coefficients)
                p.mul_(1 - self.lr * self.weight_decay)
                p.add_(ortho.reshape(experts, rows, cols), alpha=-self._adjusted_lr(rows // k, cols))

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": [None if b is None else b.clone() for b in self.buffers],
                "shapes": [list(p.shape) for p in self.params]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shapes = [list(p.shape) for p in self.params]
        if [list(s) for s in state["shapes"]] != shapes:
            raise ValueError(f"expert optimizer state is for shapes {state['shapes']}, expected {shapes}")
        self.buffers = [None if b is None else b.to(p.device, p.dtype).clone()
                        for b, p in zip(state["buffers"], self.params)]


class HybridOptimizer:
    """One object with the optimizer interface over a Muon and an AdamW."""

    def __init__(self, model: "torch.nn.Module", cfg: "TrainerConfig") -> None:
        muon_params, expert_params, adamw_params = split_parameters(model)
        self.muon_names = [n for n, _ in muon_params]
        self.expert_names = [n for n, _ in expert_params]
        self.adamw_names = [n for n, _ in adamw_params]
        self.optimizers: dict[str, Any] = {}
        self._make_optimizers(muon_params, expert_params, adamw_params, cfg)

    def _make_optimizers(self, muon_params: list, expert_params: list, adamw_params: list,
                         cfg: "TrainerConfig") -> None:
        """Fill ``self.optimizers`` (a subclass places the same split elsewhere:
        ``trainer/sharded_optim.py``)."""
        import torch

        if muon_params:
            self.optimizers["muon"] = torch.optim.Muon(
                [p for _, p in muon_params],
                lr=cfg.muon_learning_rate,
                weight_decay=cfg.weight_decay,
                momentum=cfg.muon_momentum,
                adjust_lr_fn=cfg.muon_adjust_lr,
            )
        if expert_params:
            self.optimizers["muon_experts"] = ExpertMuon(
                expert_params,
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
