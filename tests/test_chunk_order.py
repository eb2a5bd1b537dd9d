"""A trajectory's chunk order (``trainer.trajectory.order_chunks``, ``chunks_complete``)
is what it was before issue #29's intake work (``benchmarks/trajectory_baseline.py``):
the same order, the same completeness verdict and the same error for random position
sets in both index layouts, with repeats, gaps, stray segments and early finals."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from benchmarks import trajectory_baseline as before
from trainer import trajectory as after


def outcome(module, chunks) -> tuple:
    complete = module.chunks_complete(chunks)
    try:
        return ("ok", module.order_chunks(chunks), complete)
    except (before.InvalidTrajectory, after.InvalidTrajectory) as exc:
        return ("error", str(exc), complete)


def positions(rng: random.Random) -> list[SimpleNamespace]:
    across = rng.random() < 0.5  # chunk_index across the trajectory, else within each segment
    chunks, k = [], 0
    for segment in range(rng.randint(1, 3)):
        for i in range(rng.randint(1, 4)):
            chunks.append(SimpleNamespace(segment_index=segment, chunk_index=k if across else i, final=False))
            k += 1
    chunks[-1].final = True
    r = rng.random()
    if r < 0.15:
        chunks.append(SimpleNamespace(**vars(rng.choice(chunks))))  # a repeat
    elif r < 0.3:
        chunks.pop(rng.randrange(len(chunks)))  # a gap (or the final chunk missing)
    elif r < 0.4:
        rng.choice(chunks).segment_index += rng.choice([1, 2, -1])
    elif r < 0.5:
        rng.choice(chunks).chunk_index += rng.choice([1, -1, 5])
    elif r < 0.55:
        rng.choice(chunks).final = True  # a final flag before the end
    rng.shuffle(chunks)
    return chunks


@pytest.mark.parametrize("seed", range(3))
def test_order_and_completeness_are_unchanged(seed):
    rng = random.Random(seed)
    kinds = set()
    for _ in range(3000):
        chunks = positions(rng)
        want = outcome(before, chunks)
        assert outcome(after, chunks) == want, [(c.segment_index, c.chunk_index, c.final) for c in chunks]
        kinds.add(want[1].split(" ")[0] if want[0] == "error" else ("complete" if want[2] else "ok"))
    assert kinds == {"complete", "ok", "repeated", "segment", "chunk"}, kinds
