"""The OpenAI-compatible endpoint (issue #27, item 4) with the ``openai`` client as the
harness, real Kafka and the real sandbox service (bubblewrap).

The policy is scripted (:class:`tests.scripted_engine.ScriptedEngine` on a tokenizer in
Qwen2.5's published layout, ``sampler.formats.tokenizers``) where the test needs exact
tool calls: a 3-turn conversation, refused requests, mini-swe-agent solving a task.
The same plumbing on real vLLM is in ``tests/test_endpoint_vllm.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from bus import EventProducer
from sampler.config import SamplerConfig
from sampler.openai_api.config import EndpointConfig
from sampler.openai_api.episodes import EpisodeRegistry
from sampler.openai_api.server import EndpointServer, serve
from sandbox.client import SandboxClient
from sandbox.config import SandboxConfig
from schemas import Reward, TrajectoryChunk
from tasks.spec import TaskSpec
from tests.events import read_all, read_until
from tests.sandbox_helpers import live_sandbox, write_task_dir
from tests.scripted_engine import ScriptedEngine

pytestmark = [pytest.mark.kafka]

MODEL = "rollway-test"
TASK = TaskSpec(
    task_id="fix_add",
    instruction="Fix `add` in solution.py so the tests pass.",
    files={"solution.py": "def add(x, y):\n    return x - y\n"},
    hidden_tests={"test_add.py": "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"},
)
BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a bash command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
SUBMIT = {"type": "function", "function": {"name": "submit", "description": "Grade the workspace",
                                           "parameters": {"type": "object", "properties": {}}}}
FIX = "printf 'def add(x, y):\\n    return x + y\\n' > solution.py"


@pytest.fixture(scope="module")
def hermes():
    """A tokenizer in Qwen2.5's layout and its chatml-hermes format."""
    from sampler.formats import load_format
    from sampler.formats.tokenizers import build_tokenizer

    corpus = ["def add(x, y):\n    return x + y\n", "cat solution.py", '{"name": "bash", "arguments": {}}',
              "Fix `add` in solution.py so the tests pass.", "printf 'x' > solution.py && python -m pytest -q"] * 20
    tok = build_tokenizer("chatml-hermes", corpus)
    return tok, load_format(tok, "chatml-hermes")


def call_turn(fmt, name: str, arguments: dict, content: str = "") -> list[int]:
    """The ids a model of this format samples for one assistant turn with one call: the
    template's own rendering of it, after the generation prompt."""
    history = [{"role": "user", "content": "x"}]
    turn = {"role": "assistant", "content": content, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}]}
    before = fmt.render_text(history, [BASH])
    after = fmt.render_text(history + [turn], [BASH], add_generation_prompt=False)
    assert after.startswith(before)
    return fmt.tokenizer.encode(after[len(before):], add_special_tokens=False)


def as_template(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates take them: call arguments as dicts."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def scripted(turns: list[list[int]]):
    calls = iter(range(10_000))
    return lambda prompt, params: turns[min(next(calls), len(turns) - 1)]


@pytest.fixture
def sandbox_cfg(tmp_path):
    write_task_dir(tmp_path / "tasks", TASK)
    return SandboxConfig(tasks_dir=str(tmp_path / "tasks"), workspace_root=str(tmp_path / "ws"))


@contextlib.asynccontextmanager
async def running_endpoint(engine, chat_format, kafka_config, sandbox_cfg, **scfg):
    settings = dict(engine="torch", model_path="unused", max_model_len=engine.max_model_len, chunk_tokens=16,
                    temperature=1.0, top_p=1.0)
    settings.update(scfg)
    async with EventProducer(kafka_config) as producer, live_sandbox(sandbox_cfg, publisher=producer) as sb, \
            SandboxClient(sb.url) as client:
        registry = EpisodeRegistry(engine, client, SamplerConfig(**settings), EndpointConfig(), producer.publish,
                                   chat_format, replica_id="endpoint-test")
        async with serve(EndpointServer(registry, MODEL)) as url:
            yield url, registry


async def post(url: str, payload: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.request(method, url, json=payload) as resp:
        return resp.status, await resp.json()


async def create_episode(url: str, **fields) -> dict:
    status, body = await post(f"{url}/v1/rollway/episodes", {"task_id": TASK.task_id,
                                                              "instruction": TASK.instruction, **fields})
    assert status == 201, body
    return body


def trajectory(chunks: list[TrajectoryChunk], tid: str) -> list[TrajectoryChunk]:
    out = sorted((c for c in chunks if c.trajectory_id == tid), key=lambda c: c.chunk_index)
    assert [c.chunk_index for c in out] == list(range(len(out)))
    return out


def concat(chunks: list[TrajectoryChunk]) -> dict[str, np.ndarray | list]:
    return {
        "ids": np.concatenate([c.token_array() for c in chunks]).tolist(),
        "mask": np.concatenate([c.loss_mask_array() for c in chunks]).tolist(),
        "versions": np.concatenate([c.version_array() for c in chunks]).tolist(),
        "logprobs": np.concatenate([c.logprob_array() for c in chunks]).tolist(),
        "kept": [k.tolist() for c in chunks for k in c.kept_sets()],
        "segments": [c.segment_index for c in chunks for _ in range(len(c.token_array()))],
    }


async def final_chunks(kafka_config, tid: str) -> list[TrajectoryChunk]:
    events = await read_until(kafka_config, "trajectories",
                              lambda evs: any(c.trajectory_id == tid and c.final for c in evs), 60)
    return trajectory(events, tid)


async def reward_of(kafka_config, tid: str) -> Reward:
    events = await read_until(kafka_config, "rewards", lambda evs: any(r.trajectory_id == tid for r in evs), 60)
    return next(r for r in events if r.trajectory_id == tid)


def tool_call_of(message) -> tuple[str, dict]:
    call = message.tool_calls[0]
    return call.function.name, json.loads(call.function.arguments)


async def test_three_turns_with_tool_calls_record_exactly_the_sampled_ids(hermes, kafka_config, sandbox_cfg):
    from openai import AsyncOpenAI

    tok, fmt = hermes
    turns = [call_turn(fmt, "bash", {"command": "cat solution.py"}, "Let me look."),
             call_turn(fmt, "bash", {"command": FIX}),
             call_turn(fmt, "submit", {})]
    engine = ScriptedEngine(tok, scripted(turns), max_model_len=2048)
    async with running_endpoint(engine, fmt, kafka_config, sandbox_cfg) as (url, registry):
        ep = await create_episode(url)
        client = AsyncOpenAI(base_url=ep["base_url"], api_key="unused", max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        messages: list[dict] = [{"role": "system", "content": "You fix code."},
                                {"role": "user", "content": TASK.instruction}]
        tools = [BASH, SUBMIT]

        # Turn 1: non-streaming; the call comes back in OpenAI's tool_calls form.
        r1 = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                                  extra_body={"return_token_ids": True})
        choice = r1.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
        assert tool_call_of(choice.message) == ("bash", {"command": "cat solution.py"})
        assert r1.usage.completion_tokens == len(engine.calls[0].output)
        assert r1.model_extra["prompt_token_ids"] == fmt.render(messages, tools).ids == engine.calls[0].prompt
        status, out = await post(f"{url}/v1/rollway/episodes/{ep['id']}/exec", {"command": "cat solution.py"})
        assert status == 200 and out["stdout"] == TASK.files["solution.py"]
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": out["stdout"]}]

        # New weights between two turns: the bridge and turn 2 carry version 1.
        await engine.apply_weights({}, 1)

        # Turn 2: streamed (SSE chunks in OpenAI's shape), assembled by the client's types.
        stream = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools, stream=True,
                                                      stream_options={"include_usage": True})
        calls: dict[int, dict] = {}
        finish, usage, content = None, None, ""
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                content += c.delta.content or ""
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    slot = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += d.id or ""
                    slot["name"] += d.function.name or ""
                    slot["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls" and usage.completion_tokens == len(engine.calls[1].output)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("bash", {"command": FIX})]
        status, out = await post(f"{url}/v1/rollway/episodes/{ep['id']}/exec", {"command": FIX})
        assert status == 200 and out["exit_code"] == 0
        messages += [{"role": "assistant", "content": content, "tool_calls": [
                         {"id": calls[0]["id"], "type": "function",
                          "function": {"name": "bash", "arguments": calls[0]["arguments"]}}]},
                     {"role": "tool", "tool_call_id": calls[0]["id"], "content": "done"}]

        # Turn 3: a tool call named submit ends the episode: the sandbox grades it.
        r3 = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
        assert tool_call_of(r3.choices[0].message) == ("submit", {})
        status, graded = await post(f"{url}/v1/rollway/episodes/{ep['id']}/submit")
        assert status == 200 and graded["status"] == "done" and graded["reward"]["score"] == 1.0
        assert graded["segments"] == 1 and graded["template_rerenders"] == 0 and graded["history_rewrites"] == 0

    # Every turn appended only the bridge: each prompt extends the last prompt and turn.
    p = [c.prompt for c in engine.calls]
    o = [c.output for c in engine.calls]
    assert p[1][: len(p[0]) + len(o[0])] == p[0] + o[0] and p[2][: len(p[1]) + len(o[1])] == p[1] + o[1]
    # ...and the whole segment is the template's own render of the conversation, id for id.
    assert p[2] == fmt.render(as_template(messages), tools).ids

    rec = concat(await final_chunks(kafka_config, ep["trajectory_id"]))
    assert rec["ids"] == p[2] + o[2]
    assert rec["mask"] == [0] * len(p[0]) + [1] * len(o[0]) + [0] * (len(p[1]) - len(p[0]) - len(o[0])) \
        + [1] * len(o[1]) + [0] * (len(p[2]) - len(p[1]) - len(o[1])) + [1] * len(o[2])
    sampled = [i for i, m in enumerate(rec["mask"]) if m]
    assert [rec["kept"][i] for i in sampled] == [[t] for t in o[0] + o[1] + o[2]]  # the engine's kept sets
    # Version 0 through turn 1, version 1 from the bridge after the update on.
    first_v1 = len(p[0]) + len(o[0])
    assert rec["versions"] == [0] * first_v1 + [1] * (len(rec["ids"]) - first_v1)
    reward = await reward_of(kafka_config, ep["trajectory_id"])
    assert reward.score == 1.0 and reward.weight_version == 1


async def test_bad_requests_are_4xx_in_openai_shape_and_publish_nothing(hermes, kafka_config, sandbox_cfg):
    import openai
    from openai import AsyncOpenAI

    tok, fmt = hermes
    engine = ScriptedEngine(tok, scripted([call_turn(fmt, "bash", {"command": "ls"})]), max_model_len=2048)
    async with running_endpoint(engine, fmt, kafka_config, sandbox_cfg) as (url, registry):
        idle = await create_episode(url)
        ep = await create_episode(url)
        bad = AsyncOpenAI(base_url=idle["base_url"], api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": TASK.instruction}]
        refusals = [
            (openai.NotFoundError, "model_not_found", dict(model="gpt-4o", messages=messages)),
            (openai.BadRequestError, None, dict(model=MODEL, messages=[{"role": "robot", "content": "hi"}])),
            (openai.BadRequestError, None, dict(model=MODEL, messages=[])),
            (openai.BadRequestError, None, dict(model=MODEL, messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
            (openai.BadRequestError, None, dict(model=MODEL, messages=messages, n=2)),
            (openai.BadRequestError, None, dict(model=MODEL, messages=messages, temperature=0.005)),
            (openai.BadRequestError, "assistant_history_rewritten", dict(model=MODEL, messages=messages + [
                {"role": "assistant", "content": "I never said this"}, {"role": "user", "content": "go on"}])),
        ]
        for error, code, request in refusals:
            with pytest.raises(error) as caught:
                await bad.chat.completions.create(**request)
            body = caught.value.body
            assert isinstance(body, dict) and body["message"] and "type" in body, body
            if code:
                assert body["code"] == code
        # Unknown episodes, no episode: 4xx in the same shape.
        status, body = await post(f"{url}/v1/rollway/episodes/ep-nope/v1/chat/completions",
                                  {"model": MODEL, "messages": messages})
        assert status == 404 and body["error"]["code"] == "episode_not_found"
        status, body = await post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": messages})
        assert status == 400 and body["error"]["code"] == "episode_required"
        status, body = await post(f"{url}/v1/rollway/episodes/{idle['id']}/submit")
        assert status == 409 and body["error"]["code"] == "episode_empty"

        # One good turn, then a conversation that rewrites it: refused, the record untouched.
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                             default_headers={"X-Rollway-Episode": ep["id"]})
        r1 = await client.chat.completions.create(model=MODEL, messages=messages, tools=[BASH])
        said = r1.choices[0].message.model_dump(exclude_none=True)
        recorder = registry.episodes[ep["id"]].recorder
        before = (list(recorder.segment_tokens), recorder.chunks_published, len(engine.calls))
        tool_reply = {"role": "tool", "tool_call_id": said["tool_calls"][0]["id"], "content": "solution.py"}
        rewritten = dict(said, tool_calls=[dict(said["tool_calls"][0], function={"name": "bash",
                                                                                 "arguments": '{"command": "rm -rf ."}'})])
        for request in (dict(messages=messages + [rewritten, tool_reply]),
                        dict(messages=messages + [said, tool_reply], temperature=0.5)):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=MODEL, tools=[BASH], **request)
            assert caught.value.status_code == 400
        assert (list(recorder.segment_tokens), recorder.chunks_published, len(engine.calls)) == before
        assert "did not sample" in str(caught.value) or "temperature" in str(caught.value)
        # The episode goes on from where it was: the faithful continuation is bridged.
        r2 = await client.chat.completions.create(model=MODEL, messages=messages + [said, tool_reply], tools=[BASH])
        assert r2.model_extra["rollway"]["new_segment"] == ""
        # A harness that drops the sampled turns (a retry, a format error): a new segment,
        # freshly rendered, counted.
        again = messages + [{"role": "user", "content": "Start over."}]
        r3 = await client.chat.completions.create(model=MODEL, messages=again, tools=[BASH])
        assert r3.model_extra["rollway"]["new_segment"] == "history"
        assert r3.model_extra["rollway"]["segment_index"] == 1
        assert engine.calls[-1].prompt == fmt.render(again, [BASH]).ids
        status, body = await post(f"{url}/v1/rollway/episodes/{ep['id']}", method="GET")
        assert body["history_rewrites"] == 1 and body["segments"] == 2 and body["template_rerenders"] == 0
        status, _ = await post(f"{url}/v1/rollway/episodes/{idle['id']}", method="DELETE")
        assert status == 200
    chunks = await read_all(kafka_config, "trajectories")
    assert not [c for c in chunks if c.trajectory_id == idle["trajectory_id"]]


async def run_mini_cli(url: str, episode: dict, tmp_path: Path, task: str, **config) -> tuple[int, dict, str]:
    """mini-swe-agent's ``mini`` CLI (the installed entry point) on ``episode``, unattended
    as a script runs it: yolo mode, ``--exit-immediately``, stdin not a terminal. Its exit
    code, its saved trajectory (``-o``) and its output."""
    import yaml
    from minisweagent import package_dir

    from sampler.openai_api.mini_swe_agent import CLI_ENV, cli_config

    ours = tmp_path / "rollway-mini.yaml"
    ours.write_text(yaml.safe_dump(cli_config(url, episode, **config)))
    out = tmp_path / "mini.traj.json"
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, **CLI_ENV, "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mswea"),
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "mini"), "-c", str(package_dir / "config" / "mini.yaml"), "-c", str(ours),
        "-y", "--exit-immediately", "-t", task, "-o", str(out),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    output, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    text = output.decode(errors="replace")
    assert out.exists(), f"mini wrote no trajectory (exit {proc.returncode}):\n{text[-3000:]}"
    return proc.returncode, json.loads(out.read_text()), text


def mini_swe_agent_engine(tok, fmt) -> ScriptedEngine:
    """A policy that solves TASK in mini-swe-agent's style: look, fix, submit."""
    turns = [call_turn(fmt, "bash", {"command": "cat solution.py"}, "THOUGHT: look first."),
             call_turn(fmt, "bash", {"command": FIX}, "THOUGHT: fix the sign."),
             call_turn(fmt, "bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})]
    return ScriptedEngine(tok, scripted(turns), max_model_len=4096)


async def test_mini_cli_solves_a_task_in_the_sandbox_session(hermes, kafka_config, sandbox_cfg, tmp_path):
    """The ``mini`` CLI route (docs/agents.md): an episode created over HTTP, the CLI run
    with the package's mini.yaml and our config (sampler.openai_api.mini_swe_agent
    .cli_config): its bash calls run in the episode's sandbox session and its submit
    convention grades the workspace it edited."""
    tok, fmt = hermes
    engine = mini_swe_agent_engine(tok, fmt)
    async with running_endpoint(engine, fmt, kafka_config, sandbox_cfg) as (url, registry):
        episode = await create_episode(url)
        code, traj, output = await run_mini_cli(url, episode, tmp_path, TASK.instruction, agent={"step_limit": 5})
        status, graded = await post(f"{url}/v1/rollway/episodes/{episode['id']}", method="GET")
    assert code == 0, output[-3000:]
    assert traj["info"]["exit_status"] == "Submitted" and traj["info"]["model_stats"]["api_calls"] == 3
    assert status == 200 and graded["status"] == "done" and graded["turns"] == 3
    assert graded["reward"]["score"] == 1.0 and graded["history_rewrites"] == 0 and graded["segments"] == 1
    # The agent saw the sandbox's file (its first command's output).
    assert any(m["role"] == "tool" and "return x - y" in m["content"] for m in traj["messages"])
    chunks = await final_chunks(kafka_config, episode["trajectory_id"])
    rec = concat(chunks)
    assert [t for t, m in zip(rec["ids"], rec["mask"]) if m] == [t for c in engine.calls for t in c.output]
    assert chunks[-1].finish_reason == "submitted" and chunks[-1].cost.turns == 3
    assert (await reward_of(kafka_config, episode["trajectory_id"])).score == 1.0


async def test_mini_swe_agent_solves_a_task_in_the_sandbox_session(hermes, kafka_config, sandbox_cfg):
    """mini-swe-agent (the PyPI package) drives the episode: its bash calls run in the
    episode's sandbox session, its submit convention grades the workspace it edited."""
    from sampler.openai_api.mini_swe_agent import run_episode

    tok, fmt = hermes
    engine = mini_swe_agent_engine(tok, fmt)
    async with running_endpoint(engine, fmt, kafka_config, sandbox_cfg) as (url, registry):
        spec = {"task_id": TASK.task_id, "instruction": TASK.instruction}
        result = await asyncio.to_thread(run_episode, url, spec, step_limit=5)
    assert result["exit_status"] == "Submitted" and result["n_calls"] == 3
    episode = result["episode"]
    assert episode["reward"]["score"] == 1.0 and episode["turns"] == 3
    # What the agent saw of its first command is the sandbox's file.
    observation = result["messages"][3]
    assert observation["role"] == "tool" and "return x - y" in observation["content"]
    chunks = await final_chunks(kafka_config, episode["trajectory_id"])
    rec = concat(chunks)
    sampled = [t for t, m in zip(rec["ids"], rec["mask"]) if m]
    assert sampled == [t for c in engine.calls for t in c.output]
    assert chunks[-1].finish_reason == "submitted" and chunks[-1].cost.turns == 3
    assert (await reward_of(kafka_config, episode["trajectory_id"])).score == 1.0


async def test_a_sampler_replica_serves_the_endpoint_beside_its_task_loop(hermes, kafka_config, sandbox_cfg):
    """``sampler.endpoint.enabled``: the replica (SamplerService) serves the endpoint with
    its engine, producer and sandbox; its identity is on the chunks; stop closes it."""
    import socket

    from openai import AsyncOpenAI

    from sampler.service import SamplerService
    from syncer.config import SyncerConfig
    from tests.waiting import wait_until_async

    tok, fmt = hermes
    engine = ScriptedEngine(tok, scripted([call_turn(fmt, "submit", {})]), max_model_len=2048)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scfg = SamplerConfig(engine="torch", model_path="unused", format="chatml-hermes", max_model_len=2048,
                         follow_weights=False, endpoint=EndpointConfig(enabled=True, port=port))
    url = f"http://127.0.0.1:{port}"

    async def serving() -> bool:
        try:
            return (await post(f"{url}/health", method="GET"))[0] == 200
        except aiohttp.ClientError:
            return False

    async with EventProducer(kafka_config) as producer, live_sandbox(sandbox_cfg, publisher=producer) as sb, \
            SandboxClient(sb.url) as client:
        service = SamplerService(scfg, engine, kafka=kafka_config, syncer=SyncerConfig(), model_name=MODEL,
                                 replica_id="replica-e", sandbox=client)
        run = asyncio.create_task(service.run(install_signals=False))
        await wait_until_async(serving, 60, "the replica's endpoint", task=run)
        ep = await create_episode(url)
        openai_client = AsyncOpenAI(base_url=ep["base_url"], api_key="unused", max_retries=0)
        r = await openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": TASK.instruction}], tools=[SUBMIT])
        assert tool_call_of(r.choices[0].message) == ("submit", {})
        status, graded = await post(f"{url}/v1/rollway/episodes/{ep['id']}/submit")
        assert status == 200 and graded["reward"]["score"] == 0.0  # nothing was fixed
        service.request_stop()
        await run
    chunks = await final_chunks(kafka_config, ep["trajectory_id"])
    assert {c.replica_id for c in chunks} == {"replica-e"} and chunks[-1].finish_reason == "submitted"
    with pytest.raises(aiohttp.ClientError):
        await post(f"{url}/health", method="GET")
