"""Reward function: exact numbers for each component, the phases and the schedule."""

from __future__ import annotations

import math

import msgspec
import pytest

from rollway.config import ConfigError, load_config
from sandbox.config import RewardConfig
from sandbox.reward import (
    RewardParts,
    compute_reward,
    phase_at,
    suggest_length_penalty,
    weighted_cost,
)
from schemas import Cost

# Dyadic numbers throughout, so every expected value is exact in binary floating point.
CFG = RewardConfig(
    solve_reward=1.0,
    length_penalty_per_token=2**-10,
    phase_schedule=[("unconstrained", 100), ("budget", 50)],
    phase_unit="step",
    budget=1000.0,
    budget_weight_tokens=1.0,
    budget_weight_env_tokens=0.5,
    budget_weight_turns=50.0,
    budget_weight_tool_seconds=10.0,
    budget_penalty_per_unit=2**-11,
)
SMALL = Cost(generated_tokens=512, env_tokens=256, turns=4, tool_seconds=12.5)  # weighted 965
BIG = Cost(generated_tokens=1024, env_tokens=512, turns=8, tool_seconds=25.0)  # weighted 1930


def reward(cfg=CFG, *, score=1.0, cheated=False, cost=BIG, step=0, weight_version=0) -> RewardParts:
    return compute_reward(cfg, score=score, cheated=cheated, cost=cost, step=step, weight_version=weight_version)


def test_weighted_cost_exact():
    assert weighted_cost(CFG, SMALL) == 512 + 128 + 200 + 125
    assert weighted_cost(CFG, BIG) == 1024 + 256 + 400 + 250


def test_unconstrained_phase_pays_success_only():
    parts = reward(score=1.0, cost=BIG, step=0)
    assert parts == RewardParts(
        phase="unconstrained", length_penalty=0.0, budget_penalty=0.0, reward=1.0, weighted_cost=1930.0
    )
    assert reward(score=0.25, cost=BIG, step=99).reward == 0.25
    assert reward(cfg=msgspec.structs.replace(CFG, solve_reward=2.0), score=0.75, step=5).reward == 1.5


def test_budget_phase_length_penalty_and_hinge_budget_penalty():
    parts = reward(score=1.0, cost=BIG, step=100)
    # length: 1024 tokens * 2^-10 = 1.0; budget: (1930 - 1000) * 2^-11 = 0.4541015625
    assert parts == RewardParts(
        phase="budget", length_penalty=1.0, budget_penalty=0.4541015625, reward=-0.4541015625,
        weighted_cost=1930.0,
    )
    under = reward(score=1.0, cost=SMALL, step=149)
    # under budget (965 < 1000): only the linear length penalty, 512 * 2^-10 = 0.5
    assert (under.phase, under.length_penalty, under.budget_penalty, under.reward) == ("budget", 0.5, 0.0, 0.5)
    at_budget = msgspec.structs.replace(CFG, budget=965.0)
    assert reward(cfg=at_budget, score=1.0, cost=SMALL, step=120).budget_penalty == 0.0


def test_length_penalty_is_linear_in_generated_tokens_only():
    costs = [Cost(generated_tokens=n, env_tokens=10_000, turns=1) for n in (0, 256, 512, 2048)]
    cfg = msgspec.structs.replace(CFG, budget=1e9)
    assert [reward(cfg=cfg, cost=c, step=100).length_penalty for c in costs] == [0.0, 0.25, 0.5, 2.0]


def test_length_penalty_in_unconstrained_when_asked():
    cfg = msgspec.structs.replace(CFG, length_penalty_in_unconstrained=True)
    parts = reward(cfg=cfg, score=1.0, cost=SMALL, step=0)
    assert (parts.phase, parts.length_penalty, parts.budget_penalty, parts.reward) == ("unconstrained", 0.5, 0.0, 0.5)


# The cheat floor, exact: max_penalty 1.5 and cheat_margin 0.125 (dyadic).
FLOORED = msgspec.structs.replace(CFG, max_penalty=1.5, cheat_margin=0.125)
HUGE = Cost(generated_tokens=1 << 20, env_tokens=1 << 20, turns=1000, tool_seconds=1e6)


def test_cheat_gets_the_floor_of_its_phase_whatever_its_cost():
    for cost in (Cost(), SMALL, BIG, HUGE):
        for score in (0.0, 0.5, 1.0):
            # unconstrained (no penalties there): honest >= 0, cheat = -margin
            assert reward(FLOORED, score=score, cheated=True, cost=cost, step=0).reward == -0.125
            # budget: honest >= -max_penalty, cheat = -max_penalty - margin
            assert reward(FLOORED, score=score, cheated=True, cost=cost, step=100).reward == -1.625
    with_length = msgspec.structs.replace(FLOORED, length_penalty_in_unconstrained=True)
    assert reward(with_length, score=1.0, cheated=True, cost=Cost(), step=0).reward == -1.625


def test_honest_penalties_are_capped_at_max_penalty():
    # BIG in budget: 1.0 + 0.4541015625 = 1.4541015625 < 1.5: not capped
    assert reward(FLOORED, score=0.0, cost=BIG, step=100).reward == -1.4541015625
    # HUGE: length 1024 + budget ... far over 1.5: capped
    parts = reward(FLOORED, score=0.0, cost=HUGE, step=100)
    assert parts.reward == -1.5 and parts.length_penalty == 1024.0
    assert reward(FLOORED, score=1.0, cost=HUGE, step=100).reward == -0.5
    assert reward(FLOORED, score=0.0, cost=HUGE, step=0).reward == 0.0


def test_a_cheap_cheat_never_beats_an_expensive_honest_failure():
    # The case: a cheap cheat used to earn -0.02 and an expensive honest failure -0.20.
    for step in (0, 99, 100, 149):
        worst_honest = min(reward(FLOORED, score=0.0, cost=c, step=step).reward for c in (Cost(), SMALL, BIG, HUGE))
        best_cheat = max(reward(FLOORED, score=1.0, cheated=True, cost=c, step=step).reward
                         for c in (Cost(), SMALL, BIG, HUGE))
        assert best_cheat < worst_honest
        assert worst_honest - best_cheat == 0.125


def test_cheat_margin_must_be_positive():
    with pytest.raises(ValueError, match="cheat_margin must be positive"):
        RewardConfig(cheat_margin=0.0)


def test_schedule_boundaries_cycle():
    phases = {s: phase_at(CFG, s) for s in (0, 99, 100, 149, 150, 249, 250, 299, 300, 150 * 10**7 + 120)}
    assert phases == {
        0: "unconstrained", 99: "unconstrained", 100: "budget", 149: "budget", 150: "unconstrained",
        249: "unconstrained", 250: "budget", 299: "budget", 300: "unconstrained",
        150 * 10**7 + 120: "budget",  # 120 into the cycle
    }
    assert phase_at(CFG, -1) == "unconstrained"


def test_schedule_without_cycle_keeps_last_phase():
    cfg = msgspec.structs.replace(CFG, phase_schedule=[("unconstrained", 10), ("budget", 5)], phase_cycle=False)
    assert [phase_at(cfg, s) for s in (9, 10, 14, 15, 1000)] == ["unconstrained", "budget", "budget", "budget", "budget"]


def test_empty_schedule_is_always_unconstrained():
    cfg = RewardConfig(length_penalty_per_token=1.0)
    assert {phase_at(cfg, s) for s in range(0, 1000, 37)} == {"unconstrained"}
    assert compute_reward(cfg, score=1.0, cheated=False, cost=BIG, step=5, weight_version=5).reward == 1.0


def test_phase_unit_version_reads_weight_version_not_step():
    cfg = msgspec.structs.replace(CFG, phase_unit="version")
    assert reward(cfg=cfg, step=0, weight_version=100).phase == "budget"
    assert reward(cfg=cfg, step=100, weight_version=0).phase == "unconstrained"
    assert reward(cfg=CFG, step=0, weight_version=100).phase == "unconstrained"


@pytest.mark.parametrize("score", [-0.1, 1.5, math.nan])
def test_score_out_of_range_is_an_error(score):
    with pytest.raises(ValueError, match="score must be in"):
        reward(score=score)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"phase_schedule": [["warmup", 10]]}, "unknown phase 'warmup'"),
        ({"phase_schedule": [["budget", 0]]}, r"phase_schedule\[0\]: length must be positive"),
        ({"phase_unit": "epoch"}, "phase_unit"),
        ({"scoring": "most"}, "scoring"),
        ({"budget_penalty_per_unit": -1}, "budget_penalty_per_unit must not be negative"),
    ],
)
def test_bad_config_names_the_field(fields, message):
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert(fields, RewardConfig)


def test_schedule_from_toml_and_environment(tmp_path):
    toml = tmp_path / "rollway.toml"
    toml.write_text('[reward]\nphase_schedule = [["unconstrained", 100], ["budget", 50]]\nphase_unit = "version"\n')
    cfg = load_config(toml, environ={})
    assert cfg.reward.phase_schedule == [("unconstrained", 100), ("budget", 50)]
    assert cfg.reward.phase_unit == "version"
    cfg = load_config(toml, environ={"ROLLWAY_REWARD__PHASE_SCHEDULE": '[["budget", 7]]'})
    assert cfg.reward.phase_schedule == [("budget", 7)]
    with pytest.raises(ConfigError, match="unknown phase"):
        load_config(toml, environ={"ROLLWAY_REWARD__PHASE_SCHEDULE": '[["fast", 7]]'})


def test_suggest_length_penalty_on_an_exact_log_curve():
    # solve rate = 0.1 + 0.2 ln(tokens): tangent at 1000 tokens has slope 0.2 / 1000
    points = [(t, 0.1 + 0.2 * math.log(t)) for t in (100, 300, 1000, 3000)]
    s = suggest_length_penalty(points, target_tokens=1000)
    assert s.slope == pytest.approx(0.2, abs=1e-12)
    assert s.intercept == pytest.approx(0.1, abs=1e-12)
    assert s.coefficient == pytest.approx(0.0002, rel=1e-12)
    # the penalized objective p(t) - k t is maximized at the target
    objective = lambda t: s.intercept + s.slope * math.log(t) - s.coefficient * t  # noqa: E731
    assert objective(1000) > max(objective(900), objective(1100))
    # default target: the geometric mean of the token counts
    default = suggest_length_penalty(points)
    assert default.target_tokens == pytest.approx((100 * 300 * 1000 * 3000) ** 0.25, rel=1e-12)


def test_suggest_length_penalty_rejects_flat_or_falling_curves():
    with pytest.raises(ValueError, match="does not grow"):
        suggest_length_penalty([(100, 0.5), (1000, 0.4)])
    with pytest.raises(ValueError, match="at least 2"):
        suggest_length_penalty([(100, 0.5)])
    with pytest.raises(ValueError, match="same token count"):
        suggest_length_penalty([(100, 0.5), (100, 0.6)])
    with pytest.raises(ValueError, match="positive"):
        suggest_length_penalty([(0, 0.5), (100, 0.6)])
