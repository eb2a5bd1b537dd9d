"""Sampler settings."""

from __future__ import annotations

from typing import Literal

import msgspec

from sampler.openai_api.config import EndpointConfig
from sampler.sampling import temperature_error


class TimingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The timing engine (:mod:`sampler.timing_engine`): emulates an accelerator's
    generation speed on any machine, so benchmarks measure the system's scheduling.
    Tokens are drawn, not computed; everything after the engine (recording, chunks,
    events, weight updates) is the real path."""

    # Per sequence, as on an accelerator where a batch's sequences decode in parallel.
    tokens_per_s: float = 200.0
    # Tokens delivered per emulated decoding step (one sleep, one weight version).
    step_tokens: int = 8
    # Completion length ~ lognormal(median, sigma), cut to the request's max_tokens.
    median_tokens: int = 64
    length_sigma: float = 0.5
    # A completion ends with <tool>submit</tool> with this probability, else with a
    # <tool>run ...</tool> call (so turns per rollout are geometric, mean 1/p).
    submit_probability: float = 0.34
    # Kept set recorded per token (uniform over it: log-prob -log(size)).
    kept_set_size: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.tokens_per_s > 0, f"sampler.timing.tokens_per_s must be > 0, got {self.tokens_per_s}"),
            (self.step_tokens >= 1, f"sampler.timing.step_tokens must be >= 1, got {self.step_tokens}"),
            (self.median_tokens >= 1, f"sampler.timing.median_tokens must be >= 1, got {self.median_tokens}"),
            (self.length_sigma >= 0, f"sampler.timing.length_sigma must be >= 0, got {self.length_sigma}"),
            (0 <= self.submit_probability <= 1,
             f"sampler.timing.submit_probability must be in [0, 1], got {self.submit_probability}"),
            (self.kept_set_size >= 1, f"sampler.timing.kept_set_size must be >= 1, got {self.kept_set_size}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class SamplerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_path: str = "var/models/tiny"
    # "timing": no model, tokens at sampler.timing's rate (benchmarks; the tokenizer
    # still comes from model_path).
    engine: Literal["vllm", "torch", "timing"] = "vllm"
    timing: TimingConfig = msgspec.field(default_factory=TimingConfig)
    group_id: str = "rollway-samplers"
    sandbox_url: str = "http://127.0.0.1:8300"
    # Sampling distribution (recorded on every chunk).
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = -1
    seed: int = 0
    # Engine.
    dtype: str = "bfloat16"
    max_model_len: int = 1024
    # vLLM's KV cache on CPU is VLLM_CPU_KVCACHE_SPACE (GiB); on GPU this fraction.
    gpu_memory_utilization: float = 0.1
    # Where kept sets come from: "auto" (native sampling mask when the installed vLLM
    # supports it on this platform, else processed logprobs), "native", "logprobs".
    kept_set_source: Literal["auto", "native", "logprobs"] = "auto"
    # Kept sets are read from the top (cap + 1) processed log-probs (or the native mask); larger sets are
    # cut to the cap and flagged per token (TrajectoryChunk.kept_capped).
    kept_set_cap: int = 64
    # Record MoE routed experts when the model is MoE and the engine offers them.
    record_routed_experts: bool = True
    # The model's chat format (sampler/formats): "auto" reads it from the model's
    # tokenizer (added tokens, chat template); or rollway, chatml-hermes, qwen3,
    # qwen3-coder, llama3-json. Prompts come from the tokenizer's chat template with the
    # tools as JSON schemas; calls are read at the family's special-token ids.
    format: str = "auto"
    # Agent budgets.
    max_tokens_per_turn: int = 256
    max_turns: int = 8
    max_total_tokens: int = 4096
    max_tool_seconds: float = 60.0
    # Per tool call; the remaining tool-seconds budget caps it further.
    tool_timeout_s: float = 10.0
    # Tool output beyond this many tokens is cut (with a marker) before it is appended.
    max_tool_output_tokens: int = 256
    # Compact when a segment's context reaches this fraction of max_model_len.
    compaction_fraction: float = 0.85
    summary_max_tokens: int = 128
    max_segments: int = 4
    # Text placed (as environment tokens, loss-masked) at the start of every assistant
    # turn, e.g. "<tool>run\n" to force a tool call from a weak model. Empty = none.
    assistant_prefill: str = ""
    # Service.
    max_in_flight: int = 8  # rollouts (samples) at once on this replica
    max_tasks_in_flight: int = 2  # tasks (groups) handled at once
    # Synchronous RL (0 = off, the default asynchronous mode): this replica starts at
    # most this many groups with weight version v, then waits for version v+1 before
    # taking the next task. Pair it with trainer.max_staleness = 0 and
    # trainer.groups_per_step = replicas x this, so each step trains exactly the groups
    # sampled with the weights before it. A step left short (a group dropped, e.g.
    # zero reward variance) would wait forever: after sync_refill_after_s without a new
    # version the replica starts one more group with the same weights.
    sync_groups_per_version: int = 0
    sync_refill_after_s: float = 30.0
    chunk_tokens: int = 256
    # Records stay under the bus limit by construction: a chunk is flushed before its
    # packed arrays would exceed this many bytes.
    max_chunk_bytes: int = 512 * 1024
    heartbeat_interval_s: float = 2.0
    # A replica silent this long loses its tasks to the others (Kafka group session).
    consumer_session_timeout_ms: int = 10_000
    # The task loop stops polling while every task slot is busy; Kafka drops a member
    # that has not polled for this long, so it must exceed the longest task.
    consumer_max_poll_interval_ms: int = 1_800_000
    # A rebalance of the replicas' group (one joins, leaves or dies) revokes this
    # replica's task partitions, all of them under Kafka's classic protocol, also the
    # ones it gets straight back. Groups in flight of a revoked partition get this long
    # to finish here and be committed before the rebalance goes on; the rest go on until
    # the new assignment, then keep running where the partition came back and are
    # cancelled, unacked, where it moved (the new owner samples them from the commit, a
    # new attempt). 0 = no wait: every replica's task intake waits for the slowest group
    # during a grace. Tasks done past the commit are named in its metadata and not
    # sampled again (docs/sampler.md, "Rebalances").
    revoke_grace_s: float = 0.0
    # Follow rollway.weights through the syncer's WeightSubscriber.
    follow_weights: bool = True
    # The OpenAI-compatible endpoint for agent harnesses (docs/agents.md); off by default.
    endpoint: EndpointConfig = msgspec.field(default_factory=EndpointConfig)
    # One HTTP call to the sandbox. A submit waits for a command slot and then the
    # grading, so this must exceed sandbox.command_queue_timeout_s +
    # sandbox.grading_timeout_s (checked where both are known: rollway.config); below
    # it a slow grading was resampled although its reward was published.
    sandbox_request_timeout_s: float = 180.0
    # SIGTERM: in-flight groups get this long to finish; what is left then is abandoned
    # unacked (the task's next owner samples it again) and the replica exits cleanly.
    # It must cover a rollout's sandbox time (max_tool_seconds + a submit,
    # sandbox_request_timeout_s) plus its generation; the container's stop grace period
    # must exceed it (docker-compose.yml: stop_grace_period).
    drain_timeout_s: float = 600.0

    @property
    def consumer_heartbeat_ms(self) -> int:
        """The task consumer's heartbeat interval: a fifth of its session."""
        return max(500, self.consumer_session_timeout_ms // 5)

    def __post_init__(self) -> None:
        formats = ("auto", "rollway", "chatml-hermes", "qwen3", "qwen3-coder", "llama3-json")
        if self.format not in formats:
            raise ValueError(f"sampler.format must be one of {', '.join(formats)}, not {self.format!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampler.top_p must be in (0, 1], not {self.top_p}")
        error = temperature_error("sampler.temperature", self.temperature)
        if error is not None:
            raise ValueError(error)
        if not 0.1 <= self.compaction_fraction <= 1.0:
            raise ValueError(f"sampler.compaction_fraction must be in [0.1, 1], not {self.compaction_fraction}")
        if self.kept_set_cap < 1:
            raise ValueError(f"sampler.kept_set_cap must be >= 1, not {self.kept_set_cap}")
        if self.sync_groups_per_version < 0 or self.sync_refill_after_s <= 0:
            raise ValueError("sampler.sync_groups_per_version must be >= 0 and sampler.sync_refill_after_s > 0")
        if self.sync_groups_per_version > self.max_tasks_in_flight:
            raise ValueError(f"sampler.sync_groups_per_version ({self.sync_groups_per_version}) cannot exceed "
                             f"sampler.max_tasks_in_flight ({self.max_tasks_in_flight}): the groups of one "
                             "version could never all start")
        if self.revoke_grace_s < 0:
            raise ValueError(f"sampler.revoke_grace_s must not be negative, not {self.revoke_grace_s}")
        if self.chunk_tokens < 1 or self.max_chunk_bytes < 4096:
            raise ValueError("sampler.chunk_tokens must be >= 1 and sampler.max_chunk_bytes >= 4096")
        sandbox_time = self.max_tool_seconds + self.sandbox_request_timeout_s
        if self.drain_timeout_s < sandbox_time:
            raise ValueError(
                f"sampler.drain_timeout_s = {self.drain_timeout_s:g} cannot fit a rollout's sandbox time alone: "
                f"sampler.max_tool_seconds + sampler.sandbox_request_timeout_s (a submit) = {sandbox_time:g} s"
            )


class EvalConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``rollway eval`` and the evaluator component (:mod:`sampler.evaluation`, :mod:`sampler.evaluator`)."""

    # What to evaluate: "family:heldout" / "family:heldout-names" (held-out behaviours named
    # from the held-out name pool) / "family:train" (also without "family:"), or
    # "dir:PATH", a folder in the task format (what ``rollway eval --tasks DIR`` sets).
    split: str = "family:heldout"
    samples: int = 1  # samples per task; pass@1 = mean over tasks of the solved fraction
    # Tasks drawn from a family split; the first max_tasks (by id) of a folder, 0 = all.
    max_tasks: int = 100
    # Sampling temperature; negative = the sampler's (TOML has no null). top_p and the
    # agent's budgets are always the sampler's.
    temperature: float = -1.0
    # Seeds the family split's instances and the engine's sampling.
    seed: int = 0
    # Rollouts at once.
    concurrency: int = 4
    # Empty = sampler.sandbox_url.
    sandbox_url: str = ""
    # --- the evaluator component (``rollway evaluator``) ---
    # Evaluate every version v with v % every_n_versions == 0 (the newest due one when
    # several arrived during an evaluation).
    every_n_versions: int = 10
    # Evaluate the base model (version 0) first when the evals log has no result for it.
    evaluate_base: bool = True
    group_id: str = "rollway-evaluator"
    heartbeat_interval_s: float = 5.0

    def __post_init__(self) -> None:
        # Negative: the sampler's temperature (checked there).
        temperature = None if self.temperature < 0 else temperature_error("eval.temperature", self.temperature)
        checks = [
            (self.samples >= 1, f"eval.samples must be at least 1, got {self.samples}"),
            (self.max_tasks >= 0, f"eval.max_tasks must not be negative, got {self.max_tasks}"),
            (self.concurrency >= 1, f"eval.concurrency must be at least 1, got {self.concurrency}"),
            (self.every_n_versions >= 1, f"eval.every_n_versions must be at least 1, got {self.every_n_versions}"),
            (temperature is None, temperature or ""),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
