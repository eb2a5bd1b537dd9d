"""``rollway tail TOPIC``: decoded records of a topic, as JSON lines or one line each."""

from __future__ import annotations

import argparse

EXAMPLES = """\
questions it answers:
  the last 5 rewards of task-3        rollway tail rewards --last 5 --where task_id=task-3
  new rewards as they come            rollway tail rewards -f
  every solved reward, then follow    rollway tail rewards --from-beginning --where score=1 -f
  cheap solves in the last hour       rollway tail rewards --since 1h --where score=1 --where cost.turns<=3
  one chunk's token ids               rollway tail trajectories --offset 0:120 --limit 1 --decode-arrays
  held-out pass@1 per version         rollway tail evals --from-beginning --format line
  what went to the dead-letter topic  rollway tail dlq --last 20 --format line

stdout carries matching events only; records that do not decode go to stderr
(--skip-undecodable: just their count). Exit status 2 for a bad option, an unknown
topic or a --where field the topic's events do not have.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("topic", help="short name (rewards) or full topic name")
    parser.add_argument("--format", choices=["json", "line"], default="json",
                        help="json: one JSON object per line (default); line: a readable line per event")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--last", type=int, metavar="N",
                       help="the newest N matching records across all partitions, merged by record time "
                            "(default 10; with -f alone, 0: only new records)")
    start.add_argument("--from-beginning", action="store_true", help="every matching record from the oldest")
    start.add_argument("--since", help="start at a time: 10m, 2h, 1d ago, an ISO time, or epoch ms")
    start.add_argument("--offset", action="append", default=[], metavar="P:O",
                       help="start partition P at offset O (repeatable; other partitions are skipped)")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="then keep printing new records (alone: only records written from now on)")
    parser.add_argument("-n", "--limit", type=int, help="stop after N printed records")
    parser.add_argument("--key", help="only records with this key")
    parser.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE",
                        help="only events whose field matches (dotted paths; = != > < >= <=; repeatable); "
                             "field names are checked against the topic's event type")
    parser.add_argument("--meta", action="store_true",
                        help="show partition, offset, timestamp and headers (JSON: a _meta object)")
    parser.add_argument("--decode-arrays", action="store_true",
                        help="expand packed per-token arrays (token ids, log-probs, kept sets) into numbers")
    parser.add_argument("--max-width", type=int, metavar="CHARS",
                        help="line format: cut each field value to CHARS characters (default: whole)")
    parser.add_argument("--skip-undecodable", action="store_true",
                        help="do not print records that do not decode; report their count on stderr")
    parser.add_argument("--group", help="consume as this consumer group, from its committed offsets (start "
                             "options do not apply; default: join no group)")


def run(args: argparse.Namespace) -> int:
    import os
    import sys

    from bus.tail import TailError, TailOptions, run_tail
    from rollway.commands import load_config_or_exit
    from rollway.logging import configure_logging

    configure_logging("tail", level="warning")
    cfg = load_config_or_exit(args, "tail")
    try:
        opts = TailOptions(
            topic=args.topic, format=args.format, from_beginning=args.from_beginning, offsets=args.offset,
            since=args.since, last=args.last, follow=args.follow, limit=args.limit, key=args.key,
            where=args.where, meta=args.meta, decode_arrays=args.decode_arrays, group=args.group,
            skip_undecodable=args.skip_undecodable, max_width=args.max_width,
        )
        run_tail(cfg.kafka, opts, sys.stdout, sys.stderr)
    except TailError as exc:
        print(f"rollway tail: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `rollway tail ... | head`: the reader has what it wanted
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0
