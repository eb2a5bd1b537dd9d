"""The training-relevant settings of a trainer and their hash (``TrainStep.config_hash``).

A logged step is re-executed bit for bit only under the settings that produced it. Each
``TrainStep`` records a hash of those settings, so a replay under other ones fails
saying the config differs, not with a bare weights-hash mismatch after minutes of work.

Every ``TrainerConfig`` field counts unless it is listed in ``NOT_TRAINING``: settings
that cannot change what a logged step computes from its logged records (where things
live, names, checkpoint and publish cadence, bounds on which groups get picked, since
the log names the exact records). A new field is hashed until someone says otherwise.
"""

from __future__ import annotations

import hashlib

import msgspec

from trainer.config import TrainerConfig

NOT_TRAINING = frozenset({
    "model_path",  # the initial weights are checked by hash (checkpoints, replayed steps)
    "group_id", "transactional_id", "session_timeout_ms",
    "checkpoint_dir", "checkpoint_every", "keep_checkpoints",
    "publish_every",
    "groups_per_step", "max_version_fraction", "max_buffered_groups", "held_drops_max", "held_drops_max_s",
    "device",  # "auto" resolves per machine; a device change shows as a hash mismatch
    "metrics_source", "on_replay_mismatch",
})


def training_settings(cfg: TrainerConfig) -> dict[str, object]:
    """The hashed settings. ``world_size`` (and the batch split rule, which decides
    which rank trains which group) count only above 1, and ``fsdp`` only with CPU
    offload on, so logs written before those settings existed keep their hash."""
    settings = {k: v for k, v in msgspec.to_builtins(cfg).items() if k not in NOT_TRAINING}
    if not cfg.fsdp.cpu_offload:
        # Off (the default) leaves the hash as it was before the setting existed; on,
        # the optimizer steps on the CPU (other arithmetic than the GPU's): hashed.
        del settings["fsdp"]
    if cfg.world_size == 1:
        del settings["world_size"]
    else:
        from trainer.distributed import SPLIT_RULE

        settings["split_rule"] = SPLIT_RULE
    return dict(sorted(settings.items()))


def training_config_hash(cfg: TrainerConfig) -> str:
    """16 hex digits of the sha256 of the training settings (JSON, keys sorted)."""
    return hashlib.sha256(msgspec.json.encode(training_settings(cfg))).hexdigest()[:16]
