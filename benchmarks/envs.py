"""Task environments side by side: OCI image roots vs the host root vs Docker (issue #26).

    .venv/bin/python benchmarks/envs.py [--sessions 40] [--concurrency 4] [--disk-sessions 20]
                                        [--group 8] [--groups 10]

All through the live sandbox service (real HTTP, bwrap, overlayfs, per-session quota),
on the example images (tests/image_helpers.py builds them once per machine):

1. session start: create a session, run ``true`` in it, close it (what ``docker run
   --rm IMAGE true`` does), sequentially: p50/p99 for a host-root task, an image task
   (tree made on demand) and an image task with warm sessions (tree made ahead); and
   ``docker run --rm`` of the same image where a Docker daemon answers (else "not
   available");
1b. a GRPO group: ``--group`` sessions of one task opened at once (each create + ``true``
   + close, as the sampler's G rollouts of a group start together), ``--groups`` groups
   with a pause between them (the agents' work, while warm trees are made): per-session
   p50/p99 for a host task, an image task with no warm trees, with the old floor of 2
   warm trees, and with warm trees following the group size (the default), the service
   in a process of its own (as beside a sampler, whose G rollouts share one loop); next to
   ``docker run --rm`` of the image, one at a time (the goal's reference) and G at once;
2. throughput: ``--concurrency`` clients doing the same loop on one image: sessions/s;
   memory per open session: the host's Shmem (tmpfs pages: the CoW layers live in a
   tmpfs) and Slab (inodes, dentries, mounts) deltas with ``--disk-sessions`` sessions open
   at once (host-wide figures: noisy on a shared machine);
   and ``true`` as a later command of an open session (its sandbox started ahead);
3. disk: ``--disk-sessions`` sessions of one image, each changing one file: the bytes
   their copy-on-write layers use, next to the image's unpacked size;
4. per example image: fetch (skopeo) and unpack (umoci) time, blob and unpacked size, in
   a fresh store; and the example images' build time when this run built them.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
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

from benchmarks.harness import cpu_name, load_average, print_aligned  # noqa: E402
from sandbox.client import SandboxClient  # noqa: E402
from sandbox.config import ImageConfig, SandboxConfig  # noqa: E402
from sandbox.images import ImageStore  # noqa: E402
from tasks.images.examples import EXAMPLES  # noqa: E402
from tasks.spec import TaskSpec  # noqa: E402
from tasks.store import TaskStore  # noqa: E402
from tests.image_helpers import example_images  # noqa: E402
from tests.sandbox_helpers import live_sandbox, write_task_dir  # noqa: E402

IMAGE_TASK = "rollway-examples__namekit-1"
HOST_TASK = "host_blank"
BIG_TASK = "bench_bigrepo"
BIG_IMAGE = "rollway.local/bench/bigrepo:1"


def big_image(layout: str, cache_dir: str, work: Path) -> int:
    """An image whose /testbed is a repository-sized tree (the image's own Python standard
    library, ~2k files), on the examples' base; returns its file count."""
    store = ImageStore(ImageConfig(cache_dir=cache_dir))
    if store.lookup(BIG_IMAGE) is None:
        base = Path(asyncio.run(store.ensure(EXAMPLES[0].image)).rootfs)
        stage = work / "big"
        shutil.copytree(base / "usr/lib/python3.11", stage, symlinks=True)
        subprocess.run(["umoci", "tag", "--image", f"{layout}:base", "bigrepo"], check=True, capture_output=True)
        subprocess.run(["umoci", "insert", "--image", f"{layout}:bigrepo", str(stage), "/testbed"], check=True,
                       capture_output=True)
        asyncio.run(store.ensure(BIG_IMAGE, source=f"oci:{layout}:bigrepo"))
    root = Path(store.lookup(BIG_IMAGE).rootfs) / "testbed"
    return sum(len(files) + len(dirs) for _, dirs, files in os.walk(root))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _ms(v: float) -> str:
    return f"{v * 1000:.1f}"


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


async def _start_once(client: SandboxClient, task_id: str, created: list[float] | None = None) -> float:
    started = time.perf_counter()
    sid = await client.create_session(task_id)
    if created is not None:
        created.append(time.perf_counter() - started)
    result = await client.exec(sid, "true")
    await client.close_session(sid)
    assert result.exit_code == 0, result
    return time.perf_counter() - started


async def session_start(client: SandboxClient, task_id: str, n: int) -> tuple[list[float], list[float]]:
    """(create + true + close, create alone) per session, sequentially; a pause between
    sessions lets warm trees be made (as while an agent works)."""
    await _start_once(client, task_id)  # warm-up (first use of the image, page cache)
    created: list[float] = []
    total = []
    for _ in range(n):
        total.append(await _start_once(client, task_id, created))
        await asyncio.sleep(0.05)
    return total, created


async def next_command(client: SandboxClient, task_id: str, n: int) -> list[float]:
    """``true`` as a later command of one open session (an agent's next tool call, after
    a pause like its model's turn): the exec alone, with the session's next sandbox
    started ahead (sandbox.prestart_sandboxes)."""
    sid = await client.create_session(task_id)
    await client.exec(sid, "true")
    times = []
    for _ in range(n):
        await asyncio.sleep(0.25)
        started = time.perf_counter()
        result = await client.exec(sid, "true")
        times.append(time.perf_counter() - started)
        assert result.exit_code == 0, result
    await client.close_session(sid)
    return times


def docker_start(image: str, n: int) -> list[float] | str:
    docker = shutil.which("docker")
    if docker is None:
        return "not available (no docker binary)"
    if subprocess.run([docker, "info"], capture_output=True).returncode != 0:
        return "not available (no Docker daemon answers)"
    times = []
    for _ in range(n):
        started = time.perf_counter()
        proc = subprocess.run([docker, "run", "--rm", image, "true"], capture_output=True)
        if proc.returncode != 0:
            return f"not available (docker run failed: {proc.stderr.decode()[-200:]})"
        times.append(time.perf_counter() - started)
    return times


async def _warm_trees(client: SandboxClient) -> int:
    return (await client.request("GET", "/health"))["warm_sessions"]


async def group_start(client: SandboxClient, task_id: str, group: int, groups: int,
                      pause_s: float, expect_warm: int) -> tuple[list[float], list[float], list[int], list[float]]:
    """``groups`` groups of ``group`` sessions opened at once (create + true + close each):
    per-session totals, creates, the warm trees ready as each group started, and the
    seconds after each group until ``expect_warm`` trees were ready again (within the
    pause; polled over /health). One group first, unmeasured (the image's first group:
    the pool learns its size)."""

    async def one_group(total: list[float], created: list[float], refill: list[float]) -> None:
        results = await asyncio.gather(*(_start_once(client, task_id, created) for _ in range(group)))
        total.extend(results)
        ended = time.perf_counter()
        while time.perf_counter() - ended < pause_s:
            if expect_warm and len(refill) < len(total) // group and await _warm_trees(client) >= expect_warm:
                refill.append(time.perf_counter() - ended)
            await asyncio.sleep(0.01)

    await one_group([], [], [])
    total: list[float] = []
    created: list[float] = []
    ready: list[int] = []
    refill: list[float] = []
    for _ in range(groups):
        ready.append(await _warm_trees(client))
        await one_group(total, created, refill)
    return total, created, ready, refill


@contextlib.asynccontextmanager
async def service_process(cfg: SandboxConfig, work: Path):
    """The sandbox service on ``cfg`` in a child process (this script's --serve); yields its URL."""
    config = work / "serve.json"
    config.write_bytes(msgspec.json.encode(cfg))
    url_file = work / "serve.url"
    url_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(config), str(url_file)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not url_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the sandbox service exited ({proc.returncode})")
            await asyncio.sleep(0.05)
        yield url_file.read_text()
    finally:
        proc.stdin.close()  # it shuts down (sessions, warm trees) and exits
        await asyncio.to_thread(proc.wait, 60)


async def serve(config: str, url_file: str) -> None:
    cfg = msgspec.json.decode(Path(config).read_bytes(), type=SandboxConfig)
    async with live_sandbox(cfg, store=TaskStore(cfg.tasks_dir)) as live:
        Path(url_file + ".tmp").write_text(live.url)
        os.rename(url_file + ".tmp", url_file)
        await asyncio.to_thread(sys.stdin.read)


def docker_group(image: str, group: int, groups: int) -> list[float] | str:
    """``docker run --rm IMAGE true``, ``group`` at once, ``groups`` times: per-run seconds."""
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "info"], capture_output=True).returncode != 0:
        return "not available"

    def one() -> float:
        started = time.perf_counter()
        proc = subprocess.run([docker, "run", "--rm", image, "true"], capture_output=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.decode()[-200:])
        return time.perf_counter() - started

    times: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(group) as pool:
        for _ in range(groups):
            times += list(pool.map(lambda _: one(), range(group)))
    return times


async def throughput(client: SandboxClient, task_id: str, concurrency: int, per_client: int) -> float:
    async def worker() -> None:
        for _ in range(per_client):
            await _start_once(client, task_id)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return concurrency * per_client / (time.perf_counter() - started)


async def held_sessions(live, client: SandboxClient, task_id: str, n: int) -> tuple[dict[str, float], int, int]:
    """Open ``n`` sessions, change one file in each; memory deltas per session, the bytes
    of their CoW layers, and the unpacked image size."""
    before = _meminfo()
    sids = [await client.create_session(task_id) for _ in range(n)]
    for sid in sids:
        await client.exec(sid, "echo '# touched' >> namekit/__init__.py")
    after = _meminfo()
    used = 0
    for sid in sids:
        st = os.statvfs(live.service.pool.get(sid).workspace.root)
        used += (st.f_blocks - st.f_bfree) * st.f_frsize
    root = live.service.pool.get(sids[0]).root
    image = next(i for i in live.service.images.list() if i.digest == root.digest)
    for sid in sids:
        await client.close_session(sid)
    per = {k: (after[k] - before[k]) / n for k in ("Shmem", "Slab")}
    return per, used, image.size_bytes


async def unpack_figures(layout: str) -> list[list[object]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollway-envs-store-") as tmp:
        store = ImageStore(ImageConfig(cache_dir=tmp))
        for ex in EXAMPLES:
            await store.ensure(ex.image, source=f"oci:{layout}:{ex.name}")
        for image in store.list()[::-1]:
            rows.append([image.refs[0], image.layers, f"{image.blob_bytes / 2**20:.1f}",
                         f"{image.size_bytes / 2**20:.1f}", f"{image.fetch_s:.2f}", f"{image.unpack_s:.2f}"])
    return rows


async def main(args: argparse.Namespace) -> None:
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load before: {load_average()}")
    images = example_images()
    if images.build_s:
        print(f"example images built for this run in {images.build_s:.1f} s (tasks/images/build.py + import)")
    with tempfile.TemporaryDirectory(prefix="rollway-envs-") as tmp:
        started = time.monotonic()
        files = await asyncio.to_thread(big_image, images.layout, images.cache_dir, Path(tmp))
        big_name = f"image task, {files}-entry repo"
        print(f"big-repo image ready in {time.monotonic() - started:.1f} s")
        tasks = Path(tmp) / "tasks"
        tasks.mkdir()
        shutil.copy(Path(__file__).resolve().parent.parent / "tasks/images/examples.jsonl", tasks)
        write_task_dir(tasks, TaskSpec(task_id=HOST_TASK, instruction="-", files=dict(EXAMPLES[0].files),
                                       hidden_tests={"test_x.py": ""}))
        (tasks / "big.jsonl").write_text(json.dumps({
            "instance_id": BIG_TASK, "problem_statement": "-", "image": BIG_IMAGE,
            "test_files": {"tests/test_x.py": "def test_x():\n    pass\n"}, "FAIL_TO_PASS": ["tests/test_x.py::test_x"],
        }) + "\n")
        store = TaskStore(tasks)
        results: dict[str, object] = {}
        for warm in (0, 2):
            cfg = SandboxConfig(max_sessions=max(args.disk_sessions, args.concurrency) + 4,
                                workspace_root=str(Path(tmp) / f"ws{warm}"), tasks_dir=str(tasks),
                                images=ImageConfig(cache_dir=images.cache_dir, warm_sessions_per_image=warm))
            Path(cfg.workspace_root).mkdir()
            async with live_sandbox(cfg, store=store) as live, SandboxClient(live.url) as client:
                if warm == 0:
                    results["host task"] = await session_start(client, HOST_TASK, args.sessions)
                    results["image task"] = await session_start(client, IMAGE_TASK, args.sessions)
                    results[big_name] = await session_start(client, BIG_TASK, args.sessions)
                    results["host task, next command (exec alone)"] = await next_command(client, HOST_TASK,
                                                                                        args.sessions)
                    results["image task, next command (exec alone)"] = await next_command(client, IMAGE_TASK,
                                                                                         args.sessions)
                    per_client = max(1, args.sessions // args.concurrency)
                    results["rate host"] = await throughput(client, HOST_TASK, args.concurrency, per_client)
                    results["rate image"] = await throughput(client, IMAGE_TASK, args.concurrency, per_client)
                    results["held"] = await held_sessions(live, client, IMAGE_TASK, args.disk_sessions)
                else:
                    results["image task, warm sessions"] = await session_start(client, IMAGE_TASK, args.sessions)
                    results[big_name + ", warm"] = await session_start(client, BIG_TASK, args.sessions)
        # A GRPO group: G sessions of one image at once, under the default max_sessions (or
        # 2G, whichever is larger: a group plus its warm trees).
        group_rows = (("image task, no warm trees", 0, False), ("image task, 2 warm trees (old default)", 2, False),
                      ("image task, warm trees follow the group (default)", 2, True))
        for name, warm, follow in group_rows:
            cfg = SandboxConfig(max_sessions=max(SandboxConfig().max_sessions, 2 * args.group),
                                workspace_root=str(Path(tmp) / f"wsg-{warm}-{follow}"), tasks_dir=str(tasks),
                                images=ImageConfig(cache_dir=images.cache_dir, warm_sessions_per_image=warm,
                                                   warm_follow_demand=follow))
            Path(cfg.workspace_root).mkdir()
            # The service in a process of its own, as `rollway sandbox` runs beside the
            # sampler (whose G rollouts share one event loop, here this one).
            async with service_process(cfg, Path(tmp)) as url, SandboxClient(url) as client:
                if warm == 0:
                    results["group: host task"] = await group_start(client, HOST_TASK, args.group,
                                                                    args.groups, args.group_pause, 0)
                results["group: " + name] = await group_start(client, IMAGE_TASK, args.group, args.groups,
                                                              args.group_pause, args.group if follow else warm)
        results["docker run --rm"] = docker_start(EXAMPLES[0].image, args.sessions)
        results["group: docker run --rm, G at once"] = docker_group(EXAMPLES[0].image, args.group, args.groups)

    print(f"\n1. Session start, {args.sessions} sequential, ms: create + exec true + close (as docker run --rm "
          f"IMAGE true), and create alone")
    rows = []
    for name in ("host task", "image task", "image task, warm sessions", big_name, big_name + ", warm",
                 "host task, next command (exec alone)", "image task, next command (exec alone)",
                 "docker run --rm"):
        value = results[name]
        if isinstance(value, str):
            rows.append([name, value, "", "", "", ""])
        else:
            total, created = value if isinstance(value, tuple) else (value, [])
            rows.append([name, _ms(statistics.median(total)), _ms(_pct(total, 0.99)), _ms(min(total)),
                         _ms(statistics.median(created)) if created else "-",
                         _ms(_pct(created, 0.99)) if created else "-"])
    print_aligned(["", "p50", "p99", "min", "create p50", "create p99"], rows)

    print(f"\n1b. A group of {args.group} sessions opened at once, {args.groups} groups {args.group_pause} s apart, "
          f"per-session ms (create + exec true + close), warm trees ready as each group started, and the ratio of "
          f"p50 to docker run --rm p50 one at a time (row 1) and {args.group} at once")
    docker_one = results["docker run --rm"]
    docker_g = results["group: docker run --rm, G at once"]
    rows = []
    for name in ("group: host task", *("group: " + r[0] for r in group_rows), "group: docker run --rm, G at once"):
        value = results[name]
        if isinstance(value, str):
            rows.append([name[7:], value, "", "", "", "", "", "", ""])
            continue
        total, created, ready, refill = value if isinstance(value, tuple) else (value, [], [], [])
        p50 = statistics.median(total)
        ratio_one = f"{p50 / statistics.median(docker_one):.3f}" if not isinstance(docker_one, str) else "-"
        ratio_g = f"{p50 / statistics.median(docker_g):.3f}" if not isinstance(docker_g, str) else "-"
        rows.append([name[7:], _ms(p50), _ms(_pct(total, 0.99)), _ms(min(total)),
                     _ms(statistics.median(created)) if created else "-",
                     f"{statistics.mean(ready):.1f}" if ready else "-",
                     (f"{statistics.median(refill):.2f}" + ("" if len(refill) == len(ready) else
                                                           f" ({len(ready) - len(refill)} > pause)")) if refill else "-",
                     ratio_one, ratio_g])
    print_aligned(["", "p50", "p99", "min", "create p50", "warm ready", "refilled s", "/ docker p50",
                   f"/ docker {args.group} p50"], rows)

    print(f"\n2. Throughput, {args.concurrency} concurrent clients on {os.cpu_count()} cores (sessions/s)")
    print_aligned(["", "sessions/s"], [["host task", f"{results['rate host']:.1f}"],
                                       ["image task", f"{results['rate image']:.1f}"]])
    per, used, image_size = results["held"]
    print(f"\n3. {args.disk_sessions} open sessions of one image, each with one file changed")
    print_aligned(["", "value"], [
        ["CoW layers, all sessions (KiB)", f"{used / 1024:.0f}"],
        ["per session (KiB)", f"{used / args.disk_sessions / 1024:.1f}"],
        ["image unpacked once, shared by all (MiB)", f"{image_size / 2**20:.1f}"],
        ["memory per open session: host Shmem delta (KiB)", f"{per['Shmem'] / 1024:.0f}"],
        ["memory per open session: host Slab delta (KiB)", f"{per['Slab'] / 1024:.0f}"],
    ])
    print("\n4. Example images: fetch (skopeo copy oci: -> layout, digests checked) and unpack (umoci), fresh store")
    print_aligned(["image", "layers", "blobs MiB", "unpacked MiB", "fetch s", "unpack s"],
                  await unpack_figures(images.layout))
    print(f"\nload after: {load_average()}")
    if args.json:
        print(json.dumps({k: v for k, v in results.items() if k != "held"}, default=str))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--disk-sessions", type=int, default=20)
    parser.add_argument("--group", type=int, default=8, help="sessions of a GRPO group, opened at once")
    parser.add_argument("--groups", type=int, default=10)
    parser.add_argument("--group-pause", type=float, default=1.0, help="seconds between groups (agents working)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", nargs=2, metavar=("CONFIG", "URL_FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    asyncio.run(serve(*args.serve) if args.serve else main(args))
