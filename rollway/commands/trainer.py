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

# torchrun's flags that `rollway trainer` passes through (name, metavar, help).
RENDEZVOUS_FLAGS = (
    ("--nnodes", "N", "machines in the trainer (torchrun --nnodes; default 1: --standalone)"),
    ("--node-rank", "I", "this machine's index (torchrun --node-rank; static rendezvous)"),
    ("--rdzv-backend", "NAME", "torchrun --rdzv-backend (c10d for several machines)"),
    ("--rdzv-endpoint", "HOST:PORT", "torchrun --rdzv-endpoint"),
    ("--rdzv-id", "ID", "torchrun --rdzv-id: the same on every machine of one trainer"),
    ("--master-addr", "HOST", "torchrun --master-addr (static rendezvous)"),
    ("--master-port", "PORT", "torchrun --master-port"),
    ("--max-restarts", "N", "torchrun --max-restarts: restart all ranks this often when one fails (default 0)"),
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-steps", type=int, help="stop after this many steps in total")
    parser.add_argument("--exit-when-idle", type=float, metavar="SECONDS",
                        help="stop when no record arrived and no step ran for this long")
    parser.add_argument("--no-publish", action="store_true",
                        help="do not publish weights through the syncer (dry run)")
    parser.add_argument("--nproc", type=int, metavar="N",
                        help="ranks on this machine; sets trainer.world_size = N x --nnodes "
                             "(default: trainer.world_size / --nnodes)")
    for flag, metavar, help_text in RENDEZVOUS_FLAGS:
        parser.add_argument(flag, metavar=metavar, help=help_text)


def is_rank() -> bool:
    """Started by torchrun (this command's launcher, or the user's own)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _world_size_flag(args: argparse.Namespace) -> int | None:
    """trainer.world_size as --nproc x --nnodes say (None: no --nproc)."""
    try:
        nnodes = int(args.nnodes or 1)
    except ValueError:
        raise SystemExit(f"rollway trainer: --nnodes {args.nnodes}: give a fixed number of machines (an elastic "
                         "range would change the world size, and with it the batch split the step log records)"
                         ) from None
    if args.nproc is None:
        return None
    if args.nproc < 1 or nnodes < 1:
        raise SystemExit("rollway trainer: --nproc and --nnodes must be >= 1")
    return args.nproc * nnodes


def run(args: argparse.Namespace) -> int:
    from rollway.commands import load_config_or_exit

    world_size = _world_size_flag(args)
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
    import sys

    import structlog

    from rollway.logging import configure_logging

    configure_logging("trainer", level="INFO")
    log = structlog.get_logger("rollway.trainer")
    nnodes = int(args.nnodes or 1)  # checked by _world_size_flag when --nproc is given
    nproc = args.nproc if args.nproc is not None else world_size // nnodes
    if nproc * nnodes != world_size:
        print(f"rollway trainer: trainer.world_size = {world_size} is not --nnodes {nnodes} x {nproc} ranks a "
              "machine; give --nproc", file=sys.stderr)
        return 2
    launcher = [f"--nproc-per-node={nproc}"]
    if nnodes == 1 and not (args.rdzv_endpoint or args.master_addr):
        launcher.append("--standalone")
    for flag, _, _ in RENDEZVOUS_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            launcher.append(f"{flag}={value}")
    log.info("launching trainer ranks", world_size=world_size, nproc=nproc, nnodes=nnodes,
             torchrun=" ".join(launcher))
    # The ranks get the world size from the environment (they inherit this process's),
    # not from --nproc x --nnodes, which their command line leaves out (rank_argv).
    os.environ["ROLLWAY_TRAINER__WORLD_SIZE"] = str(world_size)
    return run_ranks(launcher, log)


def rank_argv(argv: list[str]) -> list[str]:
    """This command line as each rank runs it: without the launcher's own flags
    (``--nproc`` and the rendezvous flags, as ``--flag value`` or ``--flag=value``).
    torchrun's argument parser reads the whole line, the ranks' part included, and
    refused ``--nproc`` as an ambiguous abbreviation of its ``--nproc-per-node`` /
    ``--nproc_per_node``: ``rollway trainer --nproc N`` failed before any rank started.
    The ranks need none of them."""
    launcher_flags = {"--nproc", *(flag for flag, _, _ in RENDEZVOUS_FLAGS)}
    out: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
            continue
        if arg.split("=", 1)[0] in launcher_flags:
            skip_value = "=" not in arg
            continue
        out.append(arg)
    return out


def run_ranks(launcher: list[str], log, command: str = "trainer") -> int:
    """torch.distributed.run with ``launcher`` (its own flags), each rank running this
    command line (:func:`rank_argv`; it sees RANK in its environment); the exit code."""
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as torchrun

    try:
        torchrun(get_args_parser().parse_args([*launcher, "--module", "rollway.cli", *rank_argv(sys.argv[1:])]))
    except ChildFailedError as exc:
        # Rank 0's exit code says why the trainer stopped (fenced, replay mismatch, ...);
        # a rank killed by a signal reads 128 + its number, as a shell shows it.
        failures = exc.failures
        first = failures.get(0) or failures[min(failures)]
        code = first.exitcode if first.exitcode > 0 else 128 - first.exitcode
        log.error(f"{command} ranks failed", failed_ranks=sorted(failures), exit_code=code,
                  exit_codes={r: f.exitcode for r, f in failures.items()})
        print(f"rollway {command}: rank(s) {sorted(failures)} failed; exit code {code}", file=sys.stderr)
        return code
    return 0


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
