"""The evaluator component: held-out pass@1 of every N-th weight version while training runs.

* Follows ``rollway.weights`` in its own consumer group (``eval.group_id``); a version v
  with ``v % eval.every_n_versions == 0`` is due. When several due versions arrived
  during an evaluation, only the newest is evaluated (the evaluator never falls further
  and further behind the trainer); the others are logged as skipped.
* Weights come from the store through the syncer's :class:`WeightSubscriber` (delta
  path from the version the engine holds, else keyframe), applied to its own engine.
* Each evaluation is :func:`sampler.evaluation.evaluate` (own sandbox sessions, nothing
  published but the ``EvalResult``), published on ``rollway.evals``; then the version's
  announcement is acked. Versions whose result (same split, model, task and sample
  counts) is already in the evals log are not evaluated again, so a restarted evaluator
  picks up where it was, and the base model (version 0) is evaluated once at the start.
* Heartbeats (role ``evaluator``) on ``rollway.health``: waiting / evaluating, version.
* SIGTERM: an evaluation in progress is abandoned (its announcement stays unacked, so it
  is evaluated again after a restart), heartbeat ``stopped``, exit 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import TYPE_CHECKING

import structlog

from bus import EventConsumer, EventProducer, read_topic
from sampler.evaluation import SandboxUnreachable, check_sandbox, eval_sampler_config, evaluate
from sampler.service import stop_heartbeats
from sandbox.client import SandboxClient
from schemas import EvalResult, Heartbeat, WeightVersion, now

if TYPE_CHECKING:
    from bus.config import KafkaConfig
    from sampler.config import EvalConfig, SamplerConfig
    from sampler.engine import Engine
    from syncer.config import SyncerConfig

log = structlog.get_logger(__name__)


class Evaluator:
    def __init__(self, ecfg: "EvalConfig", scfg: "SamplerConfig", engine: "Engine", *, kafka: "KafkaConfig",
                 syncer: "SyncerConfig", model_name: str, replica_id: str, split: str, specs: list) -> None:
        """``scfg``: the sampler's settings (the evaluation's temperature and seed are
        applied here); ``split``, ``specs``: what :func:`sampler.evaluation.load_tasks`
        gave for ``ecfg``."""
        self.ecfg = ecfg
        self.scfg = eval_sampler_config(ecfg, scfg)
        self.kafka = kafka
        self.syncer = syncer
        self.model_name = model_name
        self.engine = engine
        self.replica_id = replica_id
        self.status = "starting"
        self.split = split
        self.specs = specs
        self.evaluated: set[int] = set()
        self.last: EvalResult | None = None
        self._stop = asyncio.Event()
        self._current: asyncio.Task | None = None
        self._producer: EventProducer | None = None

    def request_stop(self) -> None:
        if not self._stop.is_set():
            log.info("evaluator stopping", status=self.status)
        self._stop.set()
        if self._current is not None:
            self._current.cancel()

    async def run(self, install_signals: bool = True) -> None:
        if install_signals:
            from bus.connect import add_stop_handler

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                add_stop_handler(loop, sig, self.request_stop)
        from syncer.store import open_store
        from syncer.subscriber import WeightSubscriber

        store = open_store(self.syncer.store_url, self.syncer)
        await store.start()
        subscriber = WeightSubscriber(self.syncer, self.model_name, store, self.engine)
        client_id = f"{self.kafka.client_id}-{self.replica_id}"
        try:
            async with EventProducer(self.kafka, client_id=client_id) as producer, \
                    SandboxClient(self.ecfg.sandbox_url or self.scfg.sandbox_url,
                                  timeout_s=self.scfg.sandbox_request_timeout_s, publish_rewards=False) as sandbox:
                self._producer = producer
                beats = asyncio.create_task(self._heartbeats(), name="heartbeats")
                try:
                    await self._serve(sandbox, subscriber)
                finally:
                    self.status = "stopped"
                    await stop_heartbeats(beats, self._beat)
        finally:
            subscriber.close()
            await store.close()
        log.info("evaluator stopped", evaluated=sorted(self.evaluated))

    async def _serve(self, sandbox: SandboxClient, subscriber) -> None:
        kafka, ecfg = self.kafka, self.ecfg
        # The sandbox may come up after us (``rollway up`` starts everything at once).
        while not self._stop.is_set():
            try:
                await check_sandbox(sandbox, self.specs)
                break
            except SandboxUnreachable as exc:
                log.warning("waiting for the sandbox", error=str(exc))
                await self._sleep(2.0)
        if self._stop.is_set():
            return
        self.evaluated = await self._already_evaluated()
        log.info("evaluator serving", split=self.split, tasks=len(self.specs), samples=ecfg.samples,
                 every_n_versions=ecfg.every_n_versions, already_evaluated=sorted(self.evaluated))
        if ecfg.evaluate_base and 0 not in self.evaluated and self.engine.weight_version == 0:
            if not await self._evaluate_current(sandbox):
                return
        consumer = EventConsumer(
            kafka, ["weights"], group_id=ecfg.group_id, client_id=f"{kafka.client_id}-{self.replica_id}",
            # An evaluation holds the poll loop for minutes; Kafka must not drop us for it.
            max_poll_interval_ms=self.scfg.consumer_max_poll_interval_ms,
        )
        async with consumer:
            while not self._stop.is_set():
                self.status = "waiting"
                envs = await consumer.getmany(timeout_ms=500)
                due = sorted({
                    e.event.version for e in envs
                    if isinstance(e.event, WeightVersion) and e.event.model == self.model_name
                    and e.event.version % ecfg.every_n_versions == 0
                    and e.event.version > subscriber.version and e.event.version not in self.evaluated
                })
                if due:
                    if len(due) > 1:
                        log.info("versions skipped: a newer one is due", skipped=due[:-1], evaluating=due[-1])
                    if not await self._evaluate_version(sandbox, subscriber, due[-1]):
                        return  # stopped mid-evaluation: leave the announcements unacked
                for env in envs:
                    await consumer.ack(env, commit=False)
                await consumer.commit()

    async def _already_evaluated(self) -> set[int]:
        """Versions with a comparable result in the evals log (same split, model, sizes)."""
        try:
            envs = await read_topic(self.kafka, "evals")
        except Exception as exc:  # a garbage record must not stop the evaluator: re-evaluating is harmless
            log.warning("cannot read the evals log; evaluating as if it were empty", error=str(exc))
            return set()
        return {
            e.event.weight_version for e in envs
            if isinstance(e.event, EvalResult) and e.event.split == self.split and e.event.model == self.model_name
            and e.event.tasks == len(self.specs) and e.event.samples == self.ecfg.samples and not e.event.errors
        }

    async def _evaluate_version(self, sandbox: SandboxClient, subscriber, version: int) -> bool:
        """False when stopped before the result was published."""
        try:
            await subscriber.update_to(version)
        except Exception as exc:  # pruned meanwhile, corrupt, not this model's shape: skip it, keep
            # serving (a crash would only come back to the same version and crash-loop the stack)
            log.error("cannot load the version to evaluate; skipped", version=version, error=repr(exc))
            return True
        return await self._evaluate_current(sandbox)

    async def _evaluate_current(self, sandbox: SandboxClient) -> bool:
        if self._stop.is_set():
            return False
        self.status = "evaluating"
        await self._beat()
        self._current = asyncio.create_task(evaluate(
            self.engine, sandbox, self.scfg, self.ecfg, self.specs, split=self.split,
            model=self.model_name, evaluator=self.replica_id,
        ))
        try:
            report = await self._current
        except asyncio.CancelledError:
            if self._stop.is_set():
                log.info("evaluation abandoned at stop", version=self.engine.weight_version)
                return False
            raise
        finally:
            self._current = None
        ref = await self._producer.publish(report.result)
        self.evaluated.add(report.result.weight_version)
        self.last = report.result
        log.info("eval result published", version=report.result.weight_version, pass_at_1=report.result.pass_at_1,
                 partition=ref.partition, offset=ref.offset)
        return True

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    def heartbeat(self) -> Heartbeat:
        details = {"split": self.split, "evaluations": str(len(self.evaluated))}
        if self.last is not None:
            details |= {"last_version": str(self.last.weight_version), "last_pass_at_1": f"{self.last.pass_at_1:.4f}"}
        return Heartbeat(
            replica_id=self.replica_id, role="evaluator", status=self.status,
            weight_version=self.engine.weight_version, host=socket.gethostname(), pid=os.getpid(),
            details=details, created_at=now(),
        )

    async def _beat(self) -> None:
        if self._producer is not None:
            await self._producer.publish(self.heartbeat())

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.ecfg.heartbeat_interval_s)
            try:
                await self._beat()
            except Exception as exc:  # health is best effort
                log.warning("heartbeat failed", error=str(exc))
