"""``rollway analytics solve-rate``: the example analytics consumer."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="report", required=True)
    solve = sub.add_parser("solve-rate", help="rolling solve rate, tokens per solved task, per weight version")
    solve.add_argument("--window", type=int, default=200, help="rolling window in rewards")
    solve.add_argument("--print-every", type=int, default=50)
    solve.add_argument("--json", dest="json_path", help="write the final report here as JSON")
    solve.add_argument("--until-end", action="store_true",
                       help="stop once the rewards present at start are read: a one-shot report")
    solve.add_argument("--log-level", default="info", help="log level of the JSON logs on stderr")


def run(args: argparse.Namespace) -> int:
    from bus.examples.solve_rate import SolveRate
    from rollway.commands import load_config_or_exit
    from rollway.consumers import run_consumers

    cfg = load_config_or_exit(args, "analytics")
    app = SolveRate(window=args.window, print_every=args.print_every, json_path=args.json_path)
    run_consumers([app], cfg.kafka, until_end=args.until_end, log_level=args.log_level, argv=[])
    return 0
