"""Object stores: a local folder (``file://``) and S3 or anything speaking it (``s3://``).

Both give the same small async interface. ``put`` is atomic: a reader sees the whole
object or none of it (rename on a filesystem; S3 objects appear complete by design,
multipart uploads only on completion). Keys are ``/``-separated relative paths.

``put_if_absent`` is the conditional create a commit point needs (a version's
manifest): of two writers of one key exactly one wins, the other learns it lost.
``leftovers`` / ``delete_leftovers`` find and remove what crashed writers left behind
(temporary files, unfinished multipart uploads) once they are older than a grace period.

Use as ``async with open_store(url, cfg) as store`` (S3 clients hold connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Iterable
from urllib.parse import urlparse

import structlog

from syncer.config import SyncerConfig

log = structlog.get_logger(__name__)


class ObjectNotFound(KeyError):
    """The key does not exist in the store."""


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid object key {key!r}")
    return key


class ObjectStore:
    """Interface. ``url_for(key)`` names an object for humans and events."""

    url: str

    async def put(self, key: str, data: bytes | memoryview) -> None:
        raise NotImplementedError

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Create ``key`` only if it does not exist; False (nothing written) if it did."""
        raise NotImplementedError

    async def get(self, key: str) -> bytes:
        raise NotImplementedError

    async def modified(self, key: str) -> float:
        """Last-modified time (seconds since the epoch); ObjectNotFound when absent."""
        raise NotImplementedError

    async def leftovers(self, prefix: str, older_than_s: float) -> list[str]:
        """Incomplete writes under ``prefix`` (temporary files, unfinished multipart
        uploads) started more than ``older_than_s`` ago, as opaque handles."""
        return []

    async def delete_leftovers(self, handles: Iterable[str]) -> int:
        return 0

    async def exists(self, key: str) -> bool:
        raise NotImplementedError

    async def list(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix``, sorted."""
        raise NotImplementedError

    async def delete(self, keys: Iterable[str]) -> int:
        """Delete these keys (missing ones are fine); returns how many were asked."""
        raise NotImplementedError

    def url_for(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def __aenter__(self) -> "ObjectStore":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class LocalStore(ObjectStore):
    """A folder. Writes go to a temporary file in the same folder, are fsynced, then
    renamed over the key, so a crash never leaves a half-written object."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"
        self.fsync = fsync

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def _durable_tmp(self, key: str, data: bytes | memoryview) -> tuple[Path, Path]:
        """``data`` in a fresh temporary file next to the key's path, fsynced (unless
        ``fsync`` is off): (the key's path, the temporary file)."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path, tmp

    def _put_sync(self, key: str, data: bytes | memoryview) -> None:
        path, tmp = self._durable_tmp(key, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await asyncio.to_thread(self._put_sync, key, data)

    def _put_if_absent_sync(self, key: str, data: bytes | memoryview) -> bool:
        path, tmp = self._durable_tmp(key, data)
        try:
            # link(2) fails when the name exists: an atomic create-if-absent of the
            # whole, already durable file (rename would silently replace).
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            return True
        finally:
            tmp.unlink(missing_ok=True)

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        return await asyncio.to_thread(self._put_if_absent_sync, key, data)

    async def modified(self, key: str) -> float:
        try:
            return self._path(key).stat().st_mtime
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url_for(key)} does not exist") from None

    def _leftovers_sync(self, prefix: str, older_than_s: float) -> list[str]:
        folder = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not folder.is_dir():
            return []
        cutoff = time.time() - older_than_s
        out = []
        for dirpath, _, files in os.walk(folder):
            for name in files:
                if not (name.startswith(".") and name.endswith(".tmp")):
                    continue
                path = Path(dirpath, name)
                key = path.relative_to(self.root).as_posix()
                try:
                    old = path.stat().st_mtime < cutoff
                except FileNotFoundError:
                    continue  # its writer just finished or cleaned up
                if key.startswith(prefix) and old:
                    out.append(key)
        return sorted(out)

    async def leftovers(self, prefix: str, older_than_s: float) -> list[str]:
        return await asyncio.to_thread(self._leftovers_sync, prefix, older_than_s)

    async def delete_leftovers(self, handles: Iterable[str]) -> int:
        handles = list(handles)
        for key in handles:
            if not Path(key).name.endswith(".tmp"):
                raise ValueError(f"{key!r} is not a temporary file")
        await asyncio.to_thread(self._delete_sync, handles)
        return len(handles)

    def _get_sync(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url_for(key)} does not exist") from None

    async def get(self, key: str) -> bytes:
        return await asyncio.to_thread(self._get_sync, key)

    async def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def _list_sync(self, prefix: str) -> list[str]:
        # Walk only the folder that contains the prefix.
        folder = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not folder.is_dir():
            return []
        out = []
        for dirpath, _, files in os.walk(folder):
            for name in files:
                if name.startswith(".") and name.endswith(".tmp"):
                    continue
                key = Path(dirpath, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)

    async def list(self, prefix: str) -> list[str]:
        return await asyncio.to_thread(self._list_sync, prefix)

    def _delete_sync(self, keys: list[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            parents.add(path.parent)
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            # Remove folders left empty (chunk folders of deleted versions).
            while parent != self.root and parent.is_dir():
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    async def delete(self, keys: Iterable[str]) -> int:
        keys = list(keys)
        await asyncio.to_thread(self._delete_sync, keys)
        return len(keys)


class S3Store(ObjectStore):
    """S3 through aioboto3. Credentials come from the usual AWS chain (environment,
    shared config, instance role); ``endpoint_url`` points at MinIO or another
    compatible store. Big objects go up as multipart uploads with their parts in
    parallel; at most ``max_concurrency`` requests run at once."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str = "",
        region: str = "",
        max_concurrency: int = 8,
        multipart_threshold: int = 16 * 1024 * 1024,
        part_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        if not bucket:
            raise ValueError("S3 store URL needs a bucket: s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url = endpoint_url or None
        self.region = region or None
        self.max_concurrency = max_concurrency
        self.multipart_threshold = max(multipart_threshold, part_bytes)
        self.part_bytes = part_bytes
        self._sem = asyncio.Semaphore(max_concurrency)
        self._stack: contextlib.AsyncExitStack | None = None
        self._client = None

    def _full(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    async def start(self) -> None:
        if self._client is not None:
            return
        import aioboto3
        from botocore.config import Config

        stack = contextlib.AsyncExitStack()
        session = aioboto3.Session()
        self._client = await stack.enter_async_context(
            session.client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=self.region,
                config=Config(
                    max_pool_connections=self.max_concurrency + 2,
                    retries={"max_attempts": 5, "mode": "standard"},
                ),
            )
        )
        self._stack = stack

    async def close(self) -> None:
        if self._stack is not None:
            stack, self._stack, self._client = self._stack, None, None
            await stack.aclose()

    @property
    def client(self):
        if self._client is None:
            raise RuntimeError("S3Store used before start(); use `async with open_store(...)`")
        return self._client

    async def ensure_bucket(self) -> None:
        """Create the bucket when it does not exist (MinIO/moto setups, tests)."""
        from botocore.exceptions import ClientError

        try:
            await self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            kwargs = {}
            if self.region and self.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
            await self.client.create_bucket(Bucket=self.bucket, **kwargs)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        data = bytes(data) if isinstance(data, memoryview) else data
        if len(data) <= self.multipart_threshold:
            async with self._sem:
                await self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data)
            return
        await self._put_multipart(self._full(key), data)

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """S3 conditional write (``If-None-Match: *``): 412 when the key exists.
        Used for manifests, which stay far below the multipart threshold."""
        from botocore.exceptions import ClientError

        data = bytes(data) if isinstance(data, memoryview) else data
        if len(data) > self.multipart_threshold:
            raise ValueError(f"put_if_absent of {len(data)} bytes: conditional writes are single-part here")
        async with self._sem:
            try:
                await self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data, IfNoneMatch="*")
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                    return False
                raise
        return True

    async def modified(self, key: str) -> float:
        from botocore.exceptions import ClientError

        async with self._sem:
            try:
                head = await self.client.head_object(Bucket=self.bucket, Key=self._full(key))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                    raise ObjectNotFound(f"{self.url_for(key)} does not exist") from None
                raise
        return head["LastModified"].timestamp()

    async def leftovers(self, prefix: str, older_than_s: float) -> list[str]:
        """Unfinished multipart uploads (a writer killed before complete/abort): their
        parts cost storage until aborted. Handles are ``key\x00upload_id``."""
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        cutoff = time.time() - older_than_s
        out = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        async with self._sem:
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                for upload in page.get("Uploads", []):
                    if upload["Initiated"].timestamp() < cutoff:
                        out.append(f"{self._relative(upload['Key'])}\x00{upload['UploadId']}")
        return sorted(out)

    async def delete_leftovers(self, handles: Iterable[str]) -> int:
        from botocore.exceptions import ClientError

        n = 0
        for handle in handles:
            key, upload_id = handle.split("\x00", 1)
            async with self._sem:
                try:
                    await self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._full(key),
                                                             UploadId=upload_id)
                except ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") != "NoSuchUpload":
                        raise
            n += 1
        return n

    async def _put_multipart(self, full_key: str, data: bytes) -> None:
        async with self._sem:
            upload = await self.client.create_multipart_upload(Bucket=self.bucket, Key=full_key)
        upload_id = upload["UploadId"]
        view = memoryview(data)

        async def part(number: int, start: int) -> dict:
            body = bytes(view[start : start + self.part_bytes])
            async with self._sem:
                answer = await self.client.upload_part(
                    Bucket=self.bucket, Key=full_key, UploadId=upload_id, PartNumber=number, Body=body
                )
            return {"PartNumber": number, "ETag": answer["ETag"]}

        try:
            parts = await asyncio.gather(
                *(part(i + 1, start) for i, start in enumerate(range(0, len(data), self.part_bytes)))
            )
            async with self._sem:
                await self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full_key, UploadId=upload_id, MultipartUpload={"Parts": list(parts)}
                )
        except BaseException:
            with contextlib.suppress(Exception):
                await self.client.abort_multipart_upload(Bucket=self.bucket, Key=full_key, UploadId=upload_id)
            raise

    async def get(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        async with self._sem:
            try:
                answer = await self.client.get_object(Bucket=self.bucket, Key=self._full(key))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise ObjectNotFound(f"{self.url_for(key)} does not exist") from None
                raise
            async with answer["Body"] as body:
                return await body.read()

    async def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        async with self._sem:
            try:
                await self.client.head_object(Bucket=self.bucket, Key=self._full(key))
                return True
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                    return False
                raise

    async def list(self, prefix: str) -> list[str]:
        if prefix.startswith("/") or ".." in prefix.split("/"):
            raise ValueError(f"invalid key prefix {prefix!r}")
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        keys: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        async with self._sem:
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                keys.extend(self._relative(obj["Key"]) for obj in page.get("Contents", []))
        return sorted(keys)

    async def delete(self, keys: Iterable[str]) -> int:
        full = [self._full(k) for k in keys]
        for start in range(0, len(full), 1000):  # DeleteObjects takes at most 1000 keys
            batch = full[start : start + 1000]
            async with self._sem:
                answer = await self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            errors = answer.get("Errors") or []
            if errors:
                raise RuntimeError(f"S3 delete failed for {len(errors)} keys, first: {errors[0]}")
        return len(full)


def open_store(url: str, cfg: SyncerConfig | None = None) -> ObjectStore:
    """``file:///abs``, ``file://relative`` or ``s3://bucket/prefix``."""
    cfg = cfg or SyncerConfig()
    parsed = urlparse(url)
    if parsed.scheme == "file":
        path = url[len("file://") :]
        if not path:
            raise ValueError(f"store URL {url!r} has no path")
        return LocalStore(path)
    if parsed.scheme == "s3":
        return S3Store(
            parsed.netloc,
            parsed.path,
            endpoint_url=cfg.s3_endpoint_url,
            region=cfg.s3_region,
            max_concurrency=cfg.max_concurrency,
            multipart_threshold=cfg.s3_multipart_threshold,
            part_bytes=cfg.s3_part_bytes,
        )
    raise ValueError(f"unsupported store URL {url!r}: use file://PATH or s3://BUCKET/PREFIX")
