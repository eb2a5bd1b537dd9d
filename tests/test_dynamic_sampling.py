"""Dynamic sampling and the informative-group share (issue #30 point 2), without Kafka:

* the feeder's selector weights a task by the chance that a group of G samples has
  reward variance, pools solve rates kind -> skill -> task, sharpens with a temperature
  (exact numbers), and on a population whose kinds mix easy and hard skills it draws
  more informative groups with skill pooling than with kind pooling alone;
* the assembler's dynamic sampling: zero-variance groups are dropped (counted, handed to
  the step log) and never reach a batch; the batch waits and fills with informative
  groups; a group is never dropped because its first samples agree;
* ``rollway.group_signal`` counts the share from step-log events, each group's end once.
The Kafka path (a real trainer, its step log and a bit-exact replay of a step with
dropped groups) is tests/test_dynamic_sampling_kafka.py."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from bus import Envelope
from rollway.group_signal import rolling_share, step_groups, tally, trained_per_minute
from rollway.live_state import informative_share
from schemas import GroupDrop, GroupRef, GroupsDropped, TrainStep
from tasks.config import FeederConfig
from tasks.selection import TaskSelector
from tests.synthetic import SampledTrajectory, load_tiny, make_task_groups, to_events
from tests.trainer_helpers import one_thread  # noqa: F401  autouse fixture
from trainer.assembler import Assembler
from trainer.config import TrainerConfig


# -- the selector ---------------------------------------------------------------------------
def test_weight_is_the_chance_of_an_informative_group_exact():
    s = TaskSelector(["a", "b"], window=8, min_attempts_to_retire=0, group_size=4)
    assert s.weights() == {"a": 0.875, "b": 0.875}  # p = 1/2: 1 - 2 / 16
    for solved in (True, True, True, False):
        s.record("a", solved)
    # p = (3 + 1) / (4 + 2) = 2/3: 1 - (2/3)^4 - (1/3)^4 = 64/81
    assert s.solve_rate("a") == pytest.approx(2 / 3)
    assert s.weight("a") == pytest.approx(64 / 81)
    assert s.expected_informative() == pytest.approx((64 / 81) ** 2 / (64 / 81 + 0.875) + 0.875 ** 2 / (64 / 81 + 0.875))
    # group_size 0 keeps the old weight, the variance p(1 - p).
    assert TaskSelector(["a"], group_size=0).weight("a") == 0.25
    assert TaskSelector(["a"], group_size=0).expected_informative() is None


def test_temperature_sharpens_the_weights_exact():
    s = TaskSelector(["a", "b"], window=8, min_attempts_to_retire=0, group_size=4, temperature=0.5)
    for _ in range(4):
        s.record("a", True)
    chance = 1 - (5 / 6) ** 4 - (1 / 6) ** 4
    assert s.weight("a") == pytest.approx(chance ** 2)
    assert s.weight("b") == pytest.approx(0.875 ** 2)
    with pytest.raises(ValueError, match="temperature must be positive"):
        TaskSelector(["a"], temperature=0.0)
    with pytest.raises(ValueError, match="feeder.selection_temperature must be positive"):
        FeederConfig(selection_temperature=-1.0)
    with pytest.raises(ValueError, match="feeder.selection_weight must be 'informative' or 'variance'"):
        FeederConfig(selection_weight="entropy")


def test_group_size_grows_with_the_solve_rate_until_the_target_chance_exact():
    s = TaskSelector(["easy", "even", "hard"], window=128, min_attempts_to_retire=0, group_size=8,
                     group_size_max=16, informative_target=0.8)
    for _ in range(8):
        s.record("easy", True)  # p = (8 + 1) / (8 + 2) = 0.9
    for _ in range(98):
        s.record("hard", False)  # p = 1 / 100
    # 0.9: 1 - 0.9^15 - 0.1^15 = 0.794 < 0.8 <= 1 - 0.9^16 - 0.1^16 = 0.815
    assert s.group_size_for("easy") == 16
    assert s.weight("easy") == pytest.approx(1 - 0.9 ** 16 - 0.1 ** 16)
    # unseen (p = 1/2): the base size already reaches the target (0.992)
    assert s.group_size_for("even") == 8 and s.weight("even") == pytest.approx(1 - 2 / 256)
    # 0.01: no size up to 16 reaches it; the largest (0.149)
    assert s.group_size_for("hard") == 16
    assert s.weight("hard") == pytest.approx(1 - 0.01 ** 16 - 0.99 ** 16)
    # a lower target stops earlier: 0.9 reaches 0.75 at 14 (0.771; 13 gives 0.746)
    lower = TaskSelector(["easy"], window=128, min_attempts_to_retire=0, group_size=8, group_size_max=16,
                         informative_target=0.75)
    for _ in range(8):
        lower.record("easy", True)
    assert lower.group_size_for("easy") == 14
    # without group_size_max every group has group_size samples, whatever the rate
    fixed = TaskSelector(["easy"], window=128, min_attempts_to_retire=0, group_size=8)
    for _ in range(8):
        fixed.record("easy", True)
    assert fixed.group_size_for("easy") == 8 and fixed.weight("easy") == pytest.approx(1 - 0.9 ** 8 - 0.1 ** 8)


def test_group_size_max_refuses_settings_it_cannot_follow():
    with pytest.raises(ValueError, match="group_size_max must be 0 .* at least group_size \\(8\\), got 4"):
        TaskSelector(["a"], group_size=8, group_size_max=4)
    with pytest.raises(ValueError, match="group_size_max needs group_size"):
        TaskSelector(["a"], group_size=0, group_size_max=16)
    with pytest.raises(ValueError, match="informative_target must be in \\(0, 1\\), got 1.0"):
        TaskSelector(["a"], group_size=8, group_size_max=16, informative_target=1.0)
    with pytest.raises(ValueError, match="feeder.group_size_max must be 0 .* at least group_size \\(8\\), got 6"):
        FeederConfig(group_size=8, group_size_max=6, selection_weight="informative")
    with pytest.raises(ValueError, match="feeder.group_size_max needs feeder.selection_weight = 'informative'"):
        FeederConfig(group_size=8, group_size_max=16)
    with pytest.raises(ValueError, match="feeder.informative_target must be in \\(0, 1\\), got 0.0"):
        FeederConfig(informative_target=0.0)
    cfg = FeederConfig(group_size=8, group_size_max=16, informative_target=0.7, selection_weight="informative")
    s = TaskSelector.from_config(["a"], cfg)
    assert (s.group_size, s.group_size_max, s.informative_target) == (8, 16, 0.7)


def test_solve_rates_pool_kind_then_skill_then_task_exact():
    kinds = {"a1": "k", "a2": "k", "b1": "k"}
    skills = {"a1": "k:easy", "a2": "k:easy", "b1": "k:hard"}
    s = TaskSelector(list(kinds), window=8, min_attempts_to_retire=0, groups=kinds, skills=skills, group_size=4)
    for _ in range(4):
        s.record("a1", True)
    m_kind = (4 + 1) / (4 + 2)
    m_easy = (4 + 2 * m_kind) / (4 + 2)
    assert s.kind_mean("b1") == pytest.approx(m_kind)
    assert s.prior_mean("a2") == pytest.approx(m_easy) and s.solve_rate("a2") == pytest.approx(m_easy)
    # A skill with no outcome yet takes the kind's rate.
    assert s.solve_rate("b1") == pytest.approx(m_kind)
    assert s.solve_rate("a1") == pytest.approx((4 + 2 * m_easy) / (4 + 2))
    # The easy skill's fresh instance is drawn less than the untried skill's.
    assert s.weight("a2") < s.weight("b1")


def simulate(selector: TaskSelector, true_rate: dict[str, float], groups: int, seed: int) -> float:
    """Share of ``groups`` drawn groups of 4 whose outcomes were not all equal."""
    rng = random.Random(seed)
    informative = 0
    for _ in range(groups):
        task = selector.choose()
        outcomes = [rng.random() < true_rate[task] for _ in range(4)]
        informative += len(set(outcomes)) > 1
        for o in outcomes:
            selector.record(task, o)
    return informative / groups


def test_skill_pooling_draws_more_informative_groups_when_kinds_mix_easy_and_hard_skills():
    # Two kinds of 300 fresh instances each; in each kind a third of the skills is always
    # solved, a third never, a third at 0.5: the kind's rate (~0.5) says nothing about an
    # instance, its skill's does.
    ids, kinds, skills, rate = [], {}, {}, {}
    for kind in ("k1", "k2"):
        for i in range(300):
            tid, skill = f"{kind}-{i}", f"{kind}:s{i % 6}"
            ids.append(tid)
            kinds[tid], skills[tid] = kind, skill
            rate[tid] = (1.0, 0.0, 0.5)[i % 6 % 3]
    common = dict(window=8, min_attempts_to_retire=0, groups=kinds, group_size=4, seed=5)
    by_kind = simulate(TaskSelector(ids, **common), rate, 400, seed=1)
    by_skill = simulate(TaskSelector(ids, skills=skills, skill_window=64, **common), rate, 400, seed=1)
    sharp = simulate(TaskSelector(ids, skills=skills, skill_window=64, temperature=0.5, **common), rate, 400, seed=1)
    # Kind pooling alone draws all three skill classes alike: about 1/3 x 7/8 informative.
    assert by_kind < 0.4
    assert by_skill > 0.6 and sharp > by_skill


def test_the_feeder_pools_by_the_family_skill_metadata():
    from tasks.feeder import Feeder
    from tasks.store import TaskStore
    from bus import KafkaConfig

    cfg = FeederConfig(tasks_dir="family:train", family_tasks=40, selection_weight="informative",
                       pool_by_skill_window=64)
    store = TaskStore(cfg.tasks_dir, family_count=40, family_seed=1)
    feeder = Feeder(cfg, KafkaConfig(bootstrap_servers="127.0.0.1:1"), store)
    sel = feeder.selector
    assert len(sel.skills) == 40 and sel.group_size == cfg.group_size == 4
    assert {k.split(":")[0] for k in sel.skills.values()} == {"arith", "text", "lists", "fix"}
    assert "expected_informative_share" in feeder.snapshot()
    off = Feeder(FeederConfig(tasks_dir="family:train", family_tasks=40, pool_by_skill_window=0,
                              selection_weight="variance"), KafkaConfig(bootstrap_servers="127.0.0.1:1"), store)
    assert off.selector.skills == {} and off.selector.group_size == 0


# -- the assembler: dynamic sampling -----------------------------------------------------------
_offsets = itertools.count()


@pytest.fixture(scope="module")
def sampled(tiny_model_path) -> list[list[SampledTrajectory]]:
    model, tok = load_tiny(str(tiny_model_path))
    return make_task_groups(model, tok, 2, group_size=4, max_new_tokens=8, env_after=3, seed=7)


def renamed(group: list[SampledTrajectory], task_id: str) -> list[SampledTrajectory]:
    return [dataclasses.replace(t, task_id=task_id, group_id="g-" + task_id) for t in group]


def envs(traj: SampledTrajectory, reward: float | None = None) -> list[Envelope]:
    chunks, rew = to_events(traj, reward=reward, chunk_tokens=16)
    out = [Envelope(c, "t.trajectories", 0, next(_offsets), 0, None, ()) for c in chunks]
    return out + [Envelope(rew, "t.rewards", 0, next(_offsets), 0, None, ())]


def feed_group(asm: Assembler, group, rewards=None) -> None:
    for i, t in enumerate(group):
        for env in envs(t, None if rewards is None else rewards[i]):
            asm.add(env)


def test_zero_variance_groups_never_reach_a_batch_and_the_batch_fills_with_informative_ones(sampled):
    asm = Assembler(TrainerConfig(groups_per_step=2, max_staleness=4))
    a, b = renamed(sampled[0], "A"), renamed(sampled[1], "B")
    solved_all, failed_all = renamed(sampled[0], "Z1"), renamed(sampled[1], "Z2")
    feed_group(asm, solved_all, [1.0] * 4)
    feed_group(asm, a)
    assert asm.take_batch(0, 0) is None  # one informative group: the step waits
    feed_group(asm, failed_all, [0.0] * 4)
    assert asm.take_batch(0, 0) is None  # a drop does not count towards the batch
    feed_group(asm, b)
    batch = asm.take_batch(0, 0)
    assert batch is not None and [g.key for g in batch] == [("A", "g-A"), ("B", "g-B")]
    assert all(len(set(g.rewards())) > 1 for g in batch)
    trained = {t.trajectory_id for g in batch for t in g.members}
    assert not {t.trajectory_id for t in solved_all + failed_all} & trained
    drops, held = asm.take_drops()
    assert drops == [GroupDrop("Z1", "g-Z1", "zero_variance"), GroupDrop("Z2", "g-Z2", "zero_variance")]
    assert len(held) == sum(len(envs(t)) for t in solved_all + failed_all)  # acked with the step that logs them
    assert asm.counters["groups_dropped_zero_variance"] == 2


def test_a_group_is_never_dropped_because_its_first_samples_agree(sampled):
    asm = Assembler(TrainerConfig(groups_per_step=1, max_staleness=4))
    group = renamed(sampled[0], "C")
    for t in group[:3]:
        for env in envs(t, 1.0):
            asm.add(env)
    assert asm.take_batch(0, 0) is None and asm.take_drops() == ([], [])
    assert asm.counters["groups_dropped_zero_variance"] == 0
    for env in envs(group[3], 0.0):
        asm.add(env)
    batch = asm.take_batch(0, 0)
    assert batch is not None and batch[0].rewards() == [1.0, 1.0, 1.0, 0.0]


# -- the share, from step-log events -----------------------------------------------------------
def step(n: int, trained: list[str], dropped: list[tuple[str, str]] = (), at: float = 0.0) -> TrainStep:
    return TrainStep(step=n, weight_version=n, weights_hash="h", groups=[GroupRef(t, "g") for t in trained],
                     dropped=[GroupDrop(t, "g", r) for t, r in dropped], created_at=at)


def test_group_signal_counts_each_end_once_from_the_log():
    events = [
        step(1, ["a", "b"], [("z1", "zero_variance"), ("s", "stale")], at=1000.0),
        step(1, ["a", "b"], [("z1", "zero_variance")], at=1001.0),  # logged twice: the first entry counts
        step(2, ["c", "d"], [("z2", "zero_variance"), ("z1", "zero_variance")], at=1060.0),  # z1 again: once
        GroupsDropped(after_step=2, dropped=[GroupDrop("z3", "g", "zero_variance")]),
        step(3, ["e", "f"], [], at=1120.0),
    ]
    rows = step_groups(events)
    assert [(r.step, r.trained, r.dropped) for r in rows] == [
        (1, 2, {"stale": 1, "zero_variance": 1}), (2, 2, {"zero_variance": 2}), (3, 2, {})]
    total = tally(rows)
    assert (total.trained, total.zero_variance, total.ended) == (6, 3, 10)
    assert total.informative_share == pytest.approx(6 / 9)
    assert rolling_share(rows, window=4) == [(1, 2 / 3), (2, 0.5), (3, pytest.approx(4 / 6))]
    assert trained_per_minute(rows) == pytest.approx(4 / 2.0)  # steps 2 and 3 over 2 minutes
    assert informative_share(6, 3) == pytest.approx(6 / 9) and informative_share(0, 0) is None


def test_the_report_and_the_live_view_show_the_share():
    from rollway.live_view import status_line
    from rollway.report import collect, summary_markdown

    data = collect([step(1, ["a", "b"], [("z1", "zero_variance")], at=10.0),
                    step(2, ["c", "d"], [("z2", "zero_variance"), ("x", "stale")], at=70.0)])
    text = summary_markdown(data, [], "test")
    assert ("| groups with a learning signal (step log) | 0.667 = 4 trained / (4 + 2 dropped for zero variance); "
            "first / second half of the steps 0.667 / 0.667; other drops: stale 1 |") in text
    assert "| trained groups per minute | 2.00 |" in text

    from rollway.live_state import LiveState

    state = LiveState()
    m = state.model(now=0.0)
    assert m.informative_share is None and "signal=" not in status_line(m)


def test_the_report_draws_the_share_per_step(tmp_path):
    from rollway.report import collect
    from rollway.report_plots import informative_groups

    assert informative_groups(collect([]), tmp_path) is None
    data = collect([step(1, ["a"], [("z1", "zero_variance")], at=10.0), step(2, ["b", "c"], [], at=20.0)])
    name, caption = informative_groups(data, tmp_path)
    assert name == "informative_groups.png" and (tmp_path / name).stat().st_size > 0
    assert "learning signal" in caption
