"""The weight sync benchmark runs end to end (tiny model) and prints its table."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_benchmark_small_run_prints_table(capsys):
    from benchmarks.weight_sync import main

    assert main(["--small", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.split("\n\n")[1].splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| case | changed | delta |")
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| AdamW lr=1e-06", "| AdamW lr=1e-05", "| 1% values changed"]
    # 1% of the values changed, and the delta is far smaller than the model
    one_pct = rows[3].split(" | ")
    assert 0.99 <= float(one_pct[1].rstrip("%")) <= 1.2  # small tensors round up to one change
    assert float(one_pct[2].rstrip("%")) < 5.0
    assert "| publish keyframe s | publish delta s |" in out  # the end-to-end table
