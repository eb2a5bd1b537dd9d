"""Weight syncer settings (publisher in the trainer, subscriber in samplers)."""

from __future__ import annotations

from typing import Literal

import msgspec
import structlog

log = structlog.get_logger(__name__)


class SyncerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # file:///abs/path, file://relative/path or s3://bucket/prefix
    store_url: str = "file://var/weights"
    # For S3-compatible stores (MinIO, moto); empty = AWS default resolution.
    # Credentials always come from the usual AWS chain (env, profile, instance role).
    s3_endpoint_url: str = ""
    s3_region: str = ""
    # Objects above this size are uploaded as multipart uploads of s3_part_bytes parts
    # (S3 wants parts >= 5 MiB except the last).
    s3_multipart_threshold: int = 16 * 1024 * 1024
    s3_part_bytes: int = 8 * 1024 * 1024
    # Every keyframe_every-th published version is a full copy; the others are deltas.
    keyframe_every: int = 10
    # Retention: versions older than the newest keep_keyframes keyframes are deleted.
    keep_keyframes: int = 2
    # Keyframe versions also store a delta, so up-to-date samplers never download a
    # full copy just because the trainer's turn for a keyframe came.
    delta_with_keyframes: bool = True
    # Upper bound on the raw (uncompressed) bytes of one chunk: the unit of upload,
    # download, decode and of memory held per in-flight transfer.
    chunk_bytes: int = 64 * 1024 * 1024
    # Level 1: on XOR deltas higher levels spend time matching mantissa noise for no
    # smaller output (benchmarks/weight_sync.py).
    zstd_level: int = 1
    # Worker threads for XOR + zstd + checksums (chunks are coded in parallel).
    zstd_threads: int = 2
    # auto: per tensor, keep whichever of interleaved / byte planes compresses smaller
    # on a sample; always / never force one layout.
    byte_planes: Literal["auto", "always", "never"] = "auto"
    # Concurrent object-store requests (uploads, downloads, deletes).
    max_concurrency: int = 8
    # Subscriber: how the vLLM applier writes weights: auto | direct | reload.
    # direct = copy_ into the existing parameters (GPU); reload = vLLM's layerwise
    # reload, needed where the backend repacked weights into kernel formats (CPU).
    vllm_apply_mode: Literal["auto", "direct", "reload"] = "auto"
    # Subscriber: seconds between retries after a failed update.
    retry_delay_s: float = 2.0
    # Publisher (with a Kafka producer): follow sampler heartbeats and make the next
    # version a keyframe when a sampler reports a failed weight update (syncer/health.py).
    keyframe_on_trouble: bool = True
    # ... and when no publish follows the trouble within this many seconds (a trainer that
    # cannot train because every replica is stuck on old weights: its groups are all
    # stale), store the newest version again as a keyframe and re-announce it, so the
    # replicas get around the damage without a new version. 0 turns it off.
    keyframe_repair_after_s: float = 30.0
    # Subscriber: manifests kept in memory (most recently used).
    manifest_cache: int = 64
    # Retention also deletes chunks no manifest references and incomplete writes (temp
    # files, multipart uploads) once they are this old: younger ones may belong to a
    # publish still in flight.
    orphan_grace_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.keyframe_every < 1:
            raise ValueError("syncer.keyframe_every must be >= 1")
        if self.keep_keyframes < 1:
            raise ValueError("syncer.keep_keyframes must be >= 1")
        if self.chunk_bytes < 4096:
            raise ValueError("syncer.chunk_bytes must be >= 4096")
        if self.s3_part_bytes < 5 * 1024 * 1024:
            raise ValueError("syncer.s3_part_bytes must be >= 5 MiB (S3's minimum part size)")
        if self.zstd_threads < 1 or self.max_concurrency < 1:
            raise ValueError("syncer.zstd_threads and syncer.max_concurrency must be >= 1")
        if self.manifest_cache < 1:
            raise ValueError("syncer.manifest_cache must be >= 1")
        if self.orphan_grace_s < 0:
            raise ValueError("syncer.orphan_grace_s must be >= 0")
        if self.keyframe_repair_after_s < 0:
            raise ValueError("syncer.keyframe_repair_after_s must be >= 0 (0 turns the repair off)")


def keyframe_cadence(cfg: SyncerConfig, max_staleness: int, publish_every: int) -> SyncerConfig:
    """``cfg`` with keyframes often enough that one unreadable delta cannot outlast
    the trainer's staleness bound.

    A sampler that cannot apply a delta stays on the version before it until the next
    keyframe. With keyframes every N publishes of every ``publish_every`` steps, its
    tokens are then up to N * publish_every steps old; beyond ``max_staleness`` they
    are dropped, so every group goes stale and training stops stepping. We lower
    ``keyframe_every`` to max(1, max_staleness // publish_every) (with a warning)
    rather than reject the config: the default pairs (10 vs 4) and any hand-written
    config keep working, at the price of bigger keyframes more often."""
    if publish_every <= 0:
        return cfg
    bound = max(1, max_staleness // publish_every)
    if cfg.keyframe_every <= bound:
        return cfg
    log.warning("syncer.keyframe_every lowered so a bad delta cannot outlast trainer.max_staleness",
                configured=cfg.keyframe_every, used=bound, max_staleness=max_staleness, publish_every=publish_every)
    return msgspec.structs.replace(cfg, keyframe_every=bound)
