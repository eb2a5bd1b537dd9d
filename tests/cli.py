"""Running the ``rollway`` command from tests: one way for every test file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bus.config import KafkaConfig

REPO = Path(__file__).resolve().parent.parent
ROLLWAY = [sys.executable, "-m", "rollway.cli"]


def kafka_env(cfg: KafkaConfig) -> dict[str, str]:
    """This process's environment with ``cfg``'s broker and topic prefix, for a command
    that must use the test's Kafka."""
    return {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": cfg.bootstrap_servers,
            "ROLLWAY_KAFKA__TOPIC_PREFIX": cfg.topic_prefix}


def run_cli(*args: str, config: Path | None = None, env: dict[str, str | None] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """``rollway [--config CONFIG] ARGS`` in the repository root, output captured as text.
    ``env`` overrides this process's environment (a None value unsets the variable)."""
    merged = {**os.environ, **(env or {})}
    argv = ROLLWAY + (["--config", str(config)] if config is not None else []) + list(args)
    return subprocess.run(argv, cwd=REPO, env={k: v for k, v in merged.items() if v is not None},
                          capture_output=True, text=True, timeout=timeout)


def log_events(path: Path, event: str | None = None) -> list[dict]:
    """The JSON lines of a component's log (structlog; other lines are skipped), only
    those whose ``event`` is ``event`` when given; [] while the file does not exist."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and (event is None or item.get("event") == event):
            out.append(item)
    return out
