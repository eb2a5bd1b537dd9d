"""Trainer side: turn a CPU state dict into a stored version and announce it.

``publish(version, state_dict, trainer_step)``:

1. checksum every tensor (worker threads) -> the version's ``weights_hash``;
2. decide full (every ``keyframe_every``-th version, and always after a restart) or
   delta (XOR against the last published version, which this object keeps a copy of);
   keyframes also get a delta when ``delta_with_keyframes``;
3. encode and upload chunk by chunk, at most ``max_concurrency`` chunks in flight,
   so memory beyond the kept base copy stays bounded by a few chunks;
4. create the manifest LAST and only if absent: only then does the version exist for
   readers. Chunks go under a folder unique to this publish attempt, so a second
   publisher of the same version never overwrites the winner's chunks; the loser
   deletes its own objects and gets ``WeightConflict`` (or, with the very same
   weights, adopts the winner's version);
5. publish ``WeightVersion`` on ``rollway.weights`` (when a Kafka producer is set);
6. after a keyframe, apply retention.

A version is a keyframe every ``keyframe_every`` versions, after a restart, and (with a
producer and ``keyframe_on_trouble``) when a sampler heartbeat reported a failed weight
update since the last keyframe (``syncer.health.TroubleWatch``). When no publish follows
such a report within ``keyframe_repair_after_s``, the newest version is stored again as
a keyframe and re-announced (``repair_keyframe``): same version, same weights hash.

Publishing a version that is already in the store with the same weights re-announces
it and adopts it as the base (a trainer replaying after a crash); with different
weights it is an error (``WeightConflict``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Mapping

import structlog

from bus import failpoints
from schemas import WeightVersion
from syncer import catalog as cat
from syncer.aio import gather_or_cancel
from syncer.config import SyncerConfig
from syncer.hashing import checksum, tensor_checksum, weights_hash
from syncer.manifest import ChunkRef, CodecInfo, Manifest, chunk_key, encode_manifest, manifest_key
from syncer.store import ObjectNotFound, ObjectStore
from syncer.tensor_codec import TensorPlan, encode_planned_chunk, plan_tensor

if TYPE_CHECKING:
    import torch

    from bus import EventProducer

log = structlog.get_logger(__name__)


class WeightConflict(ValueError):
    """A version is published again with different weights, or out of order."""


class WeightPublisher:
    def __init__(
        self,
        cfg: SyncerConfig,
        model: str,
        store: ObjectStore,
        producer: "EventProducer | None" = None,
        *,
        writer: str = "",
    ) -> None:
        self.cfg = cfg
        self.model = model
        # Names the writer in every attempt folder (the trainer's producer epoch): the
        # objects of a fenced trainer are told apart from its successor's.
        self.writer = writer
        self.store = store
        self.producer = producer
        self._pool = ThreadPoolExecutor(max_workers=cfg.zstd_threads, thread_name_prefix="syncer-encode")
        self._reader = cat.ManifestReader(store, model)
        # The last published version, kept to XOR the next one against.
        self._base: dict[str, "torch.Tensor"] | None = None
        self._base_checksums: dict[str, str] = {}
        self.base_version = -1
        self.keyframe_version = -1
        self._deltas_since_keyframe = 0
        self._lock = asyncio.Lock()
        self._watch = None
        if producer is not None and cfg.keyframe_on_trouble:
            from syncer.health import TroubleWatch

            self._watch = TroubleWatch(producer.cfg)
        self._last_keyframe_at = 0.0
        self._base_step = -1  # trainer_step of base_version
        self._base_delta_base = -1  # the base of base_version's delta, as announced
        self._repair_task: asyncio.Task | None = None
        self.repairs = 0  # versions stored again as keyframes (repair_keyframe)

    @property
    def watch(self):
        """The heartbeat watch (None without a producer or with keyframe_on_trouble off)."""
        return self._watch

    def close(self) -> None:
        # The watch's task finishes its cancellation on the running loop (asyncio.run
        # and test loops wait for cancelled tasks); aclose() waits for it here.
        if self._watch is not None:
            self._watch.cancel()
        if self._repair_task is not None:
            self._repair_task.cancel()
        self._pool.shutdown(wait=True)

    async def aclose(self) -> None:
        if self._repair_task is not None:
            self._repair_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._repair_task
            self._repair_task = None
        if self._watch is not None:
            await self._watch.close()
        self.close()

    def _start_watch(self) -> None:
        self._watch.start()
        if self._repair_task is None and self.cfg.keyframe_repair_after_s > 0:
            self._repair_task = asyncio.create_task(self._repair_loop(), name="syncer-keyframe-repair")

    async def _repair_loop(self) -> None:
        """Store the newest version again as a keyframe when a sampler reported trouble
        and no keyframe followed within ``keyframe_repair_after_s`` (module docstring)."""
        after = self.cfg.keyframe_repair_after_s
        watch = self._watch
        while True:
            await asyncio.sleep(min(5.0, max(0.1, after / 4)))
            if not watch.trouble_since(self._last_keyframe_at) or time.monotonic() - watch.trouble_noted < after:
                continue
            if self._lock.locked():
                continue  # a publish is under way: it makes the keyframe itself
            try:
                await self.repair_keyframe()
            except asyncio.CancelledError:
                raise
            except WeightConflict as exc:
                # Another trainer writes this model: the fencing of its next publish stops
                # this one; nothing to repair from here.
                log.error("keyframe repair refused: another publisher writes this model", error=str(exc))
                return
            except Exception as exc:  # store down, a fence: retried at the next trouble report
                self._last_keyframe_at = time.time()
                log.error("keyframe repair failed; retried when a sampler reports trouble again", error=str(exc))

    async def repair_keyframe(self) -> WeightVersion | None:
        """Store the newest published version again as a keyframe (same weights, same
        hash; only its ``full`` manifest is new) and re-announce it. None when there is
        nothing to repair: no version published by this object, or the newest version is
        a keyframe already (its manifest is immutable; the next version will be one)."""
        async with self._lock:
            if self._base is None:
                return None
            version = self.base_version
            self._last_keyframe_at = time.time()
            catalog = await cat.load_catalog(self.store, self.model)
            if catalog.latest > version:
                raise WeightConflict(f"{self.model} v{catalog.latest} is in the store; this publisher's newest is "
                                     f"v{version}: another publisher is writing")
            if catalog.has(version, "full"):
                log.warning("samplers report failed weight updates but the newest version is a keyframe already; "
                            "the next version will be one", model=self.model, version=version)
                return None
            # The delta's base as announced (its manifest may be the damaged object).
            delta_base = self._base_delta_base if catalog.has(version, "delta") else -1
            digest = weights_hash(_entries(self._base, self._base_checksums))
            attempt = (f"{self.writer}-" if self.writer else "") + uuid.uuid4().hex[:16]
            created: list[Manifest] = []
            try:
                manifest = await self._write(version, "full", self._base, self._base_checksums, digest,
                                             self._base_step, None, version, attempt, created)
            except WeightConflict:
                await self._withdraw(created)
                raise
            self.keyframe_version = version
            self._deltas_since_keyframe = 0
            event = self._event(manifest, self._base_step, delta_base)
            await self._announce(event)
            self.repairs += 1
            log.warning("newest version stored again as a keyframe: a sampler reported a failed weight update "
                        "and no publish followed", model=self.model, version=version,
                        replica=self._watch.trouble_replica if self._watch is not None else "",
                        stored_mb=round(manifest.stored_bytes / 1e6, 3))
            await self.apply_retention()
            return event

    async def publish(
        self,
        version: int,
        state_dict: Mapping[str, "torch.Tensor"],
        trainer_step: int = -1,
        *,
        owned: bool = False,
    ) -> WeightVersion:
        """Store and announce ``version``. ``owned=True`` hands the tensors over (the
        caller will not modify them), saving the copy kept as the next base."""
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        if not state_dict:
            raise ValueError("state_dict is empty")
        async with self._lock:
            return await self._publish(version, dict(state_dict), trainer_step, owned)

    async def _publish(self, version: int, state: dict, trainer_step: int, owned: bool) -> WeightVersion:
        t0 = time.perf_counter()
        checksums = await self._checksums(state)
        digest = weights_hash(_entries(state, checksums))

        existing = await self._existing(version, digest)
        if existing is not None:
            manifest, delta_base = existing
            await self._adopt(version, manifest, state, checksums, owned)
            event = self._event(manifest, trainer_step if trainer_step >= 0 else manifest.trainer_step, delta_base)
            self._base_step, self._base_delta_base = event.trainer_step, event.base_version
            await self._announce(event)
            log.info("version already stored; re-announced", model=self.model, version=version)
            return event

        keyframe = self._base is None or self._deltas_since_keyframe + 1 >= self.cfg.keyframe_every
        if self._watch is not None:
            self._start_watch()
            if not keyframe and self._watch.trouble_since(self._last_keyframe_at):
                log.info("keyframe published early: a sampler reported a failed weight update",
                         model=self.model, version=version, replica=self._watch.trouble_replica)
                keyframe = True
        if keyframe:
            self._last_keyframe_at = time.time()
        keyframe_version = version if keyframe else self.keyframe_version
        attempt = (f"{self.writer}-" if self.writer else "") + uuid.uuid4().hex[:16]
        created: list[Manifest] = []
        delta_manifest = None
        full_manifest = None
        try:
            if self._base is not None and (not keyframe or self.cfg.delta_with_keyframes):
                delta_manifest = await self._write(
                    version, "delta", state, checksums, digest, trainer_step, self._base, keyframe_version,
                    attempt, created,
                )
            if keyframe:
                full_manifest = await self._write(
                    version, "full", state, checksums, digest, trainer_step, None, keyframe_version,
                    attempt, created,
                )
        except WeightConflict:
            # Another publisher owns this version: take back what we created so no
            # reader can combine our manifests with theirs.
            await self._withdraw(created)
            raise
        announced = full_manifest or delta_manifest
        assert announced is not None

        prev_keyframe = self.keyframe_version
        await self._adopt(version, announced, state, checksums, owned)
        event = self._event(announced, trainer_step, delta_manifest.base_version if delta_manifest else -1)
        self._base_step, self._base_delta_base = trainer_step, event.base_version
        await failpoints.reached_async("weights.before_announce")
        await self._announce(event)
        log.info(
            "published weights",
            model=self.model, version=version, kind=announced.kind,
            base_version=announced.base_version,
            raw_mb=round(announced.raw_bytes / 1e6, 2),
            stored_mb=round(announced.stored_bytes / 1e6, 3),
            delta_mb=round(delta_manifest.stored_bytes / 1e6, 3) if delta_manifest else None,
            seconds=round(time.perf_counter() - t0, 3),
        )
        if keyframe and self.keyframe_version != prev_keyframe:
            await self.apply_retention()
        return event

    async def _checksums(self, state: dict) -> dict[str, str]:
        loop = asyncio.get_running_loop()
        names = list(state)
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"state dict key {name!r} is not a non-empty string")
        digests = await gather_or_cancel(
            (loop.run_in_executor(self._pool, tensor_checksum, state[n]) for n in names)
        )
        return dict(zip(names, digests))

    async def _existing(self, version: int, digest: str) -> tuple[Manifest, int] | None:
        """(stored manifest, delta base or -1) of ``version`` when the store holds these
        very weights; raise when it holds other weights or ``version`` is out of order."""
        catalog = await cat.load_catalog(self.store, self.model)
        if version in catalog.kinds:
            kind = "full" if catalog.has(version, "full") else "delta"
            manifest = await self._reader.get(version, kind)
            if manifest.weights_hash != digest:
                raise WeightConflict(
                    f"{self.model} v{version} is already stored with weights hash {manifest.weights_hash}; "
                    f"refusing to overwrite it with different weights ({digest})"
                )
            delta_base = -1
            if catalog.has(version, "delta"):
                delta_base = (await self._reader.get(version, "delta")).base_version
            return manifest, delta_base
        newest = max(catalog.latest, self.base_version)
        if version < newest:
            raise WeightConflict(f"{self.model} v{version} is older than the newest stored version v{newest}")
        return None

    async def _adopt(self, version: int, manifest: Manifest, state: dict, checksums: dict, owned: bool) -> None:
        import torch

        if owned:
            base = {n: t.detach() for n, t in state.items()}
        else:
            def snapshot() -> dict:
                return {
                    n: torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t.detach())
                    for n, t in state.items()
                }

            base = await asyncio.get_running_loop().run_in_executor(self._pool, snapshot)
        self._base = base
        self._base_checksums = dict(checksums)
        self.base_version = version
        if manifest.kind == "full":
            self.keyframe_version = version
            self._deltas_since_keyframe = 0
        else:
            self.keyframe_version = manifest.keyframe_version
            self._deltas_since_keyframe += 1

    async def _write(
        self,
        version: int,
        kind: str,
        state: dict,
        checksums: dict[str, str],
        digest: str,
        trainer_step: int,
        base: dict | None,
        keyframe_version: int,
        attempt: str,
        created: list[Manifest],
    ) -> Manifest:
        """Upload one manifest's chunks under ``attempt`` and create the manifest; on
        success it is appended to ``created``. Returns the stored manifest (another
        publisher's when it won with the same weights)."""
        entries = await self._upload_tensors(version, kind, state, checksums, base, attempt)
        manifest = Manifest(
            model=self.model,
            version=version,
            kind=kind,
            base_version=self.base_version if kind == "delta" else -1,
            keyframe_version=keyframe_version,
            weights_hash=digest,
            tensors=list(entries),
            raw_bytes=sum(e.raw_bytes for e in entries),
            stored_bytes=sum(e.stored_bytes for e in entries),
            num_chunks=sum(len(e.chunks) for e in entries),
            trainer_step=trainer_step,
            codec=CodecInfo(level=self.cfg.zstd_level, chunk_bytes=self.cfg.chunk_bytes),
            created_at=time.time(),
        )
        manifest.validate()
        return await self._commit(manifest, created)

    async def _upload_tensors(self, version: int, kind: str, state: dict, checksums: dict[str, str],
                              base: dict | None, attempt: str) -> list:
        """Plan every tensor (against ``base`` for a delta), then encode and upload its
        chunks under ``attempt``; the manifest entries, in name order."""
        loop = asyncio.get_running_loop()
        cfg = self.cfg

        def make_plan(name: str) -> TensorPlan:
            return plan_tensor(
                name, state[name], base.get(name) if base is not None else None,
                chunk_bytes=cfg.chunk_bytes, level=cfg.zstd_level, byte_planes=cfg.byte_planes,
                new_checksum=checksums[name],
                base_checksum=self._base_checksums.get(name) if base is not None else None,
            )

        names = sorted(state)
        plans = await gather_or_cancel((loop.run_in_executor(self._pool, make_plan, n) for n in names))
        in_flight = asyncio.Semaphore(cfg.max_concurrency)

        async def upload_chunk(index: int, plan: TensorPlan, j: int, start: int, count: int) -> ChunkRef:
            key = chunk_key(self.model, version, kind, index, j, attempt)
            async with in_flight:
                def encode() -> tuple[bytes, str]:
                    payload = encode_planned_chunk(plan, start, count, cfg.zstd_level)
                    return payload, checksum(payload)

                payload, chunk_digest = await loop.run_in_executor(self._pool, encode)
                await self.store.put(key, payload)
            return ChunkRef(
                key=key, start=start, count=count, raw_bytes=count * plan.new_bits.dtype.itemsize,
                stored_bytes=len(payload), checksum=chunk_digest,
            )

        async def encode_tensor(index: int, plan: TensorPlan):
            chunks = await gather_or_cancel(
                (upload_chunk(index, plan, j, s, c) for j, (s, c) in enumerate(plan.ranges))
            )
            return plan.entry(list(chunks))

        return list(await gather_or_cancel((encode_tensor(i, p) for i, p in enumerate(plans))))

    async def _commit(self, manifest: Manifest, created: list[Manifest]) -> Manifest:
        """Create the manifest, the commit point of its version, only if absent (appended
        to ``created``). When another publisher's is there: drop our chunks and use
        theirs if it holds the same weights, else raise ``WeightConflict``."""
        version, kind, digest = manifest.version, manifest.kind, manifest.weights_hash
        key = manifest_key(self.model, version, kind)
        if await self.store.put_if_absent(key, encode_manifest(manifest)):
            created.append(manifest)
            return manifest
        ours = [c.key for e in manifest.tensors for c in e.chunks]
        await self.store.delete(ours)  # never referenced: the other publisher's manifest won
        self._reader.forget(version)
        try:
            winner = await self._reader.get(version, kind)
        except (ObjectNotFound, ValueError) as exc:
            raise WeightConflict(f"{self.model} v{version} {kind} was published concurrently and "
                                 f"its manifest is unreadable here: {exc}") from exc
        if winner.weights_hash != digest:
            raise WeightConflict(
                f"{self.model} v{version} {kind} was published concurrently by another publisher with weights "
                f"hash {winner.weights_hash}; ours is {digest}: this publisher is not the only writer"
            )
        log.info("version published concurrently with the same weights; using the stored one",
                 model=self.model, version=version, kind=kind)
        return winner

    async def _withdraw(self, manifests: list[Manifest]) -> None:
        for manifest in manifests:
            await self.store.delete([manifest_key(self.model, manifest.version, manifest.kind)])
            await self.store.delete([c.key for t in manifest.tensors for c in t.chunks])
            self._reader.forget(manifest.version)

    def _event(self, manifest: Manifest, trainer_step: int, delta_base: int) -> WeightVersion:
        return WeightVersion(
            model=self.model,
            version=manifest.version,
            kind=manifest.kind,
            # A keyframe that also stored a delta names the delta's base.
            base_version=manifest.base_version if manifest.kind == "delta" else delta_base,
            keyframe_version=manifest.keyframe_version,
            manifest_url=self.store.url_for(manifest_key(self.model, manifest.version, manifest.kind)),
            weights_hash=manifest.weights_hash,
            num_tensors=len(manifest.tensors),
            raw_bytes=manifest.raw_bytes,
            stored_bytes=manifest.stored_bytes,
            trainer_step=trainer_step,
            created_at=time.time(),
        )

    async def _announce(self, event: WeightVersion) -> None:
        if self.producer is not None:
            await self.producer.publish(event)

    async def apply_retention(self) -> int:
        """Delete versions older than the newest ``keep_keyframes`` keyframes, then
        orphaned objects older than ``orphan_grace_s``."""
        catalog = await cat.load_catalog(self.store, self.model)
        doomed = cat.versions_to_delete(catalog, self.cfg.keep_keyframes)
        deleted = await cat.delete_versions(self.store, self.model, catalog, doomed)
        for v in doomed:
            self._reader.forget(v)
        try:
            garbage = await cat.collect_garbage(self.store, self.model, self.cfg.orphan_grace_s)
        except Exception as exc:  # housekeeping: never fail a publish that is already announced
            log.warning("garbage collection failed; retried after the next keyframe", model=self.model,
                        error=str(exc))
            return deleted
        return deleted + garbage.count


def _entries(state: Mapping[str, "torch.Tensor"], checksums: Mapping[str, str]):
    from syncer.bits import dtype_name

    return [(n, dtype_name(t.dtype), list(t.shape), checksums[n]) for n, t in state.items()]
