"""Groups -> tensors: rows of tokens and, per loss token, everything the loss needs.

Each segment of each trajectory is one row. Rows are right-padded (causal attention
never looks right, so padding cannot change a real position's output) and packed into
micro-batches of at most ``micro_batch_tokens`` padded tokens, in the order the groups
were given. The same groups in the same order always give the same tensors, which is
what makes a logged step re-executable bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from trainer.config import TrainerConfig
from trainer.trajectory import Group

if TYPE_CHECKING:
    import torch


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


def pack_step(groups: Sequence[Group], current_version: int, cfg: TrainerConfig) -> PackedStep:
    import torch

    from trainer.loss import group_advantages

    rows: list[tuple[np.ndarray, dict]] = []
    out = PackedStep(micro_batches=[], loss_tokens=0, generated_tokens=0, total_tokens=0, groups=len(groups))
    for group in groups:
        rewards = torch.tensor(group.rewards(), dtype=torch.float64)
        adv = group_advantages(rewards, cfg.advantage_norm, cfg.advantage_eps)
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
                    "kept": [seg.kept[t] for t in loss_pos],
                    "capped": seg.capped[loss_pos],
                    "kept_size": seg.kept_size[loss_pos],
                    "adv": np.full(loss_pos.size, a, dtype=np.float32),
                    "keep": keep,
                    "staleness": staleness,
                }))
                out.generated_tokens += int(loss_pos.size)
                out.loss_tokens += int(keep.sum())
                out.total_tokens += seg.num_tokens

    current: list[tuple[np.ndarray, dict]] = []
    width = 0
    for tokens, info in rows:
        new_width = max(width, tokens.size)
        if current and new_width * (len(current) + 1) > cfg.micro_batch_tokens:
            out.micro_batches.append(_micro_batch(current))
            current, new_width = [], tokens.size
        current.append((tokens, info))
        width = new_width
    if current:
        out.micro_batches.append(_micro_batch(current))
    return out


def _micro_batch(rows: list[tuple[np.ndarray, dict]]) -> MicroBatch:
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
    kept: list[np.ndarray] = [k for _, info in rows for k in info["kept"]]
    kept_ids, kept_lengths = pad_kept_sets(kept, targets)
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
    )
