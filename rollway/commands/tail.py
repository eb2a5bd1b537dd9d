"""``rollway tail TOPIC``: decoded records of a topic, as JSON lines or one line each."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topic", help="short name (rewards) or full topic name")
    parser.add_argument("--format", choices=["json", "line"], default="json",
                        help="json: one JSON object per line (default); line: a readable line per event")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--from-beginning", action="store_true", help="start at the oldest record")
    start.add_argument("--offset", action="append", default=[], metavar="P:O",
                       help="start partition P at offset O (repeatable; other partitions are skipped)")
    start.add_argument("--since", help="start at a time: 10m, 2h, 1d ago, an ISO time, or epoch ms")
    start.add_argument("--last", type=int, default=10,
                       help="default start: the last N records of each partition (default 10)")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new records")
    parser.add_argument("-n", "--limit", type=int, help="stop after N printed records")
    parser.add_argument("--key", help="only records with this key")
    parser.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE",
                        help="only events whose field matches (dotted paths; = != > < >= <=; repeatable)")
    parser.add_argument("--meta", action="store_true", help="show partition, offset, timestamp and headers")
    parser.add_argument("--decode-arrays", action="store_true",
                        help="expand packed per-token arrays (token ids, log-probs, kept sets) into numbers")
    parser.add_argument("--group", help="consume as this consumer group (default: join no group)")


def run(args: argparse.Namespace) -> int:
    import sys

    from bus.tail import TailError, TailOptions, run_tail
    from rollway.config import ConfigError, load_config
    from rollway.logging import configure_logging

    configure_logging("tail", level="warning")
    try:
        cfg = load_config(args.config)
        opts = TailOptions(
            topic=args.topic, format=args.format, from_beginning=args.from_beginning, offsets=args.offset,
            since=args.since, last=args.last, follow=args.follow, limit=args.limit, key=args.key,
            where=args.where, meta=args.meta, decode_arrays=args.decode_arrays, group=args.group,
        )
        run_tail(cfg.kafka, opts, sys.stdout)
    except (TailError, ConfigError) as exc:
        print(f"rollway tail: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `rollway tail ... | head`
        return 0
    return 0
