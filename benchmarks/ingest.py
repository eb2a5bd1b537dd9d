"""Trainer ingest: how many megabytes and tokens per second one trainer process can
consume, decode, check and assemble from the trajectories topic, next to kcat reading
the same records (issue #29).

    .venv/bin/python benchmarks/ingest.py [--producers 4] [--trajectories 1200] [--group-size 8] [--repeat 3]

1. **Records.** Rollouts of the ``benchmarks/recording_cost.py`` mix (1-4 turns of
   64-512 environment tokens and a 64-1024-token completion, kept sets of 1-200 ids,
   capped at 64; the sampled token leads its set 70% of the time, else sits at a random
   place in it) recorded by the real recorder into real ``TrajectoryChunk``s (256
   tokens, ~4-22 KiB), plus one ``Reward`` per rollout, groups of ``--group-size``.
   Built once (untimed) and split between the producers.
2. **Produce.** ``--producers`` processes, each a Rollway ``EventProducer`` (acks=all,
   idempotent, zstd, the settings of ``bus.config.KafkaConfig``) publishing its share
   with ``publish_many``, all at once, to a fresh topic pair of the broker
   (``KAFKA_BOOTSTRAP_SERVERS``, else one started here). Reported: records/s and MB/s
   of the whole write (from the first producer's start to the last one's end).
   Then the producer anchors (``--no-anchors`` skips them): the chunks alone from one
   process, each writer to a fresh 16-partition topic: Rollway's ``EventProducer``,
   plain aiokafka's best pattern (every ``send`` issued, one gather) with aiokafka's
   default 16 KiB batches and with Rollway's batch size, and ``kcat -P`` (a file per
   message), all acks=all, idempotent, zstd, ``linger_ms`` of the config.
3. **Consume**, each from the beginning of the same topics, one after the other:

   * ``kcat``: ``kcat -C -c <records>`` of each topic (one process per topic, at once)
     to ``/dev/null`` (librdkafka, C);
   * ``aiokafka``: a plain ``AIOKafkaConsumer``, ``getmany`` until every record is
     read, nothing done with them (the Python client's floor);
   * ``trainer intake``: what the trainer does per record, training off:
     ``EventConsumer.getmany`` with the trainer's intake options
     (``trainer.service.INTAKE_CONSUMER``: batches CRC-checked and decompressed on
     worker threads, ``bus/prefetch.py``), decode into events,
     ``Assembler.add_many`` (the trainer's one check of each chunk, over the whole
     batch: ``trainer.batch_check``; trajectories and groups put together),
     batches taken and marked trained as soon as groups are ready;
   * ``trainer intake, consumer before the 6th pass``: the same with a plain
     ``EventConsumer`` (aiokafka checks and decompresses every batch on the loop's
     thread; getmany hands over everything fetched);
   * ``trainer intake, assembly before #29``: the plain consumer, with the chunk check
     and assembly as they were before issue #29's intake work
     (``benchmarks/trajectory_baseline.py``, swapped into the assembler for this row).

   Then the same intake without Kafka, after and before (decode, check, assemble of the
   same records' bytes, in batches of 500; CPU time): the trainer's own share.

   The Python readers also give their rate after the first batch (the group join and
   the first fetch left out: a trainer joins once; kcat joins no group).

   MB = the records' value bytes (uncompressed, as the consumers hand them over);
   tokens = every token of the chunks (generated ones in brackets). The trainer intake
   also gives its CPU seconds (``time.process_time``): the broker shares the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import benchmark_kafka, cpu_name, load_average, print_aligned  # noqa: E402
from bus import codec  # noqa: E402
from bus.config import KafkaConfig  # noqa: E402
from bus.topics import topic_spec  # noqa: E402
from sampler.engine import SampledToken  # noqa: E402
from sampler.recorder import TrajectoryIdentity, TrajectoryRecorder  # noqa: E402
from schemas import Cost, Reward  # noqa: E402

CAP = 64
VOCAB = 151_936
SIZE_MIX = [(0.45, 1, 1), (0.25, 2, 8), (0.15, 9, 32), (0.10, 33, 64), (0.05, 65, 200)]
PARTITIONS = 16
FLEET_TOKENS_PER_ENGINE = 30_000  # one H200 serving a 7B model at batch 256 (issue #29)


def _kept_size(rng: np.random.Generator) -> int:
    probs = [p for p, _, _ in SIZE_MIX]
    _, lo, hi = SIZE_MIX[int(rng.choice(len(SIZE_MIX), p=np.array(probs) / sum(probs)))]
    return int(rng.integers(lo, hi + 1))


async def _rollout(i: int, group_size: int, rng: np.random.Generator, chunks: list) -> tuple[Reward, int, int]:
    async def publish(chunk):
        chunks.append(chunk)

    group = i // group_size
    ident = TrajectoryIdentity(trajectory_id=f"t{group}/g{group}/{i % group_size}/a", task_id=f"t{group}",
                               group_id=f"g{group}", sample_index=i % group_size, group_size=group_size,
                               attempt="a", replica_id="r0", temperature=1.0, top_p=0.95)
    rec = TrajectoryRecorder(ident, publish)
    for _ in range(int(rng.integers(1, 5))):
        await rec.add_env(rng.integers(0, VOCAB, size=int(rng.integers(64, 513))).tolist(), 0)
        for _ in range(int(rng.integers(64, 1025))):
            size = _kept_size(rng)
            capped = size > CAP
            kept = rng.integers(0, VOCAB, size=CAP + 1 if capped else size).astype(np.int32)
            # The sampler records a set most likely first: its token leads it when it was
            # the most likely (70%, as in recording_cost.py), else sits further in.
            pick = 0 if rng.random() < 0.7 else int(rng.integers(0, kept.size))
            await rec.add_sampled(SampledToken(0, int(kept[pick]), -0.5, kept, capped, 0))
    await rec.finish("stop", Cost(generated_tokens=rec.generated_tokens, env_tokens=rec.env_tokens))
    reward = Reward(trajectory_id=ident.trajectory_id, task_id=ident.task_id, group_id=ident.group_id,
                    sample_index=ident.sample_index, attempt="a", score=float(i % 2), reward=float(i % 2),
                    weight_version=0, cost=Cost(generated_tokens=rec.generated_tokens, env_tokens=rec.env_tokens))
    return reward, rec.generated_tokens, rec.env_tokens


def build_records(trajectories: int, group_size: int, seed: int) -> tuple[list, int, int]:
    """The events to publish (chunks of each rollout then its reward), generated and
    environment token counts."""
    rng = np.random.default_rng(seed)
    events: list = []
    generated = env = 0

    async def build() -> None:
        nonlocal generated, env
        for i in range(trajectories):
            chunks: list = []
            reward, g, e = await _rollout(i, group_size, rng, chunks)
            events.extend(chunks)
            events.append(reward)
            generated += g
            env += e

    asyncio.run(build())
    return events, generated, env


def _producer_main(cfg_bytes: bytes, path: str, ready: "mp.Queue", start: "mp.synchronize.Event",
                   out: "mp.Queue") -> None:
    """One producer process: publish the pickled events in ``path`` with EventProducer."""
    import pickle

    import msgspec

    from bus.producer import EventProducer

    cfg = msgspec.json.decode(cfg_bytes, type=KafkaConfig)
    events = pickle.loads(Path(path).read_bytes())

    async def run() -> tuple[float, float]:
        async with EventProducer(cfg, client_id=f"ingest-{os.getpid()}") as producer:
            ready.put(os.getpid())
            start.wait()
            t0 = time.time()
            await producer.publish_many(events)
            return t0, time.time()

    out.put(asyncio.run(run()))


def produce(cfg: KafkaConfig, events: list, producers: int, workdir: str) -> float:
    """Publish ``events`` from ``producers`` processes at once; wall seconds of the write."""
    import pickle

    import msgspec

    ctx = mp.get_context("spawn")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    # Whole trajectories per producer (a rollout's chunks come from one sampler).
    shares: list[list] = [[] for _ in range(producers)]
    current: list = []
    n = 0
    for ev in events:
        current.append(ev)
        if isinstance(ev, Reward):
            shares[n % producers].extend(current)
            current, n = [], n + 1
    procs = []
    for k, share in enumerate(shares):
        path = f"{workdir}/share{k}.pkl"
        Path(path).write_bytes(pickle.dumps(share))
        p = ctx.Process(target=_producer_main, args=(msgspec.json.encode(cfg), path, ready, start, out))
        p.start()
        procs.append(p)
    for _ in procs:  # every producer connected: the write is timed from the start signal
        ready.get(timeout=300)
    start.set()
    spans = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return max(b for _, b in spans) - min(a for a, _ in spans)


async def produce_anchors(bootstrap: str, events: list, workdir: str) -> list[tuple[str, float]]:
    """Seconds to write the chunks of ``events`` from one process: Rollway's
    EventProducer, plain aiokafka's best pattern (every send issued, one gather) with
    aiokafka's default batch size and with Rollway's, and kcat (a file per message);
    each to a fresh topic, acks=all, idempotent, zstd, linger as configured."""
    from aiokafka import AIOKafkaProducer

    from bus.admin import ensure_topics
    from bus.producer import EventProducer

    chunks = [e for e in events if not isinstance(e, Reward)]
    payloads = [codec.encode(e) for e in chunks]
    rows: list[tuple[str, float]] = []

    async def fresh_topic() -> tuple[KafkaConfig, str]:
        cfg = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=f"ingestp{uuid.uuid4().hex[:8]}.",
                          partitions={"trajectories": PARTITIONS})
        await ensure_topics(cfg, [topic_spec("trajectories")])
        return cfg, topic_spec("trajectories").name(cfg.topic_prefix)

    batch = EventProducer(cfg := KafkaConfig(bootstrap_servers=bootstrap))._client_kwargs.get("max_batch_size", 16384)
    for name, max_batch in ((f"Rollway EventProducer.publish_many (batch {batch // 1024} KiB)", batch),
                            ("Rollway EventProducer.publish_many, 16 KiB batches (before #29)", 16384)):
        cfg, topic = await fresh_topic()
        producer = EventProducer(cfg)
        producer._client_kwargs["max_batch_size"] = max_batch  # (the benchmark's "before" row only)
        async with producer:
            # Warm-up: connections, metadata, every partition's leader known.
            await asyncio.gather(*(producer.publish_raw(topic, v, headers=h, partition=p)
                                   for p, (v, h) in enumerate(payloads[:PARTITIONS])))
            t0 = time.perf_counter()
            await producer.publish_many(chunks)
            rows.append((name, time.perf_counter() - t0))
    for name, max_batch in (("plain aiokafka, default batch (16 KiB)", 16384),
                            (f"plain aiokafka, batch {batch // 1024} KiB", batch)):
        cfg, topic = await fresh_topic()
        raw = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True,
                               compression_type=cfg.compression or None, linger_ms=cfg.linger_ms,
                               max_request_size=max(cfg.max_record_bytes + 64 * 1024, 1024 * 1024),
                               max_batch_size=max_batch)
        await raw.start()
        try:
            await asyncio.gather(*[await raw.send(topic, v, headers=h, partition=p)
                                   for p, (v, h) in enumerate(payloads[:PARTITIONS])])
            t0 = time.perf_counter()
            futures = [await raw.send(topic, v, headers=h) for v, h in payloads]
            await asyncio.gather(*futures)
            rows.append((name, time.perf_counter() - t0))
        finally:
            await raw.stop()
    kcat = shutil.which("kcat") or shutil.which("kafkacat")
    if kcat:
        cfg, topic = await fresh_topic()
        folder = Path(workdir) / "kcat"
        folder.mkdir(exist_ok=True)
        files = []
        for i, (v, _) in enumerate(payloads):
            path = folder / f"{i:06d}.bin"
            path.write_bytes(v)
            files.append(str(path))
        headers = [x for k, val in payloads[0][1] for x in ("-H", f"{k}={val.decode()}")]
        command = [kcat, "-P", "-b", bootstrap, "-t", topic, *headers, "-X", f"compression.codec={cfg.compression}",
                   "-X", "enable.idempotence=true", "-X", "acks=all", "-X", f"linger.ms={cfg.linger_ms}",
                   "-X", f"message.max.bytes={cfg.max_record_bytes + 64 * 1024}", *files]
        t0 = time.perf_counter()
        subprocess.run(command, check=True, timeout=600)
        rows.append(("kcat (librdkafka), a file per message", time.perf_counter() - t0))
    return rows


def topics_of(cfg: KafkaConfig) -> list[str]:
    return [topic_spec(t, cfg.topic_prefix).name(cfg.topic_prefix) for t in ("trajectories", "rewards")]


def consume_kcat(cfg: KafkaConfig, counts: list[int]) -> float | None:
    """Wall seconds of ``kcat -C`` reading ``counts`` records of each topic (``-c``: it
    stops at the last one instead of waiting out end-of-partition fetches), both topics
    at once (two processes)."""
    kcat = shutil.which("kcat") or shutil.which("kafkacat")
    if not kcat:
        return None
    t0 = time.perf_counter()
    procs = [subprocess.Popen([kcat, "-C", "-b", cfg.bootstrap_servers, "-t", topic, "-o", "beginning",
                               "-c", str(count), "-q"], stdout=subprocess.DEVNULL)
             for topic, count in zip(topics_of(cfg), counts)]
    for p in procs:
        if p.wait(timeout=600):
            raise RuntimeError(f"kcat exited {p.returncode}")
    return time.perf_counter() - t0


async def consume_aiokafka(cfg: KafkaConfig, records: int) -> tuple[float, float]:
    """(wall s, records/s after the first batch) of a plain consumer reading every record."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(*topics_of(cfg), bootstrap_servers=cfg.bootstrap_servers,
                                group_id=f"ingest-raw-{uuid.uuid4().hex[:8]}", auto_offset_reset="earliest",
                                enable_auto_commit=False, isolation_level="read_committed")
    await consumer.start()
    try:
        seen = 0
        t0 = time.perf_counter()
        first: tuple[float, int] | None = None
        while seen < records:
            batches = await consumer.getmany(timeout_ms=1000)
            seen += sum(len(b) for b in batches.values())
            if first is None and seen:
                first = time.perf_counter(), seen
        end = time.perf_counter()
        return end - t0, _after_first(first, seen, end)
    finally:
        await consumer.stop()


@contextlib.contextmanager
def assembly(baseline: bool):
    """The assembler's chunk check and assembly as they are (``trainer/trajectory.py``),
    or, with ``baseline``, as they were before issue #29's intake work
    (``benchmarks/trajectory_baseline.py``; the benchmark's "before" rows only)."""
    import trainer.assembler as assembler_module

    saved = assembler_module.check_chunk, assembler_module.assemble, assembler_module.check_chunks
    if baseline:
        from benchmarks import trajectory_baseline

        def one_by_one(chunks):  # (before #29 there was no batch check: each chunk on its own)
            out = []
            for c in chunks:
                try:
                    out.append(trajectory_baseline.check_chunk(c))
                except ValueError as exc:
                    out.append(exc)
            return out

        assembler_module.check_chunk, assembler_module.assemble, assembler_module.check_chunks = (
            trajectory_baseline.check_chunk, trajectory_baseline.assemble, one_by_one)
    try:
        yield
    finally:
        assembler_module.check_chunk, assembler_module.assemble, assembler_module.check_chunks = saved


def intake_in_process(payloads: list[tuple[bytes, list]], group_size: int, baseline: bool) -> tuple[float, int]:
    """(CPU s, groups trained) of the trainer's intake without Kafka: each record's
    value decoded (``bus.codec.decode``) and added to an ``Assembler`` in batches of
    500 records (as ``getmany`` hands them over), groups taken as soon as ready."""
    from bus.consumer import Envelope
    from trainer.assembler import Assembler
    from trainer.config import TrainerConfig

    with assembly(baseline):
        assembler = Assembler(TrainerConfig(groups_per_step=1), current=0)
        trained = 0
        t0 = time.process_time()
        for start in range(0, len(payloads), 500):
            envs = []
            for offset, (value, headers) in enumerate(payloads[start:start + 500], start):
                headers = tuple(headers)  # as EventConsumer hands them over
                envs.append(Envelope(codec.decode(value, headers), "trajectories", 0, offset, 0, None, headers))
            assembler.add_many(envs)
            while (batch := assembler.take_batch(0, 0)) is not None:
                assembler.mark_trained(batch)
                trained += len(batch)
        cpu = time.process_time() - t0
    if assembler.invalid or trained != len([1 for v, h in payloads if codec.event_type_of(h) is Reward]) // group_size:
        raise RuntimeError(f"the in-process intake put together {trained} groups ({len(assembler.invalid)} invalid)")
    return cpu, trained


async def consume_trainer(cfg: KafkaConfig, records: int, group_size: int, baseline: bool = False,
                          consumer_options: dict | None = None) -> tuple[float, float, int, int, float]:
    """(wall s, CPU s, groups trained, records checked) of the trainer's intake
    (``baseline``: the chunk check and assembly before issue #29's intake work;
    ``consumer_options``: the EventConsumer's, by default the trainer's,
    ``trainer.service.INTAKE_CONSUMER``; ``{}`` reads as before the sixth pass: every
    batch's CRC and decompression on the loop's thread)."""
    if consumer_options is None:
        from trainer.service import INTAKE_CONSUMER

        consumer_options = INTAKE_CONSUMER
    with assembly(baseline):
        return await _consume_trainer(cfg, records, group_size, consumer_options)


def _after_first(first: tuple[float, int] | None, seen: int, end: float) -> float:
    """Records/s from the first batch's arrival to the end (the group join and the first
    fetch left out), 0 when everything came in one batch."""
    if first is None or seen == first[1] or end <= first[0]:
        return 0.0
    return (seen - first[1]) / (end - first[0])


async def _consume_trainer(cfg: KafkaConfig, records: int, group_size: int,
                           consumer_options: dict) -> tuple[float, float, int, int, float]:
    from bus.consumer import EventConsumer
    from trainer.assembler import Assembler
    from trainer.config import TrainerConfig

    tcfg = TrainerConfig(groups_per_step=1)
    assembler = Assembler(tcfg, current=0)
    consumer = EventConsumer(cfg, ["trajectories", "rewards"], group_id=f"ingest-{uuid.uuid4().hex[:8]}",
                             dead_letters=False, **consumer_options)
    await consumer.start()
    try:
        seen = trained = 0
        t0, c0 = time.perf_counter(), time.process_time()
        first: tuple[float, int] | None = None
        while seen < records:
            envs = await consumer.getmany(timeout_ms=1000)
            if first is None and envs:
                first = time.perf_counter(), len(envs)  # (this batch's own work counts after it)
            assembler.add_many(envs)  # (as trainer.service does with each getmany batch)
            seen += len(envs)
            while (batch := assembler.take_batch(0, 0)) is not None:
                assembler.mark_trained(batch)
                trained += len(batch)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if assembler.invalid:
            raise RuntimeError(f"the trainer refused {len(assembler.invalid)} records: {assembler.invalid[0][1]}")
        return wall, cpu, trained, seen, _after_first(first, seen, t0 + wall)
    finally:
        await consumer.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--trajectories", type=int, default=1200)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="consume runs of each reader (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-anchors", dest="anchors", action="store_false",
                    help="skip the one-process produce comparison (Rollway / aiokafka / kcat)")
    args = ap.parse_args(argv)
    if args.trajectories % args.group_size:
        ap.error("--trajectories must be a multiple of --group-size (whole groups)")

    print(f"CPU: {cpu_name()}; load average before: {load_average()}")
    t0 = time.perf_counter()
    events, generated, env_tokens = build_records(args.trajectories, args.group_size, args.seed)
    sizes = [len(codec.encode(e)[0]) for e in events]
    nbytes = sum(sizes)
    chunk_sizes = [s for s, e in zip(sizes, events) if not isinstance(e, Reward)]
    tokens = generated + env_tokens
    print(f"records: {len(events)} ({len(chunk_sizes)} chunks, median {statistics.median(chunk_sizes) / 1024:.1f} "
          f"KiB, p90 {np.percentile(chunk_sizes, 90) / 1024:.1f} KiB; {args.trajectories} rewards), "
          f"{nbytes / 1e6:.1f} MB, {tokens} tokens ({generated} generated); built in {time.perf_counter() - t0:.0f} s")

    with tempfile.TemporaryDirectory(prefix="rollway-ingest-") as workdir, benchmark_kafka(workdir) as bootstrap:
        from bus.admin import ensure_topics

        cfg = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=f"ingest{uuid.uuid4().hex[:8]}.",
                          partitions={"trajectories": PARTITIONS, "rewards": PARTITIONS})
        asyncio.run(ensure_topics(cfg, [topic_spec("trajectories"), topic_spec("rewards")]))
        write_s = produce(cfg, events, args.producers, workdir)
        print(f"produced by {args.producers} EventProducer processes in {write_s:.2f} s: "
              f"{len(events) / write_s:,.0f} records/s, {nbytes / write_s / 1e6:.1f} MB/s")

        if args.anchors:
            anchor_rows = asyncio.run(produce_anchors(bootstrap, events, workdir))
            chunk_mb = sum(chunk_sizes) / 1e6
            kcat_w = dict(anchor_rows).get("kcat (librdkafka), a file per message")
            print(f"\nproduce, one process, the {len(chunk_sizes)} chunks ({chunk_mb:.1f} MB), each to a fresh topic:")
            print_aligned(["producer", "seconds", "records/s", "MB/s", "of kcat"],
                          [[name, f"{w:.2f}", f"{len(chunk_sizes) / w:,.0f}", f"{chunk_mb / w:.1f}",
                            f"{kcat_w / w:.2f}x" if kcat_w else "-"] for name, w in anchor_rows])

        # The numba kernels loaded (~0.13 s a process) before any timed row: the first
        # intake row read would pay for it otherwise.
        intake_in_process([codec.encode(e) for e in events], args.group_size, baseline=False)
        from trainer.service import INTAKE_CONSUMER

        before = "trainer intake, assembly before #29"
        plain = "trainer intake, consumer before the 6th pass"
        intakes = {"trainer intake": INTAKE_CONSUMER, plain: {}, before: {}}
        runs: dict[str, list[float]] = {"kcat": [], "aiokafka": [], **{name: [] for name in intakes}}
        cpu: dict[str, list[float]] = {name: [] for name in intakes}
        steady: dict[str, list[float]] = {"aiokafka": [], **{name: [] for name in intakes}}
        for i in range(args.repeat):
            k = consume_kcat(cfg, [len(chunk_sizes), args.trajectories])
            if k is not None:
                runs["kcat"].append(k)
            wall, rate = asyncio.run(consume_aiokafka(cfg, len(events)))
            runs["aiokafka"].append(wall)
            steady["aiokafka"].append(rate)
            # (the intake's consumers in turn first: none always reads right after another)
            order = list(intakes) if i % 2 == 0 else [plain, "trainer intake", before]
            for name in order:
                wall, c, trained, seen, rate = asyncio.run(consume_trainer(
                    cfg, len(events), args.group_size, baseline=name == before, consumer_options=intakes[name]))
                if trained != args.trajectories // args.group_size:
                    raise RuntimeError(f"{name} put together {trained} groups of {args.trajectories // args.group_size}")
                runs[name].append(wall)
                cpu[name].append(c)
                steady[name].append(rate)

    kcat_s = statistics.median(runs["kcat"]) if runs["kcat"] else None
    rows = []
    for name, secs in runs.items():
        if not secs:
            rows.append([name, "-", "-", "-", "-", "not installed"])
            continue
        s = statistics.median(secs)
        after_first = statistics.median(steady[name]) * nbytes / len(events) / 1e6 if steady.get(name) else None
        rows.append([name, f"{s:.2f}", f"{nbytes / s / 1e6:.1f}", f"{tokens / s / 1e3:,.0f}k ({generated / s / 1e3:,.0f}k)",
                     f"{len(events) / s:,.0f}", f"{kcat_s / s:.2f}x" if kcat_s else "-",
                     f"{after_first:.1f}" if after_first else "-"])
    print(f"\nconsume (median of {args.repeat}; CPU s: the trainer intake {statistics.median(cpu['trainer intake']):.2f}, "
          f"with the consumer before the 6th pass {statistics.median(cpu[plain]):.2f}, "
          f"with the consumer and assembly before #29 {statistics.median(cpu[before]):.2f}):")
    print_aligned(["reader", "seconds", "MB/s", "tokens/s (generated)", "records/s", "of kcat",
                   "MB/s after the 1st batch"], rows)
    print("(MB/s after the 1st batch: the records after the first batch over the time from its arrival to the end, "
          "at the mean record size: the group join and first fetch left out; kcat joins no group)")

    # The same intake without Kafka (decode, check, assemble; CPU time), before/after
    # interleaved: what the trainer's own code costs, apart from the client's.
    payloads = [codec.encode(e) for e in events]
    local: dict[str, list[float]] = {"after": [], "before": []}
    for _ in range(args.repeat):
        for name in ("after", "before"):
            local[name].append(intake_in_process(payloads, args.group_size, baseline=name == "before")[0])
    b, a = statistics.median(local["before"]), statistics.median(local["after"])
    print(f"\nwithout Kafka (decode + check + assemble, CPU s, median of {args.repeat}): before #29's intake work "
          f"{b:.3f} s ({nbytes / b / 1e6:.1f} MB/s), now {a:.3f} s ({nbytes / a / 1e6:.1f} MB/s): {b / a:.2f}x")
    s = statistics.median(runs["trainer intake"])
    gen_rate = generated / s
    print(f"\nthe trainer intake drinks {gen_rate / 1e3:,.0f}k generated tokens/s; a fleet of 8 engines at "
          f"{FLEET_TOKENS_PER_ENGINE // 1000}k tokens/s makes {8 * FLEET_TOKENS_PER_ENGINE / 1e3:,.0f}k "
          f"({8 * FLEET_TOKENS_PER_ENGINE / gen_rate:.2f}x of it), of 64 engines "
          f"{64 * FLEET_TOKENS_PER_ENGINE / 1e3:,.0f}k ({64 * FLEET_TOKENS_PER_ENGINE / gen_rate:.2f}x)")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
