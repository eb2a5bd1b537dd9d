"""User consumers: the decorator and base class, and the solve-rate example, on real Kafka."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys

import pytest

from bus import EventConsumer, EventProducer
from bus.analytics import ConsumerApp, consumer
from bus.examples.solve_rate import SolveRate
from schemas import Cost, Reward

pytestmark = pytest.mark.kafka


def reward(i: int, solved: bool, tokens: int, version: int, cheated: bool = False) -> Reward:
    return Reward(trajectory_id=f"t{i}", task_id="task", group_id="g", sample_index=i, attempt="a",
                  score=1.0 if solved else 0.0, cheated=cheated, reward=1.0 if solved else 0.0,
                  cost=Cost(generated_tokens=tokens), weight_version=version)


REWARDS = [
    reward(0, True, 100, 1), reward(1, False, 300, 1), reward(2, True, 200, 1),
    reward(3, True, 50, 2), reward(4, True, 150, 2, cheated=True), reward(5, False, 400, 2),
]


def test_solve_rate_numbers():
    app = SolveRate(window=4, print_every=0, out=io.StringIO())
    for r in REWARDS:
        app.add(r)
    report = app.report()
    # Window = last 4: t2 solved(200), t3 solved(50), t4 cheated, t5 unsolved.
    assert report.rolling_solve_rate == 0.5
    assert report.rolling_mean_tokens_per_solved == 125.0
    assert report.per_version[1] == {"trajectories": 3, "solve_rate": 2 / 3, "mean_tokens": 200.0,
                                     "mean_tokens_per_solved": 150.0}
    assert report.per_version[2]["solve_rate"] == 1 / 3
    assert report.per_version[2]["mean_tokens_per_solved"] == 50.0


async def test_decorated_consumer_sees_events_and_commits(kafka_config):
    async with EventProducer(kafka_config) as producer:
        for r in REWARDS:
            await producer.publish(r)
    seen = []

    @consumer("rewards", group="deco")
    async def on_reward(event, env):
        seen.append(event.trajectory_id)
        if len(seen) == len(REWARDS):
            app.stop()

    app = ConsumerApp(kafka_config, [on_reward])
    await asyncio.wait_for(app.run(handle_signals=False), 30)
    assert sorted(seen) == sorted(r.trajectory_id for r in REWARDS)
    # Everything was acked and committed: the same group sees nothing new.
    async with EventConsumer(kafka_config, ["rewards"], group_id="deco") as again:
        assert await again.getmany(timeout_ms=1500) == []


def test_decorator_rejects_sync_functions_and_missing_topics():
    with pytest.raises(TypeError, match="async"):
        consumer("rewards")(lambda e, env: None)
    with pytest.raises(ValueError, match="topic"):
        consumer()


async def test_solve_rate_command_writes_report_and_stops_on_sigterm(kafka_config, tmp_path):
    async with EventProducer(kafka_config) as producer:
        for r in REWARDS:
            # One key, one partition: the rolling window depends on the order of rewards.
            await producer.publish(r, key="one-partition")
    report_path = tmp_path / "report.json"
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_config.bootstrap_servers,
           "ROLLWAY_KAFKA__TOPIC_PREFIX": kafka_config.topic_prefix}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollway.cli", "analytics", "solve-rate", "--window", "4", "--print-every", "6",
         "--json", str(report_path), "--group", "solve-cmd"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.startswith("rewards=6 rolling_solve_rate=0.500 (last 4) mean_tokens_per_solved=125.0")
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    report = json.loads(report_path.read_text())
    assert report["rewards_seen"] == 6 and report["rolling_solve_rate"] == 0.5
    assert report["per_version"]["1"]["trajectories"] == 3
