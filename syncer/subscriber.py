"""Sampler side: follow ``rollway.weights``, prefetch and verify the next version while
the engine keeps serving, then apply it in one short, measured pause.

The subscriber keeps a CPU copy of the weights it last applied (HF names): deltas are
XORed against it, and it is what makes "verify before apply" possible. Update rules:

* versions at or below the applied one are ignored (never out of order);
* paths are tried cheapest first: the delta path (current -> ... -> target) when the
  replica has weights, then every keyframe at or before the target, newest first
  (keyframe + the deltas after it). Any failure to plan or reconstruct a path (missing
  or unreadable manifest, unknown format, bad chunk, wrong base) moves on to the next
  path; ``UpdateFailed`` only when none is left;
* every chunk and tensor is checked before anything reaches the engine, and so is the
  announced ``weights_hash`` (a store holding other weights than the trainer announced
  is refused); a corrupt, partial or wrong-base update is never applied;
* a failed apply (the engine may now hold a mix) marks the replica unhealthy
  (``healthy`` False, heartbeat status ``unhealthy``) until a full update succeeds;
  the next update, even of the same version, resends every tensor.

The target contract (``docs/contracts.md``)::

    target.weight_version: int
    await target.apply_weights(tensors, version) -> float   # pause seconds

A target receives every tensor on each update unless it sets
``accepts_partial_updates = True``; then only tensors that changed are sent (vLLM's
CPU backend reloads whole layers and must not opt in).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import structlog

from schemas import WeightVersion
from syncer import catalog as cat
from syncer.config import SyncerConfig
from syncer.fetch import Reconstruction, Reconstructor
from syncer.store import ObjectStore
from syncer.tensor_codec import IntegrityError

if TYPE_CHECKING:
    import torch

    from bus.config import KafkaConfig

log = structlog.get_logger(__name__)


class WeightTarget(Protocol):
    weight_version: int

    async def apply_weights(self, tensors: dict[str, "torch.Tensor"], version: int) -> float: ...


class UpdateFailed(RuntimeError):
    """Neither the delta path nor the keyframe path produced verified weights."""


class WeightSubscriber:
    def __init__(
        self,
        cfg: SyncerConfig,
        model: str,
        store: ObjectStore,
        target: WeightTarget,
        *,
        kafka_cfg: "KafkaConfig | None" = None,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.store = store
        self.target = target
        self.kafka_cfg = kafka_cfg
        self._pool = ThreadPoolExecutor(max_workers=cfg.zstd_threads, thread_name_prefix="syncer-decode")
        self._reader = cat.ManifestReader(store, model, cfg.manifest_cache)
        self._reconstructor = Reconstructor(store, self._pool, cfg.max_concurrency)
        # The weights last applied to the target, and their checksums.
        self._weights: dict[str, "torch.Tensor"] = {}
        self._checksums: dict[str, str] = {}
        self.version = -1
        self.weights_hash = ""  # of the weights applied (self.version)
        # True after a failed apply: the engine may hold a mix, so send everything next.
        self._engine_dirty = False
        self.announced = -1
        self.announced_hash = ""  # weights_hash announced for self.announced
        self.last_pause_s = 0.0
        self.last_update_s = 0.0
        self.last_path = ""
        self.updates_applied = 0
        self.failures = 0
        self.last_error = ""
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()

    # -- what the sampler heartbeat reports ---------------------------------------------
    @property
    def last_pause_ms(self) -> float:
        return self.last_pause_s * 1000.0

    @property
    def healthy(self) -> bool:
        """False after a failed apply until a full update succeeds: the engine may
        hold a mix of two versions under the old version's label."""
        return not self._engine_dirty

    @property
    def weights(self) -> dict[str, "torch.Tensor"]:
        """The CPU copy of the applied weights (read-only by convention)."""
        return self._weights

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- updating -----------------------------------------------------------------------
    async def update_to(self, version: int, weights_hash: str = "") -> bool:
        """Reach ``version`` (False when already there or newer and the engine is
        clean). ``weights_hash``, when given, is what the trainer announced: other
        weights are refused. Raises UpdateFailed when no path yields verified weights;
        the target is then left untouched."""
        async with self._lock:
            if version <= self.version and not self._engine_dirty:
                return False
            if version < self.version:
                # A dirty engine is repaired at the version this replica last reached.
                version, weights_hash = self.version, ""
            t0 = time.perf_counter()
            if version == self.version:
                # Repair: the CPU copy of this version is verified; send all of it again.
                recon = Reconstruction(version, self._weights, self._checksums, 0)
                plan = cat.Plan(version, None, [])
            else:
                recon, plan = await self._prefetch(version, weights_hash)
            await self._apply(recon, plan, time.perf_counter() - t0)
            return True

    async def _prefetch(self, version: int, weights_hash: str = "") -> tuple[Reconstruction, cat.Plan]:
        catalog = await cat.load_catalog(self.store, self.model)
        if version not in catalog.kinds:
            raise UpdateFailed(f"{self.model} v{version} is not in {self.store.url} (not published or pruned)")
        errors: list[str] = []
        for frame in self._path_candidates(catalog, version):
            try:
                if frame is None:
                    chain = await cat.delta_chain(self._reader, catalog, self.version, version)
                    plan = cat.Plan(version, None, chain)
                    recon = await self._reconstructor.run(plan, self._weights, self._checksums)
                else:
                    plan = await cat.keyframe_plan(self._reader, catalog, version, frame)
                    recon = await self._reconstructor.run(plan, {}, {})
                if weights_hash and recon.weights_hash != weights_hash:
                    raise IntegrityError(
                        f"the store holds weights hash {recon.weights_hash} for v{version}, "
                        f"the trainer announced {weights_hash}"
                    )
                if errors:
                    log.warning("reached the version through a fallback path", model=self.model, target=version,
                                path=plan.describe(), failed=errors)
                return recon, plan
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure of one path: try the next (why: issue 13)
                where = "delta path" if frame is None else f"keyframe v{frame} path"
                errors.append(f"{where}: {type(exc).__name__}: {exc}")
                log.warning("update path failed; trying the next", model=self.model, target=version,
                            path=where, error=str(exc))
                # A manifest read before it was damaged (or replaced) must not be reused.
                self._reader.forget()
        raise UpdateFailed(f"no path to {self.model} v{version} yields verified weights: " + "; ".join(errors))

    def _path_candidates(self, catalog: cat.Catalog, version: int) -> list[int | None]:
        """None (the delta path from the applied weights) first when it can apply,
        then every keyframe at or before ``version``, newest first."""
        out: list[int | None] = []
        if self._weights and 0 <= self.version < version:
            out.append(None)
        out.extend(reversed([f for f in catalog.keyframes if f <= version]))
        if not out:
            raise UpdateFailed(f"no keyframe at or before {self.model} v{version} in {self.store.url}")
        return out

    async def _apply(self, recon: Reconstruction, plan: cat.Plan, prefetch_s: float) -> None:
        partial_ok = bool(getattr(self.target, "accepts_partial_updates", False))
        full = not partial_ok or self._engine_dirty or plan.keyframe is not None
        if full:
            tensors = dict(recon.tensors)
        else:
            # Unchanged tensors are the very objects we already hold.
            tensors = {n: t for n, t in recon.tensors.items() if self._weights.get(n) is not t}
        dropped = set(self._weights) - set(recon.tensors)
        if dropped:
            log.warning("tensors absent from the new version stay as they are in the engine",
                        names=sorted(dropped)[:10], count=len(dropped))
        from syncer.apply import WeightsRefused

        try:
            pause = await self.target.apply_weights(tensors, recon.version)
        except WeightsRefused as exc:
            # Refused before any byte was written: the engine still holds self.version.
            log.error("engine refused the update; nothing was written", model=self.model,
                      version=recon.version, error=str(exc))
            raise
        except BaseException as exc:
            self._engine_dirty = True
            log.error("weight apply failed mid-way; replica unhealthy until a full update succeeds",
                      model=self.model, version=recon.version, error=str(exc))
            raise
        self._engine_dirty = False
        self._weights = recon.tensors
        self._checksums = recon.checksums
        self.version = recon.version
        self.weights_hash = recon.weights_hash
        self.last_pause_s = float(pause)
        self.last_update_s = prefetch_s
        self.last_path = plan.describe()
        self.updates_applied += 1
        self.last_error = ""
        log.info(
            "weights applied",
            model=self.model, version=recon.version, path=self.last_path,
            tensors=len(tensors), downloaded_mb=round(recon.downloaded_bytes / 1e6, 3),
            prefetch_s=round(prefetch_s, 3), pause_ms=round(self.last_pause_ms, 3),
        )

    # -- following the topic ------------------------------------------------------------
    def notify(self, event: WeightVersion) -> None:
        """Take note of an announcement (from Kafka or any other source)."""
        if event.model != self.model:
            return
        if event.version > self.announced:
            self.announced = event.version
            self.announced_hash = event.weights_hash
            self._wake.set()
        elif event.version == self.announced and event.weights_hash != self.announced_hash:
            # Announced again with other weights (a second publisher): the newest word
            # counts; the subscriber checks what the store holds against it.
            self.announced_hash = event.weights_hash
            self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    async def run(self) -> None:
        """Follow ``rollway.weights`` as a plain reader (no group, reads every partition
        from the beginning) and keep the target at the newest announced version.
        Returns after :meth:`stop`."""
        from bus import EventConsumer

        if self.kafka_cfg is None:
            raise ValueError("WeightSubscriber.run needs kafka_cfg")
        consumer = EventConsumer(self.kafka_cfg, ["weights"], group_id=None, dead_letters=False)
        updater = asyncio.create_task(self._update_loop(), name="weights-updater")
        try:
            async with consumer:
                while not self._stop.is_set():
                    envs = await consumer.getmany(timeout_ms=200)
                    for env in envs:
                        if isinstance(env.event, WeightVersion):
                            self.notify(env.event)
        finally:
            self.stop()
            await updater

    async def _update_loop(self) -> None:
        while not self._stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            # Coalesce: a burst of announcements (a new replica reading the topic from
            # the start) becomes one update to the newest.
            target, digest = self.announced, self.announced_hash
            if target <= self.version and self.healthy:
                continue
            try:
                await self.update_to(target, digest)
            except Exception as exc:  # keep serving old weights; retry later
                self.failures += 1
                self.last_error = str(exc)
                log.error("weight update failed; keeping current weights",
                          model=self.model, target=target, current=self.version, error=str(exc))
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=self.cfg.retry_delay_s)
                except asyncio.TimeoutError:
                    self._wake.set()
