"""The agent loop: one rollout of one sample of a task, against the sandbox service.

A rollout is a sequence of *segments*; a segment is one context window::

    <task prompt>                                  environment (loss mask 0)
    <|im_start|>assistant\\n[prefill]               environment
    ...model text... <tool>run\\nls</tool>          policy (loss mask 1)
    <|im_end|>\\n<|im_start|>tool\\n<output>..</output><|im_end|>\\n   environment
    <|im_start|>assistant\\n ...                    next turn

Tool calls follow :mod:`sampler.tool_format`. A message without a well-formed tool
call gets an error reply and costs a turn. Budgets: ``max_turns`` (assistant
messages), ``max_total_tokens`` (generated tokens, summaries included) and
``max_tool_seconds`` (wall time of tool calls); the first one exhausted ends the
rollout with ``budget_<name>``.

Tool calls are read from the turn's token ids (:mod:`sampler.tool_calls`); a tool
error of any kind (a refusal, a sandbox failure, no free command slot) becomes the
reply, never a failed rollout: one bad argument must not cancel the whole group.
Tool time is the time the sandbox spent on the agent's calls (a command's own
duration): waiting for a command slot is the infrastructure's cost, not the agent's.

Self-compaction: before a turn, when the segment holds ``compact_at`` tokens (at most
``compaction_fraction`` of ``max_model_len``), the agent is asked for a summary
(``<summary>`` prefilled, generated until ``</summary>``; those tokens are trainable),
then a new segment starts from the task prompt and the summary. Every segment's tokens
are published, so all segments train. Outside a compaction the context never grows
past ``context_limit`` = ``max_model_len`` less the compaction request and a full
summary, so compaction always fits; and ``compact_at`` leaves room below that limit for
a whole turn: the assistant header with its prefill, ``MIN_TURN_TOKENS`` generated
tokens and the tool reply's markup.

When the rollout ends (submit, budget, context exhausted) the final chunk is
published, then the sandbox grades the workspace (``submit``), which publishes the
``Reward``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import aiohttp
import structlog

from sampler import chat_loop
from sampler import tool_format as fmt
from sampler.formats import apply_edit, load_format
from sampler.tool_calls import ToolCall, ToolCallError, ToolCallParser, format_hint
from sampler.config import SamplerConfig
from sampler.engine import Engine
from sampler.recorder import Publish, TrajectoryIdentity, TrajectoryRecorder
from sampler.sampling import SamplingParams
from sandbox.client import SandboxBusy, SandboxClient, SandboxError
from schemas import Cost, Reward, Task

log = structlog.get_logger(__name__)

TRUNCATED_MARK = "\n[... output truncated]"
# A turn opens only with room for this many generated tokens (else the agent compacts).
MIN_TURN_TOKENS = 16


def trajectory_id(task: Task, sample_index: int, attempt: str) -> str:
    """Unique per task, group, sample and delivery attempt."""
    return f"{task.task_id}/{task.group_id}/{sample_index}/{attempt}"


@dataclass
class RolloutResult:
    trajectory_id: str
    finish_reason: str
    cost: Cost
    reward: Reward | None
    chunks: int
    segments: int
    weight_versions: list[int] = field(default_factory=list)
    summaries: list[str] = field(default_factory=list)


@dataclass
class _RolloutState:
    turns: int = 0
    tool_seconds: float = 0.0
    summaries: list[str] = field(default_factory=list)
    compactions: int = 0  # chat formats (sampler/chat_loop.py)
    template_rerenders: int = 0

    def budget_spent(self, cfg, rec: TrajectoryRecorder) -> str | None:
        """The finish reason when a turn, token or tool-time budget is spent; None otherwise
        (both agent loops check it before every turn)."""
        if self.turns >= cfg.max_turns:
            return "budget_turns"
        if rec.generated_tokens >= cfg.max_total_tokens:
            return "budget_tokens"
        if self.tool_seconds >= cfg.max_tool_seconds:
            return "budget_tool_seconds"
        return None


class AgentLoop:
    """Runs rollouts with one engine and one sandbox client (both shared)."""

    def __init__(
        self,
        engine: Engine,
        sandbox: SandboxClient,
        cfg: SamplerConfig,
        publish: Publish,
        *,
        replica_id: str = "",
    ) -> None:
        self.engine = engine
        self.sandbox = sandbox
        self.cfg = cfg
        self.publish = publish
        self.replica_id = replica_id
        tok = engine.tokenizer
        self.tok = tok
        # The model's chat format (sampler/formats); the rollway dialect keeps this
        # module's own path, other formats take sampler/chat_loop.py's.
        self.format = load_format(tok, cfg.format, cfg.model_path)
        self.max_len = min(cfg.max_model_len, engine.max_model_len)
        if self.format.name != "rollway":
            self._init_chat_budget()
            return
        self.calls = ToolCallParser.for_tokenizer(tok)
        self._tool_stop = self.calls.close_id
        self._im_end = self._single_token(fmt.IM_END)
        self._summary_stop = self._single_token(fmt.SUMMARY_CLOSE)
        self.max_len = min(cfg.max_model_len, engine.max_model_len)
        # The compaction request and a full summary always fit on top of the context
        # (the summary prompt must stay below max_model_len: +1).
        compaction = len(self.encode(fmt.compaction_request())) + cfg.summary_max_tokens + 1
        self.context_limit = self.max_len - compaction
        # What a turn adds besides its generated tokens: the assistant header with the
        # prefill, and the tool reply's markup (the longer of its two forms).
        self.header_tokens = len(self.encode(fmt.assistant_header(cfg.assistant_prefill)))
        self.reply_markup = max(len(self.encode(fmt.tool_reply("", closed))) for closed in (False, True))
        self.reserve = compaction + self.header_tokens + MIN_TURN_TOKENS + self.reply_markup
        self.compact_at = min(int(cfg.compaction_fraction * self.max_len), self.max_len - self.reserve)
        if self.compact_at < MIN_TURN_TOKENS:
            raise ValueError(
                f"max_model_len {self.max_len} leaves no room for turns after reserving {self.reserve} tokens "
                f"(compaction request and summary {compaction}, assistant header and prefill {self.header_tokens}, "
                f"a {MIN_TURN_TOKENS}-token turn, reply markup {self.reply_markup}); lower sampler.summary_max_tokens, "
                "shorten sampler.assistant_prefill or raise max_model_len"
            )

    def _init_chat_budget(self) -> None:
        """The context limits of a chat format (as for the dialect, with its markup)."""
        cfg = self.cfg
        budget = chat_loop.Budget(self.format, cfg.summary_max_tokens)
        self.context_limit = self.max_len - budget.compaction
        self.reply_markup = budget.reply_markup
        self.reserve = budget.compaction + MIN_TURN_TOKENS + budget.reply_markup
        self.compact_at = min(int(cfg.compaction_fraction * self.max_len), self.max_len - self.reserve)
        if self.compact_at < MIN_TURN_TOKENS:
            raise ValueError(
                f"max_model_len {self.max_len} leaves no room for turns of format {self.format.name!r} after reserving "
                f"{self.reserve} tokens (compaction request and summary {budget.compaction}, a {MIN_TURN_TOKENS}-token "
                f"turn, reply markup {budget.reply_markup}); lower sampler.summary_max_tokens or raise max_model_len")

    def _single_token(self, text: str) -> int | None:
        ids = self.tok.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def encode(self, pieces: list[fmt.Piece]) -> list[int]:
        out: list[int] = []
        for text, trusted in pieces:
            if text:
                out.extend(self.tok.encode(text, add_special_tokens=False, split_special_tokens=not trusted))
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def sampling(self, max_tokens: int, stops: list[int | None], stop_strings: tuple[str, ...]) -> SamplingParams:
        ids = tuple(t for t in stops if t is not None)
        return SamplingParams(
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            top_k=self.cfg.top_k,
            max_tokens=max(1, max_tokens),
            stop_token_ids=ids,
            stop=stop_strings,
        )

    # -- one rollout --------------------------------------------------------------------------
    async def run(self, task: Task, sample_index: int, attempt: str, *, phase_step: int | None = None) -> RolloutResult:
        """One rollout. ``phase_step``: the trainer step whose reward phase grades it, the
        same for every sample of the group (the service passes the version it served when
        it took the group); None: the version served as this rollout starts (a lone rollout
        is its own group)."""
        cfg = self.cfg
        if phase_step is None:
            phase_step = self.engine.weight_version
        tid = trajectory_id(task, sample_index, attempt)
        base = self.sampling(1, [], ())
        effective = self.engine.effective_params(base)
        rec = TrajectoryRecorder(
            TrajectoryIdentity(
                trajectory_id=tid, task_id=task.task_id, group_id=task.group_id, sample_index=sample_index,
                group_size=task.group_size, attempt=attempt, replica_id=self.replica_id,
                temperature=effective.temperature, top_p=effective.top_p, top_k=effective.top_k,
            ),
            self.publish, chunk_tokens=cfg.chunk_tokens, max_chunk_bytes=cfg.max_chunk_bytes,
        )
        logger = log.bind(trajectory_id=tid)
        session = await self.sandbox.create_session(task.task_id, dict(task.files))
        submitted = False
        state = _RolloutState()
        try:
            if self.format.name == "rollway":
                await rec.add_env(self.encode(fmt.task_prompt(task.instruction, task.files)), self.engine.weight_version)
                reason = await self._turns(task, rec, session, state, logger)
            else:
                reason = await chat_loop.template_turns(self, task, rec, session, state, logger)
            cost = Cost(
                generated_tokens=rec.generated_tokens,
                env_tokens=rec.env_tokens,
                turns=state.turns,
                tool_seconds=round(state.tool_seconds, 6),
                segments=rec.segment_index + 1,
                template_rerenders=state.template_rerenders,
            )
            await rec.finish(reason, cost)
            version = rec.newest_generated_version
            if version < 0:
                version = self.engine.weight_version
            # weight_version: the newest version that produced a token (staleness).
            # trainer_step: the group's phase step, not this trajectory's newest version:
            # per-trajectory phases let one group straddle a phase boundary, and identical
            # solves got 1.0 and 0.9, i.e. advantages of +-1 for the same behaviour.
            reward = await self.sandbox.submit(
                session, trajectory_id=tid, task_id=task.task_id, group_id=task.group_id,
                sample_index=sample_index, attempt=attempt, cost=cost,
                weight_version=version, trainer_step=phase_step,
            )
            submitted = True
            logger.info("rollout done", reason=reason, turns=state.turns, tokens=rec.generated_tokens,
                        segments=cost.segments, template_rerenders=state.template_rerenders,
                        chunks=rec.chunks_published, score=reward.score)
            return RolloutResult(tid, reason, cost, reward, rec.chunks_published, cost.segments,
                                 sorted(rec.generated_versions), state.summaries)
        finally:
            if not submitted:
                with contextlib.suppress(Exception):
                    await self.sandbox.close_session(session)

    async def _turns(self, task: Task, rec: TrajectoryRecorder, session: str, state: "_RolloutState", logger) -> str:
        """Assistant turns until a submit or an exhausted budget; returns the finish reason."""
        cfg = self.cfg
        if len(rec.segment_tokens) >= self.compact_at:
            logger.warning("task prompt alone reaches the compaction threshold",
                           tokens=len(rec.segment_tokens), compact_at=self.compact_at)
            return "context_exhausted"
        while True:
            if spent := state.budget_spent(cfg, rec):
                return spent
            if len(rec.segment_tokens) >= self.compact_at:
                if rec.segment_index + 1 >= cfg.max_segments:
                    return "context_exhausted"
                summary = await self._compact(task, rec)
                state.summaries.append(summary)
                logger.info("compacted", segment=rec.segment_index, summary_chars=len(summary))
                continue
            # Below compact_at the whole turn fits under context_limit (see __init__).
            header = self.encode(fmt.assistant_header(cfg.assistant_prefill))
            await rec.add_env(header, self.engine.weight_version)
            room = self.context_limit - len(rec.segment_tokens) - self.reply_markup
            budget = cfg.max_total_tokens - rec.generated_tokens
            params = self.sampling(min(cfg.max_tokens_per_turn, room, budget), [self._tool_stop, self._im_end], ())
            generated, _ = await self.engine.record(rec, params)
            state.turns += 1
            closed = bool(generated) and generated[-1] == self._im_end
            # The header's ids carry the prefill (which may open the call).
            try:
                call = self.calls.parse(header + generated)
            except ToolCallError as exc:
                reply = [(f"error: {exc}; ", False), *format_hint()]
            else:
                if call.name == "submit":
                    return "submitted"
                body, billed = await self._execute(session, call, cfg.max_tool_seconds - state.tool_seconds)
                state.tool_seconds += billed
                reply = [(body, False)]
            await rec.add_env(self._reply_tokens(reply, closed, rec), self.engine.weight_version)

    async def _compact(self, task: Task, rec: TrajectoryRecorder) -> str:
        """Ask for a summary, then start a new segment from the task and the summary."""
        await rec.add_env(self.encode(fmt.compaction_request()), self.engine.weight_version)
        room = self.max_len - 1 - len(rec.segment_tokens)
        budget = self.cfg.max_total_tokens - rec.generated_tokens
        params = self.sampling(min(self.cfg.summary_max_tokens, room, max(budget, 1)),
                               [self._summary_stop, self._im_end], ())
        generated, _ = await self.engine.record(rec, params)
        summary = self.decode(generated)
        for marker in (fmt.SUMMARY_CLOSE, fmt.IM_END):
            summary = summary.split(marker)[0]
        summary = summary.strip()
        await rec.new_segment()
        resume = self.encode(fmt.task_prompt(task.instruction, task.files) + fmt.summary_resume_prompt(summary))
        if len(resume) >= self.compact_at:
            # The summary is too long to help: keep its head so the new segment has room.
            keep = max(0, len(self.encode([(summary, False)])) - (len(resume) - self.compact_at) - 16)
            summary = self.decode(self.encode([(summary, False)])[:keep])
            resume = self.encode(fmt.task_prompt(task.instruction, task.files) + fmt.summary_resume_prompt(summary))
        await rec.add_env(resume, self.engine.weight_version)
        return summary

    def _reply_tokens(self, body: list[fmt.Piece], closed: bool, rec: TrajectoryRecorder) -> list[int]:
        """The tool reply, its body cut to the token limit and to what the context allows."""
        markup = len(self.encode(fmt.tool_reply("", closed)))
        limit = min(self.cfg.max_tool_output_tokens, self.context_limit - len(rec.segment_tokens) - markup)
        body_ids = self.encode(body)
        if len(body_ids) > max(limit, 0):
            mark = self.encode([(TRUNCATED_MARK, False)])
            body_ids = body_ids[: max(0, limit - len(mark))] + (mark if limit >= len(mark) else [])
        head, _, tail = fmt.tool_reply("", closed)
        return self.encode([head]) + body_ids + self.encode([tail])

    async def _execute(self, session: str, call: ToolCall, seconds_left: float) -> tuple[str, float]:
        """Run one tool call: the reply text and the tool seconds to bill. Every error
        becomes the reply (a 4xx refusal, a 5xx, an unreachable sandbox, no free command
        slot): a tool call never fails the rollout, and with it the group.

        Billed: a command's own duration as the sandbox measured it (not the wait for a
        command slot, on either side of the HTTP call); a file read or write, or a
        refused call, its wall time (they take no slot); nothing for a call that never
        got a slot or that the sandbox failed (5xx, no answer)."""
        t0 = time.perf_counter()
        try:
            if call.name == "run":
                timeout = max(0.1, min(self.cfg.tool_timeout_s, seconds_left))
                res = await self.sandbox.exec(session, call.arg, timeout_s=timeout)
                out = res.stdout + (("\n" if res.stdout and res.stderr else "") + res.stderr if res.stderr else "")
                notes = []
                if res.timed_out:
                    notes.append(f"timed out after {timeout:.1f}s")
                if res.killed:
                    notes.append(f"killed: {res.killed}")
                if res.exit_code not in (0, None):
                    notes.append(f"exit code {res.exit_code}")
                return out + (f"\n[{'; '.join(notes)}]" if notes else ""), res.duration_s
            if call.name == "read":
                text = await self.sandbox.read_file(session, call.arg)
                return text, time.perf_counter() - t0
            if call.name == "write":
                written = await self.sandbox.write_file(session, call.arg, call.content)
                return f"wrote {call.arg} ({written} bytes)", time.perf_counter() - t0
            if call.name == "edit":  # read + exact replace + write (sampler/formats/tools.py)
                text = await self.sandbox.read_file(session, call.arg)
                try:
                    edited = apply_edit(text, call.content, call.new, call.arg)
                except ValueError as exc:
                    return f"error: {exc}", time.perf_counter() - t0
                written = await self.sandbox.write_file(session, call.arg, edited)
                return f"edited {call.arg} (1 replacement; {written} bytes)", time.perf_counter() - t0
            raise ValueError(f"unknown tool {call.name!r}")
        except SandboxBusy as exc:
            return f"error: {exc.message}", 0.0
        except SandboxError as exc:
            if exc.status < 500:  # the call's own fault (a refusal): its time is the agent's
                return f"error: {exc.message}", time.perf_counter() - t0
            log.warning("tool call failed in the sandbox", tool=call.name, status=exc.status, error=exc.message)
            return f"error: {exc.message}", 0.0
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Commands are cut at tool_timeout_s, far below the client's timeout: no
            # answer is the infrastructure's fault, not billed.
            log.warning("tool call did not reach the sandbox", tool=call.name, error=repr(exc))
            return f"error: the sandbox did not answer ({type(exc).__name__})", 0.0
