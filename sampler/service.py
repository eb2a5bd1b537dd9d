"""The sampler process: tasks in, trajectories out, weights followed, health reported.

* Replicas share ``rollway.tasks`` in one consumer group (``sampler.group_id``). A
  task (one group of ``group_size`` samples) is handled by running its samples'
  rollouts concurrently; the task's record is acked only after every sample's final
  chunk was acknowledged by the broker and graded, so a replica that dies mid-task
  leaves the offset uncommitted and the group's new owner samples the task again.
  Each delivery gets a fresh ``attempt`` id, so trajectory ids never repeat across
  attempts (the trainer groups by ``(group_id, attempt)``).
* A rebalance of the group (sticky assignment: a join or leave moves few partitions)
  revokes the replica's partitions: a task of a revoked partition not yet started is left
  to the next owner; the groups in flight get ``revoke_grace_s`` (default 0) to finish
  and commit, then go on. Once the new assignment is known, those of partitions that came
  back keep running (sampled once, here); those of partitions that moved are cancelled
  unacked and the new owner samples them (both run for the seconds in between); tasks
  done past the commit are named in it and skipped.
* SIGTERM (or SIGINT): stop taking tasks, finish the in-flight ones, commit, publish a
  ``stopped`` heartbeat, exit 0. Groups still running after ``drain_timeout_s`` are
  abandoned unacked (the task's next owner samples it again), so the replica exits
  cleanly before its supervisor's grace period ends instead of being killed mid-group.
* Heartbeats on ``rollway.health``: status, loaded weight version, in-flight
  rollouts, generated tokens/s, last weight-update pause.
* Weights: a :class:`syncer.subscriber.WeightSubscriber` follows ``rollway.weights``
  and applies each new version to the engine in place, between decoding steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from typing import TYPE_CHECKING, Awaitable, Callable

import structlog

from bus import EventConsumer, EventProducer, InvalidEvent
from sampler.agent import AgentLoop, RolloutResult
from sampler.engine import Engine
from sandbox.client import SandboxClient
from schemas import Heartbeat, Metrics, Task, now

if TYPE_CHECKING:
    from bus import Envelope
    from bus.config import KafkaConfig
    from sampler.config import SamplerConfig
    from syncer.config import SyncerConfig

log = structlog.get_logger(__name__)

MAX_GROUP_SIZE = 256


async def stop_heartbeats(loop: asyncio.Task, beat: Callable[[], Awaitable[None]]) -> None:
    """Stop a heartbeat loop and send the last beat (the status says 'stopped' by now);
    best effort: the broker may be gone at shutdown."""
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)
    try:
        await beat()
    except Exception as exc:
        log.warning("final heartbeat failed", error=str(exc))


def make_engine(scfg: "SamplerConfig", syncer: "SyncerConfig") -> Engine:
    """The configured engine (not started); vLLM applies weights as ``syncer.vllm_apply_mode`` says."""
    if scfg.engine == "vllm":
        from sampler.vllm_engine import VLLMEngine

        return VLLMEngine.from_config(scfg, apply_mode=syncer.vllm_apply_mode)
    if scfg.engine == "timing":
        from sampler.timing_engine import TimingEngine

        return TimingEngine.from_config(scfg)
    from sampler.torch_engine import TorchEngine

    return TorchEngine.from_config(scfg)


def new_attempt(replica_id: str) -> str:
    return f"{replica_id}-{uuid.uuid4().hex[:8]}"


class SyncWaitAborted(RuntimeError):
    """A task waiting at the sync gate when the replica stops. The consumer leaves a
    record whose handler fails during a stop unacknowledged: the next owner takes it."""


class SyncGate:
    """Synchronous RL on one replica (``sampler.sync_groups_per_version``): at most
    ``per_version`` groups start with each weight version; the next waits until the
    engine serves a newer one. A wait longer than ``refill_after_s`` lets one more group
    start with the same version (the trainer's step was left short, e.g. by a dropped
    group, and would otherwise never come)."""

    POLL_S = 0.02  # the engine has no version callback; this bounds the added latency

    def __init__(self, per_version: int, refill_after_s: float) -> None:
        self.per_version = per_version
        self.refill_after_s = refill_after_s
        self.version = -1
        self.started = 0  # groups started with self.version
        self.refills = 0
        self.waited_s = 0.0
        self._lock = asyncio.Lock()  # the replica's other tasks queue behind the one waiting

    async def enter(self, engine: Engine, stopping: asyncio.Event | None = None) -> int:
        """Wait for a free start with the engine's version; that version. Raises
        :class:`SyncWaitAborted` once ``stopping`` is set (a draining replica must not
        start, nor wait forever for, a group it was waiting to start)."""
        async with self._lock:
            t0 = time.monotonic()
            deadline = t0 + self.refill_after_s
            while True:
                if stopping is not None and stopping.is_set():
                    raise SyncWaitAborted("replica stopping: the task is left unacknowledged for the next owner")
                if engine.weight_version != self.version:
                    self.version, self.started = engine.weight_version, 0
                if self.started < self.per_version:
                    self.started += 1
                    self.waited_s += time.monotonic() - t0
                    return self.version
                if time.monotonic() >= deadline:
                    self.refills += 1
                    self.started -= 1
                    deadline = time.monotonic() + self.refill_after_s
                    log.warning("sync: no new weights; starting one more group with the same version",
                                version=self.version, waited_s=self.refill_after_s)
                    continue
                await asyncio.sleep(self.POLL_S)


class SamplerService:
    def __init__(self, scfg: "SamplerConfig", engine: Engine, *, kafka: "KafkaConfig", syncer: "SyncerConfig",
                 model_name: str, replica_id: str, sandbox: "SandboxClient | None" = None) -> None:
        """``syncer`` and ``model_name``: which weights to follow (``scfg.follow_weights``).
        ``sandbox``: a started client with SandboxClient's methods (benchmarks pass
        :class:`sandbox.timing.TimingSandbox`); None = the service at ``scfg.sandbox_url``."""
        self.scfg = scfg
        self.kafka = kafka
        self.syncer = syncer
        self.model_name = model_name
        self.engine = engine
        self.replica_id = replica_id
        self.status = "starting"
        self.in_flight = 0
        self.tasks_done = 0
        self.rollouts_done = 0
        self._slots = asyncio.Semaphore(self.scfg.max_in_flight)
        self._consumer: EventConsumer | None = None
        self._producer: EventProducer | None = None
        self.subscriber = None
        self.agent: AgentLoop | None = None
        self._stopped = asyncio.Event()
        self._sandbox = sandbox
        # The handler task of each group in flight, cancelled at the drain deadline.
        self._groups: set[asyncio.Task] = set()
        self._drain_deadline: asyncio.TimerHandle | None = None
        self.sync_gate = SyncGate(scfg.sync_groups_per_version, scfg.sync_refill_after_s) \
            if scfg.sync_groups_per_version else None

    # -- control -----------------------------------------------------------------------
    def request_stop(self) -> None:
        """Drain: take no new task, finish the in-flight ones, then return from run()."""
        if self.status != "draining":
            log.info("draining", in_flight=self.in_flight, deadline_s=self.scfg.drain_timeout_s)
            self._drain_deadline = asyncio.get_running_loop().call_later(self.scfg.drain_timeout_s,
                                                                         self._abandon_groups)
        self.status = "draining"
        self._stopped.set()
        if self._consumer is not None:
            self._consumer.stop()

    def _abandon_groups(self) -> None:
        """The drain deadline passed: cancel the groups still running. Their task records
        stay unacked, so the commit stops short of them and their next owner resamples."""
        if self._groups:
            log.warning("drain deadline passed; abandoning groups in flight", groups=len(self._groups),
                        in_flight=self.in_flight, deadline_s=self.scfg.drain_timeout_s)
        for group in self._groups:
            group.cancel()

    # -- main -----------------------------------------------------------------------------
    async def run(self, install_signals: bool = True) -> None:
        kafka, scfg = self.kafka, self.scfg
        if install_signals:
            from bus.connect import add_stop_handler

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                add_stop_handler(loop, sig, self.request_stop)
        own_sandbox = SandboxClient(scfg.sandbox_url, timeout_s=scfg.sandbox_request_timeout_s) \
            if self._sandbox is None else contextlib.nullcontext(self._sandbox)
        async with EventProducer(kafka, client_id=f"{kafka.client_id}-{self.replica_id}") as producer, \
                own_sandbox as sandbox:
            self._producer = producer
            self.agent = AgentLoop(self.engine, sandbox, scfg, producer.publish, replica_id=self.replica_id)
            heartbeats = asyncio.create_task(self._heartbeats(), name="heartbeats")
            weights = await self._start_weights()
            endpoint = await self._start_endpoint(producer, sandbox) if scfg.endpoint.enabled else None
            self._consumer = EventConsumer(
                kafka, ["tasks"], group_id=scfg.group_id,
                client_id=f"{kafka.client_id}-{self.replica_id}",
                session_timeout_ms=scfg.consumer_session_timeout_ms,
                heartbeat_interval_ms=scfg.consumer_heartbeat_ms,
                max_poll_interval_ms=scfg.consumer_max_poll_interval_ms,
                max_poll_records=1,
                # A rebalance: groups of partitions that come back to this replica go on;
                # those of partitions that moved are cancelled once the new assignment is
                # known (the new owner samples them), and groups done past the commit are
                # named in it so the next owner does not sample them again. The sticky
                # assignor moves only the partitions a join or leave must move.
                revoke_grace_s=scfg.revoke_grace_s,
                commit_done_offsets=True,
                sticky_assignment=True,
            )
            try:
                if not self._stopped.is_set():
                    async with self._consumer:
                        self.status = "serving"
                        await self._beat()
                        log.info("sampler serving", group_id=scfg.group_id, engine=scfg.engine,
                                 kept_set_source=self.engine.kept_set_source)
                        await self._consumer.run(self._handle, concurrency=scfg.max_tasks_in_flight)
            finally:
                self.status = "stopped"
                if endpoint is not None:
                    await endpoint.cleanup()  # open episodes are abandoned (their sessions closed)
                if self._drain_deadline is not None:
                    self._drain_deadline.cancel()
                if weights is not None:
                    self.subscriber.stop()
                    await asyncio.gather(weights, return_exceptions=True)
                    self.subscriber.close()
                    await self.subscriber.store.close()
                await stop_heartbeats(heartbeats, self._beat)
                log.info("sampler stopped", tasks=self.tasks_done, rollouts=self.rollouts_done)

    async def _start_weights(self) -> asyncio.Task | None:
        if not self.scfg.follow_weights:
            return None
        from syncer.store import open_store
        from syncer.subscriber import WeightSubscriber

        store = open_store(self.syncer.store_url, self.syncer)
        await store.start()
        self.subscriber = WeightSubscriber(self.syncer, self.model_name, store, self.engine,
                                           kafka_cfg=self.kafka)
        return asyncio.create_task(self.subscriber.run(), name="weights")

    async def _start_endpoint(self, producer: EventProducer, sandbox: SandboxClient):
        """Serve the OpenAI-compatible endpoint (docs/agents.md) beside the task loop; the
        aiohttp runner (``cleanup()`` stops it)."""
        from aiohttp import web

        from sampler.formats import load_format
        from sampler.openai_api.episodes import EpisodeRegistry
        from sampler.openai_api.server import EndpointServer

        ecfg = self.scfg.endpoint
        chat_format = load_format(self.engine.tokenizer, self.scfg.format, model_path=self.scfg.model_path)
        registry = EpisodeRegistry(self.engine, sandbox, self.scfg, ecfg, producer.publish, chat_format,
                                   replica_id=self.replica_id)
        server = EndpointServer(registry, ecfg.served_model_name or self.model_name)
        runner = web.AppRunner(server.app)
        await runner.setup()
        await web.TCPSite(runner, ecfg.host, ecfg.port).start()
        log.info("endpoint serving", url=f"http://{ecfg.host}:{ecfg.port}/v1", model=server.model_name,
                 format=chat_format.name)
        return runner

    # -- tasks ------------------------------------------------------------------------------
    async def _handle(self, env: "Envelope") -> None:
        task = env.event
        if not isinstance(task, Task):
            raise InvalidEvent(f"expected a Task on {env.topic}, got {type(task).__name__}")
        if not 1 <= task.group_size <= MAX_GROUP_SIZE:
            raise InvalidEvent(f"task {task.task_id}: group_size {task.group_size} not in [1, {MAX_GROUP_SIZE}]")
        if not task.task_id or not task.group_id:
            raise InvalidEvent("task_id and group_id must be non-empty")
        if self.sync_gate is not None:
            await self.sync_gate.enter(self.engine, self._stopped)
        attempt = new_attempt(self.replica_id)
        logger = log.bind(task_id=task.task_id, group_id=task.group_id, attempt=attempt,
                          partition=env.partition, offset=env.offset)
        # One reward phase per group: every sample is graded at the step this replica
        # served when it took the group, however long the group runs (docs/contracts.md,
        # "Reward phase"); samples waiting for a slot would otherwise start at newer versions.
        phase_step = self.engine.weight_version
        logger.info("task started", group_size=task.group_size, phase_step=phase_step)
        t0 = time.perf_counter()
        handler = asyncio.current_task()
        self._groups.add(handler)
        try:
            async with asyncio.TaskGroup() as group:
                runs = [group.create_task(self._rollout(task, i, attempt, phase_step))
                        for i in range(task.group_size)]
        finally:
            self._groups.discard(handler)
        results: list[RolloutResult] = [r.result() for r in runs]
        self.tasks_done += 1
        logger.info("task done", seconds=round(time.perf_counter() - t0, 3),
                    reasons=[r.finish_reason for r in results], scores=[r.reward.score if r.reward else None for r in results])

    async def _rollout(self, task: Task, sample_index: int, attempt: str, phase_step: int) -> RolloutResult:
        async with self._slots:
            self.in_flight += 1
            try:
                result = await self.agent.run(task, sample_index, attempt, phase_step=phase_step)
                self.rollouts_done += 1
                return result
            finally:
                self.in_flight -= 1

    # -- health ------------------------------------------------------------------------------
    def heartbeat(self, tokens_per_s: float = 0.0) -> Heartbeat:
        engine = self.engine
        sub = self.subscriber
        return Heartbeat(
            replica_id=self.replica_id,
            role="sampler",
            # A failed weight apply may have left a mix of two versions in the engine.
            status="unhealthy" if sub is not None and not sub.healthy
            else "paused" if self.status == "serving" and engine.paused else self.status,
            weight_version=engine.weight_version,
            in_flight=self.in_flight,
            tokens_per_s=round(tokens_per_s, 3),
            last_pause_ms=round(getattr(engine, "last_pause_s", 0.0) * 1e3, 3),
            updates_applied=getattr(engine, "updates_applied", 0),
            host=socket.gethostname(),
            pid=os.getpid(),
            details={
                "engine": self.scfg.engine,
                "kept_set_source": str(engine.kept_set_source),
                "tasks_done": str(self.tasks_done),
                "rollouts_done": str(self.rollouts_done),
                "weight_failures": str(sub.failures if sub is not None else 0),
                # What the replica serves, for checks against the announced hash.
                "weights_hash": sub.weights_hash if sub is not None else "",
            },
            created_at=now(),
        )

    async def _beat(self, tokens_per_s: float = 0.0) -> None:
        if self._producer is not None:
            await self._producer.publish(self.heartbeat(tokens_per_s))

    async def _heartbeats(self) -> None:
        last_tokens = getattr(self.engine, "tokens_generated", 0)
        last_applied = getattr(self.engine, "updates_applied", 0)
        last_t = time.monotonic()
        while True:
            await asyncio.sleep(self.scfg.heartbeat_interval_s)
            tokens = getattr(self.engine, "tokens_generated", 0)
            t = time.monotonic()
            rate = (tokens - last_tokens) / max(t - last_t, 1e-9)
            last_tokens, last_t = tokens, t
            try:
                await self._beat(rate)
                applied = getattr(self.engine, "updates_applied", 0)
                if applied > last_applied:
                    await self._apply_metrics(applied - last_applied, rate)
                    last_applied = applied
            except Exception as exc:  # health is best effort; never kill the sampler
                log.warning("heartbeat failed", error=str(exc))

    async def _apply_metrics(self, new_updates: int, tokens_per_s: float) -> None:
        """One Metrics event when weight updates were applied since the last beat: the
        health topic is compacted, so the pause history for plots lives on metrics."""
        engine = self.engine
        if self._producer is None:
            return
        await self._producer.publish(Metrics(
            source=f"sampler:{self.replica_id}", weight_version=engine.weight_version,
            values={"apply_pause_ms": round(getattr(engine, "last_pause_s", 0.0) * 1e3, 3),
                    "updates_applied": float(getattr(engine, "updates_applied", 0)),
                    "updates_since_last": float(new_updates), "tokens_per_s": round(tokens_per_s, 3)},
            created_at=now(),
        ))
