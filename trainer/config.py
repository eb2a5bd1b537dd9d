"""Trainer settings."""

from __future__ import annotations

import msgspec


class TrainerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_path: str = "var/models/tiny"
    group_id: str = "rollway-trainer"
    checkpoint_dir: str = "var/checkpoints"
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    publish_every: int = 1
    groups_per_step: int = 4
    max_staleness: int = 4
    max_version_fraction: float = 1.0
    learning_rate: float = 1e-5
    muon_learning_rate: float = 0.02
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    advantage_norm: str = "group_std"  # group_std | group_mean | none
    importance_sampling: str = "tis"  # tis | clip | none
    is_cap: float = 2.0
    clip_epsilon: float = 0.2
    replay_kept_sets: bool = True
    temperature: float = 1.0
