"""Test your consumers without a broker.

:class:`ConsumerHarness` feeds events to consumers through the same dispatch as
``run_consumers`` (type selection by annotation, batches, the error policy), with
envelopes numbered per partition and a record-time clock you control::

    async def test_mean_reward():
        async with ConsumerHarness(on_reward) as h:
            await h.send(Reward(...), timestamp_ms=1_000)
        assert ...  # after on_stop ran

A handler's bug raises :class:`bus.policy.ConsumerFailed` out of ``send`` (as it would
stop the real consumer); retries do not wait (the delays are kept in ``backoffs``);
records the policy would dead-letter are kept in ``dead_letters``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from bus import codec
from bus.consumer import Envelope
from bus.handler import Analytics
from bus.policy import ConsumerStats, Dispatcher
from bus.topics import spec_for, topic_spec
from schemas import Event

PREFIX = "rollway."


class _MemorySink:
    def __init__(self, harness: "ConsumerHarness", app: Analytics) -> None:
        self.harness = harness
        self.app = app

    async def ack(self, envs: list[Envelope]) -> None:
        self.harness.acked[self.app.name].extend(envs)

    async def dead_letter(self, env: Envelope, error: str, kind: str, attempts: int) -> None:
        self.harness.dead_letters.append((env, error, kind))


class ConsumerHarness:
    def __init__(self, *apps: Analytics, start_ms: int = 1_700_000_000_000) -> None:
        self.apps = list(apps)
        self.now_ms = start_ms  # record time of the next event sent without timestamp_ms
        self.acked: dict[str, list[Envelope]] = defaultdict(list)
        self.dead_letters: list[tuple[Envelope, str, str]] = []
        self.backoffs: list[float] = []
        self._offsets: dict[tuple[str, int], int] = defaultdict(int)
        self._dispatchers = [Dispatcher(app, _MemorySink(self, app), sleep=self._no_wait) for app in self.apps]
        self._topics = [{_full(t) for t in app.topics} for app in self.apps]
        self._started = False

    async def _no_wait(self, seconds: float) -> None:
        self.backoffs.append(seconds)

    def stats(self, app: Analytics) -> ConsumerStats:
        return self._dispatchers[self.apps.index(app)].stats

    async def start(self) -> None:
        if not self._started:
            self._started = True
            for app in self.apps:
                await app.run_hook("on_start")

    async def send(self, event: Event, *, topic: str | None = None, key: str | bytes | None = None,
                   partition: int = 0, timestamp_ms: int | None = None) -> Envelope:
        """Deliver ``event`` (on its registry topic unless ``topic`` says otherwise)."""
        await self.start()
        spec = topic_spec(topic) if topic is not None else spec_for(event)
        name = spec.name(PREFIX)
        if timestamp_ms is None:
            timestamp_ms, self.now_ms = self.now_ms, self.now_ms + 1
        key_bytes = key.encode() if isinstance(key, str) else key if key is not None else spec_for(event).key_bytes(event)
        _, headers = codec.encode(event)
        offset = self._offsets[(name, partition)]
        self._offsets[(name, partition)] += 1
        env = Envelope(event, name, partition, offset, timestamp_ms, key_bytes, tuple(headers))
        for dispatcher, topics in zip(self._dispatchers, self._topics):
            if name in topics:
                await dispatcher.feed([env])
        return env

    async def send_undecodable(self, topic: str, partition: int = 0) -> None:
        """A record that does not decode: consumers skip it and count it (never dead-letter it)."""
        await self.start()
        name = _full(topic)
        self._offsets[(name, partition)] += 1
        for dispatcher, topics in zip(self._dispatchers, self._topics):
            if name in topics:
                dispatcher.stats.undecodable += 1

    async def catch_up(self) -> None:
        """As when the real consumer reaches the end offsets it saw at start."""
        await self.start()
        for dispatcher, app in zip(self._dispatchers, self.apps):
            await dispatcher.flush()
            await app.run_hook("on_caught_up")

    async def stop(self) -> None:
        for dispatcher, app in zip(self._dispatchers, self.apps):
            await dispatcher.flush()
            await app.run_hook("on_stop")

    async def __aenter__(self) -> "ConsumerHarness":
        await self.start()
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            await self.stop()


def _full(topic: str) -> str:
    return topic if topic.startswith(PREFIX) else topic_spec(topic).name(PREFIX)
