"""A retry against the attempt it replaced, through the real trainer after a restart
(issue #30, point 4), on a real broker.

A trainer trains two steps and stops. Then a group's killed attempt (its sample 0
complete at version 0, stale for step 3 with ``max_staleness`` 1) and the retry's two
samples (version 2) are in the log, in that order, and a restarted trainer reads them
in one batch before any eviction. Before: the stale sample and the retry's sample 1
completed the group, which was dropped stale, and the retry's sample 0 was thrown
away (``rollway audit``: dropped 1, stale 1). Now step 3 trains the retry's samples.
"""

from __future__ import annotations

import dataclasses

import pytest

from bus import ensure_topics
from rollway.config import RollwayConfig
from tests.conftest import TEST_PARTITIONS, make_kafka_config
from tests.synthetic import load_tiny, make_task_groups
from tests.trainer_helpers import one_thread, publish_trajectories  # noqa: F401  one_thread: autouse fixture
from trainer.config import TrainerConfig
from trainer.publishing import RecordingSink
from trainer.service import Trainer
from trainer.steplog import read_step_log

pytestmark = [pytest.mark.kafka]


async def test_a_restarted_trainer_trains_the_retry_not_the_killed_attempts_stale_sample(
        kafka_bootstrap, tiny_model_path, tmp_path):
    # One partition per topic: the records arrive in the order they were written.
    kafka = make_kafka_config(kafka_bootstrap, partitions={**TEST_PARTITIONS, "trajectories": 1, "rewards": 1})
    await ensure_topics(kafka)
    model, tok = load_tiny(str(tiny_model_path))
    groups = make_task_groups(model, tok, 3, group_size=2, max_new_tokens=8, env_after=3, seed=41)
    del model
    cfg = RollwayConfig(kafka=kafka, trainer=TrainerConfig(
        model_path=str(tiny_model_path), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0,
        groups_per_step=1, max_staleness=1, learning_rate=1e-3, muon_learning_rate=1e-3, num_threads=1,
        group_id=f"retry-{tmp_path.name}", session_timeout_ms=6000))

    async def publish(trajectories) -> None:
        for t in trajectories:
            await publish_trajectories(kafka, [t], chunk_tokens=8, reward=float(t.sample_index))

    await publish([t for g in groups[:2] for t in g])
    first = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    assert await first.run(max_steps=2) == 2

    def as_attempt(t, attempt: str, version: int):
        return dataclasses.replace(t, attempt=attempt, versions=[version] * len(t.token_ids))

    killed = as_attempt(groups[2][0], "a0", 0)
    retry = [as_attempt(t, "a1", 2) for t in groups[2]]
    await publish([killed, retry[1], retry[0]])
    restarted = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    # The idle bound only ends a run that cannot reach step 3 (the old code's).
    assert await restarted.run(max_steps=3, exit_when_idle_s=60) == 3
    step = (await read_step_log(kafka))[3].event
    assert [(g.task_id, g.group_id) for g in step.groups] == [(groups[2][0].task_id, groups[2][0].group_id)]
    assert sorted(t.trajectory_id for t in step.trajectories) == sorted(t.trajectory_id for t in retry)
    assert step.dropped == []
    assert restarted.assembler.counters["trajectories_dropped_stale"] == 1  # the killed attempt's sample
