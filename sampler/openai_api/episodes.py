"""Episodes: a harness's conversation bound to one Rollway trajectory.

An episode is one sample of a task (task, group, sample index, attempt), one sandbox
session and one :class:`~sampler.recorder.TrajectoryRecorder`. Each chat request is
mapped onto the episode's token record:

* the messages **extend** the conversation the segment holds (every earlier message
  equal, the last assistant message equal to the turn that was sampled, the same
  tools): only the format's bridge ids for the new messages are appended (environment
  tokens, loss mask 0), then the turn is sampled;
* the format cannot bridge them (its template rewrites history): a **new segment**
  starts with a fresh render of the whole conversation (``template_rerenders``);
* the harness changed its conversation (dropped a turn, e.g. after a format error,
  edited a message, changed the tools): a new segment as well (``history_rewrites``);
* an assistant message this episode never sampled: a 400, nothing recorded: its tokens
  would be context the policy is credited with but never produced.

Sampling goes through :meth:`Engine.record`, the agent loop's own call, so every
generated token's kept set, log-prob and weight version are recorded exactly as for
Rollway's loop, and chunks stream to ``rollway.trajectories`` as they fill. Every check
that can refuse a request runs before the recorder is touched, so a refused request
publishes nothing.

Grading: ``submit`` (the route, or a tool call named ``submit``) publishes the final
chunk and has the sandbox grade the session; the sandbox publishes the ``Reward``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import aiohttp
import msgspec
import structlog

from sampler.agent import trajectory_id
from sampler.openai_api.chat import message_from_assistant, template_messages
from sampler.openai_api.protocol import ApiError, ChatRequest, Message, bad_request
from sampler.recorder import Publish, TrajectoryIdentity, TrajectoryRecorder
from sampler.sampling import SamplingParams, temperature_error
from sandbox.client import SandboxError
from schemas import Cost, Reward, Task

if TYPE_CHECKING:
    from sampler.config import SamplerConfig
    from sampler.engine import Engine
    from sampler.openai_api.config import EndpointConfig
    from sandbox.client import ExecResult, SandboxClient

log = structlog.get_logger(__name__)

SUBMIT_TOOL = "submit"


@dataclass
class _Segment:
    """What the current segment holds, exactly: the conversation it renders (ending
    with the sampled turn), the format's render of everything before that turn, the
    turn's ids and the tools it was rendered with."""

    messages: list[Message]
    prefix: Any  # sampler.formats.Render
    turn_ids: list[int]
    tools: list[dict[str, Any]]


@dataclass
class Turn:
    message: Message
    finish_reason: str
    prompt_ids: list[int]
    generated: list[int]
    new_segment: str  # "" (bridged), "first", "template", "history"
    versions: list[int]
    reasoning: str | None = None


class EpisodeSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/rollway/episodes``: which task and sample the harness's conversation is."""

    task_id: str
    instruction: str = ""
    # None: the task's repository from the sandbox's task store.
    files: dict[str, str] | None = None
    group_id: str = ""  # "" = a group of its own
    group_size: int = 1
    sample_index: int = 0
    attempt: str = ""  # "" = a fresh one
    # The trainer step whose reward phase grades it (-1 = the version served now);
    # a driver running a group passes the same value to every sample.
    phase_step: int = -1
    # Fixed for the episode (recorded on every chunk); None = sampler.temperature / top_p.
    temperature: float | None = None
    top_p: float | None = None


class Episode:
    def __init__(self, episode_id: str, task: Task, sample_index: int, attempt: str, session_id: str,
                 phase_step: int, temperature: float | None, top_p: float | None) -> None:
        self.id = episode_id
        self.task = task
        self.sample_index = sample_index
        self.attempt = attempt
        self.trajectory_id = trajectory_id(task, sample_index, attempt)
        self.session_id = session_id
        self.phase_step = phase_step
        self.temperature = temperature
        self.top_p = top_p
        self.status = "open"  # open | grading | done | abandoned
        self.recorder: TrajectoryRecorder | None = None
        self.segment: _Segment | None = None  # None: unknown (or empty) -> the next request renders anew
        # Every assistant turn sampled: its key -> the format's rendering of it.
        self.sampled: dict[tuple, dict[str, Any]] = {}
        self.turns = 0
        self.tool_seconds = 0.0
        self.template_rerenders = 0
        self.history_rewrites = 0
        self.reward: Reward | None = None
        self.lock = asyncio.Lock()
        self.grading: asyncio.Task | None = None
        self.last_used = time.monotonic()

    def describe(self) -> dict[str, Any]:
        rec = self.recorder
        return {
            "id": self.id, "status": self.status, "trajectory_id": self.trajectory_id, "task_id": self.task.task_id,
            "group_id": self.task.group_id, "group_size": self.task.group_size, "sample_index": self.sample_index,
            "attempt": self.attempt, "session_id": self.session_id, "phase_step": self.phase_step,
            "instruction": self.task.instruction, "turns": self.turns,
            "generated_tokens": rec.generated_tokens if rec else 0, "env_tokens": rec.env_tokens if rec else 0,
            "segments": rec.segment_index + 1 if rec else 0, "chunks_published": rec.chunks_published if rec else 0,
            "template_rerenders": self.template_rerenders, "history_rewrites": self.history_rewrites,
            "tool_seconds": round(self.tool_seconds, 6),
            "reward": msgspec.to_builtins(self.reward) if self.reward is not None else None,
        }

    def cost(self) -> Cost:
        rec = self.recorder
        return Cost(generated_tokens=rec.generated_tokens, env_tokens=rec.env_tokens, turns=self.turns,
                    tool_seconds=round(self.tool_seconds, 6), segments=rec.segment_index + 1,
                    template_rerenders=self.template_rerenders)


class EpisodeRegistry:
    """The episodes of one replica: create, sample turns, run commands, grade, abandon."""

    def __init__(self, engine: "Engine", sandbox: "SandboxClient", scfg: "SamplerConfig", ecfg: "EndpointConfig",
                 publish: Publish, chat_format, *, replica_id: str = "") -> None:
        """``chat_format``: a ``sampler.formats.ChatFormat`` of the engine's tokenizer."""
        self.engine = engine
        self.sandbox = sandbox
        self.scfg = scfg
        self.ecfg = ecfg
        self.publish = publish
        self.format = chat_format
        self.replica_id = replica_id or "endpoint"
        self.episodes: dict[str, Episode] = {}
        self.max_len = min(scfg.max_model_len, engine.max_model_len)
        self._background: set[asyncio.Task] = set()

    # -- lifecycle ----------------------------------------------------------------------
    async def create(self, spec: EpisodeSpec) -> Episode:
        self._forget_graded(keep=self.ecfg.max_episodes)
        live = sum(1 for ep in self.episodes.values() if ep.status != "done")
        if live >= self.ecfg.max_episodes:
            raise ApiError(429, f"{live} episodes are open (sampler.endpoint.max_episodes); "
                           "submit or delete one first", type="rate_limit_error", code="too_many_episodes")
        for name in ("temperature",):
            value = getattr(spec, name)
            if value is not None and (error := temperature_error(name, value)):
                raise bad_request(error, name)
        if spec.top_p is not None and not 0 < spec.top_p <= 1:
            raise bad_request("top_p must be in (0, 1]", "top_p")
        if not spec.task_id or not 1 <= spec.group_size or not 0 <= spec.sample_index < spec.group_size:
            raise bad_request("task_id must be non-empty and 0 <= sample_index < group_size")
        episode_id = f"ep-{uuid.uuid4().hex[:16]}"
        task = Task(task_id=spec.task_id, group_id=spec.group_id or f"{spec.task_id}/{episode_id}",
                    group_size=spec.group_size, instruction=spec.instruction, files=spec.files or {})
        attempt = spec.attempt or f"{self.replica_id}-{uuid.uuid4().hex[:8]}"
        try:
            session = await self.sandbox.create_session(task.task_id, spec.files)
        except SandboxError as exc:
            raise ApiError(exc.status if exc.status < 500 else 502, f"sandbox: {exc.message}",
                           type="sandbox_error", code="sandbox_session") from None
        phase = spec.phase_step if spec.phase_step >= 0 else self.engine.weight_version
        ep = Episode(episode_id, task, spec.sample_index, attempt, session, phase, spec.temperature, spec.top_p)
        self.episodes[episode_id] = ep
        log.info("episode created", episode=episode_id, trajectory_id=ep.trajectory_id, session=session)
        return ep

    def get(self, episode_id: str) -> Episode:
        ep = self.episodes.get(episode_id)
        if ep is None:
            raise ApiError(404, f"unknown episode {episode_id!r} (create one with POST /v1/rollway/episodes)",
                           param="episode", code="episode_not_found")
        return ep

    def _open(self, ep: Episode) -> None:
        if ep.status != "open":
            raise ApiError(409, f"episode {ep.id} is {ep.status}: it takes no more requests",
                           code="episode_closed")
        if ep.lock.locked():
            raise ApiError(409, f"episode {ep.id} has a request in flight: one request at a time",
                           code="episode_busy")
        ep.last_used = time.monotonic()

    async def abandon(self, ep: Episode, why: str = "deleted") -> None:
        """Close the session without grading; the trajectory gets no final chunk."""
        if ep.status in ("open", "grading") and ep.grading is None:
            ep.status = "abandoned"
        self.episodes.pop(ep.id, None)
        with contextlib.suppress(Exception):
            await self.sandbox.close_session(ep.session_id)
        log.info("episode abandoned", episode=ep.id, why=why, status=ep.status)

    def _forget_graded(self, keep: int, older_than_s: float | None = None) -> None:
        """Graded episodes stay readable (GET, a repeated submit) until ``keep`` newer ones
        were graded or, with ``older_than_s``, they went unused that long."""
        done = sorted((ep for ep in self.episodes.values() if ep.status == "done"), key=lambda ep: ep.last_used)
        now = time.monotonic()
        for i, ep in enumerate(done):
            if i < len(done) - keep or (older_than_s is not None and now - ep.last_used > older_than_s):
                self.episodes.pop(ep.id, None)

    async def reap_idle(self) -> int:
        self._forget_graded(self.ecfg.max_episodes, self.ecfg.episode_idle_timeout_s)
        now = time.monotonic()
        idle = [ep for ep in self.episodes.values() if ep.status == "open" and not ep.lock.locked()
                and now - ep.last_used > self.ecfg.episode_idle_timeout_s]
        for ep in idle:
            await self.abandon(ep, "idle")
        return len(idle)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for ep in list(self.episodes.values()):
            if ep.status == "done":
                self.episodes.pop(ep.id, None)
            else:
                await self.abandon(ep, "shutdown")

    # -- turns ----------------------------------------------------------------------------
    def _check_sampled(self, ep: Episode, messages: list[Message]) -> None:
        for i, m in enumerate(messages):
            if m.role == "assistant" and m.key() not in ep.sampled:
                raise bad_request(
                    f"messages[{i}] is an assistant message this episode did not sample: a conversation may not "
                    "rewrite or invent assistant turns (every assistant token is recorded as sampled by the policy); "
                    "send the assistant messages exactly as they were returned", f"messages[{i}]",
                    code="assistant_history_rewritten")

    def _plan(self, ep: Episode, req: ChatRequest) -> tuple[list[int], Any, str]:
        """The ids to append, the new segment's prefix render (None when bridged) and why a
        new segment starts ("" = bridged)."""
        seg = ep.segment
        conversation = template_messages(req.messages, ep.sampled)
        tools = req.tools or None
        if seg is not None and seg.tools == req.tools and len(req.messages) > len(seg.messages) \
                and [m.key() for m in req.messages[: len(seg.messages)]] == [m.key() for m in seg.messages]:
            bridge = self.format.bridge(seg.prefix, seg.turn_ids, conversation, tools)
            if bridge is not None:
                return list(bridge.ids), bridge, ""
            why = "template"
        else:
            why = "first" if ep.recorder is None or not ep.recorder.segment_tokens else "history"
        render = self.format.render(conversation, tools)
        return list(render.ids), render, why

    def _sampling(self, ep: Episode, req: ChatRequest, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=ep.temperature, top_p=ep.top_p, top_k=self.scfg.top_k,
                              max_tokens=max_tokens, stop_token_ids=tuple(self.format.stop_token_ids), seed=req.seed)

    def _params(self, ep: Episode, req: ChatRequest) -> tuple[float, float]:
        """The episode's temperature and top_p: fixed by the episode or by its first
        request (they are recorded on every chunk); a later request asking for others is
        refused."""
        out = []
        for name, default in (("temperature", self.scfg.temperature), ("top_p", self.scfg.top_p)):
            asked, fixed = getattr(req, name), getattr(ep, name)
            if fixed is None:
                out.append(asked if asked is not None else default)
                continue
            if asked is not None and abs(asked - fixed) > 1e-9:
                raise bad_request(f"this episode samples with {name} = {fixed} (recorded on its trajectory); a "
                                  f"request cannot change it to {asked}", name)
            out.append(fixed)
        return out[0], out[1]

    def _recorder(self, ep: Episode) -> TrajectoryRecorder:
        if ep.recorder is None:
            effective = self.engine.effective_params(SamplingParams(temperature=ep.temperature, top_p=ep.top_p,
                                                                    top_k=self.scfg.top_k, max_tokens=1))
            task = ep.task
            ep.recorder = TrajectoryRecorder(
                TrajectoryIdentity(
                    trajectory_id=ep.trajectory_id, task_id=task.task_id, group_id=task.group_id,
                    sample_index=ep.sample_index, group_size=task.group_size, attempt=ep.attempt,
                    replica_id=self.replica_id, temperature=effective.temperature, top_p=effective.top_p,
                    top_k=effective.top_k,
                ),
                self.publish, chunk_tokens=self.scfg.chunk_tokens, max_chunk_bytes=self.scfg.max_chunk_bytes,
            )
        return ep.recorder

    async def complete(self, ep: Episode, req: ChatRequest, *, on_start: Callable[[], Awaitable[None]] | None = None,
                       on_token: Callable[[int], None] | None = None) -> Turn:
        """Sample one assistant turn for ``req``. ``on_start`` runs once every check
        passed (a stream sends its headers there); ``on_token`` gets each sampled id."""
        self._open(ep)
        async with ep.lock:
            self._check_sampled(ep, req.messages)
            temperature, top_p = self._params(ep, req)
            if ep.turns >= self.ecfg.max_turns:
                raise bad_request(f"episode {ep.id} used its {self.ecfg.max_turns} turns "
                                  "(sampler.endpoint.max_turns); submit it", code="episode_budget_exceeded")
            generated_so_far = ep.recorder.generated_tokens if ep.recorder else 0
            budget = self.ecfg.max_total_tokens - generated_so_far
            if budget <= 0:
                raise bad_request(f"episode {ep.id} generated its {self.ecfg.max_total_tokens} tokens "
                                  "(sampler.endpoint.max_total_tokens); submit it", code="episode_budget_exceeded")
            ids, render, why = self._plan(ep, req)
            kept = len(ep.recorder.segment_tokens) if ep.recorder is not None and not why else 0
            prompt_len = kept + len(ids)
            room = self.max_len - prompt_len
            if room < 1:
                raise bad_request(f"the conversation needs {prompt_len} prompt tokens; the model's context is "
                                  f"{self.max_len}", "messages", code="context_length_exceeded")
            max_tokens = min(req.max_tokens or self.ecfg.default_max_tokens, room, budget)
            # Every refusal is above: from here on the request is recorded.
            ep.temperature, ep.top_p = temperature, top_p
            params = self._sampling(ep, req, max_tokens)
            rec = self._recorder(ep)
            ep.segment = None  # until the turn is recorded whole, the segment's content is unknown
            if why == "template":
                ep.template_rerenders += 1
            elif why == "history":
                ep.history_rewrites += 1
            if why and rec.segment_tokens:
                await rec.new_segment()
            await rec.add_env(ids, self.engine.weight_version)
            prompt_ids = list(rec.segment_tokens)
            # The bridge's text is the whole new prefix; its ids are only the appended ones.
            prefix = render if why else dataclasses.replace(render, ids=prompt_ids)
            if on_start is not None:
                await on_start()
            rec.listener = on_token
            try:
                generated, done = await self.engine.record(rec, params)
            finally:
                rec.listener = None
            ep.turns += 1
            truncated = done is not None and done.finish_reason == "length"
            parsed = self.format.parse_turn(generated, truncated=truncated)
            rendered = self.format.assistant_message(parsed)
            message = message_from_assistant(rendered)
            ep.segment = _Segment([*req.messages, message], prefix, list(generated), req.tools)
            ep.sampled[message.key()] = rendered
            calls = message.tool_calls
            finish = "tool_calls" if calls else ("length" if truncated else "stop")
            versions = sorted(rec.generated_versions)
            if parsed.error:
                log.info("turn without a well-formed call", episode=ep.id, error=parsed.error)
        if any(c.name == SUBMIT_TOOL for c in calls):
            self._start_grading(ep, "submitted")
        return Turn(message, finish, prompt_ids, list(generated), why, versions, parsed.reasoning)

    # -- tools ------------------------------------------------------------------------------
    async def exec(self, ep: Episode, command: str, timeout_s: float | None) -> "ExecResult":
        self._open(ep)
        timeout = min(timeout_s or self.scfg.tool_timeout_s, self.scfg.max_tool_seconds)
        try:
            result = await self.sandbox.exec(ep.session_id, command, timeout_s=timeout)
        except SandboxError as exc:
            raise ApiError(exc.status if exc.status < 500 else 502, f"sandbox: {exc.message}",
                           type="sandbox_error", code="sandbox_exec") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(502, f"the sandbox did not answer ({type(exc).__name__})", type="sandbox_error") from None
        ep.tool_seconds += result.duration_s
        ep.last_used = time.monotonic()
        return result

    # -- grading ----------------------------------------------------------------------------
    def _start_grading(self, ep: Episode, reason: str) -> asyncio.Task:
        if ep.grading is None:
            ep.status = "grading"
            ep.grading = asyncio.create_task(self._grade(ep, reason), name=f"grade-{ep.id}")
            self._background.add(ep.grading)
            ep.grading.add_done_callback(self._graded)
        return ep.grading

    def _graded(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("grading failed", error=repr(task.exception()))

    async def submit(self, ep: Episode, reason: str = "submitted") -> Reward:
        """Finish the trajectory and grade it (idempotent: a second submit waits for the first)."""
        if ep.status == "done" and ep.reward is not None:
            return ep.reward
        if ep.status == "abandoned":
            raise ApiError(409, f"episode {ep.id} was abandoned", code="episode_closed")
        if ep.grading is None:
            if ep.recorder is None or ep.recorder.generated_tokens == 0:
                raise ApiError(409, f"episode {ep.id} has no sampled turn yet: nothing to grade (DELETE it to "
                               "abandon it)", code="episode_empty")
            if ep.lock.locked() and ep.status == "open":
                raise ApiError(409, f"episode {ep.id} has a request in flight", code="episode_busy")
        return await asyncio.shield(self._start_grading(ep, reason))

    async def _grade(self, ep: Episode, reason: str) -> Reward:
        try:
            async with ep.lock:
                rec = ep.recorder
                cost = ep.cost()
                if not rec.finished:
                    await rec.finish(reason, cost)
                version = rec.newest_generated_version
                reward = await self.sandbox.submit(
                    ep.session_id, trajectory_id=ep.trajectory_id, task_id=ep.task.task_id,
                    group_id=ep.task.group_id, sample_index=ep.sample_index, attempt=ep.attempt, cost=cost,
                    weight_version=version if version >= 0 else self.engine.weight_version,
                    trainer_step=ep.phase_step,
                )
        except BaseException:
            ep.grading = None  # a later submit tries again (the final chunk is not published twice)
            raise
        ep.reward = reward
        ep.status = "done"
        ep.last_used = time.monotonic()
        log.info("episode graded", episode=ep.id, trajectory_id=ep.trajectory_id, score=reward.score,
                 turns=ep.turns, segments=cost.segments, template_rerenders=ep.template_rerenders,
                 history_rewrites=ep.history_rewrites)
        return reward
