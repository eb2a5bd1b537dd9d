"""The reward: verified score, zero for cheating, length and budget penalties by phase.

For one graded rollout with verified score ``s`` in [0, 1] (the grader computes it from
the hidden tests), cost ``c`` (:class:`schemas.Cost`) and configuration ``cfg``
(:class:`sandbox.config.RewardConfig`)::

    phase          = phase_at(cfg, position)      position = step or weight_version (cfg.phase_unit)
    success        = 0 if cheated else cfg.solve_reward * s
    weighted_cost  = w_tokens * c.generated_tokens + w_env_tokens * c.env_tokens
                     + w_turns * c.turns + w_tool_seconds * c.tool_seconds
    length_penalty = cfg.length_penalty_per_token * c.generated_tokens
                         in budget phases (and in unconstrained ones only when
                         cfg.length_penalty_in_unconstrained), else 0
    budget_penalty = cfg.budget_penalty_per_unit * max(0, weighted_cost - cfg.budget)
                         in budget phases, else 0
    honest reward  = cfg.solve_reward * s - min(length_penalty + budget_penalty, cfg.max_penalty)

So an unconstrained phase optimizes success only: reward = solve_reward * s.

The cheat floor. A detected cheat earns, whatever its score and cost::

    floor(phase)   = -(cfg.max_penalty if penalties apply in the phase else 0) - cfg.cheat_margin
    cheat reward   = floor(phase)

Penalties apply in budget phases, and in unconstrained ones when
``length_penalty_in_unconstrained`` is set. An honest trajectory's penalties are capped at
``max_penalty``, so its reward is at least ``-max_penalty`` where penalties apply and at
least 0 where they do not; ``cheat_margin > 0`` puts every cheat strictly below every
honest trajectory of the same phase. (Keeping a cheat's own penalties, as before, let a
cheap cheat at -0.02 beat an expensive honest failure at -0.20: the policy would learn to
cheat when stuck.) The Reward event still carries the uncapped penalties for analysis.

Phase schedule: ``cfg.phase_schedule`` is a list of ``(phase, length)``; with
``[("unconstrained", 100), ("budget", 50)]`` positions 0-99 are unconstrained, 100-149
budget, 150-249 unconstrained again, and so on (``phase_cycle = false``: after the list
ends its last phase lasts forever). An empty schedule is always unconstrained. A negative
position (step or version not known yet, -1) counts as 0.
"""

from __future__ import annotations

import math
from typing import Iterable

import msgspec

from sandbox.config import RewardConfig
from schemas import Cost

UNCONSTRAINED = "unconstrained"
BUDGET = "budget"


class RewardParts(msgspec.Struct, frozen=True, kw_only=True):
    """Every component of one reward; the grader copies them into the ``Reward`` event."""

    phase: str
    length_penalty: float
    budget_penalty: float
    reward: float
    weighted_cost: float = 0.0


def phase_at(cfg: RewardConfig, position: int) -> str:
    """The phase in force at ``position`` (a trainer step or a weight version)."""
    schedule = cfg.phase_schedule
    if not schedule:
        return UNCONSTRAINED
    position = max(0, position)
    cycle = sum(length for _, length in schedule)
    if cfg.phase_cycle:
        position %= cycle
    elif position >= cycle:
        return schedule[-1][0]
    for phase, length in schedule:
        if position < length:
            return phase
        position -= length
    raise AssertionError("unreachable: position is below the cycle length")


def schedule_position(cfg: RewardConfig, *, step: int, weight_version: int) -> int:
    return step if cfg.phase_unit == "step" else weight_version


def weighted_cost(cfg: RewardConfig, cost: Cost) -> float:
    return (
        cfg.budget_weight_tokens * cost.generated_tokens
        + cfg.budget_weight_env_tokens * cost.env_tokens
        + cfg.budget_weight_turns * cost.turns
        + cfg.budget_weight_tool_seconds * cost.tool_seconds
    )


def compute_reward(
    cfg: RewardConfig, *, score: float, cheated: bool, cost: Cost, step: int, weight_version: int
) -> RewardParts:
    if not 0.0 <= score <= 1.0 or math.isnan(score):
        raise ValueError(f"score must be in [0, 1], got {score}")
    phase = phase_at(cfg, schedule_position(cfg, step=step, weight_version=weight_version))
    spent = weighted_cost(cfg, cost)
    length_penalty = budget_penalty = 0.0
    if penalties_apply(cfg, phase):
        length_penalty = cfg.length_penalty_per_token * cost.generated_tokens
    if phase == BUDGET:
        budget_penalty = cfg.budget_penalty_per_unit * max(0.0, spent - cfg.budget)
    if cheated:
        total = cheat_floor(cfg, phase)
    else:
        total = cfg.solve_reward * score - min(length_penalty + budget_penalty, cfg.max_penalty)
    return RewardParts(
        phase=phase,
        length_penalty=length_penalty,
        budget_penalty=budget_penalty,
        reward=total,
        weighted_cost=spent,
    )


def penalties_apply(cfg: RewardConfig, phase: str) -> bool:
    return phase == BUDGET or cfg.length_penalty_in_unconstrained


def cheat_floor(cfg: RewardConfig, phase: str) -> float:
    """The reward of a detected cheat in ``phase``: strictly below the lowest honest reward
    there (``-max_penalty`` where penalties apply, else 0) by ``cheat_margin``."""
    return -(cfg.max_penalty if penalties_apply(cfg, phase) else 0.0) - cfg.cheat_margin


class LengthPenaltySuggestion(msgspec.Struct, frozen=True, kw_only=True):
    """A fit ``solve_rate = intercept + slope * ln(tokens)`` and the coefficient whose
    iso-reward line (``solve_rate - coefficient * tokens = const``) touches it at
    ``target_tokens``, i.e. where maximizing ``solve_rate - coefficient * tokens`` lands."""

    intercept: float
    slope: float
    target_tokens: float
    coefficient: float
    solve_rate_at_target: float


def suggest_length_penalty(
    points: Iterable[tuple[float, float]], target_tokens: float | None = None
) -> LengthPenaltySuggestion:
    """Given ``(mean generated tokens, solve rate)`` points, fit the log curve by least
    squares and return the per-token coefficient tangent to it at ``target_tokens``
    (default: the geometric mean of the points' token counts).

    The tangent point is the optimum of the penalized objective: d/dt (a + b ln t - k t)
    = b / t - k = 0 gives t = b / k, so k = b / target. The curve is concave for b > 0,
    so that stationary point is the maximum.
    """
    pts = [(float(t), float(p)) for t, p in points]
    if len(pts) < 2:
        raise ValueError(f"need at least 2 (tokens, solve rate) points, got {len(pts)}")
    for t, p in pts:
        if not t > 0:
            raise ValueError(f"token counts must be positive, got {t}")
    xs = [math.log(t) for t, _ in pts]
    ys = [p for _, p in pts]
    n = len(pts)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all points have the same token count; the curve's slope is undetermined")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    intercept = mean_y - slope * mean_x
    if slope <= 0:
        raise ValueError(
            f"solve rate does not grow with tokens (fitted slope {slope:.4g}); "
            "no positive length penalty is tangent to the curve"
        )
    target = math.exp(mean_x) if target_tokens is None else float(target_tokens)
    if not target > 0:
        raise ValueError(f"target_tokens must be positive, got {target_tokens}")
    return LengthPenaltySuggestion(
        intercept=intercept,
        slope=slope,
        target_tokens=target,
        coefficient=slope / target,
        solve_rate_at_target=intercept + slope * math.log(target),
    )
