"""``rollway report``'s solve-rate curves (rollway/report_curves.py) and their plots on a
synthetic run, without Kafka (the CLI on a real log is in tests/test_report.py)."""

from __future__ import annotations

import math
import random

import pytest

from rollway import report_curves as curves
from rollway.report import collect, summary_markdown
from schemas import Cost, EvalResult, Reward, Task


def reward(i: int, *, solved: bool, version: int = -1, tokens: int = 10, task: str = "task", at: float | None = None,
           penalty: float = 0.0, cheated: bool = False) -> Reward:
    return Reward(trajectory_id=f"t{i}", task_id=task, group_id=f"g{i}", sample_index=0, attempt="a",
                  score=1.0 if solved else 0.0, cheated=cheated, reward=(1.0 if solved else 0.0) - penalty,
                  length_penalty=penalty, cost=Cost(generated_tokens=tokens), weight_version=version,
                  created_at=100.0 + i if at is None else at)


def synthetic_run(seed: int = 0, versions: int = 20, per_version: int = 24, coefficient: float = 0.001):
    """A run whose ``add`` tasks get solved more often version after version and whose
    ``fix`` tasks never move; longer trajectories solve more (a log curve). Rewards carry
    the length penalty ``coefficient`` per generated token."""
    rng = random.Random(seed)
    tasks = [Task(task_id=f"{kind}-{j}", group_id=f"{kind}-{j}-g", group_size=2, instruction="x",
                  metadata={"kind": kind}) for kind in ("add", "fix") for j in range(5)]
    rewards, i = [], 0
    for v in range(versions):
        for _ in range(per_version):
            task = rng.choice(tasks)
            tokens = rng.randint(20, 400)
            length_factor = 0.4 + 0.6 * math.log(tokens / 20) / math.log(20)
            p = (0.15 + 0.035 * v) * length_factor if task.metadata["kind"] == "add" else 0.03
            rewards.append(reward(i, solved=rng.random() < p, version=v, tokens=tokens, task=task.task_id,
                                  at=1000.0 + 30.0 * v + i % per_version, penalty=coefficient * tokens))
            i += 1
    evals = [EvalResult(split="family:heldout", weight_version=v, pass_at_1=0.1 + 0.02 * v, tasks=100, samples=1,
                        per_kind={"add": 0.15 + 0.03 * v, "fix": 0.0}, created_at=1000.0 + 30.0 * v + 25)
             for v in (0, 10, 19)]
    return tasks, rewards, evals


def test_rolling_solve_rate_over_the_last_window_of_rewards():
    rs = [reward(0, solved=True), reward(1, solved=False), reward(2, solved=True), reward(3, solved=True),
          reward(4, solved=True, cheated=True)]  # a cheat is not a solve
    r = curves.rolling_solve_rate(rs, window=2)
    assert r.window == 2 and r.rates == [0.5, 0.5, 1.0, 0.5] and r.at == [101.0, 102.0, 103.0, 104.0]
    # A short log gets a smaller window than the live view's, never a bigger one than the log.
    assert curves.window_for(5, 200) == 5 and curves.window_for(1000, 200) == 200
    assert curves.window_for(300, 200) == 60


def test_solve_rate_by_version_rolls_over_the_newest_versions_holding_a_window():
    rs = [reward(0, solved=True, version=0), reward(1, solved=False, version=0), reward(2, solved=True, version=1),
          reward(3, solved=False, version=2), reward(4, solved=False, version=2), reward(5, solved=False, version=2),
          reward(6, solved=True)]  # no version: left out
    rows = curves.solve_rate_by_version(rs, window=3)
    assert [(r.version, r.rewards, r.rate) for r in rows] == [(0, 2, 0.5), (1, 1, 1.0), (2, 3, 0.0)]
    assert [round(r.rolling, 4) for r in rows] == [0.5, 0.6667, 0.0]


def test_per_kind_curves_come_from_the_tasks_metadata():
    tasks = [Task(task_id="a", group_id="g", group_size=1, instruction="", metadata={"kind": "add"}),
             Task(task_id="f", group_id="g", group_size=1, instruction="", metadata={"kind": "fix"}),
             Task(task_id="n", group_id="g", group_size=1, instruction="")]
    kinds = curves.kinds_of(tasks)
    assert kinds == {"a": "add", "f": "fix"}
    rs = [reward(0, solved=True, task="a"), reward(1, solved=False, task="f"), reward(2, solved=True, task="n"),
          reward(3, solved=False, task="a")]
    by = curves.rolling_by_kind(rs, kinds, window=200)
    assert {k: r.rates[-1] for k, r in by.items()} == {"add": 0.5, "fix": 0.0, curves.NO_KIND: 1.0}
    assert curves.rolling_by_kind(rs, {}, 200) == {}


def test_the_coefficient_in_force_is_read_off_the_rewards():
    rs = [reward(0, solved=True, tokens=100, penalty=0.2), reward(1, solved=False, tokens=50, penalty=0.1),
          reward(2, solved=False, tokens=10)]
    assert curves.current_coefficient(rs, configured=0.5) == (0.002, "the rewards' length penalties")
    assert curves.current_coefficient(rs[2:], configured=0.5)[0] == 0.5
    assert curves.current_coefficient(rs[2:], configured=0.0)[0] == 0.0


def test_length_tradeoff_uses_recent_versions_and_suggest_length_penalty():
    from sandbox.reward import suggest_length_penalty

    _, rewards, _ = synthetic_run()
    t = curves.length_tradeoff(rewards, configured=0.0, at_least=200)
    # The newest versions holding >= 200 rewards: 9 versions of 24.
    assert t.versions == (11, 19) and t.rewards == 216 and len(t.bins) == 8
    assert sum(b.rewards for b in t.bins) == 216
    assert t.current == pytest.approx(0.001) and t.current_source == "the rewards' length penalties"
    s = suggest_length_penalty([(b.mean_tokens, b.solve_rate) for b in t.bins])
    assert (t.suggested, t.slope, t.target_tokens) == (s.coefficient, s.slope, s.target_tokens)
    assert t.suggested > 0
    tokens, rate = t.current_tangent()
    assert tokens == pytest.approx(t.slope / 0.001) and rate == pytest.approx(t.fit(tokens))
    # Solve rate that does not grow with length: no suggestion, and the reason.
    flat = [reward(i, solved=i % 2 == 0, version=1, tokens=10 + i) for i in range(100)]
    none = curves.length_tradeoff(flat, configured=0.0)
    assert none.suggested is None and "no positive length penalty" in none.why_not


def test_summary_and_plots_of_a_synthetic_run(tmp_path):
    from rollway.report_plots import draw_all

    tasks, rewards, evals = synthetic_run()
    data = collect([*tasks, *rewards, *evals], window=200, length_penalty=0.002)
    plots = draw_all(data, tmp_path)
    names = [n for n, _ in plots]
    assert names[:4] == ["solve_rate.png", "solve_rate_by_version.png", "solve_rate_per_kind.png",
                         "length_tradeoff.png"]
    summary = summary_markdown(data, plots, "synthetic")
    t = curves.length_tradeoff(rewards, 0.002)
    assert f"**Suggested `reward.length_penalty_per_token` = {t.suggested:.3g}**" in summary
    assert f"`ROLLWAY_REWARD__LENGTH_PENALTY_PER_TOKEN={t.suggested:.3g}`" in summary
    assert "Current length penalty: 0.001 per generated token (the rewards' length penalties)." in summary
    rolling = curves.rolling_solve_rate(data.rewards, 200)
    assert rolling.window == 96  # 480 rewards: a fifth
    assert f"| rolling solve rate (last 96 graded rewards) | first {rolling.rates[0]:.3f}, last " \
           f"{rolling.rates[-1]:.3f}" in summary
    assert "| rolling solve rate, kind add (last" in summary and "| rolling solve rate, kind fix (last" in summary
    # The synthetic add tasks learn, fix tasks do not: the curves say so.
    by_kind = curves.rolling_by_kind(data.rewards, data.kinds, 200)
    assert by_kind["add"].rates[-1] > by_kind["add"].rates[0] + 0.2 and by_kind["fix"].rates[-1] < 0.15
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
