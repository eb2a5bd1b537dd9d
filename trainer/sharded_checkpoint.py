"""Sharded checkpoints: torch.distributed.checkpoint (DCP) under checkpoint.py's rules.

Layout: ``<dir>/step-00000010/`` holds DCP's files (``.metadata`` and one
``__<rank>_0.distcp`` per rank) and ``meta.json`` (step, weight version, weights hash,
owner token, ``format: dcp``, the world size that wrote it). Every rank writes its own
shards into one folder, so across machines ``checkpoint_dir`` is a shared filesystem.

The crash-safety rules are ``trainer/checkpoint.py``'s, and so are its helpers
(``list_checkpoints``, ``prune``, ``clean_temporaries``):

* written into a hidden temporary folder (held with ``flock`` by rank 0 while it is
  written), ``meta.json`` last, then renamed into place by rank 0: a crash leaves the
  whole checkpoint or none of it, and only folders with ``meta.json`` are ever loaded;
* rank 0 owns the folder decisions (``FolderOwnership``: it checks it still owns the
  folder before the first byte and again before the rename; a superseded trainer
  writes nothing and stops with ``CheckpointFenced``), and writes only steps the step log
  holds with the same hash; the decision is broadcast, so every rank raises together;
* a restore loads the newest checkpoint the log confirms, checks the loaded weights
  against the logged hash, and falls back to an older one when they differ.

Asynchronous: ``dcp.async_save`` copies the shards to CPU memory (staging) before it
returns, then writes on a background thread; the next step goes on meanwhile. The
write's cross-rank coordination runs on a process group of its own (gloo), so it never
interleaves with the training collectives. At most one save is in flight.

Resharding: the state is keyed by parameter name (``trainer/sharded_optim.py``), so a
checkpoint written at N ranks loads at M ranks; DCP moves bytes, the loaded weights are
bit-identical (the logged hash is checked). Training on from there at M ranks is the
M-rank step, which equals the N-rank one within float32 rounding (docs/trainer.md).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import structlog

from bus import failpoints
from trainer.checkpoint import (AsyncCheckpointer, CheckpointError, CheckpointInfo, _name, list_checkpoints,
                                move_into_place, prune, write_meta)
from trainer.checkpoint_owner import CheckpointFenced, FolderOwnership, hold

if TYPE_CHECKING:
    from trainer.sharded_core import ShardedTrainCore

log = structlog.get_logger(__name__)

FORMAT = "dcp"


class CheckpointMismatch(CheckpointError):
    """A loaded checkpoint's weights are not the ones its meta.json (and the log) name."""


def _state(core: "ShardedTrainCore", *, empty_optimizer: bool = False) -> dict[str, Any]:
    """What DCP saves (and loads into): the model's DTensors and the optimizer state."""
    optim = core.optimizer.empty_state() if empty_optimizer else core.optimizer.state_dict()
    return {"model": core.model.state_dict(), "optim": optim}


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class ShardedCheckpointer(AsyncCheckpointer):
    """Asynchronous DCP checkpoints of a ``ShardedTrainCore`` (every rank calls every
    method, in the same order: they are collective). Ownership and the log are
    ``AsyncCheckpointer``'s, held by rank 0; the other ranks follow its decisions."""

    def __init__(self, directory: str | os.PathLike[str], keep: int, rank: int) -> None:
        import torch.distributed as dist

        super().__init__(directory, keep)
        self.rank = rank
        # DCP's background write gathers its plans over this group, never the one the
        # step uses (two threads' collectives on one group would interleave).
        self._group = dist.new_group(backend="gloo")

    def claim(self, ownership: FolderOwnership | None) -> None:
        """Rank 0: own the folder and clean what dead writers left; other ranks pass None."""
        if self.rank == 0 and ownership is not None:
            super().claim(ownership)

    # -- save --------------------------------------------------------------------------------
    def save(self, core: "ShardedTrainCore", weights_hash: str) -> Future:
        """Start writing the core's current state (step ``core.step``); returns once the
        shards are staged in CPU memory. Collective."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        step = core.step
        decision: tuple[str, str] | str
        if self.rank == 0:
            decision = self._prepare(step, weights_hash)
        else:
            decision = ""
        decision = _broadcast(decision)
        if isinstance(decision, tuple):
            kind, why = decision
            error = CheckpointFenced(why) if kind == "fenced" else CheckpointError(why)
            if kind == "fenced":
                self.fenced = error
            raise error
        tmp = Path(decision)
        held = hold(tmp) if self.rank == 0 else None
        try:
            pending = dcp.async_save(_state(core), checkpoint_id=str(tmp), process_group=self._group)
        except BaseException:
            if held is not None:
                os.close(held)
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._inflight = self._pool.submit(self._finish, pending, tmp, step, weights_hash, core.ctx.world_size, held)
        return self._inflight

    def _prepare(self, step: int, weights_hash: str) -> tuple[str, str] | str:
        """Rank 0: the temporary folder to write, or (kind, why) for refusing."""
        if self.logged is not None and self.logged.get(step) != weights_hash:
            return ("error", f"step {step} with weights hash {weights_hash[:16]} is not in the step log: "
                             "no checkpoint is written of a step the log did not commit")
        tag = f"{os.getpid()}-{threading.get_ident()}"
        if self.ownership is not None:
            tag = f"{self.ownership.owner.token}-{tag}"
            try:
                self.ownership.check()
            except CheckpointFenced as exc:
                return ("fenced", str(exc))
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{_name(step)}.tmp-{tag}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return str(tmp)

    def _finish(self, pending: Future, tmp: Path, step: int, weights_hash: str, world_size: int,
                held: int | None) -> CheckpointInfo | None:
        """Wait for this rank's shards; rank 0 (DCP's coordinator, whose write ends after
        every rank's) then writes meta.json and renames the folder in."""
        started = time.perf_counter()
        try:
            try:
                result = pending.result()
                # async_save may hand back a response whose upload is a second future.
                upload = getattr(result, "upload_completion", None)
                if upload is not None:
                    upload.result()
                if self.rank != 0:
                    return None
                meta = {"step": step, "weight_version": step, "weights_hash": weights_hash,
                        "created_at": time.time(), "pid": os.getpid(), "format": FORMAT, "world_size": world_size,
                        "owner": self.ownership.owner.token if self.ownership is not None else ""}
                write_meta(tmp, meta)
                failpoints.reached("checkpoint.before_rename")
                if self.ownership is not None:
                    self.ownership.check()
            except BaseException as exc:
                if self.rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                    if isinstance(exc, CheckpointFenced):
                        self.fenced = exc
                log.error("sharded checkpoint not written", step=step, rank=self.rank, error=str(exc))
                raise
            final = move_into_place(self.directory, tmp, step, tmp.name.split(".tmp-", 1)[1])
        finally:
            if held is not None:
                os.close(held)
        removed = prune(self.directory, self.keep, dict(self.logged) if self.logged is not None else None,
                        current=step, ownership=self.ownership)
        info = CheckpointInfo(step, step, weights_hash, final, meta["owner"])
        self.last_written = info
        log.info("sharded checkpoint written", step=step, path=str(final), world_size=world_size,
                 seconds=round(time.perf_counter() - started, 3), pruned=[p.name for p in removed])
        return info

    def wait(self) -> None:
        """Block until the save in flight is done; its error is raised here."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()
        if self.fenced is not None:
            raise self.fenced


# -- load ------------------------------------------------------------------------------------

def load_into(core: "ShardedTrainCore", info: CheckpointInfo) -> None:
    """Load ``info`` into ``core`` at whatever world size it runs (DCP reshards), then
    check the weights against the checkpoint's hash (``CheckpointMismatch``).
    Collective."""
    import torch.distributed.checkpoint as dcp

    if not (info.path / "meta.json").exists():
        raise CheckpointError(f"{info.path} is not a complete checkpoint (no meta.json)")
    meta = json.loads((info.path / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{info.path} is a {meta.get('format', 'single-process')!r} checkpoint, not DCP: "
                              "a sharded trainer restores DCP checkpoints only")
    state = _state(core, empty_optimizer=True)
    dcp.load(state, checkpoint_id=str(info.path))
    core.optimizer.load_state_dict(state["optim"])
    core.step = info.step
    digest = core.weights_hash()
    if digest != info.weights_hash:
        raise CheckpointMismatch(f"checkpoint {info.path} loaded to weights {digest}, not the "
                                 f"{info.weights_hash} it was written with")
    log.info("sharded checkpoint loaded", step=info.step, path=str(info.path),
             written_at_world_size=meta.get("world_size"), world_size=core.ctx.world_size)


def restore_newest(core: "ShardedTrainCore", directory: str | os.PathLike[str],
                   logged: Mapping[int, str] | None = None) -> int:
    """Load the newest complete checkpoint (that the log, when given, holds with the
    same hash) whose weights load to that hash; older ones when it does not; the step
    restored (0: there was none; the initial weights stay). Collective: every rank
    tries the same checkpoints in the same order (rank 0's listing). When checkpoints
    exist and none loads, ``CheckpointError``: a failed load may have left part of
    itself in the weights, so the trainer restarts from a fresh process."""
    candidates = [c for c in list_checkpoints(directory) if logged is None or logged.get(c.step) == c.weights_hash]
    candidates = _broadcast(candidates if core.ctx.rank == 0 else None)
    for info in reversed(candidates):
        try:
            load_into(core, info)
            return info.step
        except (CheckpointError, RuntimeError, ValueError) as exc:
            # An older checkpoint that loads overwrites every tensor a failed one touched.
            log.error("sharded checkpoint unusable; trying an older one", step=info.step, path=str(info.path),
                      error=str(exc))
    if candidates:
        raise CheckpointError(f"none of the {len(candidates)} checkpoints in {directory} loads to its logged "
                              "weights; move them aside to train from the initial model and replay the log")
    return 0
