"""``rollway up``: the whole stack as local processes (development without Docker).

Starts a local Kafka broker unless ``KAFKA_BOOTSTRAP_SERVERS`` is set, creates the
topics, builds the tiny model where the config points at a missing one, then runs the
sandbox, feeder, N samplers, trainer and the solve-rate analytics as child processes,
each logging to ``<log-dir>/<name>.log``. Ctrl-C or SIGTERM stops the children (SIGTERM,
so samplers drain and the trainer checkpoints), then the broker it started.
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samplers", type=int, default=2, help="sampler replicas")
    parser.add_argument("--log-dir", default="var/logs")
    parser.add_argument("--kafka-dir", default="var/kafka")
    parser.add_argument("--without", action="append", default=[],
                        choices=["sandbox", "feeder", "sampler", "trainer", "analytics"],
                        help="leave a component out (repeatable)")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds to wait after SIGTERM")


def plan(samplers: int, without: list[str]) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, rollway argv, extra env) of every child process."""
    procs: list[tuple[str, list[str], dict[str, str]]] = []
    if "sandbox" not in without:
        procs.append(("sandbox", ["sandbox"], {}))
    if "trainer" not in without:
        procs.append(("trainer", ["trainer"], {}))
    if "sampler" not in without:
        for i in range(samplers):
            procs.append((f"sampler-{i}", ["sampler"], {"ROLLWAY_REPLICA_ID": f"sampler-{i}"}))
    if "feeder" not in without:
        procs.append(("feeder", ["feeder"], {}))
    if "analytics" not in without:
        procs.append(("analytics", ["analytics", "solve-rate"], {}))
    return procs


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import structlog

    from bus.admin import ensure_topics
    from rollway.broker import LocalKafka, external_bootstrap
    from rollway.commands import load_config_or_exit
    from rollway.logging import configure_logging

    configure_logging("up")
    log = structlog.get_logger("rollway.up")
    cfg = load_config_or_exit(args, "up")
    env = dict(os.environ)
    if args.config:
        env["ROLLWAY_CONFIG"] = str(Path(args.config).resolve())
    kafka = None
    bootstrap = external_bootstrap()
    if bootstrap is None:
        kafka = LocalKafka(args.kafka_dir, nodes=1)
        bootstrap = kafka.start()
    env["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    cfg.kafka.bootstrap_servers = bootstrap
    children: dict[str, subprocess.Popen] = {}
    stopping = False

    def request_stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        asyncio.run(ensure_topics(cfg.kafka))
        for path in {cfg.sampler.model_path, cfg.trainer.model_path}:
            if not Path(path, "config.json").exists():
                subprocess.run([sys.executable, "-m", "rollway.cli", "model", "tiny", "--out", path],
                               env=env, check=True)
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        for name, argv, extra in plan(args.samplers, args.without):
            out = open(log_dir / f"{name}.log", "ab")
            children[name] = subprocess.Popen([sys.executable, "-m", "rollway.cli", *argv],
                                              stdout=out, stderr=subprocess.STDOUT, env={**env, **extra})
            out.close()
            log.info("started", component=name, pid=children[name].pid, log=str(log_dir / f"{name}.log"))
        print(f"rollway up: {len(children)} processes, Kafka at {bootstrap}, logs in {log_dir}/ (Ctrl-C stops)",
              flush=True)
        exit_code = 0
        while not stopping:
            for name, proc in children.items():
                if proc.poll() is not None:
                    log.error("component exited", component=name, returncode=proc.returncode)
                    exit_code = 1
                    stopping = True
            time.sleep(0.5)
        return exit_code
    finally:
        for proc in children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + args.grace
        for name, proc in children.items():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("killing component after grace period", component=name)
                proc.kill()
        if kafka is not None:
            kafka.stop()
