"""torch.distributed's launcher for the commands that run ``trainer.world_size`` ranks
(``rollway trainer``, ``rollway replay``): one definition of the flags that pass through
to torchrun, the launcher's argv built from them, and the launch itself.

The same command on every machine makes one group of ``--nnodes`` x ``--nproc`` ranks;
each rank runs the command line again without the launcher's flags (:func:`rank_argv`)
and finds RANK in its environment (:func:`is_rank`)."""

from __future__ import annotations

import argparse
import os

# torchrun's flags that pass through (name, metavar, help).
RENDEZVOUS_FLAGS = (
    ("--nnodes", "N", "machines in the group (torchrun --nnodes; default 1: --standalone)"),
    ("--node-rank", "I", "this machine's index (torchrun --node-rank; static rendezvous)"),
    ("--rdzv-backend", "NAME", "torchrun --rdzv-backend (c10d for several machines; default static)"),
    ("--rdzv-endpoint", "HOST:PORT", "torchrun --rdzv-endpoint"),
    ("--rdzv-id", "ID", "torchrun --rdzv-id: the same on every machine of one group"),
    ("--master-addr", "HOST", "torchrun --master-addr (static rendezvous)"),
    ("--master-port", "PORT", "torchrun --master-port"),
    ("--max-restarts", "N", "torchrun --max-restarts: restart all ranks this often when one fails (default 0)"),
)


class LaunchError(ValueError):
    """A launcher flag combination that cannot make the group (a one-line reason)."""


def add_launcher_flags(parser: argparse.ArgumentParser) -> None:
    """``--nproc`` and the rendezvous flags."""
    parser.add_argument("--nproc", type=int, metavar="N",
                        help="ranks on this machine; sets trainer.world_size = N x --nnodes "
                             "(default: trainer.world_size / --nnodes)")
    for flag, metavar, help_text in RENDEZVOUS_FLAGS:
        parser.add_argument(flag, metavar=metavar, help=help_text)


def is_rank() -> bool:
    """Started by torchrun (this command's launcher, or the user's own)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _nnodes(args: argparse.Namespace) -> int:
    try:
        nnodes = int(args.nnodes or 1)
    except ValueError:
        raise LaunchError(f"--nnodes {args.nnodes}: give a fixed number of machines (an elastic range would "
                          "change the world size, and with it the batch split the step log records)") from None
    if nnodes < 1:
        raise LaunchError("--nproc and --nnodes must be >= 1")
    return nnodes


def world_size_flag(args: argparse.Namespace) -> int | None:
    """trainer.world_size as --nproc x --nnodes say (None: no --nproc)."""
    nnodes = _nnodes(args)
    if args.nproc is None:
        return None
    if args.nproc < 1:
        raise LaunchError("--nproc and --nnodes must be >= 1")
    return args.nproc * nnodes


def launcher_argv(args: argparse.Namespace, world_size: int) -> list[str]:
    """torchrun's own flags for ``world_size`` ranks as the launcher flags say."""
    nnodes = _nnodes(args)
    nproc = args.nproc if args.nproc is not None else world_size // nnodes
    if nproc * nnodes != world_size:
        raise LaunchError(f"trainer.world_size = {world_size} is not --nnodes {nnodes} x {nproc} ranks a machine; "
                          "give --nproc")
    endpoint = args.rdzv_endpoint or args.master_addr
    if nnodes > 1:
        # Without these torchrun waits for peers at its default address (or each
        # machine believes it is machine 0) until its rendezvous times out.
        if not endpoint:
            raise LaunchError(f"--nnodes {nnodes} needs a rendezvous endpoint: --rdzv-endpoint HOST:PORT "
                              "(or --master-addr HOST), the same on every machine")
        if (args.rdzv_backend or "static") == "static" and args.node_rank is None:
            raise LaunchError(f"--nnodes {nnodes} with a static rendezvous needs --node-rank (0..{nnodes - 1}), "
                              "or use --rdzv-backend c10d")
    launcher = [f"--nproc-per-node={nproc}"]
    if nnodes == 1 and not endpoint:
        launcher.append("--standalone")
    for flag, _, _ in RENDEZVOUS_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            launcher.append(f"{flag}={value}")
    return launcher


def launch(args: argparse.Namespace, world_size: int, log, command: str) -> int:
    """Run torch.distributed.run in this process: the ranks of ``rollway <command>``;
    exit 2 with a one-line reason where the flags cannot make the group."""
    import sys

    try:
        launcher = launcher_argv(args, world_size)
    except LaunchError as exc:
        print(f"rollway {command}: {exc}", file=sys.stderr)
        return 2
    log.info(f"launching {command} ranks", world_size=world_size, nnodes=_nnodes(args), torchrun=" ".join(launcher))
    # The ranks get the world size from the environment (they inherit this process's),
    # not from --nproc x --nnodes, which their command line leaves out (rank_argv).
    os.environ["ROLLWAY_TRAINER__WORLD_SIZE"] = str(world_size)
    return run_ranks(launcher, log, command)


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


def run_ranks(launcher: list[str], log, command: str) -> int:
    """torch.distributed.run with ``launcher`` (its own flags), each rank running this
    command line (:func:`rank_argv`; it sees RANK in its environment); the exit code."""
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as torchrun

    try:
        torchrun(get_args_parser().parse_args([*launcher, "--module", "rollway.cli", *rank_argv(sys.argv[1:])]))
    except ChildFailedError as exc:
        # Rank 0's exit code says why the command stopped (fenced, replay mismatch, ...);
        # a rank killed by a signal reads 128 + its number, as a shell shows it.
        failures = exc.failures
        first = failures.get(0) or failures[min(failures)]
        code = first.exitcode if first.exitcode > 0 else 128 - first.exitcode
        log.error(f"{command} ranks failed", failed_ranks=sorted(failures), exit_code=code,
                  exit_codes={r: f.exitcode for r, f in failures.items()})
        print(f"rollway {command}: rank(s) {sorted(failures)} failed; exit code {code}", file=sys.stderr)
        return code
    return 0
