"""``rollway sampler``: a sampler replica (tasks -> rollouts -> trajectories)."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica-id", help="this replica's id (default: $ROLLWAY_REPLICA_ID or sampler-HOST-PID)")
    parser.add_argument("--engine", choices=["vllm", "torch"], help="inference engine (default: sampler.engine)")
    parser.add_argument("--model", help="model folder (default: sampler.model_path)")
    parser.add_argument("--sandbox-url", help="sandbox service URL (default: sampler.sandbox_url)")
    parser.add_argument("--no-weights", action="store_true", help="do not follow rollway.weights")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from rollway.commands import given, load_config_or_exit
    from rollway.logging import configure_logging, default_replica_id

    cfg = load_config_or_exit(args, "sampler", {"sampler": given(
        engine=args.engine, model_path=args.model, sandbox_url=args.sandbox_url,
        follow_weights=False if args.no_weights else None)})
    replica_id = args.replica_id or default_replica_id("sampler")
    configure_logging("sampler", replica_id, level=cfg.logging.level)

    async def main() -> int:
        from pathlib import Path

        from sampler.service import SamplerService, make_engine

        if not (Path(cfg.sampler.model_path) / "config.json").exists():
            print(f"rollway sampler: no model at {cfg.sampler.model_path} (set sampler.model_path; "
                  "`rollway model` builds the tiny one)", file=sys.stderr)
            return 2
        engine = make_engine(cfg.sampler, cfg.syncer)
        await engine.start()
        try:
            await SamplerService(cfg.sampler, engine, kafka=cfg.kafka, syncer=cfg.syncer, model_name=cfg.model_name,
                                 replica_id=replica_id).run()
        finally:
            await engine.close()
        return 0

    return asyncio.run(main())
