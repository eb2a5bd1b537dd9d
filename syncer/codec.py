"""XOR + byte-plane + zstd codec for one tensor, chunk by chunk.

Encoding a chunk of elements ``[start, start+count)``:

1. ``x = new_bits ^ base_bits`` (delta) or ``x = new_bits`` (raw/keyframe);
2. optionally split ``x`` into byte planes (all first bytes, then all second bytes...):
   in a bf16 delta the high byte (sign, exponent) is almost always zero while the low
   byte (mantissa) is noisy, and zstd does much better on the separated planes;
3. zstd-compress.

Decoding reverses it straight into the destination tensor's memory. Every chunk is
independent, so chunks of one tensor are coded in parallel threads (numpy, zstd and
BLAKE3 release the GIL). Checksums are verified by the caller: stored bytes per chunk
before decoding, reconstructed bits per tensor after.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

# Samples for the byte-plane decision: a few windows spread over the tensor.
_SAMPLE_WINDOWS = 4
_SAMPLE_WINDOW_ELEMENTS = 16 * 1024


class ChunkCorrupt(ValueError):
    """A chunk failed to decode to exactly the expected bytes."""


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects must not be shared between threads.
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def split_planes(x: np.ndarray) -> np.ndarray:
    """(n,) uint{8k} -> (k, n) uint8: plane j holds byte j of every element."""
    k = x.dtype.itemsize
    as_bytes = x.view(np.uint8).reshape(-1, k)
    planes = np.empty((k, as_bytes.shape[0]), dtype=np.uint8)
    for j in range(k):  # one strided pass per plane beats a generic transpose
        planes[j] = as_bytes[:, j]
    return planes


def merge_planes(planes: np.ndarray, out: np.ndarray) -> None:
    """Inverse of :func:`split_planes`, written into ``out`` (n,) uint{8k}."""
    k = out.dtype.itemsize
    as_bytes = out.view(np.uint8).reshape(-1, k)
    for j in range(k):
        as_bytes[:, j] = planes[j]


def xor_bits(new_bits: np.ndarray, base_bits: np.ndarray) -> np.ndarray:
    return np.bitwise_xor(new_bits, base_bits)


def encode_chunk(
    new_bits: np.ndarray,
    base_bits: np.ndarray | None,
    *,
    byte_planes: bool,
    level: int,
) -> bytes:
    """Compressed bytes for one chunk (``new_bits`` and ``base_bits`` are equal-length
    slices of flat uint views)."""
    x = new_bits if base_bits is None else xor_bits(new_bits, base_bits)
    if byte_planes and x.dtype.itemsize > 1:
        x = split_planes(x)
    return _compressor(level).compress(np.ascontiguousarray(x))


def decode_chunk(
    payload: bytes | memoryview,
    out_bits: np.ndarray,
    base_bits: np.ndarray | None,
    *,
    byte_planes: bool,
) -> None:
    """Decode one chunk into ``out_bits`` (a writable slice of the destination's bits);
    XOR with ``base_bits`` when given. Raises ChunkCorrupt on any size mismatch."""
    expected = out_bits.nbytes
    try:
        params = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(f"not a zstd frame: {exc}") from exc
    if params.content_size != expected:
        raise ChunkCorrupt(f"frame holds {params.content_size} bytes, expected {expected}")
    try:
        raw = _decompressor().decompress(payload, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(f"zstd failed: {exc}") from exc
    if len(raw) != expected:
        raise ChunkCorrupt(f"decoded {len(raw)} bytes, expected {expected}")
    k = out_bits.dtype.itemsize
    if byte_planes and k > 1:
        merge_planes(np.frombuffer(raw, dtype=np.uint8).reshape(k, -1), out_bits)
        if base_bits is not None:
            np.bitwise_xor(out_bits, base_bits, out=out_bits)
    else:
        decoded = np.frombuffer(raw, dtype=out_bits.dtype)
        if base_bits is not None:
            np.bitwise_xor(decoded, base_bits, out=out_bits)
        else:
            out_bits[:] = decoded


def _sample(bits: np.ndarray) -> np.ndarray:
    n = bits.size
    window = _SAMPLE_WINDOW_ELEMENTS
    if n <= window * _SAMPLE_WINDOWS:
        return bits
    starts = np.linspace(0, n - window, _SAMPLE_WINDOWS).astype(np.int64)
    return np.concatenate([bits[s : s + window] for s in starts])


def choose_byte_planes(
    new_bits: np.ndarray,
    base_bits: np.ndarray | None,
    *,
    mode: str,
    level: int,
) -> bool:
    """Decide the layout for a whole tensor: ``mode`` always/never, or auto = whichever
    compresses a spread-out sample smaller."""
    if new_bits.dtype.itemsize == 1 or mode == "never":
        return False
    if mode == "always":
        return True
    sample_new = _sample(new_bits)
    x = sample_new if base_bits is None else xor_bits(sample_new, _sample(base_bits))
    compressor = _compressor(min(level, 3))  # the decision needs no high level
    interleaved = len(compressor.compress(np.ascontiguousarray(x)))
    planar = len(compressor.compress(split_planes(x)))
    return planar < interleaved


def chunk_ranges(numel: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(start, count) element ranges of at most ``chunk_bytes`` raw bytes each."""
    per_chunk = max(1, chunk_bytes // itemsize)
    return [(s, min(per_chunk, numel - s)) for s in range(0, numel, per_chunk)]
