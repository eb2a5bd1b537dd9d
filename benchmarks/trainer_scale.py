"""Sharded trainer scaling on CPU (issue #28): per-rank memory of parameters + gradients +
optimizer state, and step time, at world size 1 vs 2 vs 4, side by side in one run.

The model is ``benchmarks/trainer_step.py``'s ``vocab32k`` case: a random-init Qwen2
(hidden 256, 4 layers, 32k vocabulary, untied head: ~19M parameters, no downloads) and a
batch of synthetic groups with realistic kept sets. Each world size trains the same
batches with ``ShardedTrainCore`` (launched by torch.distributed.run, gloo, one thread a
rank). Memory is counted, not sampled: at the optimizer step of the last step, the bytes
of each rank's local parameter shards, local gradient shards and optimizer state shards
(each distinct storage's ``nbytes()`` once, so padding FSDP2 adds is counted). Peak RSS of each rank
is reported next to it (informational: each rank reads only its rows of the checkpoint,
meta-device init, trainer/sharded_init.py; the interpreter, torch and transformers take
~0.5-1 GB a process, which dominates at this model size).
Step time is informational: 4 ranks on 2 cores share them.

After the steps, one publish from the shards (``publishable_state_sharded``, bfloat16,
buckets of ``--bucket-mb``): each rank's peak RSS above its RSS before the publish
(VmHWM, reset through /proc/self/clear_refs, after malloc_trim) and the bytes rank 0 keeps for the
publisher.

    flock /tmp/rollway-heavy.lock .venv/bin/python benchmarks/trainer_scale.py
    .venv/bin/python benchmarks/trainer_scale.py --world-sizes 1,2 --steps 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _storages(obj, out: dict[int, int]) -> dict[int, int]:
    """Every distinct storage under ``obj`` (tensors, DTensors' local shards, nested
    dicts and lists) -> its bytes. Distinct: FSDP2's sharded gradients are views into
    one reduce-scatter buffer per group, counted once."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        for v in obj.values():
            _storages(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, out)
    elif isinstance(obj, torch.Tensor):
        local = obj.to_local() if isinstance(obj, DTensor) else obj
        storage = local.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    return out


def _bytes(obj) -> int:
    return sum(_storages(obj, {}).values())


def rank_main(args_path: str) -> None:
    """One rank: train, count, report (rank 0 writes every rank's numbers)."""
    import resource

    import torch
    import torch.distributed as dist

    from trainer.config import TrainerConfig
    from trainer.distributed import all_gather_objects, exit_rank, init_distributed
    from trainer.sharded_core import ShardedTrainCore

    spec = json.loads(Path(args_path).read_text())
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    cfg = TrainerConfig(model_path=spec["model"], learning_rate=1e-5, muon_learning_rate=1e-5, max_staleness=100,
                        micro_batch_tokens=spec["micro_batch_tokens"], num_threads=1)
    core = ShardedTrainCore(cfg, ctx)
    groups = pickle.loads(Path(spec["groups"]).read_bytes())
    counted: dict[str, int] = {}
    step = core.optimizer.step

    def counting_step() -> None:
        step()
        params = list(core.model.parameters())
        counted["params"] = _bytes(params)
        counted["grads"] = _bytes([p.grad for p in params if p.grad is not None])
        counted["optimizer"] = _bytes(core.optimizer.state_dict())

    core.optimizer.step = counting_step
    times = []
    for _ in range(spec["steps"]):
        dist.barrier()
        started = time.perf_counter()
        core.train_step(groups)
        times.append(time.perf_counter() - started)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    publish = _measure_publish(core, ctx.rank, spec["bucket_bytes"])
    mine = dict(counted, rank=ctx.rank, step_s=times, peak_rss=peak_rss, publish=publish,
                params_count=sum(p.numel() for p in core.model.parameters()))
    everyone = all_gather_objects(mine)
    if ctx.rank == 0:
        Path(spec["out"]).write_text(json.dumps(everyone))
    exit_rank(0)  # not through the interpreter teardown (trainer.distributed.exit_rank)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _measure_publish(core, rank: int, bucket_bytes: int) -> dict:
    """One publish from the shards (``publishable_state_sharded``, bfloat16): the peak
    RSS above the RSS before it (Linux resets the high-water mark VmHWM on writing 5 to
    /proc/self/clear_refs), and the bytes rank 0 keeps (what it hands the publisher)."""
    import ctypes
    import gc

    import torch.distributed as dist

    from trainer.sharded_publish import publishable_state_sharded

    gc.collect()
    # Hand freed heap pages back first, else the publish reuses pages already resident
    # and the RSS does not see it (glibc's malloc_trim releases free pages of every arena).
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    started = time.perf_counter()
    state = publishable_state_sharded(core.model, "bfloat16", rank, bucket_bytes=bucket_bytes)
    seconds = time.perf_counter() - started
    peak = _status_bytes("VmHWM")
    kept = _bytes(state) if state is not None else 0
    del state
    return {"extra_peak": peak - before, "kept": kept, "seconds": seconds}


def run_world(world_size: int, spec: dict, workdir: Path) -> list[dict]:
    spec = dict(spec, out=str(workdir / f"ws{world_size}.json"))
    args_path = workdir / f"ws{world_size}-args.json"
    args_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           str(Path(__file__).resolve()), "--rank-main", str(args_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"world size {world_size} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(Path(spec["out"]).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank-main", help=argparse.SUPPRESS)
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--bucket-mb", type=float, default=8.0, help="publish gather bucket (publish dtype)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.rank_main)
        return

    from benchmarks.trainer_step import vocab_case

    world_sizes = [int(x) for x in args.world_sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="rollway-trainer-scale-") as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "model"
        model_dir.mkdir()
        path, groups = vocab_case(args, str(model_dir))
        (workdir / "groups.pkl").write_bytes(pickle.dumps(groups))
        spec = dict(model=path, groups=str(workdir / "groups.pkl"), steps=args.steps,
                    micro_batch_tokens=args.micro_batch_tokens, bucket_bytes=int(args.bucket_mb * 1e6))
        results = {ws: run_world(ws, spec, workdir) for ws in world_sizes}

    def state_bytes(r: dict) -> int:
        return r["params"] + r["grads"] + r["optimizer"]

    base = max(state_bytes(r) for r in results[world_sizes[0]])
    base_step = statistics.median(s for r in results[world_sizes[0]] for s in r["step_s"][1:] or r["step_s"])
    rows = []
    print(f"model: {results[world_sizes[0]][0]['params_count'] / 1e6:.1f}M float32 parameters; "
          f"{args.groups} groups x 4 x {args.prompt_tokens + args.gen_tokens} tokens a step; "
          f"median of steps 2..{args.steps}")
    print("| world size | params MB | grads MB | optimizer MB | total MB (max rank) | x world size 1 "
          "| peak RSS MB (max rank) | step s (median) | x world size 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ws in world_sizes:
        ranks = results[ws]
        worst = max(ranks, key=state_bytes)
        step = statistics.median(s for r in ranks for s in (r["step_s"][1:] or r["step_s"]))
        row = dict(world_size=ws, params_mb=worst["params"] / 1e6, grads_mb=worst["grads"] / 1e6,
                   optimizer_mb=worst["optimizer"] / 1e6, total_mb=state_bytes(worst) / 1e6,
                   memory_ratio=state_bytes(worst) / base, peak_rss_mb=max(r["peak_rss"] for r in ranks) / 1e6,
                   step_s=step, step_ratio=step / base_step)
        rows.append(row)
        print(f"| {ws} | {row['params_mb']:.1f} | {row['grads_mb']:.1f} | {row['optimizer_mb']:.1f} "
              f"| {row['total_mb']:.1f} | {row['memory_ratio']:.3f} | {row['peak_rss_mb']:.0f} "
              f"| {row['step_s']:.2f} | {row['step_ratio']:.2f} |")
    print()
    print(f"publish (bfloat16, buckets of {args.bucket_mb:g} MB): peak RSS above the RSS before it")
    print("| world size | rank 0 extra peak MB | rank 0 keeps MB | other ranks' extra peak MB (max) | seconds |")
    print("|---|---|---|---|---|")
    for ws, row in zip(world_sizes, rows):
        ranks = sorted(results[ws], key=lambda r: r["rank"])
        lead, others = ranks[0]["publish"], [r["publish"] for r in ranks[1:]]
        row.update(publish_rank0_extra_peak_mb=lead["extra_peak"] / 1e6, publish_rank0_kept_mb=lead["kept"] / 1e6,
                   publish_others_extra_peak_mb=max((o["extra_peak"] for o in others), default=0) / 1e6,
                   publish_s=lead["seconds"])
        print(f"| {ws} | {row['publish_rank0_extra_peak_mb']:.1f} | {row['publish_rank0_kept_mb']:.1f} "
              f"| {row['publish_others_extra_peak_mb']:.1f} | {row['publish_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
