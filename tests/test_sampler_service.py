"""Sampler replicas as real processes (``rollway sampler``) on real Kafka, real vLLM and
the real sandbox service: shared task consumption, SIGKILL redelivery, weight updates
through the syncer, heartbeats, SIGTERM drain."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from bus import EventProducer
from bus.codec import encode
from bus.config import KafkaConfig
from rollway.config import RollwayConfig
from sampler.config import SamplerConfig
from sandbox.config import SandboxConfig
from schemas import Heartbeat, Reward, TrajectoryChunk
from syncer.config import SyncerConfig
from tasks.spec import TaskSpec
from tests.events import read_all, read_until
from tests.sampler_helpers import agent_model_dir
from tests.sandbox_helpers import live_sandbox, write_task_dir

pytestmark = [pytest.mark.vllm, pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
GROUP_SIZE = 2


def task_spec(i: int) -> TaskSpec:
    return TaskSpec(
        task_id=f"fix_add_{i}",
        instruction="Fix `add` in solution.py so the tests pass.",
        files={"solution.py": "def add(x, y):\n    return x - y\n"},
        hidden_tests={"test_add.py": "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"},
    )


class Replica:
    def __init__(self, name: str, config_file: Path, log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollway.cli", "--config", str(config_file), "sampler", "--replica-id", name],
            cwd=REPO, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
        )

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest_asyncio.fixture(loop_scope="session")
async def stack(kafka_config: KafkaConfig, tmp_path):
    tasks_dir = tmp_path / "tasks"
    for i in range(10):
        write_task_dir(tasks_dir, task_spec(i))
    weights_dir = tmp_path / "weights"
    replicas: list[Replica] = []
    async with EventProducer(kafka_config) as producer:
        sandbox_cfg = SandboxConfig(tasks_dir=str(tasks_dir), workspace_root=str(tmp_path / "ws"), max_sessions=32)
        async with live_sandbox(sandbox_cfg, publisher=producer) as sb:
            cfg = RollwayConfig(
                kafka=kafka_config,
                syncer=SyncerConfig(store_url=f"file://{weights_dir}"),
                sampler=SamplerConfig(
                    model_path=str(agent_model_dir()), sandbox_url=sb.url, max_model_len=512, top_p=0.95,
                    max_turns=3, max_tokens_per_turn=40, chunk_tokens=16, assistant_prefill="<tool>run\n",
                    heartbeat_interval_s=0.5, consumer_session_timeout_ms=6000, max_tasks_in_flight=2,
                    max_in_flight=4,
                ),
            )
            config_file = tmp_path / "rollway.toml"
            config_file.write_bytes(msgspec.toml.encode(cfg))

            def start(name: str) -> Replica:
                replica = Replica(name, config_file, tmp_path)
                replicas.append(replica)
                return replica

            try:
                yield cfg, producer, start
            finally:
                for r in replicas:
                    r.stop()


async def publish_tasks(producer: EventProducer, cfg: RollwayConfig, indices: list[int], tag: str) -> list[str]:
    """One task per index, alternating over the tasks topic's two partitions."""
    groups = []
    topic = cfg.kafka.topic_prefix + "tasks"
    for n, i in enumerate(indices):
        event = task_spec(i).to_event(group_id=f"fix_add_{i}/{tag}", group_size=GROUP_SIZE, created_at=time.time())
        value, headers = encode(event)
        await producer.publish_raw(topic, value, key=event.task_id.encode(), headers=headers, partition=n % 2)
        groups.append(event.group_id)
    return groups


def by_trajectory(chunks: list[TrajectoryChunk]) -> dict[str, list[TrajectoryChunk]]:
    out: dict[str, list[TrajectoryChunk]] = defaultdict(list)
    for c in chunks:
        out[c.trajectory_id].append(c)
    return out


def complete_groups(chunks: list[TrajectoryChunk]) -> dict[str, str]:
    """group_id -> an attempt whose every sample has its final chunk."""
    finals: dict[tuple[str, str], set[int]] = defaultdict(set)
    for c in chunks:
        if c.final:
            finals[(c.group_id, c.attempt)].add(c.sample_index)
    return {g: a for (g, a), samples in finals.items() if samples == set(range(GROUP_SIZE))}


async def wait_heartbeats(cfg, predicate, timeout_s: float, replicas: list[Replica]) -> list[Heartbeat]:
    try:
        return await read_until(cfg.kafka, "health", predicate, timeout_s)
    except TimeoutError:
        raise AssertionError("\n\n".join(f"--- {r.name}\n{r.tail()}" for r in replicas)) from None


def trajectories(cfg, until, timeout_s, replicas):
    async def read():
        try:
            return [e for e in await read_until(cfg.kafka, "trajectories", until, timeout_s)]
        except TimeoutError:
            raise AssertionError("\n\n".join(f"--- {r.name}\n{r.tail()}" for r in replicas)) from None
    return read()


async def test_replicas_share_tasks_survive_sigkill_follow_weights_and_drain_on_sigterm(stack):
    cfg, producer, start = stack
    a, b = start("sampler-a"), start("sampler-b")

    def serving(events):
        names = {e.replica_id for e in events if isinstance(e, Heartbeat) and e.status == "serving"}
        return {"sampler-a", "sampler-b"} <= names

    beats = await wait_heartbeats(cfg, serving, 240, [a, b])
    first = next(e for e in beats if e.replica_id == "sampler-a" and e.status == "serving")
    assert first.role == "sampler" and first.details["kept_set_source"] == "logprobs"
    assert first.weight_version == 0 and first.pid == a.proc.pid

    # 8 tasks (groups of 2), 4 on each partition: both replicas get work.
    groups = await publish_tasks(producer, cfg, list(range(8)), "round1")

    # Kill A in the middle of a rollout: once it streamed a chunk of a trajectory that is not final yet.
    def a_mid_rollout(events):
        started = {c.trajectory_id for c in events if c.replica_id == "sampler-a"}
        finished = {c.trajectory_id for c in events if c.replica_id == "sampler-a" and c.final}
        return bool(started - finished)

    await trajectories(cfg, a_mid_rollout, 240, [a, b])
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(30)

    # Every task still ends with a complete group (B takes A's partition after the session timeout).
    def all_complete(events):
        return set(groups) <= set(complete_groups(events))

    chunks = await trajectories(cfg, all_complete, 300, [a, b])
    traj = by_trajectory(chunks)
    complete = complete_groups(chunks)
    attempts_by_group: dict[str, set[str]] = defaultdict(set)
    for c in chunks:
        attempts_by_group[c.group_id].add(c.attempt)
    for tid, cs in traj.items():
        assert len({(c.group_id, c.sample_index, c.attempt) for c in cs}) == 1
        assert sorted(c.chunk_index for c in cs) == list(range(len(cs))), f"{tid}: chunk gap or duplicate"
        assert sum(c.final for c in cs) <= 1
    # Ids differ per attempt: each (group, sample, attempt) has its own trajectory id.
    assert len(traj) == len({(cs[0].group_id, cs[0].sample_index, cs[0].attempt) for cs in traj.values()})
    # A died mid-rollout: some trajectory of A never got its final chunk, and its group
    # was completed by B in another attempt.
    unfinished_a = [cs[0] for cs in traj.values() if cs[0].replica_id == "sampler-a" and not any(c.final for c in cs)]
    assert unfinished_a
    for c in unfinished_a:
        done_attempt = complete[c.group_id]
        assert done_attempt != c.attempt and done_attempt.startswith("sampler-b-")
    assert any(len(attempts_by_group[g]) > 1 for g in groups)
    # Graded after the final chunk (the sandbox publishes each Reward).
    needed = {(g, complete[g], i) for g in groups for i in range(GROUP_SIZE)}

    def graded(events):
        return needed <= {(r.group_id, r.attempt, r.sample_index) for r in events if isinstance(r, Reward)}

    await read_until(cfg.kafka, "rewards", graded, 60)

    # A new weight version published by the trainer side reaches B through the syncer.
    from safetensors.torch import load_file

    from syncer.publisher import WeightPublisher
    from syncer.store import open_store

    store = open_store(cfg.syncer.store_url, cfg.syncer)
    publisher = WeightPublisher(cfg.syncer, cfg.model_name, store, producer)
    try:
        await publisher.publish(1, load_file(str(agent_model_dir() / "model.safetensors")), trainer_step=1)
    finally:
        publisher.close()

    def b_on_v1(events):
        return any(isinstance(e, Heartbeat) and e.replica_id == "sampler-b" and e.weight_version == 1
                   and e.updates_applied >= 1 for e in events)

    beats = await wait_heartbeats(cfg, b_on_v1, 120, [b])
    b_beats = [e for e in beats if e.replica_id == "sampler-b"]
    assert any(e.in_flight > 0 for e in b_beats) and any(e.tokens_per_s > 0 for e in b_beats)
    assert max(e.last_pause_ms for e in b_beats) > 0

    # Round 2 on v1: tokens carry version 1. SIGTERM B mid-rollout: it drains.
    groups2 = await publish_tasks(producer, cfg, [8, 9], "round2")

    def b_busy(events):
        return any(c.group_id in groups2 for c in events)

    await trajectories(cfg, b_busy, 120, [b])
    b.proc.send_signal(signal.SIGTERM)
    rc = await asyncio.to_thread(b.proc.wait, 180)
    assert rc == 0, b.tail()
    chunks = await read_all(cfg.kafka, "trajectories")
    started = {c.trajectory_id for c in chunks if c.group_id in groups2}
    finished = {c.trajectory_id for c in chunks if c.group_id in groups2 and c.final}
    assert started and started == finished, "SIGTERM left a rollout unfinished"
    v1_tokens = [c for c in chunks if c.group_id in groups2 and c.loss_mask_array().any()]
    for c in v1_tokens:
        versions = c.version_array()[c.loss_mask_array() == 1]
        assert set(versions.tolist()) == {1}
    beats = await read_all(cfg.kafka, "health")
    last_b = [e for e in beats if e.replica_id == "sampler-b"][-1]
    assert last_b.status == "stopped" and last_b.in_flight == 0 and last_b.weight_version == 1
