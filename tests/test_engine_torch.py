"""TorchEngine: the plain-PyTorch reference sampler with exact kept sets."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
import torch

from sampler.engine import SampleDone, SampledToken
from sampler.sampling import SamplingParams
from sampler.torch_engine import TorchEngine
from tests.sampler_helpers import agent_model_dir
from tests.waiting import wait_until_async

PROMPT = "<|im_start|>user\nFix `add` in solution.py so the tests pass.<|im_end|>\n<|im_start|>assistant\n"


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def engine():
    eng = await TorchEngine(agent_model_dir(), max_model_len=512).start()
    yield eng
    await eng.close()


async def collect(engine, prompt_ids, params, request_id=None):
    tokens: dict[int, list[SampledToken]] = {}
    done: dict[int, SampleDone] = {}
    async for ev in engine.generate(prompt_ids, params, request_id=request_id):
        if isinstance(ev, SampledToken):
            tokens.setdefault(ev.sample_index, []).append(ev)
        else:
            done[ev.sample_index] = ev
    return tokens, done


def ids(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def test_exact_kept_sets_hold_the_token_and_all_the_mass(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, n=2, seed=1)
    tokens, done = await collect(engine, ids(engine, PROMPT), params)
    assert sorted(done) == [0, 1]
    for evs in tokens.values():
        for ev in evs:
            assert not ev.kept_capped
            assert ev.token_id in ev.kept_ids
            assert float(np.exp(ev.kept_logprobs.astype(np.float64)).sum()) == pytest.approx(1.0, abs=1e-4)
            assert ev.logprob == pytest.approx(float(ev.kept_logprobs[list(ev.kept_ids).index(ev.token_id)]))


async def test_top_p_one_keeps_the_whole_vocabulary(engine):
    tokens, _ = await collect(engine, ids(engine, PROMPT), SamplingParams(top_p=1.0, max_tokens=5, seed=2))
    for ev in tokens[0]:
        assert ev.kept_ids.size == engine.vocab_size and not ev.kept_capped
        assert sorted(ev.kept_ids.tolist()) == list(range(engine.vocab_size))


async def test_same_seed_same_tokens_and_stop_and_length(engine):
    a, _ = await collect(engine, ids(engine, PROMPT), SamplingParams(max_tokens=20, seed=9))
    b, _ = await collect(engine, ids(engine, PROMPT), SamplingParams(max_tokens=20, seed=9))
    assert [e.token_id for e in a[0]] == [e.token_id for e in b[0]]
    close = engine.tokenizer.convert_tokens_to_ids("</tool>")
    tokens, done = await collect(engine, ids(engine, PROMPT + "<tool>run\n"),
                                 SamplingParams(max_tokens=40, stop_token_ids=(close,), n=4, seed=4))
    for i, d in done.items():
        assert d.finish_reason in ("stop", "length")
        if d.stop_reason == close:
            assert tokens[i][-1].token_id == close
    _, done = await collect(engine, ids(engine, PROMPT), SamplingParams(max_tokens=6, ignore_eos=True))
    assert done[0].finish_reason == "length" and done[0].num_tokens == 6


async def test_weights_applied_mid_generation_and_abort(engine):
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    zeroed = {"lm_head.weight": torch.zeros_like(state["lm_head.weight"])}
    got: list[SampledToken] = []

    async def consume():
        async for ev in engine.generate(ids(engine, PROMPT), SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                                        request_id="torch-mid"):
            if isinstance(ev, SampledToken):
                got.append(ev)

    task = asyncio.create_task(consume())
    await wait_until_async(lambda: len(got) >= 5, 60, "5 tokens", task=task, poll_s=0.001)
    v0 = engine.weight_version
    await engine.apply_weights(zeroed, v0 + 1)  # partial update: TorchEngine accepts it
    await asyncio.wait_for(task, 60)
    try:
        versions = [e.weight_version for e in got]
        switch = versions.index(v0 + 1)
        assert versions == [v0] * switch + [v0 + 1] * (len(got) - switch)
        assert {e.token_id for e in got[switch:]} == {0}
    finally:
        await engine.apply_weights({"lm_head.weight": state["lm_head.weight"]}, v0 + 2)

    events: list = []

    async def long():
        async for ev in engine.generate(ids(engine, PROMPT), SamplingParams(max_tokens=400, ignore_eos=True), request_id="ab"):
            events.append(ev)

    t = asyncio.create_task(long())
    await wait_until_async(lambda: len(events) >= 3, 60, "3 events", task=t, poll_s=0.001)
    await engine.abort("ab")
    await asyncio.wait_for(t, 30)
    assert isinstance(events[-1], SampleDone) and events[-1].finish_reason == "abort"


async def test_scoring_reproduces_the_sampled_log_probs_in_float32():
    eng = await TorchEngine(agent_model_dir(), max_model_len=512, dtype="float32").start()
    try:
        params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=5)
        prompt = ids(eng, PROMPT)
        tokens, _ = await collect(eng, prompt, params)
        evs = tokens[0]
        scored = await eng.score(prompt, [e.token_id for e in evs], params)
        for ev, (lp, kept) in zip(evs, scored):
            assert lp == pytest.approx(ev.logprob, abs=1e-4)
            assert set(kept.ids.tolist()) == set(ev.kept_ids.tolist())
    finally:
        await eng.close()


async def test_agent_rollout_runs_on_the_torch_engine(engine, tmp_path):
    """The fallback where vLLM is missing: the same agent loop, exact kept sets."""
    from sampler.agent import AgentLoop
    from sampler.config import SamplerConfig
    from sandbox.client import SandboxClient
    from sandbox.config import SandboxConfig
    from tests.sandbox_helpers import live_sandbox, write_task_dir
    from tasks.spec import TaskSpec

    spec = TaskSpec(task_id="fix_mul", instruction="Fix `mul` in solution.py so the tests pass.",
                    files={"solution.py": "def mul(x, y):\n    return x + y\n"},
                    hidden_tests={"test_mul.py": "from solution import mul\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"})
    write_task_dir(tmp_path / "tasks", spec)
    chunks = []

    async def publish(chunk):
        chunks.append(chunk)

    cfg = SamplerConfig(engine="torch", model_path=str(agent_model_dir()), max_model_len=512, max_turns=2,
                        max_tokens_per_turn=24, assistant_prefill="<tool>run\n", chunk_tokens=64)
    sandbox_cfg = SandboxConfig(tasks_dir=str(tmp_path / "tasks"), workspace_root=str(tmp_path / "ws"),
                                publish_rewards=False)
    async with live_sandbox(sandbox_cfg) as sb, SandboxClient(sb.url) as client:
        result = await AgentLoop(engine, client, cfg, publish).run(spec.to_event("fix_mul/g", 1), 0, "t")
    assert result.finish_reason == "budget_turns" and result.cost.turns == 2
    assert chunks[-1].final and result.reward is not None and result.reward.task_id == "fix_mul"
    mask = np.concatenate([c.loss_mask_array() for c in chunks])
    capped = np.concatenate([c.kept_capped_array() for c in chunks])
    assert mask.sum() == result.cost.generated_tokens > 0 and not capped.any()
