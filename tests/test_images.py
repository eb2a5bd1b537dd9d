"""OCI images as sandbox roots (issue #26), with real skopeo, umoci, overlayfs and bwrap.

The example images (tests/image_helpers.py) are built once per machine and input; each
test here uses the shared store read-only, or its own store over the same layout."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import platform
import shutil
import socket
import sys
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from sandbox import image_workspace
from sandbox.client import SandboxClient, SandboxError
from sandbox.config import ImageConfig, SandboxConfig
from sandbox.image_unpack import resolve_in_root
from sandbox.images import ImageError, ImageStore
from tasks.images.examples import EXAMPLES
from tasks.spec import TaskSpec
from tasks.store import TaskStore
from tests.image_helpers import HOST_FILE, HOSTILE, example_images
from tests.sandbox_helpers import live_sandbox, write_task_dir

QUOTA = 8 * 1024 * 1024
EXAMPLES_JSONL = Path(__file__).resolve().parent.parent / "tasks/images/examples.jsonl"
NAMEKIT = "rollway-examples__namekit-1"
MISSING_REF = "oci:/nonexistent/rollway-layout:nothing"


def _image_row(task_id: str, image: str) -> dict:
    return {"instance_id": task_id, "problem_statement": "-", "image": image,
            "test_files": {"tests/test_x.py": "def test_x():\n    pass\n"}, "FAIL_TO_PASS": ["tests/test_x.py::test_x"]}


@pytest.fixture(scope="module")
def images():
    return example_images()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sandbox(images, tmp_path_factory):
    tasks = tmp_path_factory.mktemp("image-tasks")
    shutil.copy(EXAMPLES_JSONL, tasks / "examples.jsonl")
    (tasks / "extra.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        _image_row("hostile", HOSTILE), _image_row("missing", MISSING_REF))))
    write_task_dir(tasks, TaskSpec(task_id="blank", instruction="-", files={"README.md": "x\n"},
                                   hidden_tests={"test_x.py": ""}))
    cfg = SandboxConfig(
        max_sessions=6, workspace_root=str(tmp_path_factory.mktemp("image-ws")), tasks_dir=str(tasks),
        workspace_bytes=QUOTA, workspace_inodes=2000, tmp_bytes=4 * 1024 * 1024,
        images=ImageConfig(cache_dir=images.cache_dir),
    )
    async with live_sandbox(cfg, store=TaskStore(tasks)) as live, SandboxClient(live.url) as client:
        live.client = client
        yield live


async def test_an_image_task_runs_on_the_images_python_not_the_hosts(sandbox):
    client = sandbox.client
    sid = await client.create_session(NAMEKIT)
    result = await client.exec(sid, (
        "python --version; python -c 'import sys, inflection, pytest; print(sys.executable, pytest.__version__)'; "
        f"test -e {sys.prefix} && echo HOST-VENV-VISIBLE; pwd; ls"
    ))
    assert result.exit_code == 0, result
    version, where, pwd, *listing = result.stdout.split("\n")
    assert version.startswith("Python 3.") and version != f"Python {platform.python_version()}", version
    assert where == "/usr/bin/python 8.3.5"  # the image's interpreter and its own pytest
    assert "HOST-VENV-VISIBLE" not in result.stdout
    assert (pwd, sorted(filter(None, listing))) == ("/testbed", ["README.md", "namekit", "tests"])
    await client.close_session(sid)
    # The same package is not importable on a host-root task.
    host = await client.create_session("blank")
    missing = await client.exec(host, "python -c 'import inflection'")
    assert missing.exit_code == 1 and "No module named 'inflection'" in missing.stderr
    await client.close_session(host)


async def test_session_trees_are_copy_on_write_layers_over_one_shared_root(sandbox):
    client, pool = sandbox.client, sandbox.service.pool
    a, b = await client.create_session(NAMEKIT), await client.create_session(NAMEKIT)
    wa, wb = pool.get(a).workspace, pool.get(b).workspace
    assert (wa.mode, wb.mode) == ("overlay", "overlay")
    assert pool.get(a).root.rootfs == pool.get(b).root.rootfs  # one unpacked root for both
    edit = await client.exec(a, "echo 'X = 1' >> namekit/__init__.py && echo new > new.txt && rm README.md")
    assert edit.exit_code == 0, edit
    seen = await client.exec(b, "tail -1 namekit/__init__.py; ls")
    assert seen.stdout.split() == ["return", "inflection.underscore(class_name)", "README.md", "namekit", "tests"]
    image_file = Path(pool.get(a).root.rootfs) / "testbed/namekit/__init__.py"
    assert "X = 1" not in image_file.read_text() and (image_file.parent.parent / "README.md").exists()
    # The session's disk holds its changes (and metadata-only copy-ups), not the image.
    upper = wa.base / "q" / "upper"
    data = sum(p.stat().st_size for p in upper.rglob("*") if p.is_file() and not p.is_symlink())
    assert data < 4096, data
    assert wa.read("new.txt", 100) == b"new\n"
    await client.close_session(a)
    await client.close_session(b)
    assert not wa.base.exists() and not os.path.ismount(wa.root)


FILL = (
    "python -c \"\nimport sys\nwritten = 0\ntry:\n    for i in range(400):\n"
    "        with open(f'{sys.argv[1]}/f{i}.bin', 'wb') as f:\n            f.write(b'x' * 65536)\n"
    "        written += 65536\nexcept OSError as e:\n    print('stopped', e.errno, written)\n    sys.exit(3)\n"
    "print('wrote', written)\n\" "
)

PROBE = r'''
import ctypes, json, os, socket, sys
out = {}
s = socket.socket()
s.settimeout(2)
out["connect"] = s.connect_ex(("127.0.0.1", int(sys.argv[1])))
for path in ("/usr/x", "/x", "/etc/x", "/.rollway/x", "/testbed/../x"):
    try:
        open(path, "w").close()
        out[path] = "written"
    except OSError as e:
        out[path] = e.errno
libc = ctypes.CDLL(None, use_errno=True)
out["unshare_user"] = 0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno()
out["seccomp"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")][0]
out["leak"] = os.path.exists("/leak")
out["testbed_leak"] = os.path.exists("/testbed/leak")
os.symlink(sys.argv[2], "planted")
out["planted"] = os.path.exists("planted")
print(json.dumps(out))
'''

SUID = "suid-python -c 'import os; print(os.getuid(), os.geteuid())'"

FORK = (
    "python -c \"\nimport os, time\nn = 0\ntry:\n    while n < 500:\n        if os.fork() == 0:\n"
    "            time.sleep(20)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
    "    print('stopped', n, e.errno)\n\""
)


async def test_hostile_checks_hold_inside_an_image_root(sandbox):
    client = sandbox.client
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    sid = await client.create_session("hostile")
    try:
        await client.write_file(sid, "probe.py", PROBE)
        probe = await client.exec(sid, f"python probe.py {listener.getsockname()[1]} {HOST_FILE}")
        assert probe.exit_code == 0, probe
        out = json.loads(probe.stdout)
        assert out["connect"] != 0  # its own network namespace: the host's listener is not there
        assert all(out[p] in (errno.EROFS, errno.EACCES) for p in ("/usr/x", "/x", "/etc/x", "/.rollway/x",
                                                                   "/testbed/../x")), out
        assert out["unshare_user"] == errno.EPERM and out["seccomp"] == "2"
        # Links to host paths resolve inside the image: nothing of the host is reached.
        assert out["leak"] is False and out["testbed_leak"] is False and out["planted"] is False
        # A setuid-root binary of the image runs with the session's uid.
        suid = await client.exec(sid, SUID)
        uid, euid = map(int, suid.stdout.split())
        assert uid == euid == sandbox.service.pool.get(sid).uid != 0
        bomb = await client.exec(sid, FORK, timeout_s=30)
        stopped, forks, code = bomb.stdout.split()
        assert stopped == "stopped" and int(forks) < sandbox.service.cfg.max_processes and int(code) == errno.EAGAIN
        full = await client.exec(sid, FILL + "/testbed", timeout_s=60)
        assert full.exit_code == 3 and full.stdout.split()[:2] == ["stopped", str(errno.ENOSPC)], full
        assert int(full.stdout.split()[2]) <= QUOTA and "disk" in full.limits
    finally:
        listener.close()
        await client.close_session(sid)


async def test_a_missing_image_is_a_503_naming_it_and_the_service_keeps_serving(sandbox):
    client = sandbox.client
    with pytest.raises(SandboxError) as exc:
        await client.create_session("missing")
    assert exc.value.status == 503 and MISSING_REF in exc.value.message and "not found" in exc.value.message
    assert (await client.health())["sessions"] == 0
    sid = await client.create_session(NAMEKIT)
    assert (await client.exec(sid, "true")).exit_code == 0
    await client.close_session(sid)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.name)
async def test_example_hidden_tests_fail_untouched_and_pass_with_the_gold_patch(sandbox, example):
    """In the image (the grader's own runs are tests/test_grader* with in-env grading)."""
    client = sandbox.client
    task_id = f"rollway-examples__{example.name}-1"
    ids = " ".join(example.fail_to_pass + example.pass_to_pass)
    outcomes = []
    for files in ({}, example.fixed):
        sid = await client.create_session(task_id)
        for path, text in {**example.tests_after, **files}.items():
            await client.write_file(sid, path, text)
        result = await client.exec(sid, f"python -m pytest -q -p no:cacheprovider {ids}", timeout_s=60)
        outcomes.append((result.exit_code, result.stdout.strip().splitlines()[-1]))
        await client.close_session(sid)
    assert outcomes[0][0] == 1 and "1 failed, 1 passed" in outcomes[0][1], outcomes
    assert outcomes[1][0] == 0 and "2 passed" in outcomes[1][1], outcomes


# --- the store ---------------------------------------------------------------------------


def _store(tmp_path: Path, **kwargs) -> ImageStore:
    return ImageStore(ImageConfig(cache_dir=str(tmp_path / "cache"), **kwargs))


def _layer_blob(layout: Path, tag: str) -> Path:
    index = json.loads((layout / "index.json").read_text())
    desc = next(m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == tag)
    manifest = json.loads((layout / "blobs/sha256" / desc["digest"].split(":")[1]).read_text())
    return layout / "blobs/sha256" / manifest["layers"][-1]["digest"].split(":")[1]


async def test_a_corrupt_layer_is_refused_naming_the_image(images, tmp_path):
    layout = tmp_path / "oci"
    shutil.copytree(images.layout, layout)
    blob = _layer_blob(layout, "gridfmt")
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    store = _store(tmp_path)
    with pytest.raises(ImageError) as exc:
        await store.ensure("example/gridfmt:corrupt", source=f"oci:{layout}:gridfmt")
    assert exc.value.kind == "digest" and "'example/gridfmt:corrupt'" in str(exc.value), exc.value
    assert store.list() == [] and not any((tmp_path / "cache/roots").iterdir())


async def test_unreachable_registry_and_missing_layout_name_the_image(tmp_path):
    store = _store(tmp_path)
    for ref in ("docker://127.0.0.1:9/rollway/none:1", "oci:/nonexistent/layout:x"):
        with pytest.raises(ImageError) as exc:
            await store.ensure(ref)
        assert repr(ref) in str(exc.value)


async def test_lru_eviction_held_images_and_a_full_cache(images, tmp_path):
    names = [f"oci:{images.layout}:{ex.name}" for ex in EXAMPLES]
    store = _store(tmp_path, max_cache_bytes=100 * 1024 * 1024)  # room for one unpacked image (~64 MB)
    first = await asyncio.gather(*(store.ensure(names[0]) for _ in range(4)))
    assert store.pulls == 1 and len({r.rootfs for r in first}) == 1  # pulled and unpacked once
    second = await store.acquire(names[1])  # evicts the first, which nobody holds
    assert [i.refs for i in store.list()] == [[names[1]]] and not Path(first[0].rootfs).exists()
    with pytest.raises(ImageError) as exc:
        await store.ensure(names[2])  # the held second image cannot go
    assert exc.value.kind == "cache_full" and repr(names[2]) in str(exc.value)
    assert Path(second.rootfs).is_dir()
    store.release(second)
    assert (await store.ensure(names[2])).rootfs != second.rootfs
    assert [i.refs for i in store.list()] == [[names[2]]]
    tiny = _store(tmp_path / "tiny", max_cache_bytes=1024 * 1024)
    with pytest.raises(ImageError, match="cache full"):
        await tiny.ensure(names[0])
    assert [i.refs for i in store.prune()] == [[names[2]]] and store.list() == []


def test_holds_and_releases_from_many_threads_keep_an_exact_count(tmp_path):
    """The service holds and releases an image on its loop and in worker threads at once
    (warm trees made, sessions opened and released off the loop). The count was updated
    without a lock: a lost update left the image pinned for good, or unpinned (its shared
    flock closed) while a session still ran on it. A tiny thread switch interval makes
    the interleaving happen within a few rounds; after each, only the session's hold is
    left, its lock file open."""
    import threading

    from sandbox.images import ImageRoot

    store = _store(tmp_path)
    root = ImageRoot(ref="rollway.local/hold:1", digest="sha256:" + "ab" * 32, rootfs=str(tmp_path / "none"))
    store.hold(root)  # a live session's hold, kept throughout

    def churn() -> None:
        for _ in range(5000):
            store.hold(root)
            store.release(root)

    seen = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(8):
            threads = [threading.Thread(target=churn) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            count, lock = store._held.get("ab" * 32, (0, None))
            seen.append((count, lock is not None and not lock.closed))
            if seen[-1] != (1, True):
                break
    finally:
        sys.setswitchinterval(interval)
    assert seen == [(1, True)] * 8
    store.release(root)
    assert store._held == {}


def test_resolve_in_root_never_leaves_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "opt/repo").mkdir(parents=True)
    (root / "testbed").symlink_to("/opt/repo")
    (root / "up").symlink_to("../../../../../etc")
    (root / "loop").symlink_to("loop")
    assert resolve_in_root(root, "/testbed") == root.resolve() / "opt/repo"
    assert resolve_in_root(root, "/up") is None  # the image's /etc, which it lacks
    assert resolve_in_root(root, "/../../etc/passwd") is None
    assert resolve_in_root(root, "/loop") is None


async def test_overlay_refused_falls_back_to_a_copy(images, tmp_path, monkeypatch):
    class Refuse:
        def mount(self, *args):
            return -1

    store = ImageStore(ImageConfig(cache_dir=images.cache_dir))
    root = store.lookup("rollway.local/examples/wordstats:1")
    monkeypatch.setattr(image_workspace, "_libc", Refuse())
    ws, _ = image_workspace.create(tmp_path / "ws", 61999, {"extra.txt": "x"}, None, root, "/testbed")
    try:
        assert ws.mode == "copy"
        assert sorted(p.name for p in ws.root.iterdir()) == ["extra.txt", "tests", "wordstats"]
        assert ws.root.stat().st_uid == 61999 and (ws.root / "wordstats/__init__.py").stat().st_uid == 61999
    finally:
        ws.remove()
    assert not (tmp_path / "ws").exists()


async def test_warm_sessions_are_made_ahead_and_give_way_when_the_pool_is_full(images, sandbox, tmp_path):
    """sandbox.images.warm_sessions_per_image: the next session of an image takes a tree
    made ahead in the background; warm slots go back to real sessions on demand."""
    from tests.waiting import wait_until_async

    cfg = msgspec.structs.replace(
        sandbox.service.cfg, max_sessions=3, workspace_root=str(tmp_path),
        images=ImageConfig(cache_dir=images.cache_dir, warm_sessions_per_image=2),
    )
    async with live_sandbox(cfg, store=sandbox.service.store) as live, SandboxClient(live.url) as client:
        pool = live.service.pool
        first = await client.create_session(NAMEKIT)
        await wait_until_async(lambda: pool.warm == 2, 30, "two warm trees of the image")
        warm_trees = {w.workspace.root for v in pool._warm.values() for w in v}
        second = await client.create_session(NAMEKIT, {"extra.txt": "hi\n"})
        assert pool.get(second).workspace.root in warm_trees and pool.warm == 1
        seen = await client.exec(second, "cat extra.txt; ls namekit")
        assert seen.stdout.split() == ["hi", "__init__.py"] and pool.get(second).uid == pool.get(second).workspace.uid
        # The pool is full (2 sessions + 1 warm): a host task's session takes the warm slot.
        host = await client.create_session("blank")
        assert pool.warm == 0 and len(pool) == 3
        for sid in (first, second, host):
            await client.close_session(sid)
    assert not any(tmp_path.iterdir())  # every tree (warm ones too) unmounted and removed


def test_loader_variables_of_an_image_are_set_only_after_the_uid_drop(images):
    """An image's Env may hold LD_PRELOAD or GLIBC_TUNABLES; the host's setpriv runs before
    the drop, so bwrap must not set them: the image's env(1) sets them after it."""
    from sandbox.isolation import Limits, bwrap_argv

    root = ImageStore(ImageConfig(cache_dir=images.cache_dir)).lookup("rollway.local/examples/namekit:1")
    limits = Limits(cpu_seconds=1, memory_bytes=1 << 28, max_processes=8, max_file_bytes=1 << 20,
                    max_open_files=64, tmp_bytes=1 << 20)
    argv = bwrap_argv("true", workspace="/tmp", uid=61000, limits=limits, binds=[], privileged=True,
                      env={"PATH": "/usr/bin", "LD_PRELOAD": "/testbed/x.so", "GLIBC_TUNABLES": "glibc.x=1"},
                      rootfs=root.rootfs, workdir="/testbed")
    set_by_bwrap = [argv[i + 1] for i, a in enumerate(argv) if a == "--setenv"]
    assert set_by_bwrap == ["PATH"]
    tail = argv[argv.index("--no-new-privs") + 1:]
    assert tail == ["/usr/bin/env", "LD_PRELOAD=/testbed/x.so", "GLIBC_TUNABLES=glibc.x=1", "/bin/bash", "-c", "true"]


def test_overlay_xattrs_of_an_image_are_stripped(tmp_path):
    from sandbox.image_unpack import strip_overlay_xattrs

    f = tmp_path / "f"
    f.write_text("x")
    os.setxattr(f, "trusted.overlay.redirect", b"/elsewhere")
    os.setxattr(f, "user.kept", b"1")
    assert strip_overlay_xattrs(tmp_path) == 1
    assert os.listxattr(f) == ["user.kept"]


def test_rollway_images_pull_list_prune(images, tmp_path):
    from tests.cli import run_cli

    cache = str(tmp_path / "cache")
    name = "rollway.local/examples/gridfmt:1"
    pulled = run_cli("images", "--cache-dir", cache, "pull", name, "--from", f"oci:{images.layout}:gridfmt")
    assert pulled.returncode == 0 and f"ok {name} sha256:" in pulled.stdout, pulled
    # --tasks: every image the set names; the one pulled is there, the others are not in any registry.
    tasks = run_cli("images", "--cache-dir", cache, "pull", "--tasks", str(EXAMPLES_JSONL))
    assert tasks.returncode == 1 and f"ok {name}" in tasks.stdout and "1 of 3 image(s) ready" in tasks.stdout
    assert "FAILED image 'rollway.local/examples/namekit:1': not found" in tasks.stdout
    listing = run_cli("images", "--cache-dir", cache, "list", "--json")
    assert [json.loads(line)["refs"] for line in listing.stdout.splitlines()] == [[name]]
    pruned = run_cli("images", "--cache-dir", cache, "prune")
    assert pruned.returncode == 0 and "1 image(s) removed; 0 left" in pruned.stdout
