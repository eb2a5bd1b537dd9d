"""A live sandbox service for tests (of the sandbox and other components) and benchmarks:
real HTTP on a free loopback port, real bubblewrap sandboxes. Lives under tests/, not in
the installed ``sandbox`` package."""

from __future__ import annotations

import asyncio
import contextlib
import io
import sys
import traceback
from pathlib import Path
from typing import AsyncIterator

from sandbox.config import RewardConfig, SandboxConfig
from sandbox.grader import Publisher
from sandbox.service import SandboxService
from tasks.spec import TaskSpec
from tasks.store import TaskStore


# The service's shutdown is bounded in tests: a hang there is a bug, and without the bound
# it shows only as pytest's timeout minutes later, with thread stacks that show an idle
# loop. With it, the test fails naming every task still waiting and where.
SHUTDOWN_BOUND_S = 120.0


def pending_work_report() -> str:
    """Every asyncio task of the running loop that is not done and every thread, with
    where each one waits: what a hang report needs."""
    out = io.StringIO()
    current = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is current:
            continue
        out.write(f"--- task {task.get_name()}: {task.get_coro()!r}\n")
        task.print_stack(file=out)
    for ident, frame in sys._current_frames().items():
        out.write(f"--- thread {ident}\n")
        traceback.print_stack(frame, file=out)
    return out.getvalue()


class LiveSandbox:
    def __init__(self, service: SandboxService, url: str) -> None:
        self.service = service
        self.url = url


@contextlib.asynccontextmanager
async def live_sandbox(
    cfg: SandboxConfig,
    reward_cfg: RewardConfig | None = None,
    store: TaskStore | None = None,
    publisher: Publisher | None = None,
) -> AsyncIterator[LiveSandbox]:
    from aiohttp import web

    service = SandboxService(cfg, reward_cfg or RewardConfig(), store or TaskStore(cfg.tasks_dir), publisher)
    runner = web.AppRunner(service.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield LiveSandbox(service, f"http://{host}:{port}")
    finally:
        cleanup = asyncio.ensure_future(runner.cleanup())
        done, _ = await asyncio.wait([cleanup], timeout=SHUTDOWN_BOUND_S)
        if not done:
            raise AssertionError(f"the sandbox service did not shut down in {SHUTDOWN_BOUND_S:.0f} s; "
                                 f"waiting:\n{pending_work_report()}")
        cleanup.result()


def write_task_dir(root: Path, spec: TaskSpec) -> Path:
    """Write ``spec`` in the task folder format of :mod:`tasks.spec` under ``root``."""
    import tomli_w

    folder = root / spec.task_id
    meta = {"instruction": spec.instruction, "difficulty": spec.difficulty, "test_command": spec.test_command}
    if spec.metadata:
        meta["metadata"] = dict(spec.metadata)
    folder.mkdir(parents=True)
    (folder / "task.toml").write_text(tomli_w.dumps(meta))
    for sub, files in (("repo", spec.files), ("hidden_tests", spec.hidden_tests), ("solution", spec.solution)):
        for rel, text in files.items():
            path = folder / sub / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return folder
