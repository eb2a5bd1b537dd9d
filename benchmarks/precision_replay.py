"""Precision replay: the trainer-sampler mismatch at equal weight versions, with the
trainer's forward in float32 (its master precision) and in the samplers' bfloat16.

The parity setup (tests/test_engine_parity.py): the agent model, its 11 prompts and 4
sampling settings, 2 samples of 48 tokens each. A sampler engine serving the model in
bfloat16 draws the groups, recorded and assembled exactly as live data; then, for each
trainer setting, a fresh trainer whose float32 masters are that same model (the bf16
checkpoint widened exactly, so both sides hold the same version) computes one step on
all groups and reports the mismatch between its log-probs and the sampler's behaviour
log-probs: KL(sampler || trainer) estimated per token (k3 = E[r - 1 - log r], k1 =
E[-log r], r = exp(trainer - behaviour)), the ratio's spread and its worst token. Both
trainers read the same groups in the same order in one run.

Samplers: TorchEngine (Hugging Face bf16, the same code path as the trainer) and
VLLMEngine (vLLM's kernels, the production sampler; skipped when vLLM is missing).

    .venv/bin/python benchmarks/precision_replay.py
    .venv/bin/python benchmarks/precision_replay.py --engines torch --tokens 16   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path

# The test fixtures (tests/) live in the checkout, not in the installed packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import cpu_name, load_average  # noqa: E402
from sampler.sampling import SamplingParams  # noqa: E402
from tests.synthetic import engine_group  # noqa: E402

# The parity test's prompts and settings (temperature, top_p, top_k).
from tests.test_engine_parity import PROMPTS, SETTINGS  # noqa: E402


async def sample_groups(engine, tokens: int) -> list:
    tok = engine.tokenizer
    groups = []
    for s, (temperature, top_p, top_k) in enumerate(SETTINGS):
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=tokens, n=2,
                                seed=1234)
        for p, text in enumerate(PROMPTS):
            prompt = tok.encode(text, add_special_tokens=False)
            groups.append(await engine_group(engine, prompt, params, task_id=f"s{s}p{p}", group_id="g"))
    return groups


async def sampled_by(kind: str, model_dir: Path, tokens: int) -> list:
    if kind == "torch":
        from sampler.torch_engine import TorchEngine

        engine = await TorchEngine(model_dir, max_model_len=512, dtype="bfloat16").start()
    else:
        from tests.sampler_helpers import start_test_engine

        engine = await start_test_engine(model_dir)
    try:
        return await sample_groups(engine, tokens)
    finally:
        await engine.close()


def trainer_mismatch(model_dir: Path, groups: list, replay_precision: bool) -> dict[str, float]:
    from trainer.config import TrainerConfig
    from trainer.core import TrainCore

    cfg = TrainerConfig(model_path=str(model_dir), device="cpu", num_threads=1, publish_dtype="bfloat16",
                        replay_precision=replay_precision, micro_batch_tokens=4096)
    return TrainCore(cfg).train_step(groups).metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="torch,vllm", help="comma-separated: torch, vllm")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per sample")
    args = parser.parse_args()

    from tests.sampler_helpers import agent_model_dir

    model_dir = agent_model_dir()
    print(f"# CPU: {cpu_name()}; load before: {load_average()}")
    rows = []
    for kind in args.engines.split(","):
        if kind == "vllm":
            try:
                import vllm  # noqa: F401
            except ImportError:
                print("# vllm not installed: VLLMEngine skipped")
                continue
        started = time.perf_counter()
        groups = asyncio.run(sampled_by(kind, model_dir, args.tokens))
        sample_s = time.perf_counter() - started
        for replay in (False, True):
            m = trainer_mismatch(model_dir, groups, replay)
            rows.append((kind, "bfloat16 (replay)" if replay else "float32", int(m["loss_tokens"]),
                         m["mismatch_kl_k3"], m["mismatch_kl_k1"], m["is_ratio_std"],
                         max(abs(math.log(m["is_ratio_min"])), abs(math.log(m["is_ratio_max"])))))
        print(f"# {kind}: {len(groups)} groups sampled in {sample_s:.1f} s")
    print()
    print("| sampler (bf16) | trainer forward | tokens | KL k3 | KL k1 | ratio std | max abs log r |")
    print("|---|---|---|---|---|---|---|")
    for kind, forward, tokens, k3, k1, std, worst in rows:
        print(f"| {kind} | {forward} | {tokens} | {k3:.3g} | {k1:.3g} | {std:.3g} | {worst:.3g} |")
    by = {(r[0], r[1]): r for r in rows}
    for kind in dict.fromkeys(r[0] for r in rows):
        off, on = by[(kind, "float32")], by[(kind, "bfloat16 (replay)")]
        print(f"# {kind}: k3 with replay / without = {on[3] / off[3]:.3g}" if off[3] else f"# {kind}: k3 0 without")
    print(f"# load after: {Path('/proc/loadavg').read_text().split()[:3]}")


if __name__ == "__main__":
    main()
