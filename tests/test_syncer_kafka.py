"""The subscriber follows rollway.weights on a real Kafka broker."""

from __future__ import annotations

import asyncio

import pytest

from bus import EventProducer
from schemas import WeightVersion
from syncer.apply import ModuleTarget
from syncer.config import SyncerConfig
from syncer.publisher import WeightPublisher
from syncer.store import LocalStore
from syncer.subscriber import WeightSubscriber
from tests.waiting import wait_until_async
from tests.weights_helpers import MODEL, Toy, assert_same_bits, initial_state, optimizer_like_step, subscriber

pytestmark = pytest.mark.kafka


async def test_subscribers_follow_weight_announcements(kafka_config, tmp_path):
    cfg = SyncerConfig(chunk_bytes=4096, keyframe_every=3, zstd_threads=2, retry_delay_s=0.2)
    states = {1: initial_state(7)}
    for v in range(2, 5):
        states[v] = optimizer_like_step(states[v - 1], v)
    store = LocalStore(tmp_path / "weights")
    async with EventProducer(kafka_config) as producer:
        pub = WeightPublisher(cfg, MODEL, store, producer)
        live, live_target = subscriber(cfg, store)
        live.kafka_cfg = kafka_config
        live_task = asyncio.create_task(live.run())
        try:
            for v in (1, 2):
                await pub.publish(v, states[v], trainer_step=v)
                await wait_until_async(lambda: live.version == v, 60, "live.version == v")
            # Announcements of another model and of an already-applied version are ignored.
            await producer.publish(WeightVersion(model="other", version=99, kind="full"))
            await producer.publish(WeightVersion(model=MODEL, version=1, kind="full"))
            await pub.publish(3, states[3], trainer_step=3)
            await wait_until_async(lambda: live.version == 3, 60, "live.version == 3")
            assert live.last_path == "delta v2->v3"
            assert_same_bits(dict(live_target.module.state_dict()), states[3])
            assert live.failures == 0

            # A replica that joins late reads the topic from the start and catches up.
            late, late_target = subscriber(cfg, store)
            late.kafka_cfg = kafka_config
            late_task = asyncio.create_task(late.run())
            await wait_until_async(lambda: late.version == 3, 60, "late.version == 3")
            assert late.last_path.startswith("keyframe v1")
            await pub.publish(4, states[4], trainer_step=4)
            await wait_until_async(lambda: late.version == 4 and live.version == 4, 60, "late.version == 4 and live.version == 4")
            assert live.last_path == "delta v3->v4"
            assert_same_bits(dict(late_target.module.state_dict()), states[4])
            late.stop()
            await asyncio.wait_for(late_task, 30)
        finally:
            live.stop()
            await asyncio.wait_for(live_task, 30)
            pub.close()
            live.close()


async def test_run_needs_kafka_config(tmp_path):
    sub = WeightSubscriber(SyncerConfig(), MODEL, LocalStore(tmp_path), ModuleTarget(Toy()))
    with pytest.raises(ValueError, match="kafka_cfg"):
        await sub.run()
    sub.close()


async def test_sampler_trouble_makes_the_next_version_a_keyframe(kafka_config, tmp_path):
    """A sampler that reports a failed weight update gets a keyframe at the next publish
    instead of waiting up to keyframe_every versions."""
    import time

    from schemas import Heartbeat

    cfg = SyncerConfig(chunk_bytes=4096, keyframe_every=10, zstd_threads=2)
    w = {1: initial_state()}
    for v in range(2, 6):
        w[v] = optimizer_like_step(w[v - 1], v)

    def beat(replica: str, status: str, failures: int, role: str = "sampler") -> Heartbeat:
        return Heartbeat(replica_id=replica, role=role, status=status, weight_version=1,
                         details={"weight_failures": str(failures)}, created_at=time.time())

    async with EventProducer(kafka_config) as producer:
        pub = WeightPublisher(cfg, MODEL, LocalStore(tmp_path / "weights"), producer)
        assert (await pub.publish(1, w[1])).kind == "full"
        await producer.publish(beat("s-1", "serving", 0))  # healthy: no trouble
        await producer.publish(beat("trainer", "unhealthy", 5, role="trainer"))  # not a sampler
        await wait_until_async(lambda: pub.watch.seen >= 1, 60, "pub.watch.seen >= 1")
        assert (await pub.publish(2, w[2])).kind == "delta"
        await producer.publish(beat("s-1", "serving", 1))  # a failed update
        await wait_until_async(lambda: pub.watch.seen >= 2, 60, "pub.watch.seen >= 2")
        assert (await pub.publish(3, w[3])).kind == "full"
        assert (await pub.publish(4, w[4])).kind == "delta"  # nothing new reported
        await producer.publish(beat("s-2", "unhealthy", 0))  # an apply failed mid-way
        await wait_until_async(lambda: pub.watch.seen >= 3, 60, "pub.watch.seen >= 3")
        assert (await pub.publish(5, w[5])).kind == "full"
        await pub.aclose()


async def test_a_trainer_that_cannot_publish_repairs_its_newest_version_as_a_keyframe(kafka_config, tmp_path):
    """Chaos seed 3's gap (issue #30): every path to the newest version is damaged (a
    flipped byte in the only keyframe, the newest delta manifest truncated), the replica
    stays on old weights, and a trainer starved of fresh groups never publishes the next
    version. After a sampler's trouble report and ``keyframe_repair_after_s`` without a
    publish, the publisher stores the newest version again as a keyframe, same weights
    hash, and re-announces it; the replica loads it bit for bit. Only once."""
    import time
    from pathlib import Path

    from schemas import Heartbeat
    from syncer import catalog as cat

    cfg = SyncerConfig(chunk_bytes=4096, keyframe_every=10, zstd_threads=2, retry_delay_s=0.2,
                       keyframe_repair_after_s=0.5)
    w = {1: initial_state(3)}
    w[2] = optimizer_like_step(w[1], 2)
    store = LocalStore(tmp_path / "weights")
    async with EventProducer(kafka_config) as producer:
        pub = WeightPublisher(cfg, MODEL, store, producer)
        try:
            assert (await pub.publish(1, w[1], trainer_step=1)).kind == "full"
            announced = await pub.publish(2, w[2], trainer_step=2)
            assert announced.kind == "delta"
            root = Path(tmp_path / "weights" / MODEL)
            chunk = sorted(p for p in (root / "chunks" / f"v{1:012d}-full").rglob("*") if p.is_file())[0]
            data = bytearray(chunk.read_bytes())
            data[len(data) // 2] ^= 0xFF
            chunk.write_bytes(bytes(data))
            delta = root / "manifests" / f"v{2:012d}-delta.json"
            delta.write_bytes(delta.read_bytes()[:40])

            sub, target = subscriber(cfg, store)
            sub.kafka_cfg = kafka_config
            task = asyncio.create_task(sub.run())
            try:
                await wait_until_async(lambda: sub.failures >= 1, 60, "the replica fails on the damaged store")
                assert sub.version < 2 and pub.repairs == 0  # no trouble reported yet: nothing repaired
                await producer.publish(Heartbeat(replica_id="s-1", role="sampler", status="serving", weight_version=-1,
                                                 details={"weight_failures": str(sub.failures)}, created_at=time.time()))
                await wait_until_async(lambda: sub.version == 2, 60, "the replica loads the repaired v2")
                assert sub.last_path.startswith("keyframe v2")
                assert_same_bits(dict(target.module.state_dict()), w[2])
                catalog = await cat.load_catalog(store, MODEL)
                assert catalog.kinds[2] == {"delta", "full"} and pub.repairs == 1
                full = await cat.ManifestReader(store, MODEL).get(2, "full")
                assert (full.weights_hash, full.trainer_step) == (announced.weights_hash, 2)
                # The newest version is a keyframe now: a second repair has nothing to do.
                assert await pub.repair_keyframe() is None and pub.repairs == 1
            finally:
                sub.stop()
                await asyncio.wait_for(task, 30)
                sub.close()
        finally:
            await pub.aclose()
