"""Uid-range claims (sandbox/uid_claim.py) against a hostile local user and odd
configurations, and the start-up sweep (sandbox/stale_trees.py) that reads them. No
sandboxed process runs here: claims in the test's own folder, trees as plain folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog

from sandbox import uid_claim
from sandbox.uid_claim import UnsafeLockDir, claim_uid_range


def test_a_claims_folder_inside_a_folder_another_user_can_write_is_refused(tmp_path):
    """The folder's own checks do not protect it from whoever can write a folder above
    it: they can rename the claims' folder away (no race needed) or swap it between the
    check and the open, and the next service makes a fresh folder and claims a range a
    live service holds (each flocks its own file): they kill each other's commands. A
    folder above that others may write (without the sticky bit, or owned by another user)
    is refused; a sticky one of root's (/tmp) and links in safe folders (/var/run) are not."""
    # Before: the first claim was taken, and after `mv shared/locks shared/moved` (what any
    # user may do in `shared`) a second service claimed 60000 again.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeLockDir, match=f"folder above it, {shared}, is writable by group or others "
                                            f"without the sticky bit \\(mode 777\\)"):
        claim_uid_range(60000, 8, shared / "deeper" / "locks", solution_uid_offset=20000)

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "locks").mkdir(mode=0o700)  # ours, in a folder another user owns (may rename in)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UnsafeLockDir, match=f"folder above it, {theirs}, is owned by uid 65534"):
        claim_uid_range(60000, 8, theirs / "locks", solution_uid_offset=20000)

    sticky_theirs = tmp_path / "sticky-theirs"
    sticky_theirs.mkdir()
    sticky_theirs.chmod(0o1777)
    os.chown(sticky_theirs, 65534, 65534)  # a sticky folder's owner may still rename what is in it
    with pytest.raises(UnsafeLockDir, match=f"folder above it, {sticky_theirs}, is owned by uid 65534"):
        claim_uid_range(60000, 8, sticky_theirs / "locks", solution_uid_offset=20000)

    safe = tmp_path / "safe"
    safe.mkdir(mode=0o700)
    (shared / "link").symlink_to(safe)  # the link itself can be changed by anyone
    with pytest.raises(UnsafeLockDir, match=f"folder above it, {shared}, is writable"):
        claim_uid_range(60000, 8, shared / "link" / "locks", solution_uid_offset=20000)

    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: others cannot rename what is ours in it
    claim = claim_uid_range(60000, 8, sticky / "locks", solution_uid_offset=20000)
    assert claim.base == 60000
    claim.release()
    (tmp_path / "run-link").symlink_to(safe)  # as /var/run -> /run
    claim = claim_uid_range(60000, 8, tmp_path / "run-link" / "locks", solution_uid_offset=20000)
    assert claim.base == 60000 and (safe / "locks" / "uids-60000.lock").exists()
    claim.release()


def test_the_sweep_takes_a_dead_tree_by_its_uids_block_not_by_the_whole_range_it_maps_to(tmp_path):
    """With uid_base 60500 (not a multiple of 1,000) a range spans two blocks. A tree that a
    dead predecessor left at range 61500 (shifted once) has uids in blocks 61000 (which this
    service holds) and 62000 (free): the sweep claimed the whole range 61500, failed on
    this service's own block 61000 and left all of them, with their mounts, as "a live
    service's". A free block, or one of this service's own, holds no live service's uid:
    its trees are swept; a tree in a block another live service holds is kept."""
    from sandbox.stale_trees import sweep

    locks = tmp_path / "locks"
    own = claim_uid_range(60500, 8, locks, solution_uid_offset=20000)
    live = claim_uid_range(63000, 8, locks, solution_uid_offset=20000)  # another live service
    assert (own.base, live.base) == (60500, 63000)
    root = tmp_path / "root"
    root.mkdir()
    trees = {"rollway-ws-own": 60600,  # this service's range: its predecessor's
             "rollway-ws-in-own-block": 61700,  # dead range 61500, in block 61000 (this service's)
             "rollway-ws-free-block": 62200,  # dead range 61500, block 62000: no one's
             "rollway-grade-free-block": 82200,  # its solution uid, block 82000: no one's
             "rollway-ws-live": 63100,  # block 63000: the live service's
             "rollway-grade-live": 83100}  # its solution uid, block 83000
    for name, uid in trees.items():
        (root / name).mkdir()
        (root / name / "f.py").write_text("x = 1\n")
        os.chown(root / name, uid, uid)
    try:
        with structlog.testing.capture_logs() as logs:
            swept = sweep(root, own=own, uid_base=60500, solution_uid_offset=20000, lock_dir=locks)
        assert sorted(p.name for p in root.iterdir()) == ["rollway-grade-live", "rollway-ws-live"]
        assert swept == 4
        assert sorted((e["path"], e["uid"]) for e in logs if e["event"] == "stale_tree_swept") == sorted(
            (str(root / name), uid) for name, uid in trees.items() if "live" not in name)
        # The swept blocks were held only while sweeping; the live service's are still held.
        freed = uid_claim.try_claim(62000, locks, solution_uid_offset=20000)
        assert freed is not None and uid_claim.try_claim(63000, locks, solution_uid_offset=20000) is None
        freed.release()
    finally:
        own.release()
        live.release()


def test_a_claims_folder_that_cannot_be_made_is_a_one_line_refusal_not_a_traceback(tmp_path):
    """Root's claims moved from /tmp to /run: where /run is read-only (a container run
    read-only), the service died with an OSError traceback (exit 1) from deep in its
    start, naming neither the setting nor the way out. It is refused like an unsafe
    folder: `rollway sandbox` prints one line naming the folder and ROLLWAY_UID_LOCK_DIR,
    and exits 2."""
    import subprocess
    import sys

    from sandbox import quota
    from tasks.spec import TaskSpec
    from tests.sandbox_helpers import write_task_dir

    read_only = tmp_path / "run"
    read_only.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)], check=True)
    try:
        with pytest.raises(uid_claim.LockDirUnusable, match=f"cannot make the sandbox uid claims folder "
                                                            f"{read_only}/rollway-sandbox-uids: Read-only file system"
                                                            f".*set ROLLWAY_UID_LOCK_DIR"):
            claim_uid_range(60000, 8, read_only / "rollway-sandbox-uids", solution_uid_offset=20000)
        tasks = tmp_path / "tasks"
        write_task_dir(tasks, TaskSpec(task_id="t", instruction="-", files={"a.py": ""},
                                       hidden_tests={"test_a.py": ""}))
        env = {**os.environ, "ROLLWAY_UID_LOCK_DIR": str(read_only / "rollway-sandbox-uids"),
               "ROLLWAY_SANDBOX__WORKSPACE_ROOT": str(tmp_path / "ws")}
        done = subprocess.run([sys.executable, "-m", "rollway.cli", "sandbox", "--no-publish",
                               "--tasks-dir", str(tasks)], env=env, capture_output=True, text=True, timeout=120)
        said = [line for line in done.stderr.splitlines() if not line.startswith("{")]
        assert (done.returncode, len(said)) == (2, 1), done.stderr
        assert said[0].startswith(f"rollway sandbox: cannot make the sandbox uid claims folder {read_only}/")
    finally:
        quota.unmount(read_only)


def test_a_claim_that_fails_on_a_later_block_drops_the_blocks_it_took(tmp_path):
    """A lock file that cannot be opened (here: a link in its place) after earlier blocks
    were locked: the refusal releases those blocks at once, so the range is free for the
    next try, not held until the exception is collected."""
    import fcntl

    locks = tmp_path / "locks"
    locks.mkdir(mode=0o700)
    (locks / "uids-80000.lock").symlink_to(tmp_path / "elsewhere")
    try:
        raise_info = None
        with pytest.raises(UnsafeLockDir, match="uids-80000.lock is a symbolic link") as raise_info:
            claim_uid_range(60000, 8, locks, solution_uid_offset=20000)
        # the exception (and its frames) still alive: block 60000 must already be free
        with open(locks / "uids-60000.lock", "ab") as probe:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        del raise_info


def test_max_sessions_beyond_a_uid_range_is_refused_with_the_config():
    from sandbox.config import SandboxConfig

    assert SandboxConfig(max_sessions=500).max_sessions == 500
    with pytest.raises(ValueError, match="sandbox.max_sessions must be at most 500 \\(one uid range of 1000\\), got 501"):
        SandboxConfig(max_sessions=501)
