"""Publishing events: acks=all, idempotent, zstd, batched; ``publish`` returns once the
broker acknowledged the record.

With a ``transactional_id`` the producer is the single writer of that id: starting it
fences every older producer of the same id (the broker bumps the epoch), and a fenced
producer's open transaction is aborted, so read_committed consumers never see what it
wrote. Every write then goes through a transaction: ``async with producer.transaction()``
groups records (and consumed offsets, ``send_offsets``) into one atomic commit; a
``publish`` outside one runs in a transaction of its own. Transactions of one producer
run one at a time (another task's ``transaction()`` waits for the open one).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Mapping, Sequence

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    InvalidProducerEpoch, KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError, ProducerFenced,
    RequestTimedOutError,
)
from aiokafka.structs import OffsetAndMetadata

from bus import codec
from bus.clients import transaction_manager
from bus.config import KafkaConfig
from bus.connect import backoff_s, start_client, waiting_for_broker
from bus.security import client_security
from bus.topics import spec_for
from schemas import Event, RecordRef

log = structlog.get_logger(__name__)


class RecordTooLarge(ValueError):
    """The encoded record exceeds ``max_record_bytes``; split it (chunk) before publishing."""


# What a publish raises while the broker is away; a service waits it out (below).
BROKER_AWAY = (KafkaTimeoutError, KafkaConnectionError, NodeNotReadyError, RequestTimedOutError)


class WriterFenced(RuntimeError):
    """Another producer started with the same transactional id: this one may no longer
    write (its open transaction was aborted). A fenced process must stop."""


class EventProducer:
    """A Kafka producer of Rollway events. Use as ``async with EventProducer(cfg) as p``."""

    def __init__(
        self,
        cfg: KafkaConfig,
        *,
        client_id: str | None = None,
        transactional_id: str | None = None,
    ) -> None:
        self.cfg = cfg
        # Built at start(): an aiokafka client that is never started still warns
        # "Unclosed AIOKafkaProducer" when collected.
        self._client: AIOKafkaProducer | None = None
        self._client_kwargs = dict(
            bootstrap_servers=cfg.bootstrap_servers,
            client_id=client_id or cfg.client_id,
            acks="all",
            enable_idempotence=True,
            transactional_id=transactional_id,
            compression_type=cfg.compression or None,
            linger_ms=cfg.linger_ms,
            # Per-partition batches of up to 512 KiB: aiokafka's default (16 KiB) holds
            # one or two chunks, and aiokafka keeps one produce request in flight per
            # broker (at most one batch per partition in it), so small batches cap a
            # replica at a few hundred chunks/s (issue #29; docs/performance.md).
            # Under the broker's 1 MiB batch limit.
            max_batch_size=512 * 1024,
            # Leave room above the record limit for batch framing and headers.
            max_request_size=max(cfg.max_record_bytes + 64 * 1024, 1024 * 1024),
            request_timeout_ms=cfg.request_timeout_ms,
            **client_security(cfg),
        )
        self._started = False
        self._enqueue = asyncio.Lock()
        self.transactional_id = transactional_id
        self._txn_lock = asyncio.Lock()
        self._txn_owner: asyncio.Task | None = None
        self.fenced: WriterFenced | None = None

    @property
    def _producer(self) -> AIOKafkaProducer:
        if self._client is None:
            self._client = AIOKafkaProducer(**self._client_kwargs)
        return self._client

    @property
    def raw(self) -> AIOKafkaProducer:
        """The underlying aiokafka producer (transactions, flush)."""
        return self._producer

    async def start(self) -> None:
        if not self._started:
            # With a transactional id, start() is InitProducerId: the broker aborts any
            # open transaction of an older producer of this id and fences it.
            await start_client(self._producer, self.cfg.bootstrap_servers, "producer")
            self._started = True
            if self.transactional_id:
                log.info("transactional producer started", transactional_id=self.transactional_id,
                         epoch=self.epoch)

    @property
    def epoch(self) -> int:
        """The producer epoch the broker granted this transactional id (-1 without one).
        aiokafka has no public accessor: see :func:`bus.clients.transaction_manager`."""
        txn = transaction_manager(self._client) if self._client is not None else None
        return txn.producer_epoch if txn is not None and self.transactional_id else -1

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator["EventProducer"]:
        """One atomic transaction (re-entrant within a task). Raises ``WriterFenced``
        when a newer producer of the same transactional id exists."""
        if not self.transactional_id:
            raise RuntimeError("EventProducer.transaction() needs a transactional_id")
        task = asyncio.current_task()
        if self._txn_owner is task:
            yield self
            return
        async with self._txn_lock:
            self._check_fenced()
            self._txn_owner = task
            try:
                async with self._producer.transaction():
                    yield self
            except (ProducerFenced, InvalidProducerEpoch) as exc:
                raise self._fence(exc) from None
            except Exception:
                if transaction_manager(self._producer).is_fatal_error():
                    raise self._fence(None) from None
                raise
            finally:
                self._txn_owner = None

    def _check_fenced(self) -> None:
        if self.fenced is None and transaction_manager(self._producer).is_fatal_error():
            self._fence(None)
        if self.fenced is not None:
            self._retrieve_txn_error()
            raise self.fenced

    def _fence(self, exc: BaseException | None) -> WriterFenced:
        if self.fenced is None:
            self.fenced = WriterFenced(
                f"fenced: another producer started with transactional id {self.transactional_id!r} "
                f"(this one had epoch {self.epoch}); nothing of this process's open transaction is committed"
                + (f" ({type(exc).__name__})" if exc is not None else "")
            )
            log.error("producer fenced", transactional_id=self.transactional_id, epoch=self.epoch)
        self._retrieve_txn_error()
        return self.fenced

    def _retrieve_txn_error(self) -> None:
        # aiokafka fails its transaction waiter future on a fatal error (again for each
        # later failure) and nobody awaits it: retrieve it, or asyncio logs "Future
        # exception was never retrieved" for an error already reported as WriterFenced.
        waiter = transaction_manager(self._producer).wait_for_transaction_end()
        if waiter is not None and waiter.done() and not waiter.cancelled():
            waiter.exception()

    async def send_offsets(self, offsets: Mapping[TopicPartition, int | OffsetAndMetadata], group_id: str) -> None:
        """Commit consumed ``offsets`` of ``group_id`` in the current transaction (or one
        of their own): they become visible exactly when the records written with them do."""
        async with self.transaction():
            try:
                await self._producer.send_offsets_to_transaction(
                    {tp: om if isinstance(om, OffsetAndMetadata) else OffsetAndMetadata(om, "")
                     for tp, om in offsets.items()}, group_id)
            except (ProducerFenced, InvalidProducerEpoch) as exc:
                raise self._fence(exc) from None

    async def stop(self) -> None:
        if self._started:
            self._started = False
            await self._producer.stop()
            if self.fenced is not None:
                self._retrieve_txn_error()

    async def __aenter__(self) -> "EventProducer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def topic_for(self, event: Event) -> str:
        return spec_for(event).name(self.cfg.topic_prefix)

    async def publish(
        self,
        event: Event,
        *,
        topic: str | None = None,
        key: str | bytes | None = None,
    ) -> RecordRef:
        """Encode, check size, send and wait for the broker's acknowledgement."""
        value, headers = codec.encode(event)
        if key is None:
            key = spec_for(event).key_bytes(event)
        elif isinstance(key, str):
            key = key.encode()
        return await self.publish_raw(topic or self.topic_for(event), value, key=key, headers=headers)

    async def publish_raw(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
        partition: int | None = None,
    ) -> RecordRef:
        size = len(value or b"") + len(key or b"") + sum(len(k) + len(v) for k, v in headers)
        if size > self.cfg.max_record_bytes:
            raise RecordTooLarge(
                f"record for {topic} is {size} bytes, over max_record_bytes={self.cfg.max_record_bytes}; "
                "split it into smaller events"
            )
        if not self._started:
            raise RuntimeError("EventProducer.publish before start()")
        if self.transactional_id:
            if self._txn_owner is not asyncio.current_task():
                async with self.transaction():
                    return await self._send(topic, value, key, headers, partition)
            # In a caller's transaction: a failure breaks the transaction, so the caller
            # (the trainer) retries the whole of it.
            return await self._send(topic, value, key, headers, partition)
        attempt = 0
        while True:
            try:
                return await self._send(topic, value, key, headers, partition)
            except BROKER_AWAY as exc:
                # A service waits for a lost broker instead of crashing. The record may
                # have been written before the error (at-least-once: a duplicate).
                if not waiting_for_broker():
                    raise
                attempt += 1
                delay = backoff_s(attempt)
                log.warning(f"cannot reach Kafka at {self.cfg.bootstrap_servers}; publish to {topic} retried in "
                            f"{delay:g} s", error=type(exc).__name__, attempt=attempt)
                await asyncio.sleep(delay)

    async def _send(self, topic: str, value: bytes | None, key: bytes | None,
                    headers: Sequence[tuple[str, bytes]], partition: int | None) -> RecordRef:
        # Enqueue one caller at a time, then wait for the ack outside the lock: with many
        # concurrent publishers, aiokafka's full-buffer wait otherwise wakes every
        # waiter on each drain (a thundering herd that halved throughput).
        async with self._enqueue:
            delivery = await self._producer.send(
                topic, value=value, key=key, headers=list(headers), partition=partition
            )
        try:
            meta = await delivery
        except (ProducerFenced, InvalidProducerEpoch) as exc:
            if self.transactional_id:
                raise self._fence(exc) from None
            raise
        return RecordRef(meta.topic, meta.partition, meta.offset)

    async def publish_many(self, events: Sequence[Event]) -> list[RecordRef]:
        """Publish in order, let the producer batch them, return once all are acked."""
        return list(await asyncio.gather(*(self.publish(e) for e in events)))
