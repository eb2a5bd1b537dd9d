"""``rollway evaluator``: evaluate every N-th weight version while training runs
(held-out pass@1 on ``rollway.evals``; see :mod:`sampler.evaluator`)."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica-id", help="this evaluator's id (default: $ROLLWAY_REPLICA_ID or evaluator-HOST-PID)")
    parser.add_argument("--split", help="family:heldout (default: eval.split), family:train, or dir:PATH")
    parser.add_argument("--every", type=int, help="evaluate versions divisible by this (default: eval.every_n_versions)")
    parser.add_argument("--engine", choices=["vllm", "torch"], help="inference engine (default: sampler.engine)")
    parser.add_argument("--model", help="base model folder (default: sampler.model_path)")
    parser.add_argument("--sandbox-url", help="sandbox service URL (default: eval.sandbox_url, else sampler.sandbox_url)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys
    from pathlib import Path

    from rollway.commands import given, load_config_or_exit
    from rollway.logging import configure_logging, default_replica_id

    cfg = load_config_or_exit(args, "evaluator", {
        "eval": given(split=args.split, every_n_versions=args.every, sandbox_url=args.sandbox_url),
        "sampler": given(engine=args.engine, model_path=args.model)})
    replica_id = args.replica_id or default_replica_id("evaluator")
    configure_logging("evaluator", replica_id, level=cfg.logging.level)

    async def main() -> int:
        from bus.admin import ensure_topics
        from bus.topics import topic_spec
        from sampler.evaluation import EvalError, eval_sampler_config, load_tasks
        from sampler.evaluator import Evaluator
        from sampler.service import make_engine

        try:
            split, specs = load_tasks(cfg.eval.split, max_tasks=cfg.eval.max_tasks, seed=cfg.eval.seed)
        except EvalError as exc:
            print(f"rollway evaluator: {exc}", file=sys.stderr)
            return 2
        if not (Path(cfg.sampler.model_path) / "config.json").exists():
            print(f"rollway evaluator: no model at {cfg.sampler.model_path} (set sampler.model_path; "
                  "`rollway model` builds one)", file=sys.stderr)
            return 2
        await ensure_topics(cfg.kafka, [topic_spec(t) for t in ("weights", "evals", "health")])
        engine = make_engine(eval_sampler_config(cfg.eval, cfg.sampler), cfg.syncer)
        await engine.start()
        try:
            await Evaluator(cfg.eval, cfg.sampler, engine, kafka=cfg.kafka, syncer=cfg.syncer, model_name=cfg.model_name,
                            replica_id=replica_id, split=split, specs=specs).run()
        except EvalError as exc:  # e.g. the sandbox refuses a task: not worth a restart loop
            print(f"rollway evaluator: {exc}", file=sys.stderr)
            return 2
        finally:
            await engine.close()
        return 0

    return asyncio.run(main())
