"""Kernel-enforced disk quota of a workspace: a size-limited tmpfs mounted on its folder.

Each session workspace (and each grading folder) is its own tmpfs with ``size=`` and
``nr_inodes=`` limits, mounted by the service (root) before anything is written, so a
command that fills it gets ENOSPC from the kernel, at once, whatever it writes (one big
file, or many files each under the per-file limit), and no other session or the host's
disk is touched. Unmounting frees it in one step, however many files it holds. Each
command's private /tmp is a tmpfs with a size limit too (bwrap ``--size``,
:mod:`sandbox.isolation`).

tmpfs lives in memory (and swap): only pages actually written count, so the limits are
ceilings, not reservations; ``workspace_bytes * max_sessions`` bounds the total.
Not polling: nothing here watches usage; :func:`is_full` only reads statvfs after a
command, to report ``disk`` among the limits it ran into.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import msgspec

MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2
# Free space below this after a command means the command ran into the quota (a write
# that fails with ENOSPC leaves at most a partial page or block behind).
_FULL_MARGIN_BYTES = 64 * 1024

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class Quota(msgspec.Struct, frozen=True, kw_only=True):
    size_bytes: int
    inodes: int


class QuotaError(RuntimeError):
    pass


def mount(path: Path, quota: Quota, *, uid: int) -> None:
    """Mount a fresh tmpfs of ``quota`` on the (existing, empty) folder ``path``, its
    root owned by ``uid`` with mode 0755."""
    options = f"size={quota.size_bytes},nr_inodes={quota.inodes},mode=0755,uid={uid},gid={uid}"
    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()) != 0:
        err = ctypes.get_errno()
        raise QuotaError(f"cannot mount the workspace quota (tmpfs {options}) on {path}: {os.strerror(err)}")


def unmount(path: Path) -> None:
    """Detach the tmpfs (its files go with it); a no-op when nothing is mounted there."""
    if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone
            raise QuotaError(f"cannot unmount the workspace quota on {path}: {os.strerror(err)}")


def is_full(path: Path) -> bool:
    """Whether the filesystem holding ``path`` has (almost) no space or no inodes left."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < _FULL_MARGIN_BYTES or (st.f_files > 0 and st.f_favail == 0)


def available() -> bool:
    """Mounting needs root (CAP_SYS_ADMIN in the service's mount namespace)."""
    return os.geteuid() == 0
