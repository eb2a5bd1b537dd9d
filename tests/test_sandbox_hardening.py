"""Kernel-enforced limits of the sandbox: the workspace disk quota (a size-limited tmpfs
per session, ENOSPC inside, ``disk`` in the answer's limits, other sessions unaffected)
and the seccomp filter (a test per rule, each checked against the same probe run without
the filter, so the refusal is the filter's doing)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import tempfile
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from sandbox.client import SandboxClient
from sandbox.config import SandboxConfig
from sandbox.runner import Jail
from sandbox.workspace import Workspace
from tasks.spec import TaskSpec
from tasks.store import TaskStore
from tests.sandbox_helpers import live_sandbox, write_task_dir

QUOTA = 8 * 1024 * 1024
TASK = TaskSpec(task_id="blank", instruction="-", files={"README.md": "x\n"}, hidden_tests={"test_x.py": ""})

# Many files, each far under the per-file limit (16 MiB): only a total quota stops this.
FILL = (
    "python -c \"\nimport sys\nwritten = 0\ntry:\n    for i in range(400):\n"
    "        with open(f'{sys.argv[1]}/f{i}.bin', 'wb') as f:\n            f.write(b'x' * 65536)\n"
    "        written += 65536\nexcept OSError as e:\n    print('stopped', e.errno, written)\n    sys.exit(3)\n"
    "print('wrote', written)\n\" "
)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sandbox(tmp_path_factory):
    tasks = tmp_path_factory.mktemp("hardening-tasks")
    write_task_dir(tasks, TASK)
    cfg = SandboxConfig(
        max_sessions=4, workspace_root=str(tmp_path_factory.mktemp("hardening-ws")), tasks_dir=str(tasks),
        workspace_bytes=QUOTA, workspace_inodes=300, tmp_bytes=4 * 1024 * 1024,
    )
    async with live_sandbox(cfg, store=TaskStore(tasks)) as live, SandboxClient(live.url) as client:
        live.client = client
        yield live


async def test_workspace_quota_is_enospc_inside_and_disk_in_limits(sandbox):
    client = sandbox.client
    a, b = await client.create_session("blank"), await client.create_session("blank")
    full = await client.exec(a, FILL + "/workspace", timeout_s=60)
    assert full.exit_code == 3, full
    stopped, code, written = full.stdout.split()
    assert (stopped, int(code)) == ("stopped", errno.ENOSPC)
    assert int(written) <= QUOTA
    assert "disk" in full.limits
    # The other session, and the full one's neighbours, keep working.
    other = await client.exec(b, FILL.replace("range(400)", "range(16)") + "/workspace")
    assert (other.exit_code, other.stdout.strip(), other.limits) == (0, "wrote 1048576", [])
    assert (await client.health())["sessions"] == 2
    for sid in (a, b):
        await client.close_session(sid)


async def test_workspace_inode_quota(sandbox):
    client = sandbox.client
    sid = await client.create_session("blank")
    result = await client.exec(sid, "for i in $(seq 1 400); do : > e$i || exit 7; done")
    assert result.exit_code == 7 and "No space left on device" in result.stderr
    assert "disk" in result.limits
    await client.close_session(sid)


async def test_private_tmp_quota(sandbox):
    client = sandbox.client
    sid = await client.create_session("blank")
    result = await client.exec(sid, FILL + "/tmp")
    assert result.exit_code == 3 and result.stdout.split()[:2] == ["stopped", str(errno.ENOSPC)]
    assert int(result.stdout.split()[2]) <= 4 * 1024 * 1024
    assert "disk" in result.limits
    await client.close_session(sid)


# Two dozen threads that each allocate a little, then wait together.
THREADS = (
    "python -c \"\nimport threading, time\n\ndef work():\n    keep = [bytearray(1000) for _ in range(200)]\n"
    "    time.sleep(0.3)\n\nthreads = [threading.Thread(target=work) for _ in range(24)]\nfor t in threads:\n"
    "    t.start()\nfor t in threads:\n    t.join()\nprint('ok', len(threads))\n\""
)


async def test_two_dozen_threads_fit_the_address_space_limit(sandbox):
    """RLIMIT_AS (memory_bytes, 512 MiB) counts reserved address space, and glibc gives
    each thread that mallocs an arena reserving 64 MiB (up to 8 per CPU): without
    MALLOC_ARENA_MAX these threads could not start ("can't start new thread"), and an honest
    threaded solution graded in-env hit MemoryError in pytest (flagged as tampering)."""
    client = sandbox.client
    sid = await client.create_session("blank")
    result = await client.exec(sid, THREADS, timeout_s=60)
    assert (result.exit_code, result.stdout.split()) == (0, ["ok", "24"]), result
    await client.close_session(sid)


async def test_closing_a_session_unmounts_its_quota(sandbox):
    client = sandbox.client
    sid = await client.create_session("blank")
    root = sandbox.service.pool.get(sid).workspace.root
    assert os.path.ismount(root)
    await client.close_session(sid)
    assert not root.exists()


# --- seccomp ------------------------------------------------------------------------------

PROBE = r'''
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NEWUSER, SIGCHLD = 0x10000000, 17
calls = {
    "unshare": (272, NEWUSER),
    "clone_newuser": (56, NEWUSER | SIGCHLD, 0, 0, 0, 0),
    "clone_newnet": (56, 0x40000000 | SIGCHLD, 0, 0, 0, 0),
    "setns": (308, -1, 0),
    "mount": (165, b"none", b"/tmp", b"tmpfs", 0, 0),
    "umount2": (166, b"/tmp", 0),
    "ptrace": (101, 0, 0, 0, 0),
    "process_vm_readv": (310, os.getpid(), 0, 0, 0, 0, 0),
    "bpf": (321, 0, 0, 0),
    "keyctl": (250, 0, -1, 0),
    "add_key": (248, 0, 0, 0, 0, 0),
    "perf_event_open": (298, 0, 0, -1, -1, 0),
    "userfaultfd": (323, 0),
    "kexec_load": (246, 0, 0, 0, 0),
    "clone3": (435, 0, 0),
}
out = {}
for name, args in calls.items():
    ctypes.set_errno(0)
    rc = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if rc == 0 and name.startswith("clone"):
        os._exit(0)  # the child of a clone that went through
    if rc > 0 and name.startswith("clone"):
        os.waitpid(rc, 0)
    out[name] = 0 if rc >= 0 else ctypes.get_errno()
pid = os.fork()
if pid == 0:
    os._exit(0)
out["fork"] = os.waitpid(pid, 0)[1]
out["seccomp"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")][0]
print(json.dumps(out))
'''


async def _probe(seccomp: bool, root: Path, uid: int) -> dict:
    cfg = SandboxConfig(seccomp=seccomp, cgroups="off", workspace_root=str(root))
    ws, _ = Workspace.create(root / f"probe-{seccomp}", uid, {"probe.py": PROBE})
    result = await Jail(cfg).run("python probe.py", workspace=ws.root, uid=uid, timeout_s=30)
    assert result.exit_code == 0, result
    return json.loads(result.stdout)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def probes(tmp_path_factory):
    from sandbox.uid_claim import claim_uid_range

    root = tmp_path_factory.mktemp("probe")
    # uids of a range claimed like a service's: a fixed uid may be a live service's session
    cfg = SandboxConfig()
    claim = claim_uid_range(cfg.uid_base, 2, solution_uid_offset=cfg.grading_solution_uid_offset)
    own = (claim.base, claim.base + 1) if os.geteuid() == 0 else (os.geteuid(), os.geteuid())
    try:
        filtered, unfiltered = await asyncio.gather(_probe(True, root, own[0]), _probe(False, root, own[1]))
    finally:
        claim.release()
    return filtered, unfiltered


RULES = ["unshare", "clone_newuser", "clone_newnet", "setns", "mount", "umount2", "ptrace", "process_vm_readv",
         "bpf", "keyctl", "add_key", "perf_event_open", "userfaultfd", "kexec_load"]


@pytest.mark.parametrize("rule", RULES)
def test_seccomp_refuses(probes, rule):
    filtered, _ = probes
    assert filtered[rule] == errno.EPERM, (rule, filtered)


# Without the filter these get another answer (success or a different errno): the refusal
# above is the filter's, not a missing privilege.
@pytest.mark.parametrize("rule", ["unshare", "clone_newnet", "setns", "keyctl", "add_key", "perf_event_open",
                                  "clone3"])
def test_without_the_filter_the_kernel_answers_differently(probes, rule):
    filtered, unfiltered = probes
    assert unfiltered[rule] != filtered[rule], (rule, filtered, unfiltered)


def test_clone3_answers_enosys_and_fork_still_works(probes):
    filtered, unfiltered = probes
    assert filtered["clone3"] == errno.ENOSYS
    assert filtered["fork"] == 0
    assert (filtered["seccomp"], unfiltered["seccomp"]) == ("2", "0")


async def test_no_nested_user_namespace_from_the_shell(sandbox):
    client = sandbox.client
    sid = await client.create_session("blank")
    result = await client.exec(sid, "unshare -r true; echo rc=$?; python -c 'import threading; t = threading.Thread("
                                    "target=print, args=(\"thread ok\",)); t.start(); t.join()'")
    assert "rc=1" in result.stdout and "thread ok" in result.stdout, result
    assert "Operation not permitted" in result.stderr
    await client.close_session(sid)


def test_two_cgroup_managers_in_one_process_do_not_share_a_parent():
    """Two sandbox services in one process (the grader tests run two) used to share
    rollway-sandbox-<pid>: the first to close removed it and every later command of the
    other failed with FileNotFoundError."""
    from sandbox.cgroups import make_cgroup_manager

    first = make_cgroup_manager("required", max_processes=64, memory_bytes=256 << 20)
    second = make_cgroup_manager("required", max_processes=64, memory_bytes=256 << 20)
    try:
        assert set(first.parents.values()).isdisjoint(second.parents.values())
        second.close()
        assert not any(p.exists() for p in second.parents.values())
        group = first.create("after-the-other-closed")
        assert all(d.is_dir() for d in group.dirs.values())
        group.remove()
    finally:
        second.close()
        first.close()
    assert not any(p.exists() for p in first.parents.values())


def test_sandbox_services_on_one_host_claim_disjoint_uid_ranges(tmp_path):
    """Cleaning up a command SIGKILLs every process of its uid: two services with the
    same uid_base (a stack's sandbox and a test suite's, or `rollway eval`'s) killed each
    other's gradings (exit 137, no report). Each claims its own range; a released range
    is reused; a crashed holder's lock goes with its process."""
    import subprocess
    import sys

    from sandbox.uid_claim import RANGE_STRIDE, claim_uid_range

    locks = tmp_path / "locks"
    first = claim_uid_range(60000, 8, locks)
    second = claim_uid_range(60000, 8, locks)
    assert (first.base, second.base) == (60000, 60000 + RANGE_STRIDE)
    first.release()
    third = claim_uid_range(60000, 8, locks)
    assert third.base == 60000
    # Another process holding the next free range, then killed: its range is free again.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from sandbox.uid_claim import "
         "claim_uid_range; c = claim_uid_range(60000, 8, Path(sys.argv[1])); print('BASE', c.base, flush=True); "
         "time.sleep(60)", str(locks)], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("BASE "):  # structlog's lines come first
            line = holder.stdout.readline()
            assert line, "the holder exited"
        assert int(line.split()[1]) == 60000 + 2 * RANGE_STRIDE
        fourth = claim_uid_range(60000, 8, locks)
        assert fourth.base == 60000 + 3 * RANGE_STRIDE
        fourth.release()
    finally:
        holder.kill()
        holder.wait()
    assert claim_uid_range(60000, 8, locks).base == 60000 + 2 * RANGE_STRIDE
    second.release()
    third.release()
    with pytest.raises(ValueError, match="max_sessions 600"):
        claim_uid_range(60000, 600, locks)


def test_services_configured_with_other_uid_bases_never_share_a_uid(tmp_path):
    """Claims lock every aligned block a range touches, its solution uids' too: a service
    at uid_base 80000 would otherwise run sessions as the solution uids of one at 60000
    (offset 20000), and one at 60500 half inside 60000's range, each one's clean-up
    killing the other's processes."""
    from sandbox.uid_claim import RANGE_STRIDE, blocks_of, claim_uid_range

    assert blocks_of(60000, 20000) == [60000, 80000]
    assert blocks_of(60500, 20000) == [60000, 61000, 80000, 81000]
    assert blocks_of(60000) == [60000]
    locks = tmp_path / "locks"
    a = claim_uid_range(60000, 8, locks, solution_uid_offset=20000)
    b = claim_uid_range(80000, 8, locks, solution_uid_offset=20000)  # 80000: a's solution block
    c = claim_uid_range(60500, 8, locks, solution_uid_offset=20000)  # 60000 a's, then 81000 b's
    assert (a.base, b.base, c.base) == (60000, 81000, 62500)

    def uids(base: int) -> set[int]:
        return set(range(base, base + RANGE_STRIDE)) | set(range(base + 20000, base + 20000 + RANGE_STRIDE))

    assert not uids(a.base) & uids(b.base) and not uids(a.base) & uids(c.base) and not uids(b.base) & uids(c.base)
    a.release()
    # a's blocks are free again: the same configuration takes them back whole
    assert claim_uid_range(60000, 8, locks, solution_uid_offset=20000).base == 60000


def test_uid_claims_refuse_a_folder_or_lock_file_another_user_could_replace(tmp_path, monkeypatch):
    """Whoever can replace a lock file makes two services hold one range (each flocks its
    own inode): they kill each other's commands and sweep each other's trees. The claims'
    folder must be this user's own and writable by no one else, a lock file that is a
    link is refused (not followed), and root's default folder is in /run, not /tmp."""
    import os

    from sandbox import uid_claim
    from sandbox.uid_claim import UnsafeLockDir, claim_uid_range

    fresh = tmp_path / "fresh" / "locks"
    claim = claim_uid_range(60000, 8, fresh)  # made, 0700, parents too
    assert claim.base == 60000 and oct(os.stat(fresh).st_mode & 0o777) == "0o700"
    assert oct(os.stat(fresh / "uids-60000.lock").st_mode & 0o777) == "0o600"
    claim.release()

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # as a folder another user made in /tmp would be
    with pytest.raises(UnsafeLockDir, match=f"{shared} is writable by group or others \\(mode 777\\)"):
        claim_uid_range(60000, 8, shared)
    assert list(shared.iterdir()) == []

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UnsafeLockDir, match=f"{theirs} is owned by uid 65534, not by this service's uid {os.geteuid()}"):
        claim_uid_range(60000, 8, theirs)

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    linked = tmp_path / "linked"
    linked.symlink_to(real)
    with pytest.raises(UnsafeLockDir, match=f"{linked} is a symbolic link"):
        claim_uid_range(60000, 8, linked)
    assert list(real.iterdir()) == []

    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    target = tmp_path / "elsewhere" / "victim"
    target.parent.mkdir()
    (own / "uids-60000.lock").symlink_to(target)
    with pytest.raises(UnsafeLockDir, match="uids-60000.lock is a symbolic link: refused"):
        claim_uid_range(60000, 8, own)
    assert not target.exists()  # not created through the link

    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(UnsafeLockDir, match=f"{blocked} is not a folder"):
        claim_uid_range(60000, 8, blocked)

    monkeypatch.delenv("ROLLWAY_UID_LOCK_DIR", raising=False)
    assert uid_claim.default_lock_dir() == (Path("/run/rollway-sandbox-uids") if os.geteuid() == 0 else
                                            Path(tempfile.gettempdir()) / f"rollway-sandbox-uids-{os.geteuid()}")
    monkeypatch.setenv("ROLLWAY_UID_LOCK_DIR", str(own))
    assert uid_claim.default_lock_dir() == own
