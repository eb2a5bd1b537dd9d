"""The feeder against real Kafka: Task events out, real Reward events back in.

A small driver in the test stands in for samplers and graders: it reads the Task events
the feeder published and answers each sample with a Reward event on rollway.rewards,
solving according to a per-task schedule the test controls.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Callable

import pytest

from bus import EventConsumer, EventProducer
from bus.config import KafkaConfig
from schemas import Metrics, Reward, Task
from tasks.config import FeederConfig
from tasks.feeder import Feeder
from tasks.store import TaskStore
from tests.waiting import wait_until_async

pytestmark = pytest.mark.kafka


def make_store(root: Path, ids: list[str]) -> TaskStore:
    for task_id in ids:
        folder = root / task_id
        (folder / "hidden_tests").mkdir(parents=True)
        (folder / "repo").mkdir()
        (folder / "repo" / "m.py").write_text("x = 1\n")
        (folder / "task.toml").write_text(f'instruction = "task {task_id}"\ndifficulty = "easy"\n')
        (folder / "hidden_tests" / "test_m.py").write_text("def test_m():\n    assert True\n")
    return TaskStore(root)


def reward_for(task: Task, index: int, solved: bool) -> Reward:
    return Reward(
        trajectory_id=f"{task.group_id}-{index}", task_id=task.task_id, group_id=task.group_id,
        sample_index=index, attempt="0", score=1.0 if solved else 0.0, tests_passed=int(solved), tests_total=1,
    )


class Driver:
    """Answers every sample of every Task event with a Reward (or holds them back)."""

    def __init__(self, kafka: KafkaConfig, solves: Callable[[int, Task, int], bool] | None) -> None:
        self.kafka = kafka
        self.solves = solves  # (groups seen so far, task, sample index) -> solved; None = never answer
        self.tasks: list[Task] = []

    async def run(self) -> None:
        async with EventProducer(self.kafka, client_id="test-driver") as producer, \
                EventConsumer(self.kafka, ["tasks"], group_id=f"test-driver-{uuid.uuid4().hex[:6]}") as consumer:
            async for env in consumer:
                task = env.event
                assert isinstance(task, Task)
                self.tasks.append(task)
                if self.solves is not None:
                    n = len(self.tasks) - 1
                    for i in range(task.group_size):
                        await producer.publish(reward_for(task, i, self.solves(n, task, i)))
                await consumer.ack(env)

    async def wait_for(self, count: int, timeout: float = 30.0) -> None:
        await wait_until_async(lambda: len(self.tasks) >= count, timeout, f"{count} tasks")


async def run_feeder(feeder: Feeder, driver: Driver, timeout: float = 120.0) -> str:
    """Run the feeder to its end; the driver keeps going until it saw every published group."""
    driving = asyncio.create_task(driver.run())
    try:
        reason = await asyncio.wait_for(feeder.run(), timeout)
        await driver.wait_for(feeder.published)
        return reason
    finally:
        driving.cancel()
        await asyncio.gather(driving, return_exceptions=True)


async def test_task_mix_shifts_as_solve_rates_change(kafka_config, tmp_path):
    """Phase 1: alpha is solved by half its samples, beta by none -> alpha dominates.
    Phase 2: alpha is solved always, beta by half -> beta dominates."""
    store = make_store(tmp_path, ["alpha", "beta"])
    per_phase = 80
    cfg = FeederConfig(
        group_size=2, groups_per_second=500, max_outstanding_groups=3, max_groups=2 * per_phase,
        solve_rate_window=8, min_attempts_to_retire=0, prior_successes=0.5, prior_failures=0.5,
        metrics_interval_s=3600, seed=1,
    )

    def solves(n: int, task: Task, index: int) -> bool:
        learnable = index == 0  # one of the two samples solved
        if n < per_phase:
            return learnable if task.task_id == "alpha" else False
        return True if task.task_id == "alpha" else learnable

    feeder = Feeder(cfg, kafka_config, store)
    driver = Driver(kafka_config, solves)
    reason = await run_feeder(feeder, driver)
    assert reason == f"published max_groups={2 * per_phase}"
    assert len(driver.tasks) == 2 * per_phase
    order = [t.task_id for t in driver.tasks]
    tail1 = order[per_phase - 50:per_phase]
    tail2 = order[2 * per_phase - 50:]
    share_alpha_1 = tail1.count("alpha") / len(tail1)
    share_beta_2 = tail2.count("beta") / len(tail2)
    # stationary mix: 0.25 / (0.25 + 0.0525) = 0.83 for the learnable task in each phase
    print(f"mix: phase-1 alpha share {share_alpha_1:.2f}, phase-2 beta share {share_beta_2:.2f}")
    assert share_alpha_1 > 0.6, (share_alpha_1, order)
    assert share_beta_2 > 0.6, (share_beta_2, order)
    assert feeder.rewards_seen >= 2 * (2 * per_phase - cfg.max_outstanding_groups)
    assert all(t.group_size == 2 and t.instruction == f"task {t.task_id}" and t.files == {"m.py": "x = 1\n"}
               for t in driver.tasks)
    assert len({t.group_id for t in driver.tasks}) == 2 * per_phase


async def test_groups_grow_with_the_solve_rate_and_complete_at_their_own_size(kafka_config, tmp_path):
    """feeder.group_size_max: "even" (half its samples solved, p = 1/2) keeps groups of 4
    (chance 0.875 >= 0.8; 3 gives 0.75); "easy" (always solved) starts at 4 (unseen:
    p = 1/2) and grows to the largest size once its rate is high (p = 8.5/9: no size up to 8
    reaches 0.8). Every group is complete at its own size: the feeder counts each sample's
    reward once and its metrics count the samples asked for."""
    store = make_store(tmp_path, ["easy", "even"])
    cfg = FeederConfig(group_size=2, group_size_max=8, informative_target=0.8, selection_weight="informative",
                       groups_per_second=500, max_outstanding_groups=2, max_groups=40, solve_rate_window=8,
                       min_attempts_to_retire=0, prior_successes=0.5, prior_failures=0.5, pool_by_kind_window=0,
                       metrics_interval_s=3600, seed=2)
    feeder = Feeder(cfg, kafka_config, store)
    driver = Driver(kafka_config, lambda n, task, index: task.task_id == "easy" or index % 2 == 0)
    assert await run_feeder(feeder, driver) == "published max_groups=40"
    sizes = {name: [t.group_size for t in driver.tasks if t.task_id == name] for name in ("easy", "even")}
    assert sizes["even"] and set(sizes["even"]) == {4}, sizes
    assert sizes["easy"][0] == 4 and sizes["easy"][-1] == 8 and sizes["easy"] == sorted(sizes["easy"]), sizes
    total = sum(t.group_size for t in driver.tasks)
    assert feeder.published_samples == total
    # each reward counted once; a group leaves the outstanding set exactly when all its own
    # samples are rewarded (the feeder stops reading at its end: the last groups may be open)
    missing = sum(g.group_size - len(g.rewarded) for g in feeder.outstanding._groups.values())
    assert len(feeder.outstanding) <= cfg.max_outstanding_groups and all(
        len(g.rewarded) < g.group_size for g in feeder.outstanding._groups.values())
    assert feeder.rewards_seen == total - missing
    assert feeder.snapshot()["published_samples"] == float(total)


async def test_backpressure_stops_publishing_until_groups_are_rewarded(kafka_config, tmp_path):
    store = make_store(tmp_path, ["only"])
    cfg = FeederConfig(group_size=3, groups_per_second=200, max_outstanding_groups=3, metrics_interval_s=3600)
    feeder = Feeder(cfg, kafka_config, store)
    driver = Driver(kafka_config, solves=None)  # holds every reward back
    feeding = asyncio.create_task(feeder.run())
    driving = asyncio.create_task(driver.run())
    try:
        await driver.wait_for(3)
        # A window in which nothing may be published (no condition to wait for): 200
        # groups/s would have published ~200 more by now.
        await asyncio.sleep(1.0)
        assert (feeder.published, len(driver.tasks), len(feeder.outstanding)) == (3, 3, 3)
        first = driver.tasks[0]
        async with EventProducer(kafka_config, client_id="test-grader") as producer:
            # two of three samples, one of them twice (redelivery): the group is not complete
            for index in (0, 1, 0):
                await producer.publish(reward_for(first, index, solved=False))
            await asyncio.sleep(0.7)  # a window: all three are read, nothing is published
            assert (feeder.published, len(feeder.outstanding)) == (3, 3)
            assert feeder.rewards_seen == 2
            await producer.publish(reward_for(first, 2, solved=True))
            await driver.wait_for(4)
            await asyncio.sleep(0.7)  # a window: no fifth group while three are outstanding
            assert (feeder.published, len(driver.tasks), len(feeder.outstanding)) == (4, 4, 3)
        assert feeder.backpressure_seconds > 1.0
    finally:
        feeder.stop()
        assert await asyncio.wait_for(feeding, 30) == "stopped"
        driving.cancel()
        await asyncio.gather(driving, return_exceptions=True)


async def test_retires_always_and_never_solved_then_stops_and_replays(kafka_config, tmp_path):
    store = make_store(tmp_path, ["easy", "hard", "mixed"])
    cfg = FeederConfig(
        group_size=2, groups_per_second=500, max_outstanding_groups=2, solve_rate_window=4,
        min_attempts_to_retire=4, metrics_interval_s=3600, seed=3,
    )
    mixed_rounds = {"n": 0}

    def solves(n: int, task: Task, index: int) -> bool:
        if task.task_id == "mixed":
            # learnable for its first 10 groups, then always solved: retires too
            mixed_rounds["n"] += index == 0
            return index == 0 or mixed_rounds["n"] > 10
        return task.task_id == "easy"

    feeder = Feeder(cfg, kafka_config, store)
    driver = Driver(kafka_config, solves)
    reason = await run_feeder(feeder, driver)
    assert reason == "every task is retired"
    assert feeder.selector.retired() == {"easy": "always solved", "hard": "never solved", "mixed": "always solved"}
    published = feeder.published_by_task
    # retired after 4 outcomes = 2 groups, plus at most the groups already in flight
    assert 2 <= published["easy"] <= 2 + cfg.max_outstanding_groups
    assert 2 <= published["hard"] <= 2 + cfg.max_outstanding_groups
    assert published["mixed"] >= 11

    # the feeder's own metrics are on the metrics topic
    async with EventConsumer(kafka_config, ["metrics"], group_id=None) as consumer:
        env = await asyncio.wait_for(consumer.__anext__(), 30)
    assert isinstance(env.event, Metrics) and env.event.source == "feeder"
    assert env.event.values["retired_tasks"] == 3.0
    assert env.event.values["published_groups"] == float(feeder.published)

    # a restarted feeder rebuilds its statistics from the rewards log before choosing
    restarted = Feeder(cfg, kafka_config, store)
    assert await asyncio.wait_for(restarted.run(), 60) == "every task is retired"
    assert restarted.published == 0
    assert restarted.selector.retired() == feeder.selector.retired()


async def test_rollway_feeder_command_publishes_demo_tasks(kafka_config):
    import os
    import sys

    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=kafka_config.bootstrap_servers,
               ROLLWAY_KAFKA__TOPIC_PREFIX=kafka_config.topic_prefix, ROLLWAY_CONFIG="/dev/null")
    root = Path(__file__).resolve().parents[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollway.cli", "feeder", "--tasks-dir", str(root / "tasks" / "demo"),
        "--max-groups", "3", "--rate", "50", "--group-size", "5", "--seed", "4",
        env=env, cwd=root, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "published 3 groups" in out.decode()
    demo = TaskStore(root / "tasks" / "demo")
    async with EventConsumer(kafka_config, ["tasks"], group_id=None) as consumer:
        events = [(await asyncio.wait_for(consumer.__anext__(), 30)).event for _ in range(3)]
    for event in events:
        spec = demo.get(event.task_id)
        assert event.group_size == 5 and event.task_set == "demo"
        assert event.files == spec.files and event.instruction == spec.instruction


def test_rollway_feeder_command_rejects_bad_settings():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "rollway.cli", "feeder", "--rate", "0"], cwd=root,
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "ROLLWAY_CONFIG": "/dev/null"})
    assert proc.returncode == 2
    assert "groups_per_second must be positive" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "rollway.cli", "feeder", "--tasks-dir", "/nonexistent"], cwd=root,
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "ROLLWAY_CONFIG": "/dev/null"})
    assert proc.returncode == 2 and "/nonexistent does not exist" in proc.stderr


def test_replayed_history_is_observed_in_publish_order_not_partition_order(tmp_path):
    # The reader drains one partition, then the other: here every failure first, then
    # every solve. In publish order the task alternated solve/fail (learnable), so it
    # must not be retired; in partition order it would retire as "never solved".
    store = make_store(tmp_path, ["mixed"])
    cfg = FeederConfig(group_size=2, solve_rate_window=4, min_attempts_to_retire=4, seed=0)
    feeder = Feeder(cfg, KafkaConfig(), store)
    task = Task(task_id="mixed", group_id="g", group_size=2, instruction="i")
    history = [(1000 + i, 0.0, f"t{i:02d}", reward_for(task, i, solved=i % 2 == 0)) for i in range(12)]
    feeder._replay_buffer = [h for h in history if not h[3].score] + [h for h in history if h[3].score]
    feeder._finish_replay()
    assert feeder.selector.retired() == {}
    assert feeder.rewards_seen == 12 and feeder._replay_buffer is None


async def test_the_feeder_skips_garbage_on_the_rewards_topic_without_a_dead_letter(kafka_config, tmp_path):
    # The trainer owns rollway.rewards and dead-letters an undecodable record there once.
    # The feeder only reads the topic (no group, the whole log at every start): it skips
    # such a record. Before, it dead-lettered it too, again at every start, so the
    # dead-letter topic no longer held exactly the bad records (issue 13, chaos invariant).
    from bus import read_topic

    store = make_store(tmp_path, ["a"])
    async with EventProducer(kafka_config) as producer:
        await producer.publish_raw(kafka_config.topic_prefix + "rewards", b"\xffgarbage", key=b"x")
    cfg = FeederConfig(group_size=2, groups_per_second=500, max_groups=1, metrics_interval_s=3600, seed=3)
    for _ in range(2):  # a start and a restart, each reading the garbage
        feeder = Feeder(cfg, kafka_config, store)
        await run_feeder(feeder, Driver(kafka_config, lambda n, task, i: i == 0))
        assert feeder.published == 1
    assert await read_topic(kafka_config, "dlq") == []
