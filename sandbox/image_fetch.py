"""Fetching an image into a local OCI layout with skopeo, and checking every blob's digest.

A reference names where the image comes from, as skopeo spells transports:
``docker://registry/name:tag`` (a bare ``name:tag`` or ``registry/name@sha256:...``
means ``docker://``), ``docker-archive:file.tar[:name]``, ``oci-archive:file.tar[:tag]``,
``oci:layout-dir[:tag]``, ``dir:path``. skopeo copies it (one platform: this host's)
into a fresh OCI layout; :func:`verify_layout` then re-reads the manifest, the config
and every layer and compares each with the sha256 and size its descriptor names, so a
corrupt or truncated blob is refused before anything is unpacked.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from pathlib import Path

import msgspec

TRANSPORTS = ("docker://", "docker-archive:", "oci-archive:", "oci:", "dir:", "docker-daemon:")
LAYOUT_TAG = "image"
_CHUNK = 1 << 20
_SYSTEM_POLICY = Path("/etc/containers/policy.json")


class FetchError(RuntimeError):
    """Why a fetch or a check failed; ``kind`` is 'missing', 'digest', 'auth' or 'fetch'."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ImageConfigInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the store keeps of an image's manifest and config."""

    digest: str  # sha256:<hex> of the manifest
    env: dict[str, str] = {}
    workdir: str = ""
    layers: int = 0
    blob_bytes: int = 0  # manifest + config + layers as stored (compressed)


def source_of(ref: str) -> str:
    """The skopeo source of ``ref``: as given with a transport prefix, else ``docker://``."""
    if ref.startswith(TRANSPORTS):
        return ref
    if not ref or any(c.isspace() for c in ref):
        raise FetchError("missing", f"{ref!r} is not an image reference")
    return "docker://" + ref


def skopeo_argv(source: str, layout: Path, policy: str = "", *, registries_conf: str = "",
                auth_file: str = "") -> list[str]:
    """``registries_conf``/``auth_file``: containers-registries.conf(5) and
    containers-auth.json(5) files (skopeo 1.9 reads no environment variable for the
    former, so it is passed as a flag)."""
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise FetchError("fetch", "skopeo is not installed (apt-get install skopeo; scripts/setup does)")
    argv = [skopeo]
    if policy:
        argv += ["--policy", policy]
    elif not _SYSTEM_POLICY.exists():
        argv += ["--insecure-policy"]
    if registries_conf:
        argv += ["--registries-conf", registries_conf]
    copy = ["copy", "--quiet"]
    if auth_file:
        copy += ["--src-authfile", auth_file]
    return [*argv, *copy, source, f"oci:{layout}:{LAYOUT_TAG}"]


async def fetch(ref: str, layout: Path, *, policy: str = "", timeout_s: float = 1800.0, registries_conf: str = "",
                auth_file: str = "") -> None:
    """skopeo copy ``ref`` into the new OCI layout ``layout`` (must not exist)."""
    argv = skopeo_argv(source_of(ref), layout, policy, registries_conf=registries_conf, auth_file=auth_file)
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
        raise FetchError(_kind_of(text), f"skopeo copy failed (exit {proc.returncode}): {text}")


def _kind_of(stderr: str) -> str:
    low = stderr.lower()
    if "digest" in low and ("mismatch" in low or "did not match" in low or "does not match" in low):
        return "digest"
    # Before "missing": a registry that refuses the credentials (or wants some) must not read
    # as an image that does not exist; the operator's fix is the auth file, not the reference.
    if any(s in low for s in ("unauthorized", "authentication required", "invalid username/password")):
        return "auth"
    if any(s in low for s in ("no such file", "not found", "manifest unknown", "does not exist",
                              "name unknown", "no such host", "requested access to the resource")):
        return "missing"
    return "fetch"


def _blob(layout: Path, digest: str) -> Path:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise FetchError("digest", f"unsupported or malformed digest {digest!r}")
    return layout / "blobs" / "sha256" / hexpart


def _check_blob(layout: Path, descriptor: dict) -> bytes | None:
    """Re-hash one blob against its descriptor; returns its bytes when small (JSON)."""
    digest, size = descriptor.get("digest", ""), descriptor.get("size", -1)
    path = _blob(layout, digest)
    if not path.is_file():
        raise FetchError("digest", f"blob {digest} is missing from the layout")
    h, total, keep = hashlib.sha256(), 0, bytearray()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            total += len(chunk)
            if total <= 4 * _CHUNK:
                keep += chunk
    actual = "sha256:" + h.hexdigest()
    if actual != digest or total != size:
        raise FetchError("digest", f"digest mismatch: blob {digest} ({descriptor.get('mediaType', 'blob')}) "
                                   f"holds {total} bytes hashing to {actual} (descriptor: {size} bytes)")
    return bytes(keep) if total <= 4 * _CHUNK else None


def verify_layout(layout: Path) -> ImageConfigInfo:
    """Check manifest, config and every layer of the layout's one image against their
    digests and sizes; return the manifest digest and the config's Env / WorkingDir."""
    try:
        index = json.loads((layout / "index.json").read_text())
        descriptor = index["manifests"][0]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise FetchError("fetch", f"the fetched layout has no readable index: {exc}") from None
    manifest = json.loads(_check_blob(layout, descriptor) or b"{}")
    if "layers" not in manifest or "config" not in manifest:
        raise FetchError("fetch", f"manifest {descriptor.get('digest')} is not an image manifest "
                                  f"(mediaType {manifest.get('mediaType', '?')})")
    config = json.loads(_check_blob(layout, manifest["config"]) or b"{}")
    for layer in manifest["layers"]:
        _check_blob(layout, layer)
    inner = config.get("config") or {}
    env = {}
    for item in inner.get("Env") or []:
        key, sep, value = item.partition("=")
        if sep:
            env[key] = value
    total = descriptor["size"] + manifest["config"]["size"] + sum(layer["size"] for layer in manifest["layers"])
    return ImageConfigInfo(digest=descriptor["digest"], env=env, workdir=inner.get("WorkingDir") or "",
                           layers=len(manifest["layers"]), blob_bytes=total)


def tree_bytes(root: Path) -> int:
    """Disk used by a tree (allocated blocks, each hard-linked inode once, no link followed)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += st.st_blocks * 512
    return total
