"""Consuming events: typed envelopes, at-least-once acks, dead letters, graceful stop.

* Records are decoded into events; a record that cannot be decoded (garbage bytes, an
  unknown event type, a newer schema) is published to the DLQ with its origin and
  skipped, so one bad record never stops a consumer.
* ``ack(env)`` marks a record done. Offsets are committed per partition up to the
  highest *contiguous* done offset, so a consumer with many records in flight (a sampler
  running several rollouts) never commits past unfinished work.
* ``run(handler)`` is the managed loop: ack after the handler succeeds, retry a failing
  handler with back-off over ``cfg.handler_retry.window_s``, dead-letter a record whose
  handler keeps failing, stop on SIGTERM after the in-flight handlers finish (a record
  waiting out a back-off is left unacked for the next owner), commit, and leave the group.
* A rebalance (``run``; aiokafka's eager protocol revokes every partition, also those
  that come straight back): from the revoke on, no record of a revoked partition is
  started; its handlers in flight get ``revoke_grace_s`` to finish (acked and committed
  here), then the contiguous done offset is committed (with ``commit_done_offsets``, the
  records done past it named in the metadata) and the handlers still running are left
  running. At the new assignment a partition that came back (the very next generation)
  keeps its handlers and progress: re-reading it from the commit starts no second copy
  of a record in flight here and skips those done here; acks made in between are
  committed then. Handlers of a partition that moved are cancelled then, unacked: the
  new owner runs them from the commit, so both may run a record for the seconds between
  the new owner's start and this cancel, and a record finished here in between (acked
  but not committable) is run again there. A member whose generation was lost (session
  or poll timeout) cancels at the revoke, as the partitions may already be another's.
  ``sticky_assignment`` (aiokafka's sticky assignor) makes a join or leave move only the
  partitions it must, so most handlers survive a rebalance.
* A dead letter that cannot be published is retried with back-off until it is (one too
  big for a record goes without the original value): the record is acked only after its
  letter is in the DLQ, so a failed publish neither loses it nor leaves it unacked,
  holding back the partition's commits, while the consumer goes on.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Awaitable, Callable, Sequence

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyPartitionAssignor
from aiokafka.structs import OffsetAndMetadata

from bus import codec
from bus.clients import decompress_fetches_ahead, fetch_committed, group_generation, new_consumer
from bus.config import KafkaConfig
from bus.connect import add_stop_handler, start_client, stop_consumer
from bus.prefetch import BatchPrefetcher
from bus.producer import EventProducer, RecordTooLarge
from bus.topics import topic_spec
from schemas import DeadLetter, Event, RecordRef, now

log = structlog.get_logger(__name__)

# Characters of the error kept in a dead letter that had to leave out the original value.
_LETTER_ERROR_CHARS = 4_000


class InvalidEvent(ValueError):
    """Raised by a handler for an event that decodes but can never be handled (e.g.
    inconsistent arrays). The record is dead-lettered at once, without retries."""


class Envelope(msgspec.Struct, frozen=True, gc=False):
    """A decoded record and where it came from. (A frozen Struct: one is built for every
    record read, several times cheaper than a frozen dataclass; it holds no cycles.)"""

    event: Event
    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    headers: tuple[tuple[str, bytes], ...]

    @property
    def ref(self) -> RecordRef:
        return RecordRef(self.topic, self.partition, self.offset)


def envelope_of(record) -> Envelope:
    """Decode an aiokafka ``ConsumerRecord``; raises ``codec.DecodeFailure``."""
    headers = tuple(record.headers or ())
    event = codec.decode(record.value, headers)
    return Envelope(event, record.topic, record.partition, record.offset, record.timestamp, record.key, headers)


class _PartitionProgress:
    """A partition's ownership by this member: offsets delivered but not yet acked, the
    next offset to commit, the ``run`` handlers in flight, and offsets a previous owner
    finished past its commit (skipped). A new object when the partition comes from
    another member (a handler of an earlier ownership never acks into it); the same one,
    ``generation`` bumped, when ``run``'s partition comes back at a rebalance."""

    __slots__ = ("pending", "next_offset", "committed", "committed_metadata", "handlers", "revoked", "skip",
                 "held", "generation", "reread_below", "redeliver")

    def __init__(self) -> None:
        self.pending: set[int] = set()
        self.next_offset: int | None = None  # one past the last delivered record
        self.committed: int | None = None
        self.committed_metadata = ""
        self.handlers: dict[asyncio.Task, int] = {}  # run's handlers in flight -> their offsets
        self.revoked = False  # set at the start of the revoke: start nothing more of it
        self.skip: set[int] = set()
        # After the revoke's commit, until the new assignment: no commits (the member is
        # between generations); acks only mark records done.
        self.held = False
        self.generation = 0  # bumped when the partition comes back: records delivered before are not started
        # Came back: offsets below this were delivered before the rebalance; re-read from
        # the commit, only those in ``redeliver`` (delivered, never started) go out again.
        self.reread_below: int | None = None
        self.redeliver: set[int] = set()

    def delivered(self, offset: int) -> None:
        self.pending.add(offset)
        self.passed(offset)

    def passed(self, offset: int) -> None:
        """The partition was read past ``offset`` (a re-read after coming back reads lower ones again)."""
        self.next_offset = offset + 1 if self.next_offset is None else max(self.next_offset, offset + 1)

    def came_back(self) -> None:
        """The partition is this member's again: its handlers and acks carry on, and the
        re-read from the commit delivers only the records fetched but never started."""
        self.revoked = self.held = False
        self.generation += 1
        self.reread_below = self.next_offset
        self.redeliver = self.pending - set(self.handlers.values())

    def accept(self, offset: int) -> bool:
        """Whether a record read at ``offset`` is to be delivered: False for one of a
        partition that came back which is in flight or done here (read again because
        aiokafka seeks a new assignment to its commit)."""
        if self.reread_below is None:
            return True
        if offset >= self.reread_below:
            self.reread_below = None
            self.redeliver.clear()
            return True
        if offset in self.redeliver:
            self.redeliver.discard(offset)  # still pending: delivered once more, then started
            return True
        return False

    def committable(self) -> int | None:
        if self.pending:
            return min(self.pending)
        return self.next_offset

    def done_above(self, commit: int) -> list[int]:
        """Offsets past ``commit`` that were delivered and are done (acked, or skipped as
        a previous owner's): every offset up to ``next_offset`` was delivered in order,
        except control records, which no owner ever gets."""
        if self.next_offset is None or commit + 1 >= self.next_offset:
            return []
        return [o for o in range(commit + 1, self.next_offset) if o not in self.pending]


# How long a revoke waits for the handlers it cancelled to end.
_CANCEL_WAIT_S = 5.0

# Commit metadata naming the offsets done past the committed one (a record acked while
# an older one of its partition was still in flight): the partition's next owner skips
# them instead of handling them again. Kafka keeps up to 4,096 bytes of metadata
# (offset.metadata.max.bytes); past this many characters the higher ranges are left
# out, and those records are handled again (at-least-once, as without the metadata).
DONE_PREFIX = "done:"
_DONE_MAX_CHARS = 2_000


def done_metadata(offsets: list[int]) -> str:
    """``done:5,7-9`` for [5, 7, 8, 9] (sorted); "" for none."""
    ranges: list[str] = []
    i = 0
    size = len(DONE_PREFIX)
    while i < len(offsets):
        j = i
        while j + 1 < len(offsets) and offsets[j + 1] == offsets[j] + 1:
            j += 1
        part = str(offsets[i]) if i == j else f"{offsets[i]}-{offsets[j]}"
        if size + len(part) + 1 > _DONE_MAX_CHARS:
            break
        ranges.append(part)
        size += len(part) + 1
        i = j + 1
    return DONE_PREFIX + ",".join(ranges) if ranges else ""


def parse_done_metadata(metadata: str | None, committed: int) -> set[int]:
    """The offsets above ``committed`` that ``metadata`` names done; nothing for
    metadata of another form (it is only a hint: a record not skipped is handled again)."""
    if not metadata or not metadata.startswith(DONE_PREFIX):
        return set()
    done: set[int] = set()
    try:
        for part in metadata[len(DONE_PREFIX):].split(","):
            lo, _, hi = part.partition("-")
            done.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        log.warning("unreadable done offsets in commit metadata; ignored", metadata=metadata[:200])
        return set()
    return {o for o in done if o > committed}


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, owner: "EventConsumer") -> None:
        self.owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.owner._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.owner._on_assigned(assigned)


Handler = Callable[[Envelope], Awaitable[None]]


class EventConsumer:
    """Typed consumer of Rollway topics. ``topics`` are short (``tasks``) or full names."""

    def __init__(
        self,
        cfg: KafkaConfig,
        topics: Sequence[str],
        group_id: str | None,
        *,
        from_beginning: bool = True,
        dead_letters: bool = True,
        dead_letter_undecodable: bool | None = None,
        client_id: str | None = None,
        on_assign: Callable[[set[TopicPartition]], Awaitable[None]] | None = None,
        on_revoke: Callable[[set[TopicPartition]], Awaitable[None]] | None = None,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 2_000,
        max_poll_interval_ms: int = 300_000,
        max_poll_records: int | None = None,
        commit_offsets: Callable[[dict[TopicPartition, OffsetAndMetadata]], Awaitable[None]] | None = None,
        decompress_ahead: bool = False,
        revoke_grace_s: float = 0.0,
        commit_done_offsets: bool = False,
        sticky_assignment: bool = False,
    ) -> None:
        self.cfg = cfg
        # ``run``: how long the handlers in flight of a revoked partition may go on
        # finishing (acked and committed by this consumer) before they are cancelled and
        # their records left unacked for the partition's next owner; 0 = cancelled at once.
        # The group's rebalance waits for them, so Kafka's rebalance timeout covers it.
        if revoke_grace_s < 0:
            raise ValueError(f"revoke_grace_s must not be negative, got {revoke_grace_s}")
        self._revoke_grace_s = revoke_grace_s
        # Commits name the offsets done past the committed one (commit metadata) and an
        # assignment skips the ones its previous owner named: with several records of a
        # partition in flight, one finished after an older one was abandoned (revoked,
        # or its consumer stopped or died) is not handled a second time.
        self._commit_done_offsets = commit_done_offsets
        # The trainer's intake: each fetched zstd batch's CRC checked and its records
        # decompressed on worker threads as the response arrives (bus/prefetch.py).
        self._decompress_ahead = decompress_ahead
        self._prefetcher: BatchPrefetcher | None = None
        # Where commits go instead of the group coordinator: a transactional writer
        # (the trainer) commits its consumed offsets in its own transactions, so they
        # move exactly with what it wrote and a fenced zombie commits nothing.
        self._commit_offsets = commit_offsets
        self.group_id = group_id
        self.topics = [
            t if t.startswith(cfg.topic_prefix) else topic_spec(t, cfg.topic_prefix).name(cfg.topic_prefix)
            for t in topics
        ]
        self.dlq_topic = cfg.topic_prefix + "dlq"
        self._dead_letters = dead_letters
        # False: skip undecodable records (counted) without a dead letter, also when
        # ``dead_letters`` is on for handler failures: a read-only consumer (analytics)
        # must not dead-letter again what the topic's owner already dead-lettered.
        self._dead_letter_undecodable = dead_letter_undecodable
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        # Built at start(): an aiokafka client that is never started still warns
        # "Unclosed AIOKafkaConsumer" when collected (a service stopped before Kafka came up).
        self._client: AIOKafkaConsumer | None = None
        self._client_id = client_id or cfg.client_id
        self._client_kwargs = dict(
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            isolation_level="read_committed",
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
            max_poll_interval_ms=max_poll_interval_ms,
            # The broker waits this long for every member to rejoin; a member draining
            # its revoked handlers (revoke_grace_s) rejoins only after them.
            rebalance_timeout_ms=session_timeout_ms + int(revoke_grace_s * 1000),
            # A join or leave moves only the partitions it must (round-robin, the default,
            # deals every partition out anew): ``run`` keeps the handlers of the others.
            # A subclass per consumer: aiokafka's sticky assignor keeps the member's last
            # assignment (sent at each join) in class attributes, which consumers of one
            # process (tests, several replicas in one process) would otherwise share.
            **({"partition_assignment_strategy": (type("StickyPartitionAssignor", (StickyPartitionAssignor,), {}),)}
               if sticky_assignment else {}),
            **({"max_poll_records": max_poll_records} if max_poll_records else {}),
        )
        self._progress: dict[TopicPartition, _PartitionProgress] = {}
        # Set by ``run``: a rebalance keeps the progress (and handlers) of revoked
        # partitions until the new assignment says which came back.
        self._keep_revoked = False
        self._revoked_generation = -1  # the generation whose partitions are held
        self._dlq: EventProducer | None = None
        self._stop = asyncio.Event()
        self._started = False
        self._commit_lock = asyncio.Lock()
        self.dead_lettered = 0
        self.undecodable = 0  # records skipped because they did not decode (dead-lettered or not)

    # -- lifecycle -------------------------------------------------------------------
    @property
    def _consumer(self) -> AIOKafkaConsumer:
        if self._client is None:
            self._client = new_consumer(self.cfg, self._client_id, **self._client_kwargs)
            if self._decompress_ahead:
                self._prefetcher = BatchPrefetcher()
                decompress_fetches_ahead(self._client, self._prefetcher)
        return self._client

    @property
    def raw(self) -> AIOKafkaConsumer:
        return self._consumer

    async def start(self) -> None:
        if self._started:
            return
        self._consumer.subscribe(self.topics, listener=_Rebalance(self))
        await start_client(self._consumer, self.cfg.bootstrap_servers, f"consumer {self.group_id or ''}".strip())
        self._started = True

    async def close(self) -> None:
        """Commit what is done, leave the group, release the DLQ producer."""
        if not self._started:
            return
        try:
            await self.commit()
        finally:
            self._started = False
            await stop_consumer(self._consumer)
            if self._prefetcher is not None:
                self._prefetcher.close()
                self._prefetcher = None
            if self._dlq is not None:
                await self._dlq.stop()
                self._dlq = None

    async def __aenter__(self) -> "EventConsumer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stop(self) -> None:
        """Ask iteration (and ``run``) to end after the current record."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def install_signal_handlers(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        loop = asyncio.get_running_loop()
        for sig in signals:
            add_stop_handler(loop, sig, self.stop)

    # -- iteration ---------------------------------------------------------------------
    def __aiter__(self) -> "EventConsumer":
        return self

    async def __anext__(self) -> Envelope:
        while True:
            if self._stop.is_set():
                raise StopAsyncIteration
            record = await self._next_record()
            if record is None:
                raise StopAsyncIteration
            tp = TopicPartition(record.topic, record.partition)
            progress = self._progress.setdefault(tp, _PartitionProgress())
            if not progress.accept(record.offset):
                continue  # came back: in flight or done here
            if progress.skip and record.offset in progress.skip:
                self._skip_done(progress, tp, record.offset)
                continue
            progress.delivered(record.offset)
            env = await self._decode_or_dead_letter(record)
            if env is not None:
                return env

    async def _next_record(self):
        fetch = asyncio.ensure_future(self._consumer.getone())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait({fetch, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if fetch in done:
            return fetch.result()
        fetch.cancel()
        try:
            await fetch
        except (asyncio.CancelledError, Exception):
            pass
        return None

    async def getmany(self, timeout_ms: int = 1000, max_records: int | None = None) -> list[Envelope]:
        """A batch of decoded envelopes (bad records dead-lettered), possibly empty."""
        batches = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        out: list[Envelope] = []
        append = out.append
        for tp, records in batches.items():
            progress = self._progress.setdefault(tp, _PartitionProgress())
            pending = progress.pending
            # Inline, not a coroutine per record (the trainer reads tens of thousands a
            # second); an undecodable record is dead-lettered in order, as before.
            skip = progress.skip
            for record in records:
                offset = record.offset
                if skip and offset in skip:
                    self._skip_done(progress, tp, offset)
                    continue
                pending.add(offset)
                progress.next_offset = offset + 1
                try:
                    append(envelope_of(record))
                except codec.DecodeFailure as exc:
                    await self._dead_letter_record(record, tuple(record.headers or ()), str(exc), exc.kind)
        return out

    @staticmethod
    def _skip_done(progress: _PartitionProgress, tp: TopicPartition, offset: int) -> None:
        """A record the partition's previous owner handled past its commit: not delivered."""
        progress.skip.discard(offset)
        progress.passed(offset)
        log.info("record done by the partition's previous owner; skipped", topic=tp.topic,
                 partition=tp.partition, offset=offset)

    async def _decode_or_dead_letter(self, record) -> Envelope | None:
        """The record as an envelope, or None after dead-lettering it (undecodable)."""
        try:
            return envelope_of(record)
        except codec.DecodeFailure as exc:
            await self._dead_letter_record(record, tuple(record.headers or ()), str(exc), exc.kind)
            return None

    # -- acks and commits ---------------------------------------------------------------
    async def ack(self, env: Envelope, commit: bool = True) -> None:
        """Mark ``env`` handled; commit the partition's contiguous done prefix."""
        self._mark_done(TopicPartition(env.topic, env.partition), env.offset)
        if commit:
            await self.commit([TopicPartition(env.topic, env.partition)])

    def _mark_done(self, tp: TopicPartition, offset: int) -> None:
        progress = self._progress.get(tp)
        if progress is not None:
            progress.pending.discard(offset)

    async def commit(self, partitions: Sequence[TopicPartition] | None = None) -> None:
        if self.group_id is None:
            return
        if self._commit_offsets is not None:
            # Not under the commit lock: the committer takes the writer's transaction
            # lock, and a step holding that lock commits from inside its transaction
            # while a rebalance may be committing too (lock order would deadlock).
            # Offsets are computed and recorded without an await between, so a
            # concurrent commit at worst re-commits an equal or older prefix (records
            # then re-read are recognised as done by their owner). Offsets already
            # recorded are sent again: they were recorded when handed to a transaction
            # that may then have aborted (a broker lost mid-step), and the retried
            # transaction must carry them or they are never committed.
            offsets = self._offsets_to_commit(partitions, resend=True)
            if offsets:
                await self._commit_offsets(offsets)
                self._record_committed(offsets)
            return
        async with self._commit_lock:
            offsets = self._offsets_to_commit(partitions)
            if not offsets:
                return
            await self._consumer.commit(offsets)
            self._record_committed(offsets)

    def _offsets_to_commit(self, partitions: Sequence[TopicPartition] | None, resend: bool = False) -> dict:
        assigned = self._consumer.assignment()
        offsets = {}
        for tp in partitions if partitions is not None else list(self._progress):
            progress = self._progress.get(tp)
            if progress is None or tp not in assigned or progress.held:
                # Revoked meanwhile: the new owner re-reads the unacked records (or, held
                # until the new assignment, this member commits them when it comes back).
                continue
            target = progress.committable()
            if target is None:
                continue
            metadata = done_metadata(progress.done_above(target)) if self._commit_done_offsets else ""
            if resend or target != progress.committed or metadata != progress.committed_metadata:
                offsets[tp] = OffsetAndMetadata(target, metadata)
        return offsets

    def _record_committed(self, offsets: dict) -> None:
        for tp, om in offsets.items():
            progress = self._progress.get(tp)
            if progress is not None:
                if om.offset >= (progress.committed or 0):
                    progress.committed_metadata = om.metadata
                progress.committed = max(om.offset, progress.committed or 0)

    def in_flight(self) -> int:
        return sum(len(p.pending) for p in self._progress.values())

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        # Kicked out (session or poll timeout: aiokafka reset the generation before this
        # rejoin): the partitions may be another member's already, so nothing is kept.
        lost = self._keep_revoked and group_generation(self._consumer) < 0
        keep = self._keep_revoked and not lost
        await self._settle_revoked_handlers(revoked, cancel=not keep)
        if self.group_id is not None and revoked:
            try:
                await self.commit(list(revoked & self._consumer.assignment()))
            except Exception as exc:  # the group may already be rebalancing
                log.warning("commit on revoke failed", error=str(exc))
        if keep:
            # Held until the new assignment says which partitions came back.
            self._revoked_generation = group_generation(self._consumer)
            for tp in revoked:
                progress = self._progress.get(tp)
                if progress is not None:
                    progress.held = True
        else:
            for tp in revoked:
                self._progress.pop(tp, None)
        log.info("partitions revoked", partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in revoked),
                 handlers_kept=keep, generation_lost=lost)
        if self._on_revoke:
            await self._on_revoke(revoked)

    async def _settle_revoked_handlers(self, revoked: set[TopicPartition], cancel: bool) -> None:
        """Before the revoke's commit: no record of a revoked partition starts from now
        on (``run`` leaves one waiting for a slot unacked), and its handlers in flight
        get ``revoke_grace_s`` to finish, acked and committed here. Those still running
        are then cancelled, unacked, only with ``cancel`` (the generation was lost);
        otherwise the new assignment decides (``_on_assigned``)."""
        handlers = self._handlers_of(revoked, mark_revoked=True)
        if not handlers:
            return
        unfinished = set(handlers)
        if self._revoke_grace_s > 0:
            _, unfinished = await asyncio.wait(handlers, timeout=self._revoke_grace_s)
        if unfinished and cancel:
            await self._cancel_handlers({t: handlers[t] for t in unfinished}, "generation lost")

    def _handlers_of(self, partitions, mark_revoked: bool = False) -> dict[asyncio.Task, str]:
        handlers: dict[asyncio.Task, str] = {}
        for tp in partitions:
            progress = self._progress.get(tp)
            if progress is not None:
                if mark_revoked:
                    progress.revoked = True
                handlers.update((task, f"{tp.topic}:{tp.partition}@{offset}")
                                for task, offset in progress.handlers.items())
        return handlers

    @staticmethod
    async def _cancel_handlers(handlers: dict[asyncio.Task, str], why: str) -> None:
        log.warning("cancelling handlers in flight of partitions this member no longer owns; the records are "
                    "left unacked for the partitions' next owner", why=why, records=sorted(handlers.values()))
        for task in handlers:
            task.cancel()
        # Their clean-up (a sampler closes its sandbox sessions) is waited for, but not
        # past a bound: the group may wait for this member. One still running after it
        # acks nothing (``_handle`` checks the ownership it was started under).
        _, stuck = await asyncio.wait(handlers, timeout=_CANCEL_WAIT_S)
        if stuck:
            log.warning("cancelled handlers still cleaning up; going on without them", handlers=len(stuck))

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        # No await before every partition's progress is set: records may be fetched meanwhile.
        # A held partition came back only if no generation went by without this member
        # (one did if the rebalance went on without it: its commit may be another's since).
        generation = group_generation(self._consumer)
        continuous = self._revoked_generation >= 0 and generation == self._revoked_generation + 1
        self._revoked_generation = -1
        moved = [tp for tp, p in self._progress.items() if p.held and not (continuous and tp in assigned)]
        moved_handlers = self._handlers_of(moved)
        for tp in moved:
            del self._progress[tp]  # before the cancel: a handler ending now acks nothing
        back, fresh = set(), set()
        for tp in assigned:
            progress = self._progress.get(tp)
            if progress is not None and progress.held:
                progress.came_back()
                back.add(tp)
            else:
                self._progress[tp] = _PartitionProgress()
                fresh.add(tp)
        log.info("partitions assigned", partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in assigned),
                 came_back=sorted(f"{tp.topic}:{tp.partition}" for tp in back),
                 moved_away=sorted(f"{tp.topic}:{tp.partition}" for tp in moved))
        if moved_handlers:
            await self._cancel_handlers(moved_handlers, "partition moved to another member")
        if back and self.group_id is not None:
            try:  # acks made between the revoke and now
                await self.commit(list(back))
            except Exception as exc:
                log.warning("commit of partitions that came back failed", error=str(exc))
        if self._commit_done_offsets and self.group_id is not None and fresh:
            await self._load_done_offsets(fresh)
        if self._on_assign:
            await self._on_assign(assigned)

    async def _load_done_offsets(self, assigned: set[TopicPartition]) -> None:
        """The offsets the previous owners named done past their commits (skipped when read)."""
        try:
            committed = await fetch_committed(self._consumer, assigned)
        except Exception as exc:  # only a hint: without it those records are handled again
            log.warning("could not read the commits' done offsets; none skipped", error=str(exc))
            return
        for tp, om in committed.items():
            progress = self._progress.get(tp)
            if progress is not None and om is not None and om.offset >= 0:
                progress.skip = parse_done_metadata(om.metadata, om.offset)
                if progress.skip:
                    log.info("offsets done by the previous owner will be skipped", topic=tp.topic,
                             partition=tp.partition, committed=om.offset, skip=sorted(progress.skip))

    # -- dead letters ------------------------------------------------------------------
    async def _producer_for_dlq(self) -> EventProducer:
        if self._dlq is None:
            self._dlq = EventProducer(self.cfg, client_id=f"{self.cfg.client_id}-dlq")
            await self._dlq.start()
        return self._dlq

    async def dead_letter(self, env: Envelope, error: str, kind: str = "handler", attempts: int = 0) -> None:
        """Send a decoded record that could not be handled to the DLQ, then ack it.
        A stop requested while the letter cannot be published leaves the record unacked
        (its next owner handles it again)."""
        from bus.codec import encode

        value, _ = encode(env.event)
        if await self._publish_dead_letter(env.topic, env.partition, env.offset, env.key, value,
                                           env.headers, error, kind, attempts):
            await self.ack(env)

    async def _dead_letter_record(self, record, headers, error: str, kind: str) -> None:
        self.undecodable += 1
        log.warning("undecodable record", topic=record.topic, partition=record.partition,
                    offset=record.offset, error=error, kind=kind)
        if record.topic != self.dlq_topic and self._dead_letter_undecodable is not False:
            if not await self._publish_dead_letter(record.topic, record.partition, record.offset, record.key,
                                                   record.value, headers, error, kind, 0):
                return  # stopping: left unacked for the next owner
        tp = TopicPartition(record.topic, record.partition)
        self._mark_done(tp, record.offset)
        await self.commit([tp])

    async def _publish_dead_letter(self, topic, partition, offset, key, value, headers, error, kind,
                                   attempts) -> bool:
        """Publish the letter, retrying until it is in the DLQ. False only when the
        consumer is stopped first: then the caller must not ack the record."""
        from bus.connect import backoff_s

        self.dead_lettered += 1
        if not self._dead_letters:
            return True
        letter = DeadLetter(
            topic=topic, partition=partition, offset=offset, key=key, value=value,
            headers=list(headers), error=error, error_kind=kind,
            consumer_group=self.group_id or "", attempts=attempts, created_at=now(),
        )
        failures = 0
        shrunk = False
        while True:
            try:
                producer = await self._producer_for_dlq()
                await producer.publish(letter, topic=self.dlq_topic)
                return True
            except asyncio.CancelledError:
                raise
            except RecordTooLarge as exc:
                if shrunk:
                    raise  # nothing left to leave out (a key near the limit?): a bug to see, not to retry
                shrunk = True
                # The original stays in its topic; the letter says where (and why it is short).
                log.warning("dead letter too large; sending it without the original value", topic=topic,
                            partition=partition, offset=offset, error=str(exc))
                letter = msgspec.structs.replace(
                    letter, value=None, headers=[],
                    error=f"{letter.error[:_LETTER_ERROR_CHARS]} [original value ({len(letter.value or b'')} bytes) "
                          f"and headers left out: the letter exceeded max_record_bytes; read the record at "
                          f"{topic}:{partition}@{offset}]",
                )
            except Exception as exc:
                failures += 1
                delay = backoff_s(failures)
                log.warning("dead-letter publish failed; retrying", topic=topic, partition=partition,
                            offset=offset, attempt=failures, retry_in_s=delay, error=repr(exc))
                if await self._stopped_within(delay):
                    return False

    async def _stopped_within(self, seconds: float) -> bool:
        """Sleep ``seconds``; True (at once) when the consumer is stopped meanwhile."""
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            return False
        return True

    # -- the managed loop ------------------------------------------------------------------
    async def run(self, handler: Handler, *, concurrency: int = 1, handle_signals: bool = False) -> None:
        """Handle every record until :meth:`stop` (or SIGTERM with ``handle_signals``).

        Each record is acked after its handler returns. Cancelling ``run`` cancels the
        handlers in flight and acks none of their records. A handler raising
        :class:`InvalidEvent` dead-letters the record at once; any other exception is
        retried after each delay of ``cfg.handler_retry`` (seconds to minutes in all),
        then the record is dead-lettered.
        """
        if handle_signals:
            self.install_signal_handlers()
        slots = asyncio.Semaphore(concurrency)
        running: set[asyncio.Task] = set()
        self._keep_revoked = True
        try:
            async for env in self:
                tp = TopicPartition(env.topic, env.partition)
                progress = self._progress.get(tp)  # the ownership that delivered it
                generation = progress.generation if progress is not None else -1
                await slots.acquire()
                if self.stopping:
                    # Fetched before the stop but not started: leave it unacked, so the
                    # commit stops short of it and the next owner handles it.
                    slots.release()
                    break
                if progress is None or progress.revoked or progress.generation != generation \
                        or self._progress.get(tp) is not progress:
                    # Its partition was revoked while it waited for a slot: the next owner
                    # (this member too, when it came back) reads it from the commit
                    # (unacked here); started, it would run twice.
                    slots.release()
                    log.info("record of a revoked partition not started; left for its next owner",
                             topic=env.topic, partition=env.partition, offset=env.offset)
                    continue
                task = asyncio.create_task(self._handle(env, handler, progress))
                running.add(task)
                progress.handlers[task] = env.offset
                task.add_done_callback(
                    lambda t, p=progress: (running.discard(t), p.handlers.pop(t, None), slots.release()))
        except asyncio.CancelledError:
            # Cancelled (not stopped): the handlers go with it, unacked, so their records
            # are the next owner's. Left running they would outlive what they use (the
            # caller's producer closes next), fail every retry and dead-letter good records.
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            raise
        if running:
            log.info("draining in-flight handlers", count=len(running))
            await asyncio.gather(*running, return_exceptions=True)
        await self.commit()

    async def _handle(self, env: Envelope, handler: Handler, progress: _PartitionProgress) -> None:
        delays = self.cfg.handler_retry.delays()
        attempts = 0
        while True:
            attempts += 1
            try:
                await handler(env)
            except InvalidEvent as exc:
                log.warning("invalid event", topic=env.topic, offset=env.offset, error=str(exc))
                await self.dead_letter(env, str(exc), "invalid", attempts)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if attempts > len(delays):
                    log.error("handler kept failing; dead-lettering", topic=env.topic, partition=env.partition,
                              offset=env.offset, attempts=attempts, error=repr(exc))
                    await self.dead_letter(
                        env, f"handler failed {attempts} times over {self.cfg.handler_retry.window_s:g} s: {exc!r}",
                        "handler", attempts)
                    return
                delay = delays[attempts - 1]
                log.warning("handler failed", topic=env.topic, partition=env.partition, offset=env.offset,
                            attempt=attempts, retry_in_s=round(delay, 3), error=repr(exc))
                if await self._stopped_within(delay):
                    # Stopping: not acked, so the next owner of the partition retries it.
                    log.info("stopping during a retry back-off; record left for the next owner",
                             topic=env.topic, partition=env.partition, offset=env.offset)
                    return
                continue
            tp = TopicPartition(env.topic, env.partition)
            if self._progress.get(tp) is not progress:
                # Finished after its partition moved away (a handler that outlived its
                # cancellation): its next owner has it; an ack here would mark the same
                # offset of a later ownership done. (A partition that came back keeps
                # its progress, so its handlers ack.)
                log.warning("handler finished after its partition was revoked; not acked", topic=env.topic,
                            partition=env.partition, offset=env.offset)
                return
            await self.ack(env)
            return
