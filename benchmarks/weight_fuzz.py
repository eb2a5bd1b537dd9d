"""Corrupt stored weight objects byte by byte; count wrong weights applied and recoveries.

A small model is published as v1 (keyframe), v2, v3 (deltas) and v4 (keyframe that also
stores a delta v3->v4) in a local folder store. For each corrupted byte of one of four
objects of v4 (the delta manifest, a delta chunk, the full manifest, a full chunk) a
subscriber updates to v4 with the hash the trainer announced: one at v3 for the delta
objects (the delta path breaks, the v4 keyframe must serve), a new replica for the full
objects (the v4 keyframe breaks, v1 + deltas must serve). A trial is

* ``recovered`` — the replica ends on exactly v4's bits;
* ``failed`` — UpdateFailed and the replica's weights untouched;
* ``wrong`` — anything else (weights that are neither its old ones nor v4's).

The invariant is wrong == 0; with a path around every single object, also failed == 0.

    python benchmarks/weight_fuzz.py              # every byte of the four objects
    python benchmarks/weight_fuzz.py --sample 50  # a seeded sample of 50 bytes each
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from syncer.apply import ModuleTarget
from syncer.bits import bits_view
from syncer.config import SyncerConfig
from syncer.hashing import state_dict_hash
from syncer.manifest import decode_manifest, manifest_key
from syncer.publisher import WeightPublisher
from syncer.store import LocalStore
from syncer.subscriber import UpdateFailed, WeightSubscriber

MODEL = "fuzz"


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 32, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(32, 32, dtype=torch.bfloat16)
        self.norm = torch.nn.LayerNorm(32, dtype=torch.float32)


def versions() -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    state = {n: (torch.randn(t.shape, generator=g) * 0.02).to(t.dtype) for n, t in Small().state_dict().items()}
    out = {1: state}
    for v in range(2, 5):
        out[v] = {n: (t.float() - 2e-3 * torch.sign(torch.randn(t.shape, generator=g))).to(t.dtype)
                  for n, t in out[v - 1].items()}
    return out


@dataclass
class Tally:
    tried: int = 0
    recovered: int = 0
    failed: int = 0
    wrong: int = 0
    wrong_positions: list[int] = field(default_factory=list)


def _same(module: torch.nn.Module, want: dict[str, torch.Tensor]) -> bool:
    got = module.state_dict()
    return all(np.array_equal(bits_view(got[n]), bits_view(t)) for n, t in want.items())


async def run_fuzz(root: Path, sample: int | None = None, seed: int = 0) -> dict[str, Tally]:
    cfg = SyncerConfig(chunk_bytes=4096, keyframe_every=3, keep_keyframes=2, zstd_threads=1, max_concurrency=2,
                       retry_delay_s=0.0)
    store = LocalStore(root, fsync=False)
    w = versions()
    pub = WeightPublisher(cfg, MODEL, store)
    for v in range(1, 5):
        await pub.publish(v, w[v])
    pub.close()
    announced = state_dict_hash(w[4])
    delta = decode_manifest(await store.get(manifest_key(MODEL, 4, "delta")))
    full = decode_manifest(await store.get(manifest_key(MODEL, 4, "full")))
    objects = {
        "delta manifest": (manifest_key(MODEL, 4, "delta"), 3),
        "delta chunk": (next(c.key for t in delta.tensors for c in t.chunks), 3),
        "full manifest": (manifest_key(MODEL, 4, "full"), None),
        "full chunk": (full.tensors[0].chunks[0].key, None),
    }
    rng = random.Random(seed)
    tallies: dict[str, Tally] = {}
    for label, (key, start) in objects.items():
        original = await store.get(key)
        positions = list(range(len(original)))
        if sample is not None and sample < len(positions):
            positions = sorted(rng.sample(positions, sample))
        tally = tallies[label] = Tally()
        for pos in positions:
            module = Small()
            sub = WeightSubscriber(cfg, MODEL, store, ModuleTarget(module))
            try:
                if start is not None:
                    await sub.update_to(start)
                before = {n: t.clone() for n, t in module.state_dict().items()}
                damaged = bytearray(original)
                damaged[pos] ^= rng.randrange(1, 256)
                await store.put(key, bytes(damaged))
                tally.tried += 1
                try:
                    await sub.update_to(4, announced)
                    ok = _same(module, w[4])
                    tally.recovered += ok
                except UpdateFailed:
                    ok = _same(module, before)
                    tally.failed += ok
                if not ok:
                    tally.wrong += 1
                    tally.wrong_positions.append(pos)
            finally:
                sub.close()
                await store.put(key, original)
    return tallies


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
        flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
        return f"{name} (avx512f: {'avx512f' in flags}, avx2: {'avx2' in flags})"
    except OSError:
        return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", type=int, help="bytes per object (seeded sample); default: every byte")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import logging

    import structlog

    # Thousands of expected "path failed" warnings would bury the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    torch.set_num_threads(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tallies = asyncio.run(run_fuzz(Path(tmp) / "weights", args.sample, args.seed))
    print(f"CPU: {cpu()}")
    print(f"{'object':<16} {'tried':>7} {'recovered':>10} {'failed':>7} {'wrong':>6}")
    for label, t in tallies.items():
        print(f"{label:<16} {t.tried:>7} {t.recovered:>10} {t.failed:>7} {t.wrong:>6}")
    total = Tally(*(sum(getattr(t, f) for t in tallies.values()) for f in ("tried", "recovered", "failed", "wrong")))
    print(f"{'total':<16} {total.tried:>7} {total.recovered:>10} {total.failed:>7} {total.wrong:>6}"
          f"   ({time.perf_counter() - started:.0f} s)")
    raise SystemExit(0 if total.wrong == 0 and total.failed == 0 else 1)


if __name__ == "__main__":
    main()
