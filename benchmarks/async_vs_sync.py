"""Asynchronous vs synchronous RL, side by side, on the same task stream.

    .venv/bin/python benchmarks/async_vs_sync.py [--seconds 150]
    .venv/bin/python benchmarks/async_vs_sync.py --engine vllm --replicas 1

Both modes run the real system in one process against a real broker
(``$KAFKA_BOOTSTRAP_SERVERS`` or one started here): sampler replicas
(``SamplerService``: task consumer group, agent loop, recorder, chunks on Kafka, weight
subscriber), the real ``Trainer`` (assembler, staleness, step log transactions, weights
through the syncer to a local store) and the tiny model's real training step. What is
emulated is what two shared cores cannot do at accelerator speed:

* generation: the timing engine (``sampler.engine = "timing"``), tokens at
  ``--tokens-per-s`` per sequence, lognormal completion lengths;
* tools and grading: ``sandbox.timing.TimingSandbox``, lognormal latencies
  (sigma 1: one call in a hundred takes 10x the median), real ``Reward`` events;
* the trainer step: the real step, then a sleep up to ``--step-s`` (an accelerator's
  step time for a model larger than the tiny one).

``--engine vllm`` generates with the real vLLM engine (tiny model) instead.

Synchronous mode is the product option ``sampler.sync_groups_per_version`` (each
replica starts groups_per_step / replicas groups with version v, then waits for v+1)
with ``trainer.max_staleness = 0``. Asynchronous mode is the default (samplers never
wait, ``trainer.max_staleness`` bounds staleness). Measured over the steady window from
the end of the first step to the end of the run: trained groups/min, trainer busy
fraction (time inside steps), sampler idle fractions (rollout slots unused; replicas
with no rollout at all), token staleness of trained groups (mean and max), groups
dropped as stale.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from bus import EventProducer, ensure_topics  # noqa: E402
from harness import benchmark_kafka, cpu_name, load_average, print_aligned  # noqa: E402
from bus.config import KafkaConfig  # noqa: E402
from rollway.logging import configure_logging  # noqa: E402
from sampler.config import SamplerConfig, TimingConfig  # noqa: E402
from sandbox.timing import TimingSandbox, TimingSandboxConfig  # noqa: E402
from schemas import Task  # noqa: E402
from syncer.config import SyncerConfig  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.core import TrainCore  # noqa: E402

MODEL = "var/models/tiny"


@dataclass
class StepRecord:
    start: float
    end: float
    real_s: float  # the real training step, before the sleep up to step_s
    groups: int
    token_staleness_mean: float
    token_staleness_max: float
    backlog: int  # complete groups still ready when this step began (after its batch was taken)
    # Per group: seconds from its last final chunk (reward time less grading time) to
    # the end of this step (wall clock, as events carry it).
    latencies: list[float] = field(default_factory=list)


class PacedCore(TrainCore):
    """The real training step, then a sleep up to ``step_s``; every step recorded."""

    def __init__(self, cfg: TrainerConfig, step_s: float) -> None:
        super().__init__(cfg)
        self.step_s = step_s
        self.records: list[StepRecord] = []
        self.assembler_of = lambda: None  # set by the benchmark: the trainer's assembler, for the backlog


    def train_step(self, groups, seed=None):
        start = time.monotonic()
        assembler = self.assembler_of()
        backlog = len(assembler.ready) if assembler is not None else -1
        result = super().train_step(groups, seed)
        real = time.monotonic() - start
        if real < self.step_s:
            time.sleep(self.step_s - real)  # runs in the trainer's worker thread
        now = time.time()
        latencies = [now - max(m.reward.created_at - m.reward.grading_seconds for m in g.members) for g in groups]
        self.records.append(StepRecord(start, time.monotonic(), real, len(groups),
                                       result.metrics.get("staleness_mean", 0.0),
                                       result.metrics.get("staleness_max", 0.0), backlog, latencies))
        return result


@dataclass
class ModeResult:
    mode: str
    window_s: float = 0.0
    steps: int = 0
    groups: int = 0
    busy: float = 0.0
    slot_idle: float = 0.0
    replica_idle: float = 0.0
    staleness_mean: float = 0.0
    staleness_max: float = 0.0
    dropped_stale: int = 0
    dropped_other: int = 0
    real_step_s: float = 0.0
    sync_refills: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def groups_per_min(self) -> float:
        return 60.0 * self.groups / self.window_s if self.window_s > 0 else 0.0


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


async def start_engine(scfg: SamplerConfig, replica: int):
    import msgspec

    from sampler.service import make_engine

    # Each replica draws its own lengths and choices.
    scfg = msgspec.structs.replace(scfg, timing=msgspec.structs.replace(scfg.timing, seed=scfg.timing.seed + replica))
    engine = make_engine(scfg, SyncerConfig())
    await engine.start()
    return engine


async def run_mode(mode: str, args: argparse.Namespace, bootstrap: str, workdir: str) -> ModeResult:
    from sampler.service import SamplerService
    from trainer.service import Trainer

    sync = mode == "sync"
    run_id = f"bench{mode}{uuid.uuid4().hex[:6]}"
    kafka = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=f"{run_id}.", client_id=run_id,
                        partitions={"tasks": max(8, args.replicas), "trajectories": 4, "rewards": 4})
    await ensure_topics(kafka)
    syncer = SyncerConfig(store_url=f"file://{workdir}/{run_id}-weights")
    per_replica = args.groups_per_step // args.replicas
    scfg = SamplerConfig(
        engine=args.engine, model_path=MODEL, max_model_len=1024, group_id=f"{run_id}-samplers",
        max_tasks_in_flight=args.tasks_in_flight, max_in_flight=args.tasks_in_flight * args.group_size,
        max_turns=8, max_tokens_per_turn=128, max_total_tokens=1024, chunk_tokens=256,
        sync_groups_per_version=per_replica if sync else 0, sync_refill_after_s=60.0,
        timing=TimingConfig(tokens_per_s=args.tokens_per_s, median_tokens=args.median_tokens, length_sigma=0.5,
                            submit_probability=args.submit_probability, kept_set_size=8, seed=1),
        heartbeat_interval_s=5.0, consumer_session_timeout_ms=30_000,
    )
    tcfg = TrainerConfig(model_path=MODEL, group_id=f"{run_id}-trainer", checkpoint_dir=f"{workdir}/{run_id}-ckpt",
                         checkpoint_every=0, publish_every=1, groups_per_step=args.groups_per_step,
                         max_staleness=0 if sync else args.max_staleness, num_threads=1, session_timeout_ms=30_000)
    core = await asyncio.to_thread(PacedCore, tcfg, args.step_s)
    trainer = Trainer(tcfg, kafka, syncer=syncer, model_name="bench", core=core)
    core.assembler_of = lambda: trainer.assembler

    async with EventProducer(kafka, client_id=f"{run_id}-feeder") as feeder:
        await feeder.publish_many([
            Task(task_id=f"task{i}", group_id=f"task{i}/g0", group_size=args.group_size,
                 instruction=f"Make test {i} pass.", files={"solution.py": "pass\n"}, created_at=time.time())
            for i in range(args.tasks)
        ])

    engines = []
    if args.engine == "vllm":
        shared = await start_engine(scfg, 0)  # one vLLM per process; --replicas 1
        engines = [shared] * args.replicas
    else:
        for r in range(args.replicas):
            engines.append(await start_engine(scfg, r))

    samples: list[tuple[float, list[int]]] = []
    async with EventProducer(kafka, client_id=f"{run_id}-grader") as grader:
        sandbox = TimingSandbox(TimingSandboxConfig(exec_median_s=args.exec_median_s, exec_sigma=1.0,
                                                    grading_median_s=args.grading_median_s, grading_sigma=1.0,
                                                    seed=2), grader)
        services = [SamplerService(scfg, engines[r], kafka=kafka, syncer=syncer, model_name="bench",
                                   replica_id=f"{run_id}-r{r}", sandbox=sandbox) for r in range(args.replicas)]
        trainer_task = asyncio.create_task(trainer.run())
        sampler_tasks = [asyncio.create_task(s.run(install_signals=False)) for s in services]
        started = time.monotonic()
        seconds = args.sync_seconds if sync and args.sync_seconds else args.seconds
        try:
            while time.monotonic() - started < seconds:
                await asyncio.sleep(0.1)
                samples.append((time.monotonic(), [s.in_flight for s in services]))
                for t in [trainer_task, *sampler_tasks]:
                    if t.done():
                        t.result()  # a crashed component ends the benchmark with its error
                        raise RuntimeError("a component stopped early")
        finally:
            ended = time.monotonic()
            trainer.stop()
            await asyncio.wait_for(asyncio.gather(trainer_task, return_exceptions=True), 60)
            for t in sampler_tasks:
                t.cancel()
            await asyncio.gather(*sampler_tasks, return_exceptions=True)
            if args.engine != "vllm":
                for e in engines:
                    await e.close()

    res = ModeResult(mode)
    records = core.records
    if not records:
        res.notes.append("no step finished")
        return res
    w0, w1 = records[0].end, ended  # steady window: from the end of the first step
    res.window_s = w1 - w0
    inside = [r for r in records[1:] if r.end <= w1]
    res.steps = len(inside)
    res.groups = sum(r.groups for r in inside)
    res.busy = sum(overlap(r.start, r.end, w0, w1) for r in records) / res.window_s
    res.staleness_mean = statistics.fmean(r.token_staleness_mean for r in inside) if inside else 0.0
    res.staleness_max = max((r.token_staleness_max for r in inside), default=0.0)
    res.real_step_s = statistics.median(r.real_s for r in records)
    slots = scfg.max_in_flight
    window_samples = [counts for t, counts in samples if w0 <= t <= w1]
    if window_samples:
        res.slot_idle = 1 - statistics.fmean(sum(c) for c in window_samples) / (slots * args.replicas)
        res.replica_idle = statistics.fmean(sum(1 for x in c if x == 0) / len(c) for c in window_samples)
    counters = trainer.assembler.counters if trainer.assembler else {}
    res.dropped_stale = int(counters.get("groups_dropped_stale", 0))
    other = {k.removeprefix("groups_dropped_"): int(v) for k, v in counters.items()
             if k.startswith("groups_dropped_") and k != "groups_dropped_stale" and v}
    res.dropped_other = sum(other.values())
    if other:
        res.notes.append("dropped other: " + ", ".join(f"{k} {v}" for k, v in sorted(other.items())))
    backlog = [r.backlog for r in inside]
    if backlog:
        starved = sum(1 for b in backlog if b < args.groups_per_step)
        res.notes.append(f"groups ready after taking a batch: median {statistics.median(backlog):g}, "
                         f"{starved} of {len(backlog)} steps had less than a step's worth ready")
    # Gap between a step's end and the next one's start: pure overhead (step log
    # transaction, acks, batch assembly) after a step that began with a full step's
    # worth still ready; overhead plus waiting for groups otherwise.
    fed, short = [], []
    for a, b in zip(records, records[1:]):
        if w0 <= a.end and b.end <= w1:
            (fed if a.backlog >= args.groups_per_step else short).append(b.start - a.end)
    for name, gaps in (("with a step ready", fed), ("without", short)):
        if gaps:
            res.notes.append(f"gap between steps {name}: mean {statistics.fmean(gaps):.2f} s "
                             f"max {max(gaps):.2f} s ({len(gaps)} steps)")
    res.sync_refills = sum(s.sync_gate.refills for s in services if s.sync_gate is not None)
    if args.engine == "vllm" and engines:
        await engines[0].close()
    return res


def print_table(results: list[ModeResult], args: argparse.Namespace) -> None:
    print(f"\nengine={args.engine} replicas={args.replicas} tasks_in_flight/replica={args.tasks_in_flight} "
          f"group_size={args.group_size} groups_per_step={args.groups_per_step} step_s={args.step_s} "
          f"max_staleness(async)={args.max_staleness} seconds/mode={args.seconds}"
          + (f" (sync {args.sync_seconds:g})" if args.sync_seconds else ""))
    print(f"CPU: {cpu_name()}; load average before: {args.load_before}")
    header = ("mode", "window s", "steps", "groups", "groups/min", "trainer busy", "slot idle", "replica idle",
              "staleness mean", "staleness max", "dropped stale", "dropped other", "real step s", "sync refills")
    rows = [(r.mode, f"{r.window_s:.0f}", r.steps, r.groups, f"{r.groups_per_min:.1f}", f"{r.busy:.0%}",
             f"{r.slot_idle:.0%}", f"{r.replica_idle:.0%}", f"{r.staleness_mean:.2f}", f"{r.staleness_max:.0f}",
             r.dropped_stale, r.dropped_other, f"{r.real_step_s:.2f}", r.sync_refills) for r in results]
    print_aligned(header, rows)
    by = {r.mode: r for r in results}
    if "sync" in by and "async" in by and by["sync"].groups_per_min > 0:
        print(f"\nasync / sync throughput: {by['async'].groups_per_min / by['sync'].groups_per_min:.2f}x")
    for r in results:
        for note in r.notes:
            print(f"{r.mode}: {note}")


async def main(args: argparse.Namespace) -> None:
    configure_logging("bench", level=args.log_level)
    args.load_before = load_average()
    workdir = tempfile.mkdtemp(prefix="bench-async-sync-")
    with benchmark_kafka(workdir) as bootstrap:
        results = []
        for mode in args.modes.split(","):
            try:
                results.append(await run_mode(mode, args, bootstrap, workdir))
            except Exception as exc:  # the other mode still runs; the table says what failed
                results.append(ModeResult(mode, notes=[f"failed: {type(exc).__name__}: {exc}"]))
                traceback.print_exc()
            print(f"{mode} done: {results[-1].groups} groups in {results[-1].window_s:.0f} s", flush=True)
        print_table(results, args)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--engine", choices=("timing", "vllm"), default="timing")
    p.add_argument("--seconds", type=float, default=150.0, help="wall time per mode")
    p.add_argument("--sync-seconds", type=float, default=0.0,
                   help="wall time of the sync mode if not --seconds (its steps are rarer: heavy tails gate each)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--tasks-in-flight", type=int, default=4, help="groups at once per replica")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--step-s", type=float, default=4.0, help="trainer step time (real step, then sleep)")
    p.add_argument("--max-staleness", type=int, default=4, help="async mode's bound (sync: 0)")
    p.add_argument("--tasks", type=int, default=600)
    p.add_argument("--tokens-per-s", type=float, default=100.0, help="per sequence (timing engine)")
    p.add_argument("--median-tokens", type=int, default=48)
    p.add_argument("--submit-probability", type=float, default=0.34)
    p.add_argument("--exec-median-s", type=float, default=0.5)
    p.add_argument("--grading-median-s", type=float, default=1.0)
    p.add_argument("--log-level", default="error")
    args = p.parse_args()
    if args.groups_per_step % args.replicas:
        p.error("--groups-per-step must be a multiple of --replicas (sync mode splits a step's groups evenly)")
    if args.groups_per_step // args.replicas > args.tasks_in_flight:
        p.error("--tasks-in-flight must be at least groups_per_step / replicas")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
