"""Codec: decode(encode(new, base), base) == new bit for bit, and corruption is caught."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncer import codec
from syncer.bits import bits_view
from syncer.manifest import ChunkRef, Manifest, TensorEntry, decode_manifest, encode_manifest
from syncer.tensor_codec import IntegrityError, decode_tensor, encode_tensor

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def random_tensor(rng: np.random.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infs, signed zeros, subnormals included)."""
    t = torch.empty(shape, dtype=dtype)
    bits = bits_view(t)
    raw = rng.integers(0, 256, size=bits.nbytes, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1  # a bool byte other than 0/1 is not a valid bool
    bits.view(np.uint8)[:] = raw
    return t


def sparse_update(rng: np.random.Generator, base: torch.Tensor, fraction: float) -> torch.Tensor:
    new = base.clone()
    bits = bits_view(new)
    if bits.size == 0 or fraction == 0.0:
        return new
    n = max(1, int(bits.size * fraction))
    idx = rng.choice(bits.size, size=min(n, bits.size), replace=False)
    width = bits.dtype.itemsize * 8
    if base.dtype == torch.bool:
        bits[idx] ^= np.uint8(1)
    else:
        # flip the low mantissa-ish bits most of the time, any bit sometimes
        flip = rng.integers(0, min(width, 8) if rng.random() < 0.8 else width, size=idx.size)
        bits[idx] ^= (np.ones(idx.size, dtype=bits.dtype) << flip.astype(bits.dtype))
    return new


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(bits_view(a), bits_view(b))


shapes = st.lists(st.integers(0, 37), min_size=0, max_size=3).map(tuple)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    seed=st.integers(0, 2**32 - 1),
    fraction=st.sampled_from([0.0, 0.001, 0.01, 0.3, 1.0]),
    chunk_bytes=st.sampled_from([1, 16, 100, 4096, 1 << 20]),
    planes=st.sampled_from(["auto", "always", "never"]),
    level=st.sampled_from([1, 3]),
)
def test_roundtrip_delta_is_bit_exact(dtype, shape, seed, fraction, chunk_bytes, planes, level):
    rng = np.random.default_rng(seed)
    base = random_tensor(rng, dtype, shape)
    new = sparse_update(rng, base, fraction)
    entry, payloads = encode_tensor("w", new, base, chunk_bytes=chunk_bytes, level=level, byte_planes=planes)
    assert entry.encoding in ("xor", "same")
    if fraction == 0.0 or base.numel() == 0:
        assert entry.encoding == "same" and payloads == []
    out = decode_tensor(entry, payloads, base)
    assert_bit_equal(out, new)
    # the base is never modified by decoding
    assert out is base or out.data_ptr() != base.data_ptr()


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    seed=st.integers(0, 2**32 - 1),
    chunk_bytes=st.sampled_from([7, 64, 4096]),
    planes=st.sampled_from(["auto", "always", "never"]),
)
def test_roundtrip_keyframe_is_bit_exact(dtype, shape, seed, chunk_bytes, planes):
    rng = np.random.default_rng(seed)
    new = random_tensor(rng, dtype, shape)
    entry, payloads = encode_tensor("w", new, None, chunk_bytes=chunk_bytes, byte_planes=planes)
    assert entry.encoding == "raw"
    assert sum(c.count for c in entry.chunks) == new.numel()
    assert all(c.raw_bytes <= max(chunk_bytes, new.element_size()) for c in entry.chunks)
    assert_bit_equal(decode_tensor(entry, payloads, None), new)


def test_real_valued_small_update_roundtrip():
    """An optimizer-like bf16 update: small relative changes, most values unchanged."""
    torch.manual_seed(0)
    master = torch.randn(512, 256) * 0.02
    base = master.to(torch.bfloat16)
    new = (master - 1e-5 * torch.sign(torch.randn_like(master))).to(torch.bfloat16)
    changed = (bits_view(new) != bits_view(base)).mean()
    assert 0.0 < changed < 0.5
    entry, payloads = encode_tensor("w", new, base)
    assert entry.encoding == "xor"
    assert entry.stored_bytes < 0.5 * entry.raw_bytes
    assert_bit_equal(decode_tensor(entry, payloads, base), new)


def test_shape_change_is_stored_raw_inside_a_delta():
    base = torch.randn(10, 4).to(torch.bfloat16)
    new = torch.randn(12, 4).to(torch.bfloat16)  # e.g. a resized vocabulary
    entry, payloads = encode_tensor("emb", new, base)
    assert entry.encoding == "raw" and entry.base_checksum == ""
    assert_bit_equal(decode_tensor(entry, payloads, base), new)


def test_flipped_byte_in_payload_is_rejected():
    rng = np.random.default_rng(1)
    base = random_tensor(rng, torch.bfloat16, (300, 7))
    new = sparse_update(rng, base, 0.1)
    entry, payloads = encode_tensor("w", new, base, chunk_bytes=1024)
    assert len(payloads) > 1
    bad = bytearray(payloads[1])
    bad[len(bad) // 2] ^= 0x40
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        decode_tensor(entry, [payloads[0], bytes(bad), *payloads[2:]], base)


def test_wrong_base_is_rejected_by_tensor_checksum():
    rng = np.random.default_rng(2)
    base = random_tensor(rng, torch.float32, (64, 3))
    new = sparse_update(rng, base, 0.2)
    other = sparse_update(rng, base, 0.2)
    entry, payloads = encode_tensor("w", new, base)
    with pytest.raises(IntegrityError, match="reconstructed tensor checksum"):
        decode_tensor(entry, payloads, other)
    with pytest.raises(IntegrityError, match="delta expects"):
        decode_tensor(entry, payloads, base.to(torch.float16))
    with pytest.raises(IntegrityError, match="needs a base"):
        decode_tensor(entry, payloads, None)


def test_chunk_with_wrong_content_size_is_corrupt():
    x = np.arange(100, dtype=np.uint16)
    payload = codec.encode_chunk(x, None, byte_planes=False, level=3)
    out = np.empty(99, dtype=np.uint16)
    with pytest.raises(codec.ChunkCorrupt, match="expected 198"):
        codec.decode_chunk(payload, out, None, byte_planes=False)
    with pytest.raises(codec.ChunkCorrupt, match="not a zstd frame"):
        codec.decode_chunk(b"garbage!", out, None, byte_planes=False)


def test_byte_planes_split_merge_inverse():
    x = np.random.default_rng(3).integers(0, 2**32, size=1001, dtype=np.uint32)
    planes = codec.split_planes(x)
    assert planes.shape == (4, 1001)
    assert np.array_equal(planes[0], (x & 0xFF).astype(np.uint8))
    out = np.empty_like(x)
    codec.merge_planes(planes, out)
    assert np.array_equal(out, x)


def test_manifest_roundtrip_and_validation():
    entry = TensorEntry(
        name="a", dtype="bfloat16", shape=[2, 3], encoding="xor", checksum="c", base_checksum="b",
        raw_bytes=12, stored_bytes=5,
        chunks=[ChunkRef(key="k0", start=0, count=4, raw_bytes=8, stored_bytes=3, checksum="x"),
                ChunkRef(key="k1", start=4, count=2, raw_bytes=4, stored_bytes=2, checksum="y")],
    )
    m = Manifest(model="m", version=3, kind="delta", base_version=2, keyframe_version=1,
                 weights_hash="h", tensors=[entry])
    assert decode_manifest(encode_manifest(m)) == m
    gap = msgspec.structs.replace(m, tensors=[msgspec.structs.replace(entry, chunks=entry.chunks[1:])])
    with pytest.raises(ValueError, match="do not tile"):
        decode_manifest(encode_manifest(gap))
    with pytest.raises(ValueError, match="not older"):
        decode_manifest(encode_manifest(msgspec.structs.replace(m, base_version=3)))
    with pytest.raises(ValueError, match="raw tensors only"):
        decode_manifest(encode_manifest(msgspec.structs.replace(m, kind="full")))
    with pytest.raises(ValueError, match="not a valid manifest"):
        decode_manifest(b'{"version": "x"}')
