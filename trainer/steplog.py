"""The train-step log (``rollway.train-steps``): writing entries, reading them back, and
turning an entry into exactly the groups that step trained on.

Reading tolerates what is not a step and refuses what is a broken step: a record
without ``rollway-type: TrainStep`` (another event, a plain Kafka client's bytes) is
skipped with an error log and, by the trainer, dead-lettered once; a record that claims
to be a TrainStep and does not decode stops the reader (``StepLogError`` naming its
offset and how to inspect it), since skipping it could lose a step's trained records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import structlog
from aiokafka.errors import KafkaTimeoutError

from bus import RecordMissing, codec, fetch_records
from bus.config import KafkaConfig
from bus.connect import start_client, stop_consumer
from bus.consumer import envelope_of
from bus.reader import end_offsets, plain_reader, read_topic_records, read_up_to, topic_partitions
from bus.topics import topic_spec
from schemas import (DeadLetter, GroupDrop, GroupRef, GroupsDropped, RecordRef, Reward, TrainedTrajectory,
                     TrainStep, TrajectoryChunk, now)
from trainer.trajectory import Group, assemble, check_chunk, groups_from_trajectories

log = structlog.get_logger(__name__)


class StepLogError(RuntimeError):
    """The train-step log is inconsistent (a gap, an unreadable entry, missing records)."""


class StepLogUnreadable(StepLogError, KafkaTimeoutError):
    """The step log's committed end is known but its records could not be fetched in
    time: a broker away or a partition leader moving (chaos seed 4, issue #30). Inside
    the trainer's step transaction it counts as the broker being away (the transaction is
    retried whole, ``bus.producer.BROKER_AWAY``); elsewhere it is a ``StepLogError``."""


class StepAlreadyLogged(StepLogError):
    """Another writer logged the step this trainer was about to log: it is not the only
    trainer. It stops instead of logging a second history."""


@dataclass(frozen=True)
class LoggedStep:
    event: TrainStep
    ref: RecordRef


class StepLog(dict[int, LoggedStep]):
    """What ``read_step_log`` returns: the logged steps by number, and ``drops``, the
    ``GroupsDropped`` entries between them (``(after_step, GroupDrop)`` in log order)."""

    def __init__(self) -> None:
        super().__init__()
        self.drops: list[tuple[int, GroupDrop]] = []


def step_event(step: int, weights_hash: str, groups: Sequence[Group], metrics: dict[str, float], seed: int,
               dropped: Sequence[GroupDrop] = ()) -> TrainStep:
    return TrainStep(
        step=step,
        weight_version=step,
        weights_hash=weights_hash,
        trajectories=[
            TrainedTrajectory(trajectory_id=t.trajectory_id, chunks=list(t.chunk_refs), reward=t.reward_ref)
            for g in groups
            for t in g.members
        ],
        metrics={k: float(v) for k, v in metrics.items()},
        seed=seed,
        created_at=now(),
        groups=[GroupRef(g.task_id, g.group_id) for g in groups],
        dropped=list(dropped),
    )


async def read_step_log(cfg: KafkaConfig, timeout_ms: int = 10_000, *, dead_letter: bool = False) -> StepLog:
    """Every logged step, by step number, and the ``GroupsDropped`` entries (``.drops``).

    A step logged twice with other contents (two trainers wrote it: the log holds two
    histories from there on) raises ``StepLogError`` naming both entries; the same bytes
    twice (a retried publish) are one step, with a warning. Records of any other type
    are skipped with an error log; with ``dead_letter`` (the trainer) each is also sent
    to the dead-letter topic, once across restarts. A record claiming to be a TrainStep
    (or GroupsDropped) that does not decode raises ``StepLogError``."""
    topic = _full(cfg, "train-steps")
    try:
        records = await read_topic_records(cfg, topic, timeout_ms)
    except RecordMissing as exc:
        raise StepLogError(str(exc)) from None
    steps = StepLog()
    values: dict[int, bytes] = {}  # step -> its first entry's bytes
    foreign: list[tuple[object, str]] = []
    for record in records:
        where = f"{record.topic}:{record.partition}@{record.offset}"
        claimed = codec.header_value(record.headers, codec.TYPE_HEADER)
        if claimed == GroupsDropped.__name__.encode():
            try:
                entry = envelope_of(record).event
            except codec.DecodeFailure as exc:
                raise StepLogError(f"undecodable GroupsDropped record at {where}: {exc}") from None
            steps.drops.extend((entry.after_step, d) for d in entry.dropped)
            continue
        if claimed != TrainStep.__name__.encode():
            error = (f"not a TrainStep (rollway-type {claimed.decode(errors='replace')!r})" if claimed is not None
                     else f"no {codec.TYPE_HEADER!r} header (not written by a Rollway trainer)")
            log.error("record on the train-step log is not a TrainStep; skipped", position=where, error=error)
            foreign.append((record, error))
            continue
        try:
            event = envelope_of(record).event
        except codec.DecodeFailure as exc:
            raise StepLogError(
                f"undecodable train-step record at {where}: {exc}. The trainer cannot tell which records that step "
                f"trained on, so it does not skip it. Inspect it with: kafka-console-consumer.sh "
                f"--bootstrap-server {cfg.bootstrap_servers} --topic {record.topic} --partition {record.partition} "
                f"--offset {record.offset} --max-messages 1 --property print.headers=true"
                + (" (a newer schema: run a Rollway build that reads it)" if exc.kind == "newer_schema" else "")
            ) from None
        assert isinstance(event, TrainStep)
        earlier = steps.get(event.step)
        if earlier is not None:
            if values[event.step] != record.value:
                raise StepLogError(_two_histories(cfg, event.step, earlier.ref, record))
            # The same bytes again (a producer retry outside a transaction): one step.
            log.warning("step logged twice, identical entries; the first is used", step=event.step,
                        first=f"{earlier.ref.topic}:{earlier.ref.partition}@{earlier.ref.offset}", again=where)
            continue
        steps[event.step] = LoggedStep(event, RecordRef(record.topic, record.partition, record.offset))
        values[event.step] = record.value
    if foreign and dead_letter:
        await _dead_letter_once(cfg, foreign, timeout_ms)
    return steps


def _two_histories(cfg: KafkaConfig, step: int, first: RecordRef, again) -> str:
    topic, partition = again.topic, again.partition
    return (
        f"step {step} is logged twice with different contents, at {first.topic}:{first.partition}@{first.offset} "
        f"and {topic}:{partition}@{again.offset}: two trainers wrote this log, which from there on holds two "
        f"histories. No entry is preferred silently: a step's weights and the records it consumed would be "
        f"ambiguous. Compare them with: kafka-console-consumer.sh --bootstrap-server {cfg.bootstrap_servers} "
        f"--topic {topic} --partition {partition} --offset {first.offset} --max-messages "
        f"{again.offset - first.offset + 1} --property print.headers=true. This log cannot be continued; train on "
        f"under a new kafka.topic_prefix (a fresh log) and run exactly one trainer per prefix"
    )


def _full(cfg: KafkaConfig, short: str) -> str:
    return topic_spec(short, cfg.topic_prefix).name(cfg.topic_prefix)


async def _dead_letter_once(cfg: KafkaConfig, foreign: list[tuple[object, str]], timeout_ms: int) -> None:
    """Dead-letter foreign step-log records not already in the dead-letter topic (the
    log is re-read at every start; one letter per record is enough)."""
    from bus import EventProducer

    dlq = _full(cfg, "dlq")
    done: set[tuple[str, int, int]] = set()
    for record in await read_topic_records(cfg, dlq, timeout_ms):
        try:
            letter = envelope_of(record).event
        except codec.DecodeFailure:
            continue
        if isinstance(letter, DeadLetter):
            done.add((letter.topic, letter.partition, letter.offset))
    todo = [(r, e) for r, e in foreign if (r.topic, r.partition, r.offset) not in done]
    if not todo:
        return
    async with EventProducer(cfg, client_id=f"{cfg.client_id}-steplog-dlq") as producer:
        for record, error in todo:
            await producer.publish(DeadLetter(
                topic=record.topic, partition=record.partition, offset=record.offset, key=record.key,
                value=record.value, headers=list(record.headers or ()), error=error, error_kind="unknown_type",
                consumer_group="", attempts=0, created_at=now(),
            ), topic=dlq, key=record.key)
    log.error("foreign train-step records dead-lettered", count=len(todo), topic=dlq)


class StepLogWatch:
    """Follows the committed end of the step log so the trainer refuses to log a step
    number that is already there (``check``). Transactions fence a second trainer of the
    same transactional id; this also catches one started with another id."""

    def __init__(self, cfg: KafkaConfig) -> None:
        self.cfg = cfg
        self.topic = _full(cfg, "train-steps")
        self.last_step = 0  # highest step number seen in the log so far
        self.hashes: dict[int, str] = {}  # step -> weights hash, first entry wins
        self._consumer = None
        self._tps: list = []

    async def start(self) -> None:
        self._consumer = plain_reader(self.cfg, "steplog-watch")
        await start_client(self._consumer, self.cfg.bootstrap_servers, "step log watch")
        self._tps = await topic_partitions(self._consumer, self.topic)
        self._consumer.assign(self._tps)
        await self._consumer.seek_to_beginning(*self._tps)
        await self.check(0)

    async def stop(self) -> None:
        if self._consumer is not None:
            await stop_consumer(self._consumer)
            self._consumer = None

    async def check(self, step: int) -> None:
        """Read the log up to its committed end; raise ``StepAlreadyLogged`` when it
        holds ``step`` or a later one (``step`` 0: just catch up)."""
        consumer = self._consumer
        assert consumer is not None, "StepLogWatch.check before start()"
        ends = await end_offsets(consumer, self._tps)
        try:
            async for records in read_up_to(consumer, ends):
                for record in records:
                    if codec.header_value(record.headers, codec.TYPE_HEADER) != TrainStep.__name__.encode():
                        continue  # foreign records are read_step_log's business
                    try:
                        event = envelope_of(record).event
                    except codec.DecodeFailure:
                        continue
                    self.last_step = max(self.last_step, event.step)
                    self.hashes.setdefault(event.step, event.weights_hash)
        except RecordMissing as exc:
            raise StepLogUnreadable(str(exc)) from None
        if step and self.last_step >= step:
            raise StepAlreadyLogged(
                f"step {step} is already in the train-step log {self.topic} (it holds steps up to "
                f"{self.last_step}): another trainer is writing it. This trainer stops; run exactly one trainer "
                "per topic prefix."
            )


def last_contiguous_step(steps: dict[int, LoggedStep]) -> int:
    """The last step N of a log holding exactly steps 1..N; raises on a gap."""
    if not steps:
        return 0
    n = max(steps)
    missing = [s for s in range(1, n + 1) if s not in steps]
    if missing:
        raise StepLogError(f"train-step log has gaps: steps {missing[:10]} missing below {n}")
    return n


def trained_ids(steps: dict[int, LoggedStep]) -> set[str]:
    return {t.trajectory_id for s in steps.values() for t in s.event.trajectories}


def trained_groups(steps: dict[int, LoggedStep]) -> list[tuple[str, str]]:
    """Keys of the groups the log says were trained, in step order (entries written
    before ``TrainStep.groups`` existed contribute none: see ``group_ends``)."""
    return [(g.task_id, g.group_id) for _, s in sorted(steps.items()) for g in s.event.groups]


def is_legacy(event: TrainStep) -> bool:
    """A schema-1 entry: it trained trajectories but names no group (schema 2 on always
    names the groups of the trajectories it lists)."""
    return bool(event.trajectories) and not event.groups


@dataclass
class GroupEnds:
    """How the log says groups ended: ``trained`` (step, key) in step order, a key
    listed twice if it was trained twice; ``dropped`` (step, key, reason; for a
    ``GroupsDropped`` entry the step logged before it);
    ``unknown_steps``: schema-1 steps whose group keys could not be derived."""

    trained: list[tuple[int, tuple[str, str]]]
    dropped: list[tuple[int, tuple[str, str], str]]
    unknown_steps: list[int]


async def group_ends(cfg: KafkaConfig, steps: dict[int, LoggedStep]) -> GroupEnds:
    """Every group end the log records. Schema-1 entries (no ``groups``) get their keys
    from their trajectories' reward records (a ``Reward`` names its task and group);
    when those records are gone (retention) or unreadable, the entries' groups are
    unknown: one warning, and the caller sees them in ``unknown_steps`` (a restarted
    trainer still refuses their trajectories by id, not a retry of their groups)."""
    legacy = {s: logged.event for s, logged in steps.items() if is_legacy(logged.event)}
    derived: dict[int, list[tuple[str, str]]] = {}
    unknown: list[int] = []
    if legacy:
        refs = [t.reward for s in sorted(legacy) for t in legacy[s].trajectories]
        try:
            envelopes = await fetch_records(cfg, refs)
        except (RecordMissing, codec.DecodeFailure) as exc:
            unknown = sorted(legacy)
            log.warning("schema-1 train steps: their group keys cannot be derived (reward records unreadable); "
                        "a group they trained could be trained again under a new attempt id, their trajectories "
                        "cannot", steps=len(unknown), first=unknown[0], last=unknown[-1], error=str(exc))
        else:
            i = 0
            for s in sorted(legacy):
                keys: list[tuple[str, str]] = []
                for _ in legacy[s].trajectories:
                    reward = envelopes[i].event
                    i += 1
                    key = (reward.task_id, reward.group_id) if isinstance(reward, Reward) else None
                    if key is not None and key not in keys:
                        keys.append(key)
                derived[s] = keys
            log.info("schema-1 train steps: group keys derived from their reward records", steps=len(derived))
    trained: list[tuple[int, tuple[str, str]]] = []
    dropped: list[tuple[int, tuple[str, str], str]] = []
    for s, logged in sorted(steps.items()):
        keys = derived.get(s) or [(g.task_id, g.group_id) for g in logged.event.groups]
        trained.extend((s, k) for k in keys)
        dropped.extend((s, (d.task_id, d.group_id), d.reason) for d in logged.event.dropped)
    # Drops logged between steps (GroupsDropped): a clean stop's, or a bound's flush.
    for after, d in steps.drops if isinstance(steps, StepLog) else ():
        dropped.append((after, (d.task_id, d.group_id), d.reason))
    return GroupEnds(trained, dropped, unknown)


async def fetch_step_groups(cfg: KafkaConfig, event: TrainStep) -> list[Group]:
    """The groups a logged step trained on, rebuilt from exactly its records."""
    refs: list[RecordRef] = []
    for t in event.trajectories:
        refs.extend(t.chunks)
        refs.append(t.reward)
    envelopes = await fetch_records(cfg, refs)
    trajectories = []
    i = 0
    for t in event.trajectories:
        chunk_envs = envelopes[i : i + len(t.chunks)]
        reward_env = envelopes[i + len(t.chunks)]
        i += len(t.chunks) + 1
        chunks = [e.event for e in chunk_envs]
        if not all(isinstance(c, TrajectoryChunk) for c in chunks) or not isinstance(reward_env.event, Reward):
            raise StepLogError(f"step {event.step}: records of {t.trajectory_id} are not chunks + reward")
        try:
            checked = [check_chunk(c) for c in chunks]
            traj = assemble(checked, [e.ref for e in chunk_envs], reward_env.event, reward_env.ref)
        except ValueError as exc:  # InvalidTrajectory is one
            raise StepLogError(f"step {event.step}: {exc}") from None
        if traj.trajectory_id != t.trajectory_id:
            raise StepLogError(f"step {event.step}: records of {t.trajectory_id} belong to {traj.trajectory_id}")
        trajectories.append(traj)
    return groups_from_trajectories(trajectories)
