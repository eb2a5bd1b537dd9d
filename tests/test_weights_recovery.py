"""Weights always recover (issue 13, item 4), against the local folder store and S3 (moto).

Each test is the regression test of one failure seen on the landed code: a bad delta
manifest that skipped the keyframe fallback, a damaged newest keyframe with an older one
intact, two publishers of one version leaving a mix, the announced hash never checked,
a wrong dtype silently cast in place, a failed apply leaving a replica that looked
healthy, orphaned objects never collected, an unbounded manifest cache, and a delta
cadence that let one bad delta outlast the trainer's staleness bound.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from syncer import catalog as cat
from syncer.apply import ModuleTarget, WeightsRefused, apply_to_module
from syncer.config import SyncerConfig, keyframe_cadence
from syncer.fetch import load_version
from syncer.hashing import state_dict_hash
from syncer.manifest import chunk_key, decode_manifest, manifest_key
from syncer.publisher import WeightConflict, WeightPublisher
from syncer.store import LocalStore
from syncer.subscriber import UpdateFailed, WeightSubscriber
from tests.weights_helpers import (
    MODEL,
    Toy,
    assert_same_bits,
    initial_state,
    optimizer_like_step,
    subscriber,
    weight_store,
)


@pytest.fixture
def cfg() -> SyncerConfig:
    # Keyframes at v1 and v4 (which also stores a delta v3->v4); both kept.
    return SyncerConfig(chunk_bytes=4096, keyframe_every=3, keep_keyframes=2, zstd_threads=2, max_concurrency=4)


@pytest.fixture(params=["file", "s3"])
async def store(request, tmp_path, cfg):
    async with weight_store(request.param, tmp_path, cfg, request) as s:
        yield s


def states(n: int, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    out = {1: initial_state(seed)}
    for v in range(2, n + 1):
        out[v] = optimizer_like_step(out[v - 1], 100 * seed + v)
    return out


async def publish(cfg, store, weights, upto) -> WeightPublisher:
    pub = WeightPublisher(cfg, MODEL, store)
    for v in range(1, upto + 1):
        await pub.publish(v, weights[v])
    return pub


async def damage(store, key: str, how: str = "truncate") -> None:
    data = await store.get(key)
    await store.put(key, data[: len(data) // 2] if how == "truncate" else bytes([data[0] ^ 0xFF]) + data[1:])


async def test_bad_delta_manifest_falls_back_to_the_keyframe(cfg, store):
    """A truncated delta manifest used to escape planning as an error (no fallback)."""
    w = states(4)
    pub = await publish(cfg, store, w, 3)
    sub, target = subscriber(cfg, store)
    await sub.update_to(3)
    assert (await pub.publish(4, w[4])).kind == "full"
    await damage(store, manifest_key(MODEL, 4, "delta"))
    assert await sub.update_to(4)
    assert sub.last_path == "keyframe v4"
    assert_same_bits(dict(target.module.state_dict()), w[4])
    pub.close()
    sub.close()


@pytest.mark.parametrize("what", ["manifest", "chunk"])
async def test_damaged_newest_keyframe_falls_back_to_an_older_one(cfg, store, what):
    """Only the newest keyframe used to be tried."""
    w = states(5)
    pub = await publish(cfg, store, w, 5)  # keyframes v1, v4
    if what == "manifest":
        await damage(store, manifest_key(MODEL, 4, "full"))
    else:
        manifest = decode_manifest(await store.get(manifest_key(MODEL, 4, "full")))
        await damage(store, manifest.tensors[1].chunks[0].key, "flip")
    sub, target = subscriber(cfg, store)  # a new replica: keyframe paths only
    assert await sub.update_to(5)
    assert sub.last_path == "keyframe v1, delta v1->v2, delta v2->v3, delta v3->v4, delta v4->v5"
    assert_same_bits(dict(target.module.state_dict()), w[5])
    pub.close()
    sub.close()


async def test_no_path_left_fails_cleanly_and_applies_nothing(cfg, store):
    w = states(3)
    pub = await publish(cfg, store, w, 3)  # keyframe v1 only
    sub, target = subscriber(cfg, store)
    await sub.update_to(2)
    await damage(store, manifest_key(MODEL, 3, "delta"))
    with pytest.raises(UpdateFailed) as err:
        await sub.update_to(3)
    # both paths were tried and named
    assert "delta path" in str(err.value) and "keyframe v1 path" in str(err.value)
    assert sub.version == 2 and sub.healthy
    assert_same_bits(dict(target.module.state_dict()), w[2])
    pub.close()
    sub.close()


async def test_unknown_manifest_format_falls_back(cfg, store):
    w = states(4)
    pub = await publish(cfg, store, w, 3)
    sub, target = subscriber(cfg, store)
    await sub.update_to(3)
    await pub.publish(4, w[4])
    key = manifest_key(MODEL, 4, "delta")
    await store.put(key, (await store.get(key)).replace(b'"format":1', b'"format":99'))
    assert await sub.update_to(4)
    assert sub.last_path == "keyframe v4"
    assert_same_bits(dict(target.module.state_dict()), w[4])
    pub.close()
    sub.close()


@pytest.mark.parametrize("same_weights", [False, True])
async def test_two_publishers_of_one_version_never_leave_a_mix(cfg, store, same_weights):
    """Deterministic chunk keys and an unconditional manifest write used to leave a
    permanent mix of both publishers' chunks."""
    w = states(2)
    other = optimizer_like_step(w[1], 77)
    a, b = WeightPublisher(cfg, MODEL, store), WeightPublisher(cfg, MODEL, store)
    await a.publish(1, w[1])
    await b.publish(1, w[1])  # same weights: adopted by b as its base
    results = await asyncio.gather(
        a.publish(2, w[2]), b.publish(2, w[2] if same_weights else other), return_exceptions=True
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    if same_weights:
        assert errors == []
    else:
        assert len(errors) == 1 and isinstance(errors[0], WeightConflict), results
        assert "published concurrently" in str(errors[0]) or "already stored" in str(errors[0])
    winner = w[2] if same_weights or isinstance(results[1], BaseException) else other
    recon = await load_version(store, MODEL, 2)
    assert_same_bits(recon.tensors, winner)
    # every stored chunk of v2 belongs to the winning manifest: no mix, no leftovers
    manifest = await cat.ManifestReader(store, MODEL).get(2, "delta")
    referenced = {c.key for t in manifest.tensors for c in t.chunks}
    stored = set(await store.list(f"{MODEL}/chunks/v{2:012d}-delta/"))
    assert stored == referenced
    a.close()
    b.close()


async def test_announced_hash_is_checked(cfg, store):
    """The subscriber used to apply whatever the store held under an announcement."""
    w = states(2)
    pub = await publish(cfg, store, w, 2)
    sub, target = subscriber(cfg, store)
    await sub.update_to(1)
    with pytest.raises(UpdateFailed, match="the trainer announced deadbeef"):
        await sub.update_to(2, "deadbeef")
    assert sub.version == 1
    assert_same_bits(dict(target.module.state_dict()), w[1])
    assert await sub.update_to(2, state_dict_hash(w[2]))
    assert_same_bits(dict(target.module.state_dict()), w[2])
    pub.close()
    sub.close()


def test_wrong_dtype_or_shape_is_refused_before_any_copy():
    """copy_ used to cast a wrong dtype silently."""
    module = Toy()
    state = initial_state()
    apply_to_module(module, state)
    before = {n: t.clone() for n, t in module.state_dict().items()}
    new = optimizer_like_step(state, 9)
    with pytest.raises(WeightsRefused, match=r"proj.weight: module holds dtype torch.bfloat16, update has torch.float32"):
        apply_to_module(module, {**new, "proj.weight": new["proj.weight"].float()})
    with pytest.raises(WeightsRefused, match=r"half_buf: module holds shape \(40, 3\)"):
        apply_to_module(module, {**new, "half_buf": torch.zeros(3, 40, dtype=torch.float16)})
    assert_same_bits(dict(module.state_dict()), before)


def test_exact_widening_passes_and_narrowing_is_refused():
    """vLLM CPU on AVX-512 keeps the fused q/k/v bias in float32 while the trainer
    publishes bfloat16: bf16/fp16 into fp32 is exact and must pass (the samplers of
    those machines applied no update at all when it did not)."""
    from syncer.apply import dtype_fits

    assert dtype_fits(torch.float32, torch.bfloat16) and dtype_fits(torch.float32, torch.float16)
    assert dtype_fits(torch.bfloat16, torch.bfloat16) and dtype_fits(torch.int64, torch.int64)
    assert not dtype_fits(torch.bfloat16, torch.float32)
    assert not dtype_fits(torch.bfloat16, torch.float16)  # same size, different values
    assert not dtype_fits(torch.float16, torch.bfloat16)
    assert not dtype_fits(torch.float32, torch.int16) and not dtype_fits(torch.int32, torch.int16)

    module = torch.nn.Linear(4, 3)  # float32 parameters
    update = {"weight": torch.randn(3, 4).to(torch.bfloat16), "bias": torch.randn(3).to(torch.bfloat16)}
    apply_to_module(module, update)
    assert torch.equal(module.weight, update["weight"].float()) and torch.equal(module.bias, update["bias"].float())


async def test_failed_apply_marks_the_replica_unhealthy_until_repaired(cfg, tmp_path):
    store = LocalStore(tmp_path / "weights")
    w = states(2)
    pub = await publish(cfg, store, w, 2)
    sub, target = subscriber(cfg, store)
    await sub.update_to(1)
    real_apply = target.apply_weights
    failing = True

    async def half_then_fail(tensors, version):
        if failing:
            first = dict(list(tensors.items())[:2])
            await real_apply(first, version)  # some tensors written, then the engine breaks
            raise RuntimeError("engine died mid-update")
        return await real_apply(tensors, version)

    target.apply_weights = half_then_fail
    with pytest.raises(RuntimeError, match="mid-update"):
        await sub.update_to(2)
    assert not sub.healthy
    assert sub.version == 1
    # a refused update (nothing written) does not make a healthy replica unhealthy,
    # and an update of the same version repairs a dirty one
    failing = False
    assert await sub.update_to(1)  # repair at the version it holds: everything resent
    assert sub.healthy
    assert_same_bits(dict(target.module.state_dict()), w[1])
    assert await sub.update_to(2)
    assert_same_bits(dict(target.module.state_dict()), w[2])
    pub.close()
    sub.close()


async def test_refused_apply_keeps_the_replica_healthy(cfg, tmp_path):
    store = LocalStore(tmp_path / "weights")
    w = states(1)
    pub = await publish(cfg, store, w, 1)
    module = Toy()
    module.proj = torch.nn.Linear(64, 97, dtype=torch.bfloat16)  # an engine of another shape
    sub = WeightSubscriber(cfg, MODEL, store, ModuleTarget(module))
    with pytest.raises(WeightsRefused, match=r"proj\.(weight|bias): module holds shape .* more problems"):
        await sub.update_to(1)
    assert sub.healthy and sub.version == -1
    pub.close()
    sub.close()


async def test_orphans_are_garbage_collected(cfg, store):
    """Chunks of a publish that never got a manifest, temp files and killed multipart
    uploads used to stay forever."""
    w = states(2)
    pub = await publish(cfg, store, w, 2)
    orphans = [chunk_key(MODEL, 3, "delta", 0, 0, "crashed"), chunk_key(MODEL, 2, "delta", 1, 0, "lost")]
    for key in orphans:
        await store.put(key, b"leftover")
    if isinstance(store, LocalStore):
        tmp = store.root / MODEL / "chunks" / ".00000-0000.0123abcd.tmp"
        tmp.write_bytes(b"half")
    else:
        upload = await store.client.create_multipart_upload(Bucket=store.bucket, Key=store._full(f"{MODEL}/chunks/big"))
        await store.client.upload_part(Bucket=store.bucket, Key=store._full(f"{MODEL}/chunks/big"),
                                       UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024)
    before = set(await store.list(f"{MODEL}/"))

    young = await cat.find_garbage(store, MODEL, grace_s=3600)  # might be a publish in flight
    assert young.chunks == []
    if isinstance(store, LocalStore):
        # (moto reports a fixed 2010 "Initiated" for every multipart upload, so the
        # grace period of uploads can only be checked against a real S3)
        assert young.leftovers == []

    garbage = await cat.collect_garbage(store, MODEL, grace_s=0)
    assert sorted(garbage.chunks) == sorted(orphans)
    assert len(garbage.leftovers) == 1
    assert set(await store.list(f"{MODEL}/")) == before - set(orphans)
    if isinstance(store, LocalStore):
        assert not tmp.exists()
    else:
        assert (await store.client.list_multipart_uploads(Bucket=store.bucket)).get("Uploads", []) == []
    assert_same_bits((await load_version(store, MODEL, 2)).tensors, w[2])  # nothing needed was touched
    pub.close()


async def test_manifest_cache_is_bounded(cfg, tmp_path):
    store = LocalStore(tmp_path / "weights")
    w = states(6)
    small = msgspec.structs.replace(cfg, manifest_cache=3)
    pub = await publish(small, store, w, 6)
    sub, target = subscriber(small, store)
    for v in range(1, 7):
        await sub.update_to(v)
    assert sub._reader.cached <= 3
    assert_same_bits(dict(target.module.state_dict()), w[6])
    pub.close()
    sub.close()


def test_keyframes_come_often_enough_for_the_staleness_bound():
    """keyframe_every 10 with max_staleness 4 let one bad delta stall training."""
    cfg = SyncerConfig(keyframe_every=10)
    assert keyframe_cadence(cfg, max_staleness=4, publish_every=1).keyframe_every == 4
    assert keyframe_cadence(cfg, max_staleness=4, publish_every=2).keyframe_every == 2
    assert keyframe_cadence(cfg, max_staleness=1, publish_every=3).keyframe_every == 1
    assert keyframe_cadence(cfg, max_staleness=40, publish_every=1) is cfg  # already often enough
    assert keyframe_cadence(cfg, max_staleness=4, publish_every=0) is cfg  # never publishes
