"""A command whose first process cannot join its cgroup never runs (the exec prefix exits
125 before the command starts, tests/test_sandbox_spawn.py). That is the host's failure:
the jail raises CgroupJoinFailed naming the cgroup (the service answers 503), never a
CommandResult with exit 125 that a grading would score 0. A command that exits 125 by
itself, having run in its cgroup, is an ordinary result."""

from __future__ import annotations

import pytest

from sandbox.cgroups import CgroupJoinFailed, CgroupManager
from sandbox.config import SandboxConfig
from sandbox.runner import Jail
from sandbox.workspace import Workspace

LIMITS = dict(max_processes=64, memory_bytes=256 << 20)


class VanishingGroups(CgroupManager):
    """Each command's cgroup is gone before the command joins it (as a cleanup racing
    the spawn, or a kernel refusing the join, would leave it)."""

    def create(self, label, **kwargs):
        group = super().create(label, **kwargs)
        for d in dict.fromkeys(group.dirs.values()):
            d.rmdir()
        return group


async def test_a_failed_cgroup_join_is_an_infrastructure_error_naming_the_cgroup(tmp_path, own_uid):
    cfg = SandboxConfig(workspace_root=str(tmp_path))
    uid = own_uid
    ws, _ = Workspace.create(tmp_path / "ws", uid, {})
    for manager, command in ((VanishingGroups(**LIMITS), "touch ran"), (CgroupManager(**LIMITS), "exit 125")):
        jail = Jail(cfg, cgroups=manager)
        try:
            if isinstance(manager, VanishingGroups):
                with pytest.raises(CgroupJoinFailed) as info:
                    await jail.run(command, workspace=ws.root, uid=uid, timeout_s=30, label="probe")
                message = str(info.value)
                assert message.startswith("command 'probe' did not start: joining its cgroup ")
                # The group that shows no run (v1: the memory group; pids keeps no history),
                # and the shell's own error naming the file it could not write.
                assert any(f"{parent}/probe-1 failed" in message for parent in manager.parents.values()), message
                assert "/probe-1/cgroup.procs" in message
                assert not (ws.root / "ran").exists()
            else:
                # Joined, ran, and exited 125 itself: the command's result.
                result = await jail.run(command, workspace=ws.root, uid=uid, timeout_s=30, label="probe")
                assert result.exit_code == 125
        finally:
            manager.close()
