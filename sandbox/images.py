"""The image store of a sandbox host: OCI images as shared, read-only sandbox roots.

``await store.ensure(ref)`` returns an :class:`ImageRoot`: the image fetched with skopeo
(:mod:`sandbox.image_fetch`), every blob's digest checked, unpacked once with umoci
(:mod:`sandbox.image_unpack`) into ``<cache>/roots/<manifest sha256>``, content
addressed: two references to the same manifest share one root, and every session of an
image uses the same read-only tree (each session writes only to its own copy-on-write
layer over the image's working directory, :mod:`sandbox.image_workspace`).

Cache. ``index.json`` in the cache folder lists each unpacked image (its references,
size, Env, WorkingDir, last use). Unpacked roots stay under ``max_cache_bytes``: adding
one evicts the least recently used images that no session holds; an image that cannot
fit is refused (``ImageError``, "cache full"). Sessions hold their image
(:meth:`ImageStore.hold`: a shared ``flock`` on the root's lock file, so a ``rollway
images prune`` in another process skips it too). At most ``max_concurrent_unpacks``
pulls and unpacks run at once in a process, one per reference across processes (an
exclusive ``flock`` per reference), and a reference being pulled is pulled once however
many sessions ask.

Errors name the image: :class:`ImageError` with ``kind`` 'missing' (no such image or
source), 'digest' (a blob does not match its digest: a corrupt layer), 'auth' (the
registry wants credentials or refused them: ``sandbox.images.auth_file``), 'cache_full',
'fetch' (anything else). The service answers them as infrastructure failures (HTTP 503),
never as a task the policy failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import msgspec
import structlog

from sandbox.config import ImageConfig
from sandbox.image_fetch import FetchError, fetch, tree_bytes, verify_layout
from sandbox.image_unpack import unpack

log = structlog.get_logger(__name__)

INDEX_FILE = "index.json"


class ImageError(RuntimeError):
    """An image could not be provided; the message names it and says why."""

    def __init__(self, ref: str, reason: str, kind: str = "fetch") -> None:
        super().__init__(f"image {ref!r}: {reason}")
        self.ref = ref
        self.reason = reason
        self.kind = kind


class ImageRoot(msgspec.Struct, frozen=True, kw_only=True):
    """An unpacked image, ready to be a sandbox's ``/``."""

    ref: str
    digest: str  # sha256:<hex> of the manifest
    rootfs: str  # absolute host path of the read-only root
    env: dict[str, str] = {}  # the image config's Env
    workdir: str = ""  # the image config's WorkingDir


class CachedImage(msgspec.Struct, kw_only=True):
    digest: str
    refs: list[str]
    size_bytes: int
    blob_bytes: int = 0
    layers: int = 0
    env: dict[str, str] = {}
    workdir: str = ""
    pulled_at: float = 0.0
    last_used: float = 0.0
    fetch_s: float = 0.0
    unpack_s: float = 0.0


class _Index(msgspec.Struct):
    images: dict[str, CachedImage] = {}  # by manifest hex digest
    refs: dict[str, str] = {}  # reference -> manifest hex digest


def default_cache_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/cache/rollway/images")
    return Path(os.path.expanduser("~/.cache/rollway/images"))


def _hex(digest: str) -> str:
    return digest.split(":", 1)[1]


def _ref_key(ref: str) -> str:
    return hashlib.sha256(ref.encode()).hexdigest()[:32]


def _rmtree(path: Path) -> None:
    """Remove a tree, also one unpacked rootless (directories without write permission)."""

    def fix(func, p, exc_info):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700) if os.path.isdir(p) and not os.path.islink(p) else None
            func(p)

    if path.exists() or path.is_symlink():
        shutil.rmtree(path, onerror=fix)


class ImageStore:
    """One per sandbox host folder; safe to share between the service and ``rollway images``."""

    def __init__(self, cfg: ImageConfig | None = None) -> None:
        self.cfg = cfg or ImageConfig()
        self.dir = Path(self.cfg.cache_dir) if self.cfg.cache_dir else default_cache_dir()
        self._made = False
        self._unpacks = asyncio.Semaphore(self.cfg.max_concurrent_unpacks)
        self._pulling: dict[str, asyncio.Lock] = {}
        self._held: dict[str, tuple[int, object]] = {}
        # Holds and releases come from the loop and from worker threads at once (warm
        # trees made, sessions opened and released off the loop): a count updated by two
        # threads lost one, leaving an image pinned for good or unpinned while in use.
        self._held_lock = threading.Lock()
        self.pulls = 0  # fetch+unpack runs of this process (tests and benchmarks read it)

    # --- index ---------------------------------------------------------------------

    def _make_dirs(self) -> None:
        """The cache folders, made on first use (a service that never meets an image task
        leaves no trace)."""
        if not self._made:
            for sub in ("", "roots", "tmp", "locks"):
                (self.dir / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
            self._made = True

    @contextlib.contextmanager
    def _locked_index(self):
        """The index, under an exclusive lock, written back when the block ends cleanly."""
        self._make_dirs()
        with open(self.dir / "locks" / "index.lock", "ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            index = self._read_index()
            yield index
            tmp = self.dir / f".{INDEX_FILE}.{uuid.uuid4().hex[:8]}"
            tmp.write_bytes(msgspec.json.encode(index))
            os.replace(tmp, self.dir / INDEX_FILE)

    def _read_index(self) -> _Index:
        try:
            return msgspec.json.decode((self.dir / INDEX_FILE).read_bytes(), type=_Index)
        except FileNotFoundError:
            return _Index()
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("image_index_unreadable", path=str(self.dir / INDEX_FILE), error=str(exc))
            return _Index()

    def root_path(self, digest: str) -> Path:
        return self.dir / "roots" / _hex(digest)

    def _root_of(self, ref: str, index: _Index) -> ImageRoot | None:
        hexd = index.refs.get(ref)
        image = index.images.get(hexd or "")
        if image is None or not (self.dir / "roots" / hexd).is_dir():
            return None
        return ImageRoot(ref=ref, digest=image.digest, rootfs=str(self.dir / "roots" / hexd),
                         env=dict(image.env), workdir=image.workdir)

    def lookup(self, ref: str) -> ImageRoot | None:
        """The unpacked root of ``ref`` when it is in the cache (no fetch)."""
        return self._root_of(ref, self._read_index())

    def list(self) -> list[CachedImage]:
        index = self._read_index()
        return sorted(index.images.values(), key=lambda i: i.last_used, reverse=True)

    # --- ensure --------------------------------------------------------------------

    async def ensure(self, ref: str, *, source: str = "") -> ImageRoot:
        """The image's root, fetched and unpacked first when it is not cached yet.
        ``source``: fetch from there and keep the image under the name ``ref`` (an
        ``oci:``/``docker-archive:`` build output registered under the name tasks use)."""
        self._make_dirs()
        root = await asyncio.to_thread(self._touch, ref)
        if root is not None:
            return root
        lock = self._pulling.setdefault(ref, asyncio.Lock())
        async with lock:
            root = await asyncio.to_thread(self._touch, ref)
            if root is not None:
                return root
            async with self._unpacks:
                # One pull of a reference across processes on this host.
                with open(self.dir / "locks" / f"ref-{_ref_key(ref)}.lock", "ab") as ref_lock:
                    await asyncio.to_thread(fcntl.flock, ref_lock, fcntl.LOCK_EX)
                    root = await asyncio.to_thread(self._touch, ref)
                    if root is not None:
                        return root
                    return await self._pull(ref, source or ref)

    def _touch(self, ref: str) -> ImageRoot | None:
        index = self._read_index()
        root = self._root_of(ref, index)
        if root is not None and time.time() - index.images[_hex(root.digest)].last_used > 30:
            with self._locked_index() as index:
                image = index.images.get(_hex(root.digest))
                if image is not None:
                    image.last_used = time.time()
        return root

    async def _pull(self, ref: str, source: str) -> ImageRoot:
        work = self.dir / "tmp" / uuid.uuid4().hex
        work.mkdir(mode=0o700)
        try:
            started = time.monotonic()
            try:
                await fetch(source, work / "layout", policy=self.cfg.policy, timeout_s=self.cfg.pull_timeout_s,
                            registries_conf=self.cfg.registries_conf, auth_file=self.cfg.auth_file)
                info = await asyncio.to_thread(verify_layout, work / "layout")
            except FetchError as exc:
                raise ImageError(ref, _reason(exc), exc.kind) from None
            except TimeoutError:
                raise ImageError(ref, f"fetch took longer than {self.cfg.pull_timeout_s}s", "fetch") from None
            fetched = time.monotonic()
            hexd = _hex(info.digest)
            if (self.dir / "roots" / hexd).is_dir():
                # Another reference to the same manifest: share its root.
                with self._locked_index() as index:
                    image = index.images.get(hexd)
                    if image is not None:
                        index.refs[ref] = hexd
                        if ref not in image.refs:
                            image.refs.append(ref)
                        image.last_used = time.time()
                root = self.lookup(ref)
                if root is not None:
                    return root
            if info.blob_bytes > self.cfg.max_cache_bytes:
                raise ImageError(ref, f"cache full: its layers alone are {info.blob_bytes} bytes, over "
                                      f"sandbox.images.max_cache_bytes = {self.cfg.max_cache_bytes}", "cache_full")
            try:
                await unpack(work / "layout", work / "rootfs", timeout_s=self.cfg.pull_timeout_s)
            except FetchError as exc:
                raise ImageError(ref, _reason(exc), exc.kind) from None
            size = await asyncio.to_thread(tree_bytes, work / "rootfs")
            unpacked = time.monotonic()
            image = CachedImage(
                digest=info.digest, refs=[ref], size_bytes=size, blob_bytes=info.blob_bytes, layers=info.layers,
                env=info.env, workdir=info.workdir, pulled_at=time.time(), last_used=time.time(),
                fetch_s=round(fetched - started, 3), unpack_s=round(unpacked - fetched, 3),
            )
            await asyncio.to_thread(self._admit, ref, image, work / "rootfs")
            self.pulls += 1
            log.info("image_ready", ref=ref, digest=info.digest, size_bytes=size, layers=info.layers,
                     fetch_s=image.fetch_s, unpack_s=image.unpack_s)
            root = self.lookup(ref)
            assert root is not None
            return root
        finally:
            await asyncio.to_thread(_rmtree, work)

    def _admit(self, ref: str, image: CachedImage, rootfs: Path) -> None:
        """Make room (LRU, unheld images only) and move the unpacked root into place."""
        hexd = _hex(image.digest)
        with self._locked_index() as index:
            used = sum(i.size_bytes for i in index.images.values())
            for victim in sorted(index.images.values(), key=lambda i: i.last_used):
                if used + image.size_bytes <= self.cfg.max_cache_bytes:
                    break
                if self._evict(index, _hex(victim.digest)):
                    used -= victim.size_bytes
            fits = used + image.size_bytes <= self.cfg.max_cache_bytes
            if fits:
                os.rename(rootfs, self.dir / "roots" / hexd)
                index.images[hexd] = image
                index.refs[ref] = hexd
        if not fits:
            raise ImageError(ref, f"cache full: the unpacked image needs {image.size_bytes} bytes and "
                                  f"{used} of sandbox.images.max_cache_bytes = {self.cfg.max_cache_bytes} are "
                                  f"taken by images in use", "cache_full")

    def _evict(self, index: _Index, hexd: str) -> bool:
        """Remove one image unless a session (of any process) holds it; under the index lock."""
        with open(self.dir / "locks" / f"root-{hexd}.lock", "ab") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            image = index.images.pop(hexd, None)
            for ref in image.refs if image else []:
                index.refs.pop(ref, None)
            _rmtree(self.dir / "roots" / hexd)
            log.info("image_evicted", digest=image.digest if image else hexd, refs=image.refs if image else [])
            return True

    # --- holding and pruning ---------------------------------------------------------

    def hold(self, root: ImageRoot) -> None:
        """Keep ``root`` from eviction until :meth:`release` (counted; a shared flock)."""
        hexd = _hex(root.digest)
        with self._held_lock:
            count, lock = self._held.get(hexd, (0, None))
            if lock is None:
                self._make_dirs()
                lock = open(self.dir / "locks" / f"root-{hexd}.lock", "ab")
                fcntl.flock(lock, fcntl.LOCK_SH)
            self._held[hexd] = (count + 1, lock)

    def release(self, root: ImageRoot) -> None:
        hexd = _hex(root.digest)
        with self._held_lock:
            count, lock = self._held.get(hexd, (0, None))
            if count <= 1:
                self._held.pop(hexd, None)
                if lock is not None:
                    lock.close()
            else:
                self._held[hexd] = (count - 1, lock)

    async def acquire(self, ref: str) -> ImageRoot:
        """:meth:`ensure` and :meth:`hold` in one step (an eviction between them is retried)."""
        for _ in range(3):
            root = await self.ensure(ref)
            self.hold(root)
            if Path(root.rootfs).is_dir():
                return root
            self.release(root)
        raise ImageError(ref, "evicted again and again while being acquired; raise sandbox.images.max_cache_bytes",
                         "cache_full")

    def prune(self, refs: list[str] | None = None) -> list[CachedImage]:
        """Remove the images of ``refs`` (all when None) that no session holds; returns them."""
        removed = []
        with self._locked_index() as index:
            wanted = set(index.images) if refs is None else {index.refs[r] for r in refs if r in index.refs}
            for hexd in sorted(wanted):
                image = index.images.get(hexd)
                if image is not None and self._evict(index, hexd):
                    removed.append(image)
        return removed


def _reason(exc: FetchError) -> str:
    if exc.kind == "missing":
        return f"not found: {exc}"
    if exc.kind == "digest":
        return f"corrupt: {exc}"
    if exc.kind == "auth":
        return f"the registry refused the credentials (sandbox.images.auth_file): {exc}"
    return str(exc)
