"""The trainer against real Kafka, in process: batching from the log, the train-step
log, metrics, weight publishing, stale/duplicate/zero-variance drops, committed offsets.
(The crash-and-replay test with a trainer subprocess is tests/test_trainer_crash.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import re

import msgspec
import pytest

from bus import EventProducer, codec, fetch_records
from rollway.config import RollwayConfig
from schemas import Metrics, Reward, TrajectoryChunk
from syncer.hashing import state_dict_hash
from tests.events import read_until
from tests.synthetic import load_tiny, make_task_groups, to_events
from tests.trainer_helpers import one_thread, publish_trajectories  # noqa: F401  one_thread: autouse fixture
from tests.waiting import wait_until_async
from trainer.config import TrainerConfig
from trainer.model import publishable_state
from trainer.publishing import RecordingSink
from trainer.service import Trainer
from trainer.steplog import StepLogError, fetch_step_groups, read_step_log, step_event

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def sampled(tiny_model_path):
    model, tok = load_tiny(str(tiny_model_path))
    return make_task_groups(model, tok, 5, group_size=4, max_new_tokens=8, env_after=3, seed=11)


async def wait_for_steps(cfg, n: int, task: asyncio.Task, timeout: float = 120.0):
    """The step log once it holds ``n`` steps; the trainer's error if it fails first."""
    async def logged():
        steps = await read_step_log(cfg)
        return steps if len(steps) >= n else None

    return await wait_until_async(logged, timeout, f"the trainer to log {n} steps", task=task, poll_s=0.3)


def trainer_config(tmp_path, tiny_model_path, **kw) -> TrainerConfig:
    base = dict(model_path=str(tiny_model_path), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2,
                groups_per_step=1, max_staleness=1, learning_rate=1e-3, muon_learning_rate=1e-3, num_threads=1,
                group_id=f"trainer-{tmp_path.name}", session_timeout_ms=6000)
    base.update(kw)
    return TrainerConfig(**base)


async def test_trainer_trains_from_the_log_and_drops_what_it_must(kafka_config, tiny_model_path, tmp_path, sampled):
    a, b, zero, stale, fresh = sampled
    # The synthetic sampler draws in float32, so the on-policy ratio below is 1 only with
    # a float32 forward (precision replay, on by default, would forward in bf16).
    cfg = RollwayConfig(kafka=kafka_config, trainer=trainer_config(tmp_path, tiny_model_path, replay_precision=False))
    sink = RecordingSink()
    trainer = Trainer(cfg.trainer, cfg.kafka, sink=sink)
    task = asyncio.create_task(trainer.run(max_steps=3))

    # Phase 1: two fresh groups (version 0), a zero-variance group, and a second,
    # later attempt of group a's sample 1.
    await publish_trajectories(kafka_config, a + b)
    await publish_trajectories(kafka_config, zero, score=1.0)
    retry = dataclasses.replace(a[1], attempt="retry")
    await publish_trajectories(kafka_config, [retry])
    # A chunk whose arrays disagree: dead-lettered, the rest of the trainer unbothered.
    broken_chunks, _ = to_events(dataclasses.replace(zero[0], task_id="broken"), chunk_tokens=12)
    async with EventProducer(kafka_config) as producer:
        await producer.publish(msgspec.structs.replace(broken_chunks[0], logprobs=b"\0\0\0"))
    steps = await wait_for_steps(kafka_config, 2, task)

    # Phase 2: the trainer is at version 2. A group sampled at version 0 is 2 > 1
    # versions behind (stale); one sampled at version 2 is fresh.
    n = len(stale[0].token_ids)
    await publish_trajectories(kafka_config, [dataclasses.replace(t, versions=[0] * n) for t in stale])
    await publish_trajectories(kafka_config, [dataclasses.replace(t, versions=[2] * n) for t in fresh])
    last = await asyncio.wait_for(task, 120)
    assert last == 3

    steps = await read_step_log(kafka_config)
    assert sorted(steps) == [1, 2, 3]
    trained = [[t.trajectory_id for t in steps[s].event.trajectories] for s in (1, 2, 3)]
    group_of = lambda tid: tid.split("/")[0]  # noqa: E731
    assert sorted(group_of(ts[0]) for ts in trained[:2]) == ["task-0", "task-1"]
    assert {group_of(t) for t in trained[2]} == {"task-4"}
    a_ids = next(ts for ts in trained if group_of(ts[0]) == "task-0")
    # First complete attempt won sample 1; exactly one of the two attempts is trained.
    assert len(a_ids) == 4 and len({t.rsplit("/", 2)[1] for t in a_ids}) == 4
    assert (retry.trajectory_id in a_ids) != (a[1].trajectory_id in a_ids)

    final = steps[3].event
    assert final.weight_version == 3
    assert final.metrics["count_dropped_duplicate"] == 1
    assert final.metrics["count_dropped_zero_variance"] == 1
    # The stale group ends once: dropped as a whole (stale) when it completed before the
    # next eviction, else its first trajectory is evicted alone, the group is left with
    # nothing (abandoned, key closed) and the other three are late; which one depends on
    # how the records were batched.
    assert final.metrics.get("count_groups_dropped_stale", 0) + final.metrics.get(
        "count_groups_dropped_abandoned", 0) == 1
    assert 4 * final.metrics.get("count_dropped_stale", 0) + final.metrics.get(
        "count_trajectories_dropped_stale", 0) + final.metrics.get("count_dropped_late", 0) == 4
    ends = {d.task_id: d.reason for s in (1, 2, 3) for d in steps[s].event.dropped}
    assert ends == {"task-2": "zero_variance", "task-3": ends.get("task-3"), "broken": "invalid"}
    assert ends["task-3"] in ("stale", "abandoned")
    assert final.metrics["count_dropped_invalid"] == 1
    (letter,) = await read_until(kafka_config, "dlq", lambda evs: len(evs) >= 1, 30)
    assert letter.error_kind == "invalid" and "logprobs" in letter.error
    assert letter.topic == kafka_config.topic_prefix + "trajectories"
    assert final.weights_hash == trainer.core.weights_hash()
    assert [v for v, _, _ in sink.published] == [1, 2, 3]
    assert sink.published[-1][1] == 3
    # The sink records the hash the syncer would announce: of the published bfloat16 copy.
    assert sink.published[-1][2] == state_dict_hash(publishable_state(trainer.core.model, "bfloat16"))

    # The log's record positions are exactly what the step trained on.
    groups = await fetch_step_groups(kafka_config, steps[3].event)
    assert [t.trajectory_id for g in groups for t in g.members] == trained[2]
    envs = await fetch_records(kafka_config, [t.reward for t in steps[3].event.trajectories])
    assert all(isinstance(e.event, Reward) and e.event.trajectory_id == tid for e, tid in zip(envs, trained[2]))
    chunk_envs = await fetch_records(kafka_config, steps[1].event.trajectories[0].chunks)
    assert all(isinstance(e.event, TrajectoryChunk) for e in chunk_envs) and chunk_envs[-1].event.final

    # Metrics: one event per step with the staleness histogram.
    metrics: list[Metrics] = await read_until(kafka_config, "metrics", lambda evs: len(evs) >= 3, 30)
    by_step = {m.step: m for m in metrics}
    assert sorted(by_step) == [1, 2, 3]
    for key in ("loss", "reward_mean", "solve_rate", "entropy_full", "entropy_kept", "mismatch_kl_k3",
                "is_ratio_mean", "is_truncated_frac", "kept_one_frac", "response_len_mean", "tokens_per_s",
                "step_time_s"):
        assert key in by_step[3].values
    gen = sum(sum(t.loss_mask) for t in fresh)
    assert by_step[3].histograms["staleness"] == [float(gen), 0.0, 0.0]  # v2 tokens trained at v2
    assert by_step[2].histograms["staleness"][1] > 0  # the second v0 group, trained at v1
    assert by_step[1].values["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy

    # Every record was acknowledged: trained ones after their step was logged, dropped
    # ones when dropped. A restarted trainer would start at the end.
    from bus.admin import describe_topics

    infos = await describe_topics(kafka_config, [kafka_config.topic_prefix + "trajectories",
                                                 kafka_config.topic_prefix + "rewards"],
                                  [cfg.trainer.group_id])
    for info in infos:
        for p in info.partitions:
            assert p.lag(cfg.trainer.group_id) == 0, (info.name, p)

    # A checkpoint was written at step 2 (checkpoint_every=2).
    assert (tmp_path / "ckpt" / "step-00000002" / "meta.json").exists()


async def test_weights_go_out_through_the_syncer_every_k_steps(kafka_config, tiny_model_path, tmp_path, sampled):
    from schemas import WeightVersion
    from syncer.config import SyncerConfig
    from syncer.fetch import load_version
    from syncer.store import open_store

    store_url = f"file://{tmp_path / 'weights'}"
    cfg = RollwayConfig(
        kafka=kafka_config,
        trainer=trainer_config(tmp_path, tiny_model_path, publish_every=2, checkpoint_every=3, max_staleness=100),
        syncer=SyncerConfig(store_url=store_url, keyframe_every=2),
    )
    a, b, _, d, e = sampled
    await publish_trajectories(kafka_config, a + b + d + e)
    trainer = Trainer(cfg.trainer, cfg.kafka, syncer=cfg.syncer, model_name=cfg.model_name)  # the real syncer publisher
    assert await asyncio.wait_for(trainer.run(max_steps=4), 120) == 4
    expected = publishable_state(trainer.core.model, "bfloat16")

    announced: list[WeightVersion] = await read_until(kafka_config, "weights", lambda evs: len(evs) >= 2, 30)
    assert [(w.version, w.trainer_step) for w in announced] == [(2, 2), (4, 4)]
    store = open_store(store_url)
    loaded = await load_version(store, cfg.model_name, 4)
    assert set(loaded.tensors) == set(expected)
    assert all(torch_equal(loaded.tensors[k], expected[k]) for k in expected)
    # What each hash covers (docs/contracts.md): the step log's, the float32 master
    # parameters; the announcement's, the published bfloat16 copy.
    steps = await read_step_log(kafka_config)
    assert steps[4].event.weights_hash == trainer.core.weights_hash()
    assert announced[1].weights_hash == state_dict_hash(expected)

    # A restart replays step 4 from checkpoint 3 and re-announces version 4 (same bytes).
    again = Trainer(cfg.trainer, cfg.kafka, syncer=cfg.syncer, model_name=cfg.model_name)
    assert await asyncio.wait_for(again.run(max_steps=4), 120) == 4
    assert [r.step for r in again.replayed] == [4]
    everything: list[WeightVersion] = await read_until(kafka_config, "weights", lambda evs: len(evs) >= 3, 30)
    assert [w.version for w in everything] == [2, 4, 4]
    assert everything[2].weights_hash == everything[1].weights_hash

    # A crash after checkpoint 4 was written but before version 4 went out: the next
    # start replays nothing (the checkpoint covers the log) and still publishes 4.
    from trainer.checkpoint import write_checkpoint

    write_checkpoint(cfg.trainer.checkpoint_dir, again.core.snapshot(), again.core.weights_hash())
    third = Trainer(cfg.trainer, cfg.kafka, syncer=cfg.syncer, model_name=cfg.model_name)
    assert await asyncio.wait_for(third.run(max_steps=4), 120) == 4
    assert third.replayed == []
    everything = await read_until(kafka_config, "weights", lambda evs: len(evs) >= 4, 30)
    assert [w.version for w in everything] == [2, 4, 4, 4]


async def test_step_log_reads_a_repeated_identical_entry_once_and_refuses_an_undecodable_one(kafka_config):
    # (Two entries of one step with other contents: tests/test_audit.py.)
    topic = kafka_config.topic_prefix + "train-steps"
    assert await read_step_log(kafka_config) == {}
    async with EventProducer(kafka_config) as producer:
        event = step_event(1, "ab" * 32, [], {"loss": 0.5}, seed=3)
        first = await producer.publish(event)
        value, headers = codec.encode(event)
        again = await producer.publish_raw(topic, value, key=b"trainer", headers=headers)  # a retried publish
    steps = await read_step_log(kafka_config)
    assert list(steps) == [1] and steps[1].ref == first and again.offset == 1
    assert (steps[1].event.weights_hash, steps[1].event.metrics, steps[1].event.seed) == ("ab" * 32, {"loss": 0.5}, 3)
    async with EventProducer(kafka_config) as producer:
        await producer.publish_raw(topic, b"\x00\xff", headers=[("rollway-type", b"TrainStep")])
    with pytest.raises(StepLogError, match=f"undecodable train-step record at {re.escape(topic)}:0@2"):
        await read_step_log(kafka_config)


def torch_equal(x, y) -> bool:
    import torch

    return x.dtype == y.dtype and torch.equal(x, y)
