"""``rollway trainer``: restore from checkpoint and the train-step log, then train live."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-steps", type=int, help="stop after this many steps in total")
    parser.add_argument("--exit-when-idle", type=float, metavar="SECONDS",
                        help="stop when no record arrived and no step ran for this long")
    parser.add_argument("--no-publish", action="store_true",
                        help="do not publish weights through the syncer (dry run)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    import sys

    import structlog

    from rollway.commands import load_config_or_exit
    from rollway.logging import configure_logging

    cfg = load_config_or_exit(args, "trainer")
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

    trainer = Trainer(cfg.trainer, cfg.kafka, syncer=cfg.syncer, model_name=cfg.model_name,
                      sink=RecordingSink() if args.no_publish else None)

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
    log.info("trainer exited", step=step)
    return 0
