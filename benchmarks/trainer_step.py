"""Trainer step benchmark: replay switches on versus off, same batch, same run.

Two trainers start from the same weights and train on the same batch, alternating
step by step (the order flips every round, so drift in machine load hits both alike).
"on" renormalises each generated token's log-prob over the sampler's recorded kept
set (gather + logsumexp over the kept logits); "off" uses the full-vocabulary
log-softmax. Everything else -- forward, backward, Muon + AdamW step, metrics, the
weights hash -- is the same code path.

Cases (the switch each one flips):
* ``tiny`` (``replay_kept_sets``): the repository's tiny Qwen2 (vocab 510) with trajectories sampled from it
  (top-p 0.9, environment tokens spliced in), through the real event encoding;
* ``vocab32k`` (``replay_kept_sets``): a random-init Qwen2 with a 32k vocabulary (no downloads) and a batch
  with realistic kept-set sizes (45% of tokens a kept set of one, the rest 2..256),
  where the output layer dominates;
* ``moe`` (``replay_routing``, R3): a random-init Qwen3-MoE (8 experts, top-2, every
  layer sparse) with groups drawn by TorchEngine, which records the routed experts;
  "on" routes every position to the recorded experts (a forward hook on each router),
  "off" recomputes top-k. The "differs" column is the routing_differs_frac metric;
* ``precision`` (``replay_precision``): the ``tiny`` batch with the forward on the
  weights cast to bfloat16 ("on") or in float32 ("off"): what precision replay costs.

    .venv/bin/python benchmarks/trainer_step.py             # both cases, ~2 minutes on 2 cores
    .venv/bin/python benchmarks/trainer_step.py --small     # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# The test fixtures (tests/) live in the checkout, not in the installed packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.synthetic import SampledTrajectory, groups_from_sampled, load_tiny, make_task_groups  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.core import TrainCore  # noqa: E402


@dataclass
class Row:
    case: str
    vocab: int
    mode: str
    tokens: int
    loss_tokens: int
    step_ms: float
    hash_ms: float
    tokens_per_s: float
    loss_tokens_per_s: float
    kept_mean: float
    differs: float | None = None  # routing_differs_frac (MoE only)


def tiny_case(args) -> tuple[str, list]:
    from sampler.tiny_model import tiny_model_dir

    path = str(tiny_model_dir())
    model, tok = load_tiny(path)
    groups = make_task_groups(model, tok, args.groups, group_size=4, max_new_tokens=args.tiny_tokens,
                              env_after=args.tiny_tokens // 2, seed=1)
    return path, groups_from_sampled(groups)


def vocab_case(args, workdir: str) -> tuple[str, list]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = args.vocab
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(workdir)  # the trainer loads no tokenizer

    rng = np.random.default_rng(0)
    prompt, gen = args.prompt_tokens, args.gen_tokens
    sampled = []
    for g in range(args.groups):
        group = []
        for i in range(4):
            tokens = rng.integers(0, vocab, prompt + gen).tolist()
            mask = [0] * prompt + [1] * gen
            kept: list[list[int]] = [[] for _ in range(prompt)]
            lps = [0.0] * prompt
            for t in tokens[prompt:]:
                u = rng.random()
                size = 1 if u < 0.45 else int(rng.integers(2, 17)) if u < 0.8 else int(rng.integers(17, 257))
                ids = rng.choice(vocab, size, replace=False)
                ids[0] = t
                ids = np.unique(ids).tolist()
                kept.append(ids)
                lps.append(-float(np.log(len(ids))))
            group.append(SampledTrajectory(
                task_id=f"bench-{g}", group_id="g", sample_index=i, group_size=4, attempt="a0",
                token_ids=tokens, loss_mask=mask, logprobs=lps, kept=kept, capped=[0] * len(tokens),
                versions=[0] * len(tokens), temperature=1.0, top_p=0.9,
            ))
        sampled.append(group)
    groups = groups_from_sampled(sampled, chunk_tokens=256)
    # Rewards: alternate so every group has variance.
    for group in groups:
        for j, t in enumerate(group.members):
            t.reward.reward = float(j % 2)
            t.reward.score = float(j % 2)
    return workdir, groups


def moe_case(args, workdir: str) -> tuple[str, list]:
    import asyncio

    from sampler.sampling import SamplingParams
    from sampler.tiny_model import build_tiny_moe, tiny_model_dir
    from sampler.torch_engine import TorchEngine
    from tests.synthetic import engine_group

    path = build_tiny_moe(workdir, tiny_model_dir(), hidden_size=128, layers=4, experts=8, top_k=2)

    async def sample() -> list:
        engine = await TorchEngine(path, dtype="float32", max_model_len=1024).start()
        try:
            prompt = engine.tokenizer("def fib(n):\n    ")["input_ids"]
            params = SamplingParams(n=4, max_tokens=args.tiny_tokens, ignore_eos=True, top_p=0.9)
            return [await engine_group(engine, prompt, params, task_id=f"moe-{g}") for g in range(args.groups)]
        finally:
            await engine.close()

    return str(path), asyncio.run(sample())


def measure(case: str, path: str, groups: list, args, switch: str = "replay_kept_sets") -> list[Row]:
    # The groups are sampled in float32 (vocab32k's are made up), so every case but
    # "precision" forwards in float32 (precision replay off, as when the documented
    # figures were measured): each case varies one switch.
    settings = {"replay_precision": False}
    cores = {
        mode: TrainCore(TrainerConfig(model_path=path, num_threads=args.threads, learning_rate=1e-5,
                                      muon_learning_rate=1e-5, max_staleness=1000,
                                      **{**settings, switch: mode == "on"}))
        for mode in ("on", "off")
    }
    vocab = cores["on"].model.config.vocab_size
    for core in cores.values():  # warm-up: allocator, kernels, optimizer state
        core.train_step(groups)
    samples: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(args.rounds):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for mode in order:
            samples[mode].append(cores[mode].train_step(groups).metrics)
    rows = []
    for mode in ("on", "off"):
        ms = samples[mode]
        med = lambda k: statistics.median(m[k] for m in ms)  # noqa: E731
        step = med("step_time_s")
        rows.append(Row(
            case=case, vocab=vocab, mode=mode,
            tokens=int(ms[0]["tokens_per_s"] * ms[0]["step_time_s"] + 0.5),
            loss_tokens=int(ms[0]["loss_tokens"]),
            step_ms=1000 * step, hash_ms=1000 * med("hash_s"),
            tokens_per_s=med("tokens_per_s"), loss_tokens_per_s=med("loss_tokens_per_s"),
            kept_mean=ms[0]["kept_size_mean"],
            differs=med("routing_differs_frac") if "routing_differs_frac" in ms[0] else None,
        ))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a smoke run: fewer groups and rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--tiny-tokens", type=int, default=48)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=192)
    parser.add_argument("--cases", default="tiny,vocab32k,moe,precision")
    args = parser.parse_args()
    if args.small:
        args.rounds, args.groups, args.gen_tokens, args.tiny_tokens = 2, 2, 64, 16
    torch.set_num_threads(args.threads)

    rows: list[Row] = []
    started = time.perf_counter()
    cases = args.cases.split(",")
    if "tiny" in cases:
        rows += measure("tiny", *tiny_case(args), args)
    if "vocab32k" in cases:
        with tempfile.TemporaryDirectory() as workdir:
            rows += measure("vocab32k", *vocab_case(args, workdir), args)
    if "precision" in cases:
        rows += measure("precision", *tiny_case(args), args, switch="replay_precision")
    if "moe" in cases:
        with tempfile.TemporaryDirectory() as workdir:
            rows += measure("moe", *moe_case(args, workdir), args, switch="replay_routing")

    print(f"\ntrainer step, replay on vs off (kept sets; moe: routing; precision: bf16 forward) (median of {args.rounds} alternating steps, "
          f"{args.threads} thread(s), {time.perf_counter() - started:.0f}s total)")
    header = (f"{'case':<10} {'vocab':>6} {'replay':>6} {'tokens':>7} {'loss tok':>8} {'kept':>6} "
              f"{'step ms':>9} {'hash ms':>8} {'tokens/s':>9} {'loss tok/s':>10} {'off/on time':>11} {'differs':>7}")
    print(header)
    print("-" * len(header))
    for row in rows:
        other = next(r for r in rows if r.case == row.case and r.mode == "off")
        ratio = other.step_ms / row.step_ms
        print(f"{row.case:<10} {row.vocab:>6} {row.mode:>6} {row.tokens:>7} {row.loss_tokens:>8} "
              f"{row.kept_mean:>6.1f} {row.step_ms:>9.1f} {row.hash_ms:>8.1f} {row.tokens_per_s:>9.0f} "
              f"{row.loss_tokens_per_s:>10.0f} {ratio:>11.2f} "
              f"{'-' if row.differs is None else f'{row.differs:.3f}':>7}")


if __name__ == "__main__":
    main()
