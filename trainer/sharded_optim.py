"""The hybrid optimizer (``trainer/optim.py``) on FSDP2-sharded parameters.

Parameters are DTensors sharded on dim 0 over the ranks.

* AdamW is element-wise: ``torch.optim.AdamW`` runs on the shards as they are (its state
  is DTensors of the same sharding).
* Muon orthogonalises whole matrices, which no rank holds. A 2-D hidden matrix: the
  momentum update is element-wise on the shard, then the update is all-gathered
  (``DTensor.full_tensor``), orthogonalised (``torch.optim.Muon``'s Newton-Schulz, the
  same function as the single-process trainer), and each rank keeps the rows of its own
  shard. Every rank orthogonalises every matrix (redundant compute, no second
  collective; fine at the sizes the tests and benchmarks run, the first thing to
  distribute for a large model).
* Under FSDP2 CPU offload the shards, gradients and state are CPU tensors: the update is
  gathered over gloo and moved to the GPU for Newton-Schulz, and the step lands on the
  CPU shard.
* Fused 3-D MoE expert tensors [E, k*R, C] sharded on dim 0 (FSDP2's default) hold whole
  experts on each rank: each expert matrix is orthogonalised where it lives, batched
  over the local experts (no gather). Sharded on any other dimension they are gathered
  like 2-D matrices.

State is keyed by parameter name (not position), so a checkpoint does not depend on the
world size: DCP reshards it (``trainer/sharded_checkpoint.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.optim import ExpertMuon, HybridOptimizer, newton_schulz_batched

if TYPE_CHECKING:
    import torch

    from trainer.config import TrainerConfig


def local_rows(full: "torch.Tensor", like: "torch.Tensor") -> "torch.Tensor":
    """The part of ``full`` (a full tensor) that DTensor ``like``'s rank holds."""
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank has ``full`` already, so each takes its own chunk
    # with no communication.
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _sharded_on_experts(p: "torch.Tensor") -> bool:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return True  # a plain tensor holds every expert
    return all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in p.placements)


class ShardedMuon(ExpertMuon):
    """Muon (Nesterov momentum, decoupled weight decay, ``torch.optim.Muon``'s lr
    adjustment by the full matrix shape) over sharded 2-D and fused 3-D expert params
    (``per_expert`` 0: a 2-D matrix). Buffers are keyed by parameter name."""

    def __init__(self, params: list[tuple[str, Any]], **kw: Any) -> None:
        super().__init__(params, **kw)
        self.names = [n for n, _ in params]
        self.buffers: dict[str, Any] = {}  # type: ignore[assignment]

    def _orthogonalise(self, update: "torch.Tensor", k: int) -> "torch.Tensor":
        """The orthogonalised update of a FULL tensor (2-D, or [E, k*R, C] experts)."""
        from torch.optim._muon import _zeropower_via_newtonschulz

        if k == 0:
            return _zeropower_via_newtonschulz(update, self.coefficients, self.ns_steps, self.eps)
        experts, rows, cols = update.shape
        matrices = update.reshape(experts * k, rows // k, cols)
        return newton_schulz_batched(matrices, self.ns_steps, self.eps, self.coefficients).reshape(
            experts, rows, cols)

    def step(self) -> None:
        import torch
        from torch.distributed.tensor import DTensor
        from torch.optim._muon import _adjust_lr

        with torch.no_grad():
            for name, p, k in zip(self.names, self.params, self.per_expert):
                if p.grad is None:
                    continue
                grad = p.grad
                buf = self.buffers.get(name)
                if buf is None:
                    buf = self.buffers[name] = torch.zeros_like(grad)
                buf.lerp_(grad, 1 - self.momentum)
                update = grad.lerp(buf, self.momentum) if self.nesterov else buf
                sharded = isinstance(update, DTensor)
                # Newton-Schulz runs on the mesh's device: under CPU offload the shards
                # are on the CPU but the GPU does the matmuls (a no-op move otherwise).
                compute = p.device_mesh.device_type if sharded else update.device.type
                if k and _sharded_on_experts(p):
                    # Whole experts on this rank: orthogonalise them here.
                    local = (update.to_local() if sharded else update).to(compute)
                    ortho = self._orthogonalise(local, k) if local.numel() else local
                else:
                    full = (update.full_tensor() if sharded else update).to(compute)
                    ortho = self._orthogonalise(full, k)
                    if sharded:
                        ortho = local_rows(ortho, p)
                rows, cols = p.shape[-2:]
                lr = _adjust_lr(self.lr, self.adjust_lr_fn, torch.Size((rows // k if k else rows, cols)))
                local_p = p.to_local() if isinstance(p, DTensor) else p
                local_p.mul_(1 - self.lr * self.weight_decay)
                # ``device`` too: under CPU offload the shard is on the CPU, and
                # distribute_tensor (local_rows) puts its chunk on the mesh's device.
                local_p.add_(ortho.to(device=local_p.device, dtype=local_p.dtype), alpha=-lr)

    def state_dict(self) -> dict[str, Any]:
        """Every parameter's buffer (zeros before its first update: the same as none),
        so a checkpoint always has the layout :meth:`empty_state` loads into."""
        import torch

        return {name: self.buffers[name] if name in self.buffers else torch.zeros_like(p)
                for name, p in zip(self.names, self.params)}

    def empty_state(self) -> dict[str, Any]:
        """Zero buffers for every parameter: the layout a checkpoint is loaded into."""
        import torch

        return {name: torch.zeros_like(p) for name, p in zip(self.names, self.params)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - set(self.names)
        if unknown:
            raise ValueError(f"Muon state for parameters this model does not have: {sorted(unknown)[:5]}")
        self.buffers = dict(state)


class ShardedAdamW:
    """``torch.optim.AdamW`` on the shards, its state keyed by parameter name."""

    def __init__(self, params: list[tuple[str, Any]], *, lr: float, betas: tuple[float, float],
                 weight_decay: float) -> None:
        import torch

        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay, foreach=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.opt.step()

    def state_dict(self) -> dict[str, Any]:
        """Every parameter's state (a fresh one, step 0 and zero moments, is what AdamW
        starts from anyway), so a checkpoint always has the layout of :meth:`empty_state`."""
        import torch

        return {name: dict(self.opt.state[p]) if p in self.opt.state else
                {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                for name, p in zip(self.names, self.params)}

    def empty_state(self) -> dict[str, Any]:
        import torch

        # torch.optim.AdamW's own layout (step: a float32 scalar tensor).
        return {name: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                for name, p in zip(self.names, self.params)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        by_name = dict(zip(self.names, self.params))
        unknown = set(state) - set(by_name)
        if unknown:
            raise ValueError(f"AdamW state for parameters this model does not have: {sorted(unknown)[:5]}")
        self.opt.state.clear()
        for name, entry in state.items():
            self.opt.state[by_name[name]] = dict(entry)


class ShardedHybridOptimizer(HybridOptimizer):
    """Muon (2-D hidden matrices and fused experts) + AdamW (the rest) on sharded params;
    the same split as ``HybridOptimizer`` (whose step, zero_grad and state dict it keeps)."""

    def _make_optimizers(self, muon_params: list, expert_params: list, adamw_params: list,
                         cfg: "TrainerConfig") -> None:
        if muon_params or expert_params:
            self.optimizers["muon"] = ShardedMuon(
                muon_params + expert_params, lr=cfg.muon_learning_rate, weight_decay=cfg.weight_decay,
                momentum=cfg.muon_momentum, adjust_lr_fn=cfg.muon_adjust_lr)
        if adamw_params:
            self.optimizers["adamw"] = ShardedAdamW(adamw_params, lr=cfg.learning_rate,
                                                    betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay)

    def empty_state(self) -> dict[str, Any]:
        """Zero state of every optimizer: the layout a checkpoint is loaded into."""
        return {name: opt.empty_state() for name, opt in self.optimizers.items()}
