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
async def test_sandbox_starts_and_commands_cancelled_anywhere_end_and_leave_nothing(tmp_path, times):
    """Jail.prestart and Jail.run cancelled at every phase, once or several times (a close
    cancels a prestart, then a shutdown or a client disconnect cancels whoever waits on
    it): each ends, cancelled, and nothing of it is left. Before the fixes a second cancel
    during the spawn hung in asyncio's undo for good (about 1 in 20 at the spawn), a
    cancel during a thread step (private /tmp, cgroup, clean-up) left its tmpfs mount or
    cgroup behind, and a cancel as the command's slot came free was dropped (3.11's
    wait_for), so the command ran to its end."""
    cfg = SandboxConfig(workspace_root=str(tmp_path))
    jail = Jail(cfg, make_cgroup_manager("auto", max_processes=cfg.max_processes, memory_bytes=cfg.memory_bytes))
    uid = 61017 if jail.privileged else os.geteuid()
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
