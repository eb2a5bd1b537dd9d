"""Write your own consumer of any Rollway topic in a few lines.

A typed function; the annotation picks (and the bus decodes) the event type::

    from bus.analytics import consumer
    from rollway.consumers import run_consumers
    from schemas import Reward

    @consumer("rewards")
    async def on_reward(reward: Reward, env):
        print(reward.task_id, reward.reward)

    if __name__ == "__main__":
        run_consumers([on_reward])   # blocks; Ctrl-C / SIGTERM stop it; --until-end: one shot

``on_reward`` stays a plain async function for tests; :class:`bus.testing.ConsumerHarness`
feeds it events without a broker. A class (:class:`Analytics`) suits a consumer with
state and hooks. Errors follow the consumer's :class:`ErrorPolicy` (:mod:`bus.policy`),
windows by record time are in :mod:`bus.windows`. ``run_consumers`` (in the CLI package,
:mod:`rollway.consumers`: it reads the configuration) runs them in a script and logs JSON
lines to stderr, so stdout is the consumer's own; :class:`ConsumerApp` is what it runs.

Without a ``group`` a consumer reads its topics from the beginning on every start: state
in memory is rebuilt from the log, then the consumer goes live (``on_caught_up`` marks the
moment). With a ``group`` it commits after each handled record and resumes there.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import structlog
from aiokafka import TopicPartition

from bus.config import KafkaConfig
from bus.consumer import Envelope, EventConsumer, InvalidEvent
from bus.handler import Analytics, ConsumerError, FunctionConsumer, consumer, validate
from bus.policy import ConsumerFailed, ConsumerStats, Dispatcher, ErrorPolicy, Retryable
from bus.reader import caught_up, end_offsets

__all__ = [
    "Analytics", "ConsumerApp", "ConsumerError", "ConsumerFailed", "ConsumerStats", "Envelope", "ErrorPolicy",
    "FunctionConsumer", "InvalidEvent", "Retryable", "consumer",
]

log = structlog.get_logger(__name__)


class _KafkaSink:
    """Outcomes onto Kafka: acks (committed once per fetched batch) and dead letters."""

    def __init__(self, events: EventConsumer) -> None:
        self.events = events

    async def ack(self, envs: list[Envelope]) -> None:
        for env in envs:
            await self.events.ack(env, commit=False)

    async def dead_letter(self, env: Envelope, error: str, kind: str, attempts: int) -> None:
        await self.events.dead_letter(env, error, kind, attempts)


class _CatchUp:
    """Whether a consumer has handled everything its partitions held when it got them."""

    def __init__(self, events: EventConsumer) -> None:
        self.events = events
        self.ends: dict[TopicPartition, int] = {}

    async def done(self) -> bool:
        raw = self.events.raw
        assigned = raw.assignment()
        if not assigned:
            return False  # not joined yet
        new = [tp for tp in assigned if tp not in self.ends]
        if new:
            self.ends.update(await end_offsets(raw, new))
        return await caught_up(raw, {tp: self.ends[tp] for tp in assigned})


class ConsumerApp:
    """Runs user consumers until ``stop()``, a signal, a handler error, or with
    ``until_end`` until each has handled what its topics held at start."""

    def __init__(self, cfg: KafkaConfig, apps: Sequence[Analytics], until_end: bool = False) -> None:
        self.cfg = cfg
        self.apps = list(apps)
        self.until_end = until_end
        self.stats: dict[str, ConsumerStats] = {}
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self, handle_signals: bool = True) -> None:
        """Raises :class:`ConsumerFailed` when a handler error stopped a consumer."""
        for app in self.apps:
            validate(app)
        if handle_signals:
            import signal

            from bus.connect import add_stop_handler

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                add_stop_handler(loop, sig, self.stop)
        tasks = [asyncio.create_task(self._run_one(app), name=app.name) for app in self.apps]
        try:
            # The first failure stops the others: a bug fails the process fast and loud.
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            self.stop()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            self.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _run_one(self, app: Analytics) -> None:
        events = EventConsumer(
            self.cfg, list(app.topics), app.group, from_beginning=app.from_beginning,
            dead_letters=app.policy.dead_letter, dead_letter_undecodable=False, client_id=f"{self.cfg.client_id}-{app.group or app.name}",
        )
        dispatcher = Dispatcher(app, _KafkaSink(events))
        self.stats[app.name] = dispatcher.stats
        catch_up, caught_up = _CatchUp(events), False
        log.info("consumer starting", consumer=app.name, topics=list(app.topics), group=app.group)
        await events.start()
        try:
            await app.run_hook("on_start")
            while not self._stop.is_set():
                envs = await events.getmany(timeout_ms=200, max_records=app.batch_size or 500)
                await dispatcher.feed(envs)
                await dispatcher.tick()
                await events.commit()
                if not caught_up and await catch_up.done():
                    caught_up = True
                    await dispatcher.flush()
                    await events.commit()
                    log.info("consumer caught up", consumer=app.name, **_counts(dispatcher, events))
                    await app.run_hook("on_caught_up")
                    if self.until_end:
                        break
            await dispatcher.flush()  # a partial batch fetched before the stop
        finally:
            dispatcher.stats.undecodable = events.undecodable
            try:
                await events.close()  # commits the handled prefix only: never past a failed record
            finally:
                log.info("consumer stopped", consumer=app.name, **_counts(dispatcher, events))
                await app.run_hook("on_stop")


def _counts(dispatcher: Dispatcher, events: EventConsumer) -> dict[str, int]:
    dispatcher.stats.undecodable = events.undecodable
    return {f: getattr(dispatcher.stats, f) for f in dispatcher.stats.__struct_fields__}
