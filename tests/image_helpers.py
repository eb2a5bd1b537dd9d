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
# A repository only in its image, with what real images hold and a task's text cannot:
# links (an absolute one among them), latin-1 Python (a conftest, the pytest plugin its
# config loads, and a test helper at the root that the tests assert through), the config
# itself a link, nested version-control entries.
QUIRKS = "rollway.local/tests/quirks:1"
QUIRKS_FILES: dict[str, bytes] = {
    "README.md": b"# quirks\n",
    "quirks/__init__.py": b"from quirks.core import double\n",
    "quirks/core.py": b"def double(x):\n    return x * 3\n",
    "quirks/legacy.py": b"# The old API, to be removed.\nfrom quirks.core import double as twice\n",
    "quirks/plugin.py": (b"# -*- coding: latin-1 -*-\n# The test suite's plugin, by Jos\xe9.\nimport pytest\n\n\n"
                         b"def pytest_report_header(config):\n    return 'quirks'\n\n\n"
                         b"@pytest.fixture\ndef factor():\n    return 2\n"),
    "config/setup.cfg": b"[metadata]\nname = quirks\n\n[tool:pytest]\naddopts = -p quirks.plugin\n",
    "tests/conftest.py": (b"# -*- coding: latin-1 -*-\n# Fixtures (\xa9 the quirks authors).\nimport pytest\n\n\n"
                          b"@pytest.fixture\ndef offset():\n    return 1\n"),
    "tests/test_base.py": b"from quirks import double\n\n\ndef test_double_zero():\n    assert double(0) == 0\n",
    "testing_quirks.py": (b"# -*- coding: latin-1 -*-\n# Checks (\xa9 the quirks authors).\n\n\n"
                          b"def check(got, want):\n    assert got == want, (got, want)\n"),
    ".git/HEAD": b"ref: refs/heads/main\n",
    "vendor/thing/.git": b"gitdir: ../../.git/modules/thing\n",
    "vendor/thing/thing.py": b"X = 1\n",
    "vendor/other/.hg/hgrc": b"[paths]\ndefault = https://example.invalid/other\n",
    "vendor/other/other.py": b"Y = 2\n",
}
QUIRKS_LINKS = {"setup.cfg": "config/setup.cfg", "docs/latest.md": "../README.md",
                "vendor_python": "/usr/lib/python3/dist-packages"}
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
    """The example images, built once per input key (reused across processes). Callable
    from a running event loop (an async test): the build, which runs its own loops with
    ``asyncio.run``, then runs in a thread while the caller's loop waits."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _build_example_images()
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_build_example_images).result()


def _build_example_images() -> ExampleImages:
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
        _add_quirks(layout, cache, folder / "quirks")
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


def _add_quirks(layout: Path, cache: Path, stage: Path) -> None:
    """The quirks image: QUIRKS_FILES and QUIRKS_LINKS at /testbed, on the examples' base."""
    from sandbox.config import ImageConfig
    from sandbox.images import ImageStore

    for rel, data in QUIRKS_FILES.items():
        (stage / "testbed" / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / "testbed" / rel).write_bytes(data)
    for rel, target in QUIRKS_LINKS.items():
        (stage / "testbed" / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / "testbed" / rel).symlink_to(target)
    for argv in (["umoci", "tag", "--image", f"{layout}:base", "quirks"],
                 ["umoci", "insert", "--image", f"{layout}:quirks", str(stage), "/"]):
        subprocess.run(argv, check=True, capture_output=True)
    store = ImageStore(ImageConfig(cache_dir=str(cache)))
    asyncio.run(store.ensure(QUIRKS, source=f"oci:{layout}:quirks"))


def quirks_row(instance_id: str = "quirks-1") -> dict:
    """An image-only SWE row (no ``files``) on the quirks image: the gold patch fixes
    ``double`` and deletes ``quirks/legacy.py``; the hidden tests need the plugin's and
    the latin-1 conftest's fixtures, and the legacy module gone, and check ``double``
    through the latin-1 helper ``testing_quirks.check``."""
    from tasks.images.examples import unified_diff

    text = {p: d.decode() for p, d in QUIRKS_FILES.items() if p in ("quirks/core.py", "quirks/legacy.py")}
    test = ("import importlib.util\n\nfrom quirks import double\nfrom testing_quirks import check\n\n\n"
            "def test_double(factor, offset):\n    check(double(3) + offset, 3 * factor + offset)\n\n\n"
            "def test_legacy_api_is_gone():\n    assert importlib.util.find_spec('quirks.legacy') is None\n")
    gold = unified_diff(text, {"quirks/core.py": "def double(x):\n    return x * 2\n"})
    gold += "--- a/quirks/legacy.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n" + "".join(
        "-" + line for line in text["quirks/legacy.py"].splitlines(keepends=True))
    return {
        "instance_id": instance_id, "problem_statement": "double(x) returns 3x; make it 2x and drop quirks.legacy.",
        "image": QUIRKS, "patch": gold, "test_patch": unified_diff({}, {"tests/test_quirks.py": test}),
        "FAIL_TO_PASS": ["tests/test_quirks.py::test_double", "tests/test_quirks.py::test_legacy_api_is_gone"],
        "PASS_TO_PASS": ["tests/test_base.py::test_double_zero"],
    }
