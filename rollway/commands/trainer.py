"""``rollway trainer``: restore from checkpoint and the train-step log, then train live.

At ``trainer.world_size`` N > 1 (or ``--nproc``; or at 1 with ``trainer.fsdp.cpu_offload``)
this process is torch.distributed's launcher (``torch.distributed.run``, what
``torchrun`` runs): it starts the ranks, each ``rollway trainer`` again with the same
arguments, and waits for them; rank 0 is the service, the others follow it
(``trainer/ranked_service.py``). The rendezvous flags
pass through to torchrun, so the same command on every machine makes one trainer of
``--nnodes`` x ``--nproc`` ranks (docs/trainer.md).
"""

from __future__ import annotations

import argparse
import os

from rollway.commands.launcher import LaunchError, add_launcher_flags, is_rank, rank_argv, run_ranks, world_size_flag

__all__ = ["is_rank", "rank_argv", "run_ranks"]  # their home is rollway.commands.launcher


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-steps", type=int, help="stop after this many steps in total")
    parser.add_argument("--exit-when-idle", type=float, metavar="SECONDS",
                        help="stop when no record arrived and no step ran for this long")
    parser.add_argument("--no-publish", action="store_true",
                        help="do not publish weights through the syncer (dry run)")
    add_launcher_flags(parser)


def run(args: argparse.Namespace) -> int:
    from rollway.commands import load_config_or_exit

    try:
        world_size = world_size_flag(args)
    except LaunchError as exc:
        import sys

        print(f"rollway trainer: {exc}", file=sys.stderr)
        return 2
    cfg = load_config_or_exit(args, "trainer", {"trainer": {"world_size": world_size} if world_size else {}})
    if cfg.trainer.sharded and not is_rank():
        refused = offload_refused(cfg.trainer)
        if refused:  # before any rank starts
            import sys

            print(f"rollway trainer: {refused}", file=sys.stderr)
            return 2
        return launch(args, cfg.trainer.world_size)
    # A rank of an N-rank trainer; one started at a world size other than the config's
    # is refused by init_distributed.
    sharded = is_rank() and (int(os.environ["WORLD_SIZE"]) > 1 or cfg.trainer.sharded)
    return serve(args, cfg, sharded=sharded)


def offload_refused(tcfg) -> str | None:
    """trainer.fsdp.cpu_offload where the ranks would run on the CPU (trainer.device
    "auto" on a machine without CUDA): the one-line reason, else None."""
    if not tcfg.fsdp.cpu_offload:
        return None
    from trainer.distributed import offload_error
    from trainer.model import pick_device

    try:
        return offload_error(True, pick_device(tcfg.device))
    except RuntimeError as exc:  # trainer.device = "cuda" without a CUDA device
        return str(exc)


def launch(args: argparse.Namespace, world_size: int) -> int:
    """Run torch.distributed.run in this process: N ranks of ``rollway trainer``."""
    import structlog

    from rollway.commands import launcher
    from rollway.logging import configure_logging

    configure_logging("trainer", level="INFO")
    return launcher.launch(args, world_size, structlog.get_logger("rollway.trainer"), "trainer")


def serve(args: argparse.Namespace, cfg, *, sharded: bool) -> int:
    import asyncio
    import signal
    import sys

    import structlog

    from rollway.logging import configure_logging

    configure_logging("trainer", level=cfg.logging.level)
    log = structlog.get_logger("rollway.trainer")

    from bus import WriterFenced
    from syncer.publisher import WeightConflict
    from trainer.checkpoint import CheckpointError
    from trainer.checkpoint_owner import CheckpointFenced
    from trainer.publishing import RecordingSink
    from trainer.replay import ReplayMismatch
    from trainer.service import Trainer
    from trainer.steplog import StepAlreadyLogged, StepLogError

    sink = RecordingSink() if args.no_publish else None
    if sharded:
        from trainer.distributed import init_distributed
        from trainer.ranked_service import Orders, RankedTrainer, follow, ignore_stop_signals, watch_parent

        watch_parent()
        try:
            ctx = init_distributed(cfg.trainer.device, cfg.trainer.world_size,
                                   cpu_offload=cfg.trainer.fsdp.cpu_offload)
        except RuntimeError as exc:
            print(f"rollway trainer: {exc}", file=sys.stderr)
            return 2
        orders = Orders(ctx.rank)
        if not ctx.is_leader:
            ignore_stop_signals()
            try:
                return follow(cfg.trainer, ctx, orders)
            finally:
                _leave_process_group()
        trainer = RankedTrainer(cfg.trainer, cfg.kafka, ctx, orders, syncer=cfg.syncer, model_name=cfg.model_name,
                                sink=sink)
    else:
        trainer = Trainer(cfg.trainer, cfg.kafka, syncer=cfg.syncer, model_name=cfg.model_name, sink=sink)

    async def main() -> int:
        from bus.connect import add_stop_handler

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            add_stop_handler(loop, sig, trainer.stop)
        return await trainer.run(max_steps=args.max_steps, exit_when_idle_s=args.exit_when_idle)

    try:
        step = asyncio.run(main())
    except (WriterFenced, WeightConflict, StepAlreadyLogged, CheckpointFenced) as exc:
        # Not the only trainer: a newer one owns the log (or the store holds other
        # weights). Nothing this process had not committed is visible.
        log.error("trainer stopped: not the only writer", error=str(exc))
        print(f"rollway trainer: stopped, another trainer is writing: {exc}", file=sys.stderr)
        return 4
    except (ReplayMismatch, StepLogError, CheckpointError) as exc:
        log.error("trainer stopped", error=str(exc))
        print(f"rollway trainer: {exc}", file=sys.stderr)
        return 3
    except FileNotFoundError as exc:
        print(f"rollway trainer: {exc}", file=sys.stderr)
        return 2
    finally:
        if sharded:
            trainer.release_ranks()
            _leave_process_group()
    log.info("trainer exited", step=step)
    return 0


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone; the process exits anyway
            pass
