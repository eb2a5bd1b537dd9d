"""The trainer process: restore from checkpoint + log, then train live from Kafka.

Start-up:
  0. start the transactional producer (fixed ``transactional_id``): the broker fences
     every older trainer of that id and aborts its open transaction, so from here on
     this process is the only one that can append to the step log or commit offsets;
     then claim the checkpoint folder with the producer's (id, epoch) and clean what
     dead writers left there (``trainer/checkpoint_owner.py``);
  1. read the whole train-step log; it must hold steps 1..N without a gap;
  2. load the newest checkpoint the log confirms (hash agrees), else the initial model;
  3. re-execute logged steps after it from exactly their records, checking each hash
     (a mismatch stops the trainer: the log would no longer describe its weights);
  4. go live: consume trajectories and rewards in the trainer's consumer group.

Live, per step (the order is what makes restarts exact):
  train -> one transaction {check the log holds no step >= this one; ``TrainStep``;
  the consumed offsets; metrics} -> checkpoint snapshot (written in the background)
  -> weights publish (announced in a transaction of the same id).

Offsets are committed only up to the oldest record not yet trained or dropped (the
bus commits the contiguous acknowledged prefix), so after a crash the trainer re-reads
every record that might still matter; records of trajectories the log says were
trained are recognised and skipped. Nothing is trained twice (the log is checked) and
nothing is skipped (uncommitted records are re-read).

A fenced trainer (``WriterFenced``: a newer one started; ``CheckpointFenced``: a newer
one owns the checkpoint folder), one that finds its step already logged
(``StepAlreadyLogged``) or whose weights publish conflicts (``WeightConflict``) stops
with that error: it is not the only writer, and whatever it had not committed is
aborted, never half-visible. It writes no checkpoint either: checkpoints are written
only of steps this trainer's committed transactions logged (or the log holds, during
replay), and only while it owns the folder.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Iterable

import structlog

from schemas import GroupsDropped, Metrics, now
from trainer.assembler import Assembler
from trainer.checkpoint import AsyncCheckpointer
from trainer.checkpoint_owner import FolderOwnership, owner_of_producer
from trainer.publishing import BackgroundPublisher, WeightSink
from trainer.training_config import training_config_hash
from trainer.replay import ReplayMismatch, replay_steps, restore_newest_loadable
from trainer.steplog import StepLogWatch, group_ends, last_contiguous_step, read_step_log, step_event, trained_ids
from trainer.trajectory import Group

if TYPE_CHECKING:
    from bus import EventConsumer, EventProducer
    from bus.config import KafkaConfig
    from syncer.config import SyncerConfig
    from trainer.config import TrainerConfig
    from trainer.core import StepResult, TrainCore

log = structlog.get_logger(__name__)

# The intake's consumer (issue #29): each fetched zstd batch's CRC checked and records
# decompressed on worker threads as the fetch arrives (bus/prefetch.py). getmany is not
# bounded: with 250-500 records a call the workers were meant to work through the rest
# of a fetch while this loop assembles, but they need the GIL between their GIL-free
# calls and it came out no faster (benchmarks/ingest.py reads with the same settings).
INTAKE_CONSUMER: dict[str, Any] = {"decompress_ahead": True}

# Log lines carry these metrics; all of them go to rollway.metrics and the step log.
LOGGED_METRICS = ("loss", "reward_mean", "solve_rate", "entropy_full", "entropy_kept", "mismatch_kl_k3",
                  "is_ratio_mean", "is_truncated_frac", "kept_one_frac", "staleness_mean", "step_time_s",
                  "tokens_per_s")


class Trainer:
    def __init__(self, tcfg: "TrainerConfig", kafka: "KafkaConfig", *, syncer: "SyncerConfig | None" = None,
                 model_name: str = "", sink: WeightSink | None = None, core: "TrainCore | None" = None) -> None:
        """Weights go to ``sink``, else through the syncer (``syncer``, ``model_name``)."""
        if sink is None and (syncer is None or not model_name):
            raise ValueError("Trainer: give a sink, or the syncer config and model name to publish through")
        self.tcfg = tcfg
        self.kafka = kafka
        self.syncer = syncer
        self.model_name = model_name
        self._core = core
        self._sink = sink
        self.assembler: Assembler | None = None
        self.replayed: list = []
        self.checkpointer = AsyncCheckpointer(self.tcfg.checkpoint_dir, self.tcfg.keep_checkpoints)
        self.publisher: BackgroundPublisher | None = None
        self.consumer: "EventConsumer | None" = None
        self.producer: "EventProducer | None" = None
        self.watch: StepLogWatch | None = None
        self._stop = asyncio.Event()
        self._drops_held_since: float | None = None  # monotonic time the oldest held drop was seen
        # Sent with every Metrics event: the live view tells trainer processes apart by it,
        # since the assembler's count_* counters start from zero in each process.
        self.process_started_at = time.time()

    @property
    def core(self) -> "TrainCore":
        if self._core is None:
            from trainer.core import TrainCore

            self._core = TrainCore(self.tcfg)
        return self._core

    def stop(self) -> None:
        self._stop.set()
        if self.consumer is not None:
            self.consumer.stop()

    @property
    def transactional_id(self) -> str:
        return self.tcfg.transactional_id or f"{self.kafka.topic_prefix}{self.tcfg.group_id}"

    def published_version(self) -> int:
        """Newest version the samplers can have: the last publish step (0 = initial)."""
        k = self.tcfg.publish_every
        return (self.core.step // k) * k if k > 0 else 0

    # -- start-up ------------------------------------------------------------------------------
    async def restore(self) -> int:
        """Checkpoint + replay of the logged steps after it. Returns the last logged step."""
        from bus import ensure_topics

        await ensure_topics(self.kafka)
        steps = await read_step_log(self.kafka, dead_letter=True)
        last = last_contiguous_step(steps)
        core = self.core
        self.checkpointer.adopt_log({s: e.event.weights_hash for s, e in steps.items()})
        self._restore_checkpoint(steps, last)
        log.info("restoring", checkpoint_step=core.step, logged_steps=last)

        def after_replayed(result: "StepResult", row) -> None:
            # Only a step re-executed to its logged hash (on_replay_mismatch = "warn" goes on past others).
            if (self.tcfg.checkpoint_every and result.step % self.tcfg.checkpoint_every == 0
                    and steps[result.step].event.weights_hash == result.weights_hash):
                self._save_checkpoint(result.weights_hash)

        try:
            self.replayed = await replay_steps(
                self.kafka, core, steps, last, on_step=after_replayed,
                fail_on_mismatch=self.tcfg.on_replay_mismatch == "fail",
            )
        except ReplayMismatch:
            log.error("replay diverged from the log; refusing to train on", step=core.step)
            raise
        mismatches = [r.step for r in self.replayed if not r.match]
        log.info("replay done", replayed=len(self.replayed), first=self.replayed[0].step if self.replayed else None,
                 last=last, mismatches=mismatches)
        # Trained trajectories and the groups that ended (trained or dropped) from the
        # log: none is trained or dropped again after a restart.
        ends = await group_ends(self.kafka, steps)
        self.assembler = Assembler(self.tcfg, trained_ids(steps), [k for _, k in ends.trained],
                                   [(k, reason) for _, k, reason in ends.dropped], current=core.step)
        return last

    # -- live ------------------------------------------------------------------------------------
    async def run(self, max_steps: int | None = None, exit_when_idle_s: float | None = None) -> int:
        """Restore, then train until stopped, ``max_steps`` reached or idle too long.
        Returns the last step."""
        from bus import EventConsumer, EventProducer, ensure_topics

        try:
            await ensure_topics(self.kafka)
            # Fence first, then read the log: no older trainer can append after this.
            async with EventProducer(self.kafka, transactional_id=self.transactional_id) as producer:
                self.producer = producer
                # The checkpoint folder follows the log's order of trainers: claimed with
                # this producer's (id, epoch), now that every older trainer is fenced.
                self.checkpointer.claim(FolderOwnership(self.tcfg.checkpoint_dir, owner_of_producer(producer)))
                await self.restore()
                self.watch = StepLogWatch(self.kafka)
                await self.watch.start()
                try:
                    await self._run_live(producer, max_steps, exit_when_idle_s)
                finally:
                    await self.watch.stop()
        except BaseException:
            # The error that stopped the trainer is the one to report: a write failing
            # because a newer trainer replaced this one must not turn WriterFenced into
            # a checkpoint failure.
            try:
                self.checkpointer.close()
            except Exception as exc:
                log.warning("checkpoint writer stopped with an error", error=str(exc))
            raise
        self.checkpointer.close()
        return self.core.step

    async def _run_live(self, producer: "EventProducer", max_steps: int | None,
                        exit_when_idle_s: float | None) -> None:
        from bus import EventConsumer

        self.publisher = BackgroundPublisher(self._make_sink(producer))
        try:
            if self.core.step > 0 and self.tcfg.publish_every and self.core.step % self.tcfg.publish_every == 0:
                # The crash may have come before this version's publish finished, also
                # when the checkpoint covers the last logged step and nothing was
                # replayed. Re-publishing a version the store holds only re-announces it.
                await self._publish_weights()
            if max_steps is not None and self.core.step >= max_steps:
                return
            group_id = self.tcfg.group_id

            async def commit_offsets(offsets) -> None:
                await producer.send_offsets(offsets, group_id)

            consumer = EventConsumer(
                self.kafka, ["trajectories", "rewards"], group_id=group_id,
                max_poll_interval_ms=600_000, session_timeout_ms=self.tcfg.session_timeout_ms,
                heartbeat_interval_ms=max(500, self.tcfg.session_timeout_ms // 5),
                on_assign=self._on_assign, on_revoke=self._on_revoke, commit_offsets=commit_offsets,
                **INTAKE_CONSUMER,
            )
            self.consumer = consumer  # before the first assignment: _on_assign uses it
            async with consumer:
                if self._stop.is_set():
                    consumer.stop()
                await self._live(consumer, producer, max_steps, exit_when_idle_s)
                self.consumer = None
        finally:
            await self.publisher.close()

    async def _on_assign(self, assigned) -> None:
        """Prove this trainer still owns its transactional id before reading: commit the
        group's current offsets of ``assigned`` in a transaction. A zombie that rejoined
        the group (woken from a freeze) is fenced here and stops instead of holding
        partitions its successor needs."""
        consumer, producer = self.consumer, self.producer
        if not assigned or consumer is None or producer is None:
            return
        raw = consumer.raw
        try:
            # Read and re-commit inside one transaction: a step committing between the
            # two would otherwise be followed by this older value.
            async with producer.transaction():
                offsets = {}
                missing = []
                for tp in assigned:
                    committed = await raw.committed(tp)
                    if committed is None:
                        missing.append(tp)
                    else:
                        offsets[tp] = committed
                if missing:
                    # Never committed: the group starts these at the beginning anyway.
                    offsets.update(await raw.beginning_offsets(missing))
                await producer.send_offsets(offsets, self.tcfg.group_id)
        except Exception as exc:
            if producer.fenced is None:  # e.g. the broker briefly away: the next step's transaction checks again
                log.warning("ownership check on assignment failed", error=str(exc))
                return
            log.error("fenced on assignment: another trainer owns the transactional id", error=str(exc))
            consumer.stop()  # the live loop then raises producer.fenced

    async def _on_revoke(self, revoked) -> None:
        if revoked and self.assembler is not None:
            log.warning("partitions revoked; unfinished work will be re-read", buffered=self.assembler.buffered())
            self.assembler.forget_unfinished()

    def _make_sink(self, producer: "EventProducer") -> WeightSink:
        if self._sink is not None:
            return self._sink
        from syncer.config import keyframe_cadence
        from trainer.publishing import SyncerSink

        # Keyframes often enough that one bad delta cannot outlast max_staleness.
        syncer_cfg = keyframe_cadence(self.syncer, self.tcfg.max_staleness, self.tcfg.publish_every)
        return SyncerSink(syncer_cfg, self.model_name, producer)

    async def _live(self, consumer: "EventConsumer", producer: "EventProducer", max_steps: int | None,
                    exit_when_idle_s: float | None) -> None:
        assembler = self.assembler
        assert assembler is not None
        idle_since = time.monotonic()
        log.info("live", step=self.core.step, group_id=self.tcfg.group_id)
        while not consumer.stopping and not self._stop.is_set():
            self._check_sole_writer(producer)
            envs = await consumer.getmany(timeout_ms=200)
            assembler.add_many(envs)  # the batch's chunks checked at once (trainer.batch_check)
            if envs:
                idle_since = time.monotonic()
            await self._settle(consumer, assembler)
            batch = assembler.take_batch(self.core.step, self.published_version())
            await self._settle(consumer, assembler)  # stale drops are released too
            if batch is not None:
                await self._step(batch, consumer, producer)
                idle_since = time.monotonic()
                if max_steps is not None and self.core.step >= max_steps:
                    log.info("max steps reached", step=self.core.step)
                    break
            elif exit_when_idle_s is not None and time.monotonic() - idle_since > exit_when_idle_s:
                log.info("idle; exiting", step=self.core.step, buffered=assembler.buffered())
                break
            if self._drops_overdue(assembler):
                await self._log_drops(consumer, producer, "held drops over the bound")
        self._check_sole_writer(producer)
        # A clean stop logs the drops it holds: nothing the trainer decided is left
        # out of the log (a crash instead leaves them to be decided again).
        await self._log_drops(consumer, producer, "stopping")

    def _check_sole_writer(self, producer: "EventProducer") -> None:
        """Raise what showed this trainer is not the only writer (fenced, a conflicting
        weights publish)."""
        if producer.fenced is not None:
            raise producer.fenced
        if self.checkpointer.fenced is not None:
            raise self.checkpointer.fenced
        if self.publisher is not None:
            self.publisher.check()

    async def _settle(self, consumer: "EventConsumer", assembler: Assembler) -> None:
        for env, error in assembler.take_invalid():
            await consumer.dead_letter(env, error, "invalid")
        await self._ack(consumer, assembler.released())

    async def _ack(self, consumer: "EventConsumer", envelopes: Iterable[Any]) -> None:
        any_acked = False
        for env in envelopes:
            await consumer.ack(env, commit=False)
            any_acked = True
        if any_acked:
            await consumer.commit()

    async def _step(self, groups: list[Group], consumer: "EventConsumer", producer: "EventProducer") -> None:
        core = self.core
        self.checkpointer.check()  # a failed checkpoint write stops training here
        self._check_sole_writer(producer)
        result = await asyncio.to_thread(core.train_step, groups)
        assert self.assembler is not None
        metrics = dict(result.metrics)
        metrics.update({f"count_{k}": float(v) for k, v in sorted(self.assembler.counters.items())})
        metrics.update({f"buffered_{k}": float(v) for k, v in self.assembler.buffered().items()})
        metrics["published_version"] = float(self.published_version())
        released = list(self.assembler.mark_trained(groups))
        # Groups dropped since the last step go into this entry, and their records are
        # acknowledged in its transaction: a drop is never acked without being logged.
        drops, drop_envelopes = self.assembler.take_drops()
        released.extend(drop_envelopes)
        event = step_event(result.step, result.weights_hash, groups, metrics, self.tcfg.seed, drops)
        event.config_hash = training_config_hash(self.tcfg)  # a replay under other settings says so
        await self._log_step(event, released, result, metrics, consumer, producer)
        self.checkpointer.confirm(result.step, result.weights_hash)  # committed: it may be checkpointed
        log.info("train step", step=result.step, weights_hash=result.weights_hash[:16],
                 groups=len(groups), staleness_hist=result.histograms.get("staleness"),
                 **{k: round(metrics[k], 6) for k in LOGGED_METRICS})
        if self.tcfg.checkpoint_every and result.step % self.tcfg.checkpoint_every == 0:
            started = time.perf_counter()
            # Returns once the state is copied, unless the previous write is still
            # running (then waits, off the event loop so Kafka heartbeats continue).
            await asyncio.to_thread(self._save_checkpoint, result.weights_hash)
            log.info("checkpoint snapshot taken", step=result.step,
                     snapshot_s=round(time.perf_counter() - started, 4))
        if self.tcfg.publish_every and result.step % self.tcfg.publish_every == 0:
            await self._publish_weights()

    def _drops_overdue(self, assembler: Assembler) -> bool:
        """More drops held, or one held longer, than the trainer's bounds allow."""
        if not assembler.drops:
            self._drops_held_since = None
            return False
        if self._drops_held_since is None:
            self._drops_held_since = time.monotonic()
        return (len(assembler.drops) >= self.tcfg.held_drops_max
                or time.monotonic() - self._drops_held_since >= self.tcfg.held_drops_max_s)

    async def _log_drops(self, consumer: "EventConsumer", producer: "EventProducer", why: str) -> None:
        """Log the held drops without a step (``GroupsDropped``) and acknowledge their
        records in the same transaction."""
        assert self.assembler is not None
        drops, released = self.assembler.take_drops()
        self._drops_held_since = None
        if not drops:
            return
        entry = GroupsDropped(after_step=self.core.step, dropped=drops, created_at=now())

        async def body() -> None:
            await producer.publish(entry)
            await self._ack(consumer, released)

        await self._transact(producer, f"logging {len(drops)} dropped groups", body)
        log.info("dropped groups logged", groups=len(drops), after_step=self.core.step, why=why)

    async def _log_step(self, event, released: list, result: "StepResult", metrics: dict,
                        consumer: "EventConsumer", producer: "EventProducer") -> None:
        """One transaction: the step, the offsets of its records and its metrics become
        visible together, or (fenced, crashed) not at all. It must commit before anything
        depends on this step."""
        from trainer.steplog import StepAlreadyLogged

        assert self.watch is not None
        watch = self.watch
        tries = 0

        async def body() -> None:
            nonlocal tries
            tries += 1
            await watch.check(event.step)  # refuses a step number already logged
            await producer.publish(event)
            await self._ack(consumer, released)
            await producer.publish(Metrics(
                source=self.tcfg.metrics_source, step=result.step, weight_version=result.weight_version,
                values={**metrics, "process_started_at": self.process_started_at},
                histograms=result.histograms, created_at=now(),
            ))

        try:
            await self._transact(producer, f"logging step {event.step}", body)
        except StepAlreadyLogged:
            # After a commit whose acknowledgement was lost, the entry found is ours.
            if tries > 1 and watch.hashes.get(event.step) == event.weights_hash:
                return
            raise

    async def _transact(self, producer: "EventProducer", what: str, body) -> None:
        """``body`` in one transaction of the trainer's producer. A broker lost meanwhile
        is waited for: the aborted transaction is retried whole (what it writes is in
        memory, the same each time)."""
        from bus.connect import backoff_s
        from bus.producer import BROKER_AWAY

        attempt = 0
        while True:
            try:
                async with producer.transaction():
                    await body()
                return
            except BROKER_AWAY as exc:
                attempt += 1
                delay = backoff_s(attempt)
                log.warning(f"cannot reach Kafka at {self.kafka.bootstrap_servers}; {what} retried in {delay:g} s",
                            error=type(exc).__name__, attempt=attempt)
                await asyncio.sleep(delay)

    async def _publish_weights(self) -> None:
        assert self.publisher is not None
        state = await asyncio.to_thread(self._publishable_state)
        await self.publisher.submit(self.core.step, state, self.core.step)

    # -- what a sharded trainer does otherwise (trainer/ranked_service.py) ----------------------
    def _restore_checkpoint(self, steps, last: int) -> None:
        """Load the newest checkpoint the log confirms (step <= ``last``) into the core."""
        restore_newest_loadable(self.core, self.tcfg.checkpoint_dir, steps, last)

    def _save_checkpoint(self, weights_hash: str) -> None:
        """Start writing a checkpoint of the core's current (logged) step."""
        self.checkpointer.save(self.core.snapshot(), weights_hash)

    def _publishable_state(self) -> dict:
        from trainer.model import publishable_state

        return publishable_state(self.core.model, self.tcfg.publish_dtype)
