"""Weight syncer settings (publisher in the trainer, subscriber in samplers)."""

from __future__ import annotations

import msgspec


class SyncerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # file:///path or s3://bucket/prefix
    store_url: str = "file://var/weights"
    # For S3-compatible stores (MinIO, moto); empty = AWS default resolution.
    s3_endpoint_url: str = ""
    keyframe_every: int = 10
    keep_keyframes: int = 2
    chunk_bytes: int = 64 * 1024 * 1024
    zstd_level: int = 3
    zstd_threads: int = 2
    max_concurrency: int = 8
