"""``rollway report``: PNG plots and a markdown summary of a run, read from the log.

Reads train steps, metrics, rewards, evals, health and dead letters with
:func:`bus.read_topic` (no consumer group, up to the topics' current ends), so it works
on a running stack as well as a finished one. On a log with nothing to plot it says so
in one line and exits 0.
"""

from __future__ import annotations

import argparse

REPORT_TOPICS = ("train-steps", "metrics", "rewards", "evals", "health", "dlq", "tasks")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="var/report", help="folder for the PNGs and summary.md (default var/report)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import sys
    from pathlib import Path

    import msgspec

    from bus import DecodeFailure, RecordMissing, read_topic
    from rollway.commands import load_config_or_exit
    from rollway.logging import configure_logging

    cfg = load_config_or_exit(args, "report")
    configure_logging("report", level="warning")
    # A broker that cannot be reached is reported in our one line; aiokafka's own
    # connection errors (and asyncio's note on the consumer they left open) only repeat it.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)

    async def read_all() -> list[object]:
        events: list[object] = []
        for topic in REPORT_TOPICS:
            try:
                events += [env.event for env in await read_topic(cfg.kafka, topic)]
            except DecodeFailure as exc:
                # read_topic stops at an undecodable record; the other topics still report.
                print(f"rollway report: skipped {topic}: {exc}", file=sys.stderr)
        return events

    try:
        events = asyncio.run(read_all())
    except Exception as exc:
        # aiokafka's connection errors share no base class with OSError.
        if type(exc).__name__ == "KafkaUnreachable":
            raise  # rollway.cli prints its one line
        if not isinstance(exc, (RecordMissing, OSError)) and not type(exc).__module__.startswith("aiokafka"):
            raise
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        print(f"rollway report: could not read the log at {cfg.kafka.bootstrap_servers}: {exc}", file=sys.stderr)
        return 1

    from rollway.report import collect, summary_markdown

    data = collect(events, trainer_source=cfg.trainer.metrics_source, window=cfg.up.solve_window,
                   length_penalty=cfg.reward.length_penalty_per_token)
    source = f"Kafka {cfg.kafka.bootstrap_servers}, topics {cfg.kafka.topic_prefix}*"
    if data.empty():
        print(f"rollway report: nothing to plot yet (no train steps, rewards, evals or apply pauses in {source})")
        return 0

    from rollway.report_plots import draw_all

    out = Path(args.out)
    plots = draw_all(data, out)
    (out / "summary.md").write_text(summary_markdown(data, plots, source))
    # The per-step figures for scripts (e.g. benchmarks/compare_runs.py): they outlive
    # the run's broker.
    (out / "steps.json").write_bytes(msgspec.json.encode({"steps": data.steps, "evals": data.evals}))
    print(f"rollway report: {len(plots)} plots, summary.md and steps.json in {out}/")
    return 0
