"""``rollway tasks check``: task hygiene through the real grader.

For each task: the reference solution must pass, the untouched repository must fail, and
the generic adversarial solutions of tasks/adversaries.py (always-equal results, lying
comparisons, C-level container copies, returning the input, reading the hidden tests, a
forged report) must not be paid. Exit status 1 when any task fails a check: a weak
hidden test is a reward hack waiting to be learned.
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tasks_command", metavar="SUBCOMMAND", required=True)
    check = sub.add_parser("check", help="grade each task's reference, untouched repo and adversarial solutions",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("source", nargs="?",
                       help="task folder, SWE-style .jsonl, or family:train / family:heldout (default: feeder.tasks_dir)")
    check.add_argument("--task", action="append", default=[], metavar="ID", help="only this task (repeatable)")
    check.add_argument("--per-kind", type=int, default=1,
                       help="for a family source: tasks per kind (default 1: each kind once)")
    check.add_argument("--solution", action="append", default=[], metavar="NAME",
                       help="only this solution: reference, untouched or an adversary's name (repeatable)")
    check.add_argument("--json", action="store_true", help="one JSON object per task instead of the table")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    import msgspec

    from rollway.commands import load_config_or_exit
    from rollway.logging import configure_logging
    from tasks.adversaries import NAMES
    from tasks.check import check_hygiene
    from tasks.family import KINDS, FamilyError, generate, parse_task_set
    from tasks.store import TaskFormatError, TaskStore
    from tasks.swe import SWEFormatError

    cfg = load_config_or_exit(args, "tasks")
    configure_logging("tasks", level="WARNING")
    source = args.source or cfg.feeder.tasks_dir
    unknown = sorted(set(args.solution) - {"reference", "untouched", *NAMES})
    if unknown:
        print(f"rollway tasks check: unknown solution(s) {unknown}; known: reference, untouched, {', '.join(NAMES)}",
              file=sys.stderr)
        return 2
    try:
        split = parse_task_set(source)
        if split is not None:
            specs = [s for kind in KINDS for s in generate(split, args.per_kind, kinds=[kind])]
        else:
            specs = list(TaskStore(source))
        if args.task:
            store = TaskStore(source) if split is None else None
            specs = [store.get(t) if store is not None else next(s for s in specs if s.task_id == t)
                     for t in args.task]
    except (TaskFormatError, SWEFormatError, FamilyError, KeyError, StopIteration, ValueError) as exc:
        print(f"rollway tasks check: {exc}", file=sys.stderr)
        return 2
    results = asyncio.run(check_hygiene(specs, cfg.sandbox, only=args.solution or None))
    defects = [d for r in results for d in r.defects]
    for r in results:
        if args.json:
            print(msgspec.json.encode({"task_id": r.task_id, "grading": r.grading, "ok": r.ok,
                                       "graded": r.graded}).decode())
            continue
        marks = " ".join(f"{g.solution}={'ok' if g.ok else 'FAIL'}{'(known)' if g.must == 'known-pass' and g.passed else ''}"
                         for g in r.graded)
        print(f"{'ok  ' if r.ok else 'FAIL'} {r.task_id} [{r.grading}] {marks}")
    if not args.json:
        print(f"{len(results)} tasks, {sum(len(r.graded) for r in results)} gradings, {len(defects)} defects")
        for d in defects:
            print("  " + d)
    return 1 if defects else 0
