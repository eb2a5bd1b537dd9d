"""The selector's kind floor (feeder.selection_kind_floor, issue #30 point 2): each kind
with active weight gets at least the floor of the draws, spread over its tasks by their
weights; the rest follows the weights. Exact probabilities for given outcomes, the draws
following them, the config wiring, and that the floor only reweights draws: no task (so
no group) is filtered because of its own samples."""

from __future__ import annotations

from collections import Counter

import pytest

from tasks.config import FeederConfig
from tasks.selection import TaskSelector

KINDS = {"a1": "arith", "a2": "arith", "t1": "text"}


def informative(p: float) -> float:
    return 1 - p ** 4 - (1 - p) ** 4


def floored(**kw) -> TaskSelector:
    return TaskSelector(list(KINDS), window=8, min_attempts_to_retire=0, group_size=4, kinds=KINDS, **kw)


def test_kind_floor_probabilities_exact():
    s = floored(kind_floor=0.1)
    for solved in (True, True, True, True):  # a1: p = (4 + 1) / (4 + 2) = 5/6
        s.record("a1", solved)
    w_a1, w_other = informative(5 / 6), 0.875  # a2, t1 unseen: p = 1/2
    total = w_a1 + 2 * w_other
    probs = s.probabilities()
    # (1 - 2 f) w / W + f w / W_kind, two kinds
    assert probs["a1"] == pytest.approx(0.8 * w_a1 / total + 0.1 * w_a1 / (w_a1 + w_other))
    assert probs["a2"] == pytest.approx(0.8 * w_other / total + 0.1 * w_other / (w_a1 + w_other))
    assert probs["t1"] == pytest.approx(0.8 * w_other / total + 0.1)
    assert sum(probs.values()) == pytest.approx(1.0)
    # without the floor: proportional to the weights, as before
    plain = TaskSelector(list(KINDS), window=8, min_attempts_to_retire=0, group_size=4, kinds=KINDS)
    for solved in (True, True, True, True):
        plain.record("a1", solved)
    assert plain.probabilities() == pytest.approx({"a1": w_a1 / total, "a2": w_other / total, "t1": w_other / total})


def test_a_kind_the_temperature_would_starve_keeps_its_floor():
    # text always solved (p = 9/10): at temperature 0.1 its weight is ~1e-4 of arith's
    s = floored(kind_floor=0.05, temperature=0.1)
    for _ in range(8):
        s.record("t1", True)
    w_t = informative(9 / 10) ** 10
    w_a = 0.875 ** 10
    assert s.weight("t1") == pytest.approx(w_t)
    probs = s.probabilities()
    assert probs["t1"] == pytest.approx(0.9 * w_t / (w_t + 2 * w_a) + 0.05)
    assert probs["t1"] >= 0.05
    unfloored = TaskSelector(list(KINDS), window=8, min_attempts_to_retire=0, group_size=4, temperature=0.1)
    for _ in range(8):
        unfloored.record("t1", True)
    # ~4e-5 of the draws without the floor
    assert unfloored.probabilities()["t1"] == pytest.approx(w_t / (w_t + 2 * w_a)) and w_t / (w_t + 2 * w_a) < 1e-4


def test_draws_follow_the_floored_probabilities():
    s = floored(kind_floor=0.05, temperature=0.1, seed=3)
    for _ in range(8):
        s.record("t1", True)
    probs = s.probabilities()
    n = 20_000
    counts = Counter(s.choose() for _ in range(n))
    for task, q in probs.items():
        assert counts[task] / n == pytest.approx(q, abs=0.01)


def test_a_retired_kind_gives_its_floor_back():
    s = floored(kind_floor=0.2)
    s.stats["t1"].retired = "always solved"
    assert s.probabilities() == pytest.approx({"a1": 0.5, "a2": 0.5, "t1": 0.0})
    for task in KINDS:
        s.stats[task].retired = "always solved"
    assert s.choose() is None and s.probabilities() == {"a1": 0.0, "a2": 0.0, "t1": 0.0}


def test_kind_floor_settings_are_checked_and_wired():
    with pytest.raises(ValueError, match="kind_floor must be >= 0 and below 1 / \\(number of kinds, 2\\)"):
        floored(kind_floor=0.5)
    with pytest.raises(ValueError, match="feeder.selection_kind_floor must be in \\[0, 1\\)"):
        FeederConfig(selection_kind_floor=1.0)
    assert FeederConfig().selection_kind_floor == 0.0  # off by default
    cfg = FeederConfig(selection_weight="informative", selection_temperature=0.1, selection_kind_floor=0.05)
    s = TaskSelector.from_config(list(KINDS), cfg, groups=KINDS)
    assert (s.kind_floor, s.kinds, s.temperature, s.group_size) == (0.05, KINDS, 0.1, 4)
    # kind pooling off: the floor still knows the kinds
    s = TaskSelector.from_config(list(KINDS), FeederConfig(pool_by_kind_window=0, selection_kind_floor=0.05),
                                 groups=KINDS)
    assert s.groups == {} and s.kinds == KINDS



def test_a_task_set_with_more_kinds_than_the_floor_allows_gets_half_an_equal_share_each():
    """The main job's floor (0.05, for the family's four kinds) on a user's task set of 25
    kinds: 25 x 0.05 >= 1 would leave nothing for the weights, and the selector refuses
    such a floor; the feeder's selector starts with each kind at 1 / (2 x 25) instead,
    and the probabilities are the floor's formula at that value."""
    kinds = {f"task{i}": f"kind{i}" for i in range(25)}
    cfg = FeederConfig(selection_weight="informative", selection_temperature=0.05, selection_kind_floor=0.05)
    s = TaskSelector.from_config(list(kinds), cfg, groups=kinds)
    assert s.kind_floor == 0.02
    assert s.probabilities() == pytest.approx({t: 1 / 25 for t in kinds})  # all unseen: equal
    for _ in range(8):
        s.record("task0", True)  # task0 solved 8 of 8: its weight falls, its floor stays
    probs = s.probabilities()
    assert probs["task0"] == pytest.approx(0.02 + 0.5 * s.weight("task0") / sum(s.weights().values()))
    assert sum(probs.values()) == pytest.approx(1.0)
    # a floor the kinds leave room for is kept as configured
    assert TaskSelector.from_config(list(KINDS), cfg, groups=KINDS).kind_floor == 0.05

def test_the_floor_never_filters_a_task_by_its_groups_first_samples():
    # The first three samples of a1's group agree (all solved): a1 is reweighted, never
    # removed, and every task can still be drawn; whether the group trains is the
    # assembler's decision once it is complete (tests/test_dynamic_sampling.py::
    # test_a_group_is_never_dropped_because_its_first_samples_agree).
    s = TaskSelector(list(KINDS), window=8, min_attempts_to_retire=4, group_size=4, kinds=KINDS,
                     kind_floor=0.05, temperature=0.1)
    for _ in range(3):
        assert s.record("a1", True) == ""
    assert s.active() == list(KINDS) and s.retired() == {}
    assert all(q > 0 for q in s.probabilities().values())
    assert s.record("a1", False) == ""  # the fourth disagrees: still active
    assert s.stats["a1"].window_attempts == 4 and s.stats["a1"].window_solved == 3
    assert all(q > 0 for q in s.probabilities().values())
