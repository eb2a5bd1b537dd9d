"""The manifest of one stored version, and where its objects live in the store.

A version exists in the store exactly when its manifest does: the publisher uploads
every chunk first and creates the manifest last, conditionally (only if absent), so a
reader never sees a partial version and two publishers of one version never leave a
mix: each publish attempt writes its chunks under its own attempt folder, and only the
attempt whose manifest was created is ever referenced. A version may have two
manifests: ``full`` (a keyframe, decodable alone) and ``delta`` (XOR against
``base_version``).

Layout under the store root::

    <model>/manifests/v000000000042-delta.json
    <model>/chunks/v000000000042-delta/<attempt>/00017-0003   (tensor 17, chunk 3)

Chunks no manifest references (a publish that crashed or lost) are garbage collected
by ``syncer.catalog.collect_garbage``.
"""

from __future__ import annotations

import re

import msgspec

FORMAT = 1
KINDS = ("full", "delta")

# Per-tensor encodings:
#   raw  — the tensor's own bits (keyframes; a delta tensor whose dtype/shape changed)
#   xor  — bits XOR the base version's bits
#   same — bit-identical to the base: no chunks at all
ENCODINGS = ("raw", "xor", "same")


class ChunkRef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    key: str
    start: int  # first element of the tensor (flat) this chunk covers
    count: int  # number of elements
    raw_bytes: int
    stored_bytes: int
    checksum: str  # of the stored (compressed) bytes


class TensorEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]
    encoding: str
    byte_planes: bool = False
    checksum: str  # of the reconstructed tensor's bits
    base_checksum: str = ""  # of the base tensor's bits (xor / same)
    raw_bytes: int
    stored_bytes: int = 0
    chunks: list[ChunkRef] = []

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class CodecInfo(msgspec.Struct, kw_only=True):
    compression: str = "zstd"
    level: int = 3
    chunk_bytes: int = 0
    checksum: str = "blake3-128"


class Manifest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: int = FORMAT
    model: str
    version: int
    kind: str  # full | delta
    base_version: int = -1  # delta: the version it applies to
    keyframe_version: int = -1  # newest keyframe at or before this version
    weights_hash: str  # syncer.hashing.weights_hash of the reconstructed state
    tensors: list[TensorEntry]
    raw_bytes: int = 0
    stored_bytes: int = 0
    num_chunks: int = 0
    trainer_step: int = -1
    codec: CodecInfo = msgspec.field(default_factory=CodecInfo)
    created_at: float = 0.0

    def validate(self) -> None:
        """Raise ValueError when the manifest is inconsistent with itself."""
        if self.format > FORMAT:
            raise ValueError(f"manifest format {self.format} is newer than this build ({FORMAT})")
        if self.kind not in KINDS:
            raise ValueError(f"manifest kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "delta" and self.base_version < 0:
            raise ValueError("delta manifest without a base_version")
        if self.kind == "delta" and self.base_version >= self.version:
            raise ValueError(f"delta v{self.version} has base v{self.base_version}, not older")
        names = set()
        for t in self.tensors:
            if t.name in names:
                raise ValueError(f"tensor {t.name!r} appears twice")
            names.add(t.name)
            if t.encoding not in ENCODINGS:
                raise ValueError(f"tensor {t.name!r}: unknown encoding {t.encoding!r}")
            if self.kind == "full" and t.encoding != "raw":
                raise ValueError(f"tensor {t.name!r}: a full manifest holds raw tensors only")
            if t.encoding == "same" and (t.chunks or t.checksum != t.base_checksum):
                raise ValueError(f"tensor {t.name!r}: 'same' encoding with chunks or a changed checksum")
            covered = 0
            for c in t.chunks:
                if c.start != covered or c.count <= 0:
                    raise ValueError(f"tensor {t.name!r}: chunks do not tile the tensor")
                covered += c.count
            if t.encoding != "same" and covered != t.numel:
                raise ValueError(f"tensor {t.name!r}: chunks cover {covered} of {t.numel} elements")


_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder(Manifest)


def encode_manifest(manifest: Manifest) -> bytes:
    return _json_encoder.encode(manifest)


def decode_manifest(data: bytes, where: str = "manifest") -> Manifest:
    try:
        manifest = _json_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{where} is not a valid manifest: {exc}") from exc
    manifest.validate()
    return manifest


def _check_model(model: str) -> str:
    if not model or "/" in model or model.startswith("."):
        raise ValueError(f"model name {model!r} cannot be used as a store folder")
    return model


def manifest_key(model: str, version: int, kind: str) -> str:
    return f"{_check_model(model)}/manifests/v{version:012d}-{kind}.json"


def chunk_prefix(model: str, version: int, kind: str) -> str:
    return f"{_check_model(model)}/chunks/v{version:012d}-{kind}/"


def chunk_key(model: str, version: int, kind: str, tensor_index: int, chunk_index: int, attempt: str = "") -> str:
    folder = chunk_prefix(model, version, kind) + (f"{attempt}/" if attempt else "")
    return f"{folder}{tensor_index:05d}-{chunk_index:04d}"


def chunks_prefix(model: str) -> str:
    return f"{_check_model(model)}/chunks/"


def manifests_prefix(model: str) -> str:
    return f"{_check_model(model)}/manifests/"


_MANIFEST_RE = re.compile(r"v(\d{12})-(full|delta)\.json$")


def parse_manifest_key(key: str) -> tuple[int, str] | None:
    """(version, kind) of a manifest key, None for anything else."""
    m = _MANIFEST_RE.search(key)
    return (int(m.group(1)), m.group(2)) if m else None
