"""``rollway eval``: pass@1 of one weight version on a held-out split or a task folder.

Rollouts run through the sampler's engine and agent loop and are graded by the sandbox
service; the result is printed (a table, or ``--json``) and published as an
``EvalResult`` on ``rollway.evals``. Eval trajectories and rewards are published
nowhere, so they are never trained on (see :mod:`sampler.evaluation`).
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--split", help="family:heldout, family:heldout-names (held-out names too) or family:train "
                                        "('heldout', 'heldout-names', 'train' for short; default: eval.split)")
    parser.add_argument("--tasks", metavar="DIR", help="evaluate a folder of tasks in the task format instead of a split")
    parser.add_argument("--version", default="latest",
                        help="weight version N from the store, or 'latest' (default); 0 = the base model")
    parser.add_argument("--samples", type=int, help="samples per task (default: eval.samples)")
    parser.add_argument("--max-tasks", type=int, help="tasks to evaluate (default: eval.max_tasks; 0 = a whole folder)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: eval.temperature, "
                                                          "else the sampler's)")
    parser.add_argument("--seed", type=int, help="seed of the split's instances and of sampling (default: eval.seed)")
    parser.add_argument("--engine", choices=["vllm", "torch"], help="inference engine (default: sampler.engine)")
    parser.add_argument("--model", help="base model folder (default: sampler.model_path)")
    parser.add_argument("--sandbox-url", help="sandbox service URL (default: eval.sandbox_url, else sampler.sandbox_url)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (for scripts)")
    parser.add_argument("--no-publish", action="store_true", help="do not publish the EvalResult on rollway.evals")


def parse_version(text: str) -> int | None:
    """'latest' -> None; 'N' -> N >= 0; anything else raises ValueError."""
    if text == "latest":
        return None
    if not text.isdigit():
        raise ValueError(f"--version must be a version number >= 0 or 'latest', not {text!r}")
    return int(text)


def overrides(args: argparse.Namespace) -> dict:
    """The config keys the command line sets (``eval`` and ``sampler`` sections)."""
    from rollway.commands import given

    split = f"dir:{args.tasks}" if args.tasks is not None else args.split
    return {"eval": given(split=split, samples=args.samples, max_tasks=args.max_tasks, temperature=args.temperature,
                          seed=args.seed, sandbox_url=args.sandbox_url),
            "sampler": given(engine=args.engine, model_path=args.model)}


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import sys

    from rollway.commands import load_config_or_exit
    from rollway.logging import configure_logging

    # stdout is for the table or the JSON document: vLLM logs to stdout unless told not to.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.split is not None and args.tasks is not None:
        print("rollway eval: give --split or --tasks, not both", file=sys.stderr)
        return 2
    cfg = load_config_or_exit(args, "eval", overrides(args))
    configure_logging("eval", "cli", level="warning")
    # A broker that cannot be reached is reported in our one line; aiokafka's own
    # connection errors would only repeat it.
    import logging

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        version = parse_version(args.version)
    except ValueError as exc:
        print(f"rollway eval: {exc}", file=sys.stderr)
        return 2
    from sampler.evaluation import EvalError

    try:
        report = asyncio.run(_run(cfg, version, publish=not args.no_publish))
    except EvalError as exc:
        print(f"rollway eval: {exc}", file=sys.stderr)
        return 2
    if args.json:
        import msgspec

        print(msgspec.json.format(msgspec.json.encode(report.to_json()), indent=2).decode())
    else:
        print_table(report)
    result = report.result
    if report.publish_error:
        print(f"rollway eval: the result was not published on rollway.evals: {report.publish_error}", file=sys.stderr)
        return 1
    if result.errors:
        print(f"rollway eval: {result.errors} of {result.tasks * result.samples} rollouts failed "
              "(counted as not solved); see the log", file=sys.stderr)
        return 1
    return 0


async def _run(cfg, version: int | None, *, publish: bool):
    from pathlib import Path

    from bus import EventProducer
    from bus.admin import ensure_topics
    from bus.topics import topic_spec
    from sampler.evaluation import EvalError, check_sandbox, eval_sampler_config, evaluate, load_tasks, resolve_version
    from sampler.service import make_engine
    from sandbox.client import SandboxClient
    from bus.connect import KafkaUnreachable
    from syncer.store import open_store

    ecfg = cfg.eval
    split, specs = load_tasks(ecfg.split, max_tasks=ecfg.max_tasks, seed=ecfg.seed)
    if not (Path(cfg.sampler.model_path) / "config.json").exists():
        raise EvalError(f"no model at {cfg.sampler.model_path} (set sampler.model_path or --model; "
                        "`rollway model` builds one)")
    try:
        store = open_store(cfg.syncer.store_url, cfg.syncer)
        await store.start()
    except Exception as exc:
        raise EvalError(f"cannot open the weight store {cfg.syncer.store_url}: {exc}") from None
    try:
        version = await resolve_version(store, version, model_name=cfg.model_name, store_url=cfg.syncer.store_url)
        scfg = eval_sampler_config(ecfg, cfg.sampler)
        async with SandboxClient(ecfg.sandbox_url or scfg.sandbox_url, timeout_s=scfg.sandbox_request_timeout_s,
                                 publish_rewards=False) as sandbox:
            await check_sandbox(sandbox, specs)
            producer = None
            if publish:
                try:
                    await ensure_topics(cfg.kafka, [topic_spec("evals")])
                    producer = EventProducer(cfg.kafka, client_id=f"{cfg.kafka.client_id}-eval")
                    await producer.start()
                except KafkaUnreachable:
                    raise  # rollway.cli prints its one line
                except Exception as exc:
                    raise EvalError(f"cannot publish to Kafka at {cfg.kafka.bootstrap_servers}: {exc} "
                                    "(--no-publish evaluates without it)") from None
            try:
                engine = make_engine(scfg, cfg.syncer)
                await engine.start()
                try:
                    if version > 0:
                        await _load(cfg, store, engine, version)
                    report = await evaluate(engine, sandbox, scfg, ecfg, specs, split=split, model=cfg.model_name,
                                            evaluator="cli")
                finally:
                    await engine.close()
                if producer is not None:
                    try:
                        report.record = await producer.publish(report.result)
                    except Exception as exc:  # keep the result: it is printed, and the exit code says so
                        report.publish_error = str(exc) or type(exc).__name__
                return report
            finally:
                if producer is not None:
                    await producer.stop()
    finally:
        await store.close()


async def _load(cfg, store, engine, version: int) -> None:
    from sampler.evaluation import EvalError
    from syncer.subscriber import WeightSubscriber

    subscriber = WeightSubscriber(cfg.syncer, cfg.model_name, store, engine)
    try:
        await subscriber.update_to(version)
    except Exception as exc:  # UpdateFailed, or weights that do not fit the base model
        raise EvalError(f"cannot load {cfg.model_name} v{version} into {cfg.sampler.model_path}: {exc}") from None
    finally:
        subscriber.close()


def print_table(report) -> None:
    from rich.console import Console
    from rich.table import Table

    r = report.result
    console = Console()
    console.print(f"{r.split}: {r.model} v{r.weight_version}, {r.tasks} tasks x {r.samples} samples, "
                  f"temperature {r.temperature:g}, {r.seconds:.1f} s", soft_wrap=True, highlight=False)
    table = Table()
    table.add_column("kind")
    table.add_column("tasks", justify="right")
    table.add_column("pass@1", justify="right")
    counts: dict[str, int] = {}
    for t in report.tasks:
        if t.kind:
            counts[t.kind] = counts.get(t.kind, 0) + 1
    for kind, rate in r.per_kind.items():
        table.add_row(kind, str(counts.get(kind, 0)), f"{rate:.3f}")
    table.add_row("all", str(r.tasks), f"{r.pass_at_1:.3f}", style="bold")
    console.print(table)
    console.print(f"mean reward {r.mean_reward:.4f}   mean generated tokens {r.mean_generated_tokens:.1f}   "
                  f"cheated {r.cheated}   errors {r.errors}", highlight=False)
    if report.record is not None:
        console.print(f"published on {report.record.topic} (partition {report.record.partition}, "
                      f"offset {report.record.offset})", soft_wrap=True, highlight=False)
