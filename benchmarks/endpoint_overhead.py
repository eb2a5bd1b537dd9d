"""Endpoint overhead: tokens/s of episodes driven through the OpenAI-compatible endpoint
(``/v1/chat/completions`` with the ``openai`` client as the harness) vs Rollway's own
agent loop, on the same vLLM engine, the same tasks and budgets, side by side.

    KAFKA_BOOTSTRAP_SERVERS=... python benchmarks/endpoint_overhead.py --episodes 8 --repeat 5

Both paths sample through ``Engine.record`` into a ``TrajectoryRecorder`` and publish
their chunks to Kafka; the sandbox is :class:`sandbox.timing.TimingSandbox` with zero
latency (commands and grading take no time), so what differs is what the endpoint adds:
HTTP, JSON, the chat template's render and bridge per turn, parsing, and the harness's
turn-around (the harness, the ``openai`` client, runs in its own process, as harnesses
do, on the same cores). Rows alternate (loop, endpoint, loop,
...); each row runs ``--episodes`` episodes at once and reports generated tokens over
its wall time. The ratio is endpoint / loop (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from harness import benchmark_kafka, cpu_name, load_average, print_aligned  # noqa: E402

INSTRUCTION = "Fix `add` in solution.py so the tests pass."
FILES = {"solution.py": "def add(x, y):\n    return x - y\n"}


async def loop_row(agent, n: int, tag: str) -> int:
    from schemas import Task

    task = Task(task_id="fix_add", group_id=f"fix_add/{tag}", group_size=n, instruction=INSTRUCTION,
                files=FILES)
    results = await asyncio.gather(*(agent.run(task, i, f"loop-{tag}") for i in range(n)))
    return sum(r.cost.generated_tokens for r in results)


async def harness_episode(http, client, url: str, model: str, scfg, tag: str, index: int) -> int:
    """A minimal harness: the endpoint's answer is appended as returned; a call runs in the
    sandbox session and its output comes back as a tool message; submit ends it."""
    async with http.post(f"{url}/v1/rollway/episodes", json={
            "task_id": "fix_add", "instruction": INSTRUCTION, "files": FILES, "group_id": f"fix_add/{tag}",
            "group_size": index + 1, "sample_index": index}) as resp:
        ep = await resp.json()
    messages: list[dict] = [{"role": "user", "content": f"{INSTRUCTION}\nFiles: solution.py"}]
    generated = 0
    for _ in range(scfg.max_turns):
        r = await client.chat.completions.create(model=model, messages=messages, max_tokens=scfg.max_tokens_per_turn,
                                                 extra_headers={"X-Rollway-Episode": ep["id"]})
        generated += r.usage.completion_tokens
        said = r.choices[0].message
        messages.append(said.model_dump(exclude_none=True))
        calls = said.tool_calls or []
        if any(c.function.name == "submit" for c in calls):
            break
        if not calls:
            messages.append({"role": "user", "content": "error: end the turn with one tool call"})
            continue
        for c in calls:
            output = "ok"
            if c.function.name == "run":
                command = json.loads(c.function.arguments).get("command") or "true"
                async with http.post(f"{url}/v1/rollway/episodes/{ep['id']}/exec", json={"command": command}) as resp:
                    output = (await resp.json()).get("stdout", "")
            messages.append({"role": "tool", "tool_call_id": c.id, "content": output})
    async with http.post(f"{url}/v1/rollway/episodes/{ep['id']}/submit") as resp:
        await resp.json()
    return generated


async def harness_worker(url: str, model: str, turns: int, tokens_per_turn: int) -> None:
    """The harness process: for each line ``TAG N`` on stdin, run N episodes at once and
    answer the tokens they generated on stdout (a harness runs in its own process, so
    its client's CPU time is not taken from the engine's interpreter)."""
    import types

    import aiohttp
    from openai import AsyncOpenAI

    scfg = types.SimpleNamespace(max_turns=turns, max_tokens_per_turn=tokens_per_turn)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        print("ready", flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            tag, n = line.split()
            counts = await asyncio.gather(*(harness_episode(http, client, url, model, scfg, tag, i)
                                            for i in range(int(n))))
            print(sum(counts), flush=True)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=8, help="episodes at once per row")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens-per-turn", type=int, default=48)
    ap.add_argument("--harness", metavar="URL", help=argparse.SUPPRESS)  # the harness process
    args = ap.parse_args()
    if args.harness:
        await harness_worker(args.harness, "rollway-tiny", args.turns, args.tokens_per_turn)
        return

    from bus import EventProducer, ensure_topics
    from bus.config import KafkaConfig
    from sampler.agent import AgentLoop
    from sampler.config import SamplerConfig
    from sampler.formats import load_format
    from sampler.openai_api.config import EndpointConfig
    from sampler.openai_api.episodes import EpisodeRegistry
    from sampler.openai_api.server import EndpointServer, serve
    from sandbox.timing import TimingSandbox, TimingSandboxConfig
    from tests.sampler_helpers import agent_model_dir, start_test_engine

    scfg = SamplerConfig(model_path=str(agent_model_dir()), max_model_len=1024, top_p=0.95, max_turns=args.turns,
                         max_tokens_per_turn=args.tokens_per_turn, max_total_tokens=args.turns * args.tokens_per_turn)
    model = "rollway-tiny"
    with tempfile.TemporaryDirectory() as tmp, benchmark_kafka(tmp) as bootstrap:
        kafka = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=f"bench-endpoint-{uuid.uuid4().hex[:8]}.",
                            partitions={"trajectories": 2, "rewards": 1})
        await ensure_topics(kafka)
        engine = await start_test_engine(max_model_len=1024)
        try:
            async with EventProducer(kafka) as producer:
                sandbox = TimingSandbox(TimingSandboxConfig(exec_median_s=0.0, grading_median_s=0.0), producer)
                agent = AgentLoop(engine, sandbox, scfg, producer.publish, replica_id="bench-loop")
                chat_format = load_format(engine.tokenizer, "auto", model_path=scfg.model_path)
                registry = EpisodeRegistry(engine, sandbox, scfg, EndpointConfig(max_episodes=4 * args.episodes,
                                                                                  max_turns=args.turns,
                                                                                  max_total_tokens=scfg.max_total_tokens),
                                           producer.publish, chat_format, replica_id="bench-endpoint")
                async with serve(EndpointServer(registry, model)) as url:
                    harness = await asyncio.create_subprocess_exec(
                        sys.executable, __file__, "--harness", url, "--turns", str(args.turns),
                        "--tokens-per-turn", str(args.tokens_per_turn),
                        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)

                    async def harness_row(tag: str) -> int:
                        harness.stdin.write(f"{tag} {args.episodes}\n".encode())
                        await harness.stdin.drain()
                        return int(await harness.stdout.readline())

                    assert (await harness.stdout.readline()).strip() == b"ready"
                    await loop_row(agent, 2, "warmup")  # warm the engine once
                    await harness_row("warmup")
                    rows = []
                    for r in range(args.repeat):
                        for path in ("loop", "endpoint"):
                            tag = f"{path}-{r}"
                            t0 = time.perf_counter()
                            if path == "loop":
                                tokens = await loop_row(agent, args.episodes, tag)
                            else:
                                tokens = await harness_row(tag)
                            seconds = time.perf_counter() - t0
                            rows.append((r, path, tokens, seconds, tokens / seconds))
                    harness.stdin.close()
                    await harness.wait()
        finally:
            await engine.close()
    loop_rates = [x[4] for x in rows if x[1] == "loop"]
    end_rates = [x[4] for x in rows if x[1] == "endpoint"]
    paired = [e / lo for lo, e in zip(loop_rates, end_rates)]
    print(f"# {cpu_name()}, load {load_average()}, format {chat_format.name}, {args.episodes} episodes at once, "
          f"<= {args.turns} turns x {args.tokens_per_turn} tokens, top_p 0.95, {args.repeat} repeats")
    print_aligned(["repeat", "path", "tokens", "seconds", "tokens/s"],
                  [(r, p, t, f"{s:.2f}", f"{v:.1f}") for r, p, t, s, v in rows])
    print()
    print_aligned(["", "loop tok/s", "endpoint tok/s", "endpoint / loop"], [
        ("median", f"{statistics.median(loop_rates):.1f}", f"{statistics.median(end_rates):.1f}",
         f"{statistics.median(end_rates) / statistics.median(loop_rates):.2f}"),
        ("paired (median of per-repeat ratios)", "", "", f"{statistics.median(paired):.2f}"),
    ])


if __name__ == "__main__":
    asyncio.run(main())
