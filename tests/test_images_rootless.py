"""The image path without root (a sandbox host whose service is not root): run as uid
65534 through setpriv, tests/rootless_probe.py pulls an example image into its own store
(umoci --rootless maps the image's owners to the caller), makes a session tree (no
overlay mount without root: the copy fallback), runs a command in the image root under
bwrap with a user namespace, and prunes. The host's Python runs the probe: the venv's
interpreter may live where uid 65534 cannot read (pyenv under /root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sandbox.images import _rmtree
from tests.image_helpers import example_images

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534


def _system_python() -> str:
    for candidate in ("/usr/bin/python3", shutil.which("python3") or ""):
        if candidate and os.access(candidate, os.X_OK):
            version = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                                     capture_output=True, text=True).stdout.strip()
            if version == str(tuple(sys.version_info[:2])):
                return candidate
    raise AssertionError(f"no system python3 of version {sys.version_info[:2]} to run the rootless probe")


def test_an_image_task_runs_without_root():
    assert os.geteuid() == 0, "this test switches to uid 65534 with setpriv: run the suite as root (scripts/test)"
    images = example_images()
    # Not pytest's tmp_path: its folders are 0700, untraversable for uid 65534.
    tmp_path = Path(tempfile.mkdtemp(prefix="rollway-rootless-"))
    try:
        _probe(images, tmp_path)
    finally:
        _rmtree(tmp_path)


def _probe(images, tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    folder = tmp_path / "rootless"
    folder.mkdir()
    layout = tmp_path / "oci"
    shutil.copytree(images.layout, layout)
    for path in [layout, *layout.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    os.chown(folder, NOBODY, NOBODY)
    site = next(Path(sys.prefix, "lib").glob("python3*/site-packages"))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(folder), "PYTHONPATH": f"{REPO}:{site}", "LANG": "C.UTF-8"}
    done = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", _system_python(),
         str(REPO / "tests" / "rootless_probe.py"), str(folder), str(layout), "namekit"],
        env=env, cwd=folder, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert (seen["uid"], seen["mode"], seen["exit"]) == (NOBODY, "copy", 0), seen
    # The image's package and the session's file import, the command runs as the caller,
    # the session's change stays in its copy, the image root is read-only.
    assert seen["stdout"].splitlines() == [
        f"blog_post 7 {NOBODY}", "changed", "touch: cannot touch '/usr/lib/escape': Read-only file system", "write=1"]
    assert seen["image_untouched"] and (seen["pruned"], seen["left"], seen["session_left"]) == (1, [], False)
