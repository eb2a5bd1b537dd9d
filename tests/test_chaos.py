"""The chaos run's short schedule (benchmarks/chaos.py --short): a real 3-node Kafka
(RF 3, min.insync.replicas 2) and the real components as processes; garbage into every
topic, a sampler SIGKILLed while the weight store is damaged, the trainer SIGKILLed
mid-checkpoint, and a frozen trainer woken after its replacement trained. The run's own
audit must hold every invariant (exit 0). Kafka that cannot start fails the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def test_short_chaos_run_holds_every_invariant(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/chaos.py", "--short", "--work-dir", str(tmp_path / "chaos")],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "| NO |" not in out, out[-6000:]
    # garbage, sampler, trainer-checkpoint, trainer-freeze: each followed by new steps.
    assert "4/4 faults followed by new steps" in out, out[-6000:]
