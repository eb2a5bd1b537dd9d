"""A sandbox service killed with SIGKILL leaves its sessions' trees and mounts; the next
service on the same root sweeps them at start (sandbox/stale_trees.py), and leaves a live
service's trees alone. Real services, real bubblewrap, real tmpfs and overlay mounts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import structlog

from rollway.broker import free_ports
from sandbox import quota, uid_claim
from sandbox.client import SandboxClient
from sandbox.config import ImageConfig, SandboxConfig
from sandbox.workspace import Workspace
from tasks.spec import TaskSpec
from tasks.store import TaskStore
from tests.image_helpers import REPO, example_images
from tests.sandbox_helpers import live_sandbox, write_task_dir
from tests.test_sandbox_cli import wait_healthy
from tests.waiting import wait_until_async

TASK = TaskSpec(task_id="plain", instruction="anything", files={"main.py": "print('hi')\n"},
                hidden_tests={"test_main.py": "def test_x():\n    pass\n"})


def _tasks(root: Path) -> tuple[Path, str]:
    """A host task and the example image tasks; returns the folder and an image task's id."""
    write_task_dir(root, TASK)
    examples = REPO / "tasks/images/examples.jsonl"
    shutil.copy(examples, root / "examples.jsonl")
    return root, json.loads(examples.read_text().splitlines()[0])["instance_id"]


def _trees(root: Path) -> dict[str, int]:
    """Every tree of a service under ``root``, with its owner."""
    return {p.name: p.stat().st_uid for p in root.iterdir() if p.name.startswith("rollway-")}


def _mounts(root: Path) -> list[str]:
    return [m.split()[4] for m in Path("/proc/self/mountinfo").read_text().splitlines()
            if m.split()[4].startswith(f"{root}/")]


def _unmount_all(root: Path) -> None:
    """A failed test leaves nothing mounted on the host."""
    for point in sorted(_mounts(root), key=len, reverse=True):
        quota.unmount(Path(point))


async def test_a_killed_services_trees_and_mounts_are_swept_by_the_next_service(tmp_path):
    tasks, image_task = _tasks(tmp_path / "tasks")
    ws_root = tmp_path / "ws"
    images = ImageConfig(cache_dir=example_images().cache_dir, warm_sessions_per_image=0)
    port = free_ports(1)[0]
    env = {**os.environ, "ROLLWAY_SANDBOX__PORT": str(port), "ROLLWAY_SANDBOX__WORKSPACE_ROOT": str(ws_root),
           "ROLLWAY_SANDBOX__MAX_SESSIONS": "4", "ROLLWAY_SANDBOX__IMAGES__CACHE_DIR": images.cache_dir,
           "ROLLWAY_SANDBOX__IMAGES__WARM_SESSIONS_PER_IMAGE": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "rollway.cli", "sandbox", "--no-publish", "--tasks-dir", str(tasks)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, proc)
        async with SandboxClient(url) as client:
            # A host session (a tmpfs) and an image session (an overlay on a tmpfs); after a
            # command each has its next sandbox started, with its /tmp tree (a tmpfs).
            for task in ("plain", image_task):
                await client.exec(await client.create_session(task), "true")

        def made() -> bool:
            kinds = sorted(n.split("-")[1] for n, uid in _trees(ws_root).items() if uid or n.startswith("rollway-ws-"))
            return kinds == ["tmp", "tmp", "ws", "ws"]

        await wait_until_async(made, 30, "the service's 2 session trees and 2 /tmp trees", proc=proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        dead = _trees(ws_root)
        assert len(_mounts(ws_root)) == 5  # what a killed service leaves: 3 tmpfs, 1 overlay on 1 tmpfs
        opened = [json.loads(line) for line in proc.stderr.read().decode().splitlines() if '"session_opened"' in line]
        uids = {f"rollway-ws-{e['session_id']}": e["uid"] for e in opened}
        tmp_uids = {n: uid for n, uid in dead.items() if n.startswith("rollway-tmp-")}
        assert set(tmp_uids.values()) == set(uids.values()) and len(uids) == 2

        cfg = SandboxConfig(max_sessions=4, workspace_root=str(ws_root), tasks_dir=str(tasks), images=images)
        with structlog.testing.capture_logs() as logs:
            async with live_sandbox(cfg, store=TaskStore(tasks)) as live:
                assert (_trees(ws_root), _mounts(ws_root)) == ({}, [])
                async with SandboxClient(live.url) as client:
                    sid = await client.create_session("plain")
                    assert (await client.exec(sid, "cat main.py")).stdout == TASK.files["main.py"]
        swept = {(e["path"], e["uid"]) for e in logs if e["event"] == "stale_tree_swept"}
        assert swept == {(str(ws_root / n), uid) for n, uid in (uids | tmp_uids).items()}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _unmount_all(ws_root)


async def test_a_live_services_trees_on_the_same_root_are_left_alone(tmp_path):
    tasks, _ = _tasks(tmp_path / "tasks")
    ws_root = tmp_path / "ws"
    cfg = SandboxConfig(max_sessions=4, workspace_root=str(ws_root), tasks_dir=str(tasks))
    try:
        async with live_sandbox(cfg, store=TaskStore(tasks)) as first, SandboxClient(first.url) as client:
            sid = await client.create_session("plain")
            await client.exec(sid, "true")  # its next sandbox's /tmp tree too
            await wait_until_async(lambda: any(n.startswith("rollway-tmp-") for n in _trees(ws_root)), 30,
                                   "the live session's /tmp tree")
            live_trees, live_mounts = _trees(ws_root), _mounts(ws_root)
            assert {uid - first.service.cfg.uid_base for uid in live_trees.values()} == {0}
            # Beside them, the tree of a service gone: a range that no live service holds.
            gone = uid_claim.claim_uid_range(cfg.uid_base, cfg.max_sessions)
            gone.release()
            dead = ws_root / "rollway-ws-gone"
            Workspace.create(dead, gone.base + 3, {"f.py": "x = 1\n"}, quota.Quota(size_bytes=1 << 20, inodes=64))
            with structlog.testing.capture_logs() as logs:
                async with live_sandbox(cfg, store=TaskStore(tasks)) as second, SandboxClient(second.url) as other:
                    assert (_trees(ws_root), _mounts(ws_root)) == (live_trees, live_mounts)
                    assert (await client.exec(sid, "cat main.py")).stdout == TASK.files["main.py"]
                    sid2 = await other.create_session("plain")
                    assert (await other.exec(sid2, "cat main.py")).stdout == TASK.files["main.py"]
            swept = [(e["path"], e["uid"]) for e in logs if e["event"] == "stale_tree_swept"]
            assert swept == [(str(dead), gone.base + 3)]
            assert (await client.exec(sid, "cat main.py")).stdout == TASK.files["main.py"]
    finally:
        _unmount_all(ws_root)


def test_a_link_in_a_trees_place_is_neither_followed_nor_counted_as_swept(tmp_path):
    """A ``rollway-ws-*`` entry that is a symlink owned by a dead range's uid: the sweep
    follows nothing (the folder it points to keeps its file) and, since rmtree refuses a
    link, reports it kept, not swept (it logged and counted it swept before)."""
    from sandbox.stale_trees import sweep

    target = tmp_path / "host"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    root = tmp_path / "root"
    root.mkdir()
    link = root / "rollway-ws-linked"
    link.symlink_to(target)
    os.lchown(link, 60010, 60010)
    locks = tmp_path / "locks"
    own = uid_claim.claim_uid_range(60000 + 3 * uid_claim.RANGE_STRIDE, 1, locks)
    try:
        with structlog.testing.capture_logs() as logs:
            assert sweep(root, own=own, uid_base=60000, solution_uid_offset=20000, lock_dir=locks) == 0
    finally:
        own.release()
    assert (target / "keep.txt").read_text() == "x" and link.is_symlink()
    assert [(e["event"], e["path"]) for e in logs if e["event"].startswith("stale_tree")] == [
        ("stale_tree_kept", str(link))]


def test_solution_uids_must_lie_above_every_claimable_range():
    """An offset of 5,000 put range 60000's solution uids (65000+) inside range 65000: its
    clean-up and its start-up sweep read a live grading's tree as that range's (the sweep
    removed it in helper-47's run). The config refuses offsets below the ranges' span."""
    import pytest

    span = uid_claim.MAX_RANGES * uid_claim.RANGE_STRIDE
    with pytest.raises(ValueError, match=f"grading_solution_uid_offset must be at least {span}.*got 5000"):
        SandboxConfig(grading_solution_uid_offset=5000)
    assert SandboxConfig(grading_solution_uid_offset=span).grading_solution_uid_offset == span
    assert SandboxConfig().grading_solution_uid_offset == 20000


def _grading_tree(root: Path, name: str, uid: int) -> Path:
    """A grading's layout: root-owned folders above the uid's tree (grade/area/ws/tree)."""
    tree = root / name / "area" / "ws" / "tree"
    tree.mkdir(parents=True)
    (tree / "solution.py").write_text("x = 1\n")
    for path in (tree, tree / "solution.py"):
        os.chown(path, uid, uid)
    return root / name


def test_a_sweep_killed_half_way_leaves_remains_the_next_sweep_removes(tmp_path, monkeypatch):
    """Removal goes bottom up, so a sweep killed after the uid's tree went leaves the
    root-owned folders above it, whose uid cannot be told: they stayed for ever. A tree
    is renamed before it is removed, and the next sweep removes remains by that name."""
    from sandbox import stale_trees

    root, locks = tmp_path / "root", tmp_path / "locks"
    root.mkdir()
    dead = _grading_tree(root, "rollway-grade-abc", 60000 + 3 * uid_claim.RANGE_STRIDE + 7)
    own = uid_claim.claim_uid_range(60000, 1, locks)
    real_rmtree = shutil.rmtree

    def killed_half_way(path, ignore_errors=False):
        real_rmtree(Path(path) / "area" / "ws" / "tree")
        raise KeyboardInterrupt  # the sweeping service killed here

    try:
        monkeypatch.setattr(stale_trees.shutil, "rmtree", killed_half_way)
        import pytest
        with pytest.raises(KeyboardInterrupt):
            stale_trees.sweep(root, own=own, uid_base=60000, solution_uid_offset=20000, lock_dir=locks)
        monkeypatch.setattr(stale_trees.shutil, "rmtree", real_rmtree)
        remains = root / ("rollway-swept-" + dead.name)
        assert sorted(p.name for p in root.iterdir()) == [remains.name]
        assert {p.stat().st_uid for p in remains.rglob("*")} | {remains.stat().st_uid} == {0}
        with structlog.testing.capture_logs() as logs:
            assert stale_trees.sweep(root, own=own, uid_base=60000, solution_uid_offset=20000, lock_dir=locks) == 1
    finally:
        own.release()
    assert list(root.iterdir()) == []
    assert [(e["event"], e["path"], e["reason"]) for e in logs if e["event"].startswith("stale_tree")] == [
        ("stale_tree_swept", str(remains), "the remains of a sweep killed half-way")]


def test_a_killed_self_checks_tree_is_swept_and_a_live_services_grading_is_not(tmp_path):
    """A service killed during its start-up self-check left ``rollway-selfcheck-*`` (a
    session tree of its first uid); no sweep knew the name. A live service's grading beside
    it stays, renamed nothing."""
    from sandbox.stale_trees import sweep

    root, locks = tmp_path / "root", tmp_path / "locks"
    root.mkdir()
    dead_uid = 60000 + 4 * uid_claim.RANGE_STRIDE
    check = root / "rollway-selfcheck-x1y2"
    (check / "ws").mkdir(parents=True)
    os.chown(check / "ws", dead_uid, dead_uid)
    live = uid_claim.claim_uid_range(60000 + 5 * uid_claim.RANGE_STRIDE, 1, locks)
    own = uid_claim.claim_uid_range(60000, 1, locks)
    try:
        alive = _grading_tree(root, "rollway-grade-live", live.base + 1)
        with structlog.testing.capture_logs() as logs:
            assert sweep(root, own=own, uid_base=60000, solution_uid_offset=20000, lock_dir=locks) == 1
    finally:
        own.release()
        live.release()
    assert sorted(p.name for p in root.iterdir()) == [alive.name]
    assert (alive / "area/ws/tree/solution.py").read_text() == "x = 1\n"
    assert [(e["event"], e["path"], e["uid"]) for e in logs if e["event"].startswith("stale_tree")] == [
        ("stale_tree_swept", str(check), dead_uid)]
