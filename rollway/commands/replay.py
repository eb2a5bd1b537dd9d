"""``rollway replay``: re-execute logged train steps and check their weights hashes.

Exit codes: 0 every step re-executed (and, with --verify, matched); 1 a hash mismatch
with --verify; 2 the replay could not run (missing checkpoint folder, a checkpoint that
does not load or loads to other weights than the log says, a bad step range or log)."""

from __future__ import annotations

import argparse

from rollway.commands.launcher import LaunchError, add_launcher_flags, world_size_flag


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from-step", type=int, required=True, help="first step to report (>= 1)")
    parser.add_argument("--to-step", type=int, help="last step to re-execute (default: the last logged)")
    parser.add_argument("--verify", action="store_true",
                        help="exit 1 unless every re-executed step's hash matches the log")
    parser.add_argument("--checkpoint-dir",
                        help="checkpoints to start from (default: trainer.checkpoint_dir); must exist")
    parser.add_argument("--no-checkpoint", action="store_true",
                        help="start from the initial model (step 0) instead of a checkpoint")
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    # At trainer.world_size N > 1 this command launches its ranks as `rollway trainer`
    # does, with the same flags: a replay's ranks can span machines like the trainer's.
    add_launcher_flags(parser)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys

    from rollway.commands import given, load_config_or_exit
    from rollway.logging import configure_logging

    try:
        world_size = world_size_flag(args)
    except LaunchError as exc:
        print(f"rollway replay: {exc}", file=sys.stderr)
        return 2
    cfg = load_config_or_exit(args, "replay", {"trainer": given(checkpoint_dir=args.checkpoint_dir,
                                                                 world_size=world_size)})
    configure_logging("replay", level="warning" if args.json else cfg.logging.level)

    from trainer.checkpoint import CheckpointError
    from trainer.core import TrainCore
    from trainer.replay import choose_checkpoint, replay_steps, restore_checkpoint
    from trainer.steplog import StepLogError, read_step_log

    from pathlib import Path

    tcfg = cfg.trainer
    if not args.no_checkpoint and not Path(tcfg.checkpoint_dir).is_dir():
        # Silently starting from the initial model would re-execute far more than asked
        # and hide a typo; say so instead.
        print(f"rollway replay: checkpoint folder {tcfg.checkpoint_dir} does not exist "
              f"(pass --checkpoint-dir, or --no-checkpoint to start from the initial model)", file=sys.stderr)
        return 2

    sharded = None
    if tcfg.sharded:
        # A log written at N ranks re-executes at N ranks (the batch split depends on N):
        # this command launches them (on one machine, or with the launcher flags on
        # several: only rank 0 reads Kafka), rank 0 replays, the others follow.
        from rollway.commands.launcher import is_rank, launch
        from rollway.commands.trainer import offload_refused

        if not is_rank():
            import structlog

            refused = offload_refused(tcfg)
            if refused:
                print(f"rollway replay: {refused}", file=sys.stderr)
                return 2

            return launch(args, tcfg.world_size, structlog.get_logger("rollway.replay"), "replay")
        from trainer.ranked_service import ranked_replay_core

        sharded = ranked_replay_core(tcfg)
        if sharded is None:  # a rank other than 0: it followed rank 0 until the end
            return 0

    async def main():
        steps = await read_step_log(cfg.kafka)
        if not steps:
            raise StepLogError("the train-step log is empty")
        last = max(steps)
        to_step = last if args.to_step is None else args.to_step
        if not 1 <= args.from_step <= to_step <= last:
            raise StepLogError(f"need 1 <= --from-step ({args.from_step}) <= --to-step ({to_step}) "
                               f"<= last logged step ({last})")
        if sharded is not None:
            core = sharded.core
            start = 0 if args.no_checkpoint else sharded.restore(steps, args.from_step - 1)
        else:
            core = TrainCore(tcfg)
            info = None if args.no_checkpoint else choose_checkpoint(tcfg.checkpoint_dir, steps, args.from_step - 1)
            start = restore_checkpoint(core, info)
        rows = await replay_steps(cfg.kafka, core, steps, to_step, fail_on_mismatch=False)
        return start, rows

    try:
        start, rows = asyncio.run(main())
    except (StepLogError, FileNotFoundError, CheckpointError) as exc:
        print(f"rollway replay: {exc}", file=sys.stderr)
        return 2
    finally:
        if sharded is not None:
            sharded.close()
    shown = [r for r in rows if r.step >= args.from_step]
    if args.json:
        for r in shown:
            print(json.dumps({"step": r.step, "match": r.match, "logged_hash": r.logged_hash,
                              "replayed_hash": r.replayed_hash, "seconds": round(r.seconds, 4)}))
    else:
        print(f"started from step {start} ({'checkpoint' if start else 'initial model'}); "
              f"re-executed {len(rows)} steps")
        print(f"{'step':>6}  {'logged':<16}  {'replayed':<16}  match")
        for r in shown:
            print(f"{r.step:>6}  {r.logged_hash[:16]:<16}  {r.replayed_hash[:16]:<16}  {'yes' if r.match else 'NO'}")
        bad = [r.step for r in rows if not r.match]
        print(f"{len(rows) - len(bad)}/{len(rows)} steps match" + (f"; mismatches: {bad}" if bad else ""))
    if args.verify and any(not r.match for r in rows):
        return 1
    return 0
