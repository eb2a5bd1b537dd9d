"""Grading time per submission, before and after the isolated grading path, side by side.

    .venv/bin/python benchmarks/grading_overhead.py [--baseline REV] [--also REV] [--repeat 2] [--tasks a,b,...]

"Before" is the repository at ``--baseline`` (default: the commit before the isolated
path landed), exported with ``git archive`` to a temporary folder and run from there with
the same venv; "after" is this checkout. ``--also REV`` times one more revision the same way
in the same run, as a middle column (e.g. the grading path before a change to it, so both
are measured under the same load). Each side starts its own live sandbox service
(real bubblewrap, real HTTP) in a subprocess and grades the reference solution of each
task once per round, one submission at a time (one command slot), so the numbers are
latencies, not throughput; ``--repeat`` rounds, the sides taking turns in each (the load of
a shared machine drifts). The figure per task is the median of the Reward's
``grading_seconds`` (snapshot + checks + hidden run + report); the table ends with the
mean and median over tasks (and their ratios to before) and the mean of the per-task
ratios, the figure the 1.5x goal is about. Prints the CPU it ran on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A mix: plain functions, classes with callbacks and state, and the two call-heavy tasks
# (lru_cache: 200k calls across the bridge; autocomplete: 20k).
DEFAULT_TASKS = ("sum_to,fizzbuzz,palindrome,roman_numerals,event_emitter,bank_transfer,semver,stack,"
                 "chunked,money_refactor,flatten,word_frequency,autocomplete,lru_cache")
DEFAULT_BASELINE = "84137ae~1"


async def _worker(tasks: list[str], repeat: int) -> dict[str, list[float]]:
    from sandbox.client import SandboxClient
    from sandbox.config import RewardConfig, SandboxConfig
    from tasks.store import TaskStore

    try:
        from tests.sandbox_helpers import live_sandbox
    except ImportError:  # a --baseline tree from before the fixtures moved to tests/
        from sandbox.testing import live_sandbox

    demo = Path("tasks/demo").resolve()
    store = TaskStore(demo)
    cfg = SandboxConfig(max_sessions=4, max_concurrent_commands=1, workspace_root=tempfile.mkdtemp(),
                        tasks_dir=str(demo), grading_timeout_s=300.0)
    out: dict[str, list[float]] = {}
    failures: list[str] = []
    async with live_sandbox(cfg, RewardConfig(), store) as live, SandboxClient(live.url, timeout_s=900) as client:
        for task in tasks:
            for i in range(repeat):
                sid = await client.create_session(task)
                for path, text in store.get(task).solution.items():
                    await client.write_file(sid, path, text)
                reward = await client.submit(sid, trajectory_id=f"bench-{task}-{i}")
                if reward.score != 1.0:
                    # Still timed; reported, so a flaky side shows instead of hiding.
                    print(f"{task}: reference solution scored {reward.score}: {reward.reason}", file=sys.stderr)
                    failures.append(task)
                out.setdefault(task, []).append(reward.grading_seconds)
    out["_failures"] = failures
    return out


def _run_side(tree: Path, tasks: str, repeat: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "ROLLWAY_LOG_LEVEL": "warning"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "grading_overhead.py"), "--worker", "--tasks", tasks,
         "--repeat", str(repeat)],
        cwd=tree, env=env, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _export(rev: str, dest: Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    tar = dest / "tree.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(dest / "tree")


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
    simd = "avx512f" if "avx512f" in flags else ("avx2" if "avx2" in flags else "no avx2")
    return f"{model} ({simd}, {os.cpu_count()} cpus)"


def _commit() -> str:
    """This checkout's commit, and whether its tracked files differ from it."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    return head.stdout.strip() + (" plus uncommitted changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=DEFAULT_BASELINE)
    parser.add_argument("--also", default="", help="another revision, timed in the same run (a middle column)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tasks", default=DEFAULT_TASKS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tasks = [t for t in args.tasks.split(",") if t]
    if args.worker:
        from rollway.logging import configure_logging

        configure_logging("bench", level="warning")
        print(json.dumps(asyncio.run(_worker(tasks, args.repeat))))
        return
    started, load_start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        trees: list[tuple[str, Path]] = []
        for i, (name, rev) in enumerate((("before", args.baseline), (args.also, args.also))):
            if rev:
                folder = Path(tmp) / str(i)
                folder.mkdir()
                _export(rev, folder)
                trees.append((name, folder / "tree"))
        trees.append(("after", ROOT))
        # Round by round, each side once per round: on a shared machine the load drifts,
        # and sides run one after the other would each meet a different load.
        sides: list[tuple[str, dict[str, list[float]]]] = [(name, {"_failures": []}) for name, _ in trees]
        for _ in range(args.repeat):
            for (_, tree), (_, data) in zip(trees, sides):
                for key, values in _run_side(tree, args.tasks, 1).items():
                    data.setdefault(key, []).extend(values)
    print(f"grading seconds per submission (median of {args.repeat}), reference solutions; {_cpu()}; "
          f"after = {_commit()}; {started} - {time.strftime('%H:%M:%S UTC', time.gmtime())}; "
          f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    names = [name[:10] for name, _ in sides]
    ratios = [f"{name[:8]}/b" for name in names[1:]]
    print(f"{'task':<16}" + "".join(f"{n:>11}" for n in names) + "".join(f"{r:>11}" for r in ratios))
    columns: list[list[float]] = [[] for _ in sides]
    for task in tasks:
        row = [statistics.median(data[task]) for _, data in sides]
        for col, value in zip(columns, row):
            col.append(value)
        print(f"{task:<16}" + "".join(f"{v:>11.3f}" for v in row) + "".join(f"{v / row[0]:>11.2f}" for v in row[1:]))
    for label, agg in (("mean", statistics.mean), ("median", statistics.median)):
        row = [agg(col) for col in columns]
        print(f"{label:<16}" + "".join(f"{v:>11.3f}" for v in row) + "".join(f"{v / row[0]:>11.2f}" for v in row[1:]))
    # The goal's figure (#31): the mean over tasks of each task's own ratio to "before".
    ratio_means = [statistics.mean(v / b for v, b in zip(col, columns[0])) for col in columns[1:]]
    print(f"{'mean of ratios':<16}" + " " * (11 * len(columns)) + "".join(f"{r:>11.2f}" for r in ratio_means))
    for side, data in sides:
        if data["_failures"]:
            print(f"{side}: reference solutions that did not score 1: {', '.join(data['_failures'])}")


if __name__ == "__main__":
    main()
