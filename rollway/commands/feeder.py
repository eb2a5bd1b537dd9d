"""``rollway feeder``: publish task groups for the samplers, favouring learnable tasks."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks-dir", help="task folder, SWE-style .jsonl, or family:train / family:heldout (default: feeder.tasks_dir)")
    parser.add_argument("--group-size", type=int, help="samples per group (default: feeder.group_size)")
    parser.add_argument("--rate", type=float, help="groups per second (default: feeder.groups_per_second)")
    parser.add_argument("--max-outstanding", type=int,
                        help="pause while this many groups await rewards (default: feeder.max_outstanding_groups)")
    parser.add_argument("--max-groups", type=int, help="stop after this many groups (default: feeder.max_groups, 0 = no limit)")
    parser.add_argument("--seed", type=int, help="selection seed (default: feeder.seed)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    import sys

    from rollway.commands import given, load_config_or_exit
    from rollway.logging import configure_logging

    cfg = load_config_or_exit(args, "feeder", {"feeder": given(
        tasks_dir=args.tasks_dir, group_size=args.group_size, groups_per_second=args.rate,
        max_outstanding_groups=args.max_outstanding, max_groups=args.max_groups, seed=args.seed)})
    feeder_cfg = cfg.feeder
    configure_logging("feeder", level=cfg.logging.level)

    from tasks.feeder import Feeder
    from tasks.store import TaskFormatError, TaskStore
    from tasks.swe import SWEFormatError

    try:
        store = TaskStore(feeder_cfg.tasks_dir, family_count=feeder_cfg.family_tasks,
                          family_seed=feeder_cfg.family_seed, family_long_share=feeder_cfg.family_long_share)
        feeder = Feeder(feeder_cfg, cfg.kafka, store)
    except (TaskFormatError, SWEFormatError, ValueError) as exc:
        print(f"rollway feeder: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        from bus.connect import add_stop_handler

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            add_stop_handler(loop, sig, feeder.stop)
        reason = await feeder.run()
        print(f"feeder stopped: {reason}; published {feeder.published} groups", flush=True)
        return 0

    return asyncio.run(main())
