"""The OpenAI-compatible endpoint on real vLLM (CPU) with the tiny agent model: the
``openai`` client and mini-swe-agent as harnesses, real Kafka, the real sandbox.

The tiny model's answers are poor; what is checked is the plumbing: the published
chunks hold exactly the tokens the engine reported (id, log-prob, kept set, weight
version, in order), the environment tokens are the prompts the turns were sampled
from, a weight update mid-episode shows in the versions, grading puts a Reward on the
bus."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import NamedTuple

import pytest
import pytest_asyncio

from sampler.engine import Engine, SampledToken
from tests.sampler_helpers import agent_model_dir, start_test_engine
from tests.test_endpoint import (MODEL, TASK, concat, create_episode, final_chunks, post, reward_of,  # noqa: F401
                                 run_mini_cli, running_endpoint, sandbox_cfg)

pytestmark = [pytest.mark.vllm, pytest.mark.kafka]


class Tapped(NamedTuple):
    token_id: int
    logprob: float
    kept_ids: list[int]
    weight_version: int


def token_fields(token) -> Tapped:
    """What the engine decided for one token, from either form it hands a recorder (a
    SampledToken, or a row of its step's arrays)."""
    if isinstance(token, SampledToken):
        return Tapped(token.token_id, token.logprob, token.kept_ids.tolist(), token.weight_version)
    step, r = token.step, token.row
    kept = step.kept_ids[step.kept_offsets[r]: step.kept_offsets[r + 1]]
    return Tapped(int(step.token_ids[r]), float(step.logprobs[r]), kept.tolist(), int(step.versions[r]))


class TapEngine(Engine):
    """The real engine, with a log of every token it hands a recorder (per trajectory):
    the engine's own record, to compare the published chunks with."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.kept_set_source = inner.kept_set_source
        self.log: dict[str, list] = defaultdict(list)

    weight_version = property(lambda self: self.inner.weight_version)
    max_model_len = property(lambda self: self.inner.max_model_len)
    tokenizer = property(lambda self: self.inner.tokenizer)
    paused = property(lambda self: self.inner.paused)

    def effective_params(self, params):
        return self.inner.effective_params(params)

    def generate(self, prompt_ids, params, request_id=None):
        return self.inner.generate(prompt_ids, params, request_id)

    async def record(self, recorder, params):
        log = self.log[recorder.identity.trajectory_id]
        now, awaited = recorder.add_sampled_now, recorder.add_sampled

        def add_now(token):
            taken = now(token)
            if taken:
                log.append(token_fields(token))
            return taken

        async def add(token):
            await awaited(token)
            log.append(token_fields(token))

        recorder.add_sampled_now, recorder.add_sampled = add_now, add
        try:
            return await self.inner.record(recorder, params)
        finally:
            del recorder.add_sampled_now, recorder.add_sampled

    async def abort(self, request_id):
        await self.inner.abort(request_id)

    async def pause(self):
        await self.inner.pause()

    async def resume(self):
        await self.inner.resume()

    async def apply_weights(self, tensors, version):
        return await self.inner.apply_weights(tensors, version)

    async def close(self):
        await self.inner.close()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def vllm():
    eng = await start_test_engine(max_model_len=1024)
    yield eng
    await eng.close()  # vLLM: one live in-process engine per process


@pytest.fixture(scope="module")
def chat_format(vllm):
    from sampler.formats import load_format

    return load_format(vllm.tokenizer, "auto", model_path=str(agent_model_dir()))


def assert_chunks_are_the_engine_record(rec: dict, tapped: list) -> None:
    """Mask-1 positions of the published record == the engine's tokens, field by field."""
    sampled = [i for i, m in enumerate(rec["mask"]) if m]
    assert len(sampled) == len(tapped) > 0
    assert [rec["ids"][i] for i in sampled] == [t.token_id for t in tapped]
    assert [rec["versions"][i] for i in sampled] == [t.weight_version for t in tapped]
    assert [rec["kept"][i] for i in sampled] == [t.kept_ids for t in tapped]
    assert [rec["logprobs"][i] for i in sampled] == pytest.approx([t.logprob for t in tapped], abs=1e-6)


async def test_three_turns_on_vllm_publish_exactly_what_the_engine_sampled(vllm, chat_format, kafka_config, sandbox_cfg):
    from openai import AsyncOpenAI
    from safetensors.torch import load_file

    engine = TapEngine(vllm)
    start = vllm.weight_version
    async with running_endpoint(engine, chat_format, kafka_config, sandbox_cfg, top_p=0.95,
                                chunk_tokens=32) as (url, registry):
        ep = await create_episode(url)
        client = AsyncOpenAI(base_url=ep["base_url"], api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": TASK.instruction}]
        turns = []
        for turn in range(3):
            if turn == 2:  # new weights (the same tensors) under a new version, between two turns
                await vllm.apply_weights(load_file(str(agent_model_dir() / "model.safetensors")), start + 1)
            r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                     stream=turn == 1, extra_body={"return_token_ids": True},
                                                     **({"stream_options": {"include_usage": True}} if turn == 1 else {}))
            if turn == 1:  # streamed: the last content chunk carries Rollway's extension
                chunks = [c async for c in r]
                last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
                extra = last.model_extra
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                calls = {}
                for c in chunks:
                    for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                        calls[d.index] = {"id": d.id, "type": "function",
                                          "function": {"name": d.function.name, "arguments": d.function.arguments}}
                said = {"role": "assistant", "content": content, **({"tool_calls": list(calls.values())} if calls else {})}
                generated = last.choices[0].model_extra["token_ids"]
            else:
                extra = r.model_extra
                said = r.choices[0].message.model_dump(exclude_none=True)
                generated = r.choices[0].model_extra["token_ids"]
            turns.append((extra["prompt_token_ids"], generated, extra["rollway"]))
            messages.append(said)
            for call in said.get("tool_calls", []):
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
            if not said.get("tool_calls"):
                messages.append({"role": "user", "content": "Use a tool."})
        status, graded = await post(f"{url}/v1/rollway/episodes/{ep['id']}/submit")
        assert status == 200 and graded["status"] == "done" and graded["turns"] == 3, graded

    tid = ep["trajectory_id"]
    chunks = await final_chunks(kafka_config, tid)
    rec = concat(chunks)
    tapped = engine.log[tid]
    assert_chunks_are_the_engine_record(rec, tapped)
    # Each segment's tokens are its last turn's prompt plus that turn's sampled ids.
    by_segment: dict[int, list[int]] = defaultdict(list)
    for t, s in zip(rec["ids"], rec["segments"]):
        by_segment[s].append(t)
    for s, ids in by_segment.items():
        prompt, generated, _ = [t for t in turns if t[2]["segment_index"] == s][-1]
        assert ids == prompt + generated
    # What each response said it sampled is what the engine sampled.
    assert [t.token_id for t in tapped] == [t for _, g, _ in turns for t in g]
    # Versions: turns 1-2 sampled with the start version, turn 3 with the new one.
    n1, n2 = len(turns[0][1]), len(turns[1][1])
    assert {t.weight_version for t in tapped[: n1 + n2]} == {start}
    assert {t.weight_version for t in tapped[n1 + n2:]} == {start + 1}
    assert chunks[-1].final and chunks[-1].cost.turns == 3
    assert graded["segments"] == 1 + sum(1 for _, _, x in turns[1:] if x["new_segment"])
    reward = await reward_of(kafka_config, tid)
    assert reward.weight_version == start + 1 and 0.0 <= reward.score <= 1.0


async def test_mini_swe_agent_on_the_tiny_model_end_to_end(vllm, chat_format, kafka_config, sandbox_cfg):
    """mini-swe-agent (the package, its own mini.yaml) drives an episode of the tiny model
    through the endpoint; whatever the model says, the episode is recorded and graded."""
    from sampler.openai_api.mini_swe_agent import run_episode

    engine = TapEngine(vllm)
    async with running_endpoint(engine, chat_format, kafka_config, sandbox_cfg, top_p=0.95) as (url, registry):
        spec = {"task_id": TASK.task_id, "instruction": TASK.instruction}
        # mini.yaml's instructions are ~2,100 tokens of the tiny tokenizer, past its 2,048 positions.
        short = {"instance_template": "Please solve this issue: {{task}}\nWhen done, run "
                                      "`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`."}
        result = await asyncio.to_thread(run_episode, url, spec, step_limit=2, model_kwargs={"max_tokens": 32},
                                         agent_overrides=short)
    episode = result["episode"]
    assert result["n_calls"] >= 1 and episode["status"] == "done" and episode["turns"] == result["n_calls"]
    chunks = await final_chunks(kafka_config, episode["trajectory_id"])
    assert_chunks_are_the_engine_record(concat(chunks), engine.log[episode["trajectory_id"]])
    assert chunks[-1].finish_reason in ("submitted", f"agent_{result['exit_status']}")
    reward = await reward_of(kafka_config, episode["trajectory_id"])
    assert reward.score == episode["reward"]["score"]


async def test_mini_cli_on_the_tiny_model_end_to_end(vllm, chat_format, kafka_config, sandbox_cfg, tmp_path):
    """mini-swe-agent's ``mini`` CLI (the installed entry point, unattended: yolo,
    ``--exit-immediately``, stdin not a terminal) drives an episode of the tiny model with
    a step limit of 2. The tiny model does not submit, so the CLI stops at its limit
    (``LimitsExceeded``, exit 0) and leaves the episode open; the driver submits it with
    the agent's exit status, as docs/agents.md says. Checked: the plumbing."""
    engine = TapEngine(vllm)
    short = {"step_limit": 2, "instance_template": "Please solve this issue: {{task}}\nWhen done, run "
                                                   "`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`."}
    async with running_endpoint(engine, chat_format, kafka_config, sandbox_cfg, top_p=0.95) as (url, registry):
        episode = await create_episode(url)
        code, traj, output = await run_mini_cli(url, episode, tmp_path, TASK.instruction, agent=short,
                                                model_kwargs={"max_tokens": 32})
        exit_status = traj["info"]["exit_status"]
        status, graded = await post(f"{url}/v1/rollway/episodes/{episode['id']}", method="GET")
        if graded["status"] == "open":
            status, graded = await post(f"{url}/v1/rollway/episodes/{episode['id']}/submit",
                                        {"finish_reason": f"agent_{exit_status}"})
    assert code == 0, output[-3000:]
    calls = traj["info"]["model_stats"]["api_calls"]
    assert exit_status in ("LimitsExceeded", "Submitted", "RepeatedFormatError") and 1 <= calls <= 2
    assert status == 200 and graded["status"] == "done" and graded["turns"] == calls
    tid = episode["trajectory_id"]
    chunks = await final_chunks(kafka_config, tid)
    assert_chunks_are_the_engine_record(concat(chunks), engine.log[tid])
    assert chunks[-1].finish_reason in ("submitted", f"agent_{exit_status}") and chunks[-1].cost.turns == calls
    reward = await reward_of(kafka_config, tid)
    assert reward.score == graded["reward"]["score"]
