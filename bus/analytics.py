"""Write your own consumer of any Rollway topic in a few lines.

Decorated function::

    from bus.analytics import consumer, run_consumers

    @consumer("rewards", group="my-dashboard")
    async def on_reward(reward, env):
        print(reward.task_id, reward.reward)

    run_consumers([on_reward])           # blocks; Ctrl-C / SIGTERM stop it cleanly

Or a class, when the consumer keeps state and reports at the end::

    class SolveRate(Analytics):
        topics = ["rewards"]
        group = "solve-rate"

        async def handle(self, event, env): ...
        async def on_stop(self): ...      # optional: flush, print, write a report

Either way Rollway decodes records into typed events, acks each record after your
handler returns (at-least-once: after a crash you may see a record again), retries a
failing handler and then dead-letters the record to ``rollway.dlq``, sends undecodable
records there too, and on SIGTERM lets the handler in flight finish, commits and leaves
the group.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Sequence

import structlog

from bus.config import KafkaConfig
from bus.consumer import Envelope, EventConsumer

log = structlog.get_logger(__name__)


class Analytics:
    """Base class of a user consumer. Override ``handle``; ``on_start``/``on_stop`` optional."""

    topics: Sequence[str] = ()
    group: str | None = None
    from_beginning: bool = True
    concurrency: int = 1

    async def on_start(self) -> None:  # pragma: no cover - default no-op
        pass

    async def handle(self, event: Any, env: Envelope) -> None:
        raise NotImplementedError

    async def on_stop(self) -> None:  # pragma: no cover - default no-op
        pass


class _FunctionConsumer(Analytics):
    def __init__(self, fn: Callable[[Any, Envelope], Awaitable[None]], topics: Sequence[str], group: str | None,
                 from_beginning: bool, concurrency: int) -> None:
        self.fn = fn
        self.topics = list(topics)
        self.group = group
        self.from_beginning = from_beginning
        self.concurrency = concurrency
        self.__name__ = getattr(fn, "__name__", "consumer")

    async def handle(self, event: Any, env: Envelope) -> None:
        await self.fn(event, env)


def consumer(
    *topics: str,
    group: str | None = None,
    from_beginning: bool = True,
    concurrency: int = 1,
) -> Callable[[Callable[[Any, Envelope], Awaitable[None]]], Analytics]:
    """Turn ``async def f(event, env)`` into a consumer of ``topics`` (short names)."""
    if not topics:
        raise ValueError("@consumer needs at least one topic, e.g. @consumer('rewards')")

    def wrap(fn: Callable[[Any, Envelope], Awaitable[None]]) -> Analytics:
        if not asyncio.iscoroutinefunction(fn):
            raise TypeError(f"@consumer needs an async function, {fn!r} is not")
        return _FunctionConsumer(fn, topics, group, from_beginning, concurrency)

    return wrap


class ConsumerApp:
    """Runs user consumers until ``stop()`` or a signal; one EventConsumer each."""

    def __init__(self, cfg: KafkaConfig, apps: Sequence[Analytics]) -> None:
        self.cfg = cfg
        self.apps = list(apps)
        self._consumers: list[EventConsumer] = []

    def stop(self) -> None:
        for c in self._consumers:
            c.stop()

    async def run(self, handle_signals: bool = True) -> None:
        for app in self.apps:
            if not app.topics:
                raise ValueError(f"{type(app).__name__} has no topics")
            self._consumers.append(EventConsumer(
                self.cfg, list(app.topics), app.group, from_beginning=app.from_beginning,
                client_id=f"{self.cfg.client_id}-{app.group or 'analytics'}",
            ))
        if handle_signals:
            import signal

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        try:
            for app, c in zip(self.apps, self._consumers):
                await c.start()
                await app.on_start()
            await asyncio.gather(*(
                c.run(lambda env, app=app: app.handle(env.event, env), concurrency=app.concurrency)
                for app, c in zip(self.apps, self._consumers)
            ))
        finally:
            for app, c in zip(self.apps, self._consumers):
                await c.close()
                await app.on_stop()


def run_consumers(apps: Sequence[Analytics], cfg: KafkaConfig | None = None) -> None:
    """Blocking entry point for a script: config from ``rollway.toml``/environment."""
    if cfg is None:
        from rollway.config import load_config

        cfg = load_config().kafka
    asyncio.run(ConsumerApp(cfg, apps).run())
