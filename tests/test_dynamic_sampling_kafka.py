"""Dynamic sampling through the real trainer and Kafka (issue #30 point 2): a step whose
batch had to wait past zero-variance groups trains exactly its informative groups, the
step log records the drops (so the share is derivable from the log), and a fresh core
replaying the step from the log's record positions reproduces its weights bit for bit."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rollway.group_signal import step_groups, tally
from schemas import GroupDrop, GroupsDropped
from tests.synthetic import load_tiny, make_task_groups
from tests.trainer_helpers import one_thread, publish_trajectories  # noqa: F401  one_thread: autouse fixture
from trainer.config import TrainerConfig
from trainer.core import TrainCore
from trainer.publishing import RecordingSink
from trainer.replay import replay_steps
from trainer.service import Trainer
from trainer.steplog import fetch_step_groups, read_step_log

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def sampled(tiny_model_path):
    model, tok = load_tiny(str(tiny_model_path))
    return make_task_groups(model, tok, 2, group_size=4, max_new_tokens=8, env_after=3, seed=13)


def renamed(group, task_id: str):
    return [dataclasses.replace(t, task_id=task_id, group_id="g-" + task_id) for t in group]


async def test_a_step_past_dropped_groups_trains_only_informative_ones_and_replays_bit_for_bit(
        kafka_config, tiny_model_path, tmp_path, sampled):
    cfg = TrainerConfig(model_path=str(tiny_model_path), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0,
                        groups_per_step=2, max_staleness=2, learning_rate=1e-3, muon_learning_rate=1e-3,
                        num_threads=1, group_id=f"trainer-{tmp_path.name}", session_timeout_ms=6000)
    trainer = Trainer(cfg, kafka_config, sink=RecordingSink())
    task = asyncio.create_task(trainer.run(max_steps=1))
    a, b = renamed(sampled[0], "A"), renamed(sampled[1], "B")
    all_solved, all_failed = renamed(sampled[0], "Z1"), renamed(sampled[1], "Z2")
    # In log order: a group every sample solves, an informative one, a group no sample
    # solves, the second informative one. The step needs two informative groups.
    await publish_trajectories(kafka_config, all_solved, score=1.0)
    await publish_trajectories(kafka_config, a)
    await publish_trajectories(kafka_config, all_failed, score=0.0)
    await publish_trajectories(kafka_config, b)
    assert await asyncio.wait_for(task, 180) == 1

    steps = await read_step_log(kafka_config)
    assert sorted(steps) == [1]
    logged = steps[1].event
    assert sorted((g.task_id, g.group_id) for g in logged.groups) == [("A", "g-A"), ("B", "g-B")]
    trained_ids = {t.trajectory_id for t in logged.trajectories}
    assert trained_ids == {t.trajectory_id for t in a + b}
    # Both drops are in the log: with the step, or in the GroupsDropped the clean stop writes.
    drops = sorted([*logged.dropped, *(d for _, d in steps.drops)], key=lambda d: d.task_id)
    assert drops == [GroupDrop("Z1", "g-Z1", "zero_variance"), GroupDrop("Z2", "g-Z2", "zero_variance")]
    events = [logged, *(GroupsDropped(after_step=s, dropped=[d]) for s, d in steps.drops)]
    total = tally(step_groups(events))
    assert (total.trained, total.zero_variance, total.informative_share) == (2, 2, 0.5)

    # The log's record positions give back exactly the informative groups ...
    groups = await fetch_step_groups(kafka_config, logged)
    assert sorted(g.key for g in groups) == [("A", "g-A"), ("B", "g-B")]
    assert all(len(set(g.rewards())) > 1 for g in groups)
    # ... and a fresh core replaying them lands on the logged weights, bit for bit.
    core = TrainCore(cfg)
    rows = await replay_steps(kafka_config, core, steps, until=1)
    assert [(r.step, r.match) for r in rows] == [(1, True)]
    assert core.weights_hash() == logged.weights_hash == trainer.core.weights_hash()
