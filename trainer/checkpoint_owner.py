"""Who may write in a checkpoint folder: the trainer that owns the step log.

Only one trainer may append to the step log: the one whose transactional producer the
broker started last (it fenced every older one). The checkpoint folder follows the same
order. Its ownership token is that producer's ``(producer id, epoch)``: the broker keeps
the producer id of a transactional id and bumps the epoch at every start, so of two
trainers of one id the higher epoch is the newer.

Each trainer, right after its producer started (and fenced the older ones), drops a
marker ``<dir>/.owner-p<id>-e<epoch>`` into the folder and removes the markers of older
owners (a lower epoch of its producer id, or another producer id: a topic reset or an
expired transactional id, both older than the trainer starting now). A trainer is
superseded, and may write nothing more there, when its own marker is gone or a marker of
its producer id with a higher epoch is present (:meth:`FolderOwnership.check` raises
:class:`CheckpointFenced`). Checks are file reads, so the checkpoint thread makes them
before writing, before renaming a checkpoint in and before pruning.

Folders a writer is still working in (``.step-N.tmp-<token>-<pid>-<thread>``) hold an
exclusive ``flock`` for as long as the writer lives, also while it is stopped
(SIGSTOP): cleanup removes only the ones nobody holds (a dead writer's), so one
trainer's cleanup never pulls a folder from under another that may still live.
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

MARKER = ".owner-"
_TOKEN = re.compile(r"p(-?\d+)-e(-?\d+)")


class CheckpointFenced(RuntimeError):
    """A newer trainer owns the checkpoint folder (it started after this one and fenced
    it): this trainer writes nothing more and stops, like a fenced producer."""


@dataclass(frozen=True)
class Owner:
    producer_id: int
    epoch: int

    @property
    def token(self) -> str:
        return f"p{self.producer_id}-e{self.epoch}"

    @classmethod
    def parse(cls, text: str) -> "Owner | None":
        """The owner a token names (at the start of ``text``), None for none."""
        m = _TOKEN.match(text)
        return cls(int(m.group(1)), int(m.group(2))) if m else None

    def newer_than(self, other: "Owner") -> bool:
        return self.producer_id == other.producer_id and self.epoch > other.epoch


def owner_of_producer(producer) -> Owner:
    """The ownership token of a started transactional ``EventProducer``."""
    from bus.clients import transaction_manager

    txn = transaction_manager(producer.raw)
    if txn is None or txn.producer_id < 0:
        raise ValueError("a checkpoint folder is owned through a started transactional producer")
    return Owner(int(txn.producer_id), int(txn.producer_epoch))


class FolderOwnership:
    """This trainer's claim on a checkpoint folder (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], owner: Owner) -> None:
        self.directory = Path(directory)
        self.owner = owner
        self.marker = self.directory / f"{MARKER}{owner.token}"

    def claim(self) -> None:
        """Mark the folder as this trainer's and remove older owners' markers. Raises
        ``CheckpointFenced`` when a newer owner is already there."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.marker, os.O_WRONLY | os.O_CREAT, 0o644)
        os.close(fd)
        for other, path in self._markers():
            if other != self.owner and not other.newer_than(self.owner):
                path.unlink(missing_ok=True)
        _fsync_dir(self.directory)
        self.check()
        log.info("checkpoint folder claimed", directory=str(self.directory), owner=self.owner.token)

    def newer_owner(self) -> str | None:
        """Why this trainer no longer owns the folder, or None while it does."""
        markers = self._markers()
        newer = [o for o, _ in markers if o.newer_than(self.owner)]
        if newer:
            return f"trainer {max(newer, key=lambda o: o.epoch).token} owns it now (this one is {self.owner.token})"
        if not self.marker.exists():
            return f"this trainer's marker {self.marker.name} was removed by a newer trainer"
        return None

    def check(self) -> None:
        why = self.newer_owner()
        if why is not None:
            raise CheckpointFenced(f"checkpoint folder {self.directory}: {why}; this trainer writes no checkpoint "
                                   "and stops (another trainer replaced it)")

    def may_remove(self, token_text: str) -> bool:
        """Whether what an owner named by ``token_text`` left may be removed by this
        trainer: anything but a newer owner's (a name without a token is an older
        build's)."""
        other = Owner.parse(token_text)
        return other is None or not other.newer_than(self.owner)

    def _markers(self) -> list[tuple[Owner, Path]]:
        out = []
        for child in self.directory.iterdir() if self.directory.is_dir() else ():
            if child.name.startswith(MARKER):
                other = Owner.parse(child.name[len(MARKER):])
                if other is not None:
                    out.append((other, child))
        return out


def hold(folder: Path) -> int:
    """Lock ``folder`` for as long as the returned descriptor is open (its writer
    lives): cleanup leaves a held folder alone."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def held_by_a_live_writer(folder: Path) -> bool:
    """Whether a live process (running or stopped) holds ``folder`` (see ``hold``)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the lock taken just now
    return False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
