"""Step log and checkpoint hygiene (issue 13, item 3), with real checkpoints of the tiny
model and, where the log is involved, a real Kafka broker and an in-process trainer.

Each test is the regression test of one failure seen on the landed code: a truncated
newest state.pt that made every restart fail; a rewrite that deleted the old checkpoint
before the new one was in place; pruning by folder name that deleted the checkpoint
just written after a topic reset; a failed write that was logged and ignored (and left
its temp folder); ``rollway replay`` starting from the initial model on a missing
--checkpoint-dir and exiting 1 (the hash-mismatch code) on a corrupt checkpoint; one
foreign record on rollway.train-steps that made the trainer refuse to start.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from bus import EventProducer
from rollway.config import RollwayConfig
from schemas import DeadLetter, Metrics, RecordRef
from tests.cli import run_cli
from tests.synthetic import load_tiny, make_task_groups
from tests.trainer_helpers import one_thread, publish_trajectories  # noqa: F401  one_thread: autouse fixture
from trainer.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    clean_temporaries,
    list_checkpoints,
    prune,
    write_checkpoint,
)
from trainer.config import TrainerConfig
from trainer.publishing import RecordingSink
from trainer.replay import CheckpointUnusable, restore_checkpoint, restore_newest_loadable
from trainer.steplog import LoggedStep, StepLogError, read_step_log, step_event


@pytest.fixture(scope="module")
def sampled(tiny_model_path):
    model, tok = load_tiny(str(tiny_model_path))
    return make_task_groups(model, tok, 5, group_size=4, max_new_tokens=8, env_after=3, seed=11)


def tcfg(tmp_path, tiny_model_path, **kw) -> TrainerConfig:
    base = dict(model_path=str(tiny_model_path), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2,
                keep_checkpoints=3, groups_per_step=1, max_staleness=10, learning_rate=1e-3,
                muon_learning_rate=1e-3, num_threads=1, group_id=f"trainer-{tmp_path.name}",
                session_timeout_ms=6000)
    base.update(kw)
    return TrainerConfig(**base)


def logged(hashes: dict[int, str]) -> dict[int, LoggedStep]:
    return {s: LoggedStep(step_event(s, h, [], {}, 0), RecordRef("t", 0, s)) for s, h in hashes.items()}


@pytest.fixture(scope="module")
def trained(tiny_model_path, sampled, tmp_path_factory):
    """A core trained 3 steps: (snapshots by step, hashes by step)."""
    from trainer.core import TrainCore

    from tests.synthetic import groups_from_sampled

    core = TrainCore(tcfg(tmp_path_factory.mktemp("t"), tiny_model_path))
    snaps, hashes = {0: core.snapshot()}, {0: core.weights_hash()}
    for s, group in enumerate(sampled[:3], start=1):
        result = core.train_step(groups_from_sampled([group]), 0)
        snaps[s], hashes[s] = core.snapshot(), result.weights_hash
    return snaps, hashes


def new_core(tmp_path, tiny_model_path):
    from trainer.core import TrainCore

    return TrainCore(tcfg(tmp_path, tiny_model_path))


# -- restore falls back -------------------------------------------------------------------
def test_truncated_newest_checkpoint_falls_back_to_an_older_one(tmp_path, tiny_model_path, trained):
    snaps, hashes = trained
    ckpt = tmp_path / "ckpt"
    for s in (1, 2, 3):
        write_checkpoint(ckpt, snaps[s], hashes[s])
    state = ckpt / "step-00000003" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    # the newest, and one whose bytes are another step's (loads, but to other weights)
    (ckpt / "step-00000002" / "state.pt").write_bytes((ckpt / "step-00000001" / "state.pt").read_bytes())

    core = new_core(tmp_path, tiny_model_path)
    with pytest.raises(CheckpointUnusable, match="does not load"):
        restore_checkpoint(core, list_checkpoints(ckpt)[-1])
    core = new_core(tmp_path, tiny_model_path)
    assert restore_newest_loadable(core, str(ckpt), logged(hashes), 3) == 1
    assert core.step == 1 and core.weights_hash() == hashes[1]


def test_no_loadable_checkpoint_restores_the_initial_model(tmp_path, tiny_model_path, trained):
    snaps, hashes = trained
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, snaps[2], hashes[2])
    (ckpt / "step-00000002" / "state.pt").write_bytes((ckpt / "step-00000002" / "state.pt").read_bytes()[:100])
    core = new_core(tmp_path, tiny_model_path)
    assert restore_newest_loadable(core, str(ckpt), logged(hashes), 3) == 0
    assert core.step == 0 and core.weights_hash() == hashes[0]


# -- crash-safe replacement and pruning by the log ----------------------------------------
def test_rewrite_sets_the_old_checkpoint_aside_until_the_new_one_is_in(tmp_path, trained):
    snaps, hashes = trained
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, snaps[1], hashes[1])
    final = ckpt / "step-00000001"
    # A crash after the old folder was set aside and before the new one was renamed in:
    aside = ckpt / ".step-00000001.old-123-456"
    os.rename(final, aside)
    (ckpt / ".step-00000001.tmp-123-456").mkdir()
    clean_temporaries(ckpt)
    assert [c.step for c in list_checkpoints(ckpt)] == [1]  # the old one is back
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000001"]
    # An uninterrupted rewrite replaces it and leaves nothing behind.
    write_checkpoint(ckpt, snaps[1], "rewritten")
    assert [c.weights_hash for c in list_checkpoints(ckpt)] == ["rewritten"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000001"]


def test_pruning_follows_the_log_not_folder_names(tmp_path, trained):
    snaps, hashes = trained
    ckpt = tmp_path / "ckpt"
    # An earlier run (before a topic reset) left checkpoints with higher step numbers.
    for s in (100, 200):
        write_checkpoint(ckpt, {**snaps[1], "step": s, "weight_version": s}, f"old-{s}")
    write_checkpoint(ckpt, snaps[1], hashes[1])
    removed = prune(ckpt, keep=2, logged={1: hashes[1]})
    assert sorted(p.name for p in removed) == ["step-00000100", "step-00000200"]
    assert [c.step for c in list_checkpoints(ckpt)] == [1]
    # Without the log: steps above the one just written are another log's.
    for s in (100,):
        write_checkpoint(ckpt, {**snaps[1], "step": s, "weight_version": s}, f"old-{s}")
    write_checkpoint(ckpt, snaps[2], hashes[2])
    write_checkpoint(ckpt, snaps[3], hashes[3])
    removed = prune(ckpt, keep=2, current=3)
    assert sorted(p.name for p in removed) == ["step-00000001", "step-00000100"]
    assert [c.step for c in list_checkpoints(ckpt)] == [2, 3]


def test_async_checkpointer_prunes_against_the_adopted_log(tmp_path, trained):
    snaps, hashes = trained
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, {**snaps[1], "step": 50, "weight_version": 50}, "another-run")
    writer = AsyncCheckpointer(ckpt, keep=1)
    writer.adopt_log({1: hashes[1]})
    writer.save(snaps[1], hashes[1]).result()
    writer.close()
    assert [c.step for c in list_checkpoints(ckpt)] == [1]


# -- a failed write stops the trainer and cleans up ---------------------------------------
def test_failed_write_is_an_error_and_leaves_no_temp_folder(tmp_path, trained):
    snaps, hashes = trained
    ckpt = tmp_path / "ckpt"
    writer = AsyncCheckpointer(ckpt, keep=2)
    # torch.save fails part-way: the snapshot holds something it cannot pickle.
    bad = {**snaps[1], "extra": lambda: None}
    writer.save(bad, hashes[1])
    with pytest.raises(CheckpointError, match="1 checkpoint write\\(s\\) in a row failed"):
        writer.wait()
    assert list(ckpt.iterdir()) == []  # no temp folder left
    with pytest.raises(CheckpointError):
        writer.close()

    # max_failures=2: one failure is tolerated, a success resets the count.
    tolerant = AsyncCheckpointer(ckpt, keep=2, max_failures=2)
    tolerant.save(bad, hashes[1])
    tolerant.save(snaps[1], hashes[1])
    tolerant.wait()
    assert tolerant.failures_in_a_row == 0
    tolerant.close()
    assert [c.step for c in list_checkpoints(ckpt)] == [1]


# -- with Kafka -----------------------------------------------------------------------------
@pytest.mark.kafka
async def test_trainer_restarts_past_a_truncated_newest_checkpoint(kafka_config, tiny_model_path, tmp_path, sampled):
    from trainer.service import Trainer

    cfg = RollwayConfig(kafka=kafka_config, trainer=tcfg(tmp_path, tiny_model_path))
    await publish_trajectories(kafka_config, [t for g in sampled[:2] + sampled[3:5] for t in g])
    first = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    assert await first.run(max_steps=4) == 4
    ckpt = tmp_path / "ckpt"
    assert [c.step for c in list_checkpoints(ckpt)] == [2, 4]
    state = ckpt / "step-00000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])

    second = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    try:
        assert await second.restore() == 4
    finally:
        second.checkpointer.close()
    assert [r.step for r in second.replayed] == [3, 4] and all(r.match for r in second.replayed)
    assert second.core.step == 4
    # the damaged checkpoint was rewritten by the replay and now loads
    third = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    try:
        assert await third.restore() == 4
    finally:
        third.checkpointer.close()
    assert third.replayed == []


@pytest.mark.kafka
async def test_trainer_stops_when_checkpoints_cannot_be_written(kafka_config, tiny_model_path, tmp_path, sampled):
    from trainer.service import Trainer

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoint folder's parent should be")
    cfg = RollwayConfig(kafka=kafka_config, trainer=tcfg(tmp_path, tiny_model_path, checkpoint_every=1,
                                                         checkpoint_dir=str(blocker / "ckpt")))
    await publish_trajectories(kafka_config, [t for g in sampled[:2] + sampled[3:5] for t in g])
    trainer = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    with pytest.raises(CheckpointError, match="not-a-folder"):
        await trainer.run(max_steps=4)
    # Stopped before training: the folder cannot be claimed (before checkpoint ownership
    # it stopped at the first failed write, step 1 or 2), never trained on to the end.
    assert trainer.core.step == 0


@pytest.mark.kafka
async def test_foreign_step_log_records_are_dead_lettered_once_and_skipped(kafka_config):
    topic = kafka_config.topic_prefix + "train-steps"
    async with EventProducer(kafka_config) as producer:
        await producer.publish(step_event(1, "ab" * 32, [], {}, seed=3))
        await producer.publish_raw(topic, b"hello from kafka-console-producer")  # no rollway-type header
        await producer.publish(Metrics(source="x", step=1), topic=topic)  # a Rollway event, not a step
        await producer.publish(step_event(2, "cd" * 32, [], {}, seed=3))
    for _ in range(2):  # a restart reads the log again: still one letter per record
        steps = await read_step_log(kafka_config, dead_letter=True)
        assert sorted(steps) == [1, 2]
    letters = await read_dlq(kafka_config)
    assert sorted((d.topic, d.offset, d.error_kind) for d in letters) == [(topic, 1, "unknown_type"),
                                                                          (topic, 2, "unknown_type")]
    assert letters[0].value == b"hello from kafka-console-producer" or letters[1].value == b"hello from kafka-console-producer"


async def read_dlq(cfg) -> list[DeadLetter]:
    from bus import read_topic

    return [e.event for e in await read_topic(cfg, "dlq") if isinstance(e.event, DeadLetter)]


@pytest.mark.kafka
async def test_undecodable_train_step_stops_with_the_offset_and_how_to_inspect_it(kafka_config):
    topic = kafka_config.topic_prefix + "train-steps"
    async with EventProducer(kafka_config) as producer:
        await producer.publish(step_event(1, "ab" * 32, [], {}, seed=3))
        await producer.publish_raw(topic, b"\x00\xff", headers=[("rollway-type", b"TrainStep")])
    with pytest.raises(StepLogError, match=f"{topic}:0@1.*kafka-console-consumer.sh .*--offset 1"):
        await read_step_log(kafka_config, dead_letter=True)
    assert await read_dlq(kafka_config) == []


# -- rollway replay exit codes --------------------------------------------------------------
def write_config(path: Path, kafka_config, tmp_path, tiny_model_path) -> Path:
    path.write_text(
        f'[kafka]\nbootstrap_servers = "{kafka_config.bootstrap_servers}"\n'
        f'topic_prefix = "{kafka_config.topic_prefix}"\n'
        f'[trainer]\nmodel_path = "{tiny_model_path}"\ncheckpoint_dir = "{tmp_path / "ckpt"}"\nnum_threads = 1\n'
    )
    return path


@pytest.mark.kafka
async def test_replay_exits_2_on_a_missing_or_unloadable_checkpoint(kafka_config, tiny_model_path, tmp_path, trained):
    snaps, hashes = trained
    config = write_config(tmp_path / "rollway.toml", kafka_config, tmp_path, tiny_model_path)
    async with EventProducer(kafka_config) as producer:
        for s in (1, 2):
            await producer.publish(step_event(s, hashes[s], [], {}, seed=0))

    missing = await asyncio.to_thread(run_cli, "replay", "--from-step", "2", "--checkpoint-dir",
                                      str(tmp_path / "nope"), config=config, timeout=300)
    assert missing.returncode == 2, missing.stderr[-2000:]
    assert "checkpoint folder" in missing.stderr and "does not exist" in missing.stderr

    write_checkpoint(tmp_path / "ckpt", snaps[1], hashes[1])
    state = tmp_path / "ckpt" / "step-00000001" / "state.pt"
    state.write_bytes(state.read_bytes()[:500])
    corrupt = await asyncio.to_thread(run_cli, "replay", "--from-step", "2", "--verify",
                                      config=config, timeout=300)
    assert corrupt.returncode == 2, corrupt.stderr[-2000:]
    assert "step-00000001" in corrupt.stderr and "does not load" in corrupt.stderr
