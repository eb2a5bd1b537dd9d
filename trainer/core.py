"""The model, its optimizer and one training step: the deterministic heart of the trainer.

``TrainCore.train_step(groups)`` is a pure function of (weights, optimizer state, the
groups in order, the config): the live loop and replay both call it, and the weights
hash after it is what the train-step log records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import structlog

from trainer.config import TrainerConfig
from trainer.trajectory import Group

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)


@dataclass
class StepResult:
    step: int
    weight_version: int
    weights_hash: str
    metrics: dict[str, float]
    histograms: dict[str, list[float]] = field(default_factory=dict)


DIAGNOSTICS = ("logp", "behaviour", "truncated", "entropy_full", "entropy_kept", "kept_len", "capped", "keep",
               "staleness", "rebuilt", "rebuilt_missing", "rebuilt_differs")


def new_diagnostics() -> dict[str, list["torch.Tensor"]]:
    """Per-token diagnostics of a step, one list of tensors a micro-batch each."""
    return {k: [] for k in DIAGNOSTICS}


class TrainCore:
    def __init__(self, cfg: TrainerConfig, model_path: str | None = None) -> None:
        from trainer.checkpoint_files import check_readable
        from trainer.model import load_policy, make_deterministic, pick_device
        from trainer.optim import HybridOptimizer
        from trainer.precision import SelectedLogits
        from trainer.routing import RoutingReplay

        make_deterministic(cfg.seed, cfg.num_threads)
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        # Every weights file opened first (headers only): a truncated, corrupt or missing
        # one is CheckpointUnreadable naming it, as in the sharded trainer; from_pretrained's
        # own errors name no file.
        check_readable(model_path or cfg.model_path)
        self.model = load_policy(model_path or cfg.model_path, self.device)
        self.optimizer = HybridOptimizer(self.model, cfg)
        self.step = 0  # also the weight version of self.model
        self._routing = RoutingReplay(self.model, cfg.replay_routing)
        self._logits = SelectedLogits(self.model)
        # Precision replay: the forward in the samplers' dtype (None: float32 as trained).
        self._forward_dtype = None
        if cfg.replay_precision and cfg.publish_dtype != "float32":
            import torch

            self._forward_dtype = getattr(torch, cfg.publish_dtype)
        log.info("trainer core ready", device=str(self.device), model_path=model_path or cfg.model_path,
                 muon_params=len(self.optimizer.muon_names), muon_expert_params=len(self.optimizer.expert_names),
                 adamw_params=len(self.optimizer.adamw_names))

    # -- the step --------------------------------------------------------------------------
    def train_step(self, groups: Sequence[Group], seed: int | None = None) -> StepResult:
        """One optimizer step on ``groups`` (in this order). ``seed`` defaults to the
        config's; replay passes the logged one."""
        import torch

        from trainer import loss as L
        from trainer.model import model_hash, seed_everything
        from trainer.packing import pack_step

        cfg = self.cfg
        started = time.perf_counter()
        seed_everything((cfg.seed if seed is None else seed) + self.step + 1)
        packed = pack_step(groups, self.step, cfg, self._routing.shape)
        settings = L.LossSettings(cfg.importance_sampling, cfg.is_cap, cfg.clip_epsilon, cfg.is_truncation)
        denominator = max(packed.loss_tokens, 1)

        self.model.train()
        self.optimizer.zero_grad()
        loss_total = 0.0
        diag = new_diagnostics()
        for mb in packed.micro_batches:
            mb = mb.to(self.device)
            if mb.targets.numel() == 0:
                continue
            loss_total += self._train_micro_batch(mb, denominator, settings, diag, self._forward_dtype)
        grad_norm = 0.0
        params = [p for p in self.model.parameters() if p.grad is not None]
        if params:
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1
        hash_started = time.perf_counter()
        digest = model_hash(self.model)
        hash_s = time.perf_counter() - hash_started
        elapsed = time.perf_counter() - started
        metrics, hist = self._metrics(packed, diag, loss_total, grad_norm, elapsed)
        metrics["hash_s"] = hash_s
        if self._routing.shape is not None:
            recorded, differing = self._routing.take_counts()
            # Positions with a recorded route whose recomputed experts differ in some
            # layer: what routing replay corrects (measured with replay on or off).
            metrics["routing_recorded_positions"] = float(recorded)
            metrics["routing_differs_frac"] = differing / recorded if recorded else 0.0
            metrics["routing_tables_ignored"] = float(packed.routes_ignored)
        return StepResult(self.step, self.step, digest, metrics, hist)

    def _train_micro_batch(self, mb, denominator: int, settings, diag: dict[str, list["torch.Tensor"]],
                           forward_dtype: "torch.dtype | None") -> float:
        """Forward and backward of one micro-batch (its loss divided by the step's
        ``denominator``); its diagnostics appended to ``diag``; returns its loss.
        ``forward_dtype``: precision replay's cast (None where the caller's model casts
        itself, as the sharded trainer's FSDP2 does)."""
        from trainer import loss as L
        from trainer.precision import policy_logits

        cfg = self.cfg
        with self._routing.using(mb.routes):
            logits = policy_logits(self._logits, mb.input_ids, mb.row, mb.pos, forward_dtype)
        kept_ids, kept_lengths, capped = mb.kept_ids, mb.kept_lengths, mb.capped
        if cfg.replay_kept_sets and cfg.rebuild_capped_kept_sets:
            sets = L.rebuild_capped_sets(logits.detach(), mb.targets, kept_ids, kept_lengths, capped,
                                         mb.kept_sizes)
            kept_ids, kept_lengths, capped = sets.kept_ids, sets.kept_lengths, sets.capped
            diag["rebuilt"].append(sets.rebuilt)
            diag["rebuilt_missing"].append(sets.missing)
            diag["rebuilt_differs"].append(sets.differs)
        logp, keep = L.token_logprobs(
            logits, mb.targets, kept_ids, kept_lengths, capped, mb.temperature,
            replay=cfg.replay_kept_sets, capped_policy=cfg.capped_kept_set,
        )
        keep = keep & mb.keep
        per_token, truncated = L.policy_loss_terms(logp, mb.behaviour, mb.advantages, settings)
        loss = L.masked_loss_sum(per_token, keep) / denominator
        loss.backward()
        diag["logp"].append(logp.detach()[keep])
        diag["behaviour"].append(mb.behaviour[keep])
        diag["truncated"].append(truncated[keep])
        diag["entropy_full"].append(L.full_vocab_entropy(logits.detach(), mb.temperature)[keep])
        diag["entropy_kept"].append(L.kept_set_entropy(logits.detach(), kept_ids, kept_lengths, mb.temperature)[keep])
        diag["kept_len"].append(kept_lengths[keep])
        diag["capped"].append(mb.capped[keep])
        diag["keep"].append(keep)
        diag["staleness"].append(mb.staleness)
        return float(loss.detach())

    def _metrics(self, packed, diag, loss_total: float, grad_norm: float, elapsed: float):
        import torch

        from trainer.loss import mismatch_kl

        def cat(key: str) -> torch.Tensor:
            parts = diag[key]
            return torch.cat([p.cpu() for p in parts]) if parts else torch.zeros(0)

        logp, behaviour = cat("logp").double(), cat("behaviour").double()
        ratio = torch.exp(logp - behaviour)
        k1, k3 = mismatch_kl(logp, behaviour)
        n = max(int(logp.numel()), 1)
        staleness = cat("staleness").long()
        bins = self.cfg.max_staleness + 2  # 0..max_staleness, then "older"
        hist = torch.bincount(staleness.clamp(max=bins - 1), minlength=bins).tolist() if staleness.numel() else [0] * bins
        rewards = np.asarray(packed.rewards, dtype=np.float64)
        scores = np.asarray(packed.scores, dtype=np.float64)

        def mean(t: torch.Tensor) -> float:
            return float(t.double().mean()) if t.numel() else 0.0

        metrics = {
            "loss": loss_total,
            "reward_mean": float(rewards.mean()) if rewards.size else 0.0,
            "reward_std": float(rewards.std()) if rewards.size else 0.0,
            "score_mean": float(scores.mean()) if scores.size else 0.0,
            "solve_rate": float((scores >= 1.0).mean()) if scores.size else 0.0,
            "cheat_rate": float(np.mean(packed.cheated)) if packed.cheated else 0.0,
            "advantage_abs_mean": float(np.mean(np.abs(packed.advantages))) if packed.advantages else 0.0,
            "entropy_full": mean(cat("entropy_full")),
            "entropy_kept": mean(cat("entropy_kept")),
            "mismatch_kl_k1": k1,
            "mismatch_kl_k3": k3,
            "is_ratio_mean": mean(ratio),
            "is_ratio_std": float(ratio.std(unbiased=False)) if ratio.numel() else 0.0,
            "is_ratio_min": float(ratio.min()) if ratio.numel() else 0.0,
            "is_ratio_max": float(ratio.max()) if ratio.numel() else 0.0,
            "is_truncated_frac": float(cat("truncated").double().sum() / n),
            "kept_one_frac": float((cat("kept_len") == 1).double().sum() / n),
            "kept_size_mean": mean(cat("kept_len")),
            "kept_capped_frac": float(cat("capped").double().sum() / n),
            # Capped sets rebuilt as the trainer's top-size (every generated token, masked
            # ones too); missing: the sampled token was not in it; differs: a recorded id
            # of the sampler's was not in it (the rebuilt set is not the sampler's).
            "kept_rebuilt": float(cat("rebuilt").sum()),
            "kept_rebuilt_missing": float(cat("rebuilt_missing").sum()),
            "kept_rebuilt_differs": float(cat("rebuilt_differs").sum()),
            "response_len_mean": float(np.mean(packed.response_lengths)) if packed.response_lengths else 0.0,
            "loss_tokens": float(packed.loss_tokens),
            "masked_stale_tokens": float(packed.generated_tokens - int(cat("keep").sum())),
            "future_tokens": float(packed.future_tokens),
            "staleness_mean": mean(staleness),
            "staleness_max": float(staleness.max()) if staleness.numel() else 0.0,
            "grad_norm": grad_norm,
            "groups": float(packed.groups),
            "trajectories": float(len(packed.rewards)),
            "step_time_s": elapsed,
            "tokens_per_s": packed.total_tokens / elapsed if elapsed > 0 else 0.0,
            "loss_tokens_per_s": packed.loss_tokens / elapsed if elapsed > 0 else 0.0,
        }
        return metrics, {"staleness": [float(x) for x in hist]}

    # -- state -------------------------------------------------------------------------------
    def weights_hash(self) -> str:
        from trainer.model import model_hash

        return model_hash(self.model)

    def snapshot(self) -> dict[str, Any]:
        """CPU copies of everything a checkpoint holds (fast; the write happens elsewhere)."""
        import random

        import torch

        def to_cpu(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return obj.detach().to("cpu", copy=True)
            if isinstance(obj, dict):
                return {k: to_cpu(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(to_cpu(v) for v in obj)
            return obj

        rng = {
            "torch": torch.get_rng_state(),
            "numpy": _numpy_rng_to_torch(np.random.get_state()),
            "python": random.getstate(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "step": self.step,
            "weight_version": self.step,
            "model": to_cpu(self.model.state_dict()),
            "optimizer": to_cpu(self.optimizer.state_dict()),
            "rng": rng,
        }

    def restore(self, state: dict[str, Any]) -> None:
        import random

        import torch

        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        rng = state.get("rng", {})
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "numpy" in rng:
            np.random.set_state(_numpy_rng_from_torch(rng["numpy"]))
        if "python" in rng:
            random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.step = int(state["step"])


# numpy's RNG state holds an ndarray; checkpoints load with weights_only=True, which
# accepts tensors and plain containers only.
def _numpy_rng_to_torch(state: tuple) -> tuple:
    import torch

    name, keys, pos, has_gauss, cached = state
    return (name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached))


def _numpy_rng_from_torch(state: tuple) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
