"""The sandbox service against hostile code, live: real HTTP, real bubblewrap sandboxes.

Each hostile case runs in its own session while a second session keeps working (checked
during and after), and no process of the hostile session's uid survives its command.
Network cases only ever target loopback addresses of this machine.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest
import pytest_asyncio

from sandbox.client import ExecResult, SandboxClient, SandboxError
from sandbox.config import SandboxConfig
from sandbox.runner import uid_pids
from tasks.spec import TaskSpec
from tasks.store import TaskStore
from tests.sandbox_helpers import live_sandbox, write_task_dir
from tests.waiting import wait_until_async

MAX_OUTPUT = 4096
MAX_PROCESSES = 32
MEMORY = 256 * 1024 * 1024
HIDDEN_MARKER = "hidden_marker_7f3a9c"

TASK = TaskSpec(
    task_id="hostile",
    instruction="anything",
    files={"main.py": "print('hello')\n", "pkg/util.py": "X = 1\n", ".git/config": "[core]\n", ".git/HEAD": "ref\n"},
    hidden_tests={f"test_{HIDDEN_MARKER}.py": f"# {HIDDEN_MARKER}\ndef test_x():\n    assert True\n"},
)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile-tasks")
    write_task_dir(root, TASK)
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sandbox(tasks_dir, tmp_path_factory):
    cfg = SandboxConfig(
        max_sessions=8,
        max_concurrent_commands=4,
        command_timeout_s=5.0,
        cpu_seconds=1,
        memory_bytes=MEMORY,
        max_processes=MAX_PROCESSES,
        max_output_bytes=MAX_OUTPUT,
        max_output_total_bytes=1024 * 1024,
        workspace_root=str(tmp_path_factory.mktemp("workspaces")),
        tasks_dir=str(tasks_dir),
    )
    async with live_sandbox(cfg, store=TaskStore(tasks_dir)) as live:
        async with SandboxClient(live.url) as client:
            live.client = client
            yield live


async def open_session(sandbox, files=None) -> str:
    return await sandbox.client.create_session("hostile", files)


def _descendants(root: int) -> set[int]:
    """``root`` and every process below it (from /proc/PID/stat's parent pids)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            parent[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [child for child, ppid in parent.items() if ppid == pid and child not in found]
        found.update(kids)
        frontier += kids
    return found


async def command_survivors(sandbox, session_id: str, uid: int) -> list[int]:
    """The processes of the session's uid that outlived its command. The service starts
    the session's next sandbox (as the session's uid, waiting for the next command)
    0.1 s after a command ends: that one and its children are not survivors. On a
    loaded machine the check runs after that start (a flaky failure under xdist)."""
    pids = uid_pids(uid)
    starting = sandbox.service.pool.get(session_id).next_sandbox
    if not pids or starting is None:
        return pids
    pre = await starting  # the start finished: its processes are the ones it made
    pids = uid_pids(uid)
    if pre is None:
        return pids
    ours = _descendants(pre.proc.pid)
    return [pid for pid in pids if pid not in ours]


async def run_hostile(sandbox, command: str, timeout_s: float | None = None, script: str | None = None) -> ExecResult:
    """Run ``command`` in a fresh session while another session keeps answering; return its
    result. ``script``, when given, is in the workspace as ``hostile.py``."""
    hostile = await open_session(sandbox, {**TASK.files, "hostile.py": script} if script else None)
    bystander = await open_session(sandbox)
    uid = sandbox.service.pool.get(hostile).uid
    try:
        task = asyncio.create_task(sandbox.client.exec(hostile, command, timeout_s=timeout_s))
        # The bystander is asked while the hostile command runs (or once it is already over).
        await wait_until_async(lambda: uid_pids(uid) or task.done(), 30, "the hostile command to start")
        during = await sandbox.client.exec(bystander, "echo alive; cat main.py")
        assert during.exit_code == 0 and during.stdout == "alive\nprint('hello')\n", during
        result = await task
        # The whole tree is gone with the command.
        assert await command_survivors(sandbox, hostile, uid) == []
        after = await sandbox.client.exec(bystander, "echo still alive")
        assert after.stdout == "still alive\n"
        health = await sandbox.client.health()
        assert health["sessions"] >= 2
        return result
    finally:
        await sandbox.client.close_session(hostile)
        await sandbox.client.close_session(bystander)


# --- the hostile suite ---------------------------------------------------------------


async def test_fork_bomb_is_contained(sandbox):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = await run_hostile(sandbox, "python hostile.py", timeout_s=2.0, script=bomb)
    # Contained either by the wall clock or, when the parent wins enough CPU on a quiet
    # machine, by its 1 s CPU limit (SIGXCPU); then the rest of the tree is killed.
    if result.timed_out:
        assert result.killed == "timeout", result
    else:
        assert result.exit_code == 128 + 24 and "cpu" in result.limits, result
    if sandbox.service.cgroups is not None:
        assert "processes" in result.limits


async def test_fork_bomb_never_exceeds_the_process_limit(sandbox):
    # Count from inside: fork sleepers until refused, then report how many exist.
    script = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(500):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
        "print('forked', n)\n"
    )
    result = await run_hostile(sandbox, "python hostile.py", timeout_s=4.0, script=script)
    assert "refused 11" in result.stdout, result  # EAGAIN
    forked = int(result.stdout.split("forked")[1])
    assert 0 < forked < MAX_PROCESSES
    assert result.exit_code == 0 and result.killed == ""


async def test_memory_hog_single_process(sandbox):
    result = await run_hostile(sandbox, "python -c 'x = bytearray(2 * 1024**3)'")
    assert result.exit_code == 1
    assert "MemoryError" in result.stderr


async def test_memory_hog_many_processes(sandbox):
    # 8 children of 100 MB each stay under RLIMIT_AS one by one; only the cgroup sees 800 MB.
    script = (
        "import os, time\n"
        "for _ in range(8):\n"
        "    if os.fork() == 0:\n"
        "        x = bytearray(100 * 1024**2)\n"
        "        time.sleep(2)\n"
        "        os._exit(0)\n"
        "codes = [os.wait()[1] for _ in range(8)]\n"
        "print('killed', sum(1 for c in codes if os.WIFSIGNALED(c)))\n"
    )
    result = await run_hostile(sandbox, "python hostile.py", script=script)
    if sandbox.service.cgroups is not None:
        # The cgroup's OOM killer picks its victim by badness: usually a 100 MB child
        # (the parent then reports it), sometimes, under load, the parent itself (137).
        assert "memory" in result.limits, result
        if result.exit_code == 0:
            assert int(result.stdout.split("killed")[1]) >= 1, result
        else:
            assert result.exit_code == 137, result
    else:
        assert result.exit_code == 0, result


async def test_infinite_loop_hits_the_wall_clock_timeout(sandbox):
    # The session's CPU limit is 1 s; a 0.4 s wall clock must win the race with it
    # whatever the machine's load (at 1.0 s the two tied and the test flaked).
    result = await run_hostile(sandbox, "while true; do :; done", timeout_s=0.4)
    assert result.timed_out is True and result.killed == "timeout", result
    assert result.exit_code == 137
    assert result.duration_s >= 0.4  # no upper bound: the kill's latency depends on load


async def test_cpu_bound_loop_hits_the_cpu_limit(sandbox):
    # cpu_seconds=1 with a 30 s wall clock (room for a loaded machine): RLIMIT_CPU
    # (SIGXCPU) ends it first.
    result = await run_hostile(sandbox, "python -c 'while True: pass'", timeout_s=30.0)
    assert result.timed_out is False
    assert result.exit_code == 128 + 24
    assert result.limits == ["cpu"]


async def test_gigabytes_of_output_are_capped(sandbox):
    result = await run_hostile(sandbox, "head -c 5000000000 /dev/zero | tr '\\0' y; echo done", timeout_s=5.0)
    assert result.killed == "output" and "output" in result.limits
    assert result.truncated is True
    assert result.stdout == "y" * MAX_OUTPUT
    assert result.timed_out is False  # stopped by the output cap, well before the timeout


async def test_output_under_the_cap_is_kept_whole(sandbox):
    sid = await open_session(sandbox)
    try:
        result = await sandbox.client.exec(sid, f"head -c {MAX_OUTPUT} /dev/zero | tr '\\0' a; echo err >&2")
        assert result.stdout == "a" * MAX_OUTPUT and result.stderr == "err\n"
        assert result.truncated is False and result.killed == ""
        over = await sandbox.client.exec(sid, f"head -c {MAX_OUTPUT + 1} /dev/zero | tr '\\0' a")
        assert over.truncated is True and over.stdout == "a" * MAX_OUTPUT and over.killed == ""
    finally:
        await sandbox.client.close_session(sid)


async def test_sleep_past_the_timeout(sandbox):
    result = await run_hostile(sandbox, "sleep 60; echo never", timeout_s=1.0)
    assert result.timed_out is True and "never" not in result.stdout


async def test_daemonized_process_dies_with_the_command(sandbox):
    # A detached grandchild in a new session: the pid namespace still takes it along.
    result = await run_hostile(sandbox, "setsid nohup sleep 60 >/dev/null 2>&1 & disown; echo detached")
    assert result.stdout == "detached\n" and result.exit_code == 0
    assert result.timed_out is False  # the command did not wait for its daemon


async def test_connect_to_a_loopback_server_outside_fails(sandbox):
    accepted = []

    async def on_connect(reader, writer):
        accepted.append(True)
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        # The server answers from outside the sandbox...
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        await wait_until_async(lambda: accepted, 10, "the server to accept")
        assert accepted == [True]
        # ...but not from inside: the sandbox's 127.0.0.1 is its own empty loopback.
        probe = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('CONNECTED')\n"
            "except OSError as e:\n"
            "    print('failed', type(e).__name__, e.errno)\n"
        )
        result = await run_hostile(sandbox, "python hostile.py", script=probe)
        assert result.stdout.strip() == "failed ConnectionRefusedError 111"
        await asyncio.sleep(0.1)  # a window in which no second connection may arrive
        assert accepted == [True]
    finally:
        server.close()
        await server.wait_closed()


async def test_only_loopback_interface(sandbox):
    result = await run_hostile(
        sandbox, "python -c 'import socket; print(socket.if_nameindex())'; tail -n +3 /proc/net/dev | cut -d: -f1"
    )
    lines = result.stdout.split("\n")
    assert lines[0] == "[(1, 'lo')]"
    assert [line.strip() for line in lines[1:] if line.strip()] == ["lo"]


async def test_hidden_tests_are_not_reachable(sandbox, tasks_dir):
    hidden = next((tasks_dir / "hostile" / "hidden_tests").iterdir())
    assert HIDDEN_MARKER in hidden.read_text()  # it exists on the host
    result = await run_hostile(
        sandbox,
        f"cat {hidden}; ls {tasks_dir}; ls -a /workspace; "
        f"find / -xdev -name '*{HIDDEN_MARKER}*' 2>/dev/null; echo find-done; ls /work/main",
    )
    assert "No such file or directory" in result.stderr
    assert HIDDEN_MARKER not in result.stdout
    assert "find-done" in result.stdout
    listing = result.stdout.split("find-done")
    # The workspace holds the repo only: no hidden tests, no VCS history.
    assert sorted(listing[0].split()) == [".", "..", "main.py", "pkg"]
    # The repository (service code, task store) is not there; only the read-only venv is.
    assert listing[1].split() == []
    # Nor importable through the venv's editable install of the project.
    sid = await open_session(sandbox)
    try:
        imports = await sandbox.client.exec(sid, "python -c 'import sandbox.grader'; python -c 'import tasks.store'")
        assert imports.stderr.count("ModuleNotFoundError") == 2
    finally:
        await sandbox.client.close_session(sid)


async def test_writes_outside_the_workspace_fail(sandbox, tmp_path):
    venv = Path(os.sys.prefix)
    targets = ["/usr/pwned", "/etc/pwned", "/pwned", f"{venv}/pwned", "/root/pwned", "/proc/sys/kernel/hostname"]
    script = "; ".join(f"(echo x > {t}) 2>/dev/null && echo WROTE {t} || echo refused {t}" for t in targets)
    result = await run_hostile(sandbox, f"{script}; echo tmp > /tmp/private && cat /tmp/private; echo ws > ok.txt")
    for t in targets:
        assert f"refused {t}" in result.stdout
    assert "WROTE" not in result.stdout
    assert "tmp\n" in result.stdout
    for t in ("/usr/pwned", "/etc/pwned", "/pwned", f"{venv}/pwned", "/root/pwned"):
        assert not os.path.exists(t)
    assert not os.path.exists("/tmp/private")  # the sandbox's /tmp is its own


async def test_tmp_is_private_to_each_command(sandbox):
    sid = await open_session(sandbox)
    try:
        await sandbox.client.exec(sid, "echo secret > /tmp/carry")
        result = await sandbox.client.exec(sid, "cat /tmp/carry")
        assert result.exit_code == 1 and "No such file" in result.stderr
    finally:
        await sandbox.client.close_session(sid)


async def test_symlink_escape_through_the_file_api(sandbox, tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host secret")
    sid = await open_session(sandbox)
    try:
        result = await sandbox.client.exec(
            sid, f"ln -s {secret} leak; ln -s {tmp_path} hostdir; ln -s /etc/hostname etc_link; cat leak; ls"
        )
        assert "host secret" not in result.stdout  # the link dangles inside the sandbox
        for path in ("leak", "etc_link", "hostdir/host-secret.txt"):
            with pytest.raises(SandboxError) as err:
                await sandbox.client.read_file(sid, path)
            assert err.value.status == 400 and "symlink" in err.value.message
        with pytest.raises(SandboxError) as err:
            await sandbox.client.write_file(sid, "hostdir/planted.txt", "x")
        assert err.value.status == 400 and "symlink" in err.value.message
        with pytest.raises(SandboxError) as err:
            await sandbox.client.write_file(sid, "leak", "overwritten")
        assert err.value.status == 400
        assert secret.read_text() == "host secret"
        assert not (tmp_path / "planted.txt").exists()
    finally:
        await sandbox.client.close_session(sid)


async def test_symlink_escape_inside_the_sandbox(sandbox, tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host secret")
    result = await run_hostile(
        sandbox, f"ln -s / root_link; cat root_link{secret}; ln -s {tmp_path} d; ls d/; echo end"
    )
    assert "host secret" not in result.stdout
    assert result.stdout.endswith("end\n")


async def test_killing_its_parent(sandbox):
    result = await run_hostile(
        sandbox, "kill -9 $PPID; kill -9 1; kill -9 -1 2>/dev/null; echo survived", timeout_s=3.0
    )
    # The parent is the sandbox's pid 1 (root-owned): EPERM, twice; kill -1 reaches only
    # the command's own processes (and spares the caller).
    assert result.stderr.count("kill: (1) - Operation not permitted") == 2
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "survived\n", False)
    health = await sandbox.client.health()
    assert health["capacity"] == 8


# --- isolation properties and the API -----------------------------------------------


async def test_runs_unprivileged_with_a_scrubbed_environment(sandbox, monkeypatch):
    monkeypatch.setenv("ROLLWAY_SECRET_TOKEN", "s3cr3t")
    sid = await open_session(sandbox)
    try:
        result = await sandbox.client.exec(sid, "id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; env; hostname")
        uid = sandbox.service.pool.get(sid).uid
        lines = result.stdout.splitlines()
        assert lines[0] == str(uid) and uid >= 60000
        assert "CapEff:\t0000000000000000" in lines
        assert "NoNewPrivs:\t1" in lines
        assert "s3cr3t" not in result.stdout
        env = dict(line.split("=", 1) for line in lines if "=" in line)
        assert env["HOME"] == "/tmp" and env["PWD"] == "/workspace"
        assert "KAFKA_BOOTSTRAP_SERVERS" not in env
        assert lines[-1] == "sandbox"
        # The Python the agent gets has pytest.
        py = await sandbox.client.exec(sid, "python -c 'import pytest, sys; print(pytest.__name__, sys.prefix)'")
        assert py.exit_code == 0 and py.stdout.startswith("pytest ")
    finally:
        await sandbox.client.close_session(sid)


async def test_file_size_limit(sandbox):
    sid = await open_session(sandbox)
    try:
        cfg = sandbox.service.cfg
        result = await sandbox.client.exec(sid, f"head -c {cfg.max_file_bytes + 1} /dev/zero > big; stat -c %s big")
        assert result.stdout.strip() == str(cfg.max_file_bytes)
        assert "File size limit exceeded" in result.stderr
        # As the command's own exit status, it is reported as a limit.
        alone = await sandbox.client.exec(sid, f"exec head -c {cfg.max_file_bytes + 1} /dev/zero > big2")
        assert alone.exit_code == 128 + 25 and alone.limits == ["file_size"]
    finally:
        await sandbox.client.close_session(sid)


async def test_open_files_limit(sandbox):
    sid = await open_session(sandbox)
    try:
        result = await sandbox.client.exec(
            sid, "python -c 'import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)); "
                 "fs = [open(\"/dev/null\") for _ in range(10000)]'",
        )
        assert result.stdout.strip() == f"({sandbox.service.cfg.max_open_files}, {sandbox.service.cfg.max_open_files})"
        assert "Too many open files" in result.stderr
    finally:
        await sandbox.client.close_session(sid)


async def test_file_api_round_trip_and_bad_paths(sandbox):
    sid = await open_session(sandbox)
    try:
        assert await sandbox.client.read_file(sid, "main.py") == "print('hello')\n"
        assert await sandbox.client.write_file(sid, "new/dir/f.txt", "héllo") == len("héllo".encode())
        assert (await sandbox.client.exec(sid, "cat new/dir/f.txt")).stdout == "héllo"
        await sandbox.client.exec(sid, "echo from-sandbox > made.txt")
        assert await sandbox.client.read_file(sid, "made.txt") == "from-sandbox\n"
        for bad in ("../etc/passwd", "/etc/passwd", "a/../../x", ".git/config", ""):
            with pytest.raises(SandboxError) as err:
                await sandbox.client.read_file(sid, bad)
            assert err.value.status == 400, bad
        with pytest.raises(SandboxError) as err:
            await sandbox.client.read_file(sid, "missing.txt")
        assert err.value.status == 404 and "missing.txt" in err.value.message
        with pytest.raises(SandboxError) as err:
            await sandbox.client.read_file(sid, "pkg")
        assert err.value.status == 400 and "directory" in err.value.message
        await sandbox.client.exec(sid, "mkfifo pipe")
        with pytest.raises(SandboxError) as err:
            await sandbox.client.read_file(sid, "pipe")
        assert err.value.status == 400 and "regular file" in err.value.message
    finally:
        await sandbox.client.close_session(sid)


async def test_vcs_history_is_dropped(sandbox):
    resp = await sandbox.client.request(
        "POST", "/sessions", json={"task_id": "hostile", "files": {**TASK.files, "sub/.hg/store": "x"}}
    )
    try:
        assert sorted(resp["dropped"]) == [".git/HEAD", ".git/config", "sub/.hg/store"]
        result = await sandbox.client.exec(resp["session_id"], "find . | sort")
        assert result.stdout.split() == [".", "./main.py", "./pkg", "./pkg/util.py"]
    finally:
        await sandbox.client.close_session(resp["session_id"])


async def test_errors_are_clear(sandbox):
    with pytest.raises(SandboxError) as err:
        await sandbox.client.exec("nope", "true")
    assert err.value.status == 404 and "nope" in err.value.message
    with pytest.raises(SandboxError) as err:
        await sandbox.client.request("POST", "/sessions", data=b"{not json")
    assert err.value.status == 400 and "JSON" in err.value.message
    with pytest.raises(SandboxError) as err:
        await sandbox.client.request("POST", "/sessions", json={"files": {}})
    assert err.value.status == 400 and "task_id" in err.value.message
    with pytest.raises(SandboxError) as err:
        await sandbox.client.create_session("no-such-task")
    assert err.value.status == 404 and "no-such-task" in err.value.message
    sid = await open_session(sandbox)
    try:
        with pytest.raises(SandboxError) as err:
            await sandbox.client.exec(sid, "true", timeout_s=10_000)
        assert err.value.status == 400 and "timeout_s" in err.value.message
        # One command at a time per session: a second one is refused, not queued.
        slow = asyncio.create_task(sandbox.client.exec(sid, "sleep 1"))

        async def running() -> bool:
            return (await sandbox.client.health())["commands_running"] >= 1

        await wait_until_async(running, 30, "the slow command to start", task=slow, poll_s=0.02)
        with pytest.raises(SandboxError) as err:
            await sandbox.client.exec(sid, "true")
        assert err.value.status == 409
        assert (await slow).exit_code == 0
    finally:
        await sandbox.client.close_session(sid)
    with pytest.raises(SandboxError) as err:
        await sandbox.client.exec(sid, "true")
    assert err.value.status == 404


async def test_session_pool_is_bounded_with_429(tmp_path):
    root = tmp_path / "tasks"
    write_task_dir(root, TASK)
    cfg = SandboxConfig(max_sessions=2, max_concurrent_commands=1, command_queue_timeout_s=0.3,
                        workspace_root=str(tmp_path / "ws"), tasks_dir=str(root))
    # busy_retries=0: see each 429 as it is answered, not after the client's backoff.
    async with live_sandbox(cfg) as live, SandboxClient(live.url, busy_retries=0) as client:
        a, b = await client.create_session("hostile"), await client.create_session("hostile")
        # A full pool refuses at once (no queueing for sessions): 429, not a wait.
        with pytest.raises(SandboxError) as err:
            await client.create_session("hostile")
        assert err.value.status == 429 and "2 sessions" in err.value.message
        # Command slots: one at a time; a second waits at most command_queue_timeout_s, then 429.
        # The busy command outlasts that wait by far, and holds its slot before b asks
        # (polled, not slept: a loaded machine may start it late).
        busy = asyncio.create_task(client.exec(a, "sleep 4"))
        async def running() -> bool:
            return (await client.health())["commands_running"] >= 1

        await wait_until_async(running, 30, "the busy command to hold its slot", task=busy, poll_s=0.02)
        with pytest.raises(SandboxError) as err:
            await client.exec(b, "true")
        assert err.value.status == 429 and "command slots" in err.value.message
        assert (await busy).exit_code == 0
        assert (await client.exec(b, "echo ok")).stdout == "ok\n"
        assert await client.health() == {
            "sessions": 2, "capacity": 2, "commands_running": 0, "command_slots": 1,
            "cgroups": live.service.cgroups is not None, "privileged": os.geteuid() == 0,
            "disk_quota": os.geteuid() == 0, "seccomp": True, "warm_sessions": 0,
        }
        await client.close_session(a)
        c = await client.create_session("hostile")
        # A freed slot's uid is reused; the new workspace is fresh.
        assert (await client.exec(c, "ls")).stdout.split() == ["main.py", "pkg"]
        await client.close_session(b)
        await client.close_session(c)
        assert (await client.health())["sessions"] == 0
        assert list((tmp_path / "ws").iterdir()) == []


async def test_read_only_binds_under_tmp_survive_the_private_tmp(tasks_dir):
    # A checkout under /tmp (CI's, say) has its .venv there: the sandbox's private /tmp
    # must not hide it. Here an extra read-only bind under /tmp stands in for it.
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="rollway-bind-", dir="/tmp"))
    (shared / "tool.txt").write_text("from the host\n")
    shared.chmod(0o755)
    (shared / "tool.txt").chmod(0o644)
    cfg = SandboxConfig(tasks_dir=str(tasks_dir), extra_ro_binds=[str(shared)])
    try:
        async with live_sandbox(cfg, store=TaskStore(tasks_dir)) as live, SandboxClient(live.url) as client:
            sid = await client.create_session("hostile", TASK.files)
            result = await client.exec(sid, f"cat {shared}/tool.txt; echo x > /tmp/scratch && cat /tmp/scratch; "
                                            f"touch {shared}/nope")
            await client.close_session(sid)
    finally:
        import shutil

        shutil.rmtree(shared, ignore_errors=True)
    assert result.stdout == "from the host\nx\n", result
    assert "Read-only file system" in result.stderr and result.exit_code != 0
