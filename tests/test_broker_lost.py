"""A broker lost mid-run (issue 13, item 6), with real processes: the broker of a
1-node launcher cluster is SIGKILLed while ``rollway trainer`` and ``rollway feeder``
run, and restarted from its data folder. Both wait for it (no crash, no traceback),
the trainer logs the next step once the broker is back, and both stop cleanly (exit 0)
on SIGTERM. A 1-node cluster: losing its broker is a whole outage, the harder case
(with RF 3 a client fails over; tests/test_kafka_broker.py loses one of three)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from bus import ensure_topics, read_topic
from rollway.broker import LocalKafka, pid_alive
from rollway.config import RollwayConfig
from schemas import GroupRef, Task
from tasks.config import FeederConfig
from tests.cli import log_events
from tests.conftest import make_kafka_config
from tests.synthetic import load_tiny, make_task_groups
from tests.trainer_helpers import publish_trajectories
from tests.waiting import wait_until
from trainer.config import TrainerConfig
from trainer.steplog import read_step_log

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def start(config: Path, log: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, ROLLWAY_REPLICA_ID=log.stem, PYTHONUNBUFFERED="1")
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)  # the config file names this test's own broker
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "rollway.cli", "--config", str(config), *args],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def test_services_wait_for_a_lost_broker_and_go_on_when_it_is_back(tmp_path, tiny_model_path):
    kafka = LocalKafka(tmp_path / "kafka", nodes=1)
    procs: list[subprocess.Popen] = []
    try:
        bootstrap = kafka.start(timeout=180)
        kcfg = make_kafka_config(bootstrap, request_timeout_ms=5000)
        asyncio.run(ensure_topics(kcfg))
        trainer_cfg = TrainerConfig(model_path=str(tiny_model_path), checkpoint_dir=str(tmp_path / "ckpt"),
                                    checkpoint_every=1, groups_per_step=1, max_staleness=4, num_threads=1,
                                    learning_rate=1e-3, muon_learning_rate=1e-3, session_timeout_ms=6000)
        config = tmp_path / "rollway.toml"
        # No sampler rewards the feeder's groups: no backpressure, it publishes throughout.
        feeder_cfg = FeederConfig(groups_per_second=2.0, max_outstanding_groups=100_000)
        config.write_bytes(msgspec.toml.encode(RollwayConfig(kafka=kcfg, trainer=trainer_cfg, feeder=feeder_cfg)))
        trainer_log, feeder_log = tmp_path / "trainer.log", tmp_path / "feeder.log"
        trainer = start(config, trainer_log, "trainer", "--no-publish")
        feeder = start(config, feeder_log, "feeder")
        procs += [trainer, feeder]

        model, tok = load_tiny(str(tiny_model_path))
        before, after = make_task_groups(model, tok, 2, group_size=4, max_new_tokens=8, env_after=3, seed=11)
        asyncio.run(publish_trajectories(kcfg, before))
        wait_until(lambda: len(asyncio.run(read_step_log(kcfg))) == 1, 300, "step 1", proc=trainer, poll_s=1.0)
        issued_before = len(asyncio.run(read_topic(kcfg, "tasks")))

        # The broker dies mid-run (SIGKILL: no clean shutdown) and comes back from its
        # data folder on the same port.
        (node,) = kafka.state.nodes
        os.kill(node.pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(node.pid), 30, "the broker to die")
        kafka.restart_node(node.node_id, timeout=180)
        assert trainer.poll() is None, trainer_log.read_text()[-3000:]
        assert feeder.poll() is None, feeder_log.read_text()[-3000:]

        asyncio.run(publish_trajectories(kcfg, after))
        wait_until(lambda: len(asyncio.run(read_step_log(kcfg))) == 2, 300, "step 2 after the broker came back",
                   proc=trainer, poll_s=1.0)
        wait_until(lambda: len(asyncio.run(read_topic(kcfg, "tasks"))) > issued_before, 120,
                   "the feeder to publish again", proc=feeder, poll_s=1.0)
        for proc in (trainer, feeder):
            proc.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=120) == 0, trainer_log.read_text()[-3000:]
        assert feeder.wait(timeout=120) == 0, feeder_log.read_text()[-3000:]

        steps = asyncio.run(read_step_log(kcfg))
        assert sorted(steps) == [1, 2]
        assert [steps[s].event.groups for s in (1, 2)] == [[GroupRef("task-0", "g0")], [GroupRef("task-1", "g1")]]
        tasks = asyncio.run(read_topic(kcfg, "tasks"))
        assert all(isinstance(e.event, Task) for e in tasks)
        for log in (trainer_log, feeder_log):
            text = log.read_text()
            assert "Traceback" not in text, text[-3000:]
        assert not log_events(trainer_log, "trainer stopped")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        kafka.stop()
