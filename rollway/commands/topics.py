"""``rollway topics``: create the registry's topics, or show partitions, offsets and lag."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--create", action="store_true", help="create missing Rollway topics first")
    parser.add_argument("--group", action="append", help="only these consumer groups (default: all)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import asyncio

    import msgspec

    from bus.admin import describe_topics, ensure_topics, list_rollway_topics
    from rollway.commands import load_config_or_exit
    from rollway.logging import configure_logging

    configure_logging("topics", level="warning")
    cfg = load_config_or_exit(args, "topics").kafka

    async def main():
        if args.create:
            await ensure_topics(cfg)
        names = await list_rollway_topics(cfg)
        return await describe_topics(cfg, names, args.group)

    infos = asyncio.run(main())
    if args.json:
        print(msgspec.json.encode(infos).decode())
        return 0
    print(format_topics(infos))
    return 0


def format_topics(infos) -> str:
    lines = [f"{'topic':<32} {'part':>4} {'begin':>9} {'end':>9}  group lag"]
    for info in infos:
        for p in info.partitions:
            lags = " ".join(f"{g}={p.lag(g)}(at {p.committed[g]})" for g in sorted(p.committed)) or "-"
            lines.append(f"{info.name:<32} {p.partition:>4} {p.begin_offset:>9} {p.end_offset:>9}  {lags}")
    return "\n".join(lines)
