"""The running phase of ``rollway up``: follow the log into the view's state, tick the
supervisor, refresh the display, and decide when to stop.

One asyncio loop, no threads: reading the log waits at most ``POLL_MS`` at a time, the
supervisor's tick never blocks, and the display is redrawn every ``up.refresh_s`` (the
terminal view) or printed every ``up.status_every_s`` (line output).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import TextIO

import structlog

from rollway.live_state import LiveState, ViewModel
from rollway.live_view import render, status_line
from rollway.supervisor import CrashLoop, Supervisor

log = structlog.get_logger(__name__)

POLL_MS = 200
VIEW_TOPICS = ("metrics", "health", "rewards", "evals", "dlq")


class Paced:
    """Shown every ``every_s`` seconds, the first time at once."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.next_at = 0.0

    def due(self, now: float) -> bool:
        if now < self.next_at:
            return False
        self.next_at = now + self.every_s
        return True


class LineDisplay(Paced):
    """``--no-tui``: notices as they happen, a status line every ``every_s`` seconds."""

    def __init__(self, every_s: float, out: TextIO = sys.stdout) -> None:
        super().__init__(every_s)
        self.out = out

    def __enter__(self) -> "LineDisplay":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def notice(self, line: str) -> None:
        print(f"rollway up: {line}", file=self.out, flush=True)

    def show(self, model: ViewModel) -> None:
        print(status_line(model), file=self.out, flush=True)


class TuiDisplay(Paced):
    """The terminal view: one ``rich`` Live table, redrawn every ``every_s`` seconds."""

    def __init__(self, every_s: float) -> None:
        from rich.live import Live

        super().__init__(every_s)
        # auto_refresh off: we redraw on our own clock, so rich starts no thread.
        self.live = Live(auto_refresh=False, redirect_stdout=True, redirect_stderr=False)

    def __enter__(self) -> "TuiDisplay":
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(*exc)

    def notice(self, line: str) -> None:
        pass  # shown in the view's notices

    def show(self, model: ViewModel) -> None:
        self.live.update(render(model), refresh=True)


class UpLoop:
    def __init__(self, cfg, upcfg, sup: Supervisor, *, tui: bool, steps: int | None, minutes: float | None) -> None:
        self.cfg, self.upcfg, self.sup = cfg, upcfg, sup
        self.steps, self.minutes = steps, minutes
        self.state = LiveState(trainer_source=cfg.trainer.metrics_source, window=upcfg.solve_window)
        self.display = TuiDisplay(upcfg.refresh_s) if tui else LineDisplay(upcfg.status_every_s)
        self.started = time.monotonic()
        self._stop_reason: str | None = None
        sup.notify = self._notice

    def _notice(self, line: str) -> None:
        self.state.note(line)
        self.display.notice(line)

    def request_stop(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason

    def model(self) -> ViewModel:
        return self.state.model(now=time.time(), elapsed_s=time.monotonic() - self.started,
                                components=self.sup.statuses())

    def summary(self) -> str:
        m = self.model()
        return (f"train step {'-' if m.train_step is None else m.train_step}, "
                f"restarts {sum(c.restarts for c in m.components)}, "
                f"{m.rewards_seen} rewards, {m.dead_letters} dead letters")

    def _due_stop(self) -> str | None:
        if self.steps is not None:
            step = self.state.train_step
            if self.sup.finished("trainer") or (step is not None and step >= self.steps):
                return f"--steps {self.steps} reached"
        if self.minutes is not None and time.monotonic() - self.started >= self.minutes * 60:
            return f"--minutes {self.minutes:g} elapsed"
        return None

    async def run(self) -> tuple[int, str]:
        """Until stopped: (exit code, reason)."""
        from rollway.log_follow import LogFollower

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM received")
        loop.add_signal_handler(signal.SIGINT, self.request_stop, "interrupted")
        code = 0
        async with LogFollower(self.cfg.kafka, VIEW_TOPICS, role="up-view") as follower:
            self.sup.start_all()
            with self.display:
                while self._stop_reason is None:
                    for env in await follower.poll(timeout_ms=POLL_MS):
                        self.state.apply(env.event)
                    self.state.undecodable = follower.undecodable
                    try:
                        self.sup.tick()
                    except CrashLoop as exc:
                        log.error("giving up", error=str(exc))
                        self.request_stop(str(exc))
                        code = 1
                    due = self._due_stop()
                    if due is not None:
                        self.request_stop(due)
                    # The model is built only when shown (every refresh, and once at the end).
                    if self.display.due(time.monotonic()) or self._stop_reason is not None:
                        self.display.show(self.model())
        return code, self._stop_reason or "stopped"
