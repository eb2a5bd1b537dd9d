"""The whole loop, as `rollway up` runs it: feeder -> sampler (vLLM) -> sandbox/grader ->
trainer -> syncer -> sampler again, all real processes on real Kafka."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bus import ensure_topics
from bus.config import KafkaConfig
from rollway.broker import free_ports
from schemas import Heartbeat, Metrics, TrainStep, TrajectoryChunk, WeightVersion
from tests.conftest import unique
from tests.events import read_until
from tests.sampler_helpers import agent_model_dir
from tests.waiting import leftover_processes

pytestmark = [pytest.mark.kafka, pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def stack_config(tmp: Path, prefix: str, model: Path, sandbox_port: int) -> str:
    return f"""
model_name = "e2e"
[kafka]
topic_prefix = "{prefix}"
[syncer]
store_url = "file://{tmp}/weights"
keyframe_every = 4
[sampler]
model_path = "{model}"
sandbox_url = "http://127.0.0.1:{sandbox_port}"
max_model_len = 512
max_turns = 2
max_tokens_per_turn = 48
max_total_tokens = 200
max_tasks_in_flight = 2
heartbeat_interval_s = 0.5
[sandbox]
port = {sandbox_port}
tasks_dir = "{REPO}/tasks/demo"
[reward]
# The tiny model solves nothing; a length penalty makes rewards differ inside a group,
# so groups have variance and the trainer has something to learn from.
length_penalty_per_token = 0.001
length_penalty_in_unconstrained = true
[trainer]
model_path = "{model}"
checkpoint_dir = "{tmp}/checkpoints"
groups_per_step = 1
checkpoint_every = 2
num_threads = 1
[feeder]
tasks_dir = "{REPO}/tasks/demo"
group_size = 2
groups_per_second = 2.0
max_outstanding_groups = 2
"""


async def test_rollway_up_runs_the_whole_loop_and_stops_cleanly(kafka_bootstrap, tmp_path):
    prefix = f"{unique('e2e-')}."
    config = tmp_path / "rollway.toml"
    config.write_text(stack_config(tmp_path, prefix, agent_model_dir(), free_ports(1)[0]))
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    kafka = KafkaConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix)
    await ensure_topics(kafka)  # so our readers can subscribe before `up` gets there
    up = subprocess.Popen(
        # The evaluator (a second engine) has its own live-stack test; this one is the training loop.
        [sys.executable, "-m", "rollway.cli", "--config", str(config), "up", "--samplers", "1", "--without", "evaluator",
         "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        # The sampler loads version >= 2 through the syncer and reports it.
        beats = await read_until(
            kafka, "health",
            lambda evs: any(isinstance(e, Heartbeat) and e.role == "sampler" and e.weight_version >= 2
                            and e.updates_applied >= 1 for e in evs),
            timeout_s=240,
        )
        steps = [e for e in await read_until(kafka, "train-steps", lambda evs: len(evs) >= 2) if isinstance(e, TrainStep)]
        versions = [e for e in await read_until(kafka, "weights", lambda evs: len(evs) >= 2)
                    if isinstance(e, WeightVersion)]
        # Trajectories sampled after the update carry the new version in their spans.
        chunks = await read_until(
            kafka, "trajectories",
            lambda evs: any(isinstance(e, TrajectoryChunk) and e.num_tokens and e.version_array().max() >= 1
                            for e in evs),
            timeout_s=120,
        )
        # The sampler records each applied update's pause on the metrics topic (for plots).
        metrics = await read_until(
            kafka, "metrics",
            lambda evs: any(isinstance(e, Metrics) and e.source == "sampler:sampler-0" for e in evs),
            timeout_s=60,
        )
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            output, _ = await asyncio.to_thread(up.communicate, timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
            output, _ = up.communicate()
    logs = {p.name: p.read_text(errors="replace")[-3000:] for p in (tmp_path / "logs").glob("*.log")}
    assert up.returncode == 0, (output, logs)

    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    assert all(s.weight_version == s.step and len(s.weights_hash) > 0 for s in steps)
    trained = [t.trajectory_id for s in steps for t in s.trajectories]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert all(t.chunks and t.reward.topic == prefix + "rewards" for s in steps for t in s.trajectories)
    assert {v.version for v in versions} >= {1, 2}
    sampler_beats = [b for b in beats if isinstance(b, Heartbeat) and b.role == "sampler"]
    assert max(b.weight_version for b in sampler_beats) >= 2
    assert any(isinstance(c, TrajectoryChunk) and c.final for c in chunks)
    pauses = [m for m in metrics if isinstance(m, Metrics) and m.source == "sampler:sampler-0"]
    assert all(m.weight_version >= 1 and m.values["apply_pause_ms"] > 0 for m in pauses)
    # The view followed the trainer's metrics; nothing needed a restart.
    seen = re.search(r"rollway up: stopped \(train step (\d+), restarts 0, ", output)
    assert seen is not None and int(seen.group(1)) >= 2, output[-3000:]
    # Every child is gone after SIGTERM: no component outlives `rollway up`.
    leftover = leftover_processes(config)
    assert leftover == [], leftover
