"""Agent rollouts on real vLLM against the real sandbox service, chunks on real Kafka."""

from __future__ import annotations

import numpy as np
import pytest
import pytest_asyncio

from bus import EventProducer
from sampler import tool_format as fmt
from sampler.agent import AgentLoop, trajectory_id
from sampler.config import SamplerConfig
from sampler.tool_calls import ToolCall
from sandbox.client import SandboxClient, SandboxError
from sandbox.config import RewardConfig, SandboxConfig
from schemas import Reward, TrajectoryChunk
from tasks.spec import TaskSpec
from tests.events import read_until
from tests.sampler_helpers import agent_model_dir, start_test_engine
from tests.sandbox_helpers import live_sandbox, write_task_dir

pytestmark = pytest.mark.vllm

TASK = TaskSpec(
    task_id="fix_add",
    instruction="Fix `add` in solution.py so the tests pass.",
    files={"solution.py": "def add(x, y):\n    return x - y\n"},
    hidden_tests={"test_add.py": "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"},
    solution={"solution.py": "def add(x, y):\n    return x + y\n"},
)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def engine():
    eng = await start_test_engine()
    yield eng
    await eng.close()  # vLLM: one live in-process engine per process


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    write_task_dir(root, TASK)
    return root


def agent_config(**overrides) -> SamplerConfig:
    fields = dict(model_path=str(agent_model_dir()), max_model_len=512, top_p=0.95, max_turns=6,
                  max_tokens_per_turn=40, max_total_tokens=2000, summary_max_tokens=32, chunk_tokens=32,
                  assistant_prefill="<tool>run\n", tool_timeout_s=5.0)
    fields.update(overrides)
    return SamplerConfig(**fields)


def concat(chunks: list[TrajectoryChunk]):
    chunks = sorted(chunks, key=lambda c: c.chunk_index)
    return {
        "tokens": np.concatenate([c.token_array() for c in chunks]),
        "mask": np.concatenate([c.loss_mask_array() for c in chunks]),
        "logprobs": np.concatenate([c.logprob_array() for c in chunks]),
        "versions": np.concatenate([c.version_array() for c in chunks]),
        "segments": np.concatenate([np.full(c.num_tokens, c.segment_index) for c in chunks]),
        "kept": [k for c in chunks for k in c.kept_sets()],
    }


def env_output_spans(tokens, mask, open_id: int, close_id: int) -> list[tuple[int, int]]:
    """(start, end) of the bodies of tool replies the environment inserted."""
    spans, i = [], 0
    while i < len(tokens):
        if tokens[i] == open_id and mask[i] == 0:
            j = i + 1
            while tokens[j] != close_id:
                j += 1
            spans.append((i + 1, j))
            i = j
        i += 1
    return spans


@pytest.mark.kafka
async def test_multi_turn_rollout_masks_tool_output_compacts_and_records_weight_versions(
    engine, kafka_config, tasks_dir, tmp_path
):
    cfg = agent_config(max_model_len=256, compaction_fraction=0.6, max_segments=3, max_turns=12)
    task = TASK.to_event(group_id="fix_add/g1", group_size=1)
    start_version = engine.weight_version
    from safetensors.torch import load_file

    same_weights = load_file(str(agent_model_dir() / "model.safetensors"))
    published: list[TrajectoryChunk] = []

    async with EventProducer(kafka_config) as producer:
        async def publish(chunk: TrajectoryChunk):
            if chunk.chunk_index == 2:
                # A new weight version lands while the rollout runs (same tensors, so
                # the model's behaviour does not change; the version does).
                await engine.apply_weights(same_weights, start_version + 1)
            published.append(chunk)
            return await producer.publish(chunk)

        sandbox_cfg = SandboxConfig(tasks_dir=str(tasks_dir), workspace_root=str(tmp_path / "ws"))
        # Phases by trainer step: only step start_version + 1 is a budget step, so the
        # reward's phase tells which step the sampler submitted (none sent counts as 0):
        # the step served when the rollout (a group of one) started, not its newest.
        reward_cfg = RewardConfig(phase_unit="step", phase_cycle=False, phase_schedule=[
            ("unconstrained", start_version + 1), ("budget", 1), ("unconstrained", 1)])
        async with live_sandbox(sandbox_cfg, reward_cfg, publisher=producer) as sb, SandboxClient(sb.url) as client:
            agent = AgentLoop(engine, client, cfg, publish, replica_id="sampler-test")
            result = await agent.run(task, sample_index=0, attempt="att-1")

    tid = trajectory_id(task, 0, "att-1")
    assert result.trajectory_id == tid == "fix_add/fix_add/g1/0/att-1"
    chunks = await read_until(
        kafka_config, "trajectories",
        lambda evs: any(isinstance(e, TrajectoryChunk) and e.final for e in evs))
    chunks = [c for c in chunks if c.trajectory_id == tid]
    assert sorted(c.chunk_index for c in chunks) == list(range(len(chunks))) == list(range(result.chunks))
    assert [c.final for c in sorted(chunks, key=lambda c: c.chunk_index)] == [False] * (len(chunks) - 1) + [True]
    final = max(chunks, key=lambda c: c.chunk_index)
    assert final.finish_reason == result.finish_reason
    assert final.finish_reason in ("budget_turns", "context_exhausted", "budget_tokens")
    for c in chunks:
        c.validate()
        assert c.num_tokens <= cfg.chunk_tokens
        assert (c.task_id, c.group_id, c.sample_index, c.attempt, c.replica_id) == (
            "fix_add", "fix_add/g1", 0, "att-1", "sampler-test")
        assert (c.temperature, c.top_p, c.top_k) == (1.0, 0.95, -1)

    arr = concat(chunks)
    tokens, mask = arr["tokens"], arr["mask"]
    cost = final.cost
    assert cost.generated_tokens == int(mask.sum()) == result.cost.generated_tokens
    assert cost.env_tokens == int((mask == 0).sum())
    assert cost.turns >= 2 and cost.tool_seconds > 0

    # Per-token records: policy tokens carry their kept set and a log-prob, env tokens none.
    for t, m, lp, kept in zip(tokens, mask, arr["logprobs"], arr["kept"]):
        if m:
            assert int(t) in kept and lp <= 1e-6
        else:
            assert kept.size == 0 and lp == 0.0

    # Tool output is environment: every token of every reply body is loss-masked.
    tok = engine.tokenizer
    out_open, out_close = (tok.convert_tokens_to_ids(t) for t in (fmt.OUTPUT_OPEN, fmt.OUTPUT_CLOSE))
    spans = env_output_spans(tokens, mask, out_open, out_close)
    assert len(spans) >= 2
    for a, b in spans:
        assert not mask[a:b].any()
    bodies = [tok.decode(tokens[a:b].tolist()) for a, b in spans]
    ran = [b for b in bodies if not b.startswith("error: no tool call") and not b.startswith("error: unterminated")]
    assert ran, bodies  # at least one command really ran in the sandbox

    # Self-compaction: a summary was asked for, then a new segment starts from the task.
    segments = sorted(set(arr["segments"].tolist()))
    assert len(segments) >= 2 and cost.segments == len(segments) == result.segments
    assert len(result.summaries) == len(segments) - 1
    for s in segments:
        seg_tokens = tokens[arr["segments"] == s].tolist()
        assert len(seg_tokens) <= cfg.max_model_len
        assert tok.decode(seg_tokens).startswith("<|im_start|>user\nFix `add` in solution.py")
        assert mask[arr["segments"] == s].any(), f"segment {s} has no trainable tokens"
        if s < segments[-1]:
            assert "Summarize your working state" in tok.decode(seg_tokens)
        if s > 0:
            assert "Summary of your earlier work:" in tok.decode(seg_tokens)

    # The weight version applied mid-rollout shows in the per-token spans.
    gen_versions = arr["versions"][mask == 1]
    assert set(gen_versions.tolist()) == {start_version, start_version + 1}
    assert np.all(np.diff(gen_versions) >= 0)
    assert sorted(result.weight_versions) == [start_version, start_version + 1]

    # Graded after the final chunk: the reward is on its topic too.
    assert isinstance(result.reward, Reward) and result.reward.trajectory_id == tid
    assert result.reward.weight_version == start_version + 1
    # trainer_step = the group's phase step: the version served when it started (one phase
    # per group, docs/contracts.md), although its newest tokens are from start_version + 1.
    assert result.reward.phase == "unconstrained"
    rewards = await read_until(kafka_config, "rewards", lambda evs: any(e.trajectory_id == tid for e in evs))
    assert [(r.cost.generated_tokens, r.phase) for r in rewards if r.trajectory_id == tid] == [
        (cost.generated_tokens, "unconstrained")]


async def collect_publish():
    out: list[TrajectoryChunk] = []

    async def publish(chunk):
        out.append(chunk)

    return out, publish


@pytest.mark.parametrize("overrides,reason", [
    ({"max_turns": 2}, "budget_turns"),
    ({"max_total_tokens": 25, "max_tokens_per_turn": 10}, "budget_tokens"),
    # The prefill is the whole call; the model adds one token, whatever it is.
    ({"max_tool_seconds": 0.3, "max_tokens_per_turn": 1, "assistant_prefill": "<tool>run\nsleep 30</tool>"},
     "budget_tool_seconds"),
])
async def test_budgets_end_the_rollout(engine, tasks_dir, tmp_path, overrides, reason):
    cfg = agent_config(**overrides)
    out, publish = await collect_publish()
    task = TASK.to_event(group_id="fix_add/g2", group_size=1)
    sandbox_cfg = SandboxConfig(tasks_dir=str(tasks_dir), workspace_root=str(tmp_path / "ws"), publish_rewards=False)
    async with live_sandbox(sandbox_cfg) as sb, SandboxClient(sb.url) as client:
        result = await AgentLoop(engine, client, cfg, publish).run(task, 0, "att-b")
    assert result.finish_reason == reason
    assert out[-1].final and out[-1].finish_reason == reason
    if reason == "budget_turns":
        assert result.cost.turns == 2
    if reason == "budget_tokens":
        assert result.cost.generated_tokens == 25
    if reason == "budget_tool_seconds":
        # the sleep was cut by the remaining tool-time budget (0.3 s): before the 5 s tool
        # timeout (what would cut it otherwise), long before the 30 s sleep ends
        assert 0.3 <= result.cost.tool_seconds < agent_config().tool_timeout_s and result.cost.turns == 1
    assert result.reward is not None and result.reward.score == 0.0


async def test_tool_calls_reach_the_sandbox_and_refusals_become_replies(engine, tasks_dir, tmp_path):
    out, publish = await collect_publish()
    sandbox_cfg = SandboxConfig(tasks_dir=str(tasks_dir), workspace_root=str(tmp_path / "ws"), publish_rewards=False)
    async with live_sandbox(sandbox_cfg) as sb, SandboxClient(sb.url) as client:
        agent = AgentLoop(engine, client, agent_config(), publish)
        session = await client.create_session("fix_add", TASK.files)
        # _execute: (reply, billed tool seconds)
        wrote, _ = await agent._execute(session, ToolCall("write", "solution.py", "def add(x, y):\n    return x + y\n"), 5)
        assert wrote == "wrote solution.py (32 bytes)"
        read, _ = await agent._execute(session, ToolCall("read", "solution.py"), 5)
        assert read == "def add(x, y):\n    return x + y\n"
        ran, billed = await agent._execute(session, ToolCall("run", "python -c 'print(6*7)'; exit 3"), 5)
        assert ran == "42\n\n[exit code 3]" and billed > 0
        missing, _ = await agent._execute(session, ToolCall("read", "nope.py"), 5)
        assert missing.startswith("error:")
        escape, _ = await agent._execute(session, ToolCall("write", "../outside.py", "x"), 5)
        assert escape.startswith("error:")
        with pytest.raises(SandboxError) as info:
            await client.exec("no-such-session", "ls")
        assert info.value.status == 404
        await client.close_session(session)
