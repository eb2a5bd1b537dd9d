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

With ``--largest`` (issue #28's informational figure "largest model that trains in 24 GB
at world size 1 vs more ranks"): the same counting and each rank's peak RSS over setup
and one step, at a few sizes of one model family (``family``: benchmarks/trainer_largest.py's
Qwen2 family, hidden h, intermediate 2.75h, h/128 layers, heads of 64, 32k vocabulary,
untied) at each world size; a least-squares line peak = a + b x parameters per world
size; the largest parameter count whose per-rank peak stays under ``--ram-gib``, and the
family member below it. ``--check`` then trains one step at 1 rank of the family member
nearest half that 1-rank limit and compares its peak with the line. Per-rank means per
machine: ranks on one machine share its RAM (more ranks on one machine add none), so the
world-size-N figure is for N machines (or GPUs' hosts) of that much RAM each.

    flock /tmp/rollway-heavy.lock .venv/bin/python benchmarks/trainer_scale.py
    .venv/bin/python benchmarks/trainer_scale.py --world-sizes 1,2 --steps 2   # smoke
    flock /tmp/rollway-heavy.lock .venv/bin/python benchmarks/trainer_scale.py --largest --check \
        --groups 1 --prompt-tokens 16 --gen-tokens 16
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
    threads = spec.get("threads", 1)
    torch.set_num_threads(threads)
    ctx = init_distributed("cpu")
    cfg = TrainerConfig(model_path=spec["model"], learning_rate=1e-5, muon_learning_rate=1e-5, max_staleness=100,
                        micro_batch_tokens=spec["micro_batch_tokens"], num_threads=threads)
    started = time.perf_counter()
    core = ShardedTrainCore(cfg, ctx)
    setup_s = time.perf_counter() - started
    setup_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
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
    publish = _measure_publish(core, ctx.rank, spec["bucket_bytes"]) if spec.get("publish", True) else None
    mine = dict(counted, rank=ctx.rank, step_s=times, peak_rss=peak_rss, publish=publish, setup_s=setup_s,
                setup_peak_rss=setup_rss, meta_init=core.meta_init,
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
    parser.add_argument("--largest", action="store_true", help="the largest-model figure (see above)")
    parser.add_argument("--largest-hidden", default="512,768,1024",
                        help="--largest: the family's hidden sizes to measure (multiples of 256)")
    parser.add_argument("--ram-gib", type=float, default=24.0, help="--largest: the per-rank RAM")
    parser.add_argument("--check", action="store_true",
                        help="--largest: train one step at 1 rank near half the 1-rank limit")
    parser.add_argument("--threads", type=int, default=1, help="--largest: torch threads a rank (measured sizes)")
    parser.add_argument("--check-threads", type=int, default=2)
    parser.add_argument("--check-timeout", type=float, default=300.0)
    parser.add_argument("--cap-gb", type=float, default=19.0,
                        help="--largest: kill a run whose ranks' summed RSS passes this (it did not fit)")
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.rank_main)
        return
    if args.largest:
        largest(args)
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


# -- --largest ---------------------------------------------------------------------------


def family(hidden: int) -> tuple[int, int, int, int]:
    """(hidden, intermediate, layers, heads) of the family member with this hidden size:
    benchmarks/trainer_largest.py's SIZES follow it (h1024-l8, h2048-l16, ...)."""
    if hidden % 256:
        raise ValueError(f"hidden {hidden}: the family's sizes are multiples of 256 (kv heads = heads / 4)")
    return hidden, hidden * 11 // 4, hidden // 128, hidden // 64


def family_params(hidden: int, vocab: int) -> int:
    """The Qwen2 member's parameter count: embedding and head (untied), per layer q/k/v
    (with biases; kv = a quarter of the heads), o, gate/up/down and two norms, final norm."""
    h, inter, layers, heads = family(hidden)
    kv = (heads // 4) * (h // heads)
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h
    return 2 * vocab * h + layers * per_layer + h


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def largest(args) -> None:
    from benchmarks.trainer_largest import run_one, write_checkpoint
    from benchmarks.trainer_step import vocab_case

    world_sizes = [int(x) for x in args.world_sizes.split(",")]
    hiddens = [int(x) for x in args.largest_hidden.split(",")]
    ram = args.ram_gib * 2**30
    cap = int(args.cap_gb * 2**30)
    rows: list[dict] = []

    def measure(hidden: int, ws: int, workdir: Path, *, threads: int = 1, timeout: float = 900.0) -> dict:
        model_dir = workdir / f"h{hidden}"
        if not model_dir.exists():
            params = write_checkpoint(model_dir, f"h{hidden}", args.vocab, family(hidden))
            assert params == family_params(hidden, args.vocab), (params, family_params(hidden, args.vocab))
        spec = dict(model=str(model_dir), groups=str(workdir / "groups.pkl"), steps=args.steps,
                    micro_batch_tokens=args.micro_batch_tokens, publish=False, threads=threads)
        run = run_one(ws, spec, workdir, cap, timeout, script=Path(__file__))
        ranks = run["ranks"]
        row = dict(hidden=hidden, layers=family(hidden)[2], params=family_params(hidden, args.vocab), world_size=ws,
                   fit=run["fit"], why=run["why"], wall_s=run["wall_s"], sampled_peak_sum=run["sampled_peak_sum"])
        if ranks:
            row.update(peak_rss=max(r["peak_rss"] for r in ranks),
                       setup_peak_rss=max(r["setup_peak_rss"] for r in ranks),
                       state=max(r["params"] + r["grads"] + r["optimizer"] for r in ranks),
                       step_s=max(max(r["step_s"]) for r in ranks), setup_s=max(r["setup_s"] for r in ranks),
                       meta_init=all(r["meta_init"] for r in ranks))
        print(json.dumps(row), flush=True)
        return row

    with tempfile.TemporaryDirectory(prefix="rollway-trainer-largest-fit-") as tmp:
        workdir = Path(tmp)
        (workdir / "small").mkdir()
        _, groups = vocab_case(args, str(workdir / "small"))
        (workdir / "groups.pkl").write_bytes(pickle.dumps(groups))
        for hidden in hiddens:
            for ws in world_sizes:
                rows.append(measure(hidden, ws, workdir, threads=args.threads))
            for file in (workdir / f"h{hidden}").glob("*.safetensors"):
                file.unlink()
        fits = {}
        for ws in world_sizes:
            done = [r for r in rows if r["world_size"] == ws and r["fit"]]
            if len(done) < 2:
                continue
            a, b = _fit([r["params"] for r in done], [r["peak_rss"] for r in done])
            sa, sb = _fit([r["params"] for r in done], [r["state"] for r in done])
            limit = (ram - a) / b
            member = max((h for h in range(256, 16384, 256) if family_params(h, args.vocab) <= limit), default=None)
            fits[ws] = dict(a=a, b=b, state_a=sa, state_b=sb, limit=limit, member=member)
        check = None
        if args.check and 1 in fits:
            target = fits[1]["limit"] / 2
            hidden = min(range(256, 16384, 256), key=lambda h: abs(family_params(h, args.vocab) - target))
            predicted = fits[1]["a"] + fits[1]["b"] * family_params(hidden, args.vocab)
            free = _mem_available()
            if predicted * 1.15 > min(free, cap):
                check = dict(hidden=hidden, predicted=predicted, skipped=f"{free / 1e9:.1f} GB available, "
                             f"cap {cap / 1e9:.1f} GB: not started")
            else:
                check = dict(measure(hidden, 1, workdir, threads=args.check_threads, timeout=args.check_timeout),
                             predicted=predicted)
            for file in (workdir / f"h{hidden}").glob("*.safetensors"):
                file.unlink()

    tokens = args.groups * 4 * (args.prompt_tokens + args.gen_tokens)
    print()
    print(f"family: Qwen2, hidden h, intermediate 2.75h, h/128 layers, heads of 64, vocab {args.vocab} untied; "
          f"{tokens} tokens a step ({args.groups} groups x 4 x {args.prompt_tokens + args.gen_tokens}); "
          f"{args.steps} step(s); gloo, {args.threads} thread(s) a rank")
    print("| hidden / layers | parameters | world size | params+grads+optimizer GB (max rank) "
          "| peak RSS GB (max rank) | setup peak GB | setup s | step s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows + ([check] if check and "params" in check else []):
        if r["fit"]:
            print(f"| {r['hidden']} / {r['layers']} | {r['params'] / 1e9:.3f}B | {r['world_size']} "
                  f"| {r['state'] / 1e9:.2f} | {r['peak_rss'] / 1e9:.2f} | {r['setup_peak_rss'] / 1e9:.2f} "
                  f"| {r['setup_s']:.0f} | {r['step_s']:.0f} |")
        else:
            print(f"| {r['hidden']} / {r['layers']} | {r['params'] / 1e9:.3f}B | {r['world_size']} "
                  f"| did not finish: {r['why'][:80]} | | | | |")
    print()
    print(f"per-rank peak = a + b x parameters (least squares over the sizes measured); largest under "
          f"{args.ram_gib:g} GiB ({ram / 1e9:.2f} GB) a rank")
    print("| world size | a GB | b bytes/parameter (peak RSS) | b bytes/parameter (params+grads+optimizer only) "
          "| largest parameters | family member under it |")
    print("|---|---|---|---|---|---|")
    for ws, f in fits.items():
        member = f["member"]
        described = (f"hidden {member}, {family(member)[2]} layers, {family_params(member, args.vocab) / 1e9:.2f}B"
                     if member else "-")
        print(f"| {ws} | {f['a'] / 1e9:.2f} | {f['b']:.1f} | {f['state_b']:.1f} | {f['limit'] / 1e9:.2f}B "
              f"| {described} |")
    if check:
        print()
        if "skipped" in check:
            print(f"check (hidden {check['hidden']}, predicted {check['predicted'] / 1e9:.2f} GB): {check['skipped']}")
        elif check["fit"]:
            print(f"check: hidden {check['hidden']} ({check['params'] / 1e9:.2f}B) at 1 rank trained "
                  f"{args.steps} step(s): peak RSS {check['peak_rss'] / 1e9:.2f} GB, the line predicts "
                  f"{check['predicted'] / 1e9:.2f} GB ({check['peak_rss'] / check['predicted']:.2f}x); "
                  f"step {check['step_s']:.0f} s on {args.check_threads} threads")
        else:
            print(f"check: hidden {check['hidden']} ({check['params'] / 1e9:.2f}B) at 1 rank did not finish: "
                  f"{check['why']} (sampled RSS {check['sampled_peak_sum'] / 1e9:.2f} GB; the line predicts "
                  f"{check['predicted'] / 1e9:.2f} GB)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows, fits=fits, check=check), indent=2))


if __name__ == "__main__":
    main()
