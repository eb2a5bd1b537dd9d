"""The trainer's chunk check over a whole ``getmany`` batch at once (issue #29).

:func:`trainer.trajectory.check_chunk` checks one chunk with a dozen numpy calls (and
makes seven array views of it); at the rate one trainer reads (tens of thousands of
chunks a second) those calls, not the bytes, were most of the intake's own time.
:func:`check_chunks` gives every chunk of a batch the same verdict with the checks run
once over the batch's bytes joined end to end:

* the usual chunk (schema 2, at least one token, one version span, no routes, kept
  capped flags recorded) is checked in the batch: its lengths in Python, the CSR
  layout and the kept sizes by one compiled pass over the whole batch
  (``trainer.intake_kernels.bad_chunks``; row lengths in int64, so offsets that wrap
  around in int32 are not taken for rows). It is accepted only where every check of
  :meth:`TrajectoryChunk.arrays` holds. An accepted chunk
  gets the versions ``check_chunk`` gives it and no per-chunk array views
  (``CheckedChunk.arrays`` is None): the assembly reads its checked bytes joined with
  the rest of its segment (``trainer.trajectory._segment``);
* anything else (another layout, a chunk the batch pass does not accept as certainly
  valid, a batch too small to pay for the joins) goes through ``check_chunk`` itself,
  which returns the same result or raises the exact error.

So a bad chunk is refused with the message ``check_chunk`` gives it, whatever batch it
came in (``tests/test_batch_check.py``).
"""

from __future__ import annotations

import sys
from operator import attrgetter
from typing import Sequence

import numpy as np

from schemas import TrajectoryChunk, arrays
from trainer.intake_kernels import bad_chunks
from trainer.trajectory import CheckedChunk, check_chunk

# Below this many batch-checkable chunks the joins and batch passes cost more than they
# save: the chunks are checked one by one (same verdicts either way).
MIN_BATCH = 8
_LITTLE_ENDIAN = sys.byteorder == "little"
_ONE_SPAN_START = b"\0\0\0\0"
_INT32, _UINT8 = arrays.INT32, arrays.UINT8
_len = len
_token_ids, _kept_ids, _kept_offsets, _kept_sizes, _kept_capped = (
    attrgetter(name) for name in ("token_ids", "kept_ids", "kept_offsets", "kept_sizes", "kept_capped"))


def check_chunks(chunks: Sequence[TrajectoryChunk]) -> list[CheckedChunk | ValueError]:
    """Each chunk's ``check_chunk`` result (an accepted usual chunk without its array
    views), or the ValueError ``check_chunk`` raises for it, in order."""
    out: list[CheckedChunk | ValueError | None] = [None] * len(chunks)
    fast: list[int] = []
    if _LITTLE_ENDIAN and len(chunks) >= MIN_BATCH:
        for i, c in enumerate(chunks):
            n4 = len(c.token_ids)
            n = n4 >> 2
            if (n and not n4 & 3 and len(c.logprobs) == n4 and len(c.loss_mask) == n
                    and len(c.kept_offsets) == n4 + 4 and not len(c.kept_ids) & 3 and len(c.kept_sizes) == n4
                    and len(c.kept_capped) == n and not c.routed_experts and not c.routed_experts_shape
                    and len(c.versions) == 8 and c.version_starts == _ONE_SPAN_START):
                fast.append(i)
    if len(fast) >= MIN_BATCH:
        for i, verdict in zip(fast, _batch([chunks[i] for i in fast])):
            out[i] = verdict
    for i, c in enumerate(chunks):
        if out[i] is None:
            try:
                out[i] = check_chunk(c)
            except ValueError as exc:
                out[i] = exc
    return out  # type: ignore[return-value]


def _batch(chunks: list[TrajectoryChunk]) -> list[CheckedChunk | None]:
    """Checked chunks of ``chunks`` (each of the usual layout, its lengths agreeing),
    None for one the batch pass does not accept (checked one by one after)."""
    counts = np.fromiter(map(_len, map(_token_ids, chunks)), dtype=np.int64, count=len(chunks)) >> 2
    kept_counts = np.fromiter(map(_len, map(_kept_ids, chunks)), dtype=np.int64, count=len(chunks)) >> 2
    # One compiled pass over the batch (trainer.intake_kernels.bad_chunks): each chunk's
    # CSR starts at 0 and ends at its kept ids' count, no row is negative; a complete set
    # has exactly its recorded ids, a capped one (-1: size unknown) at least as many.
    bad_chunk = bad_chunks(np.frombuffer(b"".join(map(_kept_offsets, chunks)), _INT32),
                           np.frombuffer(b"".join(map(_kept_sizes, chunks)), _INT32),
                           np.frombuffer(b"".join(map(_kept_capped, chunks)), _UINT8), counts, kept_counts)
    out: list[CheckedChunk | None] = []
    for c, bad, n in zip(chunks, bad_chunk.tolist(), counts.tolist()):
        if bad:
            out.append(None)
            continue
        v = int.from_bytes(c.versions, "little", signed=True)
        if c.loss_mask.count(0) != n:  # something generated (check_chunk's count_nonzero)
            out.append(CheckedChunk(c, None, v, v, v))
        else:
            out.append(CheckedChunk(c, None, None, None, v))
    return out
