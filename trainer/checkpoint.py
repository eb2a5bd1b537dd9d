"""Asynchronous, atomic checkpoints in a local folder.

Layout: ``<dir>/step-00000010/{state.pt, meta.json}``. A checkpoint is written into a
hidden temporary folder, fsynced, then renamed into place, so a crash leaves either the
whole checkpoint or none of it (temporary folders are cleaned up at the next start).

Training does not wait for the disk: :meth:`AsyncCheckpointer.save` takes a snapshot
that is already a CPU copy (``TrainCore.snapshot``) and writes it on a background
thread. At most one write is in flight; a save that finds the previous one still
running waits for it (so checkpoints are written in order and memory stays bounded).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

PREFIX = "step-"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    weight_version: int
    weights_hash: str
    path: Path


def _name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Complete checkpoints, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        if not child.name.startswith(PREFIX) or not (child / "meta.json").exists():
            continue
        try:
            meta = json.loads((child / "meta.json").read_text())
            out.append(CheckpointInfo(int(meta["step"]), int(meta["weight_version"]), meta["weights_hash"], child))
        except (ValueError, KeyError) as exc:
            log.warning("unreadable checkpoint ignored", path=str(child), error=str(exc))
    return sorted(out, key=lambda c: c.step)


def load_checkpoint(info: CheckpointInfo, map_location: str = "cpu") -> dict[str, Any]:
    import torch

    return torch.load(info.path / "state.pt", map_location=map_location, weights_only=True)


def write_checkpoint(directory: str | os.PathLike[str], snapshot: dict[str, Any], weights_hash: str) -> Path:
    """Write one checkpoint atomically (blocking). Returns its folder."""
    import torch

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    step = int(snapshot["step"])
    final = root / _name(step)
    tmp = root / f".{_name(step)}.tmp-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state_path = tmp / "state.pt"
    with open(state_path, "wb") as f:
        torch.save(snapshot, f)
        f.flush()
        os.fsync(f.fileno())
    meta = {"step": step, "weight_version": int(snapshot["weight_version"]), "weights_hash": weights_hash,
            "created_at": time.time()}
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)  # a re-executed step rewrites the same bytes
    os.rename(tmp, final)
    _fsync_dir(root)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(directory: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints; returns the deleted folders."""
    removed = []
    for info in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        shutil.rmtree(info.path, ignore_errors=True)
        removed.append(info.path)
    return removed


def clean_temporaries(directory: str | os.PathLike[str]) -> None:
    root = Path(directory)
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(f".{PREFIX}") and ".tmp-" in child.name:
                shutil.rmtree(child, ignore_errors=True)


class AsyncCheckpointer:
    def __init__(self, directory: str | os.PathLike[str], keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._inflight: Future | None = None
        self.last_written: CheckpointInfo | None = None
        self.last_error: BaseException | None = None
        clean_temporaries(self.directory)

    def save(self, snapshot: dict[str, Any], weights_hash: str) -> Future:
        """Queue a write of ``snapshot`` (already CPU copies); returns at once unless the
        previous write is still running."""
        self.wait()
        self._inflight = self._pool.submit(self._write, snapshot, weights_hash)
        return self._inflight

    def _write(self, snapshot: dict[str, Any], weights_hash: str) -> CheckpointInfo:
        started = time.perf_counter()
        try:
            path = write_checkpoint(self.directory, snapshot, weights_hash)
            removed = prune(self.directory, self.keep)
        except BaseException as exc:
            self.last_error = exc
            log.error("checkpoint write failed", step=snapshot.get("step"), error=str(exc))
            raise
        info = CheckpointInfo(int(snapshot["step"]), int(snapshot["weight_version"]), weights_hash, path)
        self.last_written = info
        log.info("checkpoint written", step=info.step, path=str(path), seconds=round(time.perf_counter() - started, 3),
                 pruned=[p.name for p in removed])
        return info

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; errors were logged."""
        if self._inflight is not None:
            try:
                self._inflight.result()
            except BaseException:
                pass
            self._inflight = None

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
