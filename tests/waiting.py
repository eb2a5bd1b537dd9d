"""Bounded waits for tests: poll a condition until it holds, or fail naming what was
awaited. Tests wait with these, never with a fixed sleep or a loop of their own; a
sleep is left only where a test checks that nothing happens during a window."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from pathlib import Path
from typing import Any, Callable


def _check_alive(what: str, proc: subprocess.Popen | None, task: asyncio.Task | None) -> None:
    if proc is not None and proc.poll() is not None:
        raise AssertionError(f"the process exited ({proc.returncode}) while waiting for {what}: {proc.args}")
    if task is not None and task.done():
        task.result()  # its exception, if it failed
        raise AssertionError(f"the task ended while waiting for {what}")


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, *,
               proc: subprocess.Popen | None = None, poll_s: float = 0.05) -> Any:
    """``predicate()``'s first truthy value, polled every ``poll_s`` s; AssertionError
    after ``timeout`` s, or at once when ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        _check_alive(what, proc, None)
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll_s)


async def wait_until_async(predicate: Callable[[], Any], timeout: float, what: str, *,
                           proc: subprocess.Popen | None = None, task: asyncio.Task | None = None,
                           poll_s: float = 0.05) -> Any:
    """:func:`wait_until` for async tests: ``predicate`` may return an awaitable, the
    event loop runs between polls, and a ``task`` that ends first fails the wait."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        _check_alive(what, proc, task)
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(poll_s)


def processes_matching(marker: str | Path) -> list[str]:
    """Pids of processes whose command line holds ``marker``."""
    return subprocess.run(["pgrep", "-f", str(marker)], capture_output=True, text=True).stdout.split()


def leftover_processes(marker: str | Path, grace_s: float = 5.0) -> list[str]:
    """The processes holding ``marker`` still alive after up to ``grace_s`` s (a process
    tree's teardown is asynchronous to its parent's exit); [] as soon as none is left."""
    try:
        wait_until(lambda: not processes_matching(marker), grace_s, f"the processes of {marker} to end")
    except AssertionError:
        pass
    return processes_matching(marker)
