"""`rollway weights` on a real file store: ls, verify, export, prune, and a corrupt chunk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from syncer.config import SyncerConfig
from syncer.store import LocalStore
from tests.weights_helpers import MODEL, assert_same_bits, initial_state, optimizer_like_step, publish_all

REPO = Path(__file__).resolve().parent.parent


def weights_cli(store_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollway.cli", "weights", "--model", MODEL, "--store", f"file://{store_dir}", *args],
        capture_output=True, text=True, cwd=REPO, timeout=120, env=dict(os.environ),
    )


async def test_weights_ls_verify_export_prune_and_corruption(tmp_path):
    # keep_keyframes=2: the publisher's own retention keeps everything; prune --keep 1 below.
    cfg = SyncerConfig(chunk_bytes=4096, keyframe_every=2, keep_keyframes=2, zstd_threads=1)
    versions = {1: initial_state()}
    for v in range(2, 5):
        versions[v] = optimizer_like_step(versions[v - 1], v)
    store_dir = tmp_path / "weights"
    async with LocalStore(store_dir) as store:
        (await publish_all(cfg, store, versions, upto=4)).close()

    ls = weights_cli(store_dir, "ls")
    assert ls.returncode == 0, ls.stderr
    rows = [line.split() for line in ls.stdout.splitlines()[2:]]
    # v1 keyframe; v2 delta; v3 keyframe (and its delta from v2); v4 delta.
    assert [(int(r[0]), r[1]) for r in rows] == [(1, "full"), (2, "delta"), (3, "delta"), (3, "full"), (4, "delta")]

    verify = weights_cli(store_dir, "verify", "4")
    assert verify.returncode == 0 and verify.stdout.startswith(f"{MODEL} v4: OK, 7 tensors"), verify.stderr

    out = tmp_path / "v4.safetensors"
    export = weights_cli(store_dir, "export", "4", str(out))
    assert export.returncode == 0, export.stderr
    assert_same_bits(load_file(str(out)), versions[4])

    # A flipped byte in a stored chunk of v4's delta: verify fails naming the problem.
    chunk = sorted(p for p in (store_dir / MODEL / "chunks").rglob("*") if p.is_file() and "v000000000004" in str(p))[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    bad = weights_cli(store_dir, "verify", "4")
    assert bad.returncode == 1 and "rollway weights:" in bad.stderr

    prune = weights_cli(store_dir, "prune", "--keep", "1")
    assert prune.returncode == 0 and prune.stdout.startswith("deleted 2 versions"), prune.stdout
    left = weights_cli(store_dir, "ls")
    assert [int(line.split()[0]) for line in left.stdout.splitlines()[2:]] == [3, 3, 4]

    # Orphans (a publish that crashed before its manifest): collected by prune once
    # older than the grace period.
    orphan = store_dir / MODEL / "chunks" / "v000000000009-delta" / "dead" / "00000-0000"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"leftover")
    kept = weights_cli(store_dir, "prune")
    assert kept.returncode == 0 and "deleted 0 unreferenced chunks" in kept.stdout and orphan.exists()
    gc = weights_cli(store_dir, "prune", "--grace-s", "0")
    assert gc.returncode == 0 and "deleted 1 unreferenced chunks" in gc.stdout, gc.stdout
    assert not orphan.exists()
    assert weights_cli(store_dir, "verify", "3").returncode == 0
