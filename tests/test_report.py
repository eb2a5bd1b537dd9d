"""`rollway report` on a real log: events produced to a real broker, the real CLI reads
them back and writes PNGs and a markdown summary with the exact figures."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bus import EventProducer, KafkaConfig, ensure_topics
from schemas import Cost, DeadLetter, EvalResult, Heartbeat, Metrics, Reward, TrainStep
from tests.conftest import TEST_PARTITIONS, unique

pytestmark = [pytest.mark.kafka]

REPO = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ["solve_rate.png", "reward_solve_rate.png", "heldout_pass_at_1.png", "entropy.png", "mismatch.png",
         "staleness.png", "tokens_per_trajectory.png", "apply_pauses.png"]

# step: reward_mean, solve_rate, entropy_full, entropy_kept, mismatch_kl_k3, staleness_mean
STEPS = {
    1: (0.1, 0.0, 2.0, 1.6, 0.002, 0.5),
    2: (0.2, 0.25, 1.9, 1.5, 0.001, 1.0),
    3: (0.3, 0.5, 1.8, 1.4, 0.004, 0.5),
    4: (0.4, 0.75, 1.7, 1.3, 0.001, 0.0),
    5: (0.5, 1.0, 1.6, 1.2, 0.003, 0.25),  # only in metrics: its train-step entry is "missing"
}
KEYS = ("reward_mean", "solve_rate", "entropy_full", "entropy_kept", "mismatch_kl_k3", "staleness_mean")


def step_values(step: int) -> dict[str, float]:
    return dict(zip(KEYS, STEPS[step]))


def reward(i: int, score: float, value: float, tokens: int, cheated: bool = False) -> Reward:
    # i turns, of which trajectory 3 had one template re-render.
    return Reward(trajectory_id=f"t{i}", task_id="task", group_id="g", sample_index=i, attempt="a", score=score,
                  cheated=cheated, reward=value, created_at=100.0 + i,
                  cost=Cost(generated_tokens=tokens, turns=i, template_rerenders=int(i == 3)))


def run_report(bootstrap: str, prefix: str, out: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "ROLLWAY_KAFKA__TOPIC_PREFIX": prefix, **env_extra}
    env.pop("ROLLWAY_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "rollway.cli", "report", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


async def test_report_plots_and_summarizes_a_real_log(kafka_bootstrap, tmp_path):
    prefix = f"{unique('report-')}."
    kafka = KafkaConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, partitions=dict(TEST_PARTITIONS))
    await ensure_topics(kafka)
    hist = {1: [4, 2, 1, 0], 2: [4, 2, 1, 0], 3: [4, 2, 1, 0], 4: [4, 2, 1, 0], 5: [3, 1, 0, 1]}
    events = [TrainStep(step=s, weight_version=s, weights_hash=f"h{s}", metrics=step_values(s), created_at=10.0 + s)
              for s in (1, 2, 3, 4)]
    # A second log entry for step 2 (a restarted trainer's): the first one counts, as in replay.
    events.append(TrainStep(step=2, weight_version=2, weights_hash="h2", metrics={"reward_mean": 9.9}))
    events += [Metrics(source="trainer", step=s, weight_version=s, values=step_values(s),
                       histograms={"staleness": [float(x) for x in hist[s]]}, created_at=10.0 + s)
               for s in (1, 2, 3, 4, 5)]
    events += [Metrics(source=f"sampler:sampler-{i % 2}", weight_version=v, values={"apply_pause_ms": ms},
                       created_at=50.0 + v) for i, (v, ms) in enumerate([(1, 12.0), (2, 30.5), (4, 8.25)])]
    # Heartbeats stand in for pauses only when no sampler published pause metrics.
    events.append(Heartbeat(replica_id="sampler-0", role="sampler", status="serving", weight_version=4,
                            last_pause_ms=99.0, updates_applied=3, created_at=60.0))
    rewards = [reward(1, 1.0, 1.0, 10), reward(2, 0.0, 0.0, 20), reward(3, 0.5, 0.5, 30), reward(4, 0.0, -0.1, 40),
               reward(5, 1.0, 0.9, 50), reward(6, 1.0, 0.0, 60, cheated=True)]
    events += rewards + [reward(2, 0.0, 0.0, 20)]  # t2 re-published: one trajectory, one reward
    events += [EvalResult(split="family:heldout", weight_version=v, pass_at_1=p, tasks=100, samples=1,
                          mean_reward=p / 2, mean_generated_tokens=40.0 + v, created_at=70.0 + v)
               for v, p in [(4, 0.4), (0, 0.15), (2, 0.25)]]
    events.append(DeadLetter(topic=prefix + "tasks", partition=0, offset=3, error="bad", error_kind="decode"))
    async with EventProducer(kafka) as producer:
        for event in events:
            await producer.publish(event)

    out = tmp_path / "report"
    done = run_report(kafka_bootstrap, prefix, out)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"rollway report: 8 plots, summary.md and steps.json in {out}/\n"
    data = json.loads((out / "steps.json").read_text())
    # JSON object keys are strings; the first log entry of step 2 counts, step 5 from Metrics.
    assert {int(k): v for k, v in data["steps"].items()} == {s: step_values(s) for s in (1, 2, 3, 4, 5)}
    assert [(e["weight_version"], e["pass_at_1"]) for e in data["evals"]] == [(0, 0.15), (2, 0.25), (4, 0.4)]
    for name in PLOTS:
        assert png_size(out / name) == (700, 400), name
    import matplotlib.image

    assert matplotlib.image.imread(out / "staleness.png").shape[:2] == (400, 700)  # decodes as a whole

    summary = (out / "summary.md").read_text()
    source = f"Kafka {kafka_bootstrap}, topics {prefix}*"
    expected_rows = [
        "| train steps | 5 (last step 5) |",
        "| reward mean per step | first 0.100, last 0.500, mean 0.300 |",
        "| solve rate per step | first 0.000, last 1.000, mean 0.500 |",
        "| entropy (full) | first 2.000, last 1.600, mean 1.800 |",
        "| entropy (kept set) | first 1.600, last 1.200, mean 1.400 |",
        "| trainer-sampler mismatch KL (k3) | mean 0.0022, max 0.004, last 0.003 |",
        "| staleness (versions) | mean of steps 0.45, tokens per bin 0: 19, 1: 9, 2: 4, >=3: 1 |",
        "| rewards | 6, mean 0.383 |",
        "| solve rate (all rewards) | 0.333 |",  # t1 and t5; t6 was a cheat
        "| rolling solve rate (last 6 graded rewards) | first 0.333, last 0.333, best 0.333 |",
        "| tokens per trajectory | mean 35.0, median 35, max 60 |",
        "| template re-renders | 1 in 21 turns (47.6 per 1,000 turns) |",  # t2's re-publication counts once
        "| held-out pass@1 | first 0.150 @ v0, latest 0.400 @ v4 (+0.250) |",
        "| weight-apply pause | median 12.0 ms, max 30.5 ms over 3 updates |",
        "| dead letters | 1 |",
    ]
    assert summary.startswith(f"# Rollway run report\n\nRead from the log: {source}.\n\n| figure | value |\n|---|---|\n"
                              + "\n".join(expected_rows) + "\n")
    assert ("| version | split | pass@1 | tasks x samples | mean reward | mean tokens |\n|---|---|---|---|---|---|\n"
            "| v0 | family:heldout | 0.150 | 100 x 1 | 0.075 | 40.0 |\n"
            "| v2 | family:heldout | 0.250 | 100 x 1 | 0.125 | 42.0 |\n"
            "| v4 | family:heldout | 0.400 | 100 x 1 | 0.200 | 44.0 |\n") in summary
    for name in PLOTS:
        assert f"]({name})" in summary


async def test_report_skips_an_undecodable_topic_and_reports_the_rest(kafka_bootstrap, tmp_path):
    prefix = f"{unique('report-')}."
    kafka = KafkaConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, partitions=dict(TEST_PARTITIONS))
    await ensure_topics(kafka)
    async with EventProducer(kafka) as producer:
        await producer.publish(reward(1, 1.0, 1.0, 10))
        await producer.publish_raw(prefix + "health", b"\x00\xffgarbage", key=b"bad",
                                   headers=[("rollway-type", b"Heartbeat")])
    out = tmp_path / "report"
    done = run_report(kafka_bootstrap, prefix, out)
    assert done.returncode == 0, done.stderr
    assert f"rollway report: skipped health: {prefix}health:0@0: cannot decode Heartbeat" in done.stderr
    assert done.stdout == f"rollway report: 2 plots, summary.md and steps.json in {out}/\n"  # solve rate, tokens
    assert png_size(out / "tokens_per_trajectory.png") == (700, 400)
    assert "| rewards | 1, mean 1.000 |" in (out / "summary.md").read_text()


def test_report_on_an_empty_log_says_there_is_nothing_to_plot(kafka_bootstrap, tmp_path):
    prefix = f"{unique('report-')}."  # no topic of this prefix exists
    out = tmp_path / "report"
    done = run_report(kafka_bootstrap, prefix, out)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (f"rollway report: nothing to plot yet (no train steps, rewards, evals or apply pauses in "
                           f"Kafka {kafka_bootstrap}, topics {prefix}*)\n")
    assert not out.exists()


def test_report_without_a_reachable_broker_is_one_line_and_exit_1(tmp_path):
    from rollway.broker import free_ports

    bootstrap = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    done = run_report(bootstrap, "report-none.", tmp_path / "report")
    assert done.returncode == 1
    assert done.stdout == ""
    # The shared one line of every CLI command that needs Kafka (rollway.cli).
    assert done.stderr == (f"cannot reach Kafka at {bootstrap} — start one with rollway broker start or set "
                           "KAFKA_BOOTSTRAP_SERVERS\n")


async def test_report_of_a_synthetic_run_shows_the_solve_rate_and_the_length_penalty(kafka_bootstrap, tmp_path):
    """Issue #30 point 5 through the CLI: tasks with kinds, 480 graded rewards over 20
    versions (add tasks learn, fix tasks do not) and held-out evals on a real log; the
    report draws the rolling solve rate against time and version, per kind, and the
    length trade-off, and summary.md names the tangent coefficient and how to apply it."""
    from rollway import report_curves as curves
    from tests.test_report_curves import synthetic_run

    prefix = f"{unique('report-')}."
    kafka = KafkaConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, partitions=dict(TEST_PARTITIONS))
    await ensure_topics(kafka)
    tasks, rewards, evals = synthetic_run()
    async with EventProducer(kafka) as producer:
        await producer.publish_many([*tasks, *rewards, *evals])
    out = tmp_path / "report"
    done = run_report(kafka_bootstrap, prefix, out, ROLLWAY_REWARD__LENGTH_PENALTY_PER_TOKEN="0.002")
    assert done.returncode == 0, done.stderr
    for name in ("solve_rate.png", "solve_rate_by_version.png", "solve_rate_per_kind.png", "length_tradeoff.png"):
        assert png_size(out / name) == (700, 400), name
    summary = (out / "summary.md").read_text()
    expected = curves.length_tradeoff(rewards, 0.002)
    assert f"**Suggested `reward.length_penalty_per_token` = {expected.suggested:.3g}**" in summary
    assert f"`ROLLWAY_REWARD__LENGTH_PENALTY_PER_TOKEN={expected.suggested:.3g}`" in summary
    # The rewards carry 0.001 per token: the coefficient in force, not the configured 0.002.
    assert "Current length penalty: 0.001 per generated token (the rewards' length penalties)." in summary
    assert "| rolling solve rate, kind add (last" in summary and "| rolling solve rate, kind fix (last" in summary
    assert "![rolling solve rate of all graded rewards and held-out pass@1 over time](solve_rate.png)" in summary
