"""One trainer writes: fencing by the step log's transactional producer (issue #13, item 1).

Against a real broker:
* a second trainer of the same transactional id fences the first: the first's open step
  (TrainStep + offsets + metrics, one transaction) is aborted and never visible to
  read_committed readers, the first stops with ``WriterFenced``, and the second trains
  the records the first had consumed; ``rollway replay --verify`` matches every step;
* a trainer frozen (SIGSTOP) while its replacement trains, then woken, logs and commits
  nothing and exits 4 with a clear error; a third trainer then trains exactly the
  records left, so nothing is lost and the log replays bit-exactly;
* a ``WeightConflict`` in the background publisher stops the trainer;
* a trainer refuses to log a step number that is already in the log.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

import msgspec
import pytest
from aiokafka import TopicPartition

from bus import EventProducer, WriterFenced, codec
from bus.clients import new_consumer
from bus.reader import read_up_to
from rollway.config import RollwayConfig
from schemas import Metrics, TrainStep
from syncer.publisher import WeightConflict
from tests.cli import run_cli
from tests.synthetic import load_tiny, make_task_groups, to_events
from tests.trainer_helpers import one_thread  # noqa: F401  autouse fixture
from tests.waiting import wait_until_async
from trainer.config import TrainerConfig
from trainer.publishing import RecordingSink
from trainer.service import Trainer
from trainer.steplog import StepAlreadyLogged, StepLogWatch, read_step_log, step_event

pytestmark = [pytest.mark.kafka, pytest.mark.slow]



@pytest.fixture(scope="module")
def sampled(tiny_model_path):
    model, tok = load_tiny(str(tiny_model_path))
    return make_task_groups(model, tok, 8, group_size=4, max_new_tokens=8, env_after=3, seed=23)


def trainer_config(tmp_path, tiny_model_path, **kw) -> TrainerConfig:
    base = dict(model_path=str(tiny_model_path), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0,
                groups_per_step=1, max_staleness=1000, learning_rate=1e-3, muon_learning_rate=1e-3,
                num_threads=1, group_id=f"fence-{tmp_path.name}", session_timeout_ms=6000)
    base.update(kw)
    return TrainerConfig(**base)


async def publish(cfg, groups) -> list[str]:
    ids = []
    async with EventProducer(cfg) as producer:
        for group in groups:
            for traj in group:
                chunks, reward = to_events(traj, chunk_tokens=10)
                for chunk in chunks:
                    await producer.publish(chunk)
                await producer.publish(reward)
                ids.append(traj.trajectory_id)
    return ids


async def logged_steps(cfg) -> dict:
    return await read_step_log(cfg)


async def every_train_step_record(cfg) -> list[TrainStep]:
    """Every TrainStep record in the log, committed or not (read_uncommitted)."""
    topic = cfg.topic_prefix + "train-steps"
    consumer = new_consumer(cfg, "test-uncommitted", isolation_level="read_uncommitted", enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        ends = await consumer.end_offsets([tp])
        return [codec.decode(r.value, tuple(r.headers)) async for batch in read_up_to(consumer, ends) for r in batch]
    finally:
        await consumer.stop()


def write_config(path: Path, cfg: RollwayConfig) -> Path:
    path.write_bytes(msgspec.toml.encode(cfg))
    return path


def replay_verify(config: Path, last: int) -> subprocess.CompletedProcess:
    return run_cli("replay", "--from-step", "1", "--to-step", str(last), "--verify", "--no-checkpoint", "--json",
                   config=config, timeout=600)


def assert_replay_matches(config: Path, steps: dict) -> None:
    last = max(steps)
    result = replay_verify(config, last)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["step"], r["match"]) for r in rows] == [(s, True) for s in range(1, last + 1)]
    assert rows[-1]["replayed_hash"] == steps[last].event.weights_hash


async def test_second_trainer_fences_the_first_and_its_open_step_is_aborted(
        kafka_config, tiny_model_path, tmp_path, sampled, monkeypatch):
    cfg = RollwayConfig(kafka=kafka_config, trainer=trainer_config(tmp_path, tiny_model_path))
    first = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    # Hold the first trainer inside step 2's transaction, after its TrainStep and offsets
    # were sent but before the commit: the moment a hung trainer is replaced.
    held, release = asyncio.Event(), asyncio.Event()
    original_publish = EventProducer.publish

    async def publish_holding(self, event, **kw):
        if self is first.producer and isinstance(event, Metrics) and event.step == 2:
            held.set()
            await release.wait()
        return await original_publish(self, event, **kw)

    monkeypatch.setattr(EventProducer, "publish", publish_holding)
    g0 = await publish(kafka_config, sampled[:1])
    first_task = asyncio.create_task(first.run())
    await wait_until_async(lambda: _has_steps(kafka_config, 1), 120, "step 1", task=first_task, poll_s=0.2)
    g1 = await publish(kafka_config, sampled[1:2])
    await asyncio.wait_for(held.wait(), 120)
    # Step 2 is written but not committed: read_committed readers stop before it.
    assert [s.step for s in await every_train_step_record(kafka_config)] == [1, 2]
    assert sorted(await logged_steps(kafka_config)) == [1]

    second = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    second_task = asyncio.create_task(second.run())
    # The second trainer's producer start fences the first and aborts its transaction.
    await wait_until_async(lambda: second.producer is not None and second.producer.epoch > first.producer.epoch,
                           120, "the second trainer's producer", task=second_task)
    release.set()
    with pytest.raises(WriterFenced, match="another producer started with transactional id"):
        await asyncio.wait_for(first_task, 120)

    # The second trainer trains the group whose step the first could not commit.
    await wait_until_async(lambda: _has_steps(kafka_config, 2), 120, "step 2 by the second trainer",
                           task=second_task, poll_s=0.2)
    second.stop()
    assert await asyncio.wait_for(second_task, 120) == 2
    steps = await logged_steps(kafka_config)
    assert sorted(steps) == [1, 2]
    assert [t.trajectory_id for t in steps[1].event.trajectories] == g0
    assert [t.trajectory_id for t in steps[2].event.trajectories] == g1
    assert steps[2].event.weights_hash == second.core.weights_hash()
    # Three step records were written; the aborted one (the first trainer's step 2) is
    # invisible to every read_committed reader.
    assert [s.step for s in await every_train_step_record(kafka_config)] == [1, 2, 2]
    assert_replay_matches(write_config(tmp_path / "rollway.toml", cfg), steps)


async def _has_steps(cfg, n: int) -> bool:
    return len(await read_step_log(cfg)) >= n


async def test_weight_conflict_stops_the_trainer(kafka_config, tiny_model_path, tmp_path, sampled):
    import torch

    from syncer.config import SyncerConfig
    from syncer.publisher import WeightPublisher
    from syncer.store import open_store

    store_url = f"file://{tmp_path / 'weights'}"
    syncer_cfg = SyncerConfig(store_url=store_url)
    cfg = RollwayConfig(kafka=kafka_config, trainer=trainer_config(tmp_path, tiny_model_path, publish_every=1),
                        syncer=syncer_cfg)
    # Another writer already stored version 1 with other weights.
    store = open_store(store_url, syncer_cfg)
    await store.start()
    other = WeightPublisher(syncer_cfg, cfg.model_name, store)
    await other.publish(1, {"lm_head.weight": torch.ones(4, 4)}, 1)
    other.close()
    await store.close()

    await publish(kafka_config, sampled[2:3])
    trainer = Trainer(cfg.trainer, cfg.kafka, syncer=cfg.syncer, model_name=cfg.model_name)  # the real syncer sink
    with pytest.raises(WeightConflict, match="already stored with weights hash"):
        await asyncio.wait_for(trainer.run(), 180)
    assert sorted(await logged_steps(kafka_config)) == [1]
    assert trainer.publisher is not None and trainer.publisher.last_version == -1


async def test_a_step_number_already_logged_is_refused(kafka_config):
    watch = StepLogWatch(kafka_config)
    await watch.start()
    try:
        await watch.check(1)  # empty log: step 1 may be logged
        # Another writer (another transactional id) logs step 1 meanwhile.
        async with EventProducer(kafka_config) as producer:
            await producer.publish(step_event(1, "ab" * 16, [], {}, 0))
        with pytest.raises(StepAlreadyLogged, match="step 1 is already in the train-step log"):
            await watch.check(1)
        await watch.check(2)
    finally:
        await watch.stop()


async def test_frozen_trainer_woken_after_its_replacement_trained_writes_nothing(
        kafka_config, tiny_model_path, tmp_path, sampled):
    from tests.test_trainer_crash import TrainerProcess

    cfg = RollwayConfig(kafka=kafka_config, trainer=trainer_config(tmp_path, tiny_model_path))
    config = write_config(tmp_path / "rollway.toml", cfg)
    published = await publish(kafka_config, sampled[0:2])
    frozen = TrainerProcess(config, tmp_path / "trainer-frozen.log")
    try:
        frozen.wait_for(lambda: frozen.last_step() >= 2, 240, "steps 1-2")
        frozen.proc.send_signal(signal.SIGSTOP)

        # The replacement fences it, replays 1-2 and trains two more groups.
        published += await publish(kafka_config, sampled[2:4])
        replacement = TrainerProcess(config, tmp_path / "trainer-replacement.log", "--max-steps", "4")
        assert replacement.wait(300) == 0, replacement.log.read_text()[-3000:]
        assert [e["step"] for e in replacement.events("train step")] == [3, 4]

        # Work is waiting when the frozen trainer wakes: it must not take it.
        waiting = await publish(kafka_config, sampled[4:6])
        frozen.proc.send_signal(signal.SIGCONT)
        assert frozen.wait(240) == 4, frozen.log.read_text()[-3000:]
    finally:
        if frozen.proc.poll() is None:
            frozen.proc.send_signal(signal.SIGCONT)
            frozen.kill()
    assert [e["step"] for e in frozen.events("train step")] == [1, 2]
    (stopped,) = frozen.events("trainer stopped: not the only writer")
    assert "transactional id" in stopped["error"] or "already in the train-step log" in stopped["error"]
    assert not frozen.events("trainer exited")
    steps = await logged_steps(kafka_config)
    assert sorted(steps) == [1, 2, 3, 4]

    # Nothing was lost: a third trainer trains exactly the waiting groups.
    third = TrainerProcess(config, tmp_path / "trainer-third.log", "--max-steps", "6")
    assert third.wait(300) == 0, third.log.read_text()[-3000:]
    steps = await logged_steps(kafka_config)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    # Exactly the waiting groups; which one is step 5 depends on the partitions' fetch order.
    assert sorted(t.trajectory_id for s in (5, 6) for t in steps[s].event.trajectories) == sorted(waiting)
    trained = [t.trajectory_id for s in range(1, 7) for t in steps[s].event.trajectories]
    assert len(trained) == len(set(trained)) == 24 and set(trained) == set(published + waiting)
    assert_replay_matches(config, steps)
