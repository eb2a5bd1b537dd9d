"""The repository an image holds at a task's ``workdir``, as the text a task spec keeps.

SWE-Gym/SWE-smith rows name an image and no files: the repository at ``base_commit`` is
only in the image (``/testbed``). Its test patch and gold patch edit files there, and the
grader needs that tree as the base against which it sees what the agent changed (static
cheat checks) and from which it restores test files and configuration (in-env grading).
:func:`read_image_repo` reads it from the unpacked, read-only image root, without following
links out of it; :class:`ImageRepoCache` keeps each resolved task per image digest, since
a real repository is thousands of files and every grading of the task needs the same.

What is not kept: version-control folders, symlinks, files that are not UTF-8 text
(binaries are no test configuration and no Python source: a cheat check compares text),
and files over ``MAX_FILE_BYTES``; a tree over ``MAX_FILES`` or ``MAX_TOTAL_BYTES`` is an
ImageError (kind ``repo``) naming the image.
"""

from __future__ import annotations

import collections
import os
import stat
import threading
from pathlib import Path

import structlog

from sandbox.image_workspace import image_dir
from sandbox.images import ImageError, ImageRoot
from sandbox.workspace import VCS_DIRS
from tasks.spec import TaskSpec
from tasks.swe import SWEFormatError, with_image_repo

log = structlog.get_logger(__name__)

MAX_FILE_BYTES = 1 << 20
MAX_FILES = 200_000
MAX_TOTAL_BYTES = 1 << 30


def read_image_repo(root: ImageRoot, workdir: str) -> dict[str, str]:
    """``{relative path: text}`` of the image's tree at ``workdir`` ({} when the image
    has no such directory)."""
    top = image_dir(root, workdir)
    if top is None:
        return {}
    files: dict[str, str] = {}
    skipped = total = 0
    for folder, dirs, names in os.walk(top, followlinks=False):
        rel_folder = os.path.relpath(folder, top)
        if rel_folder == ".":
            dirs[:] = [d for d in dirs if d not in VCS_DIRS]
        dirs.sort()
        for name in sorted(names):
            path = Path(folder, name)
            st = os.lstat(path)
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
            files[name if rel_folder == "." else f"{rel_folder}/{name}"] = text
    log.info("image_repo_read", image=root.ref, workdir=workdir, files=len(files), bytes=total, skipped=skipped)
    return files


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
