"""The feeder's pure parts: selection policy, outstanding groups, reward bookkeeping."""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest

from bus.config import KafkaConfig
from schemas import Reward
from tasks.config import FeederConfig
from tasks.feeder import Feeder
from tasks.outstanding import OutstandingGroups
from tasks.selection import RETIRED_SOLVED, RETIRED_UNSOLVED, TaskSelector
from tasks.store import TaskStore


def selector(**kw) -> TaskSelector:
    args = dict(window=8, min_attempts_to_retire=4, seed=0)
    args.update(kw)
    return TaskSelector(["a", "b", "c"], **args)


def test_unseen_tasks_get_the_prior_weight():
    s = selector()
    assert s.weights() == {"a": 0.25, "b": 0.25, "c": 0.25}
    assert s.solve_rate("a") == 0.5
    s2 = selector(prior_successes=1.0, prior_failures=3.0)
    assert s2.solve_rate("a") == 0.25 and s2.weight("a") == 0.1875


def test_weights_are_posterior_variance_exact():
    s = selector()
    for solved in (True, False):
        s.record("a", solved)  # 1 of 2: p = 2/4
    for _ in range(2):
        s.record("b", True)  # 2 of 2: p = 3/4
        s.record("c", False)  # 0 of 2: p = 1/4
    assert (s.solve_rate("a"), s.solve_rate("b"), s.solve_rate("c")) == (0.5, 0.75, 0.25)
    assert s.weights() == {"a": 0.25, "b": 0.1875, "c": 0.1875}
    assert s.probabilities() == {"a": 0.4, "b": 0.3, "c": 0.3}


def test_unseen_tasks_take_their_kinds_solve_rate_when_pooled():
    kinds = {"a1": "easy", "a2": "easy", "b1": "hard", "b2": "hard", "c": "new"}
    s = TaskSelector(list(kinds), window=8, min_attempts_to_retire=0, seed=0, groups={**kinds, "ghost": "x"},
                     group_window=4)
    for _ in range(3):
        s.record("a1", True)   # easy: 3 of 3 -> kind mean (3 + 1) / (3 + 2) = 0.8
        s.record("b1", False)  # hard: 0 of 3 -> kind mean 1 / 5 = 0.2
    # a2 never tried: p is its kind's mean; a1 adds its own outcomes on top of that prior
    assert s.solve_rate("a2") == pytest.approx(0.8) and s.solve_rate("b2") == pytest.approx(0.2)
    assert s.solve_rate("a1") == pytest.approx((3 + 2 * 0.8) / (3 + 2))
    assert s.solve_rate("c") == 0.5  # a kind with no outcomes yet: the plain prior
    assert s.weight("a2") == pytest.approx(0.16) and s.weight("c") == 0.25
    # the kind's window slides: two failures of a1 in a 4-outcome window -> 2 of 4 solved
    s.record("a1", False)
    s.record("a1", False)
    assert s.prior_mean("a2") == pytest.approx((2 + 1) / (4 + 2))
    assert "ghost" not in s.groups  # ids that are not tasks are ignored


def test_pooling_by_kind_steers_draws_away_from_kinds_with_no_variance():
    ids = [f"{k}{i}" for k in ("solved", "mixed", "failed") for i in range(50)]
    kinds = {t: t.rstrip("0123456789") for t in ids}
    rates = {"solved": 1.0, "mixed": 0.5, "failed": 0.0}

    def draws(groups):
        s = TaskSelector(ids, window=8, min_attempts_to_retire=0, seed=3, groups=groups, group_window=64)
        rng, counts = random.Random(1), Counter()
        for _ in range(600):
            task = s.choose()
            counts[kinds[task]] += 1
            s.record(task, rng.random() < rates[kinds[task]])
        return counts

    plain, pooled = draws(None), draws(kinds)
    assert pooled["mixed"] > 0.6 * 600 and plain["mixed"] < 0.5 * 600
    assert pooled["mixed"] > plain["mixed"]


def test_the_feeder_pools_by_the_tasks_kind_metadata():
    from tasks.family import generate

    store = TaskStore("family:train", family_count=8, family_seed=0)
    feeder = Feeder(FeederConfig(tasks_dir="family:train", family_tasks=8), KafkaConfig(), store)
    assert feeder.selector.groups == {s.task_id: s.metadata["kind"] for s in generate("train", 8, seed=0)}
    unpooled = Feeder(FeederConfig(tasks_dir="family:train", family_tasks=8, pool_by_kind_window=0), KafkaConfig(),
                      store)
    assert unpooled.selector.groups == {}


def test_retire_always_and_never_solved_after_enough_attempts():
    s = selector()
    assert [s.record("b", True) for _ in range(4)] == ["", "", "", RETIRED_SOLVED]
    assert [s.record("c", False) for _ in range(4)] == ["", "", "", RETIRED_UNSOLVED]
    for solved in (True, False, True, False, True):
        assert s.record("a", solved) == ""
    assert s.retired() == {"b": RETIRED_SOLVED, "c": RETIRED_UNSOLVED}
    assert s.active() == ["a"]
    assert s.weights()["b"] == 0.0 and s.probabilities() == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert {s.choose() for _ in range(50)} == {"a"}
    # retirement is permanent even if the task then gets mixed results
    s.record("b", False)
    assert s.stats["b"].retired == RETIRED_SOLVED


def test_solve_rate_follows_a_sliding_window():
    s = TaskSelector(["t"], window=4, min_attempts_to_retire=4)
    for solved in (False, True, True, True):
        assert s.record("t", solved) == ""  # 3 of 4: still learnable
    assert s.solve_rate("t") == (3 + 1) / (4 + 2)
    assert s.record("t", True) == RETIRED_SOLVED  # the early failure left the window
    assert s.stats["t"].attempts == 5 and s.stats["t"].solved == 4


def test_thresholds_retire_near_certain_tasks():
    s = TaskSelector(["t"], window=10, min_attempts_to_retire=10, retire_at_or_above=0.9)
    outcomes = [True] * 9 + [False]
    assert [s.record("t", o) for o in outcomes][-1] == RETIRED_SOLVED


def test_all_retired_means_nothing_to_choose():
    s = TaskSelector(["x"], window=2, min_attempts_to_retire=2)
    s.record("x", True)
    s.record("x", True)
    assert s.choose() is None


def test_choice_is_seeded_and_reproducible():
    s1, s2 = selector(seed=0), selector(seed=0)
    a = [s1.choose() for _ in range(10)]
    assert a == [s2.choose() for _ in range(10)]
    # random.Random(0).random() * 0.75 walks a, b, c: 0.633 -> c, 0.568 -> c, 0.315 -> b, ...
    assert a == ["c", "c", "b", "a", "b", "b", "c", "a", "b", "b"]
    s7 = selector(seed=7)
    assert a != [s7.choose() for _ in range(10)]


def test_choice_frequencies_follow_probabilities():
    s = selector(seed=3)
    s.record("a", True)
    s.record("a", False)
    for _ in range(2):
        s.record("b", True)
        s.record("c", False)
    counts = Counter(s.choose() for _ in range(20_000))
    for task, p in s.probabilities().items():
        assert counts[task] / 20_000 == pytest.approx(p, abs=0.015)


def test_mix_shifts_as_solve_rates_change():
    """A simulated policy: task 'a' starts learnable and becomes easy, 'b' starts hard
    and becomes learnable; the selector's mix follows."""
    s = TaskSelector(["a", "b"], window=16, min_attempts_to_retire=0, seed=5)  # no retiring here
    rng = random.Random(11)

    def run(p_solve: dict[str, float], rounds: int) -> Counter:
        picks = Counter()
        for _ in range(rounds):
            task = s.choose()
            picks[task] += 1
            s.record(task, rng.random() < p_solve[task])
        return picks

    before = run({"a": 0.5, "b": 0.03}, 400)
    after = run({"a": 0.97, "b": 0.5}, 400)
    assert before["a"] > 2 * before["b"]
    assert after["b"] > 2 * after["a"]


def test_duplicate_ids_and_empty_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        TaskSelector(["a", "a"])
    with pytest.raises(ValueError, match="no tasks"):
        TaskSelector([])
    with pytest.raises(ValueError, match="min_attempts_to_retire"):
        TaskSelector(["a"], window=4, min_attempts_to_retire=5)


def test_min_attempts_zero_never_retires():
    s = TaskSelector(["a"], window=4, min_attempts_to_retire=0)
    assert all(s.record("a", True) == "" for _ in range(20))
    assert s.active() == ["a"]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"groups_per_second": 0}, "groups_per_second must be positive"),
        ({"group_size": 0}, "group_size"),
        ({"min_attempts_to_retire": 100, "solve_rate_window": 10}, "min_attempts_to_retire must be within"),
        ({"retire_at_or_below": 0.5, "retire_at_or_above": 0.5}, "retire_at_or_below < retire_at_or_above"),
        ({"max_outstanding_groups": 0}, "max_outstanding_groups"),
    ],
)
def test_config_validation_names_the_field(fields, message):
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert(fields, FeederConfig)


def test_outstanding_groups_complete_on_distinct_sample_indexes():
    g = OutstandingGroups()
    g.add("g1", "a", 3, now=0.0)
    g.add("g2", "b", 1, now=5.0)
    assert len(g) == 2
    assert g.rewarded("g1", 0) is False
    assert g.rewarded("g1", 0) is False  # a duplicate reward does not count twice
    assert g.rewarded("g1", 7) is False  # out of range: ignored
    assert g.rewarded("g1", 2) is False
    assert g.rewarded("g1", 1) is True and "g1" not in g
    assert g.rewarded("g1", 1) is False  # already complete
    assert g.rewarded("unknown", 0) is False
    assert [gid for gid, _ in g.expire(now=10.0, timeout_s=5.0)] == []
    assert [gid for gid, _ in g.expire(now=10.5, timeout_s=5.0)] == ["g2"] and len(g) == 0
    g.add("g3", "a", 1, 0.0)
    with pytest.raises(ValueError, match="already outstanding"):
        g.add("g3", "a", 1, 0.0)


def _reward(tid: str, task: str, group: str, index: int, score: float, cheated: bool = False) -> Reward:
    return Reward(trajectory_id=tid, task_id=task, group_id=group, sample_index=index, attempt="0",
                  score=score, cheated=cheated)


def test_feeder_observe_counts_each_trajectory_once_and_cheats_as_failures(tmp_path):
    store = TaskStore(tmp_path_with_tasks(tmp_path, ["t1", "t2"]))
    feeder = Feeder(FeederConfig(solve_rate_window=8, min_attempts_to_retire=8), KafkaConfig(), store)
    feeder.outstanding.add("g", "t1", 2, now=0.0)
    feeder.observe(_reward("r1", "t1", "g", 0, 1.0))
    feeder.observe(_reward("r1", "t1", "g", 0, 1.0))  # redelivered
    feeder.observe(_reward("r2", "t1", "g", 1, 1.0, cheated=True))
    feeder.observe(_reward("r3", "t2", "other", 0, 0.5))  # partial score below the threshold
    feeder.observe(_reward("r4", "nope", "other", 0, 1.0))  # a task not in this store
    assert feeder.rewards_seen == 4
    assert (feeder.selector.stats["t1"].attempts, feeder.selector.stats["t1"].solved) == (2, 1)
    assert (feeder.selector.stats["t2"].attempts, feeder.selector.stats["t2"].solved) == (1, 0)
    assert len(feeder.outstanding) == 0  # both samples of g rewarded


def tmp_path_with_tasks(root, ids):
    for task_id in ids:
        folder = root / task_id
        (folder / "hidden_tests").mkdir(parents=True)
        (folder / "task.toml").write_text('instruction = "do it"\n')
        (folder / "hidden_tests" / "test_x.py").write_text("def test_x():\n    assert True\n")
    return root
