"""``rollway report``'s solve-rate curves, from every graded reward (pure: no Kafka, no
matplotlib).

* the rolling solve rate over all graded rewards (a solve: full score, not cheated; the
  live view's rule and window), against time and against the weight version that
  produced the rewards (== the trainer step of those weights), with held-out pass@1 on
  the same time axis. The per-step mean over *trained* groups leaves out every group
  dropped for zero variance (all solved or all failed): that figure jumps from step to
  step and hides the trend;
* the same per task kind (``Task.metadata["kind"]`` of the issued tasks);
* the length trade-off: solve rate against generated tokens for the rewards of the
  recent weight versions (token-quantile bins), the fit ``solve_rate = a + b ln(tokens)``
  of ``sandbox.reward.suggest_length_penalty``, the iso-reward line of the length-penalty
  coefficient in force (``solve_rate - k * tokens = const`` through the point of the fit
  that coefficient makes best) and the tangent coefficient the function picks.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable

import msgspec

from rollway.live_state import solved
from schemas import Reward, Task

NO_KIND = "(no kind)"


class Rolling(msgspec.Struct, frozen=True):
    """A rolling solve rate: one point per reward, over the last ``window`` rewards."""

    window: int
    at: list[float]  # created_at of the reward that ends each window
    versions: list[int]  # its weight version
    rates: list[float]


class VersionRate(msgspec.Struct, frozen=True):
    """Solve rate of the rewards of one weight version, and the rolling rate over the
    newest versions up to it that hold at least ``window`` rewards."""

    version: int
    rewards: int
    rate: float
    rolling: float


class TokenBin(msgspec.Struct, frozen=True):
    mean_tokens: float
    rewards: int
    solve_rate: float


class LengthTradeoff(msgspec.Struct, frozen=True, kw_only=True):
    """The solve-rate-vs-tokens curve of recent versions and the penalties over it."""

    versions: tuple[int, int]  # first and last weight version of the rewards used
    rewards: int
    bins: list[TokenBin]
    current: float  # the length-penalty coefficient in force (per generated token)
    current_source: str  # where ``current`` comes from
    intercept: float | None = None  # the fit a + b ln(tokens); None when it failed
    slope: float | None = None
    suggested: float | None = None  # suggest_length_penalty's tangent coefficient
    target_tokens: float | None = None  # where the suggested line touches the fit
    solve_rate_at_target: float | None = None
    why_not: str = ""  # why there is no suggestion

    def fit(self, tokens: float) -> float:
        assert self.intercept is not None and self.slope is not None
        return self.intercept + self.slope * math.log(tokens)

    def current_tangent(self) -> tuple[float, float] | None:
        """(tokens, solve rate) where the current coefficient's iso-reward line touches
        the fit: the most rewarding length under it (t = b / k); None without a fit or
        with k = 0 (no finite optimum: longer always pays)."""
        if self.slope is None or self.current <= 0:
            return None
        t = self.slope / self.current
        return t, self.fit(t)


def window_for(n: int, window: int) -> int:
    """The live view's window (``up.solve_window``), smaller on a short log so the curve
    has points to show: at most a fifth of the rewards, at least 10 (or all of them)."""
    return max(1, min(window, max(10, n // 5), n))


def rolling_solve_rate(rewards: list[Reward], window: int) -> Rolling:
    """Over ``rewards`` in time order (``RunData.rewards`` is)."""
    w = window_for(len(rewards), window)
    hits = [1 if solved(r) else 0 for r in rewards]
    at, versions, rates = [], [], []
    total = 0
    for i, r in enumerate(rewards):
        total += hits[i]
        if i >= w:
            total -= hits[i - w]
        if i + 1 >= w:
            at.append(r.created_at)
            versions.append(r.weight_version)
            rates.append(total / w)
    return Rolling(w, at, versions, rates)


def solve_rate_by_version(rewards: list[Reward], window: int) -> list[VersionRate]:
    """Per weight version (rewards without one, -1, are left out)."""
    by: dict[int, list[int]] = {}
    for r in rewards:
        if r.weight_version >= 0:
            by.setdefault(r.weight_version, []).append(1 if solved(r) else 0)
    versions = sorted(by)
    w = window_for(sum(len(v) for v in by.values()), window)
    out = []
    for i, v in enumerate(versions):
        hits: list[int] = []
        for u in reversed(versions[: i + 1]):
            hits += by[u]
            if len(hits) >= w:
                break
        out.append(VersionRate(v, len(by[v]), sum(by[v]) / len(by[v]), sum(hits) / len(hits)))
    return out


def kinds_of(tasks: Iterable[Task]) -> dict[str, str]:
    """task id -> kind, from the issued tasks' metadata."""
    return {t.task_id: t.metadata.get("kind", "") for t in tasks if t.metadata.get("kind")}


def rolling_by_kind(rewards: list[Reward], kinds: dict[str, str], window: int) -> dict[str, Rolling]:
    """The rolling solve rate of each task kind (rewards of tasks without one: ``NO_KIND``,
    only when some tasks have a kind)."""
    if not kinds:
        return {}
    groups: dict[str, list[Reward]] = {}
    for r in rewards:
        groups.setdefault(kinds.get(r.task_id, NO_KIND), []).append(r)
    return {k: rolling_solve_rate(rs, window) for k, rs in sorted(groups.items())}


def current_coefficient(rewards: list[Reward], configured: float) -> tuple[float, str]:
    """The coefficient the grader applied, read off the rewards (length penalty per
    generated token), else the configured one."""
    seen = [r.length_penalty / r.cost.generated_tokens for r in rewards
            if r.length_penalty > 0 and r.cost.generated_tokens > 0]
    if seen:
        return statistics.median(seen), "the rewards' length penalties"
    if configured > 0:
        return configured, "reward.length_penalty_per_token (no reward carried a length penalty)"
    return 0.0, "none in force (reward.length_penalty_per_token = 0)"


def recent(rewards: list[Reward], at_least: int) -> list[Reward]:
    """The rewards of the newest weight versions, adding older versions until at least
    ``at_least`` rewards (or all) are in."""
    by: dict[int, list[Reward]] = {}
    for r in rewards:
        if r.weight_version >= 0:
            by.setdefault(r.weight_version, []).append(r)
    out: list[Reward] = []
    for v in sorted(by, reverse=True):
        out += by[v]
        if len(out) >= at_least:
            break
    return out


def token_bins(rewards: list[Reward], bins: int) -> list[TokenBin]:
    """Quantile bins of generated tokens (equal counts), each with its solve rate."""
    pts = sorted((r.cost.generated_tokens, 1 if solved(r) else 0) for r in rewards if r.cost.generated_tokens > 0)
    if not pts:
        return []
    bins = max(1, min(bins, len(pts)))
    out = []
    for b in range(bins):
        part = pts[b * len(pts) // bins: (b + 1) * len(pts) // bins]
        if part:
            out.append(TokenBin(statistics.fmean(t for t, _ in part), len(part), statistics.fmean(s for _, s in part)))
    return out


def length_tradeoff(rewards: list[Reward], configured: float, *, at_least: int = 200,
                    max_bins: int = 8) -> LengthTradeoff | None:
    """The trade-off of the recent versions; None without rewards that have a version
    and generated tokens."""
    from sandbox.reward import suggest_length_penalty

    chosen = [r for r in recent(rewards, at_least) if r.cost.generated_tokens > 0]
    if not chosen:
        return None
    bins = token_bins(chosen, max(2, min(max_bins, len(chosen) // 20)))
    current, source = current_coefficient(chosen, configured)
    versions = (min(r.weight_version for r in chosen), max(r.weight_version for r in chosen))
    base = dict(versions=versions, rewards=len(chosen), bins=bins, current=current, current_source=source)
    try:
        s = suggest_length_penalty([(b.mean_tokens, b.solve_rate) for b in bins])
    except ValueError as exc:
        return LengthTradeoff(**base, why_not=str(exc))
    return LengthTradeoff(**base, intercept=s.intercept, slope=s.slope, suggested=s.coefficient,
                          target_tokens=s.target_tokens, solve_rate_at_target=s.solve_rate_at_target)


def apply_line(coefficient: float) -> str:
    """How to put a coefficient in force (the sandbox grades and computes rewards)."""
    value = f"{coefficient:.3g}"
    return (f"`length_penalty_per_token = {value}` under `[reward]` in the config `rollway sandbox` reads (or "
            f"`ROLLWAY_REWARD__LENGTH_PENALTY_PER_TOKEN={value}` in its environment), then restart the sandbox "
            f"(`rollway up` restarts it with the stack); it applies in budget phases, and in unconstrained ones "
            f"with `length_penalty_in_unconstrained = true`")
