"""No broker, or a broker that comes up late (issue #13, item 6), with real processes.

* CLI tools (tail, replay, topics) with nothing listening at the bootstrap address exit 1
  with exactly one line on stderr, nothing on stdout: no traceback, no aiokafka
  "Unclosed AIOKafkaConsumer/Producer" noise.
* A service (the feeder) started before its broker logs one retry line per attempt
  naming the address and how to start a broker, connects once ``rollway broker start``
  brought the broker up, and publishes; ``rollway broker stop`` then stops that broker
  although ``KAFKA_BOOTSTRAP_SERVERS`` is set (as ``start`` told the user to do).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from bus import KafkaConfig, ensure_topics, read_topic
from bus.connect import unreachable_message
from rollway.broker import ClusterState, free_ports, pid_alive, port_open
from rollway.config import RollwayConfig
from schemas import Task
from tests.cli import log_events
from tests.conftest import TEST_PARTITIONS, unique
from tests.waiting import wait_until
from tasks.config import FeederConfig

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def rollway(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollway.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def closed_port() -> int:
    """A loopback port nothing listens on."""
    port = free_ports(1)[0]
    assert not port_open(port)
    return port


def two_free_ports() -> int:
    """P such that P and P + 1 are free (rollway broker start --port P uses both)."""
    for _ in range(50):
        port = free_ports(1)[0]
        if port < 65535 and not port_open(port) and not port_open(port + 1):
            return port
    raise AssertionError("no two consecutive free ports")


@pytest.mark.parametrize("argv", [
    ["tail", "rewards", "--last", "5"],
    ["replay", "--from-step", "1", "--to-step", "3", "--verify", "--no-checkpoint"],
    ["topics"],
])
def test_cli_tool_without_a_broker_exits_1_with_one_line(argv, tmp_path):
    bootstrap = f"127.0.0.1:{closed_port()}"
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=bootstrap, PYTHONWARNINGS="default")
    result = rollway("--config", "/dev/null", *argv, env=env)
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert result.stderr == (
        f"cannot reach Kafka at {bootstrap} — start one with rollway broker start or set KAFKA_BOOTSTRAP_SERVERS\n"
    )
    assert result.stderr == unreachable_message(bootstrap) + "\n"


def test_service_started_before_the_broker_connects_once_it_is_up(tmp_path):
    port = two_free_ports()
    bootstrap = f"127.0.0.1:{port}"
    data_dir = tmp_path / "kafka"
    kafka = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=f"{unique('late-')}.",
                        partitions=dict(TEST_PARTITIONS), request_timeout_ms=5000)
    config = tmp_path / "rollway.toml"
    config.write_bytes(msgspec.toml.encode(RollwayConfig(kafka=kafka, feeder=FeederConfig(groups_per_second=20.0))))
    # As `rollway broker start` tells the user to: the variable names the broker-to-be.
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=bootstrap, PYTHONUNBUFFERED="1")
    log_path = tmp_path / "feeder.log"
    with open(log_path, "w") as out:
        feeder = subprocess.Popen(
            [sys.executable, "-m", "rollway.cli", "--config", str(config), "feeder", "--max-groups", "3"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        retries = wait_until(lambda: _retry_lines(log_path) if len(_retry_lines(log_path)) >= 2 else None,
                             120, "two retry lines", proc=feeder)
        first = retries[0]
        assert first["bootstrap"] == bootstrap and first["attempt"] == 1 and first["level"] == "warning"
        assert first["event"].startswith(f"cannot reach Kafka at {bootstrap}; retrying in ")
        assert first["event"].endswith("(start one with rollway broker start or set KAFKA_BOOTSTRAP_SERVERS)")

        started = rollway("broker", "start", "--insecure", "--data-dir", str(data_dir), "--port", str(port), env=env,
                          timeout=240)
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"export KAFKA_BOOTSTRAP_SERVERS={bootstrap}" in started.stdout.splitlines()
        pids = [n.pid for n in ClusterState.load(data_dir).nodes]
        assert all(pid_alive(p) for p in pids)

        import asyncio

        asyncio.run(ensure_topics(kafka))  # what `rollway topics create` does
        assert feeder.wait(timeout=180) == 0, log_path.read_text()[-3000:]
        text = log_path.read_text()
        assert "feeder stopped: published max_groups=3; published 3 groups" in text
        assert "Traceback" not in text and "Unclosed" not in text
        tasks = asyncio.run(read_topic(kafka, "tasks"))
        assert len(tasks) == 3 and all(isinstance(e.event, Task) for e in tasks)
    finally:
        if feeder.poll() is None:
            feeder.send_signal(signal.SIGKILL)
            feeder.wait()
        # `stop` acts on the brokers of --data-dir although the variable is set.
        stopped = rollway("broker", "stop", "--data-dir", str(data_dir), env=env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert stopped.stdout.strip() == f"stopped pids {pids}"
    assert not any(pid_alive(p) for p in pids)
    status = rollway("broker", "status", "--data-dir", str(data_dir), env=env)
    assert status.returncode == 1 and f"node 1: pid {pids[0]} dead" in status.stdout


def test_service_stopped_while_waiting_for_a_broker_exits_cleanly(tmp_path):
    bootstrap = f"127.0.0.1:{closed_port()}"
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=bootstrap, PYTHONUNBUFFERED="1")
    log_path = tmp_path / "feeder.log"
    with open(log_path, "w") as out:
        feeder = subprocess.Popen([sys.executable, "-m", "rollway.cli", "--config", "/dev/null", "feeder"],
                                  cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _retry_lines(log_path), 120, "a retry line", proc=feeder)
        feeder.send_signal(signal.SIGTERM)
        assert feeder.wait(timeout=60) == 1
    finally:
        if feeder.poll() is None:
            feeder.kill()
            feeder.wait()
    lines = log_path.read_text().splitlines()
    assert lines[-1] == unreachable_message(bootstrap)
    assert all(json.loads(line)["event"].startswith("cannot reach Kafka at") for line in lines[:-1])


def _retry_lines(path: Path) -> list[dict]:
    return [e for e in log_events(path) if str(e.get("event", "")).startswith("cannot reach Kafka at")]
