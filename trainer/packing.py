"""Groups -> tensors: rows of tokens and, per loss token, everything the loss needs.

Each segment of each trajectory is one row. Rows are right-padded (causal attention
never looks right, so padding cannot change a real position's output) and packed into
micro-batches of at most ``micro_batch_tokens`` padded tokens, in the order the groups
were given. The same groups in the same order always give the same tensors, which is
what makes a logged step re-executable bit for bit.

Kept sets stay in CSR form (the segment's ``kept_offsets``/``kept_ids``, as on the wire)
until ``_micro_batch`` pads them into the [n, K] id matrix the loss gathers with.

MoE route tables (docs/contracts.md, "Routing") go to the rows' positions: position p of
a row gets the segment's route row p + 1 (the experts position p was routed to when it
produced token p + 1), padding and unrecorded positions -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np
import structlog

from schemas.arrays import csr_take
from trainer.config import TrainerConfig
from trainer.trajectory import Group

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)


@dataclass
class MicroBatch:
    input_ids: "torch.Tensor"  # [rows, L] long
    row: "torch.Tensor"  # [n] row of each loss token
    pos: "torch.Tensor"  # [n] position whose output predicts the token (t - 1)
    targets: "torch.Tensor"  # [n] long
    behaviour: "torch.Tensor"  # [n] float32
    temperature: "torch.Tensor"  # [n] float32
    kept_ids: "torch.Tensor"  # [n, K] long, padded with the target
    kept_lengths: "torch.Tensor"  # [n] long
    capped: "torch.Tensor"  # [n] bool
    kept_sizes: "torch.Tensor"  # [n] long; the sampler's kept-set size (-1 unknown)
    advantages: "torch.Tensor"  # [n] float32
    keep: "torch.Tensor"  # [n] bool; False = stale token masked out
    staleness: "torch.Tensor"  # [n] long
    # [rows, L, moe_layers, top_k] int16 expert ids by position, -1 = not recorded; empty
    # (numel 0) when the model is dense or no row of this micro-batch has routes.
    routes: "torch.Tensor"

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device) -> "MicroBatch":
        return MicroBatch(**{k: getattr(self, k).to(device) for k in self.__dataclass_fields__})


@dataclass
class PackedStep:
    micro_batches: list[MicroBatch]
    loss_tokens: int  # loss tokens that count (keep=True): the loss denominator
    generated_tokens: int  # every generated token (incl. masked stale ones)
    total_tokens: int  # real (unpadded) tokens forwarded
    rewards: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    cheated: list[bool] = field(default_factory=list)
    response_lengths: list[int] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    future_tokens: int = 0
    groups: int = 0
    routes_ignored: int = 0  # segments whose route table does not fit the model


def pack_step(groups: Sequence[Group], current_version: int, cfg: TrainerConfig,
              route_shape: tuple[int, int, int] | None = None) -> PackedStep:
    """``route_shape``: the model's (MoE layers, top_k, experts); None for a dense model
    (route tables are then left out)."""
    import torch

    from trainer.loss import group_advantages

    rows: list[tuple[np.ndarray, dict]] = []
    out = PackedStep(micro_batches=[], loss_tokens=0, generated_tokens=0, total_tokens=0, groups=len(groups))
    for group in groups:
        rewards = torch.tensor(group.rewards(), dtype=torch.float64)
        penalised = any(t.reward.length_penalty or t.reward.budget_penalty for t in group.members)
        adv = group_advantages(rewards, cfg.advantage_norm, cfg.advantage_eps, penalised=penalised)
        for traj, a in zip(group.members, adv.tolist()):
            out.rewards.append(traj.reward.reward)
            out.scores.append(traj.reward.score)
            out.cheated.append(traj.reward.cheated)
            out.response_lengths.append(traj.generated_tokens)
            out.advantages.append(a)
            for seg in traj.segments:
                loss_pos = np.flatnonzero(seg.loss_mask)
                staleness = current_version - seg.versions[loss_pos]
                out.future_tokens += int((staleness < 0).sum())
                staleness = np.maximum(staleness, 0)
                keep = np.ones(loss_pos.size, dtype=bool)
                if cfg.stale_policy == "mask_tokens":
                    keep = staleness <= cfg.max_staleness
                rows.append((seg.token_ids, {
                    "pos": loss_pos,
                    "targets": seg.token_ids[loss_pos],
                    "behaviour": seg.behaviour[loss_pos],
                    "temperature": seg.temperature[loss_pos],
                    "kept": csr_take(seg.kept_offsets, seg.kept_ids, loss_pos),
                    "capped": seg.capped[loss_pos],
                    "kept_size": seg.kept_size[loss_pos],
                    "adv": np.full(loss_pos.size, a, dtype=np.float32),
                    "keep": keep,
                    "staleness": staleness,
                    "routes": _position_routes(seg.routes, route_shape, traj.trajectory_id, out),
                }))
                out.generated_tokens += int(loss_pos.size)
                out.loss_tokens += int(keep.sum())
                out.total_tokens += seg.num_tokens

    current: list[tuple[np.ndarray, dict]] = []
    width = 0
    for tokens, info in rows:
        new_width = max(width, tokens.size)
        if current and new_width * (len(current) + 1) > cfg.micro_batch_tokens:
            out.micro_batches.append(_micro_batch(current, route_shape))
            current, new_width = [], tokens.size
        current.append((tokens, info))
        width = new_width
    if current:
        out.micro_batches.append(_micro_batch(current, route_shape))
    return out


def _position_routes(routes: np.ndarray | None, shape: tuple[int, int, int] | None, tid: str,
                     out: PackedStep) -> np.ndarray | None:
    """A segment's route rows shifted to the positions that used them, or None."""
    if routes is None or shape is None:
        return None
    layers, top_k, experts = shape
    if routes.shape[1:] != (layers, top_k) or int(routes.max(initial=-1)) >= experts:
        # Recorded for another model: recompute this segment's routes (counted, logged).
        out.routes_ignored += 1
        log.warning("route table does not fit the model; recomputing its routes", trajectory_id=tid,
                    table=list(routes.shape[1:]), max_id=int(routes.max(initial=-1)),
                    model=[layers, top_k], experts=experts)
        return None
    by_position = np.full_like(routes, -1)
    by_position[:-1] = routes[1:]
    return by_position


def _micro_batch(rows: list[tuple[np.ndarray, dict]], route_shape: tuple[int, int, int] | None) -> MicroBatch:
    import torch

    from trainer.loss import pad_kept_sets

    width = max(t.size for t, _ in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for i, (t, _) in enumerate(rows):
        ids[i, : t.size] = t

    def cat(key: str, dtype) -> np.ndarray:
        parts = [info[key] for _, info in rows]
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

    row_index = np.concatenate([np.full(info["pos"].size, i, dtype=np.int64) for i, (_, info) in enumerate(rows)])
    targets = torch.from_numpy(cat("targets", np.int64))
    kept_ids, kept_lengths = pad_kept_sets(np.concatenate([info["kept"][0] for _, info in rows]),
                                           np.concatenate([info["kept"][1] for _, info in rows]), targets)
    routes = np.zeros(0, dtype=np.int16)
    if route_shape is not None and any(info["routes"] is not None for _, info in rows):
        routes = np.full((len(rows), width, *route_shape[:2]), -1, dtype=np.int16)
        for i, (t, info) in enumerate(rows):
            if info["routes"] is not None:
                routes[i, : t.size] = info["routes"]
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        row=torch.from_numpy(row_index),
        pos=torch.from_numpy(cat("pos", np.int64) - 1),
        targets=targets,
        behaviour=torch.from_numpy(cat("behaviour", np.float32)),
        temperature=torch.from_numpy(cat("temperature", np.float32)),
        kept_ids=kept_ids,
        kept_lengths=kept_lengths,
        capped=torch.from_numpy(cat("capped", bool)),
        kept_sizes=torch.from_numpy(cat("kept_size", np.int64)),
        advantages=torch.from_numpy(cat("adv", np.float32)),
        keep=torch.from_numpy(cat("keep", bool)),
        staleness=torch.from_numpy(cat("staleness", np.int64)),
        routes=torch.from_numpy(routes),
    )
