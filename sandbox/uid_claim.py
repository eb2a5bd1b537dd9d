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
(``+ grading_solution_uid_offset``) move with them.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

import structlog

log = structlog.get_logger(__name__)

RANGE_STRIDE = 1000  # uids per range: room for max_sessions and the tests' fixed offsets
MAX_RANGES = 16
LOCK_DIR = Path(os.environ.get("ROLLWAY_UID_LOCK_DIR", "/tmp/rollway-sandbox-uids"))


class UidRangesExhausted(RuntimeError):
    pass


class UidClaim:
    """The claimed base uid; ``release()`` (or process exit) frees the range."""

    def __init__(self, base: int, lock: IO[bytes]) -> None:
        self.base = base
        self._lock: IO[bytes] | None = lock

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the descriptor drops the flock
            self._lock = None


def claim_uid_range(uid_base: int, sessions: int, lock_dir: Path = LOCK_DIR) -> UidClaim:
    """The first free range at ``uid_base + k * RANGE_STRIDE`` (k < MAX_RANGES)."""
    if sessions > RANGE_STRIDE // 2:
        raise ValueError(f"sandbox.max_sessions {sessions} does not fit a uid range of {RANGE_STRIDE}")
    for k in range(MAX_RANGES):
        base = uid_base + k * RANGE_STRIDE
        claim = try_claim(base, lock_dir)
        if claim is None:
            continue
        if k:
            log.info("sandbox_uid_range_shifted", uid_base=base, configured=uid_base,
                     reason="another sandbox service on this host holds the lower ranges")
        return claim
    raise UidRangesExhausted(f"all {MAX_RANGES} sandbox uid ranges from {uid_base} are held by other "
                             f"sandbox services on this host (locks in {lock_dir})")


def try_claim(base: int, lock_dir: Path = LOCK_DIR) -> UidClaim | None:
    """The range at ``base``, or None while a live service holds it (its lock is taken)."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    lock = open(lock_dir / f"uids-{base}.lock", "ab")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return UidClaim(base, lock)
