"""Configurations that cannot train are refused at start; each TrainStep records the
hash of the training settings, and a replay under other settings fails saying the
config differs (issue #14 item 7)."""

from __future__ import annotations

import msgspec
import pytest

from bus import codec
from bus.config import KafkaConfig
from rollway.config import ConfigError, load_config
from schemas import RecordRef, TrainStep
from trainer.config import TrainerConfig
from trainer.replay import ConfigDiffers, check_training_config, replay_steps
from trainer.steplog import LoggedStep
from trainer.training_config import training_config_hash


def test_publishing_less_often_than_staleness_allows_is_refused():
    with pytest.raises(ConfigError, match=(
            r"trainer.publish_every = 6 cannot train with trainer.max_staleness = 4: samplers get new weights every "
            r"6 steps, so after 5 steps every group is stale and the next publish never comes; need publish_every "
            r"<= max_staleness \+ 1")):
        load_config(None, environ={}, overrides={"trainer": {"publish_every": 6}})
    assert TrainerConfig(publish_every=5, max_staleness=4).publish_every == 5  # the largest that trains


def test_a_group_of_one_is_refused():
    with pytest.raises(ConfigError, match=r"feeder.group_size = 1 cannot train: a group needs at least 2 samples"):
        load_config(None, environ={}, overrides={"feeder": {"group_size": 1}})


@pytest.mark.parametrize("sampler_dtype, replay, warned", [
    ("float32", True, True),     # replays bf16 for a float32 sampler: warned
    ("float", True, True),       # vLLM's name for float32
    ("half", True, True),        # vLLM's name for float16
    ("float32", False, False),   # replay off: nothing to match
    ("bfloat16", True, False),   # the default: matches
    ("auto", True, False),       # the engine decides: cannot be checked here
])
def test_precision_replay_that_does_not_match_the_samplers_is_warned(sampler_dtype, replay, warned):
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        load_config(None, environ={}, overrides={"sampler": {"dtype": sampler_dtype},
                                                 "trainer": {"replay_precision": replay}})
    mismatch = [e for e in logs if e["event"] == "precision replay does not match the samplers"]
    if warned:
        assert mismatch == [{"event": "precision replay does not match the samplers", "log_level": "warning",
                             "sampler_dtype": sampler_dtype, "publish_dtype": "bfloat16",
                             "hint": "set sampler.dtype = trainer.publish_dtype, or trainer.replay_precision = false"}]
    else:
        assert mismatch == []


def test_the_hash_covers_training_settings_only():
    base = training_config_hash(TrainerConfig())
    assert len(base) == 16
    for changed in ({"learning_rate": 2e-5}, {"advantage_norm": "group_mean"}, {"is_cap": 3.0},
                    {"replay_precision": False}, {"micro_batch_tokens": 8192}, {"stale_policy": "mask_tokens"}):
        assert training_config_hash(TrainerConfig(**changed)) != base, changed
    for same in ({"checkpoint_dir": "/elsewhere"}, {"group_id": "g2"}, {"publish_every": 2},
                 {"groups_per_step": 8}, {"on_replay_mismatch": "warn"}, {"model_path": "/m"}):
        assert training_config_hash(TrainerConfig(**same)) == base, same


def _step(step: int, config_hash: str) -> LoggedStep:
    return LoggedStep(TrainStep(step=step, weight_version=step, weights_hash="00" * 16, config_hash=config_hash),
                      RecordRef("rollway.train-steps", 0, step))


def test_a_step_logged_under_other_settings_fails_with_config_differs():
    ours = training_config_hash(TrainerConfig())
    other = training_config_hash(TrainerConfig(learning_rate=1e-3))
    steps = {1: _step(1, ours), 2: _step(2, ""), 3: _step(3, other)}
    check_training_config(steps, 1, 2, ours)  # "" (an older entry) is not checked
    with pytest.raises(ConfigDiffers, match=f"config differs: step 3 was trained with training config {other}, "
                                            f"this trainer's is {ours}"):
        check_training_config(steps, 1, 3, ours)


def test_a_log_from_before_precision_replay_became_the_default_needs_it_off():
    """Steps logged with the float32 forward (replay_precision false, the default before)
    do not replay under today's default (bf16 forward): config differs."""
    assert TrainerConfig().replay_precision is True
    before = training_config_hash(TrainerConfig(replay_precision=False))
    today = training_config_hash(TrainerConfig())
    steps = {1: _step(1, before)}
    with pytest.raises(ConfigDiffers, match=f"config differs: step 1 was trained with training config {before}, "
                                            f"this trainer's is {today}"):
        check_training_config(steps, 1, 1, today)
    check_training_config(steps, 1, 1, training_config_hash(TrainerConfig(replay_precision=False)))


def test_a_schema_3_train_step_decodes_without_a_config_hash():
    class TrainStepV3(msgspec.Struct, kw_only=True):  # schema 3's fields, no config_hash
        step: int
        weight_version: int
        weights_hash: str
        seed: int = 0

    old = msgspec.msgpack.encode(TrainStepV3(step=3, weight_version=3, weights_hash="ab" * 16, seed=1))
    event = codec.decode(old, [("rollway-type", b"TrainStep"), ("rollway-schema", b"3")])
    assert (event.step, event.config_hash) == (3, "")


async def test_replay_refuses_before_fetching_anything(tiny_model_path):
    """The check runs before any record is fetched: the broker here is unreachable, so
    only ConfigDiffers can come out."""
    from trainer.core import TrainCore

    core = TrainCore(TrainerConfig(model_path=str(tiny_model_path), learning_rate=1e-3))
    steps = {1: _step(1, training_config_hash(TrainerConfig(model_path=str(tiny_model_path))))}
    with pytest.raises(ConfigDiffers, match="config differs: step 1"):
        await replay_steps(KafkaConfig(bootstrap_servers="127.0.0.1:1"), core, steps, until=1)
