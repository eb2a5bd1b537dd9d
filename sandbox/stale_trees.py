"""Trees a killed sandbox service left behind, swept when a service starts.

A service killed with SIGKILL (a crash, the chaos run's ``sandbox`` fault) releases
nothing: the trees of its open sessions (``rollway-ws-*``, sandbox/sessions.py), its
commands' private /tmp (``rollway-tmp-*``, sandbox/runner.py) and its gradings
(``rollway-grade-*``, sandbox/grader.py) stay in ``workspace_root``, with their tmpfs
and overlay mounts still on the host. A restarted service made new ones beside them.

Whose a tree is comes from the uid claims (sandbox/uid_claim.py), never from its age: a
tree is made for a sandbox uid, and the 1,000-uid block that uid lies in is claimed by
a ``flock`` its service holds while it lives. A tree whose uid's block no live service
holds (the lock is free, or there never was one) is stale; a tree in one of this
service's own blocks is one its predecessor left (the sweep runs before this service
makes any). A live service's trees (two services sharing a root) are left alone, and so
is a tree whose uid cannot be told (one still being made is root's until it is handed to
its uid). While a dead block's trees are removed its claim is held, so no service
starting meanwhile makes trees in it.

A tree is renamed to ``rollway-swept-<its name>`` before it is removed: a sweep killed
half-way (removal goes bottom up, so what is left of a grading's tree is the root-owned
folders above its uid's tree, whose uid can no longer be told) leaves remains that the
next sweep recognises by name and removes, whatever their owner. Only a sweep holding
the tree's block renames, so nothing of a live service ever carries that name.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

import structlog

from sandbox import quota as disk
from sandbox.uid_claim import LOCK_DIR, MAX_RANGES, RANGE_STRIDE, UidClaim, block_of, try_claim_blocks

log = structlog.get_logger(__name__)

# The self-check's tree (sandbox/service.py) is a session tree of the service's first uid:
# a service killed during its self-check leaves it.
PREFIXES = ("rollway-ws-", "rollway-tmp-", "rollway-grade-", "rollway-selfcheck-")
SWEPT_PREFIX = "rollway-swept-"
# How deep below a tree its uid is looked for: an image session's tree is at
# ``base/tree`` or ``base/q/tree``, a grading's at ``grade/area/ws/tree`` (the folders
# above are root's).
_OWNER_DEPTH = 3


def sweep(root: Path, *, own: UidClaim, uid_base: int, solution_uid_offset: int,
          lock_dir: Path = LOCK_DIR) -> int:
    """Unmount and remove the stale trees under ``root``; returns how many. ``uid_base``:
    the configured one (ranges start there); ``own``: this service's claim."""
    root = Path(os.path.realpath(root))  # as /proc/self/mountinfo names it
    swept = _remove_remains(root)
    # By the block of the tree's uid, not by the range it maps to: every live service
    # holds every block its uids lie in, so a free block (or one of this service's) holds
    # no live service's tree. Claiming the whole range failed wherever one of its other
    # blocks was held (this service's own, when uid_base is not a multiple of
    # RANGE_STRIDE), and the dead range's trees stayed as "a live service's".
    trees: dict[int, list[tuple[Path, int, int]]] = {}
    for path in root.iterdir():
        if not path.name.startswith(PREFIXES):
            continue
        uid = _owner(path)
        base = _range(uid, uid_base, solution_uid_offset) if uid is not None else None
        if base is not None:
            trees.setdefault(block_of(uid), []).append((path, uid, base))
    for block, found in trees.items():
        if block in own.blocks:
            claim, reason = None, "this service's uid range: left by the service before it"
        else:
            claimed_once = (lock_dir / f"uids-{block}.lock").exists()
            claim = try_claim_blocks(block, [block], lock_dir)
            if claim is None:
                continue  # a live service's
            reason = ("no live service holds its uid block's claim" if claimed_once
                      else "its uid block was never claimed")
        try:
            mounts = _mount_points()
            for path, uid, base in found:
                try:
                    inside = _unmount_inside(path, mounts)
                except disk.QuotaError as exc:  # not root: the service starts, the tree stays
                    log.warning("stale_tree_kept", path=str(path), uid=uid, error=str(exc))
                    continue
                if not _remove(path):  # (a link in its place, or rmtree refused: nothing swept)
                    log.warning("stale_tree_kept", path=str(path), uid=uid, error="could not be removed")
                    continue
                # A warning: a service before this one died without releasing its trees.
                log.warning("stale_tree_swept", path=str(path), uid=uid, uid_range=base, uid_block=block,
                            reason=reason, mounts=len(inside))
                swept += 1
        finally:
            if claim is not None:
                claim.release()
    return swept


def _unmount_inside(tree: Path, mounts: list[Path]) -> list[Path]:
    """Unmount every mount at or below ``tree``; returns them. Innermost first (an overlay
    on its tmpfs); lazily (MNT_DETACH), so a mount something still holds open goes too.
    Raises QuotaError where this process may not unmount (not root)."""
    inside = [m for m in mounts if m == tree or tree in m.parents]
    for point in sorted(inside, key=lambda m: len(m.parts), reverse=True):
        disk.unmount(point)
    return inside


def _remove(tree: Path) -> bool:
    """Rename ``tree`` to its swept name, then remove it; False if anything of it is left
    (a link in its place is neither renamed nor followed)."""
    if tree.is_symlink() or not tree.is_dir():
        return False
    doomed = tree.with_name(SWEPT_PREFIX + tree.name)
    try:
        os.rename(tree, doomed)
    except OSError:
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    return not os.path.lexists(doomed)


def _remove_remains(root: Path) -> int:
    """Remove what sweeps killed half-way left (``rollway-swept-*``); returns how many."""
    removed = 0
    mounts = _mount_points()
    for path in root.iterdir():
        if not path.name.startswith(SWEPT_PREFIX) or path.is_symlink():
            continue
        try:
            inside = _unmount_inside(path, mounts)
        except disk.QuotaError as exc:
            log.warning("stale_tree_kept", path=str(path), error=str(exc))
            continue
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            log.warning("stale_tree_kept", path=str(path), error="could not be removed")
            continue
        log.warning("stale_tree_swept", path=str(path), uid=None, reason="the remains of a sweep killed half-way",
                    mounts=len(inside))
        removed += 1
    return removed


def _owner(tree: Path) -> int | None:
    """The sandbox uid ``tree`` was made for: its owner, or the first owner other than root
    (and this process) below it, breadth first, never following a link; None if none."""
    level, mine = [tree], {0, os.geteuid()}
    for _ in range(_OWNER_DEPTH + 1):
        below = []
        for path in level:
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_uid not in mine:
                return st.st_uid
            if stat.S_ISDIR(st.st_mode):
                try:
                    below += sorted(Path(e.path) for e in os.scandir(path))
                except OSError:
                    continue
        level = below
    return None


def _range(uid: int, uid_base: int, solution_uid_offset: int) -> int | None:
    """The base of the claimable range ``uid`` is in (a session uid, or a grading's
    solution uid ``+ solution_uid_offset``), or None (no range of ``uid_base``'s)."""
    for session_uid in (uid, uid - solution_uid_offset):
        k = (session_uid - uid_base) // RANGE_STRIDE
        if 0 <= k < MAX_RANGES:
            return uid_base + k * RANGE_STRIDE
    return None


def _mount_points() -> list[Path]:
    """Every mount point in this process's mount namespace (octal escapes undone)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        points.append(Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split(" ")[4])))
    return points
