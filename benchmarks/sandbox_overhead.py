"""Sandbox overhead: the same commands as a plain subprocess and through the jail
(bubblewrap, uid switch, rlimits, per-command cgroup), and a full grading.

    .venv/bin/python benchmarks/sandbox_overhead.py [--repeat 20]

Both paths run the command with ``bash -c`` from a workspace directory, one at a time,
in the same process; times are medians of ``--repeat`` runs, wall clock from spawn to
exit. Ratio = jail / plain. Grading = snapshot + static checks + hidden pytest run in a
fresh sandbox + JUnit parse (one small task, 3 tests).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from sandbox.cgroups import make_cgroup_manager
from sandbox.config import RewardConfig, SandboxConfig
from sandbox.grader import Grader
from sandbox.runner import Jail
from sandbox.uid_claim import claim_uid_range
from sandbox.workspace import Snapshot, Workspace, WorkspaceFile
from tasks.spec import TaskSpec
from tasks.store import TaskStore

COMMANDS = {
    "true": "true",
    "python -c pass": "python -c pass",
    "pytest (1 test)": "python -m pytest -q -p no:cacheprovider test_one.py",
}
TASK = TaskSpec(
    task_id="bench_add",
    instruction="add",
    files={"calc.py": "def add(a, b):\n    return a - b\n"},
    hidden_tests={"test_calc.py": "from calc import add\n\ndef test_a():\n    assert add(1, 2) == 3\n\n"
                                  "def test_b():\n    assert add(0, 0) == 0\n\ndef test_c():\n    assert add(-1, 1) == 0\n"},
)


async def plain(command: str, cwd: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        "/bin/bash", "-c", command, cwd=cwd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    await proc.communicate()
    assert proc.returncode == 0, command
    return time.perf_counter() - started


async def main(repeat: int) -> None:
    cfg = SandboxConfig()
    # A uid range of its own, claimed like a service's (sandbox/uid_claim.py): a fixed uid
    # could be a live service's session uid, whose clean-up kills every process of it.
    claim = claim_uid_range(cfg.uid_base, 1, solution_uid_offset=cfg.grading_solution_uid_offset)
    cfg = msgspec.structs.replace(cfg, uid_base=claim.base)
    cgroups = make_cgroup_manager(cfg.cgroups, max_processes=cfg.max_processes, memory_bytes=cfg.memory_bytes)
    try:
        await measure(cfg, Jail(cfg, cgroups), repeat, uid=claim.base)
    finally:
        if cgroups is not None:
            cgroups.close()
        claim.release()


async def measure(cfg: SandboxConfig, jail: Jail, repeat: int, *, uid: int) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ws, _ = Workspace.create(Path(tmp) / "ws", uid, {"test_one.py": "def test_one():\n    assert True\n"})
        env = {**jail.env, "HOME": tmp}
        for label, command in COMMANDS.items():
            plain_times, jail_times = [], []
            for _ in range(repeat):
                plain_times.append(await plain(command, ws.root, env))
                started = time.perf_counter()
                result = await jail.run(command, workspace=ws.root, uid=uid, timeout_s=60)
                jail_times.append(time.perf_counter() - started)
                assert result.exit_code == 0, result
            p, j = statistics.median(plain_times), statistics.median(jail_times)
            rows.append((label, p * 1000, j * 1000, j / p))
        store_dir = Path(tmp) / "tasks"
        store_dir.mkdir()
        store = TaskStore(store_dir)
        store.add(TASK)
        grader = Grader(cfg, RewardConfig(), store, jail)
        snap = Snapshot(files={"calc.py": WorkspaceFile("calc.py", TASK.files["calc.py"].encode())})
        grade_times = []
        for _ in range(max(3, repeat // 4)):
            started = time.perf_counter()
            verdict = await grader.verdict(TASK, snap, [], uid=uid)
            grade_times.append(time.perf_counter() - started)
            assert (verdict.tests_passed, verdict.tests_total) == (1, 3), verdict
    print(f"sandbox overhead, median of {repeat} runs (cgroups: {jail.cgroups is not None}, "
          f"privileged: {jail.privileged}, load: {os.getloadavg()[0]:.1f})")
    print(f"{'command':<18} {'plain ms':>10} {'jail ms':>10} {'ratio':>7}")
    for label, p, j, ratio in rows:
        print(f"{label:<18} {p:>10.1f} {j:>10.1f} {ratio:>7.2f}")
    print(f"{'grading (3 tests)':<18} {'':>10} {statistics.median(grade_times) * 1000:>10.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    from rollway.logging import configure_logging

    configure_logging("bench", level="warning")
    asyncio.run(main(args.repeat))
