"""``TrainCore`` over FSDP2-sharded ranks: the same step, its batch split over ranks.

Every rank holds the whole batch (rank 0 took it from Kafka and broadcast it, or the
replay read it from the log) and trains its share (``trainer.distributed.split_groups``).
Each rank's loss is divided by the whole step's loss-token count, so the gradients
summed over ranks (FSDP2 reduce-scatter, ``trainer/distributed.py``) are the step's.

Every FSDP forward all-gathers and every backward reduce-scatters, on all ranks
together: a rank with fewer micro-batches than the others runs empty ones (a one-token
forward whose loss is multiplied by zero) until all ranks have run as many.

What the step returns is what ``TrainCore.train_step`` returns: the weights hash is the
same function of the full float32 parameters (gathered one tensor at a time) and the
metrics are computed over every rank's tokens. Numbers: the step at N ranks sums the
gradients in another order than one process does, so it equals the single-process step
within float32 rounding, not bit for bit; two runs at the same N (same split, same
thread count) are bit-identical (docs/trainer.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

import structlog

from trainer.config import TrainerConfig
from trainer.core import StepResult, TrainCore, new_diagnostics
from trainer.distributed import DistContext, all_gather_objects, full_tensors, rank_groups, shard_policy
from trainer.trajectory import Group

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)

_PACKED_LISTS = ("rewards", "scores", "cheated", "response_lengths", "advantages")
_PACKED_COUNTS = ("loss_tokens", "generated_tokens", "total_tokens", "future_tokens", "groups", "routes_ignored")


class ShardedTrainCore(TrainCore):
    def __init__(self, cfg: TrainerConfig, ctx: DistContext, model_path: str | None = None) -> None:
        import torch

        from trainer.model import make_deterministic
        from trainer.precision import SelectedLogits
        from trainer.routing import RoutingReplay
        from trainer.distributed import offload_policy
        from trainer.sharded_init import materialize_shards, meta_policy
        from trainer.sharded_optim import ShardedHybridOptimizer

        make_deterministic(cfg.seed, cfg.num_threads)
        # FSDP2 CPU offload (trainer.fsdp.cpu_offload): refused on CPU ranks; on CUDA the
        # process group must have gloo for the offloaded CPU shards' collectives.
        offload = offload_policy(cfg.fsdp.cpu_offload, ctx.device)
        if cfg.fsdp.cpu_offload and not ctx.cpu_offload:
            raise RuntimeError("trainer.fsdp.cpu_offload = true but the process group was started without it "
                               "(init_distributed(cpu_offload=True) adds the gloo backend the CPU shards need)")
        self.cfg = cfg
        self.ctx = ctx
        self.device = ctx.device
        # Meta-device init (trainer/sharded_init.py): the parameters are built on the
        # meta device, sharded, then each rank reads only its rows of the checkpoint, so
        # no rank ever holds the whole float32 model (MoE checkpoints included: fused
        # expert parameters are read from their per-expert tensors).
        path = model_path or cfg.model_path
        self.model, mapping = meta_policy(path, self.device, cpu_offload=cfg.fsdp.cpu_offload)
        self.step = 0
        self._routing = RoutingReplay(self.model, cfg.replay_routing)
        self._logits = SelectedLogits(self.model)
        self._forward_dtype = None
        if cfg.replay_precision and cfg.publish_dtype != "float32":
            self._forward_dtype = getattr(torch, cfg.publish_dtype)
        # The casting to the forward dtype is FSDP2's (MixedPrecisionPolicy), not
        # functional_call's: policy_logits is called with replay_dtype=None.
        shard_policy(self._logits, self.model, ctx.mesh, self._forward_dtype, offload)
        self.meta_init = mapping is not None
        if self.meta_init:
            materialize_shards(self.model, path, self.device, mapping, cpu_offload=cfg.fsdp.cpu_offload)
        self.optimizer = ShardedHybridOptimizer(self.model, cfg)
        log.info("sharded trainer core ready", rank=ctx.rank, world_size=ctx.world_size, device=str(self.device),
                 muon_params=len(self.optimizer.muon_names), muon_expert_params=len(self.optimizer.expert_names),
                 adamw_params=len(self.optimizer.adamw_names))

    # -- the step --------------------------------------------------------------------------
    def train_step(self, groups: Sequence[Group], seed: int | None = None) -> StepResult:
        import torch
        import torch.distributed as dist

        from trainer import loss as L
        from trainer.model import seed_everything
        from trainer.packing import PackedStep, pack_step

        cfg, ctx = self.cfg, self.ctx
        started = time.perf_counter()
        seed_everything((cfg.seed if seed is None else seed) + self.step + 1)
        mine = rank_groups(groups, ctx.rank, ctx.world_size)
        packed = pack_step(mine, self.step, cfg, self._routing.shape)
        settings = L.LossSettings(cfg.importance_sampling, cfg.is_cap, cfg.clip_epsilon, cfg.is_truncation)
        # One collective for the step's loss-token count and the micro-batches to run.
        # (NCCL reduces device tensors only.)
        totals = torch.tensor([packed.loss_tokens, -len(packed.micro_batches)], dtype=torch.int64,
                              device=self.device)
        dist.all_reduce(totals[:1], op=dist.ReduceOp.SUM)
        dist.all_reduce(totals[1:], op=dist.ReduceOp.MIN)
        denominator = max(int(totals[0]), 1)
        rounds = -int(totals[1])

        self.model.train()
        self.optimizer.zero_grad()
        loss_total = 0.0
        diag = new_diagnostics()
        for i in range(rounds):
            if i >= len(packed.micro_batches) or packed.micro_batches[i].targets.numel() == 0:
                self._empty_pass()
                continue
            # The cast to the forward dtype is FSDP2's (MixedPrecisionPolicy): None here.
            loss_total += self._train_micro_batch(packed.micro_batches[i].to(self.device), denominator, settings,
                                                  diag, None)
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1
        hash_started = time.perf_counter()
        digest = self.weights_hash()
        hash_s = time.perf_counter() - hash_started

        # Metrics over every rank's tokens, merged in rank order.
        local = ({k: [t.detach().cpu() for t in v] for k, v in diag.items()},
                 {k: getattr(packed, k) for k in _PACKED_LISTS + _PACKED_COUNTS}, loss_total)
        merged_diag: dict[str, list[torch.Tensor]] = {k: [] for k in diag}
        whole = PackedStep(micro_batches=[], loss_tokens=0, generated_tokens=0, total_tokens=0)
        loss_sum = 0.0
        for rank_diag, rank_packed, rank_loss in all_gather_objects(local):
            for k, parts in rank_diag.items():
                merged_diag[k].extend(parts)
            for k in _PACKED_LISTS:
                getattr(whole, k).extend(rank_packed[k])
            for k in _PACKED_COUNTS:
                setattr(whole, k, getattr(whole, k) + rank_packed[k])
            loss_sum += rank_loss
        elapsed = time.perf_counter() - started
        metrics, hist = self._metrics(whole, merged_diag, loss_sum, grad_norm, elapsed)
        metrics["hash_s"] = hash_s
        metrics["world_size"] = float(ctx.world_size)
        if self._routing.shape is not None:
            recorded, differing = self._routing.take_counts()
            both = torch.tensor([recorded, differing], dtype=torch.int64, device=self.device)
            dist.all_reduce(both)
            recorded, differing = int(both[0]), int(both[1])
            metrics["routing_recorded_positions"] = float(recorded)
            metrics["routing_differs_frac"] = differing / recorded if recorded else 0.0
            metrics["routing_tables_ignored"] = float(whole.routes_ignored)
        return StepResult(self.step, self.step, digest, metrics, hist)

    def _empty_pass(self) -> None:
        """A forward and backward that adds zero to every gradient: this rank has no
        micro-batch left, but the others' all-gathers and reduce-scatters need it."""
        import torch

        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        at = torch.zeros(1, dtype=torch.long, device=self.device)
        logits = self._logits(ids, at, at)
        (logits.float().sum() * 0.0).backward()

    def _clip_gradients(self) -> float:
        """Clip to ``max_grad_norm`` by the norm of the whole (sharded) gradient."""
        import torch
        from torch.distributed.tensor import DTensor

        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=False)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if self.cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, total, foreach=False)
        return float(total)

    # -- state -------------------------------------------------------------------------------
    def weights_hash(self) -> str:
        """``trainer.model.model_hash`` of the full parameters, gathered one at a time
        (every rank computes it; all agree)."""
        from syncer.bits import dtype_name
        from syncer.hashing import tensor_checksum, weights_hash

        entries = []
        for name, full in full_tensors(self.model.named_parameters()):
            full = full.cpu()
            entries.append((name, dtype_name(full.dtype), list(full.shape), tensor_checksum(full)))
        return weights_hash(entries)

    def full_parameters(self) -> dict[str, "torch.Tensor"]:
        """CPU copies of the full float32 parameters (tests and small models only)."""
        return {name: t.cpu().clone() for name, t in full_tensors(self.model.named_parameters())}

    def snapshot(self) -> dict[str, Any]:
        raise NotImplementedError("a sharded trainer checkpoints with trainer.sharded_checkpoint (DCP)")

    def restore(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("a sharded trainer restores with trainer.sharded_checkpoint (DCP)")
