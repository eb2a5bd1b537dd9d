"""Where new weights go: a small interface, the syncer behind it, a stand-in for tests.

The trainer only needs ``await sink.publish(version, state_dict, trainer_step)`` with
HF parameter names and CPU tensors (docs/contracts.md). Publishing runs as a background
task, so training overlaps the upload; versions are published strictly in order.

Publishing is bound to the trainer's transactional producer: the ``WeightVersion``
announcement is written in a transaction of the trainer's id (a fenced trainer cannot
announce), and each publish attempt's objects live under a folder naming the producer
epoch. A ``WeightConflict`` (the store holds other weights for a version, or a newer
version: another trainer is writing) or a fence is fatal: ``BackgroundPublisher.check``
raises it and the trainer stops. Other failures (store briefly down) are logged; the
next publish retries.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import structlog

if TYPE_CHECKING:
    import torch

    from bus import EventProducer
    from syncer.config import SyncerConfig

log = structlog.get_logger(__name__)


class WeightSink(Protocol):
    async def publish(self, version: int, state_dict: dict[str, "torch.Tensor"], trainer_step: int) -> None: ...

    async def close(self) -> None: ...


class RecordingSink:
    """Keeps (version, trainer_step, weights hash) of every publish; for tests and dry runs.
    The hash is the one the syncer would announce (``WeightVersion.weights_hash``)."""

    def __init__(self) -> None:
        self.published: list[tuple[int, int, str]] = []

    async def publish(self, version: int, state_dict: dict[str, "torch.Tensor"], trainer_step: int) -> None:
        from syncer.hashing import state_dict_hash

        self.published.append((version, trainer_step, state_dict_hash(state_dict)))

    async def close(self) -> None:
        pass


class SyncerSink:
    """The real thing: ``syncer.publisher.WeightPublisher`` over the configured store."""

    def __init__(self, cfg: "SyncerConfig", model_name: str, producer: "EventProducer | None") -> None:
        from syncer.publisher import WeightPublisher
        from syncer.store import open_store

        self._store = open_store(cfg.store_url, cfg)
        writer = f"e{producer.epoch}" if producer is not None and producer.epoch >= 0 else ""
        self._publisher = WeightPublisher(cfg, model_name, self._store, producer, writer=writer)
        self._started = False

    async def publish(self, version: int, state_dict: dict[str, "torch.Tensor"], trainer_step: int) -> None:
        if not self._started:
            await self._store.start()
            self._started = True
        # The tensors are fresh copies made for this publish: hand them over.
        await self._publisher.publish(version, state_dict, trainer_step, owned=True)

    async def close(self) -> None:
        self._publisher.close()
        if self._started:
            await self._store.close()


def is_fatal_publish_error(exc: BaseException) -> bool:
    """Errors that mean this trainer is not the only writer: retrying cannot help."""
    from bus import WriterFenced
    from syncer.publisher import WeightConflict

    return isinstance(exc, (WeightConflict, WriterFenced))


class BackgroundPublisher:
    """Runs one publish at a time in the background; the next waits for the previous.
    A fatal failure (see ``is_fatal_publish_error``) is kept and raised by ``check``,
    ``submit`` and ``wait``."""

    def __init__(self, sink: WeightSink) -> None:
        self.sink = sink
        self._task: asyncio.Task | None = None
        self.last_version = -1
        self.failures = 0
        self.fatal: BaseException | None = None

    def check(self) -> None:
        if self.fatal is not None:
            raise self.fatal

    async def submit(self, version: int, state_dict: dict[str, "torch.Tensor"], trainer_step: int) -> None:
        await self.wait()
        self._task = asyncio.create_task(self._run(version, state_dict, trainer_step))

    async def _run(self, version: int, state_dict, trainer_step: int) -> None:
        try:
            await self.sink.publish(version, state_dict, trainer_step)
            self.last_version = version
            log.info("weights published", version=version, trainer_step=trainer_step)
        except Exception as exc:
            self.failures += 1
            if is_fatal_publish_error(exc):
                self.fatal = exc
                log.error("weight publish failed: another trainer is writing; stopping", version=version,
                          error=str(exc))
            else:  # samplers keep the older version; the next publish retries
                log.error("weight publish failed", version=version, error=str(exc))

    async def wait(self) -> None:
        if self._task is not None:
            await self._task
            self._task = None
        self.check()

    async def close(self) -> None:
        try:
            await self.wait()
        finally:
            await self.sink.close()
