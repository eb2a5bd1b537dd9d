"""Crash and replay with real Kafka and a real trainer process (``rollway trainer``).

The trainer is SIGKILLed twice: once while idle right after a non-checkpoint step (so
the restart must re-execute logged steps), once in the middle of a backlog. Each
restart must load its last checkpoint, re-execute every logged step after it with
matching hashes, and go on without training any trajectory twice or skipping one
(checked from the train-step log). Finally ``rollway replay`` re-executes the whole log
in a fresh process from the initial model: a second trainer fed the same log reaches
bit-identical weights at every step.
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

from rollway.config import RollwayConfig
from tests.cli import REPO, log_events, run_cli
from tests.synthetic import load_tiny, make_task_groups
from tests.trainer_helpers import publish_trajectories
from tests.waiting import wait_until
from trainer.config import TrainerConfig
from trainer.steplog import read_step_log

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


class TrainerProcess:
    def __init__(self, config: Path, log: Path, *args: str) -> None:
        self.log = log
        env = dict(os.environ, ROLLWAY_REPLICA_ID=log.stem, PYTHONUNBUFFERED="1")
        self._out = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollway.cli", "--config", str(config), "trainer", "--no-publish", *args],
            cwd=REPO, env=env, stdout=self._out, stderr=subprocess.STDOUT,
        )

    def events(self, name: str | None = None) -> list[dict]:
        return log_events(self.log, name)

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        try:
            wait_until(predicate, timeout, what, proc=self.proc)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n" + self.log.read_text()[-3000:]) from None

    def last_step(self) -> int:
        steps = [e["step"] for e in self.events("train step")]
        return max(steps) if steps else 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._out.close()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._out.close()


async def publish(cfg, groups) -> list[str]:
    return await publish_trajectories(cfg, [t for g in groups for t in g], chunk_tokens=10)


async def test_sigkilled_trainer_replays_the_log_and_loses_nothing(kafka_config, tiny_model_path, tmp_path):
    model, tok = load_tiny(str(tiny_model_path))
    groups = make_task_groups(model, tok, 12, group_size=4, max_new_tokens=8, env_after=3, seed=5)
    del model
    trainer_cfg = TrainerConfig(
        model_path=str(tiny_model_path), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3,
        keep_checkpoints=3, groups_per_step=1, max_staleness=1000, learning_rate=1e-3,
        muon_learning_rate=1e-3, num_threads=1, group_id="crash-trainer", session_timeout_ms=6000,
    )
    config = tmp_path / "rollway.toml"
    config.write_bytes(msgspec.toml.encode(RollwayConfig(kafka=kafka_config, trainer=trainer_cfg)))

    # Run 1: five groups; killed while idle after step 5 (checkpoint 3 is on disk).
    published = await publish(kafka_config, groups[:5])
    first = TrainerProcess(config, tmp_path / "trainer-1.log")
    first.wait_for(lambda: first.last_step() >= 5 and any(e["step"] == 3 for e in first.events("checkpoint written")),
                   180, "5 steps and checkpoint 3")
    first.kill()

    # Run 2: a backlog of seven more groups; killed mid-run, as soon as step 7 is logged.
    published += await publish(kafka_config, groups[5:])
    second = TrainerProcess(config, tmp_path / "trainer-2.log")
    second.wait_for(lambda: second.last_step() >= 7, 180, "step 7")
    second.kill()
    (restoring,) = second.events("restoring")
    assert restoring["checkpoint_step"] == 3 and restoring["logged_steps"] == 5
    replayed = second.events("replayed step")
    assert [(e["step"], e["match"]) for e in replayed] == [(4, True), (5, True)]
    assert min(e["step"] for e in second.events("train step")) == 6  # live again right after

    # Run 3: restart after the mid-run kill and drain the backlog.
    third = TrainerProcess(config, tmp_path / "trainer-3.log", "--max-steps", "12")
    assert third.wait(240) == 0, third.log.read_text()[-3000:]
    (restoring,) = third.events("restoring")
    ckpt, logged = restoring["checkpoint_step"], restoring["logged_steps"]
    assert logged >= 7 and ckpt % 3 == 0 and ckpt <= logged
    replayed = third.events("replayed step")
    assert [e["step"] for e in replayed] == list(range(ckpt + 1, logged + 1))
    assert all(e["match"] for e in replayed)
    new_steps = [e["step"] for e in third.events("train step")]
    assert new_steps == list(range(logged + 1, 13))

    # The log: steps 1..12, every published trajectory trained exactly once.
    steps = await read_step_log(kafka_config)
    assert sorted(steps) == list(range(1, 13))
    trained = [t.trajectory_id for s in range(1, 13) for t in steps[s].event.trajectories]
    assert len(trained) == len(set(trained)) == 48
    assert set(trained) == set(published)
    assert all(steps[s].event.weight_version == s for s in steps)

    # A second trainer, from the initial model, fed the same log: same weights, every step.
    result = run_cli("replay", "--from-step", "1", "--to-step", "12", "--verify", "--no-checkpoint", "--json",
                     config=config, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in rows] == list(range(1, 13)) and all(r["match"] for r in rows)
    assert rows[-1]["replayed_hash"] == steps[12].event.weights_hash

    # rollway replay from the nearest earlier checkpoint (kept: 6, 9, 12).
    result = run_cli("replay", "--from-step", "8", "--to-step", "10", "--verify", config=config, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "started from step 6 (checkpoint); re-executed 4 steps" in result.stdout
    assert "4/4 steps match" in result.stdout


def test_sigterm_stops_the_trainer_cleanly(kafka_config, tiny_model_path, tmp_path):
    trainer_cfg = TrainerConfig(model_path=str(tiny_model_path), checkpoint_dir=str(tmp_path / "ckpt"),
                                num_threads=1, group_id="sigterm-trainer", session_timeout_ms=6000)
    config = tmp_path / "rollway.toml"
    config.write_bytes(msgspec.toml.encode(RollwayConfig(kafka=kafka_config, trainer=trainer_cfg)))
    proc = TrainerProcess(config, tmp_path / "trainer.log")
    proc.wait_for(lambda: proc.events("live"), 120, "the trainer to go live")
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.log.read_text()[-3000:]
    assert proc.events("trainer exited")[0]["step"] == 0
