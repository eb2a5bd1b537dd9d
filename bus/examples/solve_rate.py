"""Solve rate from ``rollway.rewards``: rolling, and per weight version.

Run it with ``rollway analytics solve-rate [--window 200] [--json report.json]
[--until-end]``, or copy it as the starting point of your own consumer (see
:mod:`bus.analytics`). It joins no consumer group: each start re-reads the rewards from
the beginning, so the report covers the whole run also after a restart.

A trajectory counts as solved when its verified score is 1 and it was not flagged for
cheating. "Tokens" are the policy's generated tokens (``Reward.cost.generated_tokens``).
"""

from __future__ import annotations

import os
import sys
from collections import deque
from typing import TextIO

import msgspec

from bus.analytics import Analytics
from bus.consumer import Envelope
from schemas import Reward


class VersionStats(msgspec.Struct):
    trajectories: int = 0
    solved: int = 0
    tokens: int = 0
    solved_tokens: int = 0

    @property
    def solve_rate(self) -> float:
        return self.solved / self.trajectories if self.trajectories else 0.0


class SolveRateReport(msgspec.Struct):
    rewards_seen: int
    window: int
    rolling_solve_rate: float
    rolling_mean_tokens_per_solved: float | None
    per_version: dict[int, dict[str, float]]


def is_solved(reward: Reward) -> bool:
    return reward.score >= 1.0 and not reward.cheated


class SolveRate(Analytics):
    topics = ["rewards"]

    def __init__(self, window: int = 200, print_every: int = 50, json_path: str | None = None,
                 out: TextIO | None = None) -> None:
        self.window: deque[tuple[bool, int]] = deque(maxlen=window)
        self.per_version: dict[int, VersionStats] = {}
        self.seen = 0
        self.print_every = print_every
        self.json_path = json_path
        self.out = out or sys.stdout

    async def handle(self, reward: Reward, env: Envelope) -> None:
        self.add(reward)
        if self.print_every and self.seen % self.print_every == 0:
            self.print_summary()

    def add(self, reward: Reward) -> None:
        solved = is_solved(reward)
        tokens = reward.cost.generated_tokens
        self.seen += 1
        self.window.append((solved, tokens))
        stats = self.per_version.setdefault(reward.weight_version, VersionStats())
        stats.trajectories += 1
        stats.tokens += tokens
        if solved:
            stats.solved += 1
            stats.solved_tokens += tokens

    def report(self) -> SolveRateReport:
        solved_tokens = [t for s, t in self.window if s]
        return SolveRateReport(
            rewards_seen=self.seen,
            window=len(self.window),
            rolling_solve_rate=(sum(s for s, _ in self.window) / len(self.window)) if self.window else 0.0,
            rolling_mean_tokens_per_solved=(sum(solved_tokens) / len(solved_tokens)) if solved_tokens else None,
            per_version={
                v: {
                    "trajectories": s.trajectories,
                    "solve_rate": s.solve_rate,
                    "mean_tokens": s.tokens / s.trajectories,
                    "mean_tokens_per_solved": (s.solved_tokens / s.solved) if s.solved else float("nan"),
                }
                for v, s in sorted(self.per_version.items())
            },
        )

    def print_summary(self) -> None:
        r = self.report()
        tokens = "-" if r.rolling_mean_tokens_per_solved is None else f"{r.rolling_mean_tokens_per_solved:.1f}"
        print(f"rewards={r.rewards_seen} rolling_solve_rate={r.rolling_solve_rate:.3f} "
              f"(last {r.window}) mean_tokens_per_solved={tokens}", file=self.out)
        for version, s in r.per_version.items():
            print(f"  version {version}: n={int(s['trajectories'])} solve_rate={s['solve_rate']:.3f} "
                  f"mean_tokens={s['mean_tokens']:.1f}", file=self.out)
        self.out.flush()

    async def on_stop(self) -> None:
        self.print_summary()
        if self.json_path:
            write_json_atomic(self.json_path, msgspec.json.encode(self.report()))


def write_json_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
