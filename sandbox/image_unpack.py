"""Unpacking a verified OCI layout into a root filesystem with umoci, and reading paths
inside an unpacked root without ever leaving it.

umoci applies the layers in order and handles whiteouts (``.wh.`` files and opaque
directories), hard links, device nodes, ownership and permissions; nothing here
re-implements any of it. As root (the sandbox service) ``umoci raw unpack`` keeps the
image's owners; otherwise ``--rootless`` maps them to the caller.

Paths inside an image are the image's, not the host's: an absolute symlink ``/testbed ->
/root`` in the image means the image's ``/root``. :func:`resolve_in_root` follows links
the way the kernel would inside a chroot at the root, component by component, so the
service (root on the host) never reads or mounts a host path named by an image.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
from pathlib import Path, PurePosixPath

from sandbox.image_fetch import LAYOUT_TAG, FetchError

_MAX_LINKS = 40  # the kernel's limit on symlinks followed in one lookup


async def unpack(layout: Path, rootfs: Path, *, timeout_s: float = 1800.0) -> None:
    """``umoci raw unpack`` the layout's image into ``rootfs`` (must not exist)."""
    umoci = shutil.which("umoci")
    if umoci is None:
        raise FetchError("fetch", "umoci is not installed (apt-get install umoci; scripts/setup does)")
    argv = [umoci, "raw", "unpack"]
    if os.geteuid() != 0:
        argv.append("--rootless")
    argv += ["--image", f"{layout}:{LAYOUT_TAG}", str(rootfs)]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        text = " ".join((err or out).decode(errors="replace").split())[-800:]
        kind = "digest" if "digest" in text.lower() else "fetch"
        raise FetchError(kind, f"umoci unpack failed (exit {proc.returncode}): {text}")
    # The root itself: traversable by the sandbox uids whatever the image says.
    os.chmod(rootfs, 0o755)
    await asyncio.to_thread(strip_overlay_xattrs, rootfs)


def strip_overlay_xattrs(rootfs: Path) -> int:
    """Remove ``trusted.overlay.*`` attributes an image may carry (umoci restores a layer's
    xattrs as root): session trees are overlays with the image as the lower layer, and
    crafted redirect/metacopy attributes there would steer the kernel's lookups
    (overlayfs.rst: no metacopy with untrusted lower layers). Returns how many."""
    removed = 0
    for dirpath, dirnames, filenames in os.walk(rootfs):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            try:
                attrs = os.listxattr(name, follow_symlinks=False)
            except OSError:
                continue
            for attr in attrs:
                if attr.startswith("trusted.overlay."):
                    with contextlib.suppress(OSError):
                        os.removexattr(name, attr, follow_symlinks=False)
                        removed += 1
    return removed


def resolve_in_root(rootfs: Path, path: str) -> Path | None:
    """The host path of ``path`` inside the image root ``rootfs``, following symlinks as
    if ``rootfs`` were ``/`` (absolute targets and ``..`` never leave it); None when it
    does not exist."""
    root = rootfs.resolve()
    parts = list(PurePosixPath("/" + path.lstrip("/")).parts[1:])
    current: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if current:
                current.pop()
            continue
        candidate = root.joinpath(*current, part)
        try:
            st = os.lstat(candidate)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                return None
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = []
            parts = list(PurePosixPath(target).parts[1 if target.startswith("/") else 0:]) + parts
            continue
        current.append(part)
    return root.joinpath(*current)


def shell_of(rootfs: Path) -> str:
    """The shell the image runs commands with: bash when it has one, else sh."""
    for shell in ("/bin/bash", "/usr/bin/bash"):
        found = resolve_in_root(rootfs, shell)
        if found is not None and found.is_file():
            return shell
    return "/bin/sh"
