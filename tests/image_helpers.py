"""The example images for tests, built once per machine and input (not once per module).

``example_images()`` builds the example task set's OCI layout (tasks/images/build.py,
~10 s here) plus a ``hostile`` test image on the same base, and imports them into an
image store folder; both live under /tmp keyed by a hash of the files that define them,
behind a lock, so every test module (and a later run on the same machine) reuses one
build. Tests that change a store (eviction, prune, a corrupt copy) make their own store
over the same layout.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parent.parent
_INPUTS = ("tasks/images/examples.py", "tasks/images/build.py", "sandbox/image_fetch.py", "sandbox/image_unpack.py",
           "sandbox/images.py", "tests/image_helpers.py")
HOSTILE = "rollway.local/tests/hostile:1"
# A path of the host that exists with content; the hostile image links to it.
HOST_FILE = str(REPO / "README.md")


class ExampleImages(msgspec.Struct, frozen=True):
    layout: str  # the OCI layout (tags: base, each example's name, hostile)
    cache_dir: str  # an image store holding every example image and the hostile one
    build_s: float  # seconds the build took when it ran (0.0: reused)


def _key() -> str:
    h = hashlib.sha256()
    for rel in _INPUTS:
        h.update((REPO / rel).read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def example_images() -> ExampleImages:
    import time

    from tasks.images import build

    folder = Path(os.environ.get("ROLLWAY_TEST_IMAGES", "/tmp")) / f"rollway-test-images-{_key()}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{folder}.lock", "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / "done"
        layout, cache = folder / "out" / "oci", folder / "cache"
        if done.exists():
            return ExampleImages(str(layout), str(cache), 0.0)
        shutil.rmtree(folder, ignore_errors=True)
        _remove_stale(folder)
        started = time.monotonic()
        build.build(folder / "out", log=lambda *_: None)
        build.import_into(layout, cache, log=lambda *_: None)
        _add_hostile(layout, cache, folder / "hostile")
        done.write_text("ok\n")
        return ExampleImages(str(layout), str(cache), round(time.monotonic() - started, 1))


def _remove_stale(current: Path) -> None:
    """Builds of older inputs (a day untouched) go, so /tmp does not fill up with them."""
    import time

    for other in current.parent.glob("rollway-test-images-*"):
        if other != current and other.is_dir() and time.time() - other.stat().st_mtime > 86400:
            shutil.rmtree(other, ignore_errors=True)
            Path(f"{other}.lock").unlink(missing_ok=True)


def _add_hostile(layout: Path, cache: Path, stage: Path) -> None:
    """A test image on the examples' base: a setuid-root copy of its Python, and links to
    host paths (at / and in /testbed)."""
    from sandbox.config import ImageConfig
    from sandbox.images import ImageStore

    store = ImageStore(ImageConfig(cache_dir=str(cache)))
    base_root = Path(asyncio.run(store.ensure("rollway.local/examples/namekit:1")).rootfs)
    (stage / "usr/local/bin").mkdir(parents=True)
    suid = stage / "usr/local/bin/suid-python"
    shutil.copy2(base_root / "usr/bin/python3.11", suid)
    os.chown(suid, 0, 0)
    os.chmod(suid, 0o4755 | stat.S_IXGRP | stat.S_IXOTH)
    (stage / "testbed").mkdir()
    (stage / "testbed/leak").symlink_to("/root/.pyenv")
    (stage / "testbed/app.py").write_text("VALUE = 1\n")
    (stage / "leak").symlink_to(HOST_FILE)
    for argv in (["umoci", "tag", "--image", f"{layout}:base", "hostile"],
                 ["umoci", "insert", "--image", f"{layout}:hostile", str(stage), "/"]):
        subprocess.run(argv, check=True, capture_output=True)
    asyncio.run(store.ensure(HOSTILE, source=f"oci:{layout}:hostile"))
