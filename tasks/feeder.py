"""The feeder: decides what the samplers sample.

It publishes ``Task`` events (one event = one group of ``group_size`` samples) at a
steady, configurable rate, choosing tasks with :class:`tasks.selection.TaskSelector`.
It reads ``rollway.rewards`` to learn each task's solve rate under the current policy
(retiring tasks that are always or never solved) and to know which published groups
are complete. Backpressure: while ``max_outstanding_groups`` published groups are not
yet fully rewarded, it publishes nothing, so a slow sampler fleet never builds a backlog
of stale tasks (rollouts would be sampled by older and older weights).

The rewards are read by a plain reader (no consumer group, nothing committed) from the
beginning of the log by default: the log is the system of record, so a restarted
feeder rebuilds its statistics from it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from typing import Callable

import structlog

from bus import EventConsumer, EventProducer, KafkaConfig, RecordTooLarge
from bus.reader import caught_up, end_offsets, partitions_of
from schemas import Metrics, Reward, now
from tasks.config import FeederConfig
from tasks.outstanding import OutstandingGroups
from tasks.selection import TaskSelector
from tasks.store import TaskStore

log = structlog.get_logger(__name__)

# Rewards are at-least-once: remember this many trajectory ids to count each once.
_DEDUPE_CAPACITY = 200_000


class Feeder:
    def __init__(
        self,
        cfg: FeederConfig,
        kafka: KafkaConfig,
        store: TaskStore,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if len(store) == 0:
            raise ValueError(f"no tasks in {store.root}")
        self.cfg = cfg
        self.kafka = kafka
        self.store = store
        self.clock = clock
        kinds = {spec.task_id: spec.metadata["kind"] for spec in store if spec.metadata.get("kind")}
        skills = {spec.task_id: spec.metadata["skill"] for spec in store if spec.metadata.get("skill")}
        self.selector = TaskSelector.from_config(store.ids(), cfg, groups=kinds, skills=skills)
        self.outstanding = OutstandingGroups()
        self.published = 0
        self.published_samples = 0  # samples asked for (groups grow with group_size_max)
        self.published_by_task: dict[str, int] = {}
        self.rewards_seen = 0
        self.backpressure_seconds = 0.0
        self._seen: OrderedDict[str, None] = OrderedDict()
        # While the rewards log is replayed, rewards wait here to be observed in time
        # order: the reader drains partitions one after another, and the solve-rate
        # window (hence retirement) depends on the order outcomes arrive in.
        self._replay_buffer: list[tuple[int, float, str, Reward]] | None = None
        self._progress = asyncio.Event()  # a group completed (room to publish again)
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    # -- rewards in ------------------------------------------------------------------
    def observe(self, reward: Reward) -> None:
        """Count one reward (duplicates of a trajectory count once)."""
        if reward.trajectory_id in self._seen:
            return
        self._seen[reward.trajectory_id] = None
        if len(self._seen) > _DEDUPE_CAPACITY:
            self._seen.popitem(last=False)
        self.rewards_seen += 1
        if reward.task_id in self.selector.stats:
            solved = not reward.cheated and reward.score >= self.cfg.success_threshold
            retired = self.selector.record(reward.task_id, solved)
            if retired:
                stats = self.selector.stats[reward.task_id]
                log.info("task retired", task_id=reward.task_id, reason=retired,
                         window_solved=stats.window_solved, window_attempts=stats.window_attempts)
        if self.outstanding.rewarded(reward.group_id, reward.sample_index):
            self._progress.set()

    async def _read_rewards(self, consumer: EventConsumer) -> None:
        async for env in consumer:
            reward = env.event
            if isinstance(reward, Reward):
                if self._replay_buffer is not None:
                    self._replay_buffer.append((env.timestamp_ms, reward.created_at, reward.trajectory_id, reward))
                else:
                    self.observe(reward)
            await consumer.ack(env, commit=False)  # plain reader: only frees the in-flight slot

    def _finish_replay(self) -> None:
        """Observe the buffered history in the order it was published, then go live."""
        history, self._replay_buffer = self._replay_buffer or [], None
        for *_, reward in sorted(history, key=lambda item: item[:3]):
            self.observe(reward)
        log.info("rewards log replayed", rewards=self.rewards_seen, retired=len(self.selector.retired()))

    async def _catch_up(self, consumer: EventConsumer, reader: asyncio.Task, timeout_s: float = 60.0) -> None:
        """Wait until the rewards already in the log are read, so the first choices use
        the rebuilt statistics rather than a cold start."""
        raw = consumer.raw
        tps = await partitions_of(raw, consumer.topics)
        ends = await end_offsets(raw, tps)  # asked again while a broker is lost, not a crash
        deadline = self.clock() + timeout_s
        while not self._stop.is_set() and not reader.done():
            if await caught_up(raw, ends):
                return
            if self.clock() > deadline:
                log.warning("rewards log not replayed in time; starting anyway",
                            rewards=len(self._replay_buffer or ()))
                return
            await asyncio.sleep(0.05)

    # -- tasks out -------------------------------------------------------------------
    async def run(self) -> str:
        """Publish until stopped, ``max_groups`` reached, or every task retired; returns why."""
        producer = EventProducer(self.kafka, client_id="rollway-feeder")
        # A reader of the trainer's topic: what does not decode is skipped, not dead-lettered
        # (the trainer does that once; this reader sees the whole log at every start).
        consumer = EventConsumer(self.kafka, ["rewards"], group_id=None, from_beginning=self.cfg.replay_rewards,
                                 dead_letter_undecodable=False, client_id="rollway-feeder")
        await producer.start()
        try:
            await consumer.start()
            if self.cfg.replay_rewards:
                self._replay_buffer = []
            reader = asyncio.create_task(self._read_rewards(consumer), name="feeder-rewards")
            try:
                if self.cfg.replay_rewards:
                    await self._catch_up(consumer, reader)
                    self._finish_replay()
                reason = await self._publish_loop(producer, reader)
            finally:
                consumer.stop()
                try:
                    await asyncio.wait_for(reader, timeout=5)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    reader.cancel()
                await consumer.close()
            await self._publish_metrics(producer)
        finally:
            await producer.stop()
        log.info("feeder stopped", reason=reason, published=self.published, rewards_seen=self.rewards_seen)
        return reason

    async def _publish_loop(self, producer: EventProducer, reader: asyncio.Task) -> str:
        cfg = self.cfg
        interval = 1.0 / cfg.groups_per_second
        next_at = self.clock()
        last_metrics = self.clock()
        blocked_since: float | None = None
        log.info("feeder started", tasks=len(self.store), group_size=cfg.group_size,
                 groups_per_second=cfg.groups_per_second, max_outstanding=cfg.max_outstanding_groups)
        while not self._stop.is_set():
            if reader.done():  # the rewards reader died: fail loudly rather than feed blind
                reader.result()
                return "rewards reader ended"
            if cfg.max_groups and self.published >= cfg.max_groups:
                return f"published max_groups={cfg.max_groups}"
            t = self.clock()
            if t - last_metrics >= cfg.metrics_interval_s:
                await self._publish_metrics(producer)
                last_metrics = t
            for group_id, group in self.outstanding.expire(t, cfg.outstanding_timeout_s):
                log.warning("group expired without all rewards", group_id=group_id, task_id=group.task_id,
                            rewarded=len(group.rewarded), group_size=group.group_size)
            if len(self.outstanding) >= cfg.max_outstanding_groups:
                if blocked_since is None:
                    blocked_since = t
                    log.debug("backpressure: waiting for rewards", outstanding=len(self.outstanding))
                self._progress.clear()
                await self._wait(self._progress, timeout=1.0)
                continue
            if blocked_since is not None:
                self.backpressure_seconds += t - blocked_since
                blocked_since = None
                next_at = max(next_at, t)
            if t < next_at:
                await self._wait(None, timeout=next_at - t)
                continue
            task_id = self.selector.choose()
            if task_id is None:
                return "every task is retired"
            await self._publish_group(producer, task_id)
            next_at = t + interval  # steady pace: never catch up in a burst
        return "stopped"

    async def _publish_group(self, producer: EventProducer, task_id: str) -> None:
        group_id = f"g-{uuid.uuid4().hex}"
        # groups grow with the task's solve rate only with group_size_max (else all are group_size)
        size = self.selector.group_size_for(task_id) if self.selector.group_size_max else self.cfg.group_size
        event = self.store.get(task_id).to_event(group_id, size, created_at=now())
        try:
            await producer.publish(event)
        except RecordTooLarge as exc:
            # The task's files do not fit in one event; it can never be sampled.
            self.selector.stats[task_id].retired = "too large for one Task event"
            log.error("task retired: too large to publish", task_id=task_id, error=str(exc))
            return
        self.outstanding.add(group_id, task_id, size, self.clock())
        self.published += 1
        self.published_samples += size
        self.published_by_task[task_id] = self.published_by_task.get(task_id, 0) + 1
        log.debug("published task", task_id=task_id, group_id=group_id, group_size=size,
                  outstanding=len(self.outstanding))

    async def _wait(self, event: asyncio.Event | None, timeout: float) -> None:
        """Sleep up to ``timeout``; wake early on ``event`` or stop."""
        waiters = [asyncio.ensure_future(self._stop.wait())]
        if event is not None:
            waiters.append(asyncio.ensure_future(event.wait()))
        try:
            await asyncio.wait(waiters, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    def snapshot(self) -> dict[str, float]:
        rates = [self.selector.solve_rate(t) for t in self.selector.active()]
        expected = self.selector.expected_informative()
        extra = {} if expected is None else {"expected_informative_share": expected}
        return {
            "published_groups": float(self.published),
            "published_samples": float(self.published_samples),
            "outstanding_groups": float(len(self.outstanding)),
            "rewards_seen": float(self.rewards_seen),
            "active_tasks": float(len(rates)),
            "retired_tasks": float(len(self.selector.retired())),
            "mean_active_solve_rate": sum(rates) / len(rates) if rates else 0.0,
            "backpressure_seconds": self.backpressure_seconds,
            **extra,
        }

    async def _publish_metrics(self, producer: EventProducer) -> None:
        await producer.publish(Metrics(source="feeder", values=self.snapshot(), created_at=now()))
