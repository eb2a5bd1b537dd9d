"""Trainer settings.

Weight versions are trainer steps: the weights after step ``s`` are version ``s`` and
the initial model is version 0. Staleness is counted in those versions (steps), so
``max_staleness`` is "how many optimizer steps behind the trainer a token may be".
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec


class FsdpConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """FSDP2 settings of the sharded trainer (trainer.world_size >= 2; docs/trainer.md)."""

    # FSDP2 CPU offload (torch's CPUOffloadPolicy): each rank's float32 parameter,
    # gradient and optimizer-state shards live in host memory; each block's parameters
    # go to the GPU for its forward/backward only, and the optimizer steps on the CPU.
    # GPU memory then holds about one block's gathered weights plus activations, at the
    # cost of host<->device copies and a CPU optimizer step. At world size 1 it runs the
    # sharded trainer on one rank (one GPU). CUDA only: on CPU ranks everything is in
    # host memory already, so it is refused there (not ignored).
    # Hashed into the training config when on: the optimizer's arithmetic moves to the
    # CPU, so a log's steps re-execute bit for bit only with the same setting.
    cpu_offload: bool = False


class TrainerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_path: str = "var/models/tiny"
    # Consumer group of the live trainer; its committed offsets are the resume point.
    group_id: str = "rollway-trainer"
    # The trainer's fixed Kafka transactional id ("" = topic prefix + group_id). Step
    # log entries and consumed offsets are written in transactions of this id, so a
    # newly started trainer fences every older one (one writer, always).
    transactional_id: str = ""
    # How long the broker waits for a silent trainer before handing its partitions on
    # (a restarted trainer waits this long to rejoin after a crash).
    session_timeout_ms: int = 10_000
    checkpoint_dir: str = "var/checkpoints"
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    # Publish weights through the syncer every K steps (0 = never).
    publish_every: int = 1
    publish_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # what samplers load; training stays in float32

    # -- batching -------------------------------------------------------------------
    groups_per_step: int = 4
    # Drop (or mask, see stale_policy) generated tokens more than this many versions
    # behind the weights being trained.
    max_staleness: int = 4
    stale_policy: Literal["drop_group", "mask_tokens"] = "drop_group"
    # At most this fraction of one batch's groups may come from one weight version
    # older than the newest published version (1.0 = no cap). See trainer/assembler.py.
    max_version_fraction: float = 1.0
    # Ready groups held at most; beyond this the version cap is relaxed for a step so
    # a backlog can never deadlock the trainer.
    max_buffered_groups: int = 256
    # Groups dropped between steps wait for the next step's TrainStep.dropped (their
    # records unacknowledged). More than held_drops_max of them, or one held longer than
    # held_drops_max_s, are logged at once in a GroupsDropped entry (a trainer that cannot
    # step, e.g. every group without reward variance, would hold them without bound);
    # so is whatever is held when the trainer stops.
    held_drops_max: int = 64
    held_drops_max_s: float = 30.0
    # Rows of one forward/backward pass are packed up to this many tokens.
    micro_batch_tokens: int = 16384

    # -- optimisation ---------------------------------------------------------------
    learning_rate: float = 1e-5  # AdamW: embeddings, norms, biases, lm_head
    muon_learning_rate: float = 1e-5  # Muon: 2-D hidden matrices
    # "match_rms_adamw" scales Muon's update to AdamW's RMS so both can share an lr.
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    muon_momentum: float = 0.95
    adam_betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 = no clipping
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Ranks of one logical trainer (FSDP2-sharded over torch.distributed; docs/trainer.md).
    # `rollway trainer` launches them with torchrun itself. Each step's batch is split
    # over the ranks by trainer.distributed.SPLIT_RULE, so a log written at N ranks
    # replays at N ranks only (the training-config hash holds N; at 1 it is unchanged).
    world_size: int = 1
    fsdp: FsdpConfig = msgspec.field(default_factory=FsdpConfig)
    # torch intra-op threads (0 = torch's default). Bit-exact replay on CPU needs the
    # same value (and CPU kind) as the run that wrote the log.
    num_threads: int = 0

    # -- loss -----------------------------------------------------------------------
    # group_std: (r - mean) / (std + eps), population std; group_mean: r - mean (Dr.
    # GRPO); none: raw reward; penalty_aware: group_mean for a group whose rewards carry
    # a length or budget penalty (budget phases), else group_std. group_std there would
    # cancel the penalty coefficient: all-solved groups differing only in length got
    # advantages of +-1.3, as large as solve vs fail (trainer/loss.py, docs/advantages.md).
    advantage_norm: Literal["penalty_aware", "group_std", "group_mean", "none"] = "penalty_aware"
    advantage_eps: float = 1e-6
    # tis: truncated importance sampling, weight min(ratio, is_cap), no gradient
    # through the weight; clip: PPO-style clipped surrogate against the behaviour
    # log-probs; none: plain policy gradient.
    importance_sampling: Literal["tis", "clip", "none"] = "tis"
    is_cap: float = 2.0
    clip_epsilon: float = 0.2
    # Ablation switch: False = TIS uses the raw ratio / clip mode does not clip.
    is_truncation: bool = True
    # Sampling distribution replay: renormalise the trainer's distribution over the
    # sampler's recorded kept set. False = full-vocabulary log-probs (ablation).
    replay_kept_sets: bool = True
    # A token whose kept set the engine cut short (kept_capped=1): full_vocab = use the
    # full-vocabulary log-prob for it; mask = leave it out of the loss; kept_set =
    # renormalise over the incomplete set anyway.
    capped_kept_set: Literal["full_vocab", "mask", "kept_set"] = "full_vocab"
    # A capped kept set whose size the sampler recorded is rebuilt as the trainer's own
    # top-size (the sampled token forced in when it is not: kept_rebuilt_missing), so
    # the trainer renormalises over the set the sampler drew from, not an approximation
    # (identical weights: ratio 1). capped_kept_set then applies only to capped sets of
    # unknown size. False: every capped set goes to capped_kept_set (as before).
    rebuild_capped_kept_sets: bool = True
    # MoE routing replay (R3): route each position to the experts the sampler recorded
    # for it (gate weights: the router's softmax at those experts, so the router still
    # learns; docs/contracts.md, "Routing"). False = recompute top-k (ablation); the
    # routing_differs_frac metric is measured either way. No effect on dense models.
    replay_routing: bool = True
    # Precision replay: compute the forward (log-probs and their gradients) with the
    # weights cast to publish_dtype, the precision samplers run, from the float32
    # masters (gradients flow back to the masters; the optimizer stays float32).
    # On by default: against bf16 samplers it cuts the trainer-sampler mismatch KL (k3
    # 2.2e-5 -> 1.4e-5 vs vLLM, 2.8e-5 -> 5.4e-6 vs TorchEngine; docs/trainer.md).
    # False only where the samplers compute in float32 (then publish_dtype float32
    # makes it a no-op anyway).
    replay_precision: bool = True

    # -- metrics --------------------------------------------------------------------
    metrics_source: str = "trainer"
    # "fail": refuse to go live when a replayed step's hash differs from the log.
    on_replay_mismatch: Literal["fail", "warn"] = "fail"

    @property
    def sharded(self) -> bool:
        """Runs as torch.distributed ranks with the FSDP2 trainer (trainer/ranked_service.py):
        above one rank, or at one rank with CPU offload (one GPU, the model's state in host
        memory). Otherwise the single-process trainer."""
        return self.world_size > 1 or self.fsdp.cpu_offload

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"trainer.world_size must be >= 1, got {self.world_size}")
        if self.fsdp.cpu_offload and self.device == "cpu":
            raise ValueError("trainer.fsdp.cpu_offload = true needs CUDA ranks, but trainer.device = 'cpu', where "
                             "parameters, gradients and optimizer state are in host memory already; set it to false")
        if self.groups_per_step < 1:
            raise ValueError("trainer.groups_per_step must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("trainer.max_staleness must be >= 0")
        if not 0.0 < self.max_version_fraction <= 1.0:
            raise ValueError("trainer.max_version_fraction must be in (0, 1]")
        if self.held_drops_max < 1 or not (math.isfinite(self.held_drops_max_s) and self.held_drops_max_s >= 0):
            raise ValueError("trainer.held_drops_max must be >= 1 and trainer.held_drops_max_s a finite number >= 0")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("trainer.checkpoint_every must be >= 0 and keep_checkpoints >= 1")
        if self.is_cap <= 0 or self.clip_epsilon <= 0:
            raise ValueError("trainer.is_cap and trainer.clip_epsilon must be > 0")
        for name in ("learning_rate", "muon_learning_rate"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):  # a NaN rate would publish NaN weights
                raise ValueError(f"trainer.{name} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"trainer.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.publish_every > self.max_staleness + 1:
            # Samplers hold version P until step P + publish_every; from step P +
            # max_staleness + 1 on every group they send is stale, so the trainer never
            # reaches the step that would publish newer weights: a silent stall.
            raise ValueError(
                f"trainer.publish_every = {self.publish_every} cannot train with trainer.max_staleness = "
                f"{self.max_staleness}: samplers get new weights every {self.publish_every} steps, so after "
                f"{self.max_staleness + 1} steps every group is stale and the next publish never comes; "
                f"need publish_every <= max_staleness + 1"
            )
