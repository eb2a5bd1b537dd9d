"""What the agent changed in an image task's tree, measured against the image itself.

An image task's session tree is the image's ``workdir`` plus the agent's changes, so its
snapshot holds much that is the image's: symlinks (absolute ones too: ``/testbed/lib ->
/usr/lib/...`` resolves inside the image), binaries, files that are not UTF-8 or are large,
none of which the task's text (``TaskSpec.files``) can hold. Compared with the task's text
alone they would look like the agent's additions. Here they are compared with the image's
tree (:class:`sandbox.image_repo.ImageTree`: every file by size and sha256, every link by
its target):

- :func:`agent_view`: the snapshot less what the image holds as it is; what is left is the
  agent's doing, and only that goes through the static cheat checks (an escaping link the
  agent added is still refused, an image's own is not);
- :func:`over_image`: the snapshot a session would give with some files written over the
  image, for graders without a session (``rollway tasks check``);
- :func:`tree_changes`: what grading must redo over a fresh tree of the image so that it
  sees the agent's final tree and not the image's: the image's files and links the agent
  deleted or replaced (a gold patch that deletes a file must not find it back), and the
  links the agent made.
"""

from __future__ import annotations

import hashlib
import os

import msgspec

from sandbox.image_repo import ImageTree
from sandbox.image_workspace import image_dir
from sandbox.images import ImageRoot
from sandbox.workspace import Snapshot, WorkspaceFile


class TreeChanges(msgspec.Struct, frozen=True, kw_only=True):
    removed: tuple[str, ...] = ()  # image files and links the agent's tree no longer has
    links: dict[str, str] = {}  # links of the agent's tree that are not the image's own


def _same_file(data: bytes, base: tuple[int, str] | None) -> bool:
    return base is not None and len(data) == base[0] and hashlib.sha256(data).hexdigest() == base[1]


def agent_view(snapshot: Snapshot, tree: ImageTree) -> Snapshot:
    """The snapshot without the files byte-identical to the image's at the same path and
    the links with the image's target at the same path."""
    return Snapshot(
        files={p: f for p, f in snapshot.files.items() if not _same_file(f.data, tree.files.get(p))},
        symlinks={p: t for p, t in snapshot.symlinks.items() if tree.symlinks.get(p) != t},
        skipped=list(snapshot.skipped), total_bytes=snapshot.total_bytes,
    )


def tree_changes(snapshot: Snapshot, tree: ImageTree) -> TreeChanges:
    """Image entries the agent removed (deleted, a file replaced by a link or a link by
    a file, a link pointed elsewhere), and the agent's own links. Entries under what the
    snapshot skipped (a folder it could not read) are not taken for deleted."""
    skipped_dirs = tuple(s for s in snapshot.skipped if s.endswith("/"))
    removed = []
    for path in [*tree.files, *tree.symlinks]:
        if path in tree.files and path in snapshot.files:
            continue
        if path in tree.symlinks and snapshot.symlinks.get(path) == tree.symlinks[path]:
            continue
        if path in snapshot.skipped or path.startswith(skipped_dirs):
            continue
        removed.append(path)
    links = {p: t for p, t in snapshot.symlinks.items() if tree.symlinks.get(p) != t}
    return TreeChanges(removed=tuple(sorted(removed)), links=links)


def config_texts(tree: ImageTree | None) -> dict[str, str]:
    """The image's test configuration as text (undecodable bytes replaced), for what
    reads it as text (sandbox/test_selection.py)."""
    return {p: d.decode("utf-8", "replace") for p, d in tree.configs.items()} if tree is not None else {}


def over_image(root: ImageRoot, workdir: str, tree: ImageTree, files: dict[str, bytes],
               removed: tuple[str, ...] = ()) -> Snapshot:
    """The snapshot of a session of the image with ``files`` written over its tree and
    the image's files and links at ``removed`` deleted (a gold patch's deletions), and
    nothing else done (the image's other files and links as they are)."""
    top = image_dir(root, workdir)
    gone = set(removed)
    snap = Snapshot(files={}, symlinks={p: t for p, t in tree.symlinks.items() if p not in files and p not in gone})
    for path in tree.files:
        if path not in files and path not in gone and top is not None:
            fd = os.open(top / path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                snap.files[path] = WorkspaceFile(path, f.read())
    for path, data in files.items():
        snap.files[path] = WorkspaceFile(path, data)
    return snap
