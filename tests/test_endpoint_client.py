"""The harness-side setting docs/agents.md recommends for the ``openai`` client ("Endpoint
overhead"): the conversation passed through ``extra_body`` (``messages=[]``, ``tools=[]``
as the typed arguments) skips the SDK's client-side request transform, which is most of
the client's CPU per chat request, and sends the very bytes the typed call sends, so the
endpoint reads the same request. If a later ``openai`` release merged ``extra_body``
differently, this fails and the documented setting must change.

Cheap (~1 s, no Kafka, no engine): the real ``openai`` client against a local aiohttp
server that records each request's raw body and answers with the endpoint's own
``completion_body``.
"""

from __future__ import annotations

import json

from aiohttp import web

from sampler.openai_api.protocol import Message, ToolCallMsg, completion_body, parse_chat_request
from sampler.openai_api.server import serve

MODEL = "rollway-test"
BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a bash command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
CONVERSATION = [
    {"role": "system", "content": "You fix code."},
    {"role": "user", "content": [{"type": "text", "text": "Fix `add` in solution.py."}]},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "bash", "arguments": '{"command": "cat solution.py"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "def add(x, y):\n    return x - y\n"},
]


class _Recorder:
    """What ``serve`` needs of an ``EndpointServer``: an aiohttp app (and nothing to close)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.app = web.Application()
        self.app.add_routes([web.post("/v1/chat/completions", self.chat)])

    async def chat(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.read())
        call = ToolCallMsg("bash", '{"command": "python -m pytest -q"}', "call_2")
        return web.json_response(completion_body(
            cid="chatcmpl-1", model=MODEL, message=Message("assistant", "", (call,)), finish_reason="tool_calls",
            prompt_tokens=40, completion_tokens=9, extra={"rollway": {"weight_versions": [0] * 9}}))


async def test_messages_in_extra_body_send_the_same_bytes_as_the_typed_call():
    from openai import AsyncOpenAI

    recorder = _Recorder()
    async with serve(recorder) as url:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        common = dict(model=MODEL, max_tokens=48, temperature=1.0, extra_headers={"X-Rollway-Episode": "ep"})
        typed = await client.chat.completions.create(messages=CONVERSATION, tools=[BASH], **common)
        bypass = await client.chat.completions.create(messages=[], tools=[], **common,
                                                      extra_body={"messages": CONVERSATION, "tools": [BASH]})
        await client.close()

    assert len(recorder.bodies) == 2 and recorder.bodies[0] == recorder.bodies[1]  # byte for byte
    body = json.loads(recorder.bodies[1])
    assert body["messages"] == CONVERSATION and body["tools"] == [BASH]
    request = parse_chat_request(body)  # the endpoint's reading of it
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool"]
    assert request.messages[2].tool_calls == (ToolCallMsg("bash", '{"command": "cat solution.py"}', "call_1"),)
    # The answer reads the same either way (the client's own types).
    assert typed.choices[0].message.model_dump(exclude_none=True) == \
        bypass.choices[0].message.model_dump(exclude_none=True) == {
            "role": "assistant", "content": "", "tool_calls": [{"id": "call_2", "type": "function", "function": {
                "name": "bash", "arguments": '{"command": "python -m pytest -q"}'}}]}
