"""Group accounting across a trainer restart, against real Kafka (issue 13, item 2):
the step log records the keys of the groups each step trained (``TrainStep.groups``),
and a restarted trainer refuses a group re-sampled under a new attempt id."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rollway.config import RollwayConfig
from schemas import GroupRef
from tests.synthetic import load_tiny, make_task_groups
from tests.test_trainer_kafka import trainer_config
from tests.trainer_helpers import one_thread, publish_trajectories  # noqa: F401  one_thread: autouse fixture
from trainer.publishing import RecordingSink
from trainer.service import Trainer
from trainer.steplog import read_step_log

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def sampled(tiny_model_path):
    model, tok = load_tiny(str(tiny_model_path))
    return make_task_groups(model, tok, 2, group_size=4, max_new_tokens=8, env_after=3, seed=11)


async def test_a_group_trained_before_a_restart_is_not_trained_again(kafka_config, tiny_model_path, tmp_path,
                                                                     sampled):
    first, other = sampled
    cfg = RollwayConfig(kafka=kafka_config, trainer=trainer_config(tmp_path, tiny_model_path, max_staleness=4))
    await publish_trajectories(kafka_config, first)
    assert await asyncio.wait_for(Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink()).run(max_steps=1), 120) == 1

    # A sampler delivered the task again (its ack was lost): the same group under a new
    # attempt id, new trajectory ids. Then a group never trained.
    again = [dataclasses.replace(t, attempt="again") for t in first]
    await publish_trajectories(kafka_config, again)
    await publish_trajectories(kafka_config, other)
    restarted = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    assert await asyncio.wait_for(restarted.run(max_steps=2), 120) == 2

    steps = await read_step_log(kafka_config)
    assert [g for s in (1, 2) for g in steps[s].event.groups] == [GroupRef("task-0", "g0"), GroupRef("task-1", "g1")]
    assert [t.trajectory_id for t in steps[2].event.trajectories] == [t.trajectory_id for t in other]
    assert steps[2].event.metrics["count_dropped_duplicate"] == 4
    assert restarted.assembler is not None and restarted.assembler.closed[("task-0", "g0")] == "trained"
