"""Bus throughput: Rollway's producer/consumer vs raw aiokafka moving the same bytes.

    .venv/bin/python benchmarks/bus_throughput.py [--events 2000] [--tokens 512] [--kept 16]

Each event is a realistic TrajectoryChunk: ``--tokens`` tokens with behaviour
log-probs, loss mask, version spans and kept sets of ``--kept`` ids on average. Both
paths run in the same process against the same broker (``$KAFKA_BOOTSTRAP_SERVERS`` or
a local one started here), with the same producer settings (acks=all, idempotent,
zstd, linger 5 ms); end to end = first send until the consumer has every record. The
Rollway path also encodes (msgspec) and decodes into typed events; the raw path moves
pre-encoded bytes. Ratio = Rollway / raw.

``--security`` (#32): the Rollway path on an open broker and on a secured one (SASL/SCRAM-
SHA-512 + the ACL authorizer, bus/acl.py's table; the sampler principal writes, the
trainer's reads) side by side: two local brokers started here, runs interleaved in ABBA
order, best of ``--repeats`` each; each round's topic is new, and the clock starts
``--settle`` seconds after it was created (leaders elected, positions fetched). Ratio = open seconds / secured seconds (throughput of
the secured bus relative to the open one), also per repeat (paired) with its median.
``--tls`` adds a third broker serving SASL_SSL (``rollway broker start --tls``'s setup) to the
same rotation (informational).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bus import EventConsumer, EventProducer, encode, ensure_topics
from bus.config import KafkaConfig
from bus.topics import TOPICS
from schemas import Cost, TrajectoryChunk, arrays


def make_chunk(i: int, tokens: int, kept: int, rng: np.random.Generator) -> TrajectoryChunk:
    sizes = np.clip(rng.geometric(1.0 / kept, size=tokens), 1, 4 * kept)
    sets = [rng.choice(4096, size=s, replace=False) for s in sizes]
    ids = rng.integers(0, 4096, size=tokens)
    for t, s in zip(ids, sets):
        s[0] = t  # the sampled token is in its kept set
    offsets, kept_ids = arrays.pack_csr(sets)
    starts, versions = arrays.pack_spans([7] * (tokens // 2) + [8] * (tokens - tokens // 2))
    return TrajectoryChunk(
        trajectory_id=f"traj-{i}", task_id=f"task-{i % 50}", group_id=f"task-{i % 50}/g0", sample_index=i % 8,
        group_size=8, attempt="a0", replica_id="bench", chunk_index=0,
        token_ids=arrays.pack(ids, arrays.INT32),
        logprobs=arrays.pack(-rng.exponential(1.0, size=tokens), arrays.FLOAT32),
        loss_mask=arrays.pack(np.ones(tokens), arrays.UINT8),
        kept_offsets=offsets, kept_ids=kept_ids,
        kept_capped=arrays.pack(np.zeros(tokens), arrays.UINT8),
        version_starts=starts, versions=versions, temperature=1.0, top_p=0.95,
        final=True, finish_reason="stop", cost=Cost(generated_tokens=tokens), created_at=time.time(),
    )


async def rollway_path(cfg: KafkaConfig, events: list[TrajectoryChunk], reader_cfg: KafkaConfig | None = None,
                       settle_s: float = 0.0, warmups: list[float] | None = None) -> float:
    async with EventConsumer(reader_cfg or cfg, ["trajectories"], group_id=None) as consumer, \
            EventProducer(cfg) as producer:
        got = 0
        if settle_s:
            # The new topic's leaders elected and the consumer's positions fetched before the
            # clock starts (otherwise a "NotLeaderForPartition" retry lands in the timing).
            await asyncio.sleep(settle_s)
            await consumer.getmany(timeout_ms=200)
            # The producer's first send before the clock too (one record to the DLQ
            # topic, which the reader does not read): any connection not yet open is
            # opened, and on a secured broker authenticated (SCRAM: PBKDF2 on both
            # ends), and the first produce request's set-up is paid. A long-lived
            # producer pays that once; it is not the bus's throughput.
            t0 = time.perf_counter()
            await producer.publish(events[0], topic=cfg.topic_prefix + "dlq")
            if warmups is not None:
                warmups.append(time.perf_counter() - t0)

        async def consume():
            nonlocal got
            while got < len(events):
                got += len(await consumer.getmany(timeout_ms=500))

        reader = asyncio.create_task(consume())
        start = time.perf_counter()
        await producer.publish_many(events)
        await reader
        return time.perf_counter() - start


async def raw_path(cfg: KafkaConfig, topic: str, payloads: list[tuple[bytes, bytes, list]]) -> float:
    producer = AIOKafkaProducer(bootstrap_servers=cfg.bootstrap_servers, acks="all", enable_idempotence=True,
                                compression_type="zstd", linger_ms=cfg.linger_ms,
                                max_request_size=cfg.max_record_bytes + 64 * 1024)
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=cfg.bootstrap_servers, auto_offset_reset="earliest",
                                enable_auto_commit=False, isolation_level="read_committed")
    await producer.start()
    await consumer.start()
    try:
        got = 0

        async def consume():
            nonlocal got
            while got < len(payloads):
                batch = await consumer.getmany(timeout_ms=500)
                got += sum(len(records) for records in batch.values())

        reader = asyncio.create_task(consume())
        start = time.perf_counter()
        futures = [await producer.send(topic, value=v, key=k, headers=h) for k, v, h in payloads]
        await asyncio.gather(*futures)
        await reader
        return time.perf_counter() - start
    finally:
        await producer.stop()
        await consumer.stop()


async def security_compare(args: argparse.Namespace, events: list[TrajectoryChunk], megabytes: float) -> None:
    from bus.acl import AclNames, apply
    from bus.security import load_credentials
    from rollway.broker import LocalKafka

    brokers = {"open": LocalKafka(tempfile.mkdtemp(prefix="bench-open-"), nodes=1, heap=args.heap),
               "sasl+acl": LocalKafka(tempfile.mkdtemp(prefix="bench-sasl-"), nodes=1, heap=args.heap, secure=True)}
    if args.tls:
        brokers["sasl_ssl"] = LocalKafka(tempfile.mkdtemp(prefix="bench-tls-"), nodes=1, heap=args.heap, secure=True,
                                         tls=True)
    try:
        boots = {name: kafka.start() for name, kafka in brokers.items()}
        results: dict[str, float] = {}
        runs: dict[str, list[float]] = {name: [] for name in boots}
        warmups: dict[str, list[float]] = {name: [] for name in boots}
        for run in range(args.repeats):
            # ABBA order: the drift of a busy machine (warming up, neighbours) falls on both.
            order = list(boots.items()) if run % 2 == 0 else list(reversed(boots.items()))
            for name, bootstrap in order:
                prefix = f"bench{run}{name[:2]}{os.getpid()}."
                common = dict(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions={"trajectories": 3})
                state = brokers[name].state
                if name == "open":
                    writer = reader = KafkaConfig(**common)
                    await ensure_topics(writer, [TOPICS["trajectories"], TOPICS["dlq"]])
                else:
                    secured = dict(common, credentials_file=state.credentials_file, ssl_cafile=state.ca_file)
                    admin = KafkaConfig(**secured, role="admin")
                    await ensure_topics(admin, [TOPICS["trajectories"], TOPICS["dlq"]])
                    apply(admin, AclNames(prefix=prefix), load_credentials(state.credentials_file))
                    writer = KafkaConfig(**secured, role="sampler")
                    reader = KafkaConfig(**secured, role="trainer")
                seconds = await rollway_path(writer, events, reader, settle_s=args.settle, warmups=warmups[name])
                results[name] = min(results.get(name, float("inf")), seconds)
                runs[name].append(seconds)
                print(f"run {run} {name}: {seconds:.2f} s", flush=True)
        print(f"\nbus throughput, open vs SASL/SCRAM-SHA-512 + ACLs{' (+ TLS)' if args.tls else ''}: {args.events} "
              f"TrajectoryChunk events, {args.tokens} tokens, {megabytes / args.events * 1000:.1f} KB/event, best of "
              f"{args.repeats}, interleaved; rollway bus path (sampler principal writes, trainer principal reads)")
        print(f"{'broker':<10} {'seconds':>8} {'events/s':>10} {'MB/s':>8} {'ratio':>6}")
        for name, seconds in results.items():
            print(f"{name:<10} {seconds:>8.2f} {args.events / seconds:>10.0f} {megabytes / seconds:>8.1f} "
                  f"{results['open'] / seconds:>6.2f}")
        for name in [n for n in runs if n != "open"]:
            per_round = [o / s for o, s in zip(runs["open"], runs[name])]
            print(f"paired ratios open/{name} (open seconds / {name} seconds, per round in order): "
                  f"{', '.join(f'{r:.2f}' for r in per_round)}; median {float(np.median(per_round)):.2f}, "
                  f"geometric mean {float(np.exp(np.mean(np.log(per_round)))):.2f}")
        if args.settle:
            print("the producer's first publish (its leader connection opened, authenticated where secured; "
                  "before the clock), median ms: " + ", ".join(f"{name} {1e3 * float(np.median(w)):.1f}"
                                                            for name, w in warmups.items()))
    finally:
        for kafka in brokers.values():
            kafka.stop()


async def main(args: argparse.Namespace) -> None:
    if args.security:
        rng = np.random.default_rng(0)
        events = [make_chunk(i, args.tokens, args.kept, rng) for i in range(args.events)]
        await security_compare(args, events, sum(len(encode(e)[0]) for e in events) / 1e6)
        return
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    kafka = None
    if not bootstrap:
        from rollway.broker import LocalKafka

        kafka = LocalKafka(tempfile.mkdtemp(prefix="bench-kafka-"), nodes=1, heap="1g")
        bootstrap = kafka.start()
    try:
        rng = np.random.default_rng(0)
        events = [make_chunk(i, args.tokens, args.kept, rng) for i in range(args.events)]
        encoded = [encode(e) for e in events]
        payloads = [(TOPICS["trajectories"].key_bytes(e), v, h) for e, (v, h) in zip(events, encoded)]
        megabytes = sum(len(v) for _, v, _ in payloads) / 1e6
        results = {}
        for run in range(args.repeats):
            for name in ("raw aiokafka", "rollway bus"):
                cfg = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=f"bench{run}{name[0]}{os.getpid()}.",
                                  partitions={"trajectories": 3})
                await ensure_topics(cfg, [TOPICS["trajectories"], TOPICS["dlq"]])
                if name == "rollway bus":
                    seconds = await rollway_path(cfg, events)
                else:
                    seconds = await raw_path(cfg, cfg.topic_prefix + "trajectories", payloads)
                results[name] = min(results.get(name, float("inf")), seconds)
        print(f"\nbus throughput: {args.events} TrajectoryChunk events, {args.tokens} tokens, "
              f"~{args.kept} kept ids/token, {megabytes / args.events * 1000:.1f} KB/event, "
              f"best of {args.repeats}")
        print(f"{'path':<14} {'seconds':>8} {'events/s':>10} {'MB/s':>8} {'ratio':>6}")
        base = results["raw aiokafka"]
        for name, seconds in results.items():
            print(f"{name:<14} {seconds:>8.2f} {args.events / seconds:>10.0f} {megabytes / seconds:>8.1f} "
                  f"{base / seconds:>6.2f}")
    finally:
        if kafka is not None:
            kafka.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--kept", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--security", action="store_true",
                        help="open vs SASL/SCRAM + ACLs side by side (two local brokers started here)")
    parser.add_argument("--heap", default="512m", help="JVM heap of each broker of --security")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="with --security: seconds between creating a round's topic and starting the clock")
    parser.add_argument("--tls", action="store_true",
                        help="with --security: a third broker, SASL_SSL (TLS + SCRAM + ACLs), informational")
    asyncio.run(main(parser.parse_args()))
