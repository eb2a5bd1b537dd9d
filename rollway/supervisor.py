"""Child-process supervision for ``rollway up``: compose's ``restart: unless-stopped``.

Every component runs as its own process, logging to its own file. A component that
exits (any exit code, or killed by a signal) while the stack is not stopping is
started again after an exponential backoff; the restart count is kept, shown and
logged. Only a crash loop stops the stack: ``crash_loop_exits`` exits of one
component within ``crash_loop_window_s`` seconds. A component may also be marked
``done_on_success``: its exit code 0 then means "finished" (the trainer that reached
``--max-steps``), not a crash.

The supervisor is driven by :meth:`Supervisor.tick` from the caller's loop, never
blocks there, and takes its clock as a parameter so its policy is testable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec
import structlog

log = structlog.get_logger(__name__)


class RestartPolicy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Delay before the n-th restart in a row: initial * 2**(n-1), at most max.
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    # A component that ran this long before exiting starts again at the initial delay.
    backoff_reset_after_s: float = 60.0
    # Give up (stop the stack, exit != 0) when one component exited this many times
    # within the window: it is crash-looping and restarting it again will not help.
    crash_loop_exits: int = 5
    crash_loop_window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("up.restart: need 0 <= backoff_initial_s <= backoff_max_s")
        if self.crash_loop_exits < 1 or self.crash_loop_window_s <= 0:
            raise ValueError("up.restart: crash_loop_exits must be >= 1 and crash_loop_window_s > 0")

    def backoff(self, consecutive_exits: int) -> float:
        """Delay before restarting after the ``consecutive_exits``-th quick exit (>= 1)."""
        return min(self.backoff_initial_s * 2 ** max(consecutive_exits - 1, 0), self.backoff_max_s)


@dataclass(frozen=True)
class ComponentSpec:
    name: str
    argv: list[str]  # the full command line
    env: dict[str, str]
    log_path: Path
    # Shutdown order: lower stages get SIGTERM first (feeder and samplers drain while
    # the sandbox still grades their last rollouts).
    stop_stage: int = 0
    done_on_success: bool = False


@dataclass(frozen=True)
class ComponentStatus:
    """What the view shows of one component."""

    name: str
    state: str  # running | restarting | crashed | finished | stopping | stopped
    restarts: int
    pid: int | None
    last_exit: int | None  # exit code; negative = killed by that signal
    log_path: str


@dataclass
class _Component:
    spec: ComponentSpec
    proc: subprocess.Popen | None = None
    state: str = "stopped"
    restarts: int = 0
    started_at: float = 0.0
    restart_at: float = 0.0
    consecutive: int = 0  # quick exits in a row (sets the backoff)
    exits: deque = field(default_factory=deque)  # exit times inside the crash-loop window
    last_exit: int | None = None


class CrashLoop(Exception):
    """A component exited too often too fast; the stack should stop."""

    def __init__(self, name: str, exits: int, window_s: float, log_path: Path, last_exit: int | None) -> None:
        self.name, self.log_path, self.last_exit = name, log_path, last_exit
        super().__init__(
            f"{name} exited {exits} times within {window_s:g} s (last exit {describe_exit(last_exit)}); "
            f"giving up. See its log: {log_path}"
        )


def describe_exit(code: int | None) -> str:
    if code is None:
        return "unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"code {code}"


Notify = Callable[[str], None]


class Supervisor:
    def __init__(self, specs: list[ComponentSpec], policy: RestartPolicy, *,
                 clock: Callable[[], float] = time.monotonic, notify: Notify | None = None) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be unique: {names}")
        self.policy = policy
        self.clock = clock
        self.notify = notify or (lambda _line: None)
        self.components = {s.name: _Component(s) for s in specs}

    # -- lifecycle ---------------------------------------------------------------------
    def start_all(self) -> None:
        for comp in self.components.values():
            self._spawn(comp)

    def _spawn(self, comp: _Component) -> None:
        spec = comp.spec
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as out:
            # The child keeps its own copy of the descriptor; ours closes here.
            comp.proc = subprocess.Popen(spec.argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=spec.env)
        comp.state = "running"
        comp.started_at = self.clock()
        log.info("component started", component=spec.name, pid=comp.proc.pid, restarts=comp.restarts,
                 log=str(spec.log_path))

    def tick(self) -> None:
        """Notice exits, schedule and perform restarts. Raises :class:`CrashLoop`."""
        now = self.clock()
        for comp in self.components.values():
            if comp.state == "running" and comp.proc is not None and comp.proc.poll() is not None:
                self._exited(comp, now)
            if comp.state == "restarting" and now >= comp.restart_at:
                comp.restarts += 1
                self._spawn(comp)
                log.warning("component restarted", component=comp.spec.name, pid=comp.proc.pid,
                            restarts=comp.restarts)
                self.notify(f"{comp.spec.name} restarted (restart {comp.restarts}, pid {comp.proc.pid})")

    def _exited(self, comp: _Component, now: float) -> None:
        spec, code = comp.spec, comp.proc.returncode
        comp.last_exit = code
        if spec.done_on_success and code == 0:
            comp.state = "finished"
            log.info("component finished", component=spec.name)
            self.notify(f"{spec.name} finished")
            return
        ran_s = now - comp.started_at
        comp.exits.append(now)
        while comp.exits and now - comp.exits[0] > self.policy.crash_loop_window_s:
            comp.exits.popleft()
        if len(comp.exits) >= self.policy.crash_loop_exits:
            comp.state = "crashed"
            log.error("component crash loop; giving up", component=spec.name, exits=len(comp.exits),
                      window_s=self.policy.crash_loop_window_s, last_exit=code, log=str(spec.log_path))
            raise CrashLoop(spec.name, len(comp.exits), self.policy.crash_loop_window_s, spec.log_path, code)
        comp.consecutive = 1 if ran_s >= self.policy.backoff_reset_after_s else comp.consecutive + 1
        delay = self.policy.backoff(comp.consecutive)
        comp.state = "restarting"
        comp.restart_at = now + delay
        log.warning("component exited; restarting", component=spec.name, returncode=code, ran_s=round(ran_s, 3),
                    backoff_s=delay, restarts=comp.restarts, log=str(spec.log_path))
        self.notify(f"{spec.name} exited ({describe_exit(code)}) after {ran_s:.1f} s; "
                    f"restarting in {delay:g} s (see {spec.log_path})")

    def finished(self, name: str) -> bool:
        comp = self.components.get(name)
        return comp is not None and comp.state == "finished"

    def statuses(self) -> list[ComponentStatus]:
        return [
            ComponentStatus(name=c.spec.name, state=c.state, restarts=c.restarts,
                            pid=c.proc.pid if c.proc is not None and c.state in ("running", "stopping") else None,
                            last_exit=c.last_exit, log_path=str(c.spec.log_path))
            for c in self.components.values()
        ]

    def stop(self, grace_s: float, min_stage_s: float = 5.0) -> None:
        """SIGTERM the components stage by stage (waiting for each stage), SIGKILL what is
        left after the grace period. Restarts pending at this point are cancelled."""
        deadline = time.monotonic() + grace_s
        for stage in sorted({c.spec.stop_stage for c in self.components.values()}):
            comps = [c for c in self.components.values() if c.spec.stop_stage == stage]
            for comp in comps:
                if comp.state == "restarting":
                    comp.state = "stopped"
                elif comp.proc is not None and comp.proc.poll() is None:
                    comp.state = "stopping"
                    comp.proc.send_signal(signal.SIGTERM)
            # Every stage gets a little time even when an earlier one used up the grace.
            stage_deadline = max(deadline, time.monotonic() + min_stage_s)
            for comp in comps:
                if comp.proc is None or comp.state not in ("stopping", "running"):
                    continue
                try:
                    comp.proc.wait(timeout=max(stage_deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    log.warning("killing component after grace period", component=comp.spec.name)
                    comp.proc.kill()
                    comp.proc.wait()
                comp.last_exit = comp.proc.returncode
                comp.state = "stopped"
                log.info("component stopped", component=comp.spec.name, returncode=comp.proc.returncode)
        for comp in self.components.values():
            if comp.state == "running" and comp.proc is not None and comp.proc.poll() is not None:
                comp.state = "stopped"

    def kill_all(self) -> None:
        """Last resort (the supervisor itself fails): no child may outlive ``rollway up``."""
        for comp in self.components.values():
            if comp.proc is not None and comp.proc.poll() is None:
                try:
                    os.kill(comp.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
