"""bus/prefetch.py: fetched batches checked and decompressed on a worker thread give
aiokafka exactly the records, positions and errors it gets reading them itself.

Message sets are built with aiokafka's own batch builder (zstd, as Rollway's producers
write them) and read through aiokafka's own ``PartitionRecords``, once as aiokafka reads
them and once through ``bus.prefetch.memory_records`` after a ``BatchPrefetcher`` queued
them. No broker: the consumer path with a broker is covered by tests/test_trainer_kafka.py
(the trainer's consumer prefetches)."""

from __future__ import annotations

import struct

import cramjam
import pytest
import zstandard
from aiokafka.consumer.fetcher import PartitionRecords
from aiokafka.errors import CorruptRecordException
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.util import calc_crc32c
from aiokafka.structs import TopicPartition

from bus import prefetch

READ_COMMITTED = 1
TP = TopicPartition("t", 3)


def _batch(base_offset: int, values: list[bytes], codec: int = 4, key: bytes | None = b"k",
           producer_id: int = -1) -> bytes:
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=codec, is_transactional=int(producer_id >= 0),
                                        producer_id=producer_id, producer_epoch=0 if producer_id >= 0 else -1,
                                        base_sequence=0 if producer_id >= 0 else -1, batch_size=1 << 24)
    for i, value in enumerate(values):
        builder.append(i, timestamp=1_700_000_000_000 + i, key=key, value=value,
                       headers=[("rollway-type", b"chunk"), ("n", str(i).encode())])
    raw = bytearray(builder.build())
    struct.pack_into(">q", raw, 0, base_offset)  # (the broker assigns offsets; the CRC does not cover them)
    return bytes(raw)


def _with_records(batch: bytes, payload: bytes) -> bytes:
    """``batch`` with its compressed records replaced by ``payload``, length and CRC fixed."""
    raw = bytearray(batch[:61] + payload)
    struct.pack_into(">i", raw, 8, len(raw) - 12)
    struct.pack_into(">I", raw, 17, calc_crc32c(bytes(raw[21:])))
    return bytes(raw)


def _values(n: int, seed: int) -> list[bytes]:
    return [bytes((seed + i * 7 + j) % 251 for j in range(200 + 37 * i)) * 3 for i in range(n)]


def _read(message_set: bytes, records_of, fetch_offset: int = 0, aborted=()) -> tuple[list[tuple], object]:
    """Every record aiokafka hands out of ``message_set`` (all fields), and its error."""
    parts = PartitionRecords(TP, records_of(message_set), list(aborted), fetch_offset, None, None, True,
                             READ_COMMITTED)
    out: list[tuple] = []
    try:
        for r in parts:
            out.append((r.topic, r.partition, r.offset, r.timestamp, r.timestamp_type, r.key, r.value,
                        r.checksum, r.serialized_key_size, r.serialized_value_size, r.headers))
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        return out, (type(exc), str(exc), parts.next_fetch_offset)
    return out, (None, None, parts.next_fetch_offset)


def _both(message_set: bytes, fetch_offset: int = 0,
          aborted=()) -> tuple[tuple, tuple, prefetch.BatchPrefetcher, list]:
    """(aiokafka alone, through the prefetcher), the prefetcher, and the batches handed out."""
    plain = _read(message_set, prefetch.MemoryRecords, fetch_offset, aborted)
    prefetcher = prefetch.BatchPrefetcher()
    handed: list = []
    try:
        prefetcher.add(TP.topic, TP.partition, message_set)
        for _, _, future in list(prefetch._ahead.get(id(message_set), (None, None, {}))[2].values()):
            try:
                future.result(timeout=30)  # (the worker done first: every batch is taken from it)
            except Exception:  # noqa: BLE001 - a refused payload: aiokafka's own decoder decides
                pass

        class Recording:  # what the records object hands to aiokafka, batch by batch
            def __init__(self, records) -> None:
                self.records = records

            def has_next(self) -> bool:
                return self.records.has_next()

            def next_batch(self):
                batch = self.records.next_batch()
                handed.append(batch)
                return batch

        def records_of(ms):
            return Recording(prefetch.memory_records(ms))

        ahead = _read(message_set, records_of, fetch_offset, aborted)
    finally:
        prefetcher.close()
    return plain, ahead, prefetcher, handed


def test_zstd_batches_read_from_the_worker_give_the_same_records() -> None:
    message_set = b"".join([_batch(0, _values(5, 1)), _batch(5, _values(1, 2), key=None), _batch(6, _values(9, 3)),
                            _batch(15, _values(3, 4), codec=0)])  # the last one not compressed
    plain, ahead, prefetcher, handed = _both(message_set)
    assert ahead == plain
    assert len(plain[0]) == 18 and plain[1] == (None, None, 18)
    assert prefetcher.batches == 3
    # The three zstd batches came from the worker; the plain one is aiokafka's own.
    assert [type(b) is prefetch._CheckedBatch for b in handed if b is not None] == [True, True, True, False]
    assert not prefetch._ahead  # nothing left behind


def test_an_aborted_transaction_is_skipped_the_same_way() -> None:
    message_set = b"".join([_batch(0, _values(3, 20), producer_id=7), _batch(3, _values(2, 21), producer_id=8),
                            _batch(5, _values(2, 22), producer_id=7)])
    plain, ahead, _, _ = _both(message_set, aborted=[(7, 0)])  # producer 7's transaction aborted
    assert ahead == plain and [r[2] for r in plain[0]] == [3, 4] and plain[1] == (None, None, 7)


def test_two_batches_at_one_offset_are_left_to_aiokafka() -> None:
    message_set = _batch(0, _values(3, 25)) + _batch(0, _values(2, 26)) + _batch(3, _values(2, 27))
    plain, ahead, _, handed = _both(message_set)
    assert ahead == plain and [r[2] for r in plain[0]] == [0, 1, 2, 3, 4]
    assert not any(type(b) is prefetch._CheckedBatch for b in handed)


def test_control_batches_are_left_to_aiokafka() -> None:
    raw = bytearray(_batch(0, _values(1, 23), producer_id=7))
    struct.pack_into(">h", raw, 21, struct.unpack_from(">h", raw, 21)[0] | 0x20)
    struct.pack_into(">I", raw, 17, calc_crc32c(bytes(raw[21:])))
    assert prefetch.zstd_batches(bytes(raw) + _batch(1, _values(1, 24))) == [(1, len(raw), len(raw) + len(
        _batch(1, _values(1, 24))))]


def test_position_after_a_fetch_offset_inside_a_batch() -> None:
    message_set = b"".join([_batch(10, _values(6, 5)), _batch(16, _values(4, 6))])
    plain, ahead, _, _ = _both(message_set, fetch_offset=13)
    assert ahead == plain and [r[2] for r in plain[0]] == [13, 14, 15, 16, 17, 18, 19]


@pytest.mark.parametrize("where", [-5, 40])  # in the compressed records; in the batch's max timestamp
def test_a_bad_crc_raises_aiokafkas_error_at_the_same_batch(where: int) -> None:
    good = _batch(0, _values(4, 7))
    bad = bytearray(_batch(4, _values(4, 8)))
    bad[where] ^= 0x40  # a flipped bit the CRC covers (the header one still decompresses)
    message_set = good + bytes(bad) + _batch(8, _values(2, 9))
    plain, ahead, _, _ = _both(message_set)
    assert ahead == plain
    assert len(plain[0]) == 4 and plain[1][0] is CorruptRecordException and "Invalid CRC" in plain[1][1]


@pytest.mark.parametrize("payload", ["no content size", "two frames"])
def test_a_payload_zstandard_refuses_is_decoded_by_aiokafka(payload: str) -> None:
    values = _values(3, 10)
    batch = _batch(0, values)
    records = zstandard.ZstdDecompressor().decompress(batch[61:])
    if payload == "no content size":
        compressed = zstandard.ZstdCompressor(write_content_size=False).compress(records)
    else:  # aiokafka's decoder (cramjam) reads both frames; zstandard refuses the second
        half = len(records) // 2
        compressed = bytes(cramjam.zstd.compress(records[:half])) + bytes(cramjam.zstd.compress(records[half:]))
    message_set = _with_records(batch, compressed) + _batch(3, _values(2, 11))
    plain, ahead, _, handed = _both(message_set)
    assert ahead == plain and len(plain[0]) == 5 and plain[1][0] is None
    assert [type(b) is prefetch._CheckedBatch for b in handed if b is not None] == [False, True]


def test_corrupt_records_with_a_good_crc_raise_the_same_error() -> None:
    batch = _batch(0, _values(3, 12))
    records = bytearray(zstandard.ZstdDecompressor().decompress(batch[61:]))
    records[0] = 0x7F  # the first record's length varint now overruns the batch
    message_set = _with_records(batch, zstandard.ZstdCompressor().compress(bytes(records)))
    plain, ahead, _, _ = _both(message_set)
    assert ahead == plain and plain[1][0] is CorruptRecordException


def test_a_message_set_cut_short_and_a_later_one_replacing_it() -> None:
    whole = _batch(0, _values(4, 13))
    cut = whole + _batch(4, _values(4, 14))[:-100]  # the broker's fetch size cut the second batch
    assert [b[0] for b in prefetch.zstd_batches(cut)] == [0]
    plain, ahead, _, _ = _both(cut)
    assert ahead == plain and len(plain[0]) == 4

    prefetcher = prefetch.BatchPrefetcher()
    try:
        first, second = _batch(0, _values(2, 15)), _batch(2, _values(2, 16))
        prefetcher.add("t", 0, first)
        prefetcher.add("t", 0, second)  # the first was dropped (a seek): its work is forgotten
        assert id(first) not in prefetch._ahead and id(second) in prefetch._ahead
    finally:
        prefetcher.close()
    assert not prefetch._ahead


def test_install_refuses_an_aiokafka_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiokafka.consumer.fetcher as fetcher

    prefetch.install()
    assert fetcher.MemoryRecords is prefetch.memory_records
    monkeypatch.setattr(fetcher, "MemoryRecords", object)
    with pytest.raises(RuntimeError, match="aiokafka changed"):
        prefetch.install()
