"""``rollway analytics solve-rate``: the example analytics consumer."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="report", required=True)
    solve = sub.add_parser("solve-rate", help="rolling solve rate, tokens per solved task, per weight version")
    solve.add_argument("--window", type=int, default=200, help="rolling window in rewards")
    solve.add_argument("--print-every", type=int, default=50)
    solve.add_argument("--json", dest="json_path", help="write the final report here as JSON")
    solve.add_argument("--group", help="consumer group (default rollway-analytics-solve-rate)")


def run(args: argparse.Namespace) -> int:
    from bus.analytics import run_consumers
    from bus.examples.solve_rate import SolveRate
    from rollway.config import load_config
    from rollway.logging import configure_logging

    configure_logging("analytics")
    cfg = load_config(args.config)
    app = SolveRate(window=args.window, print_every=args.print_every, json_path=args.json_path, group=args.group)
    run_consumers([app], cfg.kafka)
    return 0
