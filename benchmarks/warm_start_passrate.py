"""Pass@1 of a model on the task family, through the real agent loop and sandbox grader.

    .venv/bin/python benchmarks/warm_start_passrate.py MODEL_DIR [--split heldout] [--count 100]
        [--engine vllm|torch] [--temperature 1.0] [--top-p 0.95] [--seed 0]

One rollout per task: the sampler's AgentLoop (tool calls parsed from generated text,
tool replies from a live sandbox service, ``submit`` graded by the real grader on the
hidden tests). Chunks are not published (no Kafka needed). Prints pass@1 overall and per
kind, and a JSON line. The quick measurement used to calibrate the warm start; ``rollway
eval`` is the official one.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The test fixtures (tests/) live in the checkout, not in the installed packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def measure(model: str, split: str, count: int, engine_kind: str, temperature: float, top_p: float,
                  seed: int, concurrency: int) -> dict:
    from sampler.agent import AgentLoop
    from sampler.config import SamplerConfig
    from sandbox.client import SandboxClient
    from sandbox.config import RewardConfig, SandboxConfig
    from tasks.family import generate
    from tasks.store import TaskStore
    from tests.sandbox_helpers import live_sandbox

    specs = generate(split, count, seed=seed)
    scfg = SamplerConfig(model_path=model, engine=engine_kind, max_model_len=1024, temperature=temperature,
                         top_p=top_p, seed=seed, max_turns=6, max_tokens_per_turn=200, max_total_tokens=1000)
    if engine_kind == "vllm":
        from sampler.vllm_engine import VLLMEngine

        engine = VLLMEngine.from_config(scfg)
    else:
        from sampler.torch_engine import TorchEngine

        engine = TorchEngine.from_config(scfg)
    await engine.start()

    async def publish(chunk):
        return None

    box = SandboxConfig(max_sessions=concurrency * 2, max_concurrent_commands=max(2, os.cpu_count() or 2),
                        command_queue_timeout_s=600.0, workspace_root=tempfile.mkdtemp(prefix="passrate-"))
    started = time.perf_counter()
    results: list[tuple[str, float, str, int]] = []
    turns = rerenders = 0
    try:
        async with live_sandbox(box, RewardConfig(), TaskStore("tasks/demo")) as live, \
                SandboxClient(live.url) as client:
            loop = AgentLoop(engine, client, scfg, publish)
            gate = asyncio.Semaphore(concurrency)

            async def one(i: int, spec) -> None:
                nonlocal turns, rerenders
                async with gate:
                    res = await loop.run(spec.to_event(f"passrate-{i}", 1), 0, "0")
                    turns += res.cost.turns
                    rerenders += res.cost.template_rerenders
                    results.append((spec.metadata["kind"], res.reward.score if res.reward else 0.0,
                                    res.finish_reason, res.cost.generated_tokens))

            await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
    finally:
        await engine.close()
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for kind, score, _, _ in results:
        by_kind[kind].append(float(score >= 1.0))
    solved = sum(sum(v) for v in by_kind.values())
    return {
        "model": model, "split": split, "tasks": len(results), "engine": engine_kind,
        "temperature": temperature, "top_p": top_p, "seed": seed,
        "pass_at_1": solved / max(len(results), 1),
        "by_kind": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_kind.items())},
        "finish_reasons": dict(collections.Counter(r for _, _, r, _ in results)),
        "mean_generated_tokens": sum(t for *_, t in results) / max(len(results), 1),
        "format": loop.format.name, "turns": turns,
        # New segments the chat template forced (sampler/formats), per 1,000 turns.
        "template_rerenders_per_1k_turns": round(1000.0 * rerenders / turns, 1) if turns else None,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--split", default="heldout")
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--engine", default="vllm", choices=["vllm", "torch"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=16)
    a = p.parse_args()
    from rollway.logging import configure_logging

    configure_logging("passrate", level="warning")
    out = asyncio.run(measure(a.model, a.split, a.count, a.engine, a.temperature, a.top_p, a.seed, a.concurrency))
    print(f"{out['split']} pass@1 = {out['pass_at_1']:.3f} on {out['tasks']} tasks "
          f"(T={out['temperature']}, top_p={out['top_p']}, {out['engine']}); by kind {out['by_kind']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
