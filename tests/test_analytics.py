"""User consumers on real Kafka: the error policy (DLQ and committed offsets), rebuild on
start and --until-end, logging, and the solve-rate example command."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import subprocess
import sys
import textwrap

import pytest
from aiokafka import TopicPartition

from bus import EventProducer, encode, read_topic
from bus.analytics import ConsumerApp, ConsumerFailed, ErrorPolicy, InvalidEvent, consumer
from bus.clients import new_consumer
from bus.examples.solve_rate import SolveRate
from schemas import Cost, Reward
from tests.cli import ROLLWAY, kafka_env

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


async def committed(cfg, group: str, partition: int) -> int | None:
    reader = new_consumer(cfg, "test-committed", group_id=group, enable_auto_commit=False)
    await reader.start()
    try:
        return await reader.committed(TopicPartition(cfg.topic_prefix + "rewards", partition))
    finally:
        await reader.stop()


@pytest.fixture
async def rewards_with_garbage(kafka_config):
    """Partition 0 of rewards: t0, t1, a garbage record (offset 2), t3, t4."""
    topic = kafka_config.topic_prefix + "rewards"
    async with EventProducer(kafka_config) as producer:
        for i in range(5):
            if i == 2:
                await producer.publish_raw(topic, b"\xde\xad", key=b"junk", headers=[("rollway-type", b"Reward")],
                                           partition=0)
                continue
            value, headers = encode(reward(i, True, 10, 1))
            await producer.publish_raw(topic, value, key=b"k", headers=headers, partition=0)
    return kafka_config


async def test_a_handler_bug_stops_the_consumer_without_dead_letters_or_commits_past_it(rewards_with_garbage):
    cfg = rewards_with_garbage
    seen = []

    @consumer("rewards", group="buggy")
    async def buggy(r: Reward, env):
        if r.sample_index == 3:
            r.weight_versoin  # the typo from the issue  # noqa: B018
        seen.append(r.sample_index)

    app = ConsumerApp(cfg, [buggy])
    with pytest.raises(ConsumerFailed, match=r"consumer buggy stopped at .*rewards:0@3 \(Reward\): AttributeError"):
        await asyncio.wait_for(app.run(handle_signals=False), 60)
    assert seen == [0, 1]
    # Regression: the group committed past the failing records and the DLQ grew by one
    # letter per failure plus the garbage again. Now: committed up to the failing record
    # (the garbage skipped and counted), nothing dead-lettered.
    assert await committed(cfg, "buggy", 0) == 3
    assert app.stats["buggy"].undecodable == 1 and app.stats["buggy"].handled == 2
    assert await read_topic(cfg, "dlq") == []

    # Fixed and restarted, the group resumes at the record that failed.
    @consumer("rewards", group="buggy")
    async def fixed(r: Reward, env):
        seen.append(r.sample_index)

    await asyncio.wait_for(ConsumerApp(cfg, [fixed], until_end=True).run(handle_signals=False), 60)
    assert seen == [0, 1, 3, 4] and await committed(cfg, "buggy", 0) == 5


async def test_opted_in_dead_letters_name_the_record_and_skip_the_garbage(rewards_with_garbage):
    cfg = rewards_with_garbage
    attempts = []

    @consumer("rewards", group="strict", policy=ErrorPolicy(dead_letter=True, max_attempts=2, backoff_s=0.01))
    async def strict(r: Reward, env):
        if r.sample_index == 3:
            raise InvalidEvent("inconsistent reward")
        if r.sample_index == 4:
            attempts.append(4)
            raise ConnectionError("store down")

    app = ConsumerApp(cfg, [strict], until_end=True)
    await asyncio.wait_for(app.run(handle_signals=False), 60)
    letters = [env.event for env in await read_topic(cfg, "dlq")]
    assert [(d.offset, d.error_kind, d.consumer_group, d.attempts) for d in letters] == [
        (3, "invalid", "strict", 1), (4, "handler", "strict", 2)]
    assert letters[0].topic == cfg.topic_prefix + "rewards" and "inconsistent reward" in letters[0].error
    assert attempts == [4, 4]  # retried once, then dead-lettered
    assert await committed(cfg, "strict", 0) == 5  # the consumer went on past both
    stats = app.stats["strict"]
    assert (stats.handled, stats.dead_lettered, stats.undecodable) == (2, 2, 1)


async def test_state_is_rebuilt_on_every_start_and_until_end_stops(kafka_config, capsys):
    from bus.examples import mean_reward as example

    async with EventProducer(kafka_config) as producer:
        for r in REWARDS:
            await producer.publish(r)  # keys spread them over both partitions
    reports = []
    for _ in range(2):  # a restart: the totals come back from the log, not from nothing
        example.totals.clear()
        await asyncio.wait_for(ConsumerApp(kafka_config, [example.mean_reward], until_end=True)
                               .run(handle_signals=False), 60)
        reports.append(capsys.readouterr().out)
    assert reports[0] == reports[1] == ("version 1: mean reward 0.667 over 3 rewards\n"
                                        "version 2: mean reward 0.667 over 3 rewards\n")


SCRIPT = textwrap.dedent("""
    import sys
    from bus.analytics import consumer
    from rollway.consumers import run_consumers
    from schemas import Reward

    @consumer("rewards")
    async def show(r: Reward, env):
        if r.sample_index == int(sys.argv[1]):
            raise KeyError("boom")
        print(r.trajectory_id)

    run_consumers([show])
""")


async def test_run_consumers_logs_json_to_stderr_and_fails_loudly(kafka_config):
    async with EventProducer(kafka_config) as producer:
        for r in REWARDS[:3]:
            await producer.publish(r, key="one-partition")

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", SCRIPT, *argv], capture_output=True, text=True,
                              env=kafka_env(kafka_config), timeout=60)

    ok = run("99", "--until-end")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == "t0\nt1\nt2\n"  # stdout is the consumer's own
    logs = [json.loads(line) for line in ok.stderr.splitlines()]
    assert {entry["role"] for entry in logs} == {"consumer"}
    stopped = next(e for e in logs if e["event"] == "consumer stopped")
    assert stopped["consumer"] == "show" and stopped["handled"] == 3

    failed = run("1", "--until-end")
    assert failed.returncode == 1 and failed.stdout == "t0\n"
    errors = [json.loads(line) for line in failed.stderr.splitlines() if '"consumer failed"' in line]
    assert len(errors) == 1 and "consumer show stopped at" in errors[0]["error"] and "KeyError" in errors[0]["error"]


async def test_solve_rate_command_writes_report_and_stops_on_sigterm(kafka_config, tmp_path):
    async with EventProducer(kafka_config) as producer:
        for r in REWARDS:
            # One key, one partition: the rolling window depends on the order of rewards.
            await producer.publish(r, key="one-partition")
    report_path = tmp_path / "report.json"
    proc = subprocess.Popen(
        [*ROLLWAY, "analytics", "solve-rate", "--window", "4", "--print-every", "6",
         "--json", str(report_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=kafka_env(kafka_config))
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
