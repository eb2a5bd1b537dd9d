"""``rollway model init --format qwen3|qwen3-coder|llama3-json``: the warm start in each
family's own layout (sampler/formats/tokenizers.py's table: special tokens, eos, pad,
chat template), its SFT transcripts rendered with that template.

Each family's warm start is built at toy size and trained to memorize its 8 train
transcripts (120 steps at a high rate, ~5 s), so that, served by real vLLM, it samples
the reference calls of a train task: the rollout through the real agent loop and sandbox
then shows that the family's call boundaries are read from vLLM's sampled ids (a poorer
model would show only that nothing crashes).

* the folder's tokenizer is detected as the family, every token of the layout is one id,
  the model config's eos/pad are the layout's, the saved template is the family's;
* the template renders the tools; a 4-turn transcript of the reference calls (and a
  ``run``), bridged turn by turn, is id for id the template's full render, and each
  canonical turn parses back to its call;
* vLLM serves the folder (format auto), and a rollout of a memorized fix task reads,
  writes and submits: token-exact, no re-render, reward 1.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sampler.formats import TOOL_NAMES, TOOL_SCHEMAS, load_format
from sampler.formats.sft import _assistant, _turn_text, reference_calls, spec_text
from sampler.formats.tokenizers import LAYOUTS
from tasks.family import generate
from trainer.sft import SFTConfig
from trainer.warm_start import WarmStartConfig, build_warm_start

FAMILIES = ("qwen3", "qwen3-coder", "llama3-json")
EXAMPLES = 8


def toy_config(family: str) -> WarmStartConfig:
    # premature_submit_rate 0: the teacher's first action is the reference one, so the
    # memorized rollout is the reference rollout.
    sft = SFTConfig(steps=120, batch_size=4, examples=EXAMPLES, warmup_steps=1, log_every=0, learning_rate=1e-2,
                    muon_learning_rate=1e-2, premature_submit_rate=0.0)
    return WarmStartConfig(format=family, vocab_size=700, hidden_size=64, layers=1, heads=2, kv_heads=2,
                           intermediate_size=128, sft=sft)


@pytest.fixture(scope="module", params=FAMILIES)
def built(request, tmp_path_factory):
    family = request.param
    return family, build_warm_start(tmp_path_factory.mktemp(family) / "warm", toy_config(family))


def served(out):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    return tok, load_format(tok, "auto", out)


def test_the_warm_start_is_in_the_familys_layout(built):
    family, out = built
    layout = LAYOUTS[family]
    tok, fmt = served(out)
    assert fmt.name == family
    for token in layout.special + layout.ordinary:  # each one id, as the sampler reads calls
        assert fmt.tokens.encode(token) == [tok.convert_tokens_to_ids(token)], token
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tok.convert_tokens_to_ids(layout.eos) == tok.eos_token_id
    assert config["pad_token_id"] == tok.convert_tokens_to_ids(layout.pad) == tok.pad_token_id
    assert tok.convert_tokens_to_ids(layout.eos) in fmt.stop_token_ids
    assert layout.eos == fmt.family.end_tokens[0]  # the two tables agree
    assert (out / "chat_template.jinja").read_text().strip() == layout.template.strip()
    assert fmt.incremental  # the family's published template: the window bridge applies


def test_the_template_renders_the_tools_and_turns_bridge_to_the_full_render(built):
    family, out = built
    tok, fmt = served(out)
    spec = next(s for s in generate("train", EXAMPLES, seed=0) if s.metadata.get("kind") == "fix")
    conversation = [fmt.user_message(spec_text(spec))]
    start = fmt.render(conversation, TOOL_SCHEMAS)
    for name in TOOL_NAMES:
        assert f"<name>{name}</name>" in start.text or f'"name": "{name}"' in start.text, name
    if layout_bos := LAYOUTS[family].bos:
        assert start.ids[0] == tok.convert_tokens_to_ids(layout_bos) and start.ids[1] != start.ids[0]
    calls = [("run", {"command": "python -m pytest -q"}, "1 failed")] + reference_calls(spec)
    assert len(calls) == 4 and calls[-1][0] == "submit"
    ids, prefix = list(start.ids), start
    for name, arguments, reply in calls:
        text = _turn_text(fmt, conversation, _assistant(name, arguments), prefix.text)
        policy = fmt.tokens.encode(text)
        assert policy[-1] == tok.convert_tokens_to_ids(LAYOUTS[family].eos)
        turn = fmt.parse_turn(policy)
        assert turn.error is None and [(c.name, c.arguments) for c in turn.calls] == [(name, arguments)]
        ids += policy
        if reply is None:
            break
        conversation += [fmt.assistant_message(turn), fmt.tool_message("call_0", name, reply)]
        prefix = fmt.bridge(prefix, policy, conversation, TOOL_SCHEMAS)
        assert prefix is not None, name
        ids += prefix.ids
        # Incremental (sampled ids + bridges) == the template's full render, id for id.
        assert ids == fmt.render(conversation, TOOL_SCHEMAS).ids


@pytest.mark.vllm
async def test_vllm_serves_it_and_the_agent_loop_runs_its_sampled_calls(built, tmp_path):
    from sampler.agent import AgentLoop
    from sampler.config import SamplerConfig
    from sandbox.client import SandboxClient
    from sandbox.config import SandboxConfig
    from schemas import arrays
    from tests.sampler_helpers import start_test_engine
    from tests.sandbox_helpers import live_sandbox, write_task_dir
    from tests.test_sft import policy_spans

    family, out = built
    spec = next(s for s in generate("train", EXAMPLES, seed=0) if s.metadata.get("kind") == "fix")
    write_task_dir(tmp_path / "tasks", spec)
    sandbox_cfg = SandboxConfig(tasks_dir=str(tmp_path / "tasks"), workspace_root=str(tmp_path / "ws"),
                                publish_rewards=False)
    cfg = SamplerConfig(engine="vllm", model_path=str(out), max_model_len=2048, max_turns=6, max_tokens_per_turn=160,
                        temperature=0.0, tool_timeout_s=10.0)
    published = []

    async def publish(chunk):
        published.append(chunk)

    engine = await start_test_engine(out, max_model_len=2048)
    try:
        async with live_sandbox(sandbox_cfg) as sb, SandboxClient(sb.url) as client:
            agent = AgentLoop(engine, client, cfg, publish)
            assert agent.format.name == family  # auto, from the folder
            result = await agent.run(spec.to_event(group_id=f"{spec.task_id}/g", group_size=1), 0, "a")
    finally:
        await engine.close()
    fmt = agent.format
    ids = np.concatenate([arrays.unpack(c.token_ids, arrays.INT32) for c in published]).tolist()
    mask = np.concatenate([arrays.unpack(c.loss_mask, arrays.UINT8) for c in published]).tolist()
    # The sampled turns (mask-1 runs), as vLLM sampled them, parse to the reference calls.
    turns = policy_spans(ids, mask)
    parsed = [fmt.parse_turn(t) for t in turns]
    assert [[(c.name, c.arguments) for c in p.calls] for p in parsed] == [
        [(name, arguments)] for name, arguments, _ in reference_calls(spec)]
    assert all(t[-1] in fmt.stop_token_ids for t in turns)  # each turn ended at the family's end token
    assert result.finish_reason == "submitted"
    assert (result.cost.turns, result.cost.segments, result.cost.template_rerenders) == (len(turns), 1, 0)
    assert result.reward is not None and result.reward.score == 1.0  # the write ran in the sandbox
    start = fmt.render([fmt.user_message(spec_text(spec))], TOOL_SCHEMAS).ids
    assert ids[: len(start)] == start and mask[: len(start)] == [0] * len(start)  # the template's prompt
