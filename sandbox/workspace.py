"""A session's workspace on the host: created from task files, read and written by the
service without ever following a link out of it, snapshotted for grading.

The service runs as root and the sandboxed code controls what is in the workspace, so
every host-side access walks the path one component at a time with ``openat`` and
``O_NOFOLLOW``: a symlink (``leak -> /etc/shadow``) or a swapped-in directory link is
refused, never followed, with no window between a check and the use.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path, PurePosixPath

import msgspec
import structlog

from sandbox import quota as disk

log = structlog.get_logger(__name__)

# Version-control metadata never enters a workspace: no history for the agent to mine.
VCS_DIRS = frozenset({".git", ".hg", ".svn", ".bzr", "CVS", "_darcs", ".jj"})
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted by the agent must not hang the service.
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
# Folders nested deeper than this are refused by the snapshot (WorkspaceError: the
# workspace is not gradable): the walk recurses once per level, and a tree the agent made
# 1,000 deep raised RecursionError out of submit (HTTP 500, the session left open).
MAX_DEPTH = 256


class WorkspaceError(ValueError):
    """A bad path or an unsafe file in the workspace; the message says which and why."""


class FileMissing(WorkspaceError):
    pass


class WorkspaceFile(msgspec.Struct, frozen=True):
    path: str
    data: bytes
    mode: int = 0o644


class Snapshot(msgspec.Struct, kw_only=True):
    """Regular files of a workspace at one moment; links and special files are listed, not followed."""

    files: dict[str, WorkspaceFile]
    symlinks: dict[str, str] = {}
    skipped: list[str] = []
    total_bytes: int = 0


def clean_relpath(path: str) -> str:
    """Normalize a workspace-relative path; refuse absolute, parent, empty or VCS paths."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise WorkspaceError(f"invalid path {path!r}")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise WorkspaceError(f"path {path!r} is absolute; paths are relative to the workspace")
    parts = [p for p in pure.parts if p not in ("", ".")]
    if not parts:
        raise WorkspaceError(f"path {path!r} names the workspace itself")
    if ".." in parts:
        raise WorkspaceError(f"path {path!r} leaves the workspace ('..')")
    if VCS_DIRS.intersection(parts):
        raise WorkspaceError(f"path {path!r} is version-control metadata, which workspaces never hold")
    return "/".join(parts)


class Workspace:
    """A directory owned by the sandbox uid; the service touches it only through here."""

    def __init__(self, root: Path, uid: int, mounted: bool = False) -> None:
        self.root = root
        self.uid = uid
        self.mounted = mounted

    @classmethod
    def create(cls, root: Path, uid: int, files: dict[str, str | bytes],
               quota: disk.Quota | None = None) -> tuple["Workspace", list[str]]:
        """Make the workspace from ``files`` (on its own size-limited tmpfs with ``quota``);
        returns it and the paths dropped (VCS metadata)."""
        root.mkdir(mode=0o755)
        if quota is not None:
            try:
                disk.mount(root, quota, uid=uid)
            except BaseException:
                root.rmdir()
                raise
        os.chown(root, uid, uid)
        ws = cls(root, uid, mounted=quota is not None)
        dropped = []
        try:
            for path, content in files.items():
                try:
                    ws.write(path, content)
                except WorkspaceError as exc:
                    if "version-control" in str(exc):
                        dropped.append(path)
                        continue
                    raise
        except BaseException:
            ws.remove()
            raise
        if dropped:
            log.info("workspace_vcs_dropped", paths=dropped[:20], count=len(dropped))
        return ws, dropped

    def _open_dir(self, parts: list[str], *, create: bool) -> int:
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for part in parts:
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise FileMissing(f"no such directory {part!r} in the workspace") from None
                    os.mkdir(part, 0o755, dir_fd=fd)
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    os.fchown(nfd, self.uid, self.uid)
                except OSError as exc:
                    raise _refusal(part, exc) from None
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _open_file(self, rel: str, flags: int, *, create: bool, mode: int = 0o644) -> int:
        """An fd of workspace file ``rel`` (a clean relative path), reached without following
        a link; ``create``: missing directories are made (and ``flags`` may create the file)."""
        *dirs, name = rel.split("/")
        dfd = self._open_dir(dirs, create=create)
        try:
            return os.open(name, flags | _FILE_FLAGS, mode, dir_fd=dfd)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and not create:
                raise FileMissing(f"no such file {rel!r} in the workspace") from None
            raise _refusal(rel, exc) from None
        finally:
            os.close(dfd)

    def read(self, path: str, max_bytes: int) -> bytes:
        rel = clean_relpath(path)
        fd = self._open_file(rel, os.O_RDONLY, create=False)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                raise WorkspaceError(f"{rel!r} is {kind}")
            if st.st_size > max_bytes:
                raise WorkspaceError(f"{rel!r} is {st.st_size} bytes, over the {max_bytes}-byte limit")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(max_bytes + 1)[:max_bytes]
        finally:
            os.close(fd)

    def write(self, path: str, content: str | bytes, mode: int = 0o644) -> int:
        rel = clean_relpath(path)
        data = content.encode() if isinstance(content, str) else content
        fd = self._open_file(rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, create=True, mode=mode & 0o755)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise WorkspaceError(f"{rel!r} is not a regular file")
            os.fchown(fd, self.uid, self.uid)
            os.fchmod(fd, mode & 0o755)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        return len(data)

    def unlink(self, path: str) -> bool:
        """Remove file or symlink ``path`` (never following a link); False when it is
        not there. A directory is refused."""
        rel = clean_relpath(path)
        *dirs, name = rel.split("/")
        try:
            dfd = self._open_dir(dirs, create=False)
        except FileMissing:
            return False
        try:
            os.unlink(name, dir_fd=dfd)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _refusal(rel, exc) from None
        finally:
            os.close(dfd)

    def symlink(self, path: str, target: str) -> None:
        """Make symlink ``path -> target`` (missing folders made; an existing entry at
        ``path`` is an error). The link is not followed here: what it resolves to is the
        sandbox's business, inside its own root."""
        rel = clean_relpath(path)
        if not target or "\x00" in target:
            raise WorkspaceError(f"invalid symlink target {target!r} for {rel!r}")
        *dirs, name = rel.split("/")
        dfd = self._open_dir(dirs, create=True)
        try:
            os.symlink(target, name, dir_fd=dfd)
            os.chown(name, self.uid, self.uid, dir_fd=dfd, follow_symlinks=False)
        except OSError as exc:
            raise _refusal(rel, exc) from None
        finally:
            os.close(dfd)

    def snapshot(self, *, max_bytes: int, max_files: int) -> Snapshot:
        """Every regular file (VCS metadata excluded) without following links.

        Raises WorkspaceError when the workspace is over the limits. The limits count
        the session's own files only: a file identical to the base tree's at the same
        path (an image's untouched file, :meth:`base_file`) is in the snapshot but not
        counted, so a repository of many files is not refused for its own size."""
        snap = Snapshot(files={})
        self._walk(os.open(self.root, _DIR_FLAGS), "", snap, max_bytes, max_files, [0, 0])
        return snap

    def base_file(self, rel: str) -> bytes | None:
        """The base tree's regular file at ``rel`` (None: no base tree, or no regular file
        there). A plain workspace has no base: every file is the session's."""
        return None

    def _count(self, rel: str, size: int, counted: list[int], max_bytes: int, max_files: int) -> None:
        counted[0] += 1
        counted[1] += size
        if counted[0] > max_files:
            raise WorkspaceError(f"workspace has more than {max_files} files")
        if counted[1] > max_bytes:
            raise WorkspaceError(f"workspace holds more than {max_bytes} bytes")

    def _walk(self, dfd: int, prefix: str, snap: Snapshot, max_bytes: int, max_files: int,
              counted: list[int]) -> None:
        try:
            for entry in sorted(os.scandir(dfd), key=lambda e: e.name):
                rel = f"{prefix}{entry.name}"
                st = entry.stat(follow_symlinks=False)
                if entry.name in VCS_DIRS:
                    # At any depth and of any kind (a submodule's ``.git`` is a file).
                    snap.skipped.append(rel + "/" if stat.S_ISDIR(st.st_mode) else rel)
                    continue
                if stat.S_ISLNK(st.st_mode):
                    snap.symlinks[rel] = os.readlink(entry.name, dir_fd=dfd)
                elif stat.S_ISDIR(st.st_mode):
                    if rel.count("/") >= MAX_DEPTH:  # this folder is MAX_DEPTH + 1 deep
                        raise WorkspaceError(f"workspace has folders nested more than {MAX_DEPTH} deep")
                    try:
                        sub = os.open(entry.name, _DIR_FLAGS, dir_fd=dfd)
                    except OSError:
                        snap.skipped.append(rel + "/")
                        continue
                    self._walk(sub, rel + "/", snap, max_bytes, max_files, counted)
                elif stat.S_ISREG(st.st_mode):
                    base = self.base_file(rel)
                    if base is None or len(base) != st.st_size:
                        # Not the base's file: counted before it is read.
                        self._count(rel, st.st_size, counted, max_bytes, max_files)
                    snap.total_bytes += st.st_size
                    fd = os.open(entry.name, os.O_RDONLY | _FILE_FLAGS, dir_fd=dfd)
                    with os.fdopen(fd, "rb") as f:
                        data = f.read(max_bytes if base is None else max(max_bytes, len(base)))
                    if base is not None and len(base) == st.st_size and data != base:
                        self._count(rel, st.st_size, counted, max_bytes, max_files)
                    snap.files[rel] = WorkspaceFile(rel, data, st.st_mode & 0o755)
                else:
                    snap.skipped.append(rel)
        finally:
            os.close(dfd)

    def remove(self) -> None:
        if self.mounted:
            # One step, however many files: the tmpfs goes with everything in it.
            disk.unmount(self.root)
            self.mounted = False
        shutil.rmtree(self.root, ignore_errors=True)


def _refusal(path: str, exc: OSError) -> WorkspaceError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return WorkspaceError(f"{path!r} is (or passes through) a symlink or a non-directory; refusing to follow it")
    if exc.errno == errno.EISDIR:
        return WorkspaceError(f"{path!r} is a directory")
    return WorkspaceError(f"{path!r}: {exc.strerror}")
