"""A broker lost mid-run (issue 13, item 6), with real processes: the broker of a
1-node launcher cluster is SIGKILLed while ``rollway trainer`` and ``rollway feeder``
run, and restarted from its data folder. Both wait for it (no crash, no traceback),
the trainer logs the next step once the broker is back, and both stop cleanly (exit 0)
on SIGTERM. A 1-node cluster: losing its broker is a whole outage, the harder case
(with RF 3 a client fails over; tests/test_kafka_broker.py loses one of three). During
the outage a reader asks for metadata and end offsets as a catching-up service does."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, KafkaTimeoutError

from bus import ensure_topics, read_topic
from bus.connect import start_client, stop_consumer, wait_for_broker, waiting_for_broker
from bus.reader import end_offsets, plain_reader, topic_partitions
from bus.topics import topic_spec
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


async def asks_across_the_outage(kafka: LocalKafka, kcfg, bootstrap: str) -> None:
    """Kill the 1-node cluster's broker under a live reader and restart it 5 s later.
    aiokafka fails a metadata fetch at once and gives up on end offsets after
    ``request_timeout_ms`` (chaos seed 4471: the restarted feeder, catching up on the
    rewards log, exited 1 on that KafkaTimeoutError). ``bus.reader`` asks again with
    back-off in a service and answers with the true partitions and ends from the
    restarted broker; a CLI tool (the default policy) and an expired window get the error."""
    topic = topic_spec("evals", kcfg.topic_prefix).name(kcfg.topic_prefix)  # nobody else writes it
    (node,) = kafka.state.nodes
    restarted = threading.Event()

    def restart_later() -> None:
        time.sleep(5.0)
        kafka.restart_node(node.node_id, timeout=180)
        restarted.set()

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await start_client(producer, bootstrap)
    for i in range(7):
        await producer.send_and_wait(topic, b"r%d" % i)
    await producer.stop()
    consumer = plain_reader(kcfg, "catch-up")
    await start_client(consumer, bootstrap)
    try:
        tps_before = await topic_partitions(consumer, topic)
        ends_before = await consumer.end_offsets(tps_before)
        assert tps_before and sum(ends_before.values()) == 7
        os.kill(node.pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(node.pid), 30, "the broker to die")
        assert not waiting_for_broker()  # the CLI policy: the first failure is the answer
        with pytest.raises(KafkaError, match="Unable to get cluster metadata"):
            await topic_partitions(consumer, topic)
        with pytest.raises(KafkaTimeoutError):
            await end_offsets(consumer, tps_before)
        threading.Thread(target=restart_later, daemon=True).start()
        with pytest.raises(KafkaTimeoutError):  # a service's window that runs out
            await end_offsets(consumer, tps_before, window_s=1.0)
        wait_for_broker(True)
        try:
            tps_after = await topic_partitions(consumer, topic)
            ends_after = await end_offsets(consumer, tps_after)
        finally:
            wait_for_broker(False)
        assert restarted.is_set()  # answered by the restarted broker, not before it
        assert tps_after == tps_before and ends_after == ends_before
    finally:
        await stop_consumer(consumer)


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
        # data folder on the same port; meanwhile a reader asks for metadata and end
        # offsets as a catching-up service does.
        asyncio.run(asks_across_the_outage(kafka, kcfg, bootstrap))
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

