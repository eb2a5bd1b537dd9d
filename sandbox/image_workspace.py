"""A session's tree over an image: a copy-on-write layer on the image's working directory.

The image's root is shared and read-only (sandbox/images.py). A session of an image task
gets, at the task's ``workdir``, the image's tree at that path plus the session's
changes, under the session's disk quota:

- ``overlay`` (the service is root): a tmpfs of the workspace quota holds the overlay's
  upper and work directories, and kernel overlayfs merges them over the image's
  directory (``metacopy=on``: handing the tree to the session's uid copies up metadata
  only, no file data). Writes land in the upper layer, so a session costs what it
  changed (O(diff)), not the image's size; the image itself is never written.
- ``copy`` (overlay refused, e.g. without root): the image's directory (only the
  workdir, never the whole image) is copied (``cp --reflink=auto``: a reflink where the
  filesystem has them, else a full copy) and cut down to a working tree: no device
  nodes, FIFOs or sockets, no setuid/setgid bits. With a quota the copy is not charged
  to it (the tmpfs is sized to the copy plus the quota). The log line
  ``image_workspace`` says which mode.

Version-control entries at any depth (``.git``, a submodule's or a vendored copy's
``.git`` file or folder, ``.hg``...) are hidden (an overlay whiteout, or removed from the
copy): no history for the agent to mine, as for host workspaces. Both modes show the
session a working tree only: the image's device nodes, FIFOs and sockets under the
workdir are hidden (whiteouts) or removed, and its setuid/setgid files lose those bits
(a metadata-only copy-up in the overlay; the image is never changed).
Everything is reached without following the image's links on the host
(:func:`sandbox.image_unpack.resolve_in_root`, ``lchown``).
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import shutil
import stat
import subprocess
from pathlib import Path, PurePosixPath

import msgspec
import structlog

from sandbox import quota as disk
from sandbox.image_unpack import resolve_in_root
from sandbox.images import ImageError, ImageRoot
from sandbox.workspace import VCS_DIRS, Workspace, WorkspaceError, clean_relpath

log = structlog.get_logger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)  # the overlay mount (tests refuse it to force a copy)
_tmpfs = ctypes.CDLL(None, use_errno=True)  # remounting a copy's quota
_MS_REMOUNT = 0x20


class ImageWorkspace(Workspace):
    """A workspace whose ``root`` is an overlay (or a copy) of an image's directory."""

    def __init__(self, root: Path, uid: int, *, base: Path, mounts: list[Path], mode: str,
                 lower: Path | None = None) -> None:
        super().__init__(root, uid, mounted=False)
        self.base = base
        self.mounts = mounts  # unmounted in this order (overlay first, then its tmpfs)
        self.mode = mode
        self.lower = lower  # the image's directory the tree was made from (read-only)

    def base_file(self, rel: str) -> bytes | None:
        """The image's regular file at ``rel`` under the workdir, reached without following
        any link (the image's links lead into the image's root, not the host's): the
        snapshot's limits do not count the image's untouched files."""
        if self.lower is None:
            return None
        *dirs, name = rel.split("/")
        try:
            dfd = os.open(self.lower, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            for part in dirs:
                sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                os.close(dfd)
                dfd = sub
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except OSError:
            os.close(dfd)
            return None
        os.close(dfd)
        # Checked before fdopen, which refuses a folder (IsADirectoryError): an agent's file
        # where the image has a folder (``tests`` made a file) failed the snapshot, HTTP 500.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def remove(self) -> None:
        for path in self.mounts:
            disk.unmount(path)
        self.mounts = []
        shutil.rmtree(self.base, ignore_errors=True)


def image_dir(root: ImageRoot, workdir: str) -> Path | None:
    """The host path of ``workdir`` inside the image (None: the image has no such
    directory, and the session starts empty there). A workdir whose parent is missing
    under an image directory cannot be a mount point: refused."""
    if PurePosixPath(workdir) == PurePosixPath("/"):
        raise ImageError(root.ref, "workdir / is the image's whole root; a workdir is a folder in it", "workdir")
    found = resolve_in_root(Path(root.rootfs), workdir)
    if found is not None and found.is_dir() and not found.is_symlink():
        return found
    if found is not None:
        raise ImageError(root.ref, f"workdir {workdir} is not a directory in the image", "workdir")
    top = Path(workdir).parts[1:2]
    if top and len(Path(workdir).parts) > 2 and os.path.lexists(os.path.join(root.rootfs, top[0])):
        raise ImageError(root.ref, f"workdir {workdir} does not exist in the image, and its parent is part of "
                                   f"the read-only image", "workdir")
    return None


class LowerFacts(msgspec.Struct, frozen=True):
    vcs: tuple[str, ...]  # version-control entries at any depth, relative (not entered)
    bytes: int  # what a copy of the rest takes on a tmpfs (files rounded up to pages)
    inodes: int
    special: tuple[str, ...] = ()  # device nodes, FIFOs, sockets (no working tree holds them)
    setid: tuple[str, ...] = ()  # regular files with the setuid or setgid bit


_FACTS: collections.OrderedDict[tuple[str, str], LowerFacts] = collections.OrderedDict()
_FACTS_LOCK = threading.Lock()
_PAGE = 4096


def lower_facts(root: ImageRoot, workdir: str, lower: Path) -> LowerFacts:
    """The image's ``workdir`` (``lower``): its version-control entries, and the size of
    the rest. Kept per image digest: an unpacked root never changes."""
    key = (f"{root.digest}:{root.rootfs}", workdir)
    with _FACTS_LOCK:
        if key in _FACTS:
            _FACTS.move_to_end(key)
            return _FACTS[key]
    vcs: list[str] = []
    special: list[str] = []
    setid: list[str] = []
    size = inodes = 0
    for folder, dirs, names in os.walk(lower, followlinks=False):
        rel = os.path.relpath(folder, lower)
        for name in sorted(dirs + names):
            path = name if rel == "." else f"{rel}/{name}"
            if name in VCS_DIRS:
                vcs.append(path)
                continue
            inodes += 1
            st = os.lstat(os.path.join(folder, name))
            if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                size += -(-st.st_size // _PAGE) * _PAGE
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISFIFO(st.st_mode) \
                    or stat.S_ISSOCK(st.st_mode):
                special.append(path)
            elif stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                setid.append(path)
        dirs[:] = [d for d in dirs if d not in VCS_DIRS]
    facts = LowerFacts(vcs=tuple(vcs), bytes=size, inodes=inodes, special=tuple(special), setid=tuple(setid))
    with _FACTS_LOCK:
        _FACTS[key] = facts
        while len(_FACTS) > 64:
            _FACTS.popitem(last=False)
    return facts


def create(base: Path, uid: int, files: dict[str, str | bytes], quota: disk.Quota | None, root: ImageRoot,
           workdir: str, *, removed: tuple[str, ...] = (), links: dict[str, str] | None = None,
           ) -> tuple[Workspace, list[str]]:
    """The session tree at ``base`` (must not exist): the image's ``workdir`` copy-on-write,
    less the image's entries in ``removed``, then ``files`` written over it (an image
    link at a file's path is replaced by the file), then ``links`` made where nothing is
    (grading redoing an agent's tree, sandbox/image_changes.py). Returns the workspace
    and the paths dropped (VCS)."""
    lower = image_dir(root, workdir)
    base.mkdir(mode=0o700)
    mounts: list[Path] = []
    try:
        area = base / "q"
        area.mkdir(mode=0o700)
        if quota is not None:
            disk.mount(area, quota, uid=0)
            mounts.insert(0, area)
        if lower is None:
            tree, mode = area / "tree", "empty"
            tree.mkdir(mode=0o755)
        else:
            facts = lower_facts(root, workdir, lower)
            tree, mode = _overlay(base, area, lower, mounts, facts.vcs + facts.special)
            if mode != "overlay":
                _copy(area, tree, lower, mode, facts, quota)
                mode = "copy"
        _chown_tree(tree, uid)
        if mode == "overlay":
            _clear_setid(tree, facts.setid)
        ws = ImageWorkspace(tree, uid, base=base, mounts=mounts, mode=mode, lower=lower)
    except BaseException:
        for path in mounts:
            disk.unmount(path)
        shutil.rmtree(base, ignore_errors=True)
        raise
    try:
        for path in removed:
            ws.unlink(path)
        _prune_emptied(ws, removed)
        dropped = write_files(ws, files)
        for path, target in (links or {}).items():
            ws.symlink(path, target)
    except BaseException:
        ws.remove()
        raise
    log.info("image_workspace", image=root.ref, workdir=workdir, mode=mode, files=len(files))
    return ws, dropped


def write_files(ws: Workspace, files: dict[str, str | bytes]) -> list[str]:
    """Write a task's files over the tree (a link of the image where a file goes is
    replaced, never followed); returns the paths dropped (VCS metadata)."""
    dropped = []
    for path, content in files.items():
        try:
            rel = clean_relpath(path)
        except WorkspaceError as exc:
            if "version-control" in str(exc):
                dropped.append(path)
                continue
            raise
        try:
            ws.write(rel, content)
        except WorkspaceError:
            # A link at the path (O_NOFOLLOW refused it): replaced. Anything else (a
            # link above it, a folder there) is refused again by unlink or the rewrite.
            if not ws.unlink(rel):
                raise
            ws.write(rel, content)
    return dropped


def _prune_emptied(ws: Workspace, removed: tuple[str, ...]) -> None:
    """Folders that held removed entries and are empty now go too (a deleted package
    must not stay importable as an empty namespace package)."""
    folders = sorted({str(Path(p).parent) for p in removed if "/" in p}, key=lambda f: -f.count("/"))
    for folder in folders:
        for sub in [folder, *(str(p) for p in Path(folder).parents if str(p) != ".")]:
            path = ws.root / sub
            if path.is_symlink() or not path.is_dir():
                break
            try:
                path.rmdir()
            except OSError:
                break


def _overlay(base: Path, area: Path, lower: Path, mounts: list[Path], vcs: tuple[str, ...]) -> tuple[Path, str]:
    """Mount the overlay: (the merged tree, ``overlay``); or, refused, (where the copy
    goes, why it was refused). ``vcs``: the image's entries the session must not see
    (version-control entries, device nodes, FIFOs, sockets), each hidden by a whiteout."""
    if os.geteuid() != 0:
        # Mounting (and the whiteout device nodes below) needs root: a rootless service
        # copies. Not tried and refused, as mknod would fail first on an image with .git.
        return area / "tree", "not root"
    upper, work, merged = area / "upper", area / "work", base / "tree"
    for d in (upper, work, merged):
        d.mkdir(mode=0o755)
    for rel in vcs:
        parent = upper
        for part in Path(rel).parts[:-1]:
            parent = parent / part
            if not parent.exists():
                # The upper folder stands for the image's: its mode, and merged with it.
                parent.mkdir(mode=stat.S_IMODE(os.lstat(lower / parent.relative_to(upper)).st_mode))
        os.mknod(upper / rel, stat.S_IFCHR | 0o000, os.makedev(0, 0))  # a whiteout hides it
    options = f"lowerdir={lower},upperdir={upper},workdir={work},metacopy=on"
    if any(c in str(p) for p in (lower, upper, work) for c in ",:"):
        reason = "a path holds ',' or ':'"
    elif _libc.mount(b"overlay", os.fsencode(merged), b"overlay", disk.MS_NOSUID | disk.MS_NODEV,
                     options.encode()) == 0:
        mounts.insert(0, merged)
        return merged, "overlay"
    else:
        reason = os.strerror(ctypes.get_errno())
    shutil.rmtree(merged)
    for d in (upper, work):
        shutil.rmtree(d)
    return area / "tree", reason


def _copy(area: Path, tree: Path, lower: Path, reason: str, facts: LowerFacts, quota: disk.Quota | None) -> None:
    """The ``copy`` fallback: the image's directory copied into the session's area, and
    only what a working tree is: no version-control entries, no device nodes, FIFOs or
    sockets, no setuid/setgid bits (the area is nosuid/nodev anyway; they are dropped so
    that nothing of the kind is handed to the session at all). With a quota, the copy
    is not charged to it: the area is mounted for the copy, then sized to what the copy
    holds plus the quota, so the session can write its quota as with an overlay."""
    log.warning("image_workspace_overlay_refused", reason=reason, fallback="copy")
    if quota is not None:
        disk.unmount(area)
        disk.mount(area, disk.Quota(size_bytes=quota.size_bytes + facts.bytes + (1 << 20),
                                    inodes=quota.inodes + facts.inodes + 16), uid=0)
    proc = subprocess.run(["cp", "-a", "--reflink=auto", "--no-dereference", f"{lower}/.", str(tree)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise WorkspaceError(f"cannot copy the image's tree: {proc.stderr.strip()[-300:]}")
    for rel in facts.vcs:
        path = tree / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
    dropped = _drop_special(tree)
    if dropped:
        log.warning("image_workspace_special_files_dropped", count=len(dropped), paths=dropped[:20])
    if quota is not None:
        st = os.statvfs(area)
        used, used_inodes = (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree
        options = f"size={used + quota.size_bytes},nr_inodes={used_inodes + quota.inodes}"
        if _tmpfs.mount(b"tmpfs", os.fsencode(area), b"tmpfs", _MS_REMOUNT | disk.MS_NOSUID | disk.MS_NODEV,
                        options.encode()) != 0:
            raise WorkspaceError(f"cannot size the copied tree's quota ({options}): "
                                 f"{os.strerror(ctypes.get_errno())}")


def _drop_special(tree: Path) -> list[str]:
    """Remove device nodes, FIFOs and sockets and clear setuid/setgid bits of files in
    a copied tree; returns the paths removed or changed."""
    dropped = []
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISFIFO(st.st_mode) \
                    or stat.S_ISSOCK(st.st_mode):
                os.unlink(path)
                dropped.append(os.path.relpath(path, tree))
            elif stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
                dropped.append(os.path.relpath(path, tree) + " (setuid/setgid)")
    return dropped


def _clear_setid(tree: Path, paths: tuple[str, ...]) -> None:
    """The overlay's view of the image's setuid/setgid files without those bits (a
    metadata-only copy-up; the image is untouched), as in a copy. The overlay is
    nosuid anyway: this keeps what the session sees the same in both modes."""
    for rel in paths:
        path = tree / rel
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
    if paths:
        log.warning("image_workspace_special_files_dropped", count=len(paths), paths=list(paths[:20]))


def _chown_tree(tree: Path, uid: int) -> None:
    """Give the tree to the session's uid, never following a link (``lchown``)."""
    os.lchown(tree, uid, uid)
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)
