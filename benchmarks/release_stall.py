"""Another session's calls while a session is released, and a GRPO group's start: this
checkout's sandbox service side by side with another checkout's (issue #26).

    .venv/bin/python benchmarks/release_stall.py --before /tmp/rollway-before [--files 20000]
                                                 [--rounds 2] [--group 8] [--groups 4] [--docker 10]

Closing a session unmounts and deletes its tree. Where that runs on the service's event
loop, every other session's calls wait for it; in a pool thread they do not. Per round,
each service (``--before``: a checkout of the commit to compare with, e.g. ``git clone
--shared . /tmp/rollway-before && git -C /tmp/rollway-before checkout COMMIT``; and this
checkout), in turn and in a process of its own (benchmarks/envs.py --serve of that
checkout):

1. stall: session A makes ``--files`` empty files in its tree (a repository with its
   build and caches); session B reads one of its files back to back, alone (baseline)
   and then while A is closed: A's close time, B's read latency while it lasted (max, p50) and how
   many of B's calls were answered during it;
2. group: ``--group`` sessions of the example image task opened at once (create + ``true``
   + close each; benchmarks/envs.py's group_start, warm trees following the group, the
   default), ``--groups`` groups 1 s apart: per-session p50/p99, and its ratio to ``docker
   run --rm IMAGE true`` one at a time (``--docker`` runs, where a Docker daemon answers),
   the issue's goal being <= 0.1x.

The services alternate (before, this, before, this, ...) so load changes hit both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.envs import HOST_TASK, IMAGE_TASK, _ms, _pct, docker_start, group_start  # noqa: E402
from benchmarks.harness import cpu_name, load_average, print_aligned  # noqa: E402
from sandbox.client import SandboxClient  # noqa: E402
from sandbox.config import ImageConfig, SandboxConfig  # noqa: E402
from tasks.images.examples import EXAMPLES  # noqa: E402
from tasks.spec import TaskSpec  # noqa: E402
from tests.image_helpers import example_images  # noqa: E402
from tests.sandbox_helpers import write_task_dir  # noqa: E402

HERE = Path(__file__).resolve().parent.parent


class _Service:
    """The sandbox service of checkout ``tree`` on ``cfg``, in a child process."""

    def __init__(self, tree: Path, cfg: SandboxConfig, work: Path) -> None:
        self.tree, self.cfg, self.work = tree, cfg, work

    async def __aenter__(self) -> str:
        config = self.work / "serve.json"
        config.write_bytes(msgspec.json.encode(self.cfg))
        url_file = self.work / "serve.url"
        url_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, str(self.tree / "benchmarks/envs.py"), "--serve", str(config),
                                      str(url_file)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, cwd=self.tree)
        while not url_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the sandbox service of {self.tree} exited ({self.proc.returncode})")
            await asyncio.sleep(0.05)
        return url_file.read_text()

    async def __aexit__(self, *exc) -> None:
        self.proc.stdin.close()  # it shuts down (sessions, warm trees) and exits
        await asyncio.to_thread(self.proc.wait, 60)


async def _read_times(client: SandboxClient, sid: str, until) -> list[float]:
    """Reads of one of the session's files back to back (a call that needs nothing but the
    service's loop, ~1 ms) until ``until()``: their latencies."""
    times = []
    while not until():
        started = time.perf_counter()
        await client.read_file(sid, "namekit/__init__.py")
        times.append(time.perf_counter() - started)
    return times


async def stall(client: SandboxClient, files: int) -> dict[str, float]:
    """A's close with ``files`` files in its tree, and B's file reads meanwhile."""
    a, b = await client.create_session(HOST_TASK), await client.create_session(HOST_TASK)
    made = await client.exec(a, f"mkdir d && cd d && python3 -c \"[open(str(i), 'w').close() for i in "
                                f"range({files})]\" && ls | wc -l", timeout_s=120)
    assert made.stdout.split() == [str(files)], made
    ends = time.perf_counter() + 0.5
    alone = await _read_times(client, b, lambda: time.perf_counter() > ends)
    ended: list[float] = []
    closing = asyncio.ensure_future(client.close_session(a))
    started = time.perf_counter()
    closing.add_done_callback(lambda _: ended.append(time.perf_counter()))
    during = await _read_times(client, b, closing.done)
    await closing
    await client.close_session(b)
    return {"close_s": ended[0] - started, "alone_p50": statistics.median(alone),
            "during_max": max(during), "during_p50": statistics.median(during), "during_n": len(during)}


async def main(args: argparse.Namespace) -> None:
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load before: {load_average()}")
    images = example_images()
    trees = {"before": Path(args.before).resolve(), "this": HERE}
    commits = {k: subprocess.run(["git", "-C", str(v), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() for k, v in trees.items()}
    results: dict[str, dict[str, list]] = {k: {"stall": [], "group": []} for k in trees}
    with tempfile.TemporaryDirectory(prefix="rollway-stall-") as tmp:
        tasks = Path(tmp) / "tasks"
        tasks.mkdir()
        shutil.copy(HERE / "tasks/images/examples.jsonl", tasks)
        write_task_dir(tasks, TaskSpec(task_id=HOST_TASK, instruction="-", files=dict(EXAMPLES[0].files),
                                       hidden_tests={"test_x.py": ""}))
        for r in range(args.rounds):
            for name, tree in trees.items():
                ws = Path(tmp) / f"ws-{name}-{r}"
                ws.mkdir()
                # The defaults of a group's service (envs.py 1b, warm trees following the group).
                cfg = SandboxConfig(max_sessions=max(SandboxConfig().max_sessions, 2 * args.group),
                                    workspace_root=str(ws), tasks_dir=str(tasks),
                                    images=ImageConfig(cache_dir=images.cache_dir, warm_sessions_per_image=2,
                                                       warm_follow_demand=True))
                async with _Service(tree, cfg, Path(tmp)) as url, SandboxClient(url) as client:
                    results[name]["stall"].append(await stall(client, args.files))
                    total, *_ = await group_start(client, IMAGE_TASK, args.group, args.groups, 1.0, args.group)
                    results[name]["group"] += total
        docker = docker_start(EXAMPLES[0].image, args.docker) if args.docker else "not run"

    print(f"\n1. Session B's file reads while session A ({args.files} files in its tree) is closed, "
          f"{args.rounds} rounds per service, ms")
    rows = []
    for name, res in results.items():
        for s in res["stall"]:
            rows.append([f"{name} ({commits[name]})", _ms(s["close_s"]), _ms(s["alone_p50"]), _ms(s["during_p50"]),
                         _ms(s["during_max"]), s["during_n"]])
    print_aligned(["service", "A's close", "B alone p50", "B during p50", "B during max", "B reads during"], rows)
    docker_p50 = None if isinstance(docker, str) else statistics.median(docker)
    print(f"\n2. A group of {args.group} image sessions at once, {args.groups} groups x {args.rounds} rounds, "
          f"per session ms (create + true + close); docker run --rm p50 one at a time: "
          f"{docker if isinstance(docker, str) else _ms(docker_p50)}")
    rows = []
    for name, res in results.items():
        total = res["group"]
        p50 = statistics.median(total)
        rows.append([f"{name} ({commits[name]})", _ms(p50), _ms(_pct(total, 0.99)), _ms(min(total)), len(total),
                     f"{p50 / docker_p50:.3f}" if docker_p50 else "-"])
    print_aligned(["service", "p50", "p99", "min", "n", "/ docker p50"], rows)
    print(f"\nload after: {load_average()}")
    if args.json:
        print(json.dumps({"results": results, "docker": docker, "commits": commits}, default=str))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="a checkout of the commit to compare with")
    parser.add_argument("--files", type=int, default=20000, help="files in the closed session's tree")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--docker", type=int, default=10, help="docker run --rm IMAGE true, one at a time (0: skip)")
    parser.add_argument("--json", action="store_true")
    asyncio.run(main(parser.parse_args()))
