"""``rollway sandbox`` as its own process: config from rollway.config (environment
overrides), real HTTP, rewards published to real Kafka, clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from bus import EventConsumer
from rollway.broker import free_ports
from sandbox.client import SandboxClient
from tasks.spec import TaskSpec
from tests.sandbox_helpers import write_task_dir
from tests.waiting import wait_until_async

TASK = TaskSpec(
    task_id="square",
    instruction="square(x) returns x * x.",
    files={"sq.py": "def square(x):\n    return x\n"},
    hidden_tests={"test_sq.py": "from sq import square\n\ndef test_three():\n    assert square(3) == 9\n"},
    solution={"sq.py": "def square(x):\n    return x * x\n"},
)


async def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    async with SandboxClient(url, timeout_s=2) as client:
        async def health() -> dict | None:
            try:
                return await client.health()
            except Exception:  # not listening yet
                return None

        try:
            return await wait_until_async(health, timeout_s, "the sandbox's /health", proc=proc, poll_s=0.2)
        except AssertionError as exc:
            tail = proc.stderr.read().decode()[-2000:] if proc.poll() is not None else ""
            raise AssertionError(f"{exc}\n{tail}") from None


@pytest.mark.kafka
async def test_rollway_sandbox_serves_and_publishes(kafka_config, tmp_path):
    write_task_dir(tmp_path / "tasks", TASK)
    port = free_ports(1)[0]
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_config.bootstrap_servers,
        "ROLLWAY_KAFKA__TOPIC_PREFIX": kafka_config.topic_prefix,
        "ROLLWAY_SANDBOX__PORT": str(port),
        "ROLLWAY_SANDBOX__WORKSPACE_ROOT": str(tmp_path / "ws"),
        "ROLLWAY_SANDBOX__MAX_SESSIONS": "3",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollway.cli", "sandbox", "--tasks-dir", str(tmp_path / "tasks")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        health = await wait_healthy(url, proc)
        assert health["capacity"] == 3 and health["sessions"] == 0
        async with SandboxClient(url) as client:
            sid = await client.create_session("square")  # files from the service's task store
            assert (await client.exec(sid, "cat sq.py")).stdout == TASK.files["sq.py"]
            await client.write_file(sid, "sq.py", TASK.solution["sq.py"])
            reward = await client.submit(sid, trajectory_id="cli-traj")
        assert (reward.score, reward.reward, reward.tests_total) == (1.0, 1.0, 1)
        async with EventConsumer(kafka_config, ["rewards"], group_id=None) as consumer:
            env_ = await asyncio.wait_for(consumer.__aiter__().__anext__(), 30)
        assert env_.key == b"cli-traj" and env_.event == reward
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, proc.stderr.read().decode()[-2000:]
    assert list((tmp_path / "ws").iterdir()) == []


def test_rollway_sandbox_reports_a_missing_task_store(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rollway.cli", "sandbox", "--tasks-dir", str(tmp_path / "nope"), "--no-publish"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert f"tasks folder {tmp_path / 'nope'} does not exist" in result.stderr
