"""Launching FSDP test ranks (tests/fsdp_worker.py) with torch.distributed.run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "fsdp_worker.py"


def run_ranks(nproc: int, scenario: str, args: dict, folder: Path, *, expect_ok: bool = True,
              timeout: float = 300) -> tuple[dict | None, str]:
    """Run ``scenario`` on ``nproc`` gloo ranks; (rank 0's output, the launcher's log)."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    name = f"{scenario}-{nproc}-{len(list(folder.glob('*.json')))}"
    args = dict(args, out=str(folder / f"{name}.pt"))
    args_path = folder / f"{name}.json"
    args_path.write_text(json.dumps(args))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKER), scenario, str(args_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout[-6000:] + proc.stderr[-6000:]
    if expect_ok:
        assert proc.returncode == 0, f"{scenario} on {nproc} ranks failed (rc {proc.returncode}):\n{output}"
        return torch.load(args["out"], weights_only=False), output
    assert proc.returncode != 0, f"{scenario} on {nproc} ranks was expected to fail:\n{output}"
    return None, output


def max_abs_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)
