"""``run_consumers``: a script's entry point for consumers written with :mod:`bus.analytics`.

It does what the library cannot: reads Rollway's configuration (``rollway.toml`` and the
environment, as every command does) and sets up its JSON logs::

    from bus.analytics import consumer
    from rollway.consumers import run_consumers
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import structlog

from bus.analytics import Analytics, ConsumerApp, ConsumerError, ConsumerFailed
from bus.config import KafkaConfig

log = structlog.get_logger(__name__)


def run_consumers(apps: Sequence[Analytics], cfg: KafkaConfig | None = None, *, until_end: bool | None = None,
                  log_level: str | None = None, argv: Sequence[str] | None = None) -> None:
    """Blocking entry point for a script: config from ``rollway.toml``/environment, JSON
    logs on stderr. The script accepts ``--until-end`` (stop once caught up: a one-shot
    report) and ``--log-level``; arguments given here win. Exits 1 when a consumer
    failed, 2 when one is declared wrong or the configuration is invalid."""
    import argparse
    import sys

    from rollway.config import ConfigError, load_config
    from rollway.logging import configure_logging

    parser = argparse.ArgumentParser(description="Rollway consumers: " + ", ".join(a.name for a in apps))
    parser.add_argument("--until-end", action="store_true", help="stop once the topics are read to their end")
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    configure_logging("consumer", level=log_level or args.log_level)
    if cfg is None:
        try:
            cfg = load_config().kafka
        except ConfigError as exc:
            print(f"{parser.prog}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    try:
        asyncio.run(ConsumerApp(cfg, apps, until_end=args.until_end if until_end is None else until_end).run())
    except ConsumerError as exc:
        log.error("consumer declared wrong", error=str(exc))
        raise SystemExit(2) from None
    except ConsumerFailed as exc:
        log.error("consumer failed", error=str(exc), exc_info=exc.__cause__)
        raise SystemExit(1) from None
