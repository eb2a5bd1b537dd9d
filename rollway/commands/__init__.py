"""Subcommands of the ``rollway`` CLI (one module each, heavy imports deferred)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollway.config import RollwayConfig


def load_config_or_exit(args: argparse.Namespace, command: str) -> "RollwayConfig":
    """The effective config, or exit 2 with the reason (a bad file or override)."""
    import sys

    from rollway.config import ConfigError, load_config

    try:
        return load_config(args.config)
    except ConfigError as exc:
        print(f"rollway {command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
