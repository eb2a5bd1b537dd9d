"""Named fault-injection points, for chaos runs (``benchmarks/chaos.py``).

A chaos run must kill a process *inside* an operation that takes milliseconds (a
checkpoint between writing its files and renaming them in, a weight publish between
storing its manifest and announcing it). Timing a SIGKILL from outside cannot hit such
a window, so the process stops there itself when asked to:

    ROLLWAY_FAILPOINTS="checkpoint.before_rename@2,weights.before_announce"

lists points (``@N``: at the N-th time the point is reached, default the first).
``ROLLWAY_FAILPOINTS=@/some/file`` reads that list from the file each time a point is
reached, so a driver can arm a point in a running process (then ``@N`` counts hits
from the moment the point appears in the file). At an armed point the process logs
``failpoint reached`` (with the point's name) and hangs until it is killed. A point
listed as ``NAME:pause`` (or ``NAME@N:pause``) instead waits there only while it is
armed: once the driver removes it from the file, the operation goes on (logged as
``failpoint released``); a chaos run freezes a process inside the operation this way
and lets it finish later. Unset (the normal case), a point costs one dictionary lookup.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import structlog

log = structlog.get_logger(__name__)

ENV = "ROLLWAY_FAILPOINTS"
_hits: dict[str, int] = {}
_lock = threading.Lock()


PAUSE = ":pause"


def armed() -> dict[str, int]:
    """Point name -> the hit that hangs, from ``$ROLLWAY_FAILPOINTS`` (or the file it names)."""
    return {name: nth for name, (nth, _) in _points().items()}


def paused_points() -> set[str]:
    """The armed points that pause (``NAME:pause``) rather than hang for good."""
    return {name for name, (_, pause) in _points().items() if pause}


def _points() -> dict[str, tuple[int, bool]]:
    spec = os.environ.get(ENV, "").strip()
    if spec.startswith("@"):
        try:
            with open(spec[1:]) as f:
                spec = f.read()
        except OSError:
            spec = ""
    points: dict[str, tuple[int, bool]] = {}
    for item in spec.replace("\n", ",").split(","):
        item = item.strip()
        if not item:
            continue
        pause = item.endswith(PAUSE)
        name, _, nth = item.removesuffix(PAUSE).partition("@")
        try:
            points[name.strip()] = (int(nth) if nth else 1, pause)
        except ValueError:
            # A typo in a chaos run's list must not fail the operation it guards.
            log.error("failpoint spec not understood, ignored", item=item, expected="NAME or NAME@N")
    return points


def hits(name: str) -> int:
    """How often an armed point has been reached since it was armed (an in-process
    driver waits on this to know an operation is standing at the point)."""
    with _lock:
        return _hits.get(name, 0)


def _should_hang(name: str) -> tuple[bool, bool]:
    """(hang here, pause rather than hang for good), both from one read of the spec: a
    driver that disarms a pausing point right after it is reached must release it, not
    turn it into a hang for good by a second read."""
    point = _points().get(name)
    if point is None:
        with _lock:
            _hits.pop(name, None)  # disarmed: count afresh when armed again
        return False, False
    nth, pause = point
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        hit = _hits[name]
    if hit != nth:
        return False, False
    log.warning("failpoint reached", failpoint=name, hit=hit, pid=os.getpid())
    return True, pause


def reached(name: str) -> None:
    """A point in blocking code (a worker thread): hang here when armed (a pausing
    point: until it is disarmed)."""
    hang, pause = _should_hang(name)
    if hang:
        if pause:
            while name in paused_points():
                time.sleep(0.1)
            log.warning("failpoint released", failpoint=name, pid=os.getpid())
            return
        while True:
            time.sleep(3600)


async def reached_async(name: str) -> None:
    """A point in async code: hang this task here when armed (the loop runs on)."""
    if _should_hang(name)[0]:
        await asyncio.Event().wait()
