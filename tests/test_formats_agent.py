"""The agent loop on real chat formats (sampler/chat_loop.py): a scripted policy on
tokenizers built here in the chatml-hermes and qwen3 layouts (sampler/formats/tokenizers.py),
against the real sandbox service.

* chatml-hermes, 5 turns (run, edit, a truncated write, bad JSON, submit): every prompt is
  the previous prompt + the sampled ids + only the bridge ids; the published segment is
  those ids with loss mask 1 exactly on the sampled ones; the edit fixed the code (reward 1);
  a truncated turn and bad JSON are error replies; no re-render.
* qwen3: a turn without a call gets a user message, so the template drops the turn's
  reasoning: a new segment with a fresh render, counted (``Cost.template_rerenders``); the
  first segment's sampled ids are published as sampled, never re-tokenized.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sampler.agent import AgentLoop
from sampler.config import SamplerConfig
from sampler.formats import TOOL_SCHEMAS, load_format
from sampler.formats.tokenizers import build_tokenizer
from sandbox.client import SandboxClient
from sandbox.config import SandboxConfig
from schemas import Cost, Reward, arrays
from tasks.spec import TaskSpec
from tests.sandbox_helpers import live_sandbox, write_task_dir
from tests.scripted_engine import ScriptedEngine

TASK = TaskSpec(
    task_id="fix_add",
    instruction="Fix `add` in solution.py so the tests pass.",
    files={"solution.py": "def add(x, y):\n    return x - y\n"},
    hidden_tests={"test_add.py": "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"},
    solution={"solution.py": "def add(x, y):\n    return x + y\n"},
)
CORPUS = ["def add(x, y):\n    return x + y\n", json.dumps(TOOL_SCHEMAS), "I will run the tests first.\n",
          '<tool_call>\n{"name": "run", "arguments": {"command": "python -m pytest -q"}}\n</tool_call>'] * 30


@pytest.fixture(scope="module")
def toks():
    return {name: build_tokenizer(name, CORPUS) for name in ("chatml-hermes", "qwen3")}


@pytest.fixture
def sandbox_cfg(tmp_path):
    write_task_dir(tmp_path / "tasks", TASK)
    return SandboxConfig(tasks_dir=str(tmp_path / "tasks"), workspace_root=str(tmp_path / "ws"), publish_rewards=False)


def config(**overrides) -> SamplerConfig:
    fields = dict(engine="torch", model_path="unused", max_model_len=2048, max_turns=8, max_tokens_per_turn=96,
                  summary_max_tokens=32, chunk_tokens=64, tool_timeout_s=5.0)
    fields.update(overrides)
    return SamplerConfig(**fields)


def hermes_call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call><|im_end|>'


async def rollout(tok, sandbox_cfg, turns: list[list[int]], cfg: SamplerConfig):
    calls = iter(range(1000))
    engine = ScriptedEngine(tok, lambda prompt, params: turns[min(next(calls), len(turns) - 1)],
                            max_model_len=cfg.max_model_len)
    published = []

    async def publish(chunk):
        published.append(chunk)

    async with live_sandbox(sandbox_cfg) as sb, SandboxClient(sb.url) as client:
        agent = AgentLoop(engine, client, cfg, publish)
        result = await agent.run(TASK.to_event(group_id="fix_add/g", group_size=1), 0, "a")
    return result, engine, agent, published


def segment_arrays(published, segment: int):
    chunks = [c for c in published if c.segment_index == segment]
    ids = np.concatenate([arrays.unpack(c.token_ids, arrays.INT32) for c in chunks]).tolist()
    mask = np.concatenate([arrays.unpack(c.loss_mask, arrays.UINT8) for c in chunks]).tolist()
    return ids, mask


async def test_chatml_hermes_rollout_is_token_exact_and_edits_through_the_sandbox(toks, sandbox_cfg):
    tok = toks["chatml-hermes"]
    fmt = load_format(tok)
    enc = fmt.tokens.encode
    long_write = hermes_call("write", path="notes.txt", content="x = 1\n" * 200)
    turns = [
        enc("Let me look at the code.\n" + hermes_call("run", command="cat solution.py")),
        enc(hermes_call("edit", path="solution.py", old="x - y", new="x + y")),
        enc(long_write),  # cut at max_tokens_per_turn: a truncated call
        enc('<tool_call>\n{"name": "run", "arguments": {"command": "ls"}\n</tool_call><|im_end|>'),  # bad JSON
        enc(hermes_call("submit")),
    ]
    cfg = config()
    result, engine, agent, published = await rollout(tok, sandbox_cfg, turns, cfg)
    assert result.finish_reason == "submitted" and result.reward is not None and result.reward.score == 1.0
    assert (result.cost.turns, result.cost.segments, result.cost.template_rerenders) == (5, 1, 0)
    # Token-exact: each prompt = previous prompt + sampled ids + the bridge.
    for before, after in zip(engine.calls, engine.calls[1:]):
        assert after.prompt[: len(before.prompt) + len(before.output)] == before.prompt + before.output
    assert engine.calls[2].output == turns[2][: cfg.max_tokens_per_turn]
    ids, mask = segment_arrays(published, 0)
    last = engine.calls[-1]
    assert ids == last.prompt + last.output
    sampled = [p for c in engine.calls for p in range(len(c.prompt), len(c.prompt) + len(c.output))]
    assert [i for i, m in enumerate(mask) if m] == sampled
    # The replies as the model saw them.
    replies = []
    for before, after in zip(engine.calls, engine.calls[1:]):
        text = fmt.tokens.decode(after.prompt[len(before.prompt) + len(before.output):])
        replies.append(text.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0])
    assert replies[0] == TASK.files["solution.py"]
    assert replies[1] == "edited solution.py (1 replacement; 32 bytes)"
    assert replies[2].startswith("error: max tokens were reached inside a tool call")
    assert replies[3].startswith("error: tool call 1: not valid JSON")
    # The prompt of every turn is the template's own render of the conversation so far.
    start = fmt.render([fmt.user_message(TASK.instruction + "\nFiles: solution.py")], TOOL_SCHEMAS)
    assert engine.calls[0].prompt == start.ids


async def test_qwen3_thinking_removal_starts_a_counted_new_segment(toks, sandbox_cfg):
    tok = toks["qwen3"]
    fmt = load_format(tok)
    assert fmt.name == "qwen3"
    enc = fmt.tokens.encode
    turns = [
        enc("<think>\nI am not sure.\n</think>\n\nMaybe later.<|im_end|>"),  # no call: a user message follows
        enc('<think>\nSubmit.\n</think>\n\n<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call><|im_end|>'),
    ]
    result, engine, agent, published = await rollout(tok, sandbox_cfg, turns, config())
    assert result.finish_reason == "submitted"
    assert (result.cost.segments, result.cost.template_rerenders, result.cost.turns) == (2, 1, 2)
    first_ids, first_mask = segment_arrays(published, 0)
    first = engine.calls[0]
    assert first_ids == first.prompt + first.output  # the sampled turn as sampled, then the segment ended
    assert first_mask == [0] * len(first.prompt) + [1] * len(first.output)
    second_ids, second_mask = segment_arrays(published, 1)
    second = engine.calls[1]
    assert second_ids == second.prompt + second.output and sum(second_mask) == len(second.output)
    text = fmt.tokens.decode(second.prompt)
    assert "I am not sure." not in text and "Maybe later." in text and "error: no tool call" in text


def test_live_view_counts_rerenders_per_thousand_turns():
    from rollway.live_state import rerenders_per_1k_turns

    def reward(turns, rerenders):
        return Reward(trajectory_id="t", task_id="t", group_id="g", sample_index=0, attempt="a", score=0.0,
                      cost=Cost(turns=turns, template_rerenders=rerenders))

    assert rerenders_per_1k_turns([]) is None
    assert rerenders_per_1k_turns([reward(8, 1), reward(12, 0)]) == 50.0


def test_the_tiny_model_builds_in_the_chatml_hermes_layout(tmp_path):
    """``rollway model tiny --format chatml-hermes``: the saved tokenizer, loaded as the
    samplers load it, is detected as chatml-hermes, has <tool_call> as added tokens and
    renders the tools with its own template (train_steps=0: the layout, not the skill)."""
    from transformers import AutoTokenizer

    from sampler.tiny_model import build_tiny_model

    out = build_tiny_model(tmp_path / "tiny", format="chatml-hermes", train_steps=0, vocab_size=600)
    tok = AutoTokenizer.from_pretrained(out)
    fmt = load_format(tok, "auto", out)
    assert fmt.name == "chatml-hermes"
    assert fmt.call_open_id is not None and fmt.call_close_id is not None
    start = fmt.render([fmt.user_message("Fix it.")], TOOL_SCHEMAS)
    assert '"name": "edit"' in start.text and start.text.endswith("<|im_start|>assistant\n")
    sampled = fmt.tokens.encode(hermes_call("run", command="ls"))
    turn = fmt.parse_turn(sampled)
    assert [(c.name, c.arguments) for c in turn.calls] == [("run", {"command": "ls"})]


def test_a_chatml_hermes_warm_start_builds_and_its_transcripts_are_the_agent_stream(tmp_path, toks, monkeypatch):
    """``rollway model init --format chatml-hermes`` at toy size: SFT runs on transcripts
    whose policy tokens are the canonical calls and whose environment tokens are bridges
    (sampler/formats/sft.py), the first action's name token is where the soft submit
    target goes, and the saved tokenizer serves as chatml-hermes."""
    from transformers import AutoTokenizer

    from sampler.formats.sft import render_chat_transcript, submit_token
    from tasks.family import generate
    from trainer.sft import SFTConfig
    from trainer.warm_start import WarmStartConfig, build_warm_start, cache_key

    assert WarmStartConfig().format == "chatml-hermes"  # the main job's default
    assert cache_key(WarmStartConfig(format="rollway")) != cache_key(WarmStartConfig())
    fmt = load_format(toks["chatml-hermes"])
    spec = next(s for s in generate("train", 8, seed=0) if s.metadata.get("kind") == "fix")
    ids, mask, first = render_chat_transcript(spec, fmt)
    assert fmt.tokens.decode(ids[first:first + 1]).lstrip('"').startswith("read") and mask[first] == 1
    assert fmt.tokens.decode([submit_token(fmt)]).lstrip('"').startswith("sub")
    policy = fmt.tokens.decode([t for t, m in zip(ids, mask) if m])
    assert policy.count("<tool_call>") == policy.count("<|im_end|>") == len(spec.files) + len(spec.solution) + 1
    cfg = WarmStartConfig(format="chatml-hermes", vocab_size=700, hidden_size=64, layers=1, heads=2, kv_heads=2,
                          intermediate_size=128, sft=SFTConfig(steps=2, batch_size=2, examples=4, warmup_steps=1,
                                                               log_every=0))
    # A key source edited during the build (the second key): the marker names the sources
    # the build read, the key it started with, as the cache folder's name does.
    import trainer.warm_start as warm_start

    sources = {"key": "read-by-the-build"}
    monkeypatch.setattr(warm_start, "cache_key", lambda _cfg: sources["key"])
    out = build_warm_start(tmp_path / "warm", cfg, on_step=lambda *_: sources.update(key="edited-during-the-build"))
    monkeypatch.undo()
    assert json.loads((out / warm_start.MARKER).read_text())["cache_key"] == "read-by-the-build"
    assert load_format(AutoTokenizer.from_pretrained(out), "auto", out).name == "chatml-hermes"
