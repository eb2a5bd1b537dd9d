"""Scale simulation: many sampler replicas, the real broker, the real trainer.

    .venv/bin/python benchmarks/scale.py [--replicas 1,4,16,64] [--seconds 40]

Replicas are asyncio tasks in one process (one ``SamplerService`` each: its own
producer, task-consumer-group membership, weight subscriber and heartbeats; the timing
engine, so tokens come at ``--tokens-per-s`` per sequence; one shared
``TimingSandbox`` publishing real rewards). The trainer is a separate process (the real
``Trainer`` with the tiny model's real step, no sleep added). Per replica count, over a
steady window: events/s and MB/s per topic (read back from the broker by record
timestamp), offered groups/s (groups whose rewards all landed) vs trainer intake
(groups trained/s), tokens/s generated vs what the timing engine would emit unhindered,
the sampler process's CPU and event-loop lag (where it saturates), final chunk to
trained latency p50/p99, and the consumer-group rebalance time when one replica joins
and when it leaves (until the members' assignments cover every task partition again).

Anchors in the same run, same broker: the same TrajectoryChunk bytes produced by
Rollway's EventProducer, by plain aiokafka in its best pattern (all sends issued at
once, one gather; acks=all, idempotent, zstd, linger 5 ms) and by ``kcat`` (librdkafka;
``apt install kcat``), one message per file, same settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from async_vs_sync import MODEL, PacedCore  # noqa: E402
from bus import EventProducer, encode, ensure_topics  # noqa: E402
from bus.config import KafkaConfig  # noqa: E402
from harness import benchmark_kafka, cpu_name, load_average, print_aligned  # noqa: E402
from rollway.logging import configure_logging  # noqa: E402
from sampler.config import SamplerConfig, TimingConfig  # noqa: E402
from sandbox.timing import TimingSandbox, TimingSandboxConfig  # noqa: E402
from schemas import Task  # noqa: E402
from syncer.config import SyncerConfig  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402

TASK_PARTITIONS = 128  # more than the most replicas, so a joining member gets partitions
READ_TOPICS = ("tasks", "trajectories", "rewards", "weights", "health", "metrics", "train-steps")


# -- the trainer child process ---------------------------------------------------------------
def trainer_child(spec_path: str) -> None:
    from trainer.service import Trainer

    spec = json.loads(Path(spec_path).read_text())
    configure_logging("bench-trainer", level="error")
    kafka = msgspec.convert(spec["kafka"], KafkaConfig)
    tcfg = msgspec.convert(spec["trainer"], TrainerConfig)
    syncer = msgspec.convert(spec["syncer"], SyncerConfig)
    core = PacedCore(tcfg, 0.0)
    trainer = Trainer(tcfg, kafka, syncer=syncer, model_name="bench", core=core)
    first_step = Path(spec["out"] + ".first-step")
    train_step = core.train_step

    def marking_step(groups, seed=None):
        result = train_step(groups, seed)
        first_step.touch()  # the parent starts its window once the trainer is consuming
        return result

    core.train_step = marking_step

    async def run() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, trainer.stop)
        await trainer.run()

    asyncio.run(run())
    counters = dict(trainer.assembler.counters) if trainer.assembler else {}
    Path(spec["out"]).write_text(json.dumps({
        "records": [{"end_wall": time.time() - (time.monotonic() - r.end), "groups": r.groups, "real_s": r.real_s,
                     "latencies": r.latencies} for r in core.records],
        "counters": counters,
    }))


# -- anchors -----------------------------------------------------------------------------------
def anchor_payloads(count: int) -> list[tuple[bytes, list]]:
    from bus_throughput import make_chunk

    rng = np.random.default_rng(0)
    return [encode(make_chunk(i, 256, 8, rng)) for i in range(count)]


async def anchors(bootstrap: str, count: int, workdir: str) -> list[tuple[str, float, float]]:
    from aiokafka import AIOKafkaProducer

    from bus.codec import decode

    payloads = anchor_payloads(count)
    total_mb = sum(len(v) for v, _ in payloads) / 1e6
    rows = []
    # Rollway's producer.
    cfg = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=f"anchor{uuid.uuid4().hex[:6]}.",
                      partitions={"trajectories": 4})
    await ensure_topics(cfg)
    events = [decode(v, h) for v, h in payloads]
    async with EventProducer(cfg) as producer:
        await producer.publish_many(events[:50])  # warm-up: connections, metadata
        t0 = time.perf_counter()
        await producer.publish_many(events)
        rows.append(("rollway EventProducer.publish_many", time.perf_counter() - t0))
    topic = f"{cfg.topic_prefix}trajectories"
    # Plain aiokafka, best pattern.
    raw = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, compression_type="zstd",
                           linger_ms=5, max_request_size=cfg.max_record_bytes + 64 * 1024)
    await raw.start()
    try:
        await asyncio.gather(*[await raw.send(topic, v, headers=h) for v, h in payloads[:50]])
        t0 = time.perf_counter()
        futures = [await raw.send(topic, v, headers=h) for v, h in payloads]
        await asyncio.gather(*futures)
        rows.append(("plain aiokafka (send all, one gather)", time.perf_counter() - t0))
    finally:
        await raw.stop()
    # kcat: one message per file.
    kcat = shutil.which("kcat") or shutil.which("kafkacat")
    if kcat:
        folder = Path(workdir) / "kcat"
        folder.mkdir(exist_ok=True)
        files = []
        for i, (v, _) in enumerate(payloads):
            path = folder / f"{i:06d}.bin"
            path.write_bytes(v)
            files.append(str(path))
        headers = [x for k, val in payloads[0][1] for x in ("-H", f"{k}={val.decode()}")]
        command = [kcat, "-P", "-b", bootstrap, "-t", topic, *headers, "-X", "compression.codec=zstd",
                   "-X", "enable.idempotence=true", "-X", "acks=all", "-X", "linger.ms=5",
                   "-X", f"message.max.bytes={cfg.max_record_bytes + 64 * 1024}", *files]
        t0 = time.perf_counter()
        subprocess.run(command, check=True)
        rows.append(("kcat (librdkafka), a file per message", time.perf_counter() - t0))
    return [(name, count / s, total_mb / s) for name, s in rows]


# -- one replica count -----------------------------------------------------------------------------
def assignment(service) -> set:
    consumer = getattr(service, "_consumer", None)
    if consumer is None or not consumer._started:
        return set()
    return set(consumer.raw.assignment())


async def wait_covered(services, partitions: int, *, need_member=None, timeout: float = 120.0) -> float:
    """Seconds until the group has settled: the members' assignments are disjoint and
    cover every task partition (and ``need_member`` holds some); polled every 10 ms.
    Disjoint matters: a member keeps its old assignment until its own rejoin
    completes, so a union alone can look complete mid-rebalance."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        held = [assignment(s) for s in services]
        union = set().union(*held)
        if len(union) == partitions == sum(len(h) for h in held) \
                and (need_member is None or assignment(need_member)):
            return time.monotonic() - t0
        await asyncio.sleep(0.01)
    return float("nan")


async def read_back(kafka: KafkaConfig, w0_ms: int, w1_ms: int) -> dict[str, tuple[int, int]]:
    """(records, value bytes) per topic with a timestamp inside the window."""
    from bus.reader import read_topic_records

    out = {}
    for short in READ_TOPICS:
        records = await read_topic_records(kafka, f"{kafka.topic_prefix}{short}", timeout_ms=60_000)
        inside = [r for r in records if w0_ms <= r.timestamp <= w1_ms]
        out[short] = (len(inside), sum(len(r.value or b"") for r in inside))
    return out


async def run_scale(n: int, args: argparse.Namespace, bootstrap: str, workdir: str, tokenizer) -> dict:
    from sampler.service import SamplerService
    from sampler.timing_engine import TimingEngine

    run_id = f"scale{n}x{uuid.uuid4().hex[:6]}"
    kafka = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=f"{run_id}.", client_id=run_id,
                        partitions={"tasks": TASK_PARTITIONS, "trajectories": 8, "rewards": 8, "health": 1})
    await ensure_topics(kafka)
    syncer = SyncerConfig(store_url=f"file://{workdir}/{run_id}-weights")
    scfg = SamplerConfig(
        engine="timing", model_path=MODEL, group_id=f"{run_id}-samplers", max_tasks_in_flight=args.tasks_in_flight,
        max_in_flight=args.tasks_in_flight * args.group_size, max_turns=4, max_tokens_per_turn=128,
        max_total_tokens=1024, heartbeat_interval_s=2.0, consumer_session_timeout_ms=30_000,
        timing=TimingConfig(tokens_per_s=args.tokens_per_s, median_tokens=args.median_tokens, length_sigma=0.5,
                            submit_probability=0.5, kept_set_size=8, seed=n),
    )
    tcfg = TrainerConfig(model_path=MODEL, group_id=f"{run_id}-trainer", checkpoint_dir=f"{workdir}/{run_id}-ckpt",
                         checkpoint_every=0, publish_every=args.publish_every, groups_per_step=args.groups_per_step,
                         max_staleness=args.max_staleness, num_threads=1, session_timeout_ms=30_000)
    tasks_needed = int(n * args.tasks_in_flight * (args.seconds + 60) / 4) + 50
    async with EventProducer(kafka, client_id=f"{run_id}-feeder") as feeder:
        await feeder.publish_many([
            Task(task_id=f"task{i}", group_id=f"task{i}/g0", group_size=args.group_size, instruction=f"Task {i}.",
                 created_at=time.time()) for i in range(tasks_needed)])

    spec_path, out_path = Path(workdir) / f"{run_id}-trainer.json", Path(workdir) / f"{run_id}-trained.json"
    spec_path.write_text(json.dumps({"kafka": msgspec.to_builtins(kafka), "trainer": msgspec.to_builtins(tcfg),
                                     "syncer": msgspec.to_builtins(syncer), "out": str(out_path)}))
    child = subprocess.Popen([sys.executable, __file__, "--trainer-child", str(spec_path)])

    def new_engine(i: int) -> TimingEngine:
        engine = TimingEngine(MODEL, msgspec.structs.replace(scfg.timing, seed=1000 * n + i), max_model_len=1024)
        engine.use_tokenizer(tokenizer)
        return engine

    result: dict = {"replicas": n}
    async with EventProducer(kafka, client_id=f"{run_id}-grader") as grader:
        sandbox = TimingSandbox(TimingSandboxConfig(exec_median_s=args.exec_median_s, exec_sigma=1.0,
                                                    grading_median_s=args.grading_median_s, grading_sigma=1.0,
                                                    seed=n), grader)
        engines = [new_engine(i) for i in range(n + 1)]
        services = [SamplerService(scfg, engines[i], kafka=kafka, syncer=syncer, model_name="bench",
                                   replica_id=f"{run_id}-r{i}", sandbox=sandbox) for i in range(n + 1)]
        runs = [asyncio.create_task(s.run(install_signals=False)) for s in services[:n]]
        lags: list[float] = []
        stop_ticker = asyncio.Event()

        async def ticker() -> None:
            while not stop_ticker.is_set():
                t = time.monotonic()
                await asyncio.sleep(0.05)
                lags.append(time.monotonic() - t - 0.05)

        ticking = asyncio.create_task(ticker())
        try:
            result["initial_join_s"] = await wait_covered(services[:n], TASK_PARTITIONS)
            t_first = time.monotonic()
            while not Path(str(out_path) + ".first-step").exists():
                if child.poll() is not None:
                    raise RuntimeError(f"trainer process exited with {child.returncode} before its first step")
                if time.monotonic() - t_first > 240:
                    raise RuntimeError("no trainer step within 240 s")
                await asyncio.sleep(0.2)
            result["first_step_s"] = time.monotonic() - t_first
            await asyncio.sleep(args.warmup)
            lags.clear()
            tokens0 = sum(e.tokens_generated for e in engines)
            cpu0, w0 = time.process_time(), time.time()
            await asyncio.sleep(args.seconds)
            cpu1, w1 = time.process_time(), time.time()
            tokens1 = sum(e.tokens_generated for e in engines)
            result["lag_p99_ms"] = 1e3 * float(np.percentile(lags, 99)) if lags else float("nan")
            result["sampler_cpu"] = (cpu1 - cpu0) / (w1 - w0)
            result["tokens_per_s"] = (tokens1 - tokens0) / (w1 - w0)
            # Join, then leave, of one more replica.
            runs.append(asyncio.create_task(services[n].run(install_signals=False)))
            result["join_s"] = await wait_covered(services, TASK_PARTITIONS, need_member=services[n])
            t_leave = time.monotonic()  # from the leaver's stop, its own close included
            runs[-1].cancel()
            await asyncio.gather(runs[-1], return_exceptions=True)
            await wait_covered(services[:n], TASK_PARTITIONS)
            result["leave_s"] = time.monotonic() - t_leave
        finally:
            stop_ticker.set()
            await ticking
            child.send_signal(signal.SIGTERM)
            await asyncio.to_thread(child.wait, 120)
            for r in runs:
                r.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
    rows = await read_back(kafka, int(w0 * 1e3), int(w1 * 1e3))
    window = w1 - w0
    result["topics"] = {k: (c / window, b / window / 1e6) for k, (c, b) in rows.items()}
    result["offered_groups_per_s"] = rows["rewards"][0] / args.group_size / window
    trained = json.loads(out_path.read_text()) if out_path.exists() else {"records": [], "counters": {}}
    inside = [r for r in trained["records"] if w0 <= r["end_wall"] <= w1]
    result["intake_groups_per_s"] = sum(r["groups"] for r in inside) / window
    result["trainer_busy"] = sum(r["real_s"] for r in inside) / window
    latencies = [x for r in inside for x in r["latencies"]]
    result["latency_p50"] = float(np.percentile(latencies, 50)) if latencies else float("nan")
    result["latency_p99"] = float(np.percentile(latencies, 99)) if latencies else float("nan")
    result["nominal_tokens_per_s"] = n * args.tasks_in_flight * args.group_size * args.tokens_per_s
    result["dropped_stale"] = int(trained["counters"].get("groups_dropped_stale", 0))
    return result


def print_tables(anchor_rows, results, args) -> None:
    print(f"\nCPU: {cpu_name()}; load average before: {args.load_before}; replicas are asyncio tasks in one "
          f"process, the trainer a second process, the broker a third")
    print(f"per replica: {args.tasks_in_flight} groups x {args.group_size} rollouts in flight, "
          f"{args.tokens_per_s:g} tokens/s per sequence; trainer groups_per_step={args.groups_per_step}; "
          f"window {args.seconds:g} s after {args.warmup:g} s warm-up")
    if anchor_rows:
        print("\nAnchors (the same TrajectoryChunk bytes, same broker, one run):")
        best = max(r[1] for r in anchor_rows)
        for name, eps, mbps in anchor_rows:
            print(f"  {name:42s} {eps:9.0f} events/s {mbps:8.2f} MB/s  {eps / best:5.2f}x of the best")
    topics = [t for t in READ_TOPICS]
    header = ["replicas", *[f"{t} ev/s|MB/s" for t in topics]]
    print("\nEvents/s | MB/s per topic (read back from the broker, window by record timestamp):")
    rows = [[str(r["replicas"]), *[f"{r['topics'][t][0]:.0f}|{r['topics'][t][1]:.3f}" for t in topics]]
            for r in results]
    print_aligned(header, rows)
    header = ["replicas", "tokens/s", "of slots x rate", "sampler CPU", "loop lag p99 ms", "offered groups/s",
              "trained groups/s", "trainer busy", "dropped stale", "final->trained p50 s", "p99 s",
              "join s", "leave s", "first join s"]
    rows = [[str(r["replicas"]), f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / r['nominal_tokens_per_s']:.0%}",
             f"{r['sampler_cpu']:.0%}", f"{r['lag_p99_ms']:.0f}", f"{r['offered_groups_per_s']:.2f}",
             f"{r['intake_groups_per_s']:.2f}", f"{r['trainer_busy']:.0%}", str(r["dropped_stale"]),
             f"{r['latency_p50']:.2f}", f"{r['latency_p99']:.2f}", f"{r['join_s']:.2f}", f"{r['leave_s']:.2f}",
             f"{r['initial_join_s']:.2f}"] for r in results]
    print("\nLoad and intake:")
    print_aligned(header, rows)


async def main(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    configure_logging("bench", level=args.log_level)
    args.load_before = load_average()
    workdir = tempfile.mkdtemp(prefix="bench-scale-")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    try:
        with benchmark_kafka(workdir) as bootstrap:
            anchor_rows = []
            if args.anchor_events:
                try:
                    anchor_rows = await anchors(bootstrap, args.anchor_events, workdir)
                except Exception:
                    traceback.print_exc()
            results = []
            for n in [int(x) for x in args.replicas.split(",")]:
                try:
                    results.append(await run_scale(n, args, bootstrap, workdir, tokenizer))
                except Exception:  # report the counts that ran
                    traceback.print_exc()
                    break
                print(f"{n} replicas done", flush=True)
            print_tables(anchor_rows, results, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="1,4,16,64")
    p.add_argument("--seconds", type=float, default=30.0, help="steady window per replica count")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--tasks-in-flight", type=int, default=2, help="groups at once per replica")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--tokens-per-s", type=float, default=50.0, help="per sequence")
    p.add_argument("--median-tokens", type=int, default=48)
    p.add_argument("--exec-median-s", type=float, default=0.5)
    p.add_argument("--grading-median-s", type=float, default=0.5)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--publish-every", type=int, default=1)
    p.add_argument("--max-staleness", type=int, default=8)
    p.add_argument("--anchor-events", type=int, default=2000, help="0 = no anchors")
    p.add_argument("--log-level", default="error")
    return p.parse_args()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--trainer-child":
        trainer_child(sys.argv[2])
    else:
        asyncio.run(main(parse_args()))
