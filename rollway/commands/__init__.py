"""Subcommands of the ``rollway`` CLI (one module each, heavy imports deferred)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollway.config import RollwayConfig


def given(**values: Any) -> dict[str, Any]:
    """The flags the user gave (argparse leaves the others None)."""
    return {key: value for key, value in values.items() if value is not None}


def load_config_or_exit(args: argparse.Namespace, command: str,
                        overrides: dict[str, Any] | None = None) -> "RollwayConfig":
    """The effective config: file + environment + this command's flags (``overrides``,
    ``{section: {field: value}}``; None and empty sections are left out), validated
    together; or exit 2 with one line naming the bad key. Every command loads its config
    here."""
    import sys

    from rollway.config import ConfigError, load_config

    try:
        flags = {k: v for k, v in (overrides or {}).items() if v is not None and v != {}}
        cfg = load_config(args.config, overrides=flags)
    except ConfigError as exc:
        print(f"rollway {command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from rollway.commands.acl import check_principal

    check_principal(cfg, command)
    return cfg
