"""Checking and decompressing fetched record batches ahead, on a worker thread (#29).

aiokafka checks a record batch's CRC and decompresses it when the consumer first reads
it, in ``getmany``, on the event loop's thread: for the trainer's intake ~6-7 and ~12 us
of a record's ~49 us, serial with the trainer's own decode, check and assembly. Both
release the GIL (aiokafka's compiled CRC-32C, zstandard), so they can run on the other
core meanwhile. A :class:`BatchPrefetcher` is handed each fetch response of its consumer
as it arrives (``bus.clients.decompress_fetches_ahead``) and queues every zstd batch
(record format v2) of each partition's message set to one worker thread, in the order
``getmany`` reads them; the worker computes the batch's CRC with aiokafka's own function
and decompresses it. aiokafka's fetcher then builds its records object through
:func:`memory_records`, which hands out, for a batch the worker finished with a good CRC
and a clean decompression, a stand-in: the original batch for every header field,
``validate_crc`` answered from the worker's check, and the records read from the
decompressed bytes (the same header, its codec bits cleared) by aiokafka's own batch
class. aiokafka's iteration, skipping, position updates and errors are its own.

Anything else goes the way it always went, the original batch to aiokafka: a batch the
worker has not started while busy further back (the loop's thread does it itself
rather than wait), a bad
CRC (aiokafka's own check then raises its own error), a payload zstandard refuses (no
content size in the frame, several frames, corrupt), another codec or format, a message
set of a consumer without a prefetcher.
"""

from __future__ import annotations

import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import zstandard
from aiokafka.record.default_records import DefaultRecordBatch
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.record.util import calc_crc32c

# Record batch v2 (magic 2) header: base offset (8), length (4), leader epoch (4),
# magic (1), CRC (4), attributes (2), ... record count (4); records from byte 61. The CRC
# covers everything from the attributes on.
_OFFSET_LENGTH = struct.Struct(">qi")
_MAGIC_AT = 16
_CRC = struct.Struct(">I")
_CRC_AT = 17
_ATTRIBUTES = struct.Struct(">h")
_ATTRIBUTES_AT = 21
_RECORDS_AT = 61
_CODEC_MASK = 0x07
_CODEC_ZSTD = 4
_CONTROL = 0x20

# id(message set) -> (the message set, kept alive so its id stays its own; its
# prefetcher; the worker's jobs by batch base offset). Filled when a response arrives,
# taken by memory_records() as aiokafka's fetcher builds the partition's records next.
_Jobs = dict[int, tuple[int, int, Future]]  # base offset -> (job number, stored CRC, result)
_ahead: dict[int, tuple[bytes, "BatchPrefetcher", _Jobs]] = {}
_install_lock = threading.Lock()
# Worker threads of a prefetcher: two decompress a fetch's batches side by side while
# getmany waits for them (one worker was no faster than aiokafka on the loop's thread,
# its ~15 us a record of CRC and decompression not hidden; with three, no better).
WORKERS = 2
_local = threading.local()


def zstd_batches(message_set: bytes) -> list[tuple[int, int, int]]:
    """(base offset, start, end) of each whole zstd batch of format v2 in a fetched
    message set, in order, control batches left out (aiokafka reads their marker itself);
    stops at the first batch of an older format or cut short."""
    out = []
    pos, size = 0, len(message_set)
    while pos + _RECORDS_AT <= size:
        base_offset, length = _OFFSET_LENGTH.unpack_from(message_set, pos)
        end = pos + 12 + length
        if length < _RECORDS_AT - 12 or end > size or message_set[pos + _MAGIC_AT] != 2:
            break
        (attributes,) = _ATTRIBUTES.unpack_from(message_set, pos + _ATTRIBUTES_AT)
        if attributes & _CODEC_MASK == _CODEC_ZSTD and not attributes & _CONTROL:
            out.append((base_offset, pos, end))
        pos = end
    return out


def _zstd(payload) -> bytes:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:  # (a decompression context is not shared between threads)
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    # One frame stating its size, nothing after it; zstandard raises for anything else.
    return dctx.decompress(payload, allow_extra_data=False)


def prepare(batch: memoryview) -> Any | None:
    """The worker's job for one zstd batch: None when its CRC is wrong (aiokafka's own
    check will say so), else aiokafka's batch over the header (codec bits cleared) and
    the decompressed records. Raises when zstandard refuses the payload."""
    (crc,) = _CRC.unpack_from(batch, _CRC_AT)
    if calc_crc32c(batch[_ATTRIBUTES_AT:]) != crc:
        return None
    records = _zstd(batch[_RECORDS_AT:])
    header = bytearray(batch[:_RECORDS_AT])
    (attributes,) = _ATTRIBUTES.unpack_from(header, _ATTRIBUTES_AT)
    _ATTRIBUTES.pack_into(header, _ATTRIBUTES_AT, attributes & ~_CODEC_MASK)
    return DefaultRecordBatch(bytes(header) + records)


class _CheckedBatch:
    """A batch whose CRC the worker checked and whose records it decompressed: header
    fields from the original, ``validate_crc`` True, records from the decompressed copy."""

    __slots__ = ("_batch", "_records")

    def __init__(self, batch: Any, records: Any) -> None:
        self._batch = batch
        self._records = records

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def validate_crc(self) -> bool:
        return True

    def __iter__(self):
        return iter(self._records)


class _AheadRecords:
    """aiokafka's records of one message set, handing out the worker's batches."""

    __slots__ = ("_records", "_prefetcher", "_ahead")

    def __init__(self, records: MemoryRecords, prefetcher: "BatchPrefetcher", ahead: _Jobs) -> None:
        self._records = records
        self._prefetcher = prefetcher
        self._ahead = ahead

    def size_in_bytes(self) -> int:
        return self._records.size_in_bytes()

    def has_next(self) -> bool:
        return self._records.has_next()

    def next_batch(self):
        batch = self._records.next_batch()
        if batch is None or not self._ahead:
            return batch
        job = self._ahead.pop(batch.base_offset, None)
        if job is None:
            return batch
        number, crc, future = job
        if crc != batch.crc:  # (not the batch it was queued for: never seen, but not to be trusted)
            future.cancel()
            return batch
        # Not started and the worker busy further back (a slow worker, or batches that
        # will not be read): read here, as before. Just behind (on the batch before, or
        # taking this one up), it is waited for: the worker only gets the GIL to take up
        # the next batch when this thread lets go of it.
        if self._prefetcher.behind(number) and future.cancel():
            return batch
        try:
            records = future.result()
        except Exception:  # zstandard refused it: aiokafka's decoder decides
            return batch
        return batch if records is None else _CheckedBatch(batch, records)


def memory_records(message_set):
    """What aiokafka's fetcher builds from a partition's message set (installed as
    ``aiokafka.consumer.fetcher.MemoryRecords``): aiokafka's own records, read through
    the worker's results when a prefetcher queued this message set."""
    records = MemoryRecords(message_set)
    entry = _ahead.pop(id(message_set), None)
    if entry is None or entry[0] is not message_set:
        return records
    return _AheadRecords(records, entry[1], entry[2])


def install() -> None:
    """Put :func:`memory_records` where aiokafka's fetcher builds a partition's records;
    idempotent."""
    from bus.clients import build_fetched_records_with

    with _install_lock:
        build_fetched_records_with(memory_records)


class BatchPrefetcher:
    """Queues the zstd batches of one consumer's fetch responses to worker threads."""

    def __init__(self) -> None:
        install()
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rollway-batches")
        # A partition's last queued message set: its next one replaces what is left of
        # it (aiokafka read it, or dropped it: a seek, a revoke, a discarded response).
        self._by_partition: dict[tuple[str, int], tuple[int, _Jobs]] = {}
        self._closed = False
        self.batches = 0  # queued so far: the next job's number
        self._working_on = -1  # the number of the job the worker took up last

    def add(self, topic: str, partition: int, message_set: bytes) -> None:
        """A partition's message set as fetched; its zstd batches are queued."""
        self._forget(self._by_partition.pop((topic, partition), None))
        if self._closed or not isinstance(message_set, bytes):
            return
        batches = zstd_batches(message_set)
        if not batches:
            return
        view = memoryview(message_set)
        submit, number = self._pool.submit, self.batches
        offsets = [base_offset for base_offset, _, _ in batches]
        if len(set(offsets)) != len(offsets):
            return  # (two batches at one offset: which is which is aiokafka's to say)
        jobs = {base_offset: (number + i, _CRC.unpack_from(message_set, start + _CRC_AT)[0],
                              submit(self._run, number + i, view[start:end]))
                for i, (base_offset, start, end) in enumerate(batches)}
        _ahead[id(message_set)] = (message_set, self, jobs)
        self._by_partition[(topic, partition)] = (id(message_set), jobs)
        self.batches += len(jobs)

    def _run(self, number: int, batch: memoryview):
        self._working_on = number
        return prepare(batch)

    def behind(self, number: int) -> bool:
        """The worker is still on a job before the one before ``number``."""
        return self._working_on < number - 1

    def _forget(self, queued: tuple[int, _Jobs] | None) -> None:
        if queued is None:
            return
        key, jobs = queued
        entry = _ahead.get(key)
        if entry is not None and entry[2] is jobs:  # (else taken by aiokafka already)
            del _ahead[key]
        for _, _, future in jobs.values():
            future.cancel()

    def close(self) -> None:
        """Drop what was not read and stop the worker (queued work is cancelled)."""
        self._closed = True
        for queued in self._by_partition.values():
            self._forget(queued)
        self._by_partition.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
