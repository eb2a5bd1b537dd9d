"""Download, verify and decode stored versions into CPU tensors.

``Reconstructor.run(plan, state, checksums)`` applies a plan's manifests one after
another to a state (the replica's current weights, or nothing for a keyframe) and
returns the new state. Nothing is modified in place: a tensor that changed is a new
tensor, one that did not is the very same object, so a failure anywhere leaves the
caller's state untouched and nothing half-decoded can reach an engine.

Checks, in order: a delta's base checksum per tensor against the state's; each
chunk's size and checksum before it is decoded; each reconstructed tensor's checksum;
finally the version's ``weights_hash`` over all tensors.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from syncer.aio import gather_or_cancel
from syncer.catalog import Plan
from syncer.hashing import weights_hash
from syncer.manifest import ChunkRef, Manifest, TensorEntry
from syncer.store import ObjectNotFound, ObjectStore
from syncer.tensor_codec import IntegrityError, allocate, check_base, decode_into, verify_tensor

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)


@dataclass
class Reconstruction:
    version: int
    tensors: dict[str, "torch.Tensor"]
    checksums: dict[str, str]
    downloaded_bytes: int
    weights_hash: str = ""  # of the last manifest applied, verified against its tensors


class Reconstructor:
    def __init__(self, store: ObjectStore, pool: ThreadPoolExecutor, max_concurrency: int = 8) -> None:
        self.store = store
        self.pool = pool
        self.max_concurrency = max_concurrency

    async def run(
        self,
        plan: Plan,
        state: dict[str, "torch.Tensor"],
        checksums: dict[str, str],
    ) -> Reconstruction:
        downloaded = 0
        digest = ""
        if plan.keyframe is not None:
            state, checksums = {}, {}
        for manifest in plan.manifests:
            state, checksums, nbytes = await self.apply_manifest(manifest, state, checksums)
            downloaded += nbytes
            digest = manifest.weights_hash
        if plan.manifests and plan.manifests[-1].version != plan.target:
            raise IntegrityError(f"plan to v{plan.target} ends at v{plan.manifests[-1].version}")
        return Reconstruction(plan.target, state, checksums, downloaded, digest)

    async def apply_manifest(
        self,
        manifest: Manifest,
        state: dict[str, "torch.Tensor"],
        checksums: dict[str, str],
    ) -> tuple[dict[str, "torch.Tensor"], dict[str, str], int]:
        where = f"{manifest.model} v{manifest.version} {manifest.kind}"
        if manifest.kind == "delta":
            for entry in manifest.tensors:
                if entry.encoding == "raw":
                    continue
                have = checksums.get(entry.name)
                if have is None:
                    raise IntegrityError(f"{where}: base has no tensor {entry.name!r}")
                if have != entry.base_checksum:
                    raise IntegrityError(
                        f"{where}: {entry.name} base checksum {have} != expected {entry.base_checksum} "
                        f"(this replica's weights are not v{manifest.base_version})"
                    )
        gate = asyncio.Semaphore(self.max_concurrency)
        results = await gather_or_cancel(
            (self._tensor(manifest, entry, state.get(entry.name), gate) for entry in manifest.tensors)
        )
        new_state = {entry.name: tensor for entry, (tensor, _) in zip(manifest.tensors, results)}
        new_checksums = {entry.name: entry.checksum for entry in manifest.tensors}
        got = weights_hash((e.name, e.dtype, e.shape, e.checksum) for e in manifest.tensors)
        if got != manifest.weights_hash:
            raise IntegrityError(f"{where}: weights hash {got} != manifest {manifest.weights_hash}")
        return new_state, new_checksums, sum(n for _, n in results)

    async def _tensor(
        self,
        manifest: Manifest,
        entry: TensorEntry,
        base: "torch.Tensor | None",
        gate: asyncio.Semaphore,
    ) -> tuple["torch.Tensor", int]:
        check_base(entry, base)
        if entry.encoding == "same":
            return base, 0  # base checksum already matched entry.base_checksum == checksum
        loop = asyncio.get_running_loop()
        out = allocate(entry)

        async def chunk(ref: ChunkRef) -> int:
            async with gate:  # bounds downloads in flight, hence memory
                try:
                    payload = await self.store.get(ref.key)
                except ObjectNotFound as exc:
                    raise IntegrityError(f"{entry.name}: chunk missing: {exc}") from None
                await loop.run_in_executor(self.pool, decode_into, entry, ref, payload, out, base)
            return len(payload)

        sizes = await gather_or_cancel((chunk(ref) for ref in entry.chunks))
        await loop.run_in_executor(self.pool, verify_tensor, entry, out)
        return out, sum(sizes)


async def load_version(store: ObjectStore, model: str, version: int | None = None, threads: int = 2,
                       max_concurrency: int = 8) -> Reconstruction:
    """Rebuild one stored version from scratch (newest keyframe at or before it plus
    deltas), fully verified. ``version=None``: the newest."""
    from syncer import catalog as cat

    catalog = await cat.load_catalog(store, model)
    if catalog.latest < 0:
        raise cat.NoPath(f"no versions of {model!r} in {store.url}")
    target = catalog.latest if version is None else version
    if target not in catalog.kinds:
        raise cat.NoPath(f"{model} v{target} is not in {store.url}; versions: {catalog.versions}")
    plan = await cat.keyframe_plan(cat.ManifestReader(store, model), catalog, target)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="syncer-load") as pool:
        return await Reconstructor(store, pool, max_concurrency).run(plan, {}, {})
