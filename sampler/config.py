"""Sampler settings."""

from __future__ import annotations

import msgspec


class SamplerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_path: str = "var/models/tiny"
    engine: str = "vllm"  # vllm | torch
    group_id: str = "rollway-samplers"
    sandbox_url: str = "http://127.0.0.1:8300"
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = -1
    max_model_len: int = 1024
    max_tokens_per_turn: int = 256
    max_turns: int = 8
    max_total_tokens: int = 4096
    max_tool_seconds: float = 60.0
    # Compact when a segment's context reaches this fraction of max_model_len.
    compaction_fraction: float = 0.85
    # Kept sets are read from the top-k processed log-probs; sets larger than this are capped.
    kept_set_cap: int = 64
    max_in_flight: int = 8
    chunk_tokens: int = 256
    heartbeat_interval_s: float = 2.0
