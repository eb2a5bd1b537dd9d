"""Asynchronous, atomic checkpoints in a local folder.

Layout: ``<dir>/step-00000010/{state.pt, meta.json}``. A checkpoint is written into a
hidden temporary folder, fsynced, then renamed into place, so a crash leaves either the
whole checkpoint or none of it (temporary folders are cleaned up at the next start, and
a failed write removes its own at once). Rewriting an existing step first renames the
old folder aside, then renames the new one in, then deletes the old: a crash in between
leaves the old one aside, and :func:`clean_temporaries` puts it back.

Ownership (``trainer/checkpoint_owner.py``): a trainer writes only while it owns the
folder (its transactional producer is the newest), only steps the log holds with the
same hash, and checks that it still owns the folder before writing and again before
renaming a checkpoint in; a superseded trainer (a woken zombie) writes nothing and stops
with ``CheckpointFenced``. Its temporary folders carry its token and hold a lock while
it lives, so cleanup (at a trainer's start, after it fenced the others) removes only
what dead writers left, and pruning never deletes a newer owner's checkpoint.

Pruning follows the log, not folder names: a checkpoint counts only when the step log
holds its step with the same weights hash (after a topic reset, checkpoints of the old
run have high step numbers the new log does not know, and they are deleted, never
preferred). A failed write is an error the trainer stops on (``CheckpointError``,
after ``max_failures`` failed writes in a row), not a log line.

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
from typing import Any, Mapping

import structlog

from bus import failpoints
from trainer.checkpoint_owner import CheckpointFenced, FolderOwnership, held_by_a_live_writer, hold

log = structlog.get_logger(__name__)

PREFIX = "step-"


class CheckpointError(RuntimeError):
    """Checkpoints cannot be written (unwritable folder, disk full, ...)."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    weight_version: int
    weights_hash: str
    path: Path
    owner: str = ""  # the writer's ownership token ("" before tokens existed)


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
            out.append(CheckpointInfo(int(meta["step"]), int(meta["weight_version"]), meta["weights_hash"], child,
                                      str(meta.get("owner", ""))))
        except (ValueError, KeyError) as exc:
            log.warning("unreadable checkpoint ignored", path=str(child), error=str(exc))
    return sorted(out, key=lambda c: c.step)


def load_checkpoint(info: CheckpointInfo, map_location: str = "cpu") -> dict[str, Any]:
    import torch

    return torch.load(info.path / "state.pt", map_location=map_location, weights_only=True)


def write_checkpoint(directory: str | os.PathLike[str], snapshot: dict[str, Any], weights_hash: str,
                     ownership: FolderOwnership | None = None) -> Path:
    """Write one checkpoint atomically (blocking). Returns its folder.

    With ``ownership``: nothing is written unless this trainer still owns the folder,
    checked before the first byte and again right before the rename
    (``CheckpointFenced``; its temporary folder is removed)."""
    import torch

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    step = int(snapshot["step"])
    tag = f"{os.getpid()}-{threading.get_ident()}"
    if ownership is not None:
        tag = f"{ownership.owner.token}-{tag}"
        ownership.check()
    tmp = root / f".{_name(step)}.tmp-{tag}"
    shutil.rmtree(tmp, ignore_errors=True)
    held: int | None = None
    try:
        try:
            tmp.mkdir()
            held = hold(tmp)  # until it is renamed in or removed: cleanup leaves it alone
            with open(tmp / "state.pt", "wb") as f:
                torch.save(snapshot, f)
                f.flush()
                os.fsync(f.fileno())
            write_meta(tmp, {"step": step, "weight_version": int(snapshot["weight_version"]),
                             "weights_hash": weights_hash, "created_at": time.time(), "pid": os.getpid(),
                             "owner": ownership.owner.token if ownership is not None else ""})
            failpoints.reached("checkpoint.before_rename")
            if ownership is not None:
                ownership.check()  # a trainer frozen until a newer one started writes nothing
        except BaseException:
            # A failed write (disk full) must not keep the disk full.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return move_into_place(root, tmp, step, tag)
    finally:
        if held is not None:
            os.close(held)


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    """A checkpoint's meta.json, fsynced with its folder: the last thing written into a
    temporary folder before it is renamed in (no meta.json, no checkpoint)."""
    with open(folder / "meta.json", "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(folder)


def move_into_place(root: Path, tmp: Path, step: int, tag: str) -> Path:
    """Rename the finished temporary folder ``tmp`` to step ``step``'s checkpoint."""
    final = root / _name(step)
    old = root / f".{_name(step)}.old-{tag}"
    if final.exists():
        # A re-executed step rewrites its checkpoint (the old one may be the damaged one
        # restore fell back from). Never a moment without a complete checkpoint on disk:
        # the old one is set aside, not deleted, until the new one is in place.
        os.rename(final, old)
        _fsync_dir(root)
    os.rename(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(
    directory: str | os.PathLike[str],
    keep: int,
    logged: Mapping[int, str] | None = None,
    current: int | None = None,
    ownership: FolderOwnership | None = None,
) -> list[Path]:
    """Keep the ``keep`` checkpoints with the highest steps among those the log
    confirms, delete the rest; returns the deleted folders.

    With ``logged`` (step -> weights hash of the step log), a checkpoint is confirmed
    when the log holds its step with the same hash. Without it, every checkpoint at or
    below ``current`` (the step just written) is, and none above: the trainer writes
    steps in log order, so a higher step belongs to another log (a reset topic).
    Unconfirmed checkpoints are deleted: no restore against this log can use them.
    With ``ownership``, checkpoints a newer owner wrote are left alone (this trainer
    is then superseded: its log is not the newest)."""
    confirmed, stale = [], []
    for info in list_checkpoints(directory):
        if ownership is not None and not ownership.may_remove(info.owner):
            continue
        if logged is not None:
            ok = logged.get(info.step) == info.weights_hash
        else:
            ok = current is None or info.step <= current
        (confirmed if ok else stale).append(info)
    doomed = stale + (confirmed[:-keep] if keep > 0 else confirmed)
    for info in doomed:
        if info in stale:
            log.warning("checkpoint not in the step log; deleted", step=info.step, path=str(info.path))
        shutil.rmtree(info.path, ignore_errors=True)
    return [info.path for info in doomed]


def clean_temporaries(directory: str | os.PathLike[str], ownership: FolderOwnership | None = None) -> None:
    """Remove what an interrupted write left: unfinished temporary folders, and old
    folders set aside by a rewrite (put back when the rewrite never landed). Only what
    dead writers left: a folder its writer still holds (a live process, also a stopped
    one) stays, and so does anything of a newer owner than ``ownership``."""
    root = Path(directory)
    if not root.is_dir():
        return
    for child in root.iterdir():
        if not child.name.startswith(f".{PREFIX}"):
            continue
        kind = ".tmp-" if ".tmp-" in child.name else ".old-" if ".old-" in child.name else None
        if kind is None:
            continue
        base, tag = child.name.split(kind, 1)
        if ownership is not None and not ownership.may_remove(tag):
            continue
        # A rewrite's set-aside folder belongs to the write whose temporary folder has its tag.
        writing = child if kind == ".tmp-" else root / f"{base}.tmp-{tag}"
        if held_by_a_live_writer(writing):
            log.info("checkpoint folder of a live writer left alone", path=str(child))
            continue
        if kind == ".tmp-":
            shutil.rmtree(child, ignore_errors=True)
        else:
            final = root / base[1:]
            if final.exists():
                shutil.rmtree(child, ignore_errors=True)
            else:
                os.rename(child, final)
                log.warning("interrupted checkpoint rewrite; previous checkpoint put back", path=str(final))


class AsyncCheckpointer:
    """Background checkpoint writes, pruned against the step log.

    A failed write is counted; once ``max_failures`` writes in a row have failed, the
    next :meth:`save`, :meth:`check` or :meth:`close` raises ``CheckpointError`` so the
    trainer stops instead of training on with nothing to restart from.

    After :meth:`claim` (the trainer's producer started, older trainers fenced) every
    write and prune checks the folder is still this trainer's; once it is not, nothing
    more is written and :meth:`save`, :meth:`check` and :meth:`close` raise
    ``CheckpointFenced`` (``fenced``), never a write failure: a trainer replaced while
    it wrote is not the only writer, whatever its write met."""

    def __init__(self, directory: str | os.PathLike[str], keep: int, max_failures: int = 1) -> None:
        if max_failures < 1:
            raise ValueError("max_failures must be >= 1")
        self.directory = Path(directory)
        self.keep = keep
        self.max_failures = max_failures
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._inflight: Future | None = None
        self.last_written: CheckpointInfo | None = None
        self.last_error: BaseException | None = None
        self.failures_in_a_row = 0
        # step -> weights hash of the step log: what pruning trusts, and the steps
        # that may be written.
        self.logged: dict[int, str] | None = None
        self.ownership: FolderOwnership | None = None
        self.fenced: CheckpointFenced | None = None

    def claim(self, ownership: FolderOwnership) -> None:
        """Own the folder (call right after the trainer's producer fenced the older
        ones, before anything is written), then clean what dead writers left."""
        self.ownership = ownership
        try:
            ownership.claim()
        except CheckpointFenced as exc:
            self.fenced = exc
            raise
        except OSError as exc:  # an unwritable folder stops the trainer before it trains
            raise CheckpointError(f"cannot use checkpoint folder {self.directory}: {exc}") from None
        clean_temporaries(self.directory, ownership)

    def adopt_log(self, logged: Mapping[int, str]) -> None:
        """The step log as read at start-up (step -> weights hash); steps committed
        later are added with :meth:`confirm`."""
        self.logged = dict(logged)

    def confirm(self, step: int, weights_hash: str) -> None:
        """Step ``step`` is in the log now (its transaction committed)."""
        if self.logged is not None:
            self.logged[step] = weights_hash

    def save(self, snapshot: dict[str, Any], weights_hash: str) -> Future:
        """Queue a write of ``snapshot`` (already CPU copies) of a logged step; returns
        at once unless the previous write is still running. With an adopted log, a step
        it does not hold with this hash is refused (``CheckpointError``): a checkpoint
        only ever holds state the log committed."""
        self.wait()
        step = int(snapshot["step"])
        if self.logged is not None and self.logged.get(step) != weights_hash:
            raise CheckpointError(f"step {step} with weights hash {weights_hash[:16]} is not in the step log: "
                                  "no checkpoint is written of a step the log did not commit")
        self._inflight = self._pool.submit(self._write, snapshot, weights_hash)
        return self._inflight

    def _write(self, snapshot: dict[str, Any], weights_hash: str) -> CheckpointInfo:
        started = time.perf_counter()
        step = int(snapshot["step"])
        ownership = self.ownership
        try:
            path = write_checkpoint(self.directory, snapshot, weights_hash, ownership)
            logged = dict(self.logged) if self.logged is not None else None
            if ownership is not None:
                ownership.check()
            removed = prune(self.directory, self.keep, logged, current=step, ownership=ownership)
        except BaseException as exc:
            why = exc if isinstance(exc, CheckpointFenced) else None
            if why is None and ownership is not None and ownership.newer_owner() is not None:
                # The write failed because a newer trainer took the folder over (e.g. it
                # cleaned up after this one while it was frozen): fenced, not a failure.
                why = CheckpointFenced(f"{ownership.newer_owner()}; this trainer's write of step {step} met: {exc}")
            if why is not None:
                self.fenced = why
                log.error("checkpoint not written: another trainer owns the folder", step=step,
                          directory=str(self.directory), error=str(why))
                raise why from None
            self.last_error = exc
            self.failures_in_a_row += 1
            log.error("checkpoint write failed", step=step, directory=str(self.directory), error=str(exc),
                      failures_in_a_row=self.failures_in_a_row, max_failures=self.max_failures)
            raise
        self.failures_in_a_row = 0
        self.last_error = None
        info = CheckpointInfo(step, int(snapshot["weight_version"]), weights_hash, path)
        self.last_written = info
        log.info("checkpoint written", step=info.step, path=str(path), seconds=round(time.perf_counter() - started, 3),
                 pruned=[p.name for p in removed])
        return info

    def check(self) -> None:
        """Raise ``CheckpointFenced`` once superseded, ``CheckpointError`` when too many
        writes in a row have failed."""
        inflight = self._inflight
        if inflight is not None and inflight.done():
            self.wait()
        if self.fenced is not None:
            raise self.fenced
        if self.failures_in_a_row >= self.max_failures:
            raise CheckpointError(
                f"{self.failures_in_a_row} checkpoint write(s) in a row failed in {self.directory}: "
                f"{self.last_error}; stopping rather than training on with nothing to restart from "
                f"(fix the folder or disk, then restart: the log replays the steps since the last checkpoint)"
            )

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; raises ``CheckpointError``
        once ``max_failures`` writes in a row have failed."""
        if self._inflight is not None:
            try:
                self._inflight.result()
            except BaseException:
                pass  # counted and logged in _write
            self._inflight = None
        if self.fenced is not None or self.failures_in_a_row >= self.max_failures:
            self.check()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
