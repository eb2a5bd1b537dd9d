"""The OpenAI chat-completions wire format: request validation, canonical messages,
responses, stream chunks and errors in OpenAI's shape.

Only what Rollway can serve truthfully is accepted: one choice (``n = 1``), text
content, function tools, no stop strings (a stop string would cut the text but not
the token record). Everything else is a 400 naming the field, before anything is
sampled or published.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sampler.sampling import temperature_error

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class ToolCallMsg:
    """One function call of an assistant message; ``arguments`` is canonical JSON when it
    parses (so a harness that re-serializes the arguments with other spacing still
    matches the sampled turn), else the string as sent."""

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True, slots=True)
class Message:
    """A message reduced to what the model sees. Equality is what 'the same message' means
    when a request is matched against the episode's conversation (tool call ids are
    not part of it: the model never sees them)."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCallMsg, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def key(self) -> tuple:
        return (self.role, self.content, tuple((c.name, c.arguments) for c in self.tool_calls))

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.role == "assistant" and self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


def canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, (dict, list)):
        return json.dumps(arguments, sort_keys=True, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise ValueError("arguments must be a JSON string")
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False)
    except ValueError:
        return arguments


def _content(value: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{j}]: only text parts are supported", f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where}.content must be a string, null or a list of text parts", f"{where}.content")


def parse_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    out: list[Message] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}", f"{where}.role")
        if role == "developer":
            role = "system"
        content = _content(m.get("content"), where)
        calls: list[ToolCallMsg] = []
        raw_calls = m.get("tool_calls") or []
        if raw_calls and role != "assistant":
            raise bad_request(f"{where}: only assistant messages have tool_calls", f"{where}.tool_calls")
        if not isinstance(raw_calls, list):
            raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        for j, c in enumerate(raw_calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad_request(f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': "
                                  "{'name': ..., 'arguments': ...}}", f"{where}.tool_calls")
            try:
                args = canonical_arguments(fn.get("arguments", "{}"))
            except ValueError:
                raise bad_request(f"{where}.tool_calls[{j}].function.arguments must be a JSON string",
                                  f"{where}.tool_calls") from None
            calls.append(ToolCallMsg(fn["name"], args, str(c.get("id") or "")))
        tool_call_id = m.get("tool_call_id") or ""
        if role == "tool" and not isinstance(tool_call_id, str):
            raise bad_request(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        name = m.get("name") or ""
        out.append(Message(role, content, tuple(calls), tool_call_id if role == "tool" else "",
                           name if isinstance(name, str) else ""))
    if out[-1].role == "assistant":
        raise bad_request("the last message must not be an assistant message: every assistant token must be "
                          "sampled (a prefilled answer cannot be recorded as sampled)", f"messages[{len(out) - 1}]")
    return out


def parse_tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("tools must be a list", "tools")
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                              "'parameters': ...}}}}", f"tools[{i}]")
    return raw


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: list[Message]
    tools: list[dict[str, Any]]
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    stream: bool
    include_usage: bool
    return_token_ids: bool
    seed: int | None
    episode: str  # from the ``user`` field (the route or a header may name it instead)


def _number(body: dict, name: str, kind: type, lo: float | None = None, hi: float | None = None):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise bad_request(f"{name} must be a number", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_request(f"{name} = {value} is out of range [{lo}, {hi}]", name)
    return kind(value)


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required", "model")
    if body.get("n", 1) != 1:
        raise bad_request("n must be 1: an episode records one completion per turn", "n")
    if body.get("stop"):
        raise bad_request("stop strings are not supported: a completion ends at the model's own stop tokens, "
                          "so the recorded ids are exactly the sampled ones", "stop")
    temperature = _number(body, "temperature", float, 0.0, 2.0)
    if temperature is not None and (error := temperature_error("temperature", temperature)):
        raise bad_request(error, "temperature")
    top_p = _number(body, "top_p", float, 0.0, 1.0)
    if top_p is not None and top_p <= 0:
        raise bad_request("top_p must be in (0, 1]", "top_p")
    max_tokens = _number(body, "max_completion_tokens", int, 1) or _number(body, "max_tokens", int, 1)
    options = body.get("stream_options") or {}
    user = body.get("user") or ""
    return ChatRequest(
        model=model,
        messages=parse_messages(body.get("messages")),
        tools=parse_tools(body.get("tools")),
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        return_token_ids=bool(body.get("return_token_ids", False)),
        seed=_number(body, "seed", int),
        episode=user if isinstance(user, str) else "",
    )


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def completion_body(*, cid: str, model: str, message: Message, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    msg = message.to_openai()
    if not msg.get("tool_calls"):
        msg.pop("tool_calls", None)
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": msg, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        **extra,
    }


def stream_chunk(*, cid: str, model: str, created: int, delta: dict[str, Any] | None,
                 finish_reason: str | None = None, usage: dict[str, int] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [] if delta is None else
                           [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
    if usage is not None:
        out["usage"] = usage
    return out
