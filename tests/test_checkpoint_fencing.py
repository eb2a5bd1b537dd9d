"""Checkpoint fencing (issue #30, point 1): a trainer writes checkpoints only while it
owns the checkpoint folder (its transactional producer's id and epoch), only of steps the
log committed; cleanup removes only what dead writers (or older owners) left; a woken
zombie writes nothing and exits 4.

The regression (chaos run, seed 11): a trainer SIGSTOPped while writing the checkpoint of
a step had its ``.step-N.tmp-<pid>-...`` folder removed by its replacement's start-up
cleanup; woken, its rename failed and it exited 3 ("checkpoint write failed") instead of
4 (fenced, nothing written). ``test_a_trainer_frozen_inside_a_checkpoint_write_...``
reproduces it with real processes and a real broker (the trainer pauses at the
``checkpoint.before_rename:pause`` failpoint, files written, not renamed in, and is
SIGSTOPped there); the others check the rules on the folder alone.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import msgspec
import pytest

from rollway.config import RollwayConfig
from tests.synthetic import load_tiny, make_task_groups
from tests.trainer_helpers import one_thread, publish_trajectories  # noqa: F401  one_thread: autouse fixture
from tests.waiting import wait_until
from trainer.checkpoint import AsyncCheckpointer, CheckpointError, clean_temporaries, list_checkpoints, prune
from trainer.checkpoint_owner import CheckpointFenced, FolderOwnership, Owner, hold
from trainer.config import TrainerConfig
from trainer.steplog import read_step_log

OLD, NEW = Owner(7, 3), Owner(7, 4)


def snapshot(step: int) -> dict:
    import torch

    return {"step": step, "weight_version": step, "model": {"w": torch.full((4,), float(step))}}


def test_a_newer_owner_supersedes_an_older_one_and_its_markers_go(tmp_path):
    old = FolderOwnership(tmp_path, OLD)
    old.claim()
    old.check()
    new = FolderOwnership(tmp_path, NEW)
    new.claim()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".owner-p7-e4"]
    with pytest.raises(CheckpointFenced, match="p7-e4 owns it now"):
        old.check()
    new.check()
    # A trainer that starts after the newer one already claimed is fenced at once.
    with pytest.raises(CheckpointFenced):
        FolderOwnership(tmp_path, OLD).claim()
    new.check()
    # Another producer id (a reset cluster, an expired transactional id) is older.
    FolderOwnership(tmp_path, Owner(9, 0)).claim()
    with pytest.raises(CheckpointFenced, match="marker .owner-p7-e4 was removed"):
        new.check()


def test_cleanup_leaves_a_live_writers_folder_and_removes_a_dead_ones(tmp_path):
    live = tmp_path / f".step-00000002.tmp-{OLD.token}-111-222"
    dead = tmp_path / f".step-00000004.tmp-{OLD.token}-333-444"
    legacy = tmp_path / ".step-00000006.tmp-555-666"  # an older build's name
    for d in (live, dead, legacy):
        d.mkdir()
    fd = hold(live)  # its writer lives (stopped or not): the lock is held
    try:
        clean_temporaries(tmp_path, FolderOwnership(tmp_path, NEW))
        assert live.exists() and not dead.exists() and not legacy.exists()
    finally:
        os.close(fd)  # the writer died
    clean_temporaries(tmp_path, FolderOwnership(tmp_path, NEW))
    assert not live.exists()
    # A newer owner's leftovers are never an older trainer's to clean.
    newer = tmp_path / f".step-00000008.tmp-{NEW.token}-1-2"
    newer.mkdir()
    clean_temporaries(tmp_path, FolderOwnership(tmp_path, OLD))
    assert newer.exists()


def test_a_superseded_trainer_writes_no_checkpoint_and_is_fenced_not_failed(tmp_path):
    writer = AsyncCheckpointer(tmp_path, keep=3)
    writer.claim(FolderOwnership(tmp_path, OLD))
    writer.adopt_log({2: "h2", 4: "h4"})
    writer.save(snapshot(2), "h2").result()
    # A newer trainer starts (claims the folder) and writes step 4 itself.
    newer = AsyncCheckpointer(tmp_path, keep=3)
    newer.claim(FolderOwnership(tmp_path, NEW))
    newer.adopt_log({2: "h2", 4: "h4", 6: "h6"})
    newer.save(snapshot(6), "h6").result()
    newer.close()
    with pytest.raises(CheckpointFenced):
        writer.save(snapshot(4), "h4").result()
    with pytest.raises(CheckpointFenced):
        writer.check()
    assert writer.failures_in_a_row == 0  # not a write failure
    with pytest.raises(CheckpointFenced):
        writer.close()
    assert [(c.step, c.owner) for c in list_checkpoints(tmp_path)] == [(2, OLD.token), (6, NEW.token)]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_write_whose_folder_a_newer_trainer_removed_is_fenced(tmp_path, monkeypatch):
    """The seed-11 failure on the folder alone: the write's temporary folder goes while
    it is paused before the rename (an older build's cleanup removed it), and a newer
    trainer owns the folder: fenced (exit 4), not ``CheckpointError`` (exit 3)."""
    from bus import failpoints

    spec = tmp_path / "failpoints"
    spec.write_text("checkpoint.before_rename:pause\n")
    monkeypatch.setenv(failpoints.ENV, f"@{spec}")
    ckpt = tmp_path / "ckpt"
    writer = AsyncCheckpointer(ckpt, keep=3)
    writer.claim(FolderOwnership(ckpt, OLD))
    writer.adopt_log({2: "h2"})
    done = writer.save(snapshot(2), "h2")
    # The temporary folder appears as the write starts; only at the point are its files
    # all written (removing it earlier races the writer's own file creation).
    wait_until(lambda: failpoints.hits("checkpoint.before_rename") == 1, 30, "the paused write")
    (tmp,) = [p for p in ckpt.iterdir() if ".tmp-" in p.name]
    FolderOwnership(ckpt, NEW).claim()
    import shutil

    shutil.rmtree(tmp)
    spec.write_text("")
    with pytest.raises(CheckpointFenced, match="p7-e4 owns it now"):
        done.result(30)
    assert writer.failures_in_a_row == 0 and list_checkpoints(ckpt) == []


def test_only_logged_steps_are_written_and_pruning_spares_a_newer_owners_checkpoints(tmp_path):
    writer = AsyncCheckpointer(tmp_path, keep=1)
    writer.claim(FolderOwnership(tmp_path, OLD))
    writer.adopt_log({2: "h2"})
    with pytest.raises(CheckpointError, match="step 4 .* is not in the step log"):
        writer.save(snapshot(4), "h4")
    with pytest.raises(CheckpointError, match="not in the step log"):
        writer.save(snapshot(2), "another hash")
    writer.confirm(4, "h4")  # step 4's transaction committed
    writer.save(snapshot(4), "h4").result()
    writer.close()
    assert [c.step for c in list_checkpoints(tmp_path)] == [4]
    # A checkpoint of a newer owner (unknown to this trainer's log) is not pruned by it.
    newer = AsyncCheckpointer(tmp_path, keep=3)
    newer.claim(FolderOwnership(tmp_path, NEW))
    newer.adopt_log({2: "h2", 4: "h4", 6: "h6"})
    newer.save(snapshot(6), "h6").result()
    newer.close()
    removed = prune(tmp_path, 1, {2: "h2", 4: "h4"}, current=4, ownership=FolderOwnership(tmp_path, OLD))
    assert removed == [] and [c.step for c in list_checkpoints(tmp_path)] == [4, 6]


# -- with Kafka and real trainer processes -----------------------------------------------------
@pytest.mark.kafka
@pytest.mark.slow
async def test_a_trainer_frozen_inside_a_checkpoint_write_is_fenced_and_writes_nothing(
        kafka_config, tiny_model_path, tmp_path, monkeypatch):
    from tests.test_trainer_crash import TrainerProcess

    model, tok = load_tiny(str(tiny_model_path))
    groups = make_task_groups(model, tok, 4, group_size=2, max_new_tokens=8, env_after=3, seed=31)
    del model
    ckpt = tmp_path / "ckpt"
    cfg = RollwayConfig(kafka=kafka_config, trainer=TrainerConfig(
        model_path=str(tiny_model_path), checkpoint_dir=str(ckpt), checkpoint_every=2, keep_checkpoints=3,
        groups_per_step=1, max_staleness=1000, learning_rate=1e-3, muon_learning_rate=1e-3, num_threads=1,
        group_id=f"ckfence-{tmp_path.name}", session_timeout_ms=6000))
    config = tmp_path / "rollway.toml"
    config.write_bytes(msgspec.toml.encode(cfg))
    spec = tmp_path / "failpoints"
    spec.write_text("checkpoint.before_rename:pause\n")
    monkeypatch.setenv("ROLLWAY_FAILPOINTS", f"@{spec}")

    await publish_trajectories(kafka_config, [t for g in groups[:2] for t in g], chunk_tokens=10)
    zombie = TrainerProcess(config, tmp_path / "trainer-zombie.log")
    try:
        # Step 2's checkpoint files are written, not renamed in: freeze it right there.
        zombie.wait_for(lambda: zombie.events("failpoint reached"), 240, "the step-2 checkpoint write paused")
        zombie.proc.send_signal(signal.SIGSTOP)
        spec.write_text("")  # disarmed: the replacement writes normally; the zombie goes on when woken
        (tmp,) = [p for p in ckpt.iterdir() if ".tmp-" in p.name]

        await publish_trajectories(kafka_config, [t for g in groups[2:] for t in g], chunk_tokens=10)
        replacement = TrainerProcess(config, tmp_path / "trainer-replacement.log", "--max-steps", "4")
        assert replacement.wait(300) == 0, replacement.log.read_text()[-3000:]
        assert [e["step"] for e in replacement.events("train step")] == [3, 4]
        left_alone = tmp.exists()  # its writer lives (stopped): the replacement's cleanup must leave it

        zombie.proc.send_signal(signal.SIGCONT)
        code = zombie.wait(240)
        assert code == 4, zombie.log.read_text()[-4000:]
        assert left_alone
    finally:
        if zombie.proc.poll() is None:
            zombie.proc.send_signal(signal.SIGCONT)
            zombie.kill()
    (stopped,) = zombie.events("trainer stopped: not the only writer")
    assert [e["step"] for e in zombie.events("train step")] == [1, 2]
    assert zombie.events("checkpoint written") == [] and zombie.events("checkpoint write failed") == []
    # Nothing of the zombie in the folder: the replacement's checkpoints only (its replay
    # wrote step 2, it trained and wrote 4), no temporary folder left.
    names = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".owner-"))
    assert names == ["step-00000002", "step-00000004"], names
    metas = [json.loads((ckpt / n / "meta.json").read_text()) for n in names]
    assert {m["pid"] for m in metas} == {replacement.proc.pid}
    assert sorted(await read_step_log(kafka_config)) == [1, 2, 3, 4]
