"""The largest model the sharded trainer trains in this machine's RAM (issue #28's
informational figure), at world size 1 and 2 on CPU.

Configs grow in the tiny benchmark model's family (Qwen2, 32k vocabulary, untied head;
wider and deeper). Each checkpoint is written tensor by tensor (random N(0, 0.02),
bfloat16, one safetensors file a layer plus an index), so the parent never holds the
model. Each (size, world size) runs setup (meta-device init) + ``--steps`` train steps of
``ShardedTrainCore`` under torch.distributed.run (gloo, one thread a rank), while the
parent samples the summed RSS of the ranks (ranks share the machine: their RAM adds)
every 0.2 s and kills the run above ``--cap-gb``, which counts as "did not fit". Each
rank also reports its own peak RSS (ru_maxrss).

What the figure means: on one machine, more ranks do not add RAM; sharding only splits
the same bytes among processes (and each process adds its own interpreter, torch and
transformers, ~0.5-1 GB). More ranks let a model fit only when they are on more
machines (or GPUs): then the per-rank figure is what each machine needs.

    flock /tmp/rollway-heavy.lock .venv/bin/python benchmarks/trainer_largest.py
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (hidden, intermediate, layers, heads): the tiny benchmark model's family grown.
SIZES = {
    "h1024-l8": (1024, 2816, 8, 16),
    "h1536-l12": (1536, 4096, 12, 12),
    "h2048-l16": (2048, 5632, 16, 16),
    "h2048-l24": (2048, 5632, 24, 16),
    "h2560-l24": (2560, 6912, 24, 20),
    "h3072-l28": (3072, 8192, 28, 24),
}


def write_checkpoint(folder: Path, name: str, vocab: int,
                     dims: tuple[int, int, int, int] | None = None) -> int:
    """A random-init Qwen2 checkpoint written one layer at a time; returns its parameter
    count. ``dims`` (hidden, intermediate, layers, heads): a size not in ``SIZES``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trainer.sharded_init import parameters_on_meta

    hidden, inter, layers, heads = dims or SIZES[name]
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 4 or 1, head_dim=hidden // heads,
                         max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16")
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    parts: dict[str, dict] = {}
    for pname, p in model.named_parameters():
        key = f"layer-{pname.split('.')[2]}" if ".layers." in pname else "rest"
        for done in [k for k in parts if k not in (key, "rest")]:  # a layer is complete: write it
            save_file(parts.pop(done), str(folder / f"{done}.safetensors"))
        t = torch.ones(p.shape) if pname.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.02
        parts.setdefault(key, {})[pname] = t.to(torch.bfloat16)
    for key, tensors in parts.items():
        save_file(tensors, str(folder / f"{key}.safetensors"))
    from safetensors import safe_open

    weight_map = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            weight_map.update({k: file.name for k in f.keys()})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(p.numel() for p in model.parameters())


def rank_main(args_path: str) -> None:
    import resource

    import torch

    from trainer.config import TrainerConfig
    from trainer.distributed import all_gather_objects, exit_rank, init_distributed
    from trainer.sharded_core import ShardedTrainCore

    spec = json.loads(Path(args_path).read_text())
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    cfg = TrainerConfig(model_path=spec["model"], learning_rate=1e-5, muon_learning_rate=1e-5, max_staleness=100,
                        micro_batch_tokens=spec["micro_batch_tokens"], num_threads=1)
    started = time.perf_counter()
    core = ShardedTrainCore(cfg, ctx)
    setup_s = time.perf_counter() - started
    setup_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    groups = pickle.loads(Path(spec["groups"]).read_bytes())
    steps, optimizer_s, hash_s = [], [], []
    optimizer_step = core.optimizer.step

    def timed_optimizer_step() -> None:  # where a step's time goes: the optimizer apart
        started = time.perf_counter()
        optimizer_step()
        optimizer_s.append(time.perf_counter() - started)

    core.optimizer.step = timed_optimizer_step
    for _ in range(spec["steps"]):
        started = time.perf_counter()
        result = core.train_step(groups)
        steps.append(time.perf_counter() - started)
        hash_s.append(result.metrics["hash_s"])
    mine = dict(rank=ctx.rank, setup_s=setup_s, step_s=steps, optimizer_s=optimizer_s, hash_s=hash_s,
                setup_peak_rss=setup_rss, peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                meta_init=core.meta_init)
    everyone = all_gather_objects(mine)
    if ctx.rank == 0:
        Path(spec["out"]).write_text(json.dumps(everyone))
    exit_rank(0)  # not through the interpreter teardown (trainer.distributed.exit_rank)


def _tree_rss(pid: int) -> int:
    """Summed RSS of ``pid`` and its descendants (the launcher and its ranks)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def run_one(world_size: int, spec: dict, workdir: Path, cap: int, timeout: float, script: Path | None = None) -> dict:
    """Launch ``script``'s (default: this file's) ``--rank-main`` on ``world_size`` ranks,
    killing it above ``cap`` bytes of summed RSS or after ``timeout`` s."""
    tag = f"{Path(spec['model']).name}-ws{world_size}"
    spec = dict(spec, out=str(workdir / f"{tag}.json"))
    args_path = workdir / f"{tag}-args.json"
    args_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           str(Path(script or __file__).resolve()), "--rank-main", str(args_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    log = open(workdir / f"{tag}.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    peak, started, why = 0, time.monotonic(), None
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        if peak > cap:
            why = f"summed RSS passed the {cap / 2**30:.1f} GiB cap"
        elif time.monotonic() - started > timeout:
            why = f"slower than {timeout:.0f} s"
        if why:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.2)
    wall = time.monotonic() - started
    if why is None and proc.returncode != 0:
        text = (workdir / f"{tag}.log").read_text()
        # The rank's own last words (a Python error, a C++ terminate), not only torchrun's summary.
        said = [line for line in text.splitlines()
                if any(k in line for k in ("Error", "error:", "what()", "terminate", "Killed", "Traceback"))]
        why = f"rc {proc.returncode}: " + " | ".join(said[:6])[:1200]
    keep = os.environ.get("TRAINER_LARGEST_KEEP_LOGS")
    if keep:  # the run's log outlives the temporary folder
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"{tag}.log").write_text((workdir / f"{tag}.log").read_text())
    ranks = json.loads(Path(spec["out"]).read_text()) if why is None else []
    return dict(world_size=world_size, fit=why is None, why=why, sampled_peak_sum=peak, wall_s=wall,
                rank_peak_sum=sum(r["peak_rss"] for r in ranks), ranks=ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank-main", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=512)
    parser.add_argument("--cap-gb", type=float, default=19.0, help="kill a run whose ranks' summed RSS passes this")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.rank_main)
        return

    from benchmarks.trainer_step import vocab_case

    cap = int(args.cap_gb * 2**30)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollway-trainer-largest-") as tmp:
        workdir = Path(tmp)
        (workdir / "small").mkdir()
        _, groups = vocab_case(args, str(workdir / "small"))
        (workdir / "groups.pkl").write_bytes(pickle.dumps(groups))
        stopped = set()
        for name in args.sizes.split(","):
            model_dir = workdir / name
            params = write_checkpoint(model_dir, name, args.vocab)
            for ws in (int(x) for x in args.world_sizes.split(",")):
                if ws in stopped:
                    continue
                spec = dict(model=str(model_dir), groups=str(workdir / "groups.pkl"), steps=args.steps,
                            micro_batch_tokens=args.micro_batch_tokens)
                row = dict(run_one(ws, spec, workdir, cap, args.timeout), size=name, params=params)
                rows.append(row)
                if not row["fit"]:
                    stopped.add(ws)  # larger sizes will not fit either
                print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(rows, indent=2))
            for file in model_dir.glob("*.safetensors"):
                file.unlink()
    print()
    print("| size | parameters | world size | fit | summed RSS peak GB (sampled) | sum of rank peaks GB "
          "| summed RSS / parameter, bytes | setup s | step s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bpp = r["sampled_peak_sum"] / r["params"]
        setup = max((x["setup_s"] for x in r["ranks"]), default=float("nan"))
        step = max((max(x["step_s"]) for x in r["ranks"]), default=float("nan"))
        print(f"| {r['size']} | {r['params'] / 1e9:.2f}B | {r['world_size']} | {'yes' if r['fit'] else 'no: ' + r['why'][:60]} "
              f"| {r['sampled_peak_sum'] / 1e9:.1f} | {r['rank_peak_sum'] / 1e9:.1f} | {bpp:.1f} | {setup:.0f} | {step:.0f} |")


if __name__ == "__main__":
    main()
