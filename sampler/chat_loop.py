"""The agent loop's turns for models with a real chat format (``sampler.format`` other
than ``rollway``; :mod:`sampler.formats`).

A segment starts with the template's full render of the conversation (the task as the
user message, the tools as JSON schemas, the generation prompt). After each sampled turn
the conversation gets the assistant message and the environment's replies (one ``tool``
message per call; a ``user`` message when the turn held no call), and only the bridge
ids are appended: the segment stays exactly the template's render of the conversation,
with every sampled id kept as sampled. Where no bridge exists (the template rewrote
history, e.g. Qwen3 drops earlier reasoning after a new user message) a new segment
starts with a fresh full render and ``template_rerenders`` counts it; nothing sampled is
ever re-tokenized, so every trained token was sampled in the context it is trained in.

Calls run in order; a malformed call, an unknown tool or a missing argument is an
``error: ...`` reply, a truncated turn (max tokens inside a call) too; ``submit`` ends
the rollout after the calls before it ran. ``edit`` is read + exact replace + write
through the sandbox client.

Self-compaction: when the segment reaches ``compact_at``, a new segment renders the
conversation with a user message asking for a summary (no tools called); the summary's
tokens are sampled (trainable); then a new segment starts from the task and the summary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sampler.formats import TOOL_SCHEMAS, ChatFormat, ParsedTurn, Render, check_call
from sampler.tool_calls import ToolCall

if TYPE_CHECKING:
    from sampler.agent import AgentLoop, _RolloutState
    from sampler.recorder import TrajectoryRecorder
    from schemas import Task

NO_CALL = ("error: no tool call; end your turn with a tool call (run, read, write, edit or submit) in the format "
           "the tools section describes")
COMPACTION = ("Your context is almost full. Summarize your working state (what you tried, what you learned, "
              "what is left) in a few sentences. Do not call a tool.")
TRUNCATED_MARK = "\n[... output truncated]"


def task_text(task: "Task") -> str:
    listing = "\nFiles: " + ", ".join(sorted(task.files)) if task.files else ""
    return task.instruction + listing


class Budget:
    """The token room a chat format's markup takes (a reply, the compaction request)."""

    def __init__(self, fmt: ChatFormat, summary_max_tokens: int) -> None:
        user = fmt.user_message("x")
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "run", "arguments": {"command": "x"}}}]}
        base = fmt.render_text([user, call], TOOL_SCHEMAS, add_generation_prompt=False)
        longest = 0
        for reply in (fmt.tool_message("call_0", "run", ""), fmt.user_message(NO_CALL)):
            full = fmt.render_text([user, call, reply], TOOL_SCHEMAS)
            longest = max(longest, len(fmt.tokens.encode(full[len(base):])))
        # The reply's markup with the generation prompt (+2: an end-of-turn token the
        # model did not sample, and a boundary merge).
        self.reply_markup = longest + 2
        self.no_call_reply = len(fmt.tokens.encode(NO_CALL))
        request = fmt.render_text([user, fmt.user_message(COMPACTION)], TOOL_SCHEMAS)
        request_len = len(fmt.tokens.encode(request[len(fmt.render_text([user], TOOL_SCHEMAS, add_generation_prompt=False)):]))
        self.compaction = request_len + summary_max_tokens + 1


async def template_turns(agent: "AgentLoop", task: "Task", rec: "TrajectoryRecorder", session: str,
                         state: "_RolloutState", logger) -> str:
    """Assistant turns until a submit or an exhausted budget; the finish reason."""
    fmt, cfg = agent.format, agent.cfg
    conversation = [fmt.user_message(task_text(task))]
    segment = await _start_segment(agent, rec, conversation)
    if len(rec.segment_tokens) >= agent.compact_at:
        logger.warning("task prompt alone reaches the compaction threshold",
                       tokens=len(rec.segment_tokens), compact_at=agent.compact_at)
        return "context_exhausted"
    while True:
        if spent := state.budget_spent(cfg, rec):
            return spent
        if len(rec.segment_tokens) >= agent.compact_at:
            if state.compactions + 1 >= cfg.max_segments:
                return "context_exhausted"
            conversation, segment = await _compact(agent, task, rec, conversation, state)
            logger.info("compacted", segment=rec.segment_index, summary_chars=len(state.summaries[-1]))
            continue
        room = agent.context_limit - len(rec.segment_tokens) - agent.reply_markup
        budget = cfg.max_total_tokens - rec.generated_tokens
        params = agent.sampling(min(cfg.max_tokens_per_turn, room, budget), list(fmt.stop_token_ids), ())
        generated, _ = await agent.engine.record(rec, params)
        state.turns += 1
        truncated = not generated or generated[-1] not in fmt.stop_token_ids
        turn = fmt.parse_turn(generated, truncated=truncated)
        conversation.append(fmt.assistant_message(turn))
        replies, submitted = await _replies(agent, session, turn, state, rec)
        if submitted:
            return "submitted"
        conversation += replies
        bridge = fmt.bridge(segment, generated, conversation, TOOL_SCHEMAS)
        if bridge is not None:
            await rec.add_env(bridge.ids, agent.engine.weight_version)
            segment = bridge
            continue
        state.template_rerenders += 1
        # The sampled turn's text, so each re-render can be explained from the log (rare).
        logger.info("template re-render: new segment", turn=state.turns, segment=rec.segment_index + 1,
                    sampled_text=fmt.tokens.decode(generated)[-400:])
        await rec.new_segment()
        segment = await _start_segment(agent, rec, conversation)
        if len(rec.segment_tokens) > agent.context_limit:
            return "context_exhausted"


async def _start_segment(agent: "AgentLoop", rec: "TrajectoryRecorder", conversation: list[dict]) -> Render:
    start = agent.format.render(conversation, TOOL_SCHEMAS)
    await rec.add_env(start.ids, agent.engine.weight_version)
    return start


async def _replies(agent: "AgentLoop", session: str, turn: ParsedTurn, state: "_RolloutState",
                   rec: "TrajectoryRecorder") -> tuple[list[dict], bool]:
    """The environment's messages for a turn, and whether it submitted. Calls run in
    order up to a submit; each reply is cut to the token limit and its share of the room."""
    fmt = agent.format
    if turn.error is not None:
        return [fmt.tool_message("call_0", "error", f"error: {turn.error}")], False
    if not turn.calls:
        return [fmt.user_message(NO_CALL)], False
    share = max(0, (agent.context_limit - len(rec.segment_tokens)) // len(turn.calls) - agent.reply_markup)
    limit = min(agent.cfg.max_tool_output_tokens, share)
    out: list[dict] = []
    for call in turn.calls:
        problem = check_call(call.name, call.arguments)
        if problem is None and call.name == "submit":
            return out, True
        if problem is not None:
            body = f"error: {problem}"
        else:
            body, billed = await agent._execute(session, _tool_call(call.name, call.arguments),
                                                agent.cfg.max_tool_seconds - state.tool_seconds)
            state.tool_seconds += billed
        out.append(fmt.tool_message(call.id, call.name, _cut(fmt, body, limit)))
    return out, False


def _tool_call(name: str, args: dict) -> ToolCall:
    if name == "run":
        return ToolCall("run", args["command"])
    if name == "read":
        return ToolCall("read", args["path"])
    if name == "write":
        return ToolCall("write", args["path"], args["content"])
    if name == "edit":
        return ToolCall("edit", args["path"], args["old"], args["new"])
    raise ValueError(f"no tool {name!r}")


def _cut(fmt: ChatFormat, body: str, limit: int) -> str:
    ids = fmt.tokens.untrusted(body)
    if len(ids) <= limit:
        return body
    mark = fmt.tokens.untrusted(TRUNCATED_MARK)
    keep = max(0, limit - len(mark))
    return fmt.tokens.decode(ids[:keep]) + (TRUNCATED_MARK if limit >= len(mark) else "")


async def _compact(agent: "AgentLoop", task: "Task", rec: "TrajectoryRecorder", conversation: list[dict],
                   state: "_RolloutState") -> tuple[list[dict], Render]:
    """A segment asking for a summary (its tokens train), then one from task + summary."""
    fmt, cfg = agent.format, agent.cfg
    await rec.new_segment()
    request = await _start_segment(agent, rec, conversation + [fmt.user_message(COMPACTION)])
    room = agent.max_len - 1 - len(request.ids)
    summary = ""
    if room >= 1:
        budget = cfg.max_total_tokens - rec.generated_tokens
        params = agent.sampling(min(cfg.summary_max_tokens, room, max(budget, 1)), list(fmt.stop_token_ids), ())
        generated, _ = await agent.engine.record(rec, params)
        turn = fmt.parse_turn(generated, truncated=not generated or generated[-1] not in fmt.stop_token_ids)
        summary = (turn.content if turn.error is None else turn.text).strip()
    state.summaries.append(summary)
    state.compactions += 1
    await rec.new_segment()
    resume = [fmt.user_message(f"{task_text(task)}\n\nSummary of your earlier work:\n{summary}")]
    start = fmt.render(resume, TOOL_SCHEMAS)
    if len(start.ids) >= agent.compact_at:  # the summary is too long to help: keep its head
        ids = fmt.tokens.untrusted(summary)
        summary = fmt.tokens.decode(ids[: max(0, len(ids) - (len(start.ids) - agent.compact_at) - 16)])
        state.summaries[-1] = summary
        resume = [fmt.user_message(f"{task_text(task)}\n\nSummary of your earlier work:\n{summary}")]
        start = fmt.render(resume, TOOL_SCHEMAS)
    await rec.add_env(start.ids, agent.engine.weight_version)
    return resume, start
