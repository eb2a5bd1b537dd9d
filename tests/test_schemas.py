"""Wire format: golden bytes per event, packed arrays, schema-evolution rules."""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import pytest
import torch

from bus import codec
from schemas import EVENT_TYPES, Task, TrajectoryChunk, arrays
from tests.samples import sample_chunk, sample_events



def test_every_event_type_has_a_sample():
    assert {type(e).__name__ for e in sample_events()} == set(EVENT_TYPES)


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: type(e).__name__)
def test_codec_round_trip(event):
    value, headers = codec.encode(event)
    schema = str(type(event).SCHEMA_VERSION).encode()
    assert dict(headers) == {"rollway-type": type(event).__name__.encode(), "rollway-schema": schema}
    assert codec.decode(value, headers) == event


# tests/golden/event_digests.json holds the sha256 of the msgpack body of each sample
# event. A change there is a wire-format change: old consumers would misread new
# records. Add fields with defaults at the end instead.
def golden_digests() -> dict[str, str]:
    return {type(e).__name__: hashlib.sha256(codec.encode(e)[0]).hexdigest() for e in sample_events()}


def test_golden_bytes(golden_file):
    assert golden_digests() == golden_file


@pytest.fixture
def golden_file():
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "golden" / "event_digests.json").read_text())


def test_task_golden_bytes_literal():
    # One event pinned byte for byte, so the digest file cannot drift unnoticed.
    task = Task(task_id="t", group_id="g", group_size=2, instruction="i", created_at=1.0)
    assert codec.encode(task)[0].hex() == (
        "8ca77461736b5f6964a174a867726f75705f6964a167aa67726f75705f73697a6502ab696e737472756374696f6ea169"
        "a566696c657380a86c616e6775616765a6707974686f6eaa646966666963756c7479a0a87461736b5f736574a464656d6f"
        "a86d6574616461746180aa637265617465645f6174cb3ff0000000000000"
        # image, workdir (added at the end with defaults: old readers ignore them)
        "a5696d616765a0a7776f726b646972aa2f776f726b7370616365"
    )


def test_unknown_type_and_newer_schema_are_refused_with_reason():
    value, _ = codec.encode(sample_events()[0])
    with pytest.raises(codec.DecodeFailure) as exc:
        codec.decode(value, [("rollway-type", b"Nope")])
    assert exc.value.kind == "unknown_type" and "Nope" in str(exc.value)
    with pytest.raises(codec.DecodeFailure) as exc:
        codec.decode(value, [("rollway-type", b"Task"), ("rollway-schema", b"99")])
    assert exc.value.kind == "newer_schema"
    with pytest.raises(codec.DecodeFailure) as exc:
        codec.decode(b"\xc1garbage", [("rollway-type", b"Task")])
    assert exc.value.kind == "decode"
    with pytest.raises(codec.DecodeFailure) as exc:
        codec.decode(value, [])
    assert exc.value.kind == "unknown_type"


def test_old_reader_ignores_new_fields_and_new_reader_defaults_missing_ones():
    class TaskV2(Task, kw_only=True):
        priority: int = 0

    new = msgspec.msgpack.encode(TaskV2(task_id="t", group_id="g", group_size=1, instruction="i", priority=5))
    old = msgspec.msgpack.decode(new, type=Task)
    assert old.task_id == "t"
    older = msgspec.msgpack.encode(Task(task_id="t", group_id="g", group_size=1, instruction="i"))
    assert msgspec.msgpack.decode(older, type=TaskV2).priority == 0


def test_packed_arrays_are_little_endian_and_zero_copy():
    data = arrays.pack([1, 2, 258], arrays.INT32)
    assert data == b"\x01\x00\x00\x00\x02\x00\x00\x00\x02\x01\x00\x00"
    view = arrays.unpack(data, arrays.INT32)
    assert view.tolist() == [1, 2, 258]
    buf = bytearray(data)
    view = arrays.unpack(buf, arrays.INT32)
    buf[0] = 7
    assert view[0] == 7  # a view, not a copy
    t = arrays.to_torch(bytearray(data), arrays.INT32)
    assert t.dtype == torch.int32 and t.tolist() == [1, 2, 258]
    assert arrays.from_torch(torch.tensor([0.5, -1.0]), arrays.FLOAT32) == arrays.pack([0.5, -1.0], arrays.FLOAT32)
    with pytest.raises(ValueError, match="do not fit"):
        arrays.pack([70000], arrays.INT16)
    with pytest.raises(ValueError, match="whole number"):
        arrays.unpack(b"\x00\x01\x02", arrays.INT32)


def test_csr_and_spans_round_trip_and_reject_malformed():
    sets = [[1, 2, 3], [], [7]]
    offsets, ids = arrays.pack_csr(sets)
    assert arrays.unpack(offsets, arrays.INT32).tolist() == [0, 3, 3, 4]
    assert [r.tolist() for r in arrays.csr_rows(offsets, ids)] == sets
    with pytest.raises(ValueError, match="malformed CSR"):
        arrays.unpack_csr(arrays.pack([0, 5], arrays.INT32), ids)
    starts, versions = arrays.pack_spans([3, 3, 4, 4, 4, 6])
    assert arrays.unpack(starts, arrays.INT32).tolist() == [0, 2, 5]
    assert arrays.unpack(versions, arrays.INT64).tolist() == [3, 4, 6]
    assert arrays.unpack_spans(starts, versions, 6).tolist() == [3, 3, 4, 4, 4, 6]
    with pytest.raises(ValueError, match="malformed spans"):
        arrays.unpack_spans(starts, versions, 5)


def test_chunk_accessors_and_validation():
    chunk = sample_chunk(n=4)
    chunk.validate()
    assert chunk.num_tokens == 4
    assert chunk.token_array().tolist() == [10, 11, 12, 13]
    assert [s.tolist() for s in chunk.kept_sets()] == [[10, 99], [11], [12, 99], [13]]
    assert chunk.version_array().tolist() == [3, 3, 4, 4]
    assert np.allclose(chunk.logprob_array(), [-0.5, 0, -0.5, 0])
    bad = msgspec.structs.replace(chunk, loss_mask=b"\x01")
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 4 tokens"):
        bad.validate()
    assert isinstance(chunk, TrajectoryChunk)


def test_older_train_steps_decode_with_empty_groups_and_drops():
    # Entries a schema-1 or schema-2 trainer wrote (no `groups`, no `dropped`) stay
    # readable: the new fields take their defaults.
    from schemas import GroupRef, TrainStep

    v1 = msgspec.msgpack.encode({"step": 3, "weight_version": 3, "weights_hash": "ab", "trajectories": [],
                                 "metrics": {}, "seed": 0, "created_at": 1.0})
    step = codec.decode(v1, [("rollway-type", b"TrainStep"), ("rollway-schema", b"1")])
    assert step.step == 3 and step.groups == [] and step.dropped == []
    v2 = msgspec.msgpack.encode({"step": 4, "weight_version": 4, "weights_hash": "ab", "groups": [["t", "g"]]})
    step = codec.decode(v2, [("rollway-type", b"TrainStep"), ("rollway-schema", b"2")])
    assert step.groups == [GroupRef("t", "g")] and step.dropped == []
    assert isinstance(step, TrainStep)
