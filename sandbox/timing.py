"""``TimingSandbox``: the sandbox service's client methods with drawn latencies.

For scheduling benchmarks (``benchmarks/async_vs_sync.py``, ``benchmarks/scale.py``):
tool calls and grading take lognormal times (heavy-tailed: with sigma 1 one call in a
hundred takes 10x the median) instead of running processes on the benchmark's two
cores. ``submit`` publishes a real ``Reward`` on ``rollway.rewards``, as the grader
does. The score is drawn (``solve_probability``) except that sample 0 of a group
solves and sample 1 does not, so no group is dropped for zero reward variance (a
benchmark of scheduling should not lose groups to chance).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from sandbox.client import ExecResult
from schemas import Cost, Reward

if TYPE_CHECKING:
    from bus import EventProducer


class TimingSandboxConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    exec_median_s: float = 0.5
    exec_sigma: float = 1.0
    grading_median_s: float = 1.0
    grading_sigma: float = 1.0
    solve_probability: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.exec_median_s, self.grading_median_s) < 0 or min(self.exec_sigma, self.grading_sigma) < 0:
            raise ValueError("timing sandbox: medians and sigmas must be >= 0")
        if not 0 <= self.solve_probability <= 1:
            raise ValueError(f"timing sandbox: solve_probability must be in [0, 1], got {self.solve_probability}")


class TimingSandbox:
    """Drop-in for a started :class:`sandbox.client.SandboxClient` in a sampler."""

    def __init__(self, cfg: TimingSandboxConfig, producer: "EventProducer | None", *, sleep=asyncio.sleep) -> None:
        self.cfg = cfg
        self.producer = producer  # None: rewards are returned, not published
        self._sleep = sleep
        self._rng = np.random.default_rng(cfg.seed)
        self._ids = itertools.count()
        self.sessions: set[str] = set()
        self.execs = 0
        self.graded = 0

    async def __aenter__(self) -> "TimingSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    def draw_seconds(self, median: float, sigma: float) -> float:
        return median * math.exp(sigma * self._rng.standard_normal())

    async def create_session(self, task_id: str, files: dict[str, str] | None = None) -> str:
        session = f"timing-{next(self._ids)}"
        self.sessions.add(session)
        return session

    async def exec(self, session_id: str, command: str, timeout_s: float | None = None) -> ExecResult:
        seconds = self.draw_seconds(self.cfg.exec_median_s, self.cfg.exec_sigma)
        timed_out = timeout_s is not None and seconds > timeout_s
        await self._sleep(min(seconds, timeout_s) if timed_out else seconds)
        self.execs += 1
        return ExecResult(exit_code=None if timed_out else 0, timed_out=timed_out, duration_s=round(seconds, 4))

    async def read_file(self, session_id: str, path: str) -> str:
        return ""

    async def write_file(self, session_id: str, path: str, content: str) -> int:
        return len(content.encode())

    def score(self, sample_index: int) -> float:
        if sample_index in (0, 1):
            return 1.0 - sample_index
        return float(self._rng.random() < self.cfg.solve_probability)

    async def submit(self, session_id: str, *, trajectory_id: str, task_id: str = "", group_id: str = "",
                     sample_index: int = 0, attempt: str = "", cost: Cost | None = None,
                     weight_version: int = -1, trainer_step: int = -1) -> Reward:
        started = time.monotonic()
        await self._sleep(self.draw_seconds(self.cfg.grading_median_s, self.cfg.grading_sigma))
        score = self.score(sample_index)
        reward = Reward(
            trajectory_id=trajectory_id, task_id=task_id, group_id=group_id, sample_index=sample_index,
            attempt=attempt, score=score, tests_passed=int(score), tests_total=1, reason="timing sandbox",
            cost=cost or Cost(), reward=score, weight_version=weight_version,
            grading_seconds=round(time.monotonic() - started, 4), created_at=time.time(),
        )
        if self.producer is not None:
            await self.producer.publish(reward)
        self.sessions.discard(session_id)
        self.graded += 1
        return reward

    async def close_session(self, session_id: str) -> None:
        self.sessions.discard(session_id)
