"""The step-log watch during a broker outage (issue #30, chaos seed 4): the trainer's
step transaction checks the log up to its committed end; when those records cannot be
fetched in time (a broker killed, a partition leader moving) the transaction is retried
like any broker absence, instead of stopping the trainer with exit 3 ("could not read
...train-steps:0 up to offset N")."""

from __future__ import annotations

import pytest

from bus import RecordMissing
from rollway.config import RollwayConfig
from tests.synthetic import load_tiny, make_task_groups
from tests.trainer_helpers import one_thread, publish_trajectories  # noqa: F401  one_thread: autouse fixture
from trainer import steplog
from trainer.config import TrainerConfig
from trainer.publishing import RecordingSink
from trainer.service import Trainer

pytestmark = [pytest.mark.kafka]


async def test_a_step_log_read_that_times_out_retries_the_step_transaction(
        kafka_config, tiny_model_path, tmp_path, monkeypatch):
    model, tok = load_tiny(str(tiny_model_path))
    (group,) = make_task_groups(model, tok, 1, group_size=2, max_new_tokens=8, env_after=3, seed=43)
    del model
    for t in group:
        await publish_trajectories(kafka_config, [t], chunk_tokens=8, reward=float(t.sample_index))
    calls = []
    original = steplog.read_up_to

    def flaky(consumer, ends, *a, **kw):
        calls.append(1)
        if len(calls) == 2:  # the first check inside step 1's transaction (1: the watch's start)
            raise RecordMissing("could not read train-steps:0 up to offset 0")
        return original(consumer, ends, *a, **kw)

    monkeypatch.setattr(steplog, "read_up_to", flaky)
    cfg = RollwayConfig(kafka=kafka_config, trainer=TrainerConfig(
        model_path=str(tiny_model_path), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0,
        groups_per_step=1, max_staleness=1000, learning_rate=1e-3, muon_learning_rate=1e-3, num_threads=1,
        group_id=f"watch-{tmp_path.name}", session_timeout_ms=6000))
    trainer = Trainer(cfg.trainer, cfg.kafka, sink=RecordingSink())
    assert await trainer.run(max_steps=1) == 1
    assert len(calls) >= 3  # failed once, read again in the retried transaction
    assert sorted(await steplog.read_step_log(kafka_config)) == [1]
