"""What versions a store holds, how to reach one, and what retention may delete.

A version v is reachable from a replica at version u by following delta manifests
backwards from v (each names its ``base_version``) until u is met. A replica without
usable weights (new, missed versions, failed checksum) starts instead from the
newest keyframe at or before v and follows the deltas after it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import structlog

from syncer.manifest import (
    Manifest,
    chunk_prefix,
    chunks_prefix,
    decode_manifest,
    manifest_key,
    manifests_prefix,
    parse_manifest_key,
)
from syncer.store import ObjectNotFound, ObjectStore

log = structlog.get_logger(__name__)


class NoPath(LookupError):
    """The store holds no complete chain of manifests to the requested version."""


@dataclass
class Catalog:
    """Manifests present in the store for one model: version -> kinds."""

    model: str
    kinds: dict[int, set[str]] = field(default_factory=dict)

    @property
    def versions(self) -> list[int]:
        return sorted(self.kinds)

    @property
    def keyframes(self) -> list[int]:
        return sorted(v for v, k in self.kinds.items() if "full" in k)

    @property
    def latest(self) -> int:
        return max(self.kinds) if self.kinds else -1

    def has(self, version: int, kind: str) -> bool:
        return kind in self.kinds.get(version, ())

    def keyframe_at_or_before(self, version: int) -> int | None:
        frames = [v for v in self.keyframes if v <= version]
        return frames[-1] if frames else None


async def load_catalog(store: ObjectStore, model: str) -> Catalog:
    catalog = Catalog(model)
    for key in await store.list(manifests_prefix(model)):
        parsed = parse_manifest_key(key)
        if parsed:
            catalog.kinds.setdefault(parsed[0], set()).add(parsed[1])
    return catalog


class ManifestReader:
    """Reads and caches manifests (they never change once written). The cache keeps
    the ``max_cached`` most recently used: a long-lived sampler sees every version."""

    def __init__(self, store: ObjectStore, model: str, max_cached: int = 64) -> None:
        if max_cached < 1:
            raise ValueError("max_cached must be >= 1")
        self.store = store
        self.model = model
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple[int, str], Manifest] = OrderedDict()

    @property
    def cached(self) -> int:
        return len(self._cache)

    async def get(self, version: int, kind: str) -> Manifest:
        cached = self._cache.get((version, kind))
        if cached is not None:
            self._cache.move_to_end((version, kind))
            return cached
        key = manifest_key(self.model, version, kind)
        data = await self.store.get(key)
        manifest = decode_manifest(data, where=self.store.url_for(key))
        if manifest.version != version or manifest.kind != kind or manifest.model != self.model:
            raise ValueError(
                f"{self.store.url_for(key)} describes {manifest.model} v{manifest.version} "
                f"{manifest.kind}, not {self.model} v{version} {kind}"
            )
        self._cache[(version, kind)] = manifest
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return manifest

    def forget(self, version: int | None = None) -> None:
        if version is None:
            self._cache.clear()
        else:
            for key in [k for k in self._cache if k[0] == version]:
                del self._cache[key]


async def delta_chain(reader: ManifestReader, catalog: Catalog, start: int, target: int) -> list[Manifest]:
    """Delta manifests leading from version ``start`` to ``target`` (in apply order).
    Empty when start == target; raises NoPath when the chain is broken."""
    chain: list[Manifest] = []
    v = target
    while v != start:
        if v < start or not catalog.has(v, "delta"):
            raise NoPath(f"no delta chain from v{start} to v{target} (missing delta for v{v})")
        try:
            manifest = await reader.get(v, "delta")
        except ObjectNotFound as exc:
            raise NoPath(f"delta manifest of v{v} disappeared: {exc}") from None
        chain.append(manifest)
        v = manifest.base_version
    chain.reverse()
    return chain


@dataclass
class Plan:
    target: int
    keyframe: Manifest | None  # None: start from the replica's current weights
    deltas: list[Manifest]

    @property
    def manifests(self) -> list[Manifest]:
        return ([self.keyframe] if self.keyframe else []) + self.deltas

    def describe(self) -> str:
        parts = [f"keyframe v{self.keyframe.version}"] if self.keyframe else []
        parts += [f"delta v{m.base_version}->v{m.version}" for m in self.deltas]
        return ", ".join(parts) or "nothing"


async def keyframe_plan(reader: ManifestReader, catalog: Catalog, target: int, frame: int | None = None) -> Plan:
    """Keyframe ``frame`` (default: the newest at or before ``target``) plus deltas."""
    if frame is None:
        frame = catalog.keyframe_at_or_before(target)
    if frame is None:
        raise NoPath(f"no keyframe at or before v{target} in the store")
    if frame > target or not catalog.has(frame, "full"):
        raise NoPath(f"v{frame} is not a keyframe at or before v{target}")
    try:
        keyframe = await reader.get(frame, "full")
    except ObjectNotFound as exc:
        raise NoPath(f"keyframe v{frame} disappeared: {exc}") from None
    return Plan(target, keyframe, await delta_chain(reader, catalog, frame, target))


def versions_to_delete(catalog: Catalog, keep_keyframes: int) -> list[int]:
    """Versions older than the oldest of the newest ``keep_keyframes`` keyframes."""
    frames = catalog.keyframes
    if len(frames) <= keep_keyframes:
        return []
    oldest_kept = frames[-keep_keyframes]
    return [v for v in catalog.versions if v < oldest_kept]


async def delete_versions(store: ObjectStore, model: str, catalog: Catalog, versions: list[int]) -> int:
    """Delete manifests first (the version vanishes atomically for readers), then chunks."""
    if not versions:
        return 0
    manifests = [manifest_key(model, v, k) for v in versions for k in sorted(catalog.kinds.get(v, ()))]
    await store.delete(manifests)
    chunks: list[str] = []
    for v in versions:
        for kind in ("full", "delta"):
            chunks.extend(await store.list(chunk_prefix(model, v, kind)))
    await store.delete(chunks)
    for v in versions:
        catalog.kinds.pop(v, None)
    log.info("retention deleted versions", model=model, versions=versions, objects=len(manifests) + len(chunks))
    return len(manifests) + len(chunks)


@dataclass
class Garbage:
    chunks: list[str] = field(default_factory=list)  # referenced by no manifest
    leftovers: list[str] = field(default_factory=list)  # temp files, unfinished multipart uploads

    @property
    def count(self) -> int:
        return len(self.chunks) + len(self.leftovers)


async def find_garbage(store: ObjectStore, model: str, grace_s: float) -> Garbage:
    """Objects no version needs: chunks no manifest references (a publish that crashed
    before its manifest, or lost the race for it) and incomplete writes, all older than
    ``grace_s`` so a publish still in flight is never touched. Chunks of a version whose
    manifest cannot be read are kept (unknown is not unreferenced)."""
    catalog = await load_catalog(store, model)
    reader = ManifestReader(store, model, max_cached=1)
    referenced: set[str] = set()
    unreadable: set[int] = set()
    for version in catalog.versions:
        for kind in sorted(catalog.kinds[version]):
            try:
                manifest = await reader.get(version, kind)
            except (ObjectNotFound, ValueError) as exc:
                unreadable.add(version)
                log.warning("manifest unreadable; its version's chunks are kept", version=version, kind=kind,
                            error=str(exc))
                continue
            referenced.update(c.key for t in manifest.tensors for c in t.chunks)
    cutoff = time.time() - grace_s
    garbage = Garbage()
    for key in await store.list(chunks_prefix(model)):
        if key in referenced:
            continue
        parsed = _chunk_version(key)
        if parsed is not None and parsed in unreadable:
            continue
        try:
            if await store.modified(key) >= cutoff:
                continue  # possibly a publish in flight
        except ObjectNotFound:
            continue
        garbage.chunks.append(key)
    garbage.leftovers = await store.leftovers(f"{model}/", grace_s)
    return garbage


def _chunk_version(key: str) -> int | None:
    # <model>/chunks/v000000000042-delta/...
    parts = key.split("/")
    if len(parts) < 3 or not parts[2].startswith("v"):
        return None
    try:
        return int(parts[2][1:13])
    except ValueError:
        return None


async def collect_garbage(store: ObjectStore, model: str, grace_s: float) -> Garbage:
    """Delete what :func:`find_garbage` finds; returns it."""
    garbage = await find_garbage(store, model, grace_s)
    if garbage.chunks:
        await store.delete(garbage.chunks)
    if garbage.leftovers:
        await store.delete_leftovers(garbage.leftovers)
    if garbage.count:
        log.info("garbage collected", model=model, chunks=len(garbage.chunks), leftovers=len(garbage.leftovers))
    return garbage
