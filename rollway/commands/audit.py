"""``rollway audit``: does every issued group end exactly once? Read from the log alone.

Compares the groups issued on ``rollway.tasks`` with the ends the train-step log
records (``TrainStep.groups`` trained, ``TrainStep.dropped`` dropped with a reason) and
the tasks a sampler dead-lettered (``rollway.dlq``). See ``trainer.audit``.

Exit codes: 0 every issued group ended exactly once; 1 some group is unaccounted (in
flight, if the stack still runs, or lost) or ended twice, or schema-1 steps' groups are
unknown; 2 the audit could not run (an unreadable step log)."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="the whole audit as one JSON object")
    parser.add_argument("--limit", type=int, default=20, help="keys listed per problem (default 20)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    import msgspec

    from rollway.commands import load_config_or_exit
    from rollway.logging import configure_logging

    configure_logging("audit", level="warning")
    cfg = load_config_or_exit(args, "audit").kafka

    from bus import RecordMissing
    from trainer.audit import audit_groups, format_audit
    from trainer.steplog import StepLogError

    try:
        result = asyncio.run(audit_groups(cfg))
    except (StepLogError, RecordMissing) as exc:
        print(f"rollway audit: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = msgspec.to_builtins(result)
        out["ok"] = result.ok
        print(msgspec.json.encode(out).decode())
    else:
        print(format_audit(result, args.limit))
    return 0 if result.ok else 1
