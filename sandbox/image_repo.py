"""The repository an image holds at a task's ``workdir``, as the text a task spec keeps.

SWE-Gym/SWE-smith rows name an image and no files: the repository at ``base_commit`` is
only in the image (``/testbed``). Its test patch and gold patch edit files there, and the
grader needs that tree as the base against which it sees what the agent changed (static
cheat checks) and from which it restores test files and configuration (in-env grading).
:func:`read_image_repo` reads it from the unpacked, read-only image root, without following
links out of it; :class:`ImageRepoCache` keeps each resolved task per image digest, since
a real repository is thousands of files and every grading of the task needs the same.

What the task's text does not keep: version-control entries at any depth (``.git``
folders, a submodule's ``.git`` file, ``.hg``...), symlinks, files that are not UTF-8 text
and files over ``MAX_FILE_BYTES``; a tree over ``MAX_FILES`` or ``MAX_TOTAL_BYTES`` is an
ImageError (kind ``repo``) naming the image. Those are still the image's, not the
agent's: :func:`image_tree` describes the whole tree (every regular file by size and
sha256, every symlink by its target, the test configuration as bytes with in-image links
followed inside the image root), which is what the grader compares the agent's final
tree with (sandbox/image_changes.py).
"""

from __future__ import annotations

import collections
import hashlib
import os
import stat
import threading
from pathlib import Path, PurePosixPath
from typing import Iterator

import msgspec

import structlog

from sandbox.image_unpack import resolve_in_root
from sandbox.image_workspace import image_dir
from sandbox.images import ImageError, ImageRoot
from sandbox.workspace import VCS_DIRS
from tasks.spec import TaskSpec
from tasks.swe import SWEFormatError, with_image_repo

log = structlog.get_logger(__name__)

MAX_FILE_BYTES = 1 << 20
MAX_FILES = 200_000
MAX_TOTAL_BYTES = 1 << 30


# Files that configure pytest wherever they are (as sandbox/grading_inenv.py restores them).
CONFIG_NAMES = frozenset({"conftest.py", "pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml",
                          "tox.ini", "setup.cfg"})


class ImageTree(msgspec.Struct, frozen=True, kw_only=True):
    """The image's tree at a workdir, as the grader compares an agent's tree with it."""

    files: dict[str, tuple[int, str]]  # every regular file: (size, sha256 hex)
    symlinks: dict[str, str]  # path -> target, as the image stores it
    configs: dict[str, bytes]  # test configuration (CONFIG_NAMES) as bytes, in-image links followed
    vcs: tuple[str, ...]  # version-control entries, at any depth (never part of a session)


def _entries(top: Path) -> Iterator[tuple[str, Path, os.stat_result]]:
    """(relative path, host path, lstat) of everything under ``top``, sorted, never
    following a link; version-control entries are yielded but not entered."""
    for folder, dirs, names in os.walk(top, followlinks=False):
        rel_folder = os.path.relpath(folder, top)
        kept = []
        for name in sorted(dirs + names):
            path = Path(folder, name)
            rel = name if rel_folder == "." else f"{rel_folder}/{name}"
            st = os.lstat(path)
            yield rel, path, st
            if stat.S_ISDIR(st.st_mode) and name not in VCS_DIRS:
                kept.append(name)
        dirs[:] = kept


def read_image_repo(root: ImageRoot, workdir: str) -> dict[str, str]:
    """``{relative path: text}`` of the image's tree at ``workdir`` ({} when the image
    has no such directory)."""
    top = image_dir(root, workdir)
    if top is None:
        return {}
    files: dict[str, str] = {}
    skipped = total = 0
    for rel, path, st in _entries(top):
        if VCS_DIRS.intersection(rel.split("/")) or stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
            skipped += 1
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            skipped += 1
            continue
        total += st.st_size
        if len(files) >= MAX_FILES or total > MAX_TOTAL_BYTES:
            raise ImageError(root.ref, f"the repository at {workdir} is over {MAX_FILES} files or "
                                       f"{MAX_TOTAL_BYTES} bytes of text", "repo")
        files[rel] = text
    log.info("image_repo_read", image=root.ref, workdir=workdir, files=len(files), bytes=total, skipped=skipped)
    return files


def read_image_tree(root: ImageRoot, workdir: str) -> ImageTree:
    """The whole tree at ``workdir`` (empty when the image has none there). A config
    that is a link is read where the link leads inside the image root (never on the
    host); one that leads nowhere or to a non-file is left out."""
    top = image_dir(root, workdir)
    files: dict[str, tuple[int, str]] = {}
    symlinks: dict[str, str] = {}
    configs: dict[str, bytes] = {}
    vcs: list[str] = []
    for rel, path, st in _entries(top) if top is not None else ():
        if PurePosixPath(rel).name in VCS_DIRS:
            vcs.append(rel)
            continue
        if stat.S_ISLNK(st.st_mode):
            symlinks[rel] = os.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            if len(files) >= MAX_FILES:
                raise ImageError(root.ref, f"the repository at {workdir} is over {MAX_FILES} files", "repo")
            files[rel] = (st.st_size, _sha256(path))
        else:
            continue
        if PurePosixPath(rel).name in CONFIG_NAMES:
            data = _config_bytes(root, f"{workdir.rstrip('/')}/{rel}")
            if data is not None:
                configs[rel] = data
    return ImageTree(files=files, symlinks=symlinks, configs=configs, vcs=tuple(vcs))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def image_file_bytes(root: ImageRoot, path: str) -> bytes | None:
    """The image's regular file at ``path`` (absolute in the image; links followed
    inside the image root, never on the host), None if none or over MAX_FILE_BYTES."""
    return _config_bytes(root, path)


def _config_bytes(root: ImageRoot, path: str) -> bytes | None:
    found = resolve_in_root(Path(root.rootfs), path)
    if found is None:
        return None
    try:
        st = os.lstat(found)  # resolve_in_root followed every link: a link here is none
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
            return None
        return found.read_bytes()
    except OSError:
        return None


_TREES: collections.OrderedDict[tuple[str, str], ImageTree] = collections.OrderedDict()
_TREES_LOCK = threading.Lock()
_TREES_KEPT = 16


def image_tree(root: ImageRoot, workdir: str) -> ImageTree:
    """:func:`read_image_tree`, kept per image digest and workdir (an unpacked root never
    changes; every grading of its tasks needs the same). Thread-safe."""
    key = (f"{root.digest}:{root.rootfs}", workdir)
    with _TREES_LOCK:
        tree = _TREES.get(key)
        if tree is not None:
            _TREES.move_to_end(key)
            return tree
    tree = read_image_tree(root, workdir)
    log.info("image_tree_read", image=root.ref, workdir=workdir, files=len(tree.files), links=len(tree.symlinks),
             configs=len(tree.configs), vcs=len(tree.vcs))
    with _TREES_LOCK:
        _TREES[key] = tree
        while len(_TREES) > _TREES_KEPT:
            _TREES.popitem(last=False)
    return tree


class ImageRepoCache:
    """Tasks made whole from their images (:func:`tasks.swe.with_image_repo`), per task
    and image digest; the ``size`` most recently used are kept."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._specs: collections.OrderedDict[tuple[str, str, str], TaskSpec] = collections.OrderedDict()
        self._lock = threading.Lock()

    def resolve(self, spec: TaskSpec, root: ImageRoot) -> TaskSpec:
        """Thread-safe (gradings resolve in worker threads); two first gradings of one
        task may both read the image, and one result is kept."""
        key = (spec.task_id, root.digest, spec.image_repo_row)
        with self._lock:
            whole = self._specs.get(key)
            if whole is not None:
                self._specs.move_to_end(key)
                return whole
        try:
            whole = with_image_repo(spec, read_image_repo(root, spec.workdir))
        except SWEFormatError as exc:
            # The row does not fit its image (a patch that does not apply): the task's
            # failure, not the policy's; named, like a missing image.
            raise ImageError(root.ref, f"task {spec.task_id}: {exc}", "repo") from None
        with self._lock:
            self._specs[key] = whole
            while len(self._specs) > self.size:
                self._specs.popitem(last=False)
        return whole
