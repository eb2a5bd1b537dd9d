"""One rank of the FSDP tests (tests/test_fsdp*.py), launched by torch.distributed.run.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/fsdp_worker.py SCENARIO ARGS.json

Rank 0 writes what the test checks to ``out`` (torch.save). Scenarios:

* ``train``: steps on the pickled groups with ``ShardedTrainCore`` (full gradients of the
  first step kept); optionally a DCP checkpoint after the first step (written while the
  second step runs) and publishing every step from the shards into a file store.
* ``resume``: restore the newest DCP checkpoint, then train the remaining steps.
* ``muon``: ``ShardedMuon`` on a tiny MoE's sharded parameters against the unsharded
  optimizer on the same gradients.
* ``setup_memory``: each rank's peak RSS while ``ShardedTrainCore`` is built, above its
  RSS just before (meta-device init: about its shard, not the whole model).
* ``load``: ``ShardedTrainCore`` built from each of several model folders in turn: its
  full parameters after the load, whether meta-device init read them and its
  ``meta init`` log events (rank 0's).
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _cfg(args: dict):
    import msgspec

    from trainer.config import TrainerConfig

    base = dict(model_path=args["model_path"], learning_rate=1e-3, muon_learning_rate=1e-3, max_staleness=100,
                micro_batch_tokens=256, num_threads=1, device=args.get("device", "cpu"))
    base.update(args.get("config", {}))  # e.g. {"fsdp": {"cpu_offload": true}}
    return msgspec.convert(base, TrainerConfig)


def _batches(args: dict) -> list:
    groups = pickle.loads(Path(args["groups"]).read_bytes())
    return [[groups[i] for i in batch] for batch in args["batches"]]


def _full_grads(core) -> dict:
    from trainer.distributed import full_tensors

    return {n: g.cpu().clone() for n, g in full_tensors(
        (n, p.grad) for n, p in core.model.named_parameters() if p.grad is not None)}


def _owner(args: dict):
    from trainer.checkpoint_owner import FolderOwnership, Owner

    if "owner" not in args:
        return None
    return FolderOwnership(args["checkpoint_dir"], Owner(*args["owner"]))


async def _publish(publisher, version: int, state) -> None:
    await publisher.publish(version, state, version)


def train(args: dict) -> dict:
    import torch.distributed as dist

    from trainer.distributed import init_distributed
    from trainer.sharded_checkpoint import ShardedCheckpointer
    from trainer.sharded_core import ShardedTrainCore
    from trainer.sharded_publish import publishable_state_sharded

    cfg = _cfg(args)
    ctx = init_distributed(args.get("device", "cpu"), cpu_offload=cfg.fsdp.cpu_offload)
    core = ShardedTrainCore(cfg, ctx)
    out: dict = {"hashes": [], "metrics": [], "params": [], "initial_hash": core.weights_hash()}
    checkpointer = None
    if args.get("checkpoint_after"):
        checkpointer = ShardedCheckpointer(args["checkpoint_dir"], keep=3, rank=ctx.rank)
        owner = _owner(args)
        checkpointer.claim(owner if ctx.rank == 0 else None)
    publisher = loop = None
    if args.get("store") and ctx.rank == 0:
        from syncer.config import SyncerConfig
        from syncer.publisher import WeightPublisher
        from syncer.store import open_store

        syncer_cfg = SyncerConfig(store_url=f"file://{args['store']}", chunk_bytes=64 * 1024)
        loop = asyncio.new_event_loop()
        publisher = WeightPublisher(syncer_cfg, "tiny", open_store(syncer_cfg.store_url, syncer_cfg))
    original_step = core.optimizer.step

    def step_keeping_grads() -> None:
        if "grads" not in out:
            out["grads"] = _full_grads(core)
        original_step()

    core.optimizer.step = step_keeping_grads
    for i, batch in enumerate(_batches(args)):
        result = core.train_step(batch)
        out["hashes"].append(result.weights_hash)
        out["metrics"].append(result.metrics)
        out["params"].append(core.full_parameters())
        if checkpointer is not None and result.step == args["checkpoint_after"]:
            if args.get("newer_owner_before_save") and ctx.rank == 0:  # a newer trainer claims the folder now
                newer = args["newer_owner_before_save"]
                (Path(args["checkpoint_dir"]) / f".owner-p{newer[0]}-e{newer[1]}").touch()
            checkpointer.save(core, result.weights_hash)  # the next step runs while it is written
        if args.get("store"):
            state = publishable_state_sharded(core.model, cfg.publish_dtype, ctx.rank,
                                              bucket_bytes=args.get("bucket_bytes", 64 * 1024))
            if publisher is not None:
                loop.run_until_complete(_publish(publisher, result.step, state))
    if checkpointer is not None:
        checkpointer.close()
        out["checkpoint"] = str(checkpointer.last_written.path) if checkpointer.last_written else None
    if publisher is not None:
        publisher.close()
        loop.close()
    if ctx.device.type == "cuda":  # what CPU offload saves (benchmarks/gpu_check_fsdp.sh)
        import torch

        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
    dist.barrier()
    return out


def resume(args: dict) -> dict:
    import torch.distributed as dist

    from trainer.distributed import init_distributed
    from trainer.sharded_checkpoint import restore_newest
    from trainer.sharded_core import ShardedTrainCore

    cfg = _cfg(args)
    ctx = init_distributed(args.get("device", "cpu"), cpu_offload=cfg.fsdp.cpu_offload)
    core = ShardedTrainCore(cfg, ctx)
    restored = restore_newest(core, args["checkpoint_dir"])
    out: dict = {"restored": restored, "restored_hash": core.weights_hash(), "hashes": [], "params": [],
                 "metrics": []}
    for batch in _batches(args)[restored:]:
        result = core.train_step(batch)
        out["hashes"].append(result.weights_hash)
        out["metrics"].append(result.metrics)
        out["params"].append(core.full_parameters())
    dist.barrier()
    return out


def muon(args: dict) -> dict:
    """Two Muon steps on a tiny MoE, sharded over the ranks, against the unsharded
    optimizer fed the same full gradients (rank 0 runs the reference)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from tests.test_optim_moe import tiny_moe
    from trainer.config import TrainerConfig
    from trainer.distributed import decoder_blocks, full_tensors, init_distributed
    from trainer.optim import HybridOptimizer, split_parameters
    from trainer.sharded_optim import ShardedMuon

    torch.use_deterministic_algorithms(True)
    ctx = init_distributed("cpu")
    cfg = TrainerConfig(muon_learning_rate=0.02, weight_decay=0.1, muon_momentum=0.95)
    reference = tiny_moe(args["kind"])
    sharded = tiny_moe(args["kind"])
    for block in decoder_blocks(sharded):
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(sharded, mesh=ctx.mesh)
    muon_params, expert_params, _ = split_parameters(sharded)
    opt = ShardedMuon(muon_params + expert_params, lr=cfg.muon_learning_rate, weight_decay=cfg.weight_decay,
                      momentum=cfg.muon_momentum, adjust_lr_fn=cfg.muon_adjust_lr)
    ref_opt = HybridOptimizer(reference, cfg)
    ref_params = dict(reference.named_parameters())
    placements = {n: [repr(pl) for pl in p.placements] for n, p in muon_params + expert_params}
    local_shapes = {n: list(p.to_local().shape) for n, p in expert_params}
    for step in range(2):
        gen = torch.Generator().manual_seed(100 + step)
        for name, p in muon_params + expert_params:
            full = torch.randn(p.shape, generator=gen)
            p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            ref_params[name].grad = full.clone()
        opt.step()
        ref_opt.optimizers["muon"].step()
        ref_opt.optimizers["muon_experts"].step()
    names = [n for n, _ in muon_params + expert_params]
    got = dict(full_tensors((n, p) for n, p in sharded.named_parameters() if n in names))
    dist.barrier()
    return {"sharded": {n: t.clone() for n, t in got.items()},
            "reference": {n: ref_params[n].detach().clone() for n in names},
            "experts": [n for n, _ in expert_params], "placements": placements, "local_shapes": local_shapes}


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def setup_memory(args: dict) -> dict:
    """Peak RSS above the RSS before, over building the core (Linux resets the
    high-water mark VmHWM when 5 is written to /proc/self/clear_refs)."""
    import ctypes
    import gc

    import torch.distributed as dist
    import transformers  # noqa: F401  imported before the baseline: not the model's memory
    from transformers import AutoModelForCausalLM  # noqa: F401

    from trainer.distributed import all_gather_objects, init_distributed
    from trainer.sharded_core import ShardedTrainCore
    from trainer.sharded_init import build_on_meta

    ctx = init_distributed("cpu")
    build_on_meta(args["model_path"])  # the model classes' lazy imports, before the baseline
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    core = ShardedTrainCore(_cfg(args), ctx)
    extra = _status_bytes("VmHWM") - before
    local = sum(p.to_local().numel() * 4 for p in core.model.parameters())
    mine = {"rank": ctx.rank, "extra_peak": extra, "local_param_bytes": local,
            "full_param_bytes": sum(p.numel() * 4 for p in core.model.parameters()),
            "meta_init": getattr(core, "meta_init", False)}
    everyone = all_gather_objects(mine)
    dist.barrier()
    return {"ranks": everyone}


def load(args: dict) -> dict:
    import gc

    import structlog.testing
    import torch.distributed as dist

    from trainer.distributed import init_distributed
    from trainer.sharded_core import ShardedTrainCore

    ctx = init_distributed("cpu")
    out = {}
    for path in args["model_paths"]:
        with structlog.testing.capture_logs() as logs:
            core = ShardedTrainCore(_cfg(dict(args, model_path=path)), ctx)
        out[path] = {"meta_init": core.meta_init, "params": core.full_parameters(),
                     "events": [e for e in logs if e["event"].startswith("meta init")]}
        del core
        gc.collect()
    dist.barrier()
    return out


def main() -> None:
    import torch
    import torch.distributed as dist

    from trainer.distributed import exit_rank

    scenario, args_path = sys.argv[1], sys.argv[2]
    args = json.loads(Path(args_path).read_text())
    torch.set_num_threads(1)
    out = {"train": train, "resume": resume, "muon": muon, "setup_memory": setup_memory,
           "load": load}[scenario](args)
    if dist.get_rank() == 0:
        torch.save(out, args["out"])
    exit_rank(0)  # not a plain return: see exit_rank (gloo threads alive at interpreter teardown)


if __name__ == "__main__":
    main()
