"""Object stores: the local folder and S3 (moto over real HTTP) behave the same."""

from __future__ import annotations

import os
import uuid

import pytest

from syncer.config import SyncerConfig
from syncer.store import LocalStore, ObjectNotFound, S3Store, open_store


@pytest.fixture(params=["file", "s3"])
async def store(request, tmp_path):
    if request.param == "file":
        async with LocalStore(tmp_path / "store") as s:
            yield s
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        cfg = SyncerConfig(
            s3_endpoint_url=endpoint, s3_multipart_threshold=5 * 1024 * 1024, s3_part_bytes=5 * 1024 * 1024,
            max_concurrency=4,
        )
        async with open_store(f"s3://b{uuid.uuid4().hex[:12]}/some/prefix", cfg) as s:
            await s.ensure_bucket()
            yield s


async def test_put_get_list_delete(store):
    await store.put("m/manifests/a.json", b"{}")
    await store.put("m/chunks/v1/0000-0000", b"x" * 10)
    await store.put("m/chunks/v1/0000-0001", b"y" * 3)
    await store.put("other/thing", b"z")
    assert await store.get("m/chunks/v1/0000-0001") == b"yyy"
    assert await store.exists("m/manifests/a.json")
    assert not await store.exists("m/manifests/b.json")
    assert await store.list("m/chunks/") == ["m/chunks/v1/0000-0000", "m/chunks/v1/0000-0001"]
    assert await store.list("m/") == ["m/chunks/v1/0000-0000", "m/chunks/v1/0000-0001", "m/manifests/a.json"]
    # overwrite is atomic and complete
    await store.put("m/manifests/a.json", b'{"v": 2}')
    assert await store.get("m/manifests/a.json") == b'{"v": 2}'
    assert await store.delete(["m/chunks/v1/0000-0000", "m/chunks/v1/0000-0001", "m/never-existed"]) == 3
    assert await store.list("m/chunks/") == []
    with pytest.raises(ObjectNotFound):
        await store.get("m/chunks/v1/0000-0000")
    assert store.url_for("m/x").endswith("/m/x")


async def test_big_object_roundtrip(store):
    """11 MiB: a multipart upload (3 parts) on S3, a plain file locally."""
    data = os.urandom(11 * 1024 * 1024 + 17)
    await store.put("big/object", data)
    assert await store.get("big/object") == data


async def test_invalid_keys_are_refused(store):
    for key in ["", "/abs", "a/../b", "a//b"]:
        with pytest.raises(ValueError, match="invalid object key"):
            await store.put(key, b"x")


async def test_local_store_leaves_no_temporary_files(tmp_path):
    store = LocalStore(tmp_path)
    await store.put("a/b/c", b"123")
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["c"]
    await store.delete(["a/b/c"])
    assert not (tmp_path / "a").exists()  # empty folders are cleaned up


def test_open_store_urls(tmp_path):
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    s3 = open_store("s3://bucket/pre/fix/")
    assert isinstance(s3, S3Store) and s3.bucket == "bucket" and s3.prefix == "pre/fix"
    with pytest.raises(ValueError, match="unsupported store URL"):
        open_store("gs://bucket")
    with pytest.raises(ValueError, match="needs a bucket"):
        open_store("s3:///prefix")


async def test_s3_missing_bucket_is_a_clear_error(s3_endpoint):
    from botocore.exceptions import ClientError

    async with open_store(f"s3://nobucket{uuid.uuid4().hex[:8]}", SyncerConfig(s3_endpoint_url=s3_endpoint)) as store:
        with pytest.raises(ClientError, match="NoSuchBucket"):
            await store.put("k", b"v")
