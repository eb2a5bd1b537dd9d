"""Sandbox service and reward settings."""

from __future__ import annotations

import msgspec


class SandboxConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8300
    max_sessions: int = 16
    max_concurrent_commands: int = 4
    command_timeout_s: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 512 * 1024 * 1024
    max_processes: int = 64
    max_file_bytes: int = 16 * 1024 * 1024
    max_open_files: int = 256
    max_output_bytes: int = 64 * 1024
    workspace_root: str = ""  # empty = system temp dir
    tasks_dir: str = "tasks/demo"


class RewardConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Reward for a fully solved task before penalties.
    solve_reward: float = 1.0
    # all: score 1 only when every hidden test passes; fraction: passed / total.
    scoring: str = "all"
    length_penalty_per_token: float = 0.0
    # Alternating phases: a list of (phase, length) in steps or weight versions.
    phase_unit: str = "step"  # step | version
    phase_schedule: list[list[str]] = msgspec.field(default_factory=list)
    budget: float = 2000.0
    budget_weight_tokens: float = 1.0
    budget_weight_turns: float = 50.0
    budget_weight_tool_seconds: float = 10.0
    budget_penalty_per_unit: float = 0.0005
