"""Fuzzing stored weights (issue 13): a seeded sample of single-byte corruptions of a
delta manifest, a delta chunk, a full manifest and a full chunk. No corruption may
put wrong weights into the engine, and every one must end on the right weights
through a fallback path. ``benchmarks/weight_fuzz.py`` runs every byte."""

from __future__ import annotations

from benchmarks.weight_fuzz import run_fuzz


async def test_single_byte_corruptions_never_apply_wrong_weights_and_always_recover(tmp_path):
    tallies = await run_fuzz(tmp_path / "weights", sample=25, seed=13)
    assert set(tallies) == {"delta manifest", "delta chunk", "full manifest", "full chunk"}
    for label, t in tallies.items():
        assert t.tried == 25, label
        assert (t.wrong, t.wrong_positions) == (0, []), label
        assert (t.recovered, t.failed) == (25, 0), label
