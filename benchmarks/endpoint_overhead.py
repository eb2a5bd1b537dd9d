"""Endpoint overhead: tokens/s of episodes driven through the OpenAI-compatible endpoint
(``/v1/chat/completions`` with the ``openai`` client as the harness) vs Rollway's own
agent loop, on the same vLLM engine, the same tasks and budgets, side by side.

    KAFKA_BOOTSTRAP_SERVERS=... python benchmarks/endpoint_overhead.py --episodes 8 --repeat 5

Both paths sample through ``Engine.record`` into a ``TrajectoryRecorder`` and publish
their chunks to Kafka; the sandbox is :class:`sandbox.timing.TimingSandbox` with zero
latency (commands and grading take no time), so what differs is what the endpoint adds:
HTTP, JSON, the chat template's render and bridge per turn, parsing, and the harness's
turn-around (the harness, the ``openai`` client, runs in its own process, as harnesses
do, on the same cores). Rows alternate in ABBA order (loop, endpoint, endpoint, loop,
...); each row runs ``--episodes`` episodes at once and reports generated tokens over
its wall time. The ratio is endpoint / loop (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import cProfile
import json
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
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


async def loop_row(agent, n: int, tag: str) -> dict[str, int]:
    from schemas import Task

    task = Task(task_id="fix_add", group_id=f"fix_add/{tag}", group_size=n, instruction=INSTRUCTION,
                files=FILES)
    results = await asyncio.gather(*(agent.run(task, i, f"loop-{tag}") for i in range(n)))
    return {"tokens": sum(r.cost.generated_tokens for r in results), "turns": sum(r.cost.turns for r in results),
            "template_rerenders": sum(r.cost.template_rerenders for r in results), "history_rewrites": 0}


# The harness names each chat request; both processes stamp it with time.perf_counter
# (CLOCK_MONOTONIC on Linux: one clock for all processes), so a turn's gap splits into
# the harness's and the server's parts.
SEQ_HEADER = "X-Bench-Request"

_REQUEST: contextvars.ContextVar[dict | None] = contextvars.ContextVar("endpoint_request", default=None)


class PrefixHits:
    """vLLM's prefix-cache hits (``RequestOutput.num_cached_tokens``) over the prompts of
    a row's requests: is an endpoint turn's prompt as much of a cache hit as the loop's?
    (Wraps the ``LLMEngine.step`` the engine's step thread calls; with ``step_s`` it
    also makes each step that returns outputs last at least that long.)"""

    def __init__(self, engine, step_s: float = 0.0) -> None:
        self.requests: dict[str, tuple[int, int]] = {}
        llm_engine = engine._engine
        inner = llm_engine.step
        # A prompt can hit at most its full blocks (the last token is always computed).
        self.block = llm_engine.vllm_config.cache_config.block_size

        def step():
            t0 = time.perf_counter()
            outputs = inner()
            if outputs and (rest := step_s - (time.perf_counter() - t0)) > 0:
                time.sleep(rest)  # --step-ms: a slower model's step (the GIL is free meanwhile)
            for out in outputs:
                cached = out.num_cached_tokens or 0
                old = self.requests.get(out.request_id, (0, 0))
                self.requests[out.request_id] = (max(old[0], cached), len(out.prompt_token_ids or ()))
            return outputs

        llm_engine.step = step  # the instance's attribute: the step thread calls self._engine.step()

    def take(self) -> tuple[int, int, int]:
        """(cached prompt tokens, prompt tokens in full blocks, prompt tokens) since the last take."""
        requests, self.requests = self.requests, {}
        return (sum(c for c, _ in requests.values()),
                sum((p - 1) // self.block * self.block for _, p in requests.values() if p),
                sum(p for _, p in requests.values()))


class TurnGaps:
    """Per path, how long each trajectory waited between two of its turns (from the end of
    one ``Engine.record`` to the start of the next: out of the engine's batch). The loop
    spends it parsing, running the (zero-latency) tool and bridging; the endpoint adds the
    HTTP round trips, the harness's own work and the server's handling."""

    def __init__(self, engine, endpoint_replica: str) -> None:
        self.ended: dict[str, float] = {}
        self.gaps: dict[str, list[float]] = {"loop": [], "endpoint": []}
        inner = engine.record

        async def record(rec, params):
            tid, now = rec.identity.trajectory_id, time.perf_counter()
            if tid in self.ended:
                path = "endpoint" if rec.identity.replica_id == endpoint_replica else "loop"
                self.gaps[path].append(now - self.ended[tid])
            box = _REQUEST.get()
            if box is not None:
                box["start"] = now
            try:
                return await inner(rec, params)
            finally:
                self.ended[tid] = time.perf_counter()
                if box is not None:
                    box["end"] = self.ended[tid]

        engine.record = record  # the instance's attribute: both paths call engine.record

    def track_server(self, app) -> None:
        """The server's share of the endpoint's gaps: a chat request's handling before and
        after its ``Engine.record`` (same task: a context variable carries the times), and
        /exec requests whole."""
        from aiohttp import web

        self.server: dict[str, list[float]] = {"chat: before the turn": [], "chat: after the turn": [], "exec": []}
        self.handled: dict[str, tuple[float, float, float, float]] = {}
        self.peers: set = set()  # the harness's TCP connections (keep-alive: a few, reused)
        self.parts: dict[str, list[float]] = {k: [] for k in self.PARTS}

        @web.middleware
        async def timed(request, handler):
            box: dict[str, float] = {}
            token = _REQUEST.set(box)
            self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
            t0 = time.perf_counter()
            try:
                return await handler(request)
            finally:
                t1 = time.perf_counter()
                _REQUEST.reset(token)
                if request.path.endswith("/exec"):
                    self.server["exec"].append(t1 - t0)
                elif "start" in box and "end" in box:
                    self.server["chat: before the turn"].append(box["start"] - t0)
                    self.server["chat: after the turn"].append(t1 - box["end"])
                    if seq := request.headers.get(SEQ_HEADER):
                        self.handled[seq] = (t0, box["start"], box["end"], t1)

        app.middlewares.insert(0, timed)

    PARTS = ("server: turn recorded -> response returned", "response returned -> harness has the message",
             "harness: message -> next request (its /exec included)", "request sent -> server handler starts",
             "server: handler starts -> turn starts (body, checks, bridge)")

    def split(self, stamps: list) -> None:
        """An endpoint row's gaps in five parts, from the harness's stamps of its chat
        requests (episode, seq, sent, returned) and the server's (handler start, turn
        start, turn end, handler end); both clocks are CLOCK_MONOTONIC."""
        by_episode: dict[str, list] = {}
        for ep, seq, sent, got in stamps:
            if seq in self.handled:
                by_episode.setdefault(ep, []).append((sent, got, *self.handled.pop(seq)))
        for turns in by_episode.values():
            turns.sort()
            for (_, got, _, _, end, h_end), (sent, _, h_start, start, _, _) in zip(turns, turns[1:]):
                for name, value in zip(self.PARTS, (h_end - end, got - h_end, sent - got, h_start - sent,
                                                     start - h_start)):
                    self.parts[name].append(value)

    def reset(self) -> None:
        self.ended.clear()
        self.handled.clear()
        self.peers.clear()
        for series in (*self.gaps.values(), *self.server.values(), *self.parts.values()):
            series.clear()

    @staticmethod
    def stats(name: str, series: list[float]) -> tuple:
        g = sorted(series) or [0.0]
        return (name, len(series), f"{1e3 * statistics.median(g):.1f}", f"{1e3 * g[int(0.9 * (len(g) - 1))]:.1f}",
                f"{1e3 * statistics.fmean(g):.1f}")


async def harness_episode(http, chat, url: str, scfg, tag: str, index: int, sent: Counter,
                          stamps: list) -> dict[str, int]:
    """A minimal harness: the endpoint's answer is appended as returned; a call runs in the
    sandbox session and its output comes back as a tool message; submit ends it.
    ``chat(messages, episode_id) -> (assistant message dict, completion tokens)``."""
    async with http.post(f"{url}/v1/rollway/episodes", json={
            "task_id": "fix_add", "instruction": INSTRUCTION, "files": FILES, "group_id": f"fix_add/{tag}",
            "group_size": index + 1, "sample_index": index}) as resp:
        ep = await resp.json()
    messages: list[dict] = [{"role": "user", "content": f"{INSTRUCTION}\nFiles: solution.py"}]
    generated = 0
    for _ in range(scfg.max_turns):
        try:
            sent["chat"] += 1
            seq, t0 = f"{ep['id']}/{sent['chat']}", time.perf_counter()
            said, tokens = await chat(messages, ep["id"], seq)
            stamps.append((ep["id"], seq, t0, time.perf_counter()))
        except Exception as exc:  # noqa: BLE001 - a refusal (context full) ends the episode, as the loop's does
            if "context_length_exceeded" not in str(exc):
                raise
            break
        generated += tokens
        messages.append(said)
        calls = said.get("tool_calls") or []
        if any(c["function"]["name"] == "submit" for c in calls):
            break
        if not calls:
            messages.append({"role": "user", "content": "error: end the turn with one tool call"})
            continue
        for c in calls:
            output = "ok"
            if c["function"]["name"] == "run":
                command = json.loads(c["function"]["arguments"]).get("command") or "true"
                async with http.post(f"{url}/v1/rollway/episodes/{ep['id']}/exec", json={"command": command}) as resp:
                    output = (await resp.json()).get("stdout", "")
                sent["exec"] += 1
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": output})
    async with http.post(f"{url}/v1/rollway/episodes/{ep['id']}/submit") as resp:
        done = await resp.json()
    return {"tokens": generated, "turns": done["turns"], "template_rerenders": done["template_rerenders"],
            "history_rewrites": done["history_rewrites"]}


async def harness_worker(url: str, model: str, turns: int, tokens_per_turn: int, client_kind: str,
                         extra_body: bool = False) -> None:
    """The harness process: for each line ``TAG N`` on stdin, run N episodes at once and
    answer what they generated on stdout (a harness runs in its own process, so its
    client's CPU time is not taken from the engine's interpreter). ``client_kind``:
    ``openai`` (the ``openai`` package, as harnesses use it) or ``aiohttp`` (plain JSON
    over one aiohttp session: a lean client, to tell the client's cost from the
    endpoint's)."""
    import types

    import aiohttp
    from openai import AsyncOpenAI

    scfg = types.SimpleNamespace(max_turns=turns, max_tokens_per_turn=tokens_per_turn)
    if client_kind == "openai-aiohttp":  # the openai client over aiohttp (needs the httpx-aiohttp package)
        from openai import DefaultAioHttpClient

        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=DefaultAioHttpClient())
    else:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:

        async def chat_openai(messages: list[dict], episode: str, seq: str) -> tuple[dict, int]:
            # extra_body: the SDK walks the typed arguments against its TypedDict unions
            # (async_maybe_transform, ~0.3 ms a message here) and merges extra_body after
            # that walk: the same JSON body without the walk.
            typed, extra = ([], {"messages": messages}) if extra_body else (messages, None)
            r = await client.chat.completions.create(model=model, messages=typed, max_tokens=tokens_per_turn,
                                                     extra_body=extra,
                                                     extra_headers={"X-Rollway-Episode": episode, SEQ_HEADER: seq})
            return r.choices[0].message.model_dump(exclude_none=True), r.usage.completion_tokens

        async def chat_aiohttp(messages: list[dict], episode: str, seq: str) -> tuple[dict, int]:
            async with http.post(f"{url}/v1/chat/completions", headers={"X-Rollway-Episode": episode, SEQ_HEADER: seq},
                                 json={"model": model, "messages": messages, "max_tokens": tokens_per_turn}) as resp:
                body = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"chat: HTTP {resp.status}: {body}")
            return body["choices"][0]["message"], body["usage"]["completion_tokens"]

        chat = chat_aiohttp if client_kind == "aiohttp" else chat_openai
        print("ready", flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            tag, indices = line.split()
            sent: Counter = Counter()
            stamps: list = []
            cpu0, ru0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            counts = await asyncio.gather(*(harness_episode(http, chat, url, scfg, tag, i, sent, stamps)
                                            for i in map(int, indices.split(","))))
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            out = {k: sum(c[k] for c in counts) for k in counts[0]}
            # The harness process's own CPU (its client, JSON, the episode logic) and how
            # often the kernel took the CPU from it (involuntary context switches).
            out["harness"] = {"cpu_s": time.process_time() - cpu0, "chat": sent["chat"], "exec": sent["exec"],
                              "involuntary_switches": ru1.ru_nivcsw - ru0.ru_nivcsw, "stamps": stamps}
            print(json.dumps(out), flush=True)


def _cpus(spec: str) -> set[int]:
    """``0``, ``0,1`` or ``0-1`` as a set of CPU numbers."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _thread_affinity() -> str:
    """The distinct CPU sets of this process's threads (vLLM may bind its own)."""
    sets = Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            sets[",".join(map(str, sorted(os.sched_getaffinity(int(tid)))))] += 1
        except OSError:
            continue
    return "; ".join(f"{k}: {n} threads" for k, n in sets.items())


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=8, help="episodes at once per row")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens-per-turn", type=int, default=48)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile the sampler's event loop during the endpoint rows; print the top N functions")
    ap.add_argument("--client", choices=("openai", "openai-aiohttp", "aiohttp"), default="openai",
                    help="the harness's HTTP client: the openai package (default; openai-aiohttp: with its aiohttp "
                         "transport, DefaultAioHttpClient, which needs httpx-aiohttp) or plain aiohttp JSON")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval of the sampler's process (Python's default: 5 ms), both paths")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="every engine step that samples lasts at least this long (the step thread sleeps the rest, "
                         "GIL released), both paths: a model served at a GPU's decode speed, where the tiny model's "
                         "CPU step is ~5 ms")
    ap.add_argument("--harness-processes", type=int, default=1,
                    help="harness processes the endpoint rows' episodes are spread over (1: all in one asyncio "
                         "process; --episodes: one process per episode, as mini-swe-agent runs)")
    ap.add_argument("--extra-body", action="store_true",
                    help="the openai client passes the messages through extra_body (messages=[] typed): the SDK's "
                         "client-side request transform is skipped, the body sent is the same")
    ap.add_argument("--harness-cpus", metavar="LIST", default="",
                    help="pin the harness processes to these CPUs (taskset -c LIST), e.g. 1")
    ap.add_argument("--sampler-cpus", metavar="LIST", default="",
                    help="pin the sampler's process (engine, loop, server; set before any thread starts) to these "
                         "CPUs, e.g. 0")
    ap.add_argument("--harness", metavar="URL", help=argparse.SUPPRESS)  # the harness process
    args = ap.parse_args()
    if args.switch_interval_ms is not None and not args.harness:
        sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    if args.harness:
        await harness_worker(args.harness, "rollway-tiny", args.turns, args.tokens_per_turn, args.client,
                             args.extra_body)
        return
    if args.sampler_cpus:
        os.sched_setaffinity(0, _cpus(args.sampler_cpus))  # this thread; threads started later inherit it

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

    max_model_len = 1024
    scfg = SamplerConfig(model_path=str(agent_model_dir()), max_model_len=max_model_len, top_p=0.95, max_turns=args.turns,
                         max_tokens_per_turn=args.tokens_per_turn, max_total_tokens=args.turns * args.tokens_per_turn)
    model = "rollway-tiny"
    with tempfile.TemporaryDirectory() as tmp, benchmark_kafka(tmp) as bootstrap:
        kafka = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=f"bench-endpoint-{uuid.uuid4().hex[:8]}.",
                            partitions={"trajectories": 2, "rewards": 1})
        await ensure_topics(kafka)
        engine = await start_test_engine(max_model_len=max_model_len)
        try:
            async with EventProducer(kafka) as producer:
                sandbox = TimingSandbox(TimingSandboxConfig(exec_median_s=0.0, grading_median_s=0.0), producer)
                agent = AgentLoop(engine, sandbox, scfg, producer.publish, replica_id="bench-loop")
                chat_format = load_format(engine.tokenizer, "auto", model_path=scfg.model_path)
                registry = EpisodeRegistry(engine, sandbox, scfg, EndpointConfig(max_episodes=4 * args.episodes,
                                                                                  max_turns=args.turns,
                                                                                  max_total_tokens=scfg.max_total_tokens),
                                           producer.publish, chat_format, replica_id="bench-endpoint")
                server = EndpointServer(registry, model)
                gaps = TurnGaps(engine, "bench-endpoint")
                hits = PrefixHits(engine, args.step_ms / 1000.0)
                gaps.track_server(server.app)
                async with serve(server) as url:
                    pin = ["taskset", "-c", args.harness_cpus] if args.harness_cpus else []
                    harnesses = [await asyncio.create_subprocess_exec(
                        *pin, sys.executable, __file__, "--harness", url, "--turns", str(args.turns),
                        "--tokens-per-turn", str(args.tokens_per_turn), "--client", args.client,
                        *(["--extra-body"] if args.extra_body else []),
                        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
                        for _ in range(max(1, min(args.harness_processes, args.episodes)))]

                    async def harness_part(proc, tag: str, indices: list[int]) -> dict:
                        proc.stdin.write(f"{tag} {','.join(map(str, indices))}\n".encode())
                        await proc.stdin.drain()
                        return json.loads(await proc.stdout.readline())

                    async def harness_row(tag: str, n: int = args.episodes) -> dict:
                        """Episodes 0..n-1 spread over the harness processes; their counts summed."""
                        k = len(harnesses)
                        parts = await asyncio.gather(*(harness_part(proc, tag, list(range(i, n, k)))
                                                       for i, proc in enumerate(harnesses) if i < n))
                        row: dict = {key: sum(p[key] for p in parts) for key in parts[0] if key != "harness"}
                        row["harness"] = {key: sum((p["harness"][key] for p in parts), [] if key == "stamps" else 0)
                                          for key in parts[0]["harness"]}
                        return row

                    for proc in harnesses:
                        assert (await proc.stdout.readline()).strip() == b"ready"
                    await loop_row(agent, 2, "warmup")  # warm the engine once
                    await harness_row("warmup")
                    # (getattr: the script also measures commits before the incremental bridge)
                    bridges_before = dict(getattr(chat_format, "bridges", {}))
                    gaps.reset()
                    hits.take()
                    cache = {"loop": Counter(), "endpoint": Counter()}
                    profiler = cProfile.Profile() if args.profile else None
                    rows, counts = [], {"loop": Counter(), "endpoint": Counter()}
                    # CPU seconds of the sampler's process (engine, loop, server) per path, and
                    # of the harness process over the endpoint rows.
                    cpu, walls, harness_cpu = Counter(), Counter(), Counter()
                    for r in range(args.repeat):
                        # ABBA order: a drift of the machine's load does not favour one path.
                        for path in ("loop", "endpoint") if r % 2 == 0 else ("endpoint", "loop"):
                            tag = f"{path}-{r}"
                            t0, cpu0 = time.perf_counter(), time.process_time()
                            if path == "loop":
                                row = await loop_row(agent, args.episodes, tag)
                            else:
                                if profiler:
                                    profiler.enable()
                                row = await harness_row(tag)
                                if profiler:
                                    profiler.disable()
                            seconds = time.perf_counter() - t0
                            cpu[path] += time.process_time() - cpu0
                            cached, blocks, prompt = hits.take()
                            cache[path].update({"cached": cached, "blocks": blocks, "prompt": prompt})
                            walls[path] += seconds
                            hstats = row.pop("harness", {})
                            gaps.split(hstats.pop("stamps", []))
                            harness_cpu.update(hstats)
                            counts[path].update(row)
                            rows.append((r, path, row["tokens"], seconds, row["tokens"] / seconds))
                    for proc in harnesses:
                        proc.stdin.close()
                        await proc.wait()
                    affinity = _thread_affinity()
                    import torch

                    torch_threads = torch.get_num_threads()
        finally:
            await engine.close()
    loop_rates = [x[4] for x in rows if x[1] == "loop"]
    end_rates = [x[4] for x in rows if x[1] == "endpoint"]
    paired = [e / lo for lo, e in zip(loop_rates, end_rates)]
    print(f"# {cpu_name()}, load {load_average()}, format {chat_format.name}, {args.episodes} episodes at once, "
          f"<= {args.turns} turns x {args.tokens_per_turn} tokens, top_p 0.95, {args.repeat} repeats, "
          f"harness client {args.client}, GIL switch interval {sys.getswitchinterval() * 1e3:g} ms, "
          f"engine step >= {args.step_ms:g} ms, {args.harness_processes} harness process(es), "
          f"messages in extra_body: {args.extra_body}, harness CPUs {args.harness_cpus or 'any'}, sampler CPUs "
          f"{args.sampler_cpus or 'any'} (its threads' affinity at the end: {affinity}), torch threads {torch_threads}")
    print_aligned(["repeat", "path", "tokens", "seconds", "tokens/s"],
                  [(r, p, t, f"{s:.2f}", f"{v:.1f}") for r, p, t, s, v in rows])
    print()
    print_aligned(["", "loop tok/s", "endpoint tok/s", "endpoint / loop"], [
        ("median", f"{statistics.median(loop_rates):.1f}", f"{statistics.median(end_rates):.1f}",
         f"{statistics.median(end_rates) / statistics.median(loop_rates):.2f}"),
        ("paired (median of per-repeat ratios)", "", "", f"{statistics.median(paired):.2f}"),
    ])
    print()
    per_1k = {p: 1000.0 * c["template_rerenders"] / c["turns"] if c["turns"] else 0.0 for p, c in counts.items()}
    print_aligned(["path", "turns", "template re-renders", "per 1,000 turns", "history rewrites"], [
        (p, c["turns"], c["template_rerenders"], f"{per_1k[p]:.1f}", c["history_rewrites"]) for p, c in counts.items()])
    print()
    print_aligned(["between two turns of a trajectory", "n", "median ms", "p90 ms", "mean ms"],
                  [gaps.stats(f"{p}: whole gap", gaps.gaps[p]) for p in ("loop", "endpoint")]
                  + [gaps.stats(f"endpoint server, {k}", v) for k, v in gaps.server.items()])
    print()
    print_aligned(["the endpoint's gap, part by part", "n", "median ms", "p90 ms", "mean ms"],
                  [gaps.stats(k, v) for k, v in gaps.parts.items()])
    print()
    turns = {p: counts[p]["turns"] or 1 for p in counts}
    rows_cpu = [(f"sampler process, {p} rows", f"{cpu[p]:.2f}", f"{walls[p]:.2f}", f"{cpu[p] / walls[p]:.2f}",
                 f"{1e3 * cpu[p] / turns[p]:.1f}") for p in ("loop", "endpoint")]
    if harness_cpu:
        rows_cpu.append(("harness process (endpoint rows)", f"{harness_cpu['cpu_s']:.2f}", f"{walls['endpoint']:.2f}",
                         f"{harness_cpu['cpu_s'] / walls['endpoint']:.2f}",
                         f"{1e3 * harness_cpu['cpu_s'] / turns['endpoint']:.1f}"))
    print_aligned(["CPU", "CPU s", "wall s", "cores busy", "CPU ms / turn"], rows_cpu)
    print(f"vLLM prefix-cache hits (cached / in full {hits.block}-token blocks / all prompt tokens of the rows' "
          "requests): " + ", ".join(
              f"{p} {c['cached']} / {c['blocks']} / {c['prompt']} ({100.0 * c['cached'] / max(c['blocks'], 1):.1f}% "
              "of what could hit)" for p, c in cache.items()))
    if harness_cpu:
        print(f"harness: {harness_cpu['chat']} chat requests, {harness_cpu['exec']} /exec requests, "
              f"{1e3 * harness_cpu['cpu_s'] / max(harness_cpu['chat'], 1):.2f} ms CPU per chat request (with its "
              f"share of /exec), {harness_cpu['involuntary_switches']} involuntary context switches, "
              f"{len(gaps.peers)} TCP connections")
    if bridges_before:
        bridged = {k: chat_format.bridges[k] - bridges_before[k] for k in chat_format.bridges}
        print(f"endpoint bridges (timed rows): {bridged['window']} rendered a window, {bridged['full']} the whole "
              f"conversation (incremental: {chat_format.incremental})")
    if profiler:
        print()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    asyncio.run(main())
