"""``rollway config show``: the effective configuration (file + environment)."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the effective config")
    show.add_argument("--format", choices=["toml", "json"], default="toml")


def run(args: argparse.Namespace) -> int:
    import msgspec

    from rollway.commands import load_config_or_exit

    cfg = load_config_or_exit(args, "config")
    if args.format == "json":
        print(msgspec.json.format(msgspec.json.encode(cfg).decode(), indent=2))
    else:
        import tomli_w

        print(tomli_w.dumps(msgspec.to_builtins(cfg)), end="")
    return 0
