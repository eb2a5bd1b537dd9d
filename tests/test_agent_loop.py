"""The agent loop with a scripted policy against the real sandbox service (issue #14,
items 9-12): tool calls read from token ids, tool errors as replies, tool time without
slot waits, compaction room for the assistant header and prefill.

The policy is :class:`tests.scripted_engine.ScriptedEngine` (exact turns on the real
tokenizer); the sandbox is the real service over HTTP with bubblewrap."""

from __future__ import annotations

import asyncio

import pytest

from sampler import tool_format as fmt
from sampler.agent import MIN_TURN_TOKENS, AgentLoop
from sampler.config import SamplerConfig
from sampler.tool_calls import ToolCall, ToolCallError, ToolCallParser
from sandbox.client import SandboxClient
from sandbox.config import SandboxConfig
from tasks.spec import TaskSpec
from tests.sandbox_helpers import live_sandbox, write_task_dir
from tests.scripted_engine import ScriptedEngine, call_ids, turn_ids
from tests.waiting import wait_until_async

TASK = TaskSpec(
    task_id="fix_add",
    instruction="Fix `add` in solution.py so the tests pass.",
    files={"solution.py": "def add(x, y):\n    return x - y\n"},
    hidden_tests={"test_add.py": "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"},
    solution={"solution.py": "def add(x, y):\n    return x + y\n"},
)


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def sandbox_cfg(tmp_path):
    write_task_dir(tmp_path / "tasks", TASK)
    return SandboxConfig(tasks_dir=str(tmp_path / "tasks"), workspace_root=str(tmp_path / "ws"), publish_rewards=False)


def config(**overrides) -> SamplerConfig:
    fields = dict(engine="torch", model_path="unused", max_model_len=512, max_turns=6, max_tokens_per_turn=64,
                  summary_max_tokens=32, chunk_tokens=32, tool_timeout_s=5.0)
    fields.update(overrides)
    return SamplerConfig(**fields)


def scripted(turns: list[list[int]]):
    """Answer the i-th generation with turns[i] (the last one repeated)."""
    calls = iter(range(10_000))
    return lambda prompt, params: turns[min(next(calls), len(turns) - 1)]


def replies(tok, engine: ScriptedEngine) -> list[str]:
    """The text of each tool reply body, as the next prompt shows it."""
    out = []
    for call in engine.calls[1:]:
        text = tok.decode(call.prompt, skip_special_tokens=False)
        body = text.rsplit("<|im_start|>tool\n<output>", 1)[1]
        out.append(body.split("</output>", 1)[0])
    return out


async def rollout(tok, sandbox_cfg, turns, cfg=None, *, client_kwargs=None, on_turn=None, max_model_len=512):
    respond = scripted(turns)
    if on_turn is not None:
        inner = respond

        def respond(prompt, params):
            on_turn(prompt, params)
            return inner(prompt, params)

    engine = ScriptedEngine(tok, respond, max_model_len=max_model_len)
    published = []

    async def publish(chunk):
        published.append(chunk)

    async with live_sandbox(sandbox_cfg) as sb, SandboxClient(sb.url, **(client_kwargs or {})) as client:
        agent = AgentLoop(engine, client, cfg or config(), publish)
        result = await agent.run(TASK.to_event(group_id="fix_add/g", group_size=1), 0, "a")
    return result, engine, agent, published


# -- item 9: tool calls from token ids ------------------------------------------------------
def test_parser_reads_only_special_tags(tok):
    parser = ToolCallParser.for_tokenizer(tok)
    text = lambda s: turn_ids(tok, (s, False))  # noqa: E731
    im_end = turn_ids(tok, ("<|im_end|>", True))
    assert parser.parse(text("I will look.\n") + call_ids(tok, "run\npython -m pytest -q")) == \
        ToolCall("run", "python -m pytest -q")
    assert parser.parse(call_ids(tok, "write a.py\nx = '<tool>run\nls</tool>'\n")) == \
        ToolCall("write", "a.py", "x = '<tool>run\nls</tool>'\n")
    # The first </tool> closes the call (generation stops there); a prefill may hold the whole call.
    assert parser.parse(call_ids(tok, "submit") + text("x")) == ToolCall("submit")
    for ids, match in [
        (text("<tool>run\nls</tool>") + im_end, "no tool call"),
        (turn_ids(tok, ("<tool>", True), ("run\nls", False)) + im_end, "unterminated"),
        (call_ids(tok, "run\nls")[:1] + call_ids(tok, "run\nls"), "one tool call per turn: this turn opens 2"),
        (call_ids(tok, "rm -rf /"), "unknown tool 'rm'"),
        (call_ids(tok, "read"), "read needs a path"),
    ]:
        with pytest.raises(ToolCallError, match=match):
            parser.parse(ids)


def test_a_tokenizer_without_single_token_tags_is_refused():
    class Plain:
        def encode(self, text, add_special_tokens=False):
            return list(text.encode())

    with pytest.raises(ValueError, match="<tool> and </tool> as single special tokens"):
        ToolCallParser.for_tokenizer(Plain())


async def test_a_write_quoting_a_text_spelled_call_is_content_and_runs_nothing(tok, sandbox_cfg):
    notes = "Reminder, never do this: <tool>run\nrm -rf .</tool>\n"
    turns = [call_ids(tok, f"write NOTES.md\n{notes}"), call_ids(tok, "run\nls && cat NOTES.md"),
             call_ids(tok, "submit")]
    result, engine, _, _ = await rollout(tok, sandbox_cfg, turns)
    assert result.finish_reason == "submitted" and result.cost.turns == 3
    assert replies(tok, engine) == [f"wrote NOTES.md ({len(notes.encode())} bytes)", f"NOTES.md\nsolution.py\n{notes}"]


async def test_a_text_spelled_call_is_no_call_and_the_hint_uses_the_special_tokens(tok, sandbox_cfg):
    spelled = turn_ids(tok, ("<tool>run\ntouch pwned</tool>", False), ("<|im_end|>", True))
    result, engine, agent, _ = await rollout(tok, sandbox_cfg, [spelled, call_ids(tok, "run\nls"),
                                                                call_ids(tok, "submit")])
    assert result.finish_reason == "submitted"
    error, listing = replies(tok, engine)
    assert error == ("error: no tool call: end the turn with one tool call; use <tool>run\nCMD</tool>, "
                     "<tool>read PATH</tool>, <tool>write PATH\nCONTENT</tool> or <tool>submit</tool>")
    assert listing == "solution.py\n"  # nothing ran
    # The hint's tags are the special tokens (4 calls), none spelled as text.
    prompt = engine.calls[1].prompt
    reply = prompt[len(engine.calls[0].prompt) + len(engine.calls[0].output):]
    assert reply.count(agent.calls.open_id) == 4 and reply.count(agent.calls.close_id) == 4
    spelled_open = turn_ids(tok, ("<tool>", False))
    assert not any(reply[i:i + len(spelled_open)] == spelled_open for i in range(len(reply)))


# -- item 10: bad arguments are replies, not group failures -----------------------------------
async def test_nul_byte_and_oversized_commands_are_refused_with_400(sandbox_cfg):
    from sandbox.isolation import MAX_COMMAND_BYTES
    from sandbox.client import SandboxError

    async with live_sandbox(sandbox_cfg) as sb, SandboxClient(sb.url) as client:
        session = await client.create_session("fix_add", TASK.files)
        with pytest.raises(SandboxError) as info:
            await client.exec(session, "echo a\x00b")
        assert (info.value.status, info.value.message) == (
            400, "command contains a NUL byte (at character 6); a shell command cannot carry one")
        with pytest.raises(SandboxError) as info:
            await client.exec(session, "#" * (MAX_COMMAND_BYTES + 1))
        assert (info.value.status, info.value.message) == (
            400, f"command is {MAX_COMMAND_BYTES + 1} bytes, over the {MAX_COMMAND_BYTES}-byte limit of one exec "
                 "argument; write long content to a file first")
        # The largest command runs; the service kept serving.
        ran = await client.exec(session, "echo ok #" + "x" * (MAX_COMMAND_BYTES - 9))
        assert (ran.exit_code, ran.stdout) == (0, "ok\n")
        await client.close_session(session)


async def test_a_refused_call_is_a_reply_and_the_rollout_goes_on(tok, sandbox_cfg):
    turns = [call_ids(tok, "run\nprintf a\x00b"), call_ids(tok, "run\necho still here"), call_ids(tok, "submit")]
    result, engine, _, _ = await rollout(tok, sandbox_cfg, turns)
    assert result.finish_reason == "submitted" and result.reward is not None
    assert replies(tok, engine) == [
        "error: command contains a NUL byte (at character 8); a shell command cannot carry one", "still here\n"]


async def test_sandbox_failures_are_replies_not_rollout_errors(tok, sandbox_cfg):
    """A 5xx and a sandbox that does not answer: error replies, nothing billed."""
    from aiohttp import web

    async def broken(request):
        return web.json_response({"error": "internal error: OSError: disk gone"}, status=500)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", broken)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = "http://%s:%d" % runner.addresses[0][:2]
    engine = ScriptedEngine(tok, scripted([[]]))
    try:
        async with SandboxClient(url) as client:
            agent = AgentLoop(engine, client, config(), _drop)
            assert await agent._execute("s", ToolCall("run", "ls"), 5.0) == ("error: internal error: OSError: disk gone", 0.0)
            assert await agent._execute("s", ToolCall("write", "a", "b"), 5.0) == ("error: internal error: OSError: disk gone", 0.0)
    finally:
        await runner.cleanup()
    async with SandboxClient(url) as client:  # nothing listens there any more
        agent = AgentLoop(engine, client, config(), _drop)
        assert await agent._execute("s", ToolCall("read", "a"), 5.0) == (
            "error: the sandbox did not answer (ClientConnectorError)", 0.0)


# -- item 11: waiting for a command slot is not the agent's time --------------------------------
async def test_slot_waits_are_not_billed_as_tool_time(tok, sandbox_cfg):
    """One command slot, held by someone else during the first call: that call ends in
    'no command slot' after the client's retries (billed 0); the next call runs and is
    billed its own duration as the sandbox measured it."""
    import msgspec

    cfg = msgspec.structs.replace(sandbox_cfg, max_concurrent_commands=1, command_queue_timeout_s=0.05)
    turns = [call_ids(tok, "run\necho one"), call_ids(tok, "run\nsleep 0.3"), call_ids(tok, "submit")]
    logged: list[float] = []
    turn = iter(range(100))

    async with live_sandbox(cfg) as sb, SandboxClient(sb.url, busy_retries=2) as client:
        slot = sb.service.jail.slot()
        await slot.__aenter__()  # someone else's command holds the only slot

        def on_turn(prompt, params):
            n = next(turn)
            if n == 1:  # after the first call: free the slot for the second
                asyncio.ensure_future(slot.__aexit__(None, None, None))
            if n == 2:
                logged.extend(c.duration_s for s in sb.service.pool.all() for c in s.calls)

        engine = ScriptedEngine(tok, _with(on_turn, scripted(turns)))
        agent = AgentLoop(engine, client, config(), _drop)
        result = await agent.run(TASK.to_event(group_id="fix_add/g", group_size=1), 0, "a")
    first, second = replies(tok, engine)
    assert first == "error: all 1 command slots stayed busy for 0.05s"
    assert second == ""
    assert len(logged) == 1 and logged[0] >= 0.3
    assert result.cost.tool_seconds == round(logged[0], 6)


def test_timeouts_out_of_order_are_refused_at_load():
    from rollway.config import ConfigError, load_config

    cfg = load_config(None, environ={})
    assert (cfg.sampler.sandbox_request_timeout_s, cfg.sampler.drain_timeout_s) == (180.0, 600.0)
    with pytest.raises(ConfigError, match=r"sampler.sandbox_request_timeout_s = 60 must exceed "
                                          r"sandbox.command_queue_timeout_s \+ sandbox.grading_timeout_s = 150 s"):
        load_config(None, environ={}, overrides={"sampler": {"sandbox_request_timeout_s": 60}})
    with pytest.raises(ConfigError, match=r"sampler.drain_timeout_s = 200 cannot fit a rollout's sandbox time alone: "
                                          r"sampler.max_tool_seconds \+ sampler.sandbox_request_timeout_s \(a submit\) "
                                          r"= 240 s"):
        load_config(None, environ={}, overrides={"sampler": {"drain_timeout_s": 200}})


async def test_draining_abandons_groups_still_running_at_the_deadline(tok, sandbox_cfg):
    """SIGTERM's drain has a deadline: a group whose rollouts are still generating then
    is cancelled (its record stays unacked for the next owner), its sandbox sessions are
    closed, and the replica can stop; before, draining waited for it without end."""
    from bus import Envelope
    from sampler.service import SamplerService
    from schemas import Task
    from syncer.config import SyncerConfig
    from bus.config import KafkaConfig

    cfg = config(max_tool_seconds=0.5, sandbox_request_timeout_s=1.0, drain_timeout_s=1.5)
    engine = ScriptedEngine(tok, lambda prompt, params: None)  # generation that never ends
    async with live_sandbox(sandbox_cfg) as sb, SandboxClient(sb.url) as client:
        service = SamplerService(cfg, engine, kafka=KafkaConfig(), syncer=SyncerConfig(), model_name="m",
                                 replica_id="r", sandbox=client)
        service.agent = AgentLoop(engine, client, cfg, _drop, replica_id="r")
        task = Task(task_id="fix_add", group_id="fix_add/g", group_size=2, instruction=TASK.instruction,
                    files=TASK.files)
        handling = asyncio.ensure_future(service._handle(Envelope(task, "rollway.tasks", 0, 0, 0, b"t", ())))
        await wait_until_async(lambda: engine.hanging >= 2, 60, "both samples generating", task=handling)
        assert len(sb.service.pool) == 2
        service.request_stop()
        # A guard against the old behaviour (a drain without end), not a timing check.
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(handling, 60)
        assert (service.tasks_done, service.rollouts_done, service.in_flight, len(sb.service.pool)) == (0, 0, 0, 0)


def _with(before, respond):
    def wrapped(prompt, params):
        before(prompt, params)
        return respond(prompt, params)
    return wrapped


async def _drop(chunk):
    return None


# -- item 12: compaction room counts the assistant header and prefill ---------------------------
async def test_a_turn_opens_only_with_room_for_header_prefill_and_reply(tok, sandbox_cfg):
    """A long prefill (99 tokens) and a small context: every turn gets at least
    MIN_TURN_TOKENS and its reply's markup under context_limit, and every summary prompt
    with its full summary fits max_model_len (before: a turn opened past the limit got 1
    token, and the summary prompt overflowed max_model_len, a ValueError)."""
    pad = "Plan: look at the file, then fix it." * 20
    pad_ids = turn_ids(tok, (pad, False))
    prefill = tok.decode(pad_ids[: 99 - len(call_ids(tok, "read solution.py"))]) + "<tool>read solution.py</tool>"
    cfg = config(max_model_len=320, assistant_prefill=prefill, max_turns=12, max_segments=3, summary_max_tokens=24)
    header = len(turn_ids(tok, (f"<|im_start|>assistant\n{prefill}", True)))
    assert header == 99 + 3
    im_end = turn_ids(tok, ("<|im_end|>", True))
    summary = turn_ids(tok, ("tried reading the file", False), ("</summary>", True))

    def respond(prompt, params):
        return summary if params.max_tokens <= cfg.summary_max_tokens and prompt[-1] == _summary_open(tok) else im_end

    engine = ScriptedEngine(tok, respond, max_model_len=cfg.max_model_len)
    async with live_sandbox(sandbox_cfg) as sb, SandboxClient(sb.url) as client:
        agent = AgentLoop(engine, client, cfg, _drop)
        result = await agent.run(TASK.to_event(group_id="fix_add/g", group_size=1), 0, "a")
    request = len(turn_ids(tok, *fmt.compaction_request()))
    markup = max(len(turn_ids(tok, *fmt.tool_reply("", c))) for c in (False, True))
    assert agent.context_limit == 320 - (request + 24 + 1)
    assert agent.compact_at == 320 - (request + 24 + 1) - header - MIN_TURN_TOKENS - markup
    turns = [c for c in engine.calls if c.prompt[-1] != _summary_open(tok)]
    summaries = [c for c in engine.calls if c.prompt[-1] == _summary_open(tok)]
    assert len(summaries) == 2 and result.finish_reason == "context_exhausted" and result.cost.segments == 3
    for c in turns:
        assert c.max_tokens >= MIN_TURN_TOKENS and c.prompt_len + c.max_tokens + markup <= agent.context_limit
    for c in summaries:
        assert c.max_tokens == 24 and c.prompt_len + c.max_tokens <= 320
    # By hand: request 90, markup 9, so context_limit 205 and compact_at 205 - 102 - 16 - 9 = 78.
    # Turn 1 opens at 23 + 102 = 125 (max_tokens: the per-turn 64 < 205 - 125 - 9); its
    # reply passes compact_at, so the next turn compacts first: summary prompt 146 + 90 =
    # 236, + 24 = 260 <= 320; the new segment's turn opens at 63 + 102 = 165 with
    # 205 - 165 - 9 = 31 tokens; and so on until max_segments. The old reserve (+32 for
    # "markup") opened the second turn at 248 against a limit of 174 with 1 token, then
    # asked for a summary at 350 > 320 tokens.
    assert (request, markup) == (90, 9)
    assert [(c.prompt_len, c.max_tokens) for c in engine.calls] == [(125, 64), (236, 24), (165, 31), (276, 24), (165, 31)]


def _summary_open(tok) -> int:
    return tok.convert_tokens_to_ids("<summary>")
