"""A uid range of one's own: no two sandbox services on a host run commands as the same uids.

A session's commands run as ``uid_base + slot``, and cleaning up after a command kills
every process of that uid on the host (``runner.reap_uid``). Two services with the same
``uid_base`` on one host (``rollway up`` and ``rollway eval``'s sandbox, a test suite
beside a running stack) therefore killed each other's commands: SIGKILLed gradings,
exit 137 with no report. Each service now claims a range with an exclusive ``flock`` on
a per-range lock file, held for its lifetime (the kernel drops it when the process dies,
so a crashed service's claim needs no clean-up; the trees it left are swept by the next
service, sandbox/stale_trees.py, which tells whose a tree is by these claims). Ranges are
``RANGE_STRIDE`` uids apart from ``uid_base``; the grader's solution uids
(``+ grading_solution_uid_offset``) move with them. A claim locks every
``RANGE_STRIDE``-aligned block of uids its range touches, its solution uids' too
(``blocks_of``), so services configured with different ``uid_base`` values exclude each
other wherever their uids would meet.

The claims are only as good as their folder. Whoever can replace a lock file can make two
services hold "the same" range (each flocks its own inode), and then they kill each
other's commands and sweep each other's trees as stale. A root service's claims
therefore live in ``/run`` (root's, cleared at boot) rather than ``/tmp``, where any
local user could create the folder first; whatever folder is used (also
``ROLLWAY_UID_LOCK_DIR``), it must be a real folder owned by this user and writable by
no one else, in folders that no other user can change either (whoever can write the
folder above it can rename it away, and the next service claims in a fresh one), and a
lock file that is a symbolic link is refused rather than followed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
from pathlib import Path
from typing import IO

import structlog

log = structlog.get_logger(__name__)

RANGE_STRIDE = 1000  # uids per range: room for max_sessions and the tests' fixed offsets
MAX_RANGES = 16


def default_lock_dir() -> Path:
    """``ROLLWAY_UID_LOCK_DIR``, else ``/run/rollway-sandbox-uids`` for root (the service
    that runs commands as other uids), else a folder of this user's in the temp dir."""
    configured = os.environ.get("ROLLWAY_UID_LOCK_DIR")
    if configured:
        return Path(configured)
    if os.geteuid() == 0:
        return Path("/run/rollway-sandbox-uids")
    return Path(tempfile.gettempdir()) / f"rollway-sandbox-uids-{os.geteuid()}"


LOCK_DIR = default_lock_dir()


class UidRangesExhausted(RuntimeError):
    pass


class UnsafeLockDir(RuntimeError):
    """The claims' folder or a lock file in it could be replaced by another user."""


class LockDirUnusable(RuntimeError):
    """The claims' folder or a lock file in it cannot be made (a read-only /run)."""


def _unusable(path: Path, what: str, exc: OSError) -> LockDirUnusable:
    # A refusal like an unsafe folder's (`rollway sandbox` prints it and exits 2), not an
    # OSError traceback from deep in the service's start.
    return LockDirUnusable(f"cannot make the sandbox uid claims {what} {path}: {exc.strerror}; set "
                           f"ROLLWAY_UID_LOCK_DIR to a folder only this user can write")


def checked_lock_dir(lock_dir: Path) -> Path:
    """``lock_dir``, made if missing (0700); refused unless it is a real folder owned by
    this user and not writable by group or others."""
    try:
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:  # a file, or a dangling link, in its place
        pass
    except OSError as exc:  # (root's /run read-only)
        raise _unusable(lock_dir, "folder", exc) from None
    st = os.lstat(lock_dir)
    problem = ""
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this service's uid {os.geteuid()}"
    elif st.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    else:
        problem = _replaceable_from_above(lock_dir)
    if problem:
        raise UnsafeLockDir(f"sandbox uid claims folder {lock_dir} {problem}: another user could replace its lock "
                            f"files and make two services share uids; remove it or set ROLLWAY_UID_LOCK_DIR to a "
                            f"folder only this user can write")
    return lock_dir


def _replaceable_from_above(lock_dir: Path) -> str:
    """Why another user could swap ``lock_dir`` for a folder of its own making, or "".

    Whoever can write a folder above it can rename the claims' folder away (no race
    needed: the next service makes a fresh one and claims a range a live service holds)
    or swap it between the check and the open. Every folder on the way, as named and
    with its links resolved (a link is changed through the folder it is in), must be
    root's or this user's and writable by no one else, unless sticky (as /tmp: others
    cannot rename what is not theirs in it)."""
    named = Path(os.path.abspath(lock_dir)).parents
    resolved = Path(os.path.realpath(lock_dir.parent))
    for folder in dict.fromkeys([*named, resolved, *resolved.parents]):
        st = os.lstat(folder)
        if stat.S_ISLNK(st.st_mode):
            continue  # its folder is checked, and where it leads is among the resolved ones
        if st.st_uid not in (0, os.geteuid()):
            return (f"is in a folder another user could change: the folder above it, {folder}, is owned by uid "
                    f"{st.st_uid}")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"is in a folder another user could change: the folder above it, {folder}, is writable by group "
                    f"or others without the sticky bit (mode {stat.S_IMODE(st.st_mode):o})")
    return ""


def open_lock_file(path: Path):
    """The lock file, created 0600 if missing; a symbolic link in its place is refused."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeLockDir(f"sandbox uid claim {path} is a symbolic link: refused (a claim must be its own "
                                f"file)") from None
        raise _unusable(path, "file", exc) from None
    return os.fdopen(fd, "ab")


class UidClaim:
    """The claimed base uid; ``release()`` (or process exit) frees the range."""

    def __init__(self, base: int, blocks: list[int], locks: list[IO[bytes]]) -> None:
        self.base = base
        self.blocks = blocks  # the first uids of the blocks whose locks it holds
        self._locks = locks

    def release(self) -> None:
        for lock in self._locks:
            lock.close()  # closing the descriptor drops the flock
        self._locks = []


def block_of(uid: int) -> int:
    """The first uid of the ``RANGE_STRIDE``-aligned block ``uid`` lies in."""
    return (uid // RANGE_STRIDE) * RANGE_STRIDE


def blocks_of(base: int, solution_uid_offset: int = 0) -> list[int]:
    """The first uids of the ``RANGE_STRIDE``-aligned blocks a range at ``base`` touches:
    its session uids ``[base, base + RANGE_STRIDE)`` and, with a grader, its solution
    uids (``+ solution_uid_offset``). Claims lock blocks, not bases, so two services
    configured with other uid_bases (60000 and 80000, whose solution uids are the other's
    session uids; 60000 and 60500) still never share a uid."""
    starts = [base] + ([base + solution_uid_offset] if solution_uid_offset else [])
    return sorted({block_of(u) for start in starts for u in (start, start + RANGE_STRIDE - 1)})


def claim_uid_range(uid_base: int, sessions: int, lock_dir: Path = LOCK_DIR, *,
                    solution_uid_offset: int = 0) -> UidClaim:
    """The first free range at ``uid_base + k * RANGE_STRIDE`` (k < MAX_RANGES)."""
    if sessions > RANGE_STRIDE // 2:
        raise ValueError(f"sandbox.max_sessions {sessions} does not fit a uid range of {RANGE_STRIDE}")
    for k in range(MAX_RANGES):
        base = uid_base + k * RANGE_STRIDE
        claim = try_claim(base, lock_dir, solution_uid_offset=solution_uid_offset)
        if claim is None:
            continue
        if k:
            log.info("sandbox_uid_range_shifted", uid_base=base, configured=uid_base,
                     reason="another sandbox service on this host holds the lower ranges")
        return claim
    raise UidRangesExhausted(f"all {MAX_RANGES} sandbox uid ranges from {uid_base} are held by other "
                             f"sandbox services on this host (locks in {lock_dir})")


def try_claim(base: int, lock_dir: Path = LOCK_DIR, *, solution_uid_offset: int = 0) -> UidClaim | None:
    """The range at ``base`` (every block it touches), or None while a live service holds
    any of them (its lock is taken)."""
    return try_claim_blocks(base, blocks_of(base, solution_uid_offset), lock_dir)


def try_claim_blocks(base: int, blocks: list[int], lock_dir: Path = LOCK_DIR) -> UidClaim | None:
    """Every one of ``blocks`` (for the range at ``base``), or None while a live service
    holds any of them."""
    folder = checked_lock_dir(lock_dir)
    locks: list[IO[bytes]] = []
    claimed = False
    try:
        for block in blocks:
            locks.append(open_lock_file(folder / f"uids-{block}.lock"))
            try:
                fcntl.flock(locks[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # a live service holds this block
        claimed = True
        return UidClaim(base, list(blocks), locks)
    finally:
        # Held, refused or failed part-way (a lock file that cannot be opened): the blocks
        # taken so far are dropped now, not whenever an exception's frames are collected.
        if not claimed:
            for lock in locks:
                lock.close()
