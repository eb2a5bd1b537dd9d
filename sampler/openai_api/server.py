"""The HTTP side of the endpoint (aiohttp): OpenAI's chat-completions routes and
Rollway's episode routes (docs/agents.md).

* ``GET  /v1/models``; ``POST /v1/chat/completions`` (the episode named by the
  ``X-Rollway-Episode`` header or the ``user`` field), also under an episode's own base
  URL ``/v1/rollway/episodes/{id}/v1`` (for harnesses that take only a base URL);
* ``POST /v1/rollway/episodes`` (bind a task sample and a sandbox session),
  ``GET /v1/rollway/episodes/{id}``, ``POST .../exec`` (a command in the episode's
  sandbox session), ``POST .../submit`` (grade), ``DELETE`` (abandon).

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import msgspec
import structlog
from aiohttp import web

from sampler.openai_api.episodes import Episode, EpisodeRegistry, EpisodeSpec, Turn
from sampler.openai_api.protocol import (ApiError, ChatRequest, bad_request, completion_body, new_completion_id,
                                         parse_chat_request, stream_chunk)

log = structlog.get_logger(__name__)

EPISODE_HEADER = "X-Rollway-Episode"


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = ApiError(exc.status, exc.reason or "error", code="not_found" if exc.status == 404 else None)
        return web.json_response(err.body(), status=exc.status)
    except Exception as exc:  # noqa: BLE001 - every answer is OpenAI-shaped
        log.exception("endpoint request failed", path=request.path)
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return web.json_response(err.body(), status=500)


async def _json(request: web.Request) -> Any:
    try:
        return await request.json(loads=json.loads)
    except ValueError as exc:
        raise bad_request(f"the body is not JSON: {exc}") from None


class EndpointServer:
    """The aiohttp application over an :class:`EpisodeRegistry`."""

    def __init__(self, registry: EpisodeRegistry, model_name: str, *, reap_period_s: float = 30.0) -> None:
        self.registry = registry
        self.model_name = model_name
        self.reap_period_s = reap_period_s
        tok = registry.engine.tokenizer
        # Streamed text stops at the first added token (a call, a thinking block, the end):
        # what follows is the format's to read (Qwen's <tool_call> is added but not special).
        self.control_ids = set(getattr(tok, "all_special_ids", [])) | set(tok.get_added_vocab().values())
        self._reaper: asyncio.Task | None = None
        self.app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
        base = "/v1/rollway/episodes/{id}"
        self.app.add_routes([
            web.get("/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat),
            web.get(base + "/v1/models", self.models),
            web.post(base + "/v1/chat/completions", self.chat),
            web.post("/v1/rollway/episodes", self.create_episode),
            web.get(base, self.get_episode),
            web.post(base + "/exec", self.exec),
            web.post(base + "/submit", self.submit),
            web.delete(base, self.delete_episode),
            web.get("/health", self.health),
        ])
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)

    async def _on_startup(self, app: web.Application) -> None:
        self._reaper = asyncio.create_task(self._reap())

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.registry.close()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.reap_period_s)
            with contextlib.suppress(Exception):
                await self.registry.reap_idle()

    # -- OpenAI ------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollway"}]})

    def _episode_of(self, request: web.Request, req: ChatRequest) -> Episode:
        named = request.match_info.get("id") or request.headers.get(EPISODE_HEADER) or req.episode
        if not named:
            raise bad_request(f"no episode: use the episode's base URL (/v1/rollway/episodes/ID/v1), the "
                              f"{EPISODE_HEADER} header or the user field", "user", code="episode_required")
        return self.registry.get(named)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat_request(await _json(request))
        if req.model != self.model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this endpoint serves {self.model_name!r}",
                           param="model", code="model_not_found")
        ep = self._episode_of(request, req)
        if req.stream:
            return await self._stream(request, ep, req)
        turn = await self.registry.complete(ep, req)
        body = completion_body(
            cid=new_completion_id(), model=self.model_name, message=turn.message, finish_reason=turn.finish_reason,
            prompt_tokens=len(turn.prompt_ids), completion_tokens=len(turn.generated), extra=self._extra(ep, turn))
        if turn.reasoning:
            body["choices"][0]["message"]["reasoning_content"] = turn.reasoning
        if req.return_token_ids:  # vLLM's extension: the prompt's and the completion's token ids
            body["prompt_token_ids"] = turn.prompt_ids
            body["choices"][0]["token_ids"] = turn.generated
        return web.json_response(body)

    def _extra(self, ep: Episode, turn: Turn) -> dict[str, Any]:
        """Rollway's extension of a completion: where the turn went in the record."""
        return {"rollway": {
            "episode": ep.id, "trajectory_id": ep.trajectory_id, "segment_index": ep.recorder.segment_index,
            "new_segment": turn.new_segment, "weight_versions": turn.versions, "status": ep.status}}

    async def _stream(self, request: web.Request, ep: Episode, req: ChatRequest) -> web.StreamResponse:
        """SSE: content as it is sampled (up to the turn's first special token), then the
        rest of the parsed content and the tool calls, the finish reason and usage."""
        cid, created, model = new_completion_id(), int(time.time()), self.model_name
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        tok = self.registry.engine.tokenizer
        ids: list[int] = []
        state = {"streamed": "", "open": True}
        wake = asyncio.Event()

        async def send(payload: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        async def on_start() -> None:
            await resp.prepare(request)
            await send(stream_chunk(cid=cid, model=model, created=created, delta={"role": "assistant", "content": ""}))

        def on_token(token_id: int) -> None:
            if state["open"]:
                if token_id in self.control_ids:
                    state["open"] = False
                else:
                    ids.append(token_id)
            wake.set()

        async def flush_text() -> None:
            # Trailing whitespace waits for more text: the format may strip it (Qwen's
            # "content\n<tool_call>"), and a streamed character cannot be taken back.
            text = tok.decode(ids, skip_special_tokens=False).rstrip()
            if text.endswith("\ufffd"):  # a character cut between two tokens: wait for the rest
                return
            if len(text) > len(state["streamed"]) and text.startswith(state["streamed"]):
                delta = text[len(state["streamed"]):]
                state["streamed"] = text
                await send(stream_chunk(cid=cid, model=model, created=created, delta={"content": delta}))

        work = asyncio.create_task(self.registry.complete(ep, req, on_start=on_start, on_token=on_token))
        try:
            while not work.done():
                waiter = asyncio.create_task(wake.wait())
                await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                wake.clear()
                if resp.prepared and not work.done():
                    await flush_text()
            turn = work.result()  # a refusal before on_start raises here: an ordinary JSON error
        except BaseException:
            if not work.done():
                work.cancel()
            raise
        streamed = state["streamed"]
        content = turn.message.content
        if not content.startswith(streamed):
            log.warning("streamed content differs from the parsed turn", episode=ep.id, streamed=streamed[-80:],
                        content=content[-80:])
        rest = content[len(streamed):] if content.startswith(streamed) else ""
        if turn.reasoning:
            await send(stream_chunk(cid=cid, model=model, created=created, delta={"reasoning_content": turn.reasoning}))
        if rest:
            await send(stream_chunk(cid=cid, model=model, created=created, delta={"content": rest}))
        for i, call in enumerate(turn.message.tool_calls):
            await send(stream_chunk(cid=cid, model=model, created=created, delta={"tool_calls": [{
                "index": i, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]}))
        last = stream_chunk(cid=cid, model=model, created=created, delta={}, finish_reason=turn.finish_reason)
        last.update(self._extra(ep, turn))
        if req.return_token_ids:
            last["prompt_token_ids"] = turn.prompt_ids
            last["choices"][0]["token_ids"] = turn.generated
        await send(last)
        if req.include_usage:
            usage = {"prompt_tokens": len(turn.prompt_ids), "completion_tokens": len(turn.generated),
                     "total_tokens": len(turn.prompt_ids) + len(turn.generated)}
            await send(stream_chunk(cid=cid, model=model, created=created, delta=None, usage=usage))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- episodes ----------------------------------------------------------------------------
    async def create_episode(self, request: web.Request) -> web.Response:
        body = await _json(request)
        try:
            spec = msgspec.convert(body, EpisodeSpec, strict=False)
        except msgspec.ValidationError as exc:
            raise bad_request(f"episode: {exc}") from None
        ep = await self.registry.create(spec)
        out = ep.describe()
        out["base_url"] = f"{request.scheme}://{request.host}/v1/rollway/episodes/{ep.id}/v1"
        out["model"] = self.model_name
        return web.json_response(out, status=201)

    async def get_episode(self, request: web.Request) -> web.Response:
        return web.json_response(self.registry.get(request.match_info["id"]).describe())

    async def exec(self, request: web.Request) -> web.Response:
        ep = self.registry.get(request.match_info["id"])
        body = await _json(request)
        command = body.get("command") if isinstance(body, dict) else None
        timeout = body.get("timeout_s") if isinstance(body, dict) else None
        if not isinstance(command, str) or not command:
            raise bad_request("command must be a non-empty string", "command")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise bad_request("timeout_s must be a positive number", "timeout_s")
        result = await self.registry.exec(ep, command, timeout)
        return web.json_response(msgspec.to_builtins(result))

    async def submit(self, request: web.Request) -> web.Response:
        ep = self.registry.get(request.match_info["id"])
        body = await _json(request) if request.can_read_body else {}
        reason = (body or {}).get("finish_reason", "submitted") if isinstance(body, dict) else "submitted"
        if not isinstance(reason, str) or not reason or len(reason) > 64:
            raise bad_request("finish_reason must be a short string", "finish_reason")
        try:
            reward = await self.registry.submit(ep, reason)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - the sandbox failed to grade: the harness may retry
            raise ApiError(502, f"grading failed: {exc}", type="sandbox_error", code="grading_failed") from None
        out = ep.describe()
        out["reward"] = msgspec.to_builtins(reward)
        return web.json_response(out)

    async def delete_episode(self, request: web.Request) -> web.Response:
        ep = self.registry.get(request.match_info["id"])
        await self.registry.abandon(ep)
        return web.json_response(ep.describe())

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "episodes": len(self.registry.episodes),
                                  "weight_version": self.registry.engine.weight_version})


@contextlib.asynccontextmanager
async def serve(server: EndpointServer, host: str = "127.0.0.1", port: int = 0):
    """Serve ``server`` on ``host:port`` (0 = a free port); yields the base URL."""
    runner = web.AppRunner(server.app)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    try:
        yield f"http://{bound_host}:{bound_port}"
    finally:
        await runner.cleanup()
