"""Kafka connection settings shared by every component."""

from __future__ import annotations

import msgspec


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
    # A handler failing this many times in a row sends the record to the DLQ.
    max_handler_attempts: int = 3
