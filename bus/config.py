"""Kafka connection settings shared by every component."""

from __future__ import annotations

from typing import Literal

import msgspec


class HandlerRetry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How ``EventConsumer.run`` retries a failing handler before dead-lettering the
    record: back-off delays starting at ``backoff_s``, doubling up to ``max_backoff_s``,
    until they add up to ``window_s`` (the last one shortened to land on it exactly).
    The window is what an outage of a dependency (the sandbox, the store) may last
    without costing a task: seconds to minutes, not the handler's run time."""

    window_s: float = 60.0
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        if self.window_s < 0:
            raise ValueError(f"kafka.handler_retry.window_s must not be negative, got {self.window_s}")
        if self.backoff_s <= 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("kafka.handler_retry needs 0 < backoff_s <= max_backoff_s, got "
                             f"{self.backoff_s} and {self.max_backoff_s}")

    def delays(self) -> list[float]:
        """The sleeps between tries; a record is tried ``len(delays()) + 1`` times."""
        out: list[float] = []
        total, delay = 0.0, self.backoff_s
        while self.window_s - total > 1e-9:  # not a float crumb of a last delay
            step = min(delay, self.max_backoff_s, self.window_s - total)
            out.append(step)
            total += step
            delay *= 2
        return out


class KafkaConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bootstrap_servers: str = "127.0.0.1:9092"
    client_id: str = "rollway"
    # Every topic name is prefix + short name ("rollway." + "tasks").
    topic_prefix: str = "rollway."
    # Partition count per topic short name, overriding the registry (tests use few).
    partitions: dict[str, int] = {}
    # Replication of topics created by ensure_topics; -1 = the broker's default.
    replication_factor: int = -1
    # Producer refuses bigger records before they reach the broker (callers chunk).
    # Kept below the broker default (1 MiB) so headers and batch framing fit.
    max_record_bytes: int = 900_000
    linger_ms: int = 5
    compression: str = "zstd"
    request_timeout_ms: int = 30_000
    # A handler failing through this back-off window sends the record to the DLQ.
    handler_retry: HandlerRetry = msgspec.field(default_factory=HandlerRetry)
    # Who this process is on the bus (docs/security.md). ``role`` is one of bus.acl.ROLES;
    # each command sets its own (rollway trainer -> trainer, tools -> admin) unless the
    # config names one. Credentials: ``sasl_username``/``sasl_password``, or the role's
    # entry of ``credentials_file`` (written by ``rollway broker start``, mode 0600).
    # "auto": SASL_SSL when credentials and ssl_cafile are known, SASL_PLAINTEXT with
    # credentials only, else PLAINTEXT (an open broker).
    # PLAIN is not offered: a password never crosses the wire in clear.
    security_protocol: Literal["auto", "PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL"] = "auto"
    sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256"] = "SCRAM-SHA-512"
    role: str = ""
    credentials_file: str = ""
    sasl_username: str = ""
    sasl_password: str = ""
    # SASL_SSL: the CA that signed the brokers' certificates ("" = the system's).
    ssl_cafile: str = ""
