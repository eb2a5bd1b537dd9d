"""Sandbox starts, commands and sessions ended at every point of their way, live: real
bubblewrap sandboxes, real cgroups and /tmp mounts where this host allows them.

A command's sandbox is made in steps (private /tmp in a thread, cgroup in a thread,
bwrap spawned), and a session's next sandbox is made in the background, so closes,
gradings, shutdowns and client disconnects cancel those steps wherever they happen to
be, sometimes more than once. Each case sweeps the point of the cancel (loop turns,
then short sleeps: every phase is hit on any machine) and then checks what the service
must never keep: a process of the uid, a cgroup, a /tmp mount, an fd, a busy slot.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from sandbox.cgroups import make_cgroup_manager
from sandbox.config import SandboxConfig
from sandbox.runner import Jail, uid_pids
from sandbox.workspace import Workspace

# A hang is the failure these tests look for; the bound only turns one into a report.
HANG_S = 30.0


def _leftovers(jail: Jail, root: Path, uid: int) -> dict[str, list]:
    groups = []
    if jail.cgroups is not None:
        for parent in dict.fromkeys(jail.cgroups.parents.values()):
            groups += sorted(p.name for p in parent.iterdir() if p.is_dir())
    return {
        "pids": uid_pids(uid) if jail.privileged else [],
        "cgroups": groups,
        "tmp": sorted(p.name for p in root.iterdir() if p.name.startswith("rollway-tmp-")),
    }


async def _cancel_at(jail: Jail, start, label: str, point: int, times: int) -> asyncio.Future:
    """Start ``start()`` as a task, cancel it ``times`` times at sweep ``point`` and wait
    for it to end. Points: loop turns after the start (the pause, the thread steps
    beginning); loop turns after its cgroup appeared (the spawn: the subprocess is being
    made and its pipes connected); short sleeps (everything else, on any machine)."""
    task = asyncio.ensure_future(start())
    if point < 20:
        for _ in range(point):
            await asyncio.sleep(0)
    elif point < 40 and jail.cgroups is not None:
        parent = jail.cgroups.parents["pids"]
        while not task.done() and not any(p.name.startswith(label + "-") for p in parent.iterdir()):
            await asyncio.sleep(0)
        for _ in range(point - 20):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep((point - 40) * 0.002)
    for _ in range(times):
        task.cancel()
        await asyncio.sleep(0)
    done, _ = await asyncio.wait({task}, timeout=HANG_S)
    assert done, f"{label}: cancelled {times}x at point {point}, the task never ended"
    return task


@pytest.mark.parametrize("times", [1, 2, 3])
async def test_sandbox_starts_and_commands_cancelled_anywhere_end_and_leave_nothing(tmp_path, times, own_uid):
    """Jail.prestart and Jail.run cancelled at every phase, once or several times (a close
    cancels a prestart, then a shutdown or a client disconnect cancels whoever waits on
    it): each ends, cancelled, and nothing of it is left. Before the fixes a second cancel
    during the spawn hung in asyncio's undo for good (about 1 in 20 at the spawn), a
    cancel during a thread step (private /tmp, cgroup, clean-up) left its tmpfs mount or
    cgroup behind, and a cancel as the command's slot came free was dropped (3.11's
    wait_for), so the command ran to its end."""
    cfg = SandboxConfig(workspace_root=str(tmp_path))
    jail = Jail(cfg, make_cgroup_manager("auto", max_processes=cfg.max_processes, memory_bytes=cfg.memory_bytes))
    uid = own_uid
    ws, _ = Workspace.create(tmp_path / "ws", uid, {"a.txt": "a\n"})
    fds = sorted(os.listdir("/proc/self/fd"))
    try:
        for point in range(0, 50, 2):
            pre = await _cancel_at(jail, lambda: jail.prestart(workspace=ws.root, uid=uid, label=f"p{point}"),
                                   f"p{point}", point, times)
            if not pre.cancelled() and pre.exception() is None:
                await jail.discard(pre.result())
            run = await _cancel_at(jail, lambda: jail.run("cat a.txt; sleep 5", workspace=ws.root, uid=uid,
                                                          timeout_s=30, label=f"r{point}"), f"r{point}", point + 1, times)
            # A cancelled command ends cancelled, at once: it never runs on to its end.
            assert run.cancelled(), (point, run.result())
        assert _leftovers(jail, tmp_path, uid) == {"pids": [], "cgroups": [], "tmp": []}
        assert sorted(os.listdir("/proc/self/fd")) == fds
        # Every slot is free again: as many commands as slots run at once.
        results = await asyncio.gather(*(jail.run("cat a.txt", workspace=ws.root, uid=uid, timeout_s=30)
                                         for _ in range(cfg.max_concurrent_commands)))
        assert [(r.exit_code, r.stdout) for r in results] == [(0, "a\n")] * cfg.max_concurrent_commands
        assert jail.running == 0
    finally:
        ws.remove()
        if jail.cgroups is not None:
            jail.cgroups.close()


START = "X = 'start'\n"
TASK_FILES = {"f.py": START}
HIDDEN = {"test_hidden.py": "from f import X\n\n\ndef test_h():\n    assert X != 'start'\n"}


def _task_store(root: Path):
    from tasks.spec import TaskSpec
    from tasks.store import TaskStore
    from tests.sandbox_helpers import write_task_dir

    write_task_dir(root, TaskSpec(task_id="race", instruction="edit f.py", files=TASK_FILES,
                                  hidden_tests=HIDDEN,
                                  test_command="python -m pytest -q"))
    return TaskStore(root)


async def _gone(client, sid: str) -> None:
    """The session is closed or closing (its lock held by the idle reaper): raise the 404."""
    from sandbox.client import SandboxError

    while True:
        try:
            await client.exec(sid, "true")
        except SandboxError as exc:
            if exc.status == 404:
                raise
            assert exc.status == 409, exc
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"session {sid} answered both calls 409/404 but is still open")


async def _life(client, live, rng, i: int, seen: dict) -> None:
    """One session's life: execs (the next one finds its sandbox prestarted, starting or
    still in its pause), writes read back by the next exec, two execs at once, two
    submits at once, a close, an exec after it: pauses cross the 0.1 s prestart pause,
    and the idle reaper may close the session at any point. Every answer is one of the
    exact outcomes allowed; anything else fails."""
    from sandbox.client import SandboxError

    from sandbox.sessions import SessionClosed

    sid = await client.create_session("race")
    # Its uid, read once: the reaper (0.05 s idle) may close the session as soon as the
    # create has answered, and a lookup after an exec raced it (a test error on a loaded
    # machine, not the service's).
    try:
        uid = live.service.pool.get(sid).uid
    except SessionClosed:
        uid = None  # reaped already: its next call is a 404, below
    else:
        seen["uids"].add(uid)
    content = START
    try:
        for step in range(rng.randint(2, 6)):
            await asyncio.sleep(rng.choice([0, 0, 0.005, 0.02, 0.05, 0.09, 0.1, 0.11, 0.15]))
            op = rng.choice(["exec", "exec", "write", "two_execs", "submit", "close"])
            if op == "write":
                content = f"X = '{i}-{step}'\n"
                await client.write_file(sid, "f.py", content)
            elif op == "exec":
                result = await client.exec(sid, "cat f.py; id -u")
                assert uid is not None and (result.exit_code, result.stdout) == (0, f"{content}{uid}\n")
            elif op == "two_execs":
                both = await asyncio.gather(client.exec(sid, "cat f.py"), client.exec(sid, "cat f.py"),
                                            return_exceptions=True)
                errors = [r for r in both if isinstance(r, SandboxError)]
                assert all(r.status in (404, 409) for r in errors), both
                assert all((r.exit_code, r.stdout) == (0, content) for r in both if r not in errors), both
                if len(errors) == 2:
                    await _gone(client, sid)  # the reaper held (409) or closed (404) it
            elif op == "submit":
                both = await asyncio.gather(*(client.submit(sid, trajectory_id=f"tr{i}") for _ in range(2)),
                                            return_exceptions=True)
                errors = [r for r in both if isinstance(r, SandboxError)]
                assert all(r.status in (404, 409) for r in errors), both
                if len(errors) == 2:
                    await _gone(client, sid)
                (reward,) = [r for r in both if r not in errors]
                assert reward.score == (1.0 if content != START else 0.0), (content, reward.reason)
                break
            else:
                await client.close_session(sid)
                break
        else:
            return  # left open: the reaper or the shutdown closes it
        with pytest.raises(SandboxError) as after:
            await client.exec(sid, "true")
        assert after.value.status == 404
        seen["ended"] += 1
    except SandboxError as exc:
        assert exc.status == 404, exc  # the idle reaper closed it meanwhile
        seen["reaped"] += 1


@pytest.mark.parametrize("seed", [1, 2])
async def test_sessions_raced_by_exec_write_submit_close_reaper_and_shutdown_leave_nothing(tmp_path, seed):
    """The service with prestarted sandboxes under every ordering of a session's calls
    and of the idle reaper (it closes whatever idles 0.05 s: sessions in the prestart
    pause or mid-prestart), then shut down while sessions are mid-call and prestarts mid-
    start: each call gets an exact answer, nothing hangs, and afterwards no process of a
    session uid, no cgroup, no /tmp or workspace mount and no fd of the service is left."""
    import random

    from sandbox.client import SandboxClient
    from tests.sandbox_helpers import live_sandbox, pending_work_report

    rng = random.Random(seed)
    (tmp_path / "tasks").mkdir()
    store = _task_store(tmp_path / "tasks")
    ws_root = tmp_path / "ws"
    cfg = SandboxConfig(max_sessions=10, max_concurrent_commands=2, workspace_root=str(ws_root),
                        tasks_dir=str(tmp_path / "tasks"), session_idle_timeout_s=0.05)
    fds = sorted(os.listdir("/proc/self/fd"))
    seen = {"uids": set(), "ended": 0, "reaped": 0}
    async with live_sandbox(cfg, store=store) as live:
        service = live.service
        async with SandboxClient(live.url, busy_retries=0, publish_rewards=False) as client:
            lives = [_life(client, live, random.Random(rng.random()), i, seen) for i in range(10)]
            await asyncio.wait_for(asyncio.gather(*lives), 120)
            assert seen["ended"] + seen["reaped"] > 0
            # Shutdown amid calls: sessions mid-command, in the prestart pause, mid-prestart.
            sids = [await client.create_session("race") for _ in range(6)]
            calls = [asyncio.ensure_future(client.exec(s, "cat f.py")) for s in sids]
            await asyncio.sleep(rng.choice([0.0, 0.05, 0.1, 0.12]))
        groups = dict.fromkeys(service.cgroups.parents.values()) if service.cgroups is not None else {}
    _, pending = await asyncio.wait(calls, timeout=HANG_S)
    assert not pending, f"calls still waiting after the shutdown:\n{pending_work_report()}"
    # every uid the service may have run a session as (a reaped session's too)
    uids = range(service.cfg.uid_base, service.cfg.uid_base + cfg.max_sessions)
    assert seen["uids"] <= set(uids)
    assert {uid: uid_pids(uid) for uid in uids} == {uid: [] for uid in uids}
    assert [p for p in groups if p.exists()] == []
    assert sorted(p.name for p in ws_root.iterdir()) == []
    assert [m for m in Path("/proc/self/mounts").read_text().splitlines() if str(tmp_path) in m] == []
    assert sorted(os.listdir("/proc/self/fd")) == fds


async def test_warm_trees_dropped_by_as_many_opens_as_threads_do_not_deadlock_the_service(tmp_path):
    """The pool drops a warm image tree (pool full) inside session open, which runs in a
    worker thread and waits there until the service's loop has ended the tree's
    prestarted sandbox; ending it takes a worker thread too (its clean-up). With as many
    opens at once as the default executor has threads, every thread waited for a drop
    that waited for a thread: the whole service hung. Each open must get its session."""
    import json
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from sandbox.client import SandboxClient
    from sandbox.config import ImageConfig
    from tasks.spec import TaskSpec
    from tasks.store import TaskStore
    from tests.image_helpers import REPO, example_images
    from tests.sandbox_helpers import live_sandbox, write_task_dir
    from tests.waiting import wait_until_async

    examples = REPO / "tasks/images/examples.jsonl"
    threads = ThreadPoolExecutor()._max_workers  # what asyncio's default executor gets here
    images = example_images()
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(examples, tasks / "examples.jsonl")
    write_task_dir(tasks, TaskSpec(task_id="blank", instruction="-", files={"a.txt": "a\n"},
                                   hidden_tests={"test_x.py": ""}))
    image_task = json.loads(examples.read_text().splitlines()[0])["instance_id"]
    cfg = SandboxConfig(max_sessions=threads + 1, workspace_root=str(tmp_path / "ws"), tasks_dir=str(tasks),
                        images=ImageConfig(cache_dir=images.cache_dir, warm_sessions_per_image=threads))
    async with live_sandbox(cfg, store=TaskStore(tasks)) as live, SandboxClient(live.url) as client:
        pool = live.service.pool
        first = await client.create_session(image_task)
        await wait_until_async(lambda: pool.warm == threads, 60, f"{threads} warm trees")
        sids = await asyncio.wait_for(asyncio.gather(*(client.create_session("blank") for _ in range(threads))),
                                      HANG_S)
        results = await asyncio.gather(*(client.exec(s, "cat a.txt") for s in sids))
        assert [(r.exit_code, r.stdout) for r in results] == [(0, "a\n")] * threads and pool.warm == 0
        uids = {pool.get(s).uid for s in [first, *sids]}
        for sid in [first, *sids]:
            await client.close_session(sid)
    assert {uid: uid_pids(uid) for uid in uids} == {uid: [] for uid in uids}
    assert list((tmp_path / "ws").iterdir()) == []


async def test_a_close_cancelled_while_it_ends_a_starting_sandbox_ends_cancelled(tmp_path):
    """A close (the idle reaper's, a shutdown's) waits for the session's next sandbox to
    finish starting and then ends it. Cancelled there, it must end cancelled: it returned
    as if nothing happened, so the reaper that shutdown cancels went on closing and
    sleeping, and shutdown (which awaits the reaper) waited for it for good. A later close
    (the shutdown's, the reaper's next round) closes the session, leaving nothing."""
    from sandbox.client import SandboxClient
    from tests.sandbox_helpers import live_sandbox

    (tmp_path / "tasks").mkdir()
    cfg = SandboxConfig(max_sessions=2, workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"))
    outcomes = []
    async with live_sandbox(cfg, store=_task_store(tmp_path / "tasks")) as live, SandboxClient(live.url) as client:
        service = live.service
        parent = service.cgroups.parents["pids"] if service.cgroups is not None else None
        for turns in range(6):
            sid = await client.create_session("race")
            session = service.pool.get(sid)
            await client.exec(sid, "true")
            # Mid-start: its cgroup is there (or, without cgroups, a few turns after the pause).
            while parent is not None and not any(p.name.startswith(f"s{session.slot}-") for p in parent.iterdir()):
                await asyncio.sleep(0.001)
            for _ in range(turns):
                await asyncio.sleep(0)
            closing = asyncio.ensure_future(service._close(session))
            await asyncio.sleep(0)
            closing.cancel()
            done, _ = await asyncio.wait({closing}, timeout=HANG_S)
            assert done
            outcomes.append(closing.cancelled())
            await service._close(session)  # what the shutdown (or the reaper's next round) does
            uid = session.uid
    assert outcomes == [True] * 6
    assert uid_pids(uid) == [] and list((tmp_path / "ws").iterdir()) == []


async def test_a_shutdown_while_warm_trees_and_their_sandboxes_start_leaves_nothing(tmp_path):
    """An image session opened, its warm trees being made and their first sandboxes
    started in the background, and the service shut down at once or a little later (mid
    tree, mid start, done): shutdown ends, and no tree, mount, cgroup or uid process is left.
    The image session also sees a file written after its next sandbox was started."""
    import json
    import shutil

    from sandbox.client import SandboxClient
    from sandbox.config import ImageConfig
    from tasks.store import TaskStore
    from tests.image_helpers import REPO, example_images
    from tests.sandbox_helpers import live_sandbox

    images = example_images()
    examples = REPO / "tasks/images/examples.jsonl"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(examples, tasks / "examples.jsonl")
    image_task = json.loads(examples.read_text().splitlines()[0])["instance_id"]
    from sandbox.service import _REFILL_PAUSE_S

    # Warm trees are made _REFILL_PAUSE_S after the open: shut down in the pause, and then
    # mid tree, mid start, done.
    for n, delay in enumerate([0.0, 0.01] + [_REFILL_PAUSE_S + d for d in (0.0, 0.01, 0.03, 0.06, 0.1)]):
        ws = tmp_path / f"ws{n}"
        cfg = SandboxConfig(max_sessions=4, workspace_root=str(ws), tasks_dir=str(tasks),
                            images=ImageConfig(cache_dir=images.cache_dir, warm_sessions_per_image=3))
        async with live_sandbox(cfg, store=TaskStore(tasks)) as live, SandboxClient(live.url) as client:
            service = live.service
            sid = await client.create_session(image_task)
            session = service.pool.get(sid)
            uids = {service.cfg.uid_base + i for i in range(cfg.max_sessions)}
            groups = list(dict.fromkeys(service.cgroups.parents.values())) if service.cgroups is not None else []
            if n == 0:
                await session.next_sandbox  # started before the file below was written
                await client.write_file(sid, "later.txt", "later\n")
                seen = await client.exec(sid, "cat later.txt")
                assert (seen.exit_code, seen.stdout) == (0, "later\n")
            await asyncio.sleep(delay)
        assert {uid: uid_pids(uid) for uid in uids} == {uid: [] for uid in uids}, delay
        assert [g for g in groups if g.exists()] == [] and list(ws.iterdir()) == [], delay
        assert [m for m in Path("/proc/self/mounts").read_text().splitlines() if str(ws) in m] == [], delay


async def test_an_exec_refused_for_want_of_a_slot_ends_its_started_sandbox_and_the_session_goes_on(tmp_path):
    """All command slots busy past command_queue_timeout_s: the exec is refused (429) and
    the sandbox started for it is ended unused, before its uid runs anything else; the
    session's next exec runs, sees the workspace as it is then, and nothing is left."""
    from sandbox.client import SandboxBusy, SandboxClient
    from tests.sandbox_helpers import live_sandbox

    (tmp_path / "tasks").mkdir()
    cfg = SandboxConfig(max_sessions=2, max_concurrent_commands=1, command_queue_timeout_s=0.2,
                        workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"))
    async with live_sandbox(cfg, store=_task_store(tmp_path / "tasks")) as live, \
            SandboxClient(live.url, busy_retries=0) as client:
        service = live.service
        busy, refused = await client.create_session("race"), await client.create_session("race")
        pre = await service.pool.get(refused).next_sandbox  # started
        hog = asyncio.ensure_future(client.exec(busy, "touch started; sleep 1"))
        await asyncio.wait_for(_until(lambda: (tmp_path / "ws").glob("*/started")), HANG_S)
        with pytest.raises(SandboxBusy):
            await client.exec(refused, "echo ran > ran.txt")
        uid = service.pool.get(refused).uid
        # Ended, with its cgroup, and it ran nothing.
        assert pre.proc.returncode is not None and not pre.alive
        assert pre.group is None or not any(d.exists() for d in pre.group.dirs.values())
        assert not any((tmp_path / "ws").glob("*/ran.txt"))
        assert (await hog).exit_code == 0
        await client.write_file(refused, "f.py", "X = 2\n")
        after = await client.exec(refused, "cat f.py; ls")
        assert (after.exit_code, after.stdout) == (0, "X = 2\nf.py\n")
        for sid in (busy, refused):
            await client.close_session(sid)
    assert uid_pids(uid) == [] and list((tmp_path / "ws").iterdir()) == []


async def _until(found) -> None:
    while not any(found()):
        await asyncio.sleep(0.01)


async def test_an_exec_during_the_prestart_pause_starts_its_own_sandbox_without_waiting_the_pause(tmp_path, monkeypatch):
    """The next sandbox is started a pause after each command (so a close right after does
    not pay for one). An exec within that pause waited the pause out and then the start:
    back-to-back execs took 149 ms at p50 against 47 ms without prestarting. It must run
    at once in a sandbox of its own (the pause is made long here so the exec is surely
    inside it), and a later exec still finds one started ahead."""
    import sandbox.service
    from sandbox.client import SandboxClient
    from tests.sandbox_helpers import live_sandbox

    # Far longer than any exec's round trip, short enough that a regression fails in it.
    monkeypatch.setattr(sandbox.service, "_PRESTART_PAUSE_S", 20.0)
    (tmp_path / "tasks").mkdir()
    cfg = SandboxConfig(max_sessions=2, workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"))
    async with live_sandbox(cfg, store=_task_store(tmp_path / "tasks")) as live, SandboxClient(live.url) as client:
        sid = await client.create_session("race")
        session = live.service.pool.get(sid)
        first = await client.exec(sid, "cat f.py")
        pausing = session.next_sandbox
        second = await client.exec(sid, "cat f.py")
        assert [(r.exit_code, r.stdout) for r in (first, second)] == [(0, START)] * 2
        assert pausing.cancelled() and session.next_sandbox is not pausing
        await client.close_session(sid)
    assert list((tmp_path / "ws").iterdir()) == []


def test_the_idle_list_is_safe_while_sessions_open_in_worker_threads(tmp_path):
    """The service opens sessions in worker threads while its idle reaper lists idle
    sessions on the loop. Listing iterated the live dict, so an open landing mid-list
    raised 'dictionary changed size during iteration', which ended the reaper task for
    good (no session was ever reaped again). A tiny thread switch interval makes the
    interleaving happen within a few hundred opens."""
    import sys
    import threading

    from sandbox.sessions import SessionPool

    pool = SessionPool(tmp_path, capacity=300, uid_base=62000)
    errors: list[Exception] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        opener = threading.Thread(target=lambda: [pool.open("t", {}) for _ in range(300)])
        opener.start()
        while opener.is_alive():
            try:
                pool.idle(-1.0)
            except RuntimeError as exc:
                errors.append(exc)
        opener.join()
    finally:
        sys.setswitchinterval(interval)
        for session in pool.all():
            session.workspace.remove()
    assert errors == [] and len(pool.idle(-1.0)) == 300


async def test_a_long_command_cancelled_mid_hand_over_never_writes_into_a_reused_fd(tmp_path):
    """A command over the pipe's size is finished by a thread. Cancelling the hand-over
    (the exec's caller went away) must not close the fd under that thread: the number
    would be reused by the next open and the rest of the command written into it."""
    import select

    from sandbox.runner import _send_command
    from tests.waiting import wait_until_async

    command = b"x" * (1 << 20)  # far over a pipe's 64 KiB
    read_end, write_end = os.pipe()
    sending = asyncio.ensure_future(_send_command(write_end, command))
    # The first write filled the pipe, in the same step that handed the rest to the
    # thread: once bytes are there the thread owns the fd (nobody reads yet: it blocks).
    await wait_until_async(lambda: select.select([read_end], [], [], 0)[0], HANG_S, "the pipe filled")
    assert not sending.done()
    sending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sending
    victim = tmp_path / "victim"
    fd = os.open(victim, os.O_WRONLY | os.O_CREAT)  # takes a freed fd number, if any
    try:
        received = bytearray()
        while chunk := await asyncio.to_thread(os.read, read_end, 1 << 16):  # EOF once the thread closed it
            received += chunk
    finally:
        os.close(fd)
        os.close(read_end)
    assert fd != write_end
    assert victim.read_bytes() == b""
    assert bytes(received) == command + b"."


async def test_the_idle_reaper_survives_a_close_that_fails(tmp_path, monkeypatch):
    """A close that raises (here: the first session's workspace refuses to go) is logged
    and the reaper goes on: the other idle session, and one opened later, are closed."""
    from sandbox.client import SandboxClient
    from tests.sandbox_helpers import live_sandbox
    from tests.waiting import wait_until_async

    (tmp_path / "tasks").mkdir()
    store = _task_store(tmp_path / "tasks")
    cfg = SandboxConfig(max_sessions=4, workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"),
                        session_idle_timeout_s=0.05)
    async with live_sandbox(cfg, store=store) as live, SandboxClient(live.url) as client:
        pool = live.service.pool
        first = await client.create_session("race")
        doomed = pool.get(first)
        remove = doomed.workspace.remove

        def refuse() -> None:
            raise OSError(16, "Device or resource busy (injected)")

        monkeypatch.setattr(doomed.workspace, "remove", refuse)
        second = await client.create_session("race")
        await wait_until_async(lambda: second not in pool._sessions, HANG_S, "the second session reaped")
        assert first not in pool._sessions  # its close failed after it was forgotten
        later = await client.create_session("race")
        await wait_until_async(lambda: later not in pool._sessions, HANG_S, "a later session reaped")
        assert not live.service._reaper.done()
        assert sorted(pool._free) == list(range(4))  # the failed close gave its slot back too
        remove()


@pytest.mark.parametrize("call", ["exec", "submit", "files"])
async def test_a_call_that_arrives_while_its_session_closes_is_404_not_409(tmp_path, call):
    """A call whose request began before its session was closed, and whose body arrives
    after the close took the session (the close waits for the running command): the
    session is gone, 404, not 'busy, try again' (409), which would send a client into
    retries of a session that will never come back. A file write too: it wrote into the
    closing session's tree (200; with the release off the loop, a tree being deleted)."""
    import json

    from sandbox.client import SandboxClient
    from tests.sandbox_helpers import live_sandbox
    from tests.waiting import wait_until_async

    (tmp_path / "tasks").mkdir()
    store = _task_store(tmp_path / "tasks")
    cfg = SandboxConfig(max_sessions=2, workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"))
    async with live_sandbox(cfg, store=store) as live, SandboxClient(live.url) as client:
        sid = await client.create_session("race")
        session = live.service.pool.get(sid)
        running = asyncio.ensure_future(client.exec(sid, "sleep 1"))
        await wait_until_async(session.lock.locked, HANG_S, "the command running")
        payload = json.dumps({"exec": {"command": "true"}, "submit": {"trajectory_id": "t"},
                              "files": {"path": "late.py", "content": "late\n"}}[call]).encode()
        method = "PUT" if call == "files" else "POST"
        # Raw HTTP: the headers now (the handler starts and takes its session), the body later.
        host, port = live.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        touched = session.last_used
        writer.write(f"{method} /sessions/{sid}/{call} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        # The handler took its session (touched it) and now waits for the body.
        await wait_until_async(lambda: session.last_used != touched, HANG_S, "the handler's start")
        closing = asyncio.ensure_future(client.close_session(sid))
        await wait_until_async(lambda: session.closed, HANG_S, "the close begun")
        writer.write(payload)
        await writer.drain()
        status_line = (await asyncio.wait_for(reader.readline(), HANG_S)).decode()
        writer.close()
        assert status_line.split()[1] == "404", status_line
        await running
        await closing
        assert not session.workspace.root.exists()


async def test_a_file_call_under_way_when_its_session_closes_ends_before_the_tree_goes(tmp_path, monkeypatch):
    """File calls take no session lock (they may run beside the session's command), so a
    close (or a graded submit) could delete the tree under one already in its thread: with
    the release off the loop, at the same time. The release waits for the file calls under
    way; none starts once the session is closed. Here a read is held in its thread while
    the session closes: the tree's removal begins only after it, and it is answered."""
    import threading

    from sandbox.client import SandboxClient
    from tests.sandbox_helpers import live_sandbox
    from tests.waiting import wait_until_async

    (tmp_path / "tasks").mkdir()
    cfg = SandboxConfig(max_sessions=2, workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"))
    async with live_sandbox(cfg, store=_task_store(tmp_path / "tasks")) as live, SandboxClient(live.url) as client:
        sid = await client.create_session("race")
        session = live.service.pool.get(sid)
        workspace = session.workspace
        read, remove = workspace.read, workspace.remove
        entered, go = threading.Event(), threading.Event()
        reading_at_removal: list[bool] = []

        def held_read(*args):
            entered.set()
            go.wait(HANG_S)
            try:
                return read(*args)
            finally:
                entered.clear()

        def noted_remove():
            reading_at_removal.append(entered.is_set())
            remove()

        monkeypatch.setattr(workspace, "read", held_read)
        monkeypatch.setattr(workspace, "remove", noted_remove)
        reading = asyncio.ensure_future(client.read_file(sid, "f.py"))
        await wait_until_async(entered.is_set, HANG_S, "the read in its thread")
        closing = asyncio.ensure_future(client.close_session(sid))
        await wait_until_async(lambda: session.closed, HANG_S, "the close begun")
        # Time for the close to reach the removal were it to go on under the read (not an
        # assertion: with the read waited for, no wait is long enough to reach it).
        await asyncio.wait({closing}, timeout=0.3)
        go.set()
        assert await reading == START
        await closing
        assert reading_at_removal == [False]
        assert not workspace.root.exists()


async def test_a_sessions_release_never_holds_up_another_sessions_calls(tmp_path, monkeypatch):
    """Ending a session (a close, or the release after its graded submit) unmounts and
    deletes its tree: blocking filesystem work that ran on the service's loop, stalling
    every other session's calls while it lasted (a repository-sized tree, a group's trees
    at once). Here each tree's removal waits, in whatever thread runs it, until another
    session's command has been answered: off the loop it is; on the loop it never could
    be (the wait gives up after HANG_S and the call fails). Then the tree is gone and
    the ended session answers 404."""
    import concurrent.futures

    from sandbox.client import SandboxClient, SandboxError
    from tests.sandbox_helpers import live_sandbox

    (tmp_path / "tasks").mkdir()
    cfg = SandboxConfig(max_sessions=3, workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"))
    loop = asyncio.get_running_loop()
    async with live_sandbox(cfg, store=_task_store(tmp_path / "tasks")) as live, \
            SandboxClient(live.url, publish_rewards=False) as client:
        other = await client.create_session("race")
        for ending in ("close", "submit"):
            sid = await client.create_session("race")
            workspace = live.service.pool.get(sid).workspace
            remove = workspace.remove
            served = []

            def remove_once_the_other_is_served(remove=remove, served=served) -> None:
                call = asyncio.run_coroutine_threadsafe(client.exec(other, "echo served"), loop)
                try:
                    result = call.result(HANG_S)
                except concurrent.futures.TimeoutError:
                    served.append("not served while the tree was being removed")
                    raise
                served.append((result.exit_code, result.stdout))
                remove()

            monkeypatch.setattr(workspace, "remove", remove_once_the_other_is_served)
            if ending == "close":
                await client.close_session(sid)
            else:
                await client.write_file(sid, "f.py", "X = 'solved'\n")
                reward = await client.submit(sid, trajectory_id="release-off-loop")
                assert reward.score == 1.0, reward.reason
            assert (ending, served) == (ending, [(0, "served\n")])
            assert not workspace.root.exists()
            with pytest.raises(SandboxError) as err:
                await client.exec(sid, "true")
            assert err.value.status == 404
        await client.close_session(other)
    assert list((tmp_path / "ws").iterdir()) == []


@pytest.mark.parametrize("grace", ["waited", "ran_out"])
@pytest.mark.parametrize("kind", ["host", "image"])
async def test_a_session_opening_as_the_service_shuts_down_is_refused_and_leaves_nothing(
        tmp_path, monkeypatch, kind, grace):
    """A create whose tree is being made (held in its thread here) when the service is
    told to stop (``rollway sandbox``'s SIGTERM: the runner's cleanup). ``waited``: the
    runner waits for the request (its grace, 60 s by default): the create is answered
    503 'shutting down', never handed a session of a service about to end, and its tree
    is released. ``ran_out``: the grace ends first and the runner cancels the request:
    its open went on in its thread and made the session after the shutdown had closed
    every listed one, so the tree (an overlay mount for an image task) was left behind,
    the uid range unclaimed under it. Either way, after the shutdown: no session folder,
    no mount under the workspace root, no image held, every slot free, the uid range's
    claim given back, no process of a session uid."""
    import fcntl
    import json
    import shutil
    import threading

    import aiohttp
    from aiohttp import web

    from sandbox import image_workspace, quota, uid_claim
    from sandbox.config import ImageConfig, RewardConfig
    from sandbox.service import SandboxService
    from tasks.store import TaskStore
    from tests.image_helpers import REPO, example_images

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    if kind == "image":
        examples = REPO / "tasks/images/examples.jsonl"
        shutil.copy(examples, tasks / "examples.jsonl")
        task = json.loads(examples.read_text().splitlines()[0])["instance_id"]
        images = ImageConfig(cache_dir=example_images().cache_dir, warm_sessions_per_image=2)
    else:
        _task_store(tasks)
        task, images = "race", ImageConfig()
    ws_root = tmp_path / "ws"
    cfg = SandboxConfig(max_sessions=4, workspace_root=str(ws_root), tasks_dir=str(tasks), images=images)
    service = SandboxService(cfg, RewardConfig(), TaskStore(tasks))

    # The session's tree is made, then held in its thread until the shutdown is under way.
    entered, go = threading.Event(), threading.Event()
    owner, name = (image_workspace, "create") if kind == "image" else (Workspace, "create")
    real = getattr(owner, name)

    def held(*args, **kwargs):
        made = real(*args, **kwargs)
        if not entered.is_set():  # the session's own tree (warm trees come after it)
            entered.set()
            go.wait(HANG_S)
        return made

    monkeypatch.setattr(owner, name, held)
    shutting = asyncio.Event()

    async def noted(app) -> None:
        shutting.set()

    service.app.on_shutdown.append(noted)
    runner = web.AppRunner(service.app, shutdown_timeout=60.0 if grace == "waited" else 0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    uids = {service.cfg.uid_base + i for i in range(cfg.max_sessions)}
    async with aiohttp.ClientSession() as http:

        async def create():
            async with http.post(f"http://{host}:{port}/sessions", json={"task_id": task}) as resp:
                return resp.status, await resp.json()

        creating = asyncio.ensure_future(create())
        assert await asyncio.to_thread(entered.wait, HANG_S), "the session's tree never began"
        stopping = asyncio.ensure_future(runner.cleanup())
        await asyncio.wait_for(shutting.wait(), HANG_S)
        if grace == "ran_out":
            # The runner cancels the request: the client's connection is dropped.
            await asyncio.wait({creating}, timeout=HANG_S)
            assert creating.done() and isinstance(creating.exception(), aiohttp.ClientError), creating
        go.set()
        await asyncio.wait_for(stopping, HANG_S)
        answer = await creating if grace == "waited" else None
    # Whatever is still running in the service's pool threads ends (the open, unwaited).
    await asyncio.to_thread(service._pool_threads.shutdown, True)
    with open(uid_claim.LOCK_DIR / f"uids-{service.uid_claim.base}.lock", "ab") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            claimed = False
        except BlockingIOError:
            claimed = True
    mounts = [m.split()[4] for m in Path("/proc/self/mountinfo").read_text().splitlines() if str(ws_root) in m]
    for point in sorted(mounts, reverse=True):  # a failure leaves nothing mounted on the host
        quota.unmount(Path(point))
    left = {
        "folders": sorted(p.name for p in ws_root.iterdir()),
        "mounts": mounts,
        "sessions": len(service.pool), "warm": service.pool.warm, "free": sorted(service.pool._free),
        "held": dict(service.images._held), "claimed": claimed, "pids": {u: uid_pids(u) for u in uids if uid_pids(u)},
    }
    assert left == {"folders": [], "mounts": [], "sessions": 0, "warm": 0, "free": list(range(cfg.max_sessions)),
                    "held": {}, "claimed": False, "pids": {}}
    if answer is not None:
        status, body = answer
        assert status == 503 and "shutting down" in body["error"], answer
