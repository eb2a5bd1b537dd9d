"""What a user consumer does when its handler raises: the error policy, and the one
dispatch loop shared by the Kafka runner (:mod:`bus.analytics`) and the in-memory
harness (:mod:`bus.testing`).

* A **programming error** (any exception not marked transient) stops the consumer with
  :class:`ConsumerFailed`, naming the consumer, the record and the error. The record is
  not acked, so the group never commits past it: fix the bug, restart, it is handled.
* A **transient error** (:class:`Retryable`, ``TimeoutError``, ``ConnectionError``) is
  retried with exponential back-off, ``max_attempts`` tries in all.
* :class:`bus.consumer.InvalidEvent` says "this record can never be handled".
* **Dead-lettering is opt-in** (``dead_letter=True``): then an invalid record, or one
  whose transient errors outlast the retries, goes to ``rollway.dlq`` and the consumer
  goes on. Without it, an invalid record is skipped (counted, logged) and exhausted
  retries stop the consumer.
* **Undecodable records** are skipped and counted, never dead-lettered, even with
  ``dead_letter=True``: the component that owns the topic has already dead-lettered them.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

import msgspec
import structlog

from bus.consumer import Envelope, InvalidEvent

if TYPE_CHECKING:
    from bus.handler import Analytics

log = structlog.get_logger(__name__)


class Retryable(Exception):
    """Raise (``raise Retryable("db busy") from exc``) for a transient failure: retried."""


class ConsumerFailed(RuntimeError):
    """A consumer stopped on an error its policy does not absorb; ``__cause__`` is it."""


class ErrorPolicy(msgspec.Struct, frozen=True, kw_only=True):
    max_attempts: int = 5  # tries of a transiently failing handler, the first included
    backoff_s: float = 0.5  # delay before the first retry; doubles after each
    max_backoff_s: float = 30.0
    dead_letter: bool = False  # opt in: poison records go to rollway.dlq, the consumer goes on
    transient: tuple[type[BaseException], ...] = (Retryable, TimeoutError, ConnectionError)

    def delay(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


class ConsumerStats(msgspec.Struct, kw_only=True):
    handled: int = 0  # records whose handler returned
    ignored: int = 0  # records of event types the handler does not take
    undecodable: int = 0  # skipped: garbage, unknown type or newer schema
    invalid: int = 0  # InvalidEvent without dead-lettering: skipped
    dead_lettered: int = 0
    retries: int = 0


class Sink(Protocol):
    """Where a dispatcher reports outcomes: Kafka (ack/commit, DLQ) or the test harness."""

    async def ack(self, envs: list[Envelope]) -> None: ...

    async def dead_letter(self, env: Envelope, error: str, kind: str, attempts: int) -> None: ...


class Dispatcher:
    """Feeds envelopes to one consumer's handler under its policy; batches if asked."""

    def __init__(self, app: "Analytics", sink: Sink, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        from bus.handler import validate

        self.app = app
        self.accepted = validate(app)
        self.sink = sink
        self.sleep = sleep
        self.stats = ConsumerStats()
        self._batch: list[Envelope] = []
        self._batch_since = 0.0

    async def feed(self, envs: list[Envelope]) -> None:
        for env in envs:
            if not isinstance(env.event, self.accepted):
                self.stats.ignored += 1
                await self.sink.ack([env])
            elif self.app.batch_size is None:
                await self._handle([env])
            else:
                if not self._batch:
                    self._batch_since = time.monotonic()
                self._batch.append(env)
                if len(self._batch) >= self.app.batch_size:
                    await self.flush()

    async def tick(self) -> None:
        """Handle a partial batch that has waited ``batch_wait_s``."""
        if self._batch and time.monotonic() - self._batch_since >= self.app.batch_wait_s:
            await self.flush()

    async def flush(self) -> None:
        batch, self._batch = self._batch, []
        if batch:
            await self._handle(batch)

    async def _handle(self, envs: list[Envelope]) -> None:
        policy = self.app.policy
        events = [env.event for env in envs] if self.app.batch_size is not None else envs[0].event
        arg_envs = envs if self.app.batch_size is not None else envs[0]
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.app.call(events, arg_envs)
            except asyncio.CancelledError:
                raise
            except InvalidEvent as exc:
                await self._poison(envs, f"invalid: {exc}", "invalid", attempt)
                return
            except policy.transient as exc:
                if attempt >= policy.max_attempts:
                    if policy.dead_letter:
                        await self._poison(envs, f"failed {attempt} times: {exc!r}", "handler", attempt)
                        return
                    raise self._failed(envs, exc, f"still failing after {attempt} attempts") from exc
                self.stats.retries += 1
                log.warning("handler failed, retrying", consumer=self.app.name, record=_where(envs[0]),
                            attempt=attempt, error=repr(exc))
                await self.sleep(policy.delay(attempt))
                continue
            except Exception as exc:
                raise self._failed(envs, exc, "a bug in the handler? (not retried: raise bus.policy.Retryable "
                                              "for transient errors)") from exc
            self.stats.handled += len(envs)
            await self.sink.ack(envs)
            return

    async def _poison(self, envs: list[Envelope], error: str, kind: str, attempts: int) -> None:
        if self.app.policy.dead_letter:
            for env in envs:
                await self.sink.dead_letter(env, error, kind, attempts)
            self.stats.dead_lettered += len(envs)
            log.warning("dead-lettered", consumer=self.app.name, record=_where(envs[0]), count=len(envs),
                        error=error)
            return
        self.stats.invalid += len(envs)
        log.warning("skipped invalid record", consumer=self.app.name, record=_where(envs[0]), count=len(envs),
                    error=error)
        await self.sink.ack(envs)

    def _failed(self, envs: list[Envelope], exc: BaseException, why: str) -> ConsumerFailed:
        return ConsumerFailed(
            f"consumer {self.app.name} stopped at {_where(envs[0])} ({type(envs[0].event).__name__}): "
            f"{type(exc).__name__}: {exc} - {why}; nothing from this record on was committed"
        )


def _where(env: Envelope) -> str:
    return f"{env.topic}:{env.partition}@{env.offset}"
