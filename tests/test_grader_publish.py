"""Rewards reach rollway.rewards on a real Kafka broker: the submit answer and the record
on the topic are the same Reward, keyed by trajectory id; a failed publish keeps the
session so a retried submit re-sends the same verdict."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from bus import EventConsumer, EventProducer
from sandbox.client import SandboxClient, SandboxError
from sandbox.config import RewardConfig, SandboxConfig
from schemas import Cost, Reward
from tasks.spec import TaskSpec
from tasks.store import TaskStore
from tests.sandbox_helpers import live_sandbox, write_task_dir

pytestmark = pytest.mark.kafka

TASK = TaskSpec(
    task_id="double",
    instruction="double(x) returns 2 * x.",
    files={"double.py": "def double(x):\n    return x\n"},
    hidden_tests={"test_double.py": "from double import double\n\ndef test_two():\n    assert double(2) == 4\n\n"
                                    "def test_zero():\n    assert double(0) == 0\n"},
    solution={"double.py": "def double(x):\n    return 2 * x\n"},
)


async def read_rewards(kafka_config, n: int, timeout_s: float = 30.0) -> list:
    out = []
    async with EventConsumer(kafka_config, ["rewards"], group_id=None) as consumer:
        async def collect():
            async for env in consumer:
                out.append(env)
                if len(out) == n:
                    return
        await asyncio.wait_for(collect(), timeout_s)
    return out


async def test_submit_publishes_the_reward(kafka_config, tmp_path):
    write_task_dir(tmp_path / "tasks", TASK)
    cfg = SandboxConfig(workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"))
    async with EventProducer(kafka_config) as producer:
        async with live_sandbox(cfg, RewardConfig(), TaskStore(cfg.tasks_dir), publisher=producer) as live:
            async with SandboxClient(live.url) as client:
                solved = await client.create_session("double")
                await client.write_file(solved, "double.py", TASK.solution["double.py"])
                cost = Cost(generated_tokens=321, env_tokens=12, turns=2, tool_seconds=0.75)
                first = await client.submit(solved, trajectory_id="traj-solved", group_id="grp", sample_index=1,
                                            attempt="att", cost=cost, weight_version=4)
                failed = await client.create_session("double")
                second = await client.submit(failed, trajectory_id="traj-failed", group_id="grp", sample_index=2)
    envs = await read_rewards(kafka_config, 2)
    by_key = {env.key: env for env in envs}
    assert set(by_key) == {b"traj-solved", b"traj-failed"}
    for answered in (first, second):
        env = by_key[answered.trajectory_id.encode()]
        assert env.topic == f"{kafka_config.topic_prefix}rewards"
        assert isinstance(env.event, Reward)
        assert env.event == answered
    solved_reward = by_key[b"traj-solved"].event
    assert (solved_reward.score, solved_reward.reward, solved_reward.tests_passed, solved_reward.tests_total) == (1.0, 1.0, 2, 2)
    assert solved_reward.cost == cost and solved_reward.weight_version == 4
    assert (solved_reward.group_id, solved_reward.sample_index, solved_reward.attempt) == ("grp", 1, "att")
    failed_reward = by_key[b"traj-failed"].event
    assert (failed_reward.score, failed_reward.tests_passed, failed_reward.cheated) == (0.0, 1, False)


class FlakyPublisher:
    """Fails the first publish, then forwards to the real producer."""

    def __init__(self, producer: EventProducer) -> None:
        self.producer = producer
        self.calls = 0

    async def publish(self, event):
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("broker went away")
        return await self.producer.publish(event)


async def test_failed_publish_keeps_the_verdict_for_a_retry(kafka_config, tmp_path):
    write_task_dir(tmp_path / "tasks", TASK)
    cfg = SandboxConfig(workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"))
    async with EventProducer(kafka_config) as producer:
        flaky = FlakyPublisher(producer)
        async with live_sandbox(cfg, RewardConfig(), TaskStore(cfg.tasks_dir), publisher=flaky) as live:
            # submit_retries=0: see the 502 itself rather than the client's own retry of it.
            async with SandboxClient(live.url, submit_retries=0) as client:
                sid = await client.create_session("double")
                await client.write_file(sid, "double.py", TASK.solution["double.py"])
                with pytest.raises(SandboxError) as err:
                    await client.submit(sid, trajectory_id="traj-retry")
                assert err.value.status == 502 and "retry submit" in err.value.message
                kept = err.value.body["reward"]
                # The agent cannot change the verdict between the tries: the session is graded.
                await client.write_file(sid, "double.py", "def double(x):\n    return x\n")
                again = await client.submit(sid, trajectory_id="traj-retry")
                assert again == msgspec.convert(kept, Reward) and again.score == 1.0
                assert (await client.health())["sessions"] == 0
    envs = await read_rewards(kafka_config, 1)
    assert envs[0].event == msgspec.convert(kept, Reward)
    assert flaky.calls == 2
