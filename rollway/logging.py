"""One structlog JSON configuration for every Rollway process.

Every line is a JSON object with at least ``timestamp``, ``level``, ``role``,
``replica_id`` and ``event``. Call :func:`configure_logging` once at process start
(the CLI does it), then use ``structlog.get_logger(__name__)`` anywhere.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog

def configure_logging(
    role: str,
    replica_id: str | None = None,
    level: str = "info",
    stream: TextIO | None = None,
) -> None:
    """Route structlog (and stdlib logging, e.g. aiokafka's) to JSON lines on ``stream``.

    ``role`` and ``replica_id`` are bound as context variables so every event of this
    process carries them, also events logged by library code through stdlib logging.
    """
    numeric = logging.getLevelNamesMapping()[level.upper()]
    out = stream or sys.stderr
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write per line (WriteLogger writes message + newline at once; print writes
        # them apart): torchrun's ranks run unbuffered (-u) into one log, where two ranks'
        # lines written apart were glued together ("}{") and lost to a JSON reader.
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    # Library logs (aiokafka, aiohttp, vllm) go through the same renderer.
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.JSONRenderer(),
            ],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Libraries are chatty at info; keep them at warning unless we debug.
    root.setLevel(numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(
        role=role, replica_id=replica_id or default_replica_id(role)
    )


def default_replica_id(role: str) -> str:
    """``ROLLWAY_REPLICA_ID`` if set, else ``<role>-<hostname>-<pid>``."""
    explicit = os.environ.get("ROLLWAY_REPLICA_ID")
    if explicit:
        return explicit
    return f"{role}-{os.uname().nodename}-{os.getpid()}"
