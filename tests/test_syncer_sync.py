"""Publisher -> store -> subscriber, against the local folder store and S3 (moto).

Publish v1 (keyframe), v2, v3 (deltas); a fresh subscriber reaches v3 bit-exactly; a
subscriber at v1 reaches v3 through the deltas; a flipped byte in a stored chunk is
detected and nothing is applied; retention, idempotent re-publish, conflicts.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from syncer import catalog as cat
from syncer.bits import bits_view
from syncer.config import SyncerConfig
from syncer.hashing import state_dict_hash
from syncer.manifest import decode_manifest, manifest_key
from syncer.publisher import WeightConflict, WeightPublisher
from syncer.subscriber import UpdateFailed
from tests.weights_helpers import (
    MODEL,
    Toy,
    assert_same_bits,
    initial_state,
    optimizer_like_step,
    publish_all,
    subscriber,
    weight_store,
)

@pytest.fixture
def syncer_cfg() -> SyncerConfig:
    # Small chunks: every tensor spans several chunks.
    return SyncerConfig(chunk_bytes=4096, keyframe_every=3, keep_keyframes=1, zstd_threads=2, max_concurrency=4)


@pytest.fixture(params=["file", "s3"])
async def store(request, tmp_path, syncer_cfg):
    async with weight_store(request.param, tmp_path, syncer_cfg, request) as s:
        yield s


@pytest.fixture
def versions() -> dict[int, dict[str, torch.Tensor]]:
    v1 = initial_state()
    v2 = optimizer_like_step(v1, 2)
    v3 = optimizer_like_step(v2, 3)
    return {1: v1, 2: v2, 3: v3}


async def test_publish_layout_and_events(syncer_cfg, store, versions):
    pub = WeightPublisher(syncer_cfg, MODEL, store)
    e1 = await pub.publish(1, versions[1], trainer_step=10)
    e2 = await pub.publish(2, versions[2], trainer_step=20)
    assert (e1.kind, e1.base_version, e1.keyframe_version) == ("full", -1, 1)
    assert (e2.kind, e2.base_version, e2.keyframe_version, e2.trainer_step) == ("delta", 1, 1, 20)
    assert e2.weights_hash == state_dict_hash(versions[2])
    assert e2.manifest_url == store.url_for(manifest_key(MODEL, 2, "delta"))
    assert e2.stored_bytes < 0.6 * e2.raw_bytes  # a delta is much smaller than the model
    delta = decode_manifest(await store.get(manifest_key(MODEL, 2, "delta")))
    enc = {t.name: t.encoding for t in delta.tensors}
    assert enc["scale_fp8"] == "same" and enc["norm.bias"] == "same" and enc["embed.weight"] == "xor"
    assert all(c.raw_bytes <= 4096 for t in delta.tensors for c in t.chunks)
    assert len(next(t for t in delta.tensors if t.name == "embed.weight").chunks) == 300 * 64 * 2 // 4096 + 1
    catalog = await cat.load_catalog(store, MODEL)
    assert catalog.kinds == {1: {"full"}, 2: {"delta"}}
    pub.close()


async def test_fresh_subscriber_reaches_v3_bit_exactly(syncer_cfg, store, versions):
    (await publish_all(syncer_cfg, store, versions)).close()
    sub, target = subscriber(syncer_cfg, store)
    assert await sub.update_to((await cat.load_catalog(store, MODEL)).latest)
    assert sub.version == 3 and target.weight_version == 3
    assert sub.last_path == "keyframe v1, delta v1->v2, delta v2->v3"
    assert_same_bits(sub.weights, versions[3])
    assert_same_bits(dict(target.module.state_dict()), versions[3])
    assert sub.updates_applied == 1
    assert sub.last_pause_s > 0
    sub.close()


async def test_subscriber_at_v1_reaches_v3_through_deltas_in_place(syncer_cfg, store, versions):
    pub = await publish_all(syncer_cfg, store, versions, upto=1)
    sub, target = subscriber(syncer_cfg, store)
    await sub.update_to(1)
    assert_same_bits(dict(target.module.state_dict()), versions[1])
    ptrs = {n: t.data_ptr() for n, t in target.module.state_dict().items()}
    await pub.publish(2, versions[2])
    await pub.publish(3, versions[3])
    applied: list[set[str]] = []
    original_apply = target.apply_weights

    async def spy(tensors, version):
        applied.append(set(tensors))
        return await original_apply(tensors, version)

    target.apply_weights = spy
    assert await sub.update_to(3)
    assert sub.last_path == "delta v1->v2, delta v2->v3"
    assert_same_bits(dict(target.module.state_dict()), versions[3])
    # in place: no parameter or buffer was reallocated
    assert {n: t.data_ptr() for n, t in target.module.state_dict().items()} == ptrs
    # only tensors that changed were sent to the engine
    assert applied == [set(versions[1]) - {"scale_fp8", "norm.bias"}]
    assert not await sub.update_to(2)  # older than what we hold: ignored
    assert sub.version == 3
    pub.close()
    sub.close()


async def test_flipped_byte_is_detected_and_nothing_applied(syncer_cfg, store, versions):
    pub = await publish_all(syncer_cfg, store, versions, upto=2)
    sub, target = subscriber(syncer_cfg, store)
    await sub.update_to(2)
    await pub.publish(3, versions[3])
    before = {n: t.clone() for n, t in target.module.state_dict().items()}
    # Corrupt one byte of one chunk of the v3 delta (and, to block the fallback,
    # the v1 keyframe too).
    for version, kind in ((3, "delta"), (1, "full")):
        manifest = decode_manifest(await store.get(manifest_key(MODEL, version, kind)))
        key = next(t for t in manifest.tensors if t.name == "proj.weight").chunks[-1].key
        data = bytearray(await store.get(key))
        data[len(data) // 2] ^= 0x01
        await store.put(key, bytes(data))
    with pytest.raises(UpdateFailed, match="checksum mismatch"):
        await sub.update_to(3)
    assert sub.version == 2 and target.weight_version == 2 and sub.updates_applied == 1
    assert_same_bits(dict(target.module.state_dict()), before)
    assert_same_bits(sub.weights, versions[2])
    pub.close()
    sub.close()


async def test_corrupt_delta_falls_back_to_keyframe_path(syncer_cfg, store):
    """v4 is a keyframe that also stored a delta v3->v4. A truncated chunk in that
    delta sends the subscriber at v3 down the keyframe path (full v4)."""
    states = {1: initial_state(5)}
    for v in range(2, 5):
        states[v] = optimizer_like_step(states[v - 1], v)
    pub = WeightPublisher(syncer_cfg, MODEL, store)
    for v in range(1, 4):
        await pub.publish(v, states[v])
    sub, target = subscriber(syncer_cfg, store)
    await sub.update_to(3)
    assert (await pub.publish(4, states[4])).kind == "full"
    manifest = decode_manifest(await store.get(manifest_key(MODEL, 4, "delta")))
    key = manifest.tensors[0].chunks[0].key
    await store.put(key, (await store.get(key))[:-1])  # truncated object
    assert await sub.update_to(4)
    assert sub.last_path == "keyframe v4"
    assert_same_bits(dict(target.module.state_dict()), states[4])
    pub.close()
    sub.close()


async def test_replica_with_wrong_base_bits_takes_keyframe_path(syncer_cfg, store, versions):
    """The replica's copy of v1 got damaged (a bit flipped in memory): the delta decodes
    to a tensor whose checksum fails, so the keyframe path rebuilds everything."""
    pub = await publish_all(syncer_cfg, store, versions, upto=2)
    sub, target = subscriber(syncer_cfg, store)
    await sub.update_to(1)
    bits_view(sub.weights["proj.weight"])[7] ^= 1
    assert await sub.update_to(2)
    assert sub.last_path == "keyframe v1, delta v1->v2"
    assert_same_bits(dict(target.module.state_dict()), versions[2])
    pub.close()
    sub.close()


async def test_missing_chunk_is_never_applied(syncer_cfg, store, versions):
    """A partial version (chunk gone) cannot be applied; with the keyframe gone too the
    update fails cleanly."""
    pub = await publish_all(syncer_cfg, store, versions, upto=1)
    sub, target = subscriber(syncer_cfg, store)
    await sub.update_to(1)
    await pub.publish(2, versions[2])
    delta = decode_manifest(await store.get(manifest_key(MODEL, 2, "delta")))
    full = decode_manifest(await store.get(manifest_key(MODEL, 1, "full")))
    await store.delete([delta.tensors[1].chunks[0].key, full.tensors[1].chunks[0].key])
    with pytest.raises(UpdateFailed, match="chunk missing"):
        await sub.update_to(2)
    assert sub.version == 1
    assert_same_bits(dict(target.module.state_dict()), versions[1])
    pub.close()
    sub.close()


async def test_keyframes_retention_and_missed_versions(syncer_cfg, store):
    """keyframe_every=3, keep_keyframes=1: v1 full, v2-3 deltas, v4 full(+delta), ...
    A subscriber that missed the pruned versions takes the keyframe path."""
    states = {1: initial_state(1)}
    for v in range(2, 8):
        states[v] = optimizer_like_step(states[v - 1], v)
    pub = WeightPublisher(syncer_cfg, MODEL, store)
    sub, target = subscriber(syncer_cfg, store)
    kinds = []
    for v in range(1, 8):
        kinds.append((await pub.publish(v, states[v])).kind)
        if v == 2:
            await sub.update_to(2)
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    catalog = await cat.load_catalog(store, MODEL)
    # only versions from the newest keyframe (v7) on remain
    assert catalog.kinds == {7: {"full", "delta"}}
    assert await store.list(f"{MODEL}/chunks/v000000000004") == []
    assert await sub.update_to(7)
    assert sub.last_path == "keyframe v7"
    assert_same_bits(dict(target.module.state_dict()), states[7])
    pub.close()
    sub.close()


async def test_keyframe_version_also_has_a_delta(syncer_cfg, store):
    cfg = msgspec.structs.replace(syncer_cfg, keep_keyframes=2)
    states = {1: initial_state(4)}
    for v in range(2, 5):
        states[v] = optimizer_like_step(states[v - 1], v)
    pub = WeightPublisher(cfg, MODEL, store)
    sub, target = subscriber(cfg, store)
    for v in range(1, 4):
        await pub.publish(v, states[v])
    await sub.update_to(3)
    event = await pub.publish(4, states[4])
    assert (event.kind, event.base_version, event.keyframe_version) == ("full", 3, 4)
    await sub.update_to(4)
    assert sub.last_path == "delta v3->v4"  # up-to-date replicas skip the full copy
    assert_same_bits(sub.weights, states[4])
    pub.close()
    sub.close()


async def test_republish_is_harmless_and_conflicts_are_refused(syncer_cfg, store, versions):
    pub = await publish_all(syncer_cfg, store, versions, upto=2)
    listing = await store.list(f"{MODEL}/")
    again = await pub.publish(2, versions[2])
    assert (again.version, again.kind) == (2, "delta")
    assert await store.list(f"{MODEL}/") == listing  # nothing rewritten
    with pytest.raises(WeightConflict, match="different weights"):
        await pub.publish(2, versions[3])
    with pytest.raises(WeightConflict, match="older than"):
        await pub.publish(0, versions[1])
    # A restarted trainer (fresh publisher) replaying v2 adopts it and goes on with deltas.
    pub.close()
    fresh = WeightPublisher(syncer_cfg, MODEL, store)
    replay = await fresh.publish(2, versions[2])
    assert replay.weights_hash == again.weights_hash
    e3 = await fresh.publish(3, versions[3])
    assert (e3.kind, e3.base_version) == ("delta", 2)
    sub, _ = subscriber(syncer_cfg, store)
    await sub.update_to(3)
    assert_same_bits(sub.weights, versions[3])
    fresh.close()
    sub.close()


async def test_publish_input_errors(syncer_cfg, store):
    pub = WeightPublisher(syncer_cfg, MODEL, store)
    with pytest.raises(ValueError, match="empty"):
        await pub.publish(1, {})
    with pytest.raises(ValueError, match="not supported"):
        await pub.publish(1, {"c": torch.zeros(3, dtype=torch.complex64)})
    with pytest.raises(ValueError, match=">= 0"):
        await pub.publish(-1, initial_state())
    assert (await cat.load_catalog(store, MODEL)).kinds == {}
    pub.close()


async def test_update_to_unknown_version_fails_cleanly(syncer_cfg, store, versions):
    (await publish_all(syncer_cfg, store, versions, upto=1)).close()
    sub, target = subscriber(syncer_cfg, store)
    with pytest.raises(UpdateFailed, match="not in"):
        await sub.update_to(5)
    assert sub.version == -1 and target.weight_version == -1
    sub.close()


async def test_out_of_order_delta_is_never_decoded(syncer_cfg, store, versions):
    """A delta whose base is not the replica's version is refused before decoding."""
    from concurrent.futures import ThreadPoolExecutor

    from syncer.fetch import Reconstructor
    from syncer.tensor_codec import IntegrityError

    (await publish_all(syncer_cfg, store, versions)).close()
    sub, _ = subscriber(syncer_cfg, store)
    await sub.update_to(1)
    delta3 = await cat.ManifestReader(store, MODEL).get(3, "delta")  # base v2
    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(IntegrityError, match="not v2"):
            await Reconstructor(store, pool).apply_manifest(delta3, sub.weights, sub._checksums)
    sub.close()


async def test_failed_apply_keeps_version_and_resends_everything(syncer_cfg, store, versions):
    pub = await publish_all(syncer_cfg, store, versions, upto=1)
    sub, target = subscriber(syncer_cfg, store)
    await sub.update_to(1)
    await pub.publish(2, versions[2])
    await pub.publish(3, versions[3])
    calls: list[int] = []
    real_apply = target.apply_weights

    async def flaky(tensors, version):
        calls.append(len(tensors))
        if len(calls) == 1:
            raise RuntimeError("engine hiccup")
        return await real_apply(tensors, version)

    target.apply_weights = flaky
    with pytest.raises(RuntimeError, match="hiccup"):
        await sub.update_to(2)
    assert sub.version == 1 and sub.updates_applied == 1
    await sub.update_to(3)
    # after a failed apply the engine may hold a mix: the next update sends every tensor
    assert calls == [len(versions[1]) - 2, len(versions[1])]
    assert_same_bits(dict(target.module.state_dict()), versions[3])
    pub.close()
    sub.close()


def test_apply_to_module_validates_before_copying():
    from syncer.apply import apply_to_module

    module = Toy()
    state = initial_state()
    apply_to_module(module, state)
    before = {n: t.clone() for n, t in module.state_dict().items()}
    new = optimizer_like_step(state, 9)
    with pytest.raises(KeyError, match="no parameter or buffer named 'nope'"):
        apply_to_module(module, {**new, "nope": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"proj.weight: module holds shape \(96, 64\)"):
        apply_to_module(module, {**new, "proj.weight": torch.zeros(64, 96, dtype=torch.bfloat16)})
    assert_same_bits(dict(module.state_dict()), before)  # nothing was half-applied
