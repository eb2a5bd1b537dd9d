"""How a sandbox command is started (sandbox/runner.py spawn_argv): joined to its cgroups
and under its rlimits before anything of it runs, through exec prefixes (sh, prlimit)
so the service never forks itself whole per command."""

from __future__ import annotations

import subprocess

from sandbox.cgroups import CgroupManager
from sandbox.isolation import Limits
from sandbox.runner import spawn_argv

LIMITS = Limits(cpu_seconds=7, memory_bytes=3 * 2**30, max_processes=97, max_file_bytes=5 * 2**20,
                max_open_files=211, tmp_bytes=2**20)


def test_the_command_runs_in_its_cgroups_under_exactly_its_rlimits():
    manager = CgroupManager(max_processes=LIMITS.max_processes, memory_bytes=LIMITS.memory_bytes)
    group = manager.create("spawn-test")
    try:
        probe = ("import resource as r, sys; "
                 "print([r.getrlimit(getattr(r, 'RLIMIT_' + n)) for n in ('CPU', 'AS', 'NPROC', 'FSIZE', 'NOFILE', 'CORE')]); "
                 "print(open('/proc/self/cgroup').read())")
        out = subprocess.run(spawn_argv(["python3", "-c", probe], group.procs_files(), LIMITS),
                             capture_output=True, text=True, check=True).stdout
        limits, cgroups = out.split("\n", 1)
        assert limits == str([(7, 8), (3 * 2**30,) * 2, (97, 97), (5 * 2**20,) * 2, (211, 211), (0, 0)])
        for procs in group.procs_files():
            leaf = procs.rsplit("/", 2)[-2]
            assert f"/{leaf}\n" in cgroups, (leaf, cgroups)
    finally:
        group.remove()


def test_a_cgroup_that_cannot_be_joined_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    argv = spawn_argv(["sh", "-c", f"touch {marker}"], [str(tmp_path / "no" / "such" / "cgroup.procs")], LIMITS)
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 125 and not marker.exists()
    assert "cgroup.procs" in done.stderr
