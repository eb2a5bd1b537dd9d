"""Weight syncer settings (publisher in the trainer, subscriber in samplers)."""

from __future__ import annotations

import msgspec


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
    byte_planes: str = "auto"
    # Concurrent object-store requests (uploads, downloads, deletes).
    max_concurrency: int = 8
    # Subscriber: how the vLLM applier writes weights: auto | direct | reload.
    # direct = copy_ into the existing parameters (GPU); reload = vLLM's layerwise
    # reload, needed where the backend repacked weights into kernel formats (CPU).
    vllm_apply_mode: str = "auto"
    # Subscriber: seconds between retries after a failed update.
    retry_delay_s: float = 2.0

    def __post_init__(self) -> None:
        if self.byte_planes not in ("auto", "always", "never"):
            raise ValueError(f"syncer.byte_planes must be auto|always|never, not {self.byte_planes!r}")
        if self.vllm_apply_mode not in ("auto", "direct", "reload"):
            raise ValueError(f"syncer.vllm_apply_mode must be auto|direct|reload, not {self.vllm_apply_mode!r}")
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
