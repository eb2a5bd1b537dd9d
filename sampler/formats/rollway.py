"""Rollway's own dialect (:mod:`sampler.tool_format`) as a :class:`ChatFormat`, for callers
that speak messages (the OpenAI-compatible endpoint). The agent loop keeps its own
rollway path (:mod:`sampler.agent`), which lays out exactly the same tokens.

The template (``templates.ROLLWAY``) renders a call canonically (``<tool>run\\nCMD</tool>``,
``<tool>read PATH</tool>``, ``<tool>write PATH\\nCONTENT</tool>``, ``<tool>submit</tool>``);
a call spelled otherwise (``<tool>run CMD</tool>``) is read but bridges to a new segment.
"""

from __future__ import annotations

from sampler import tool_format as fmt
from sampler.formats import templates
from sampler.formats.base import CallError, ChatFormat, Family


def _body(_format: ChatFormat, body: str) -> tuple[str, dict]:
    from sampler.tool_calls import ToolCallError, parse_call_body

    try:
        call = parse_call_body(body)
    except ToolCallError as exc:
        raise CallError(str(exc)) from None
    if call.name == "run":
        return "run", {"command": call.arg}
    if call.name == "read":
        return "read", {"path": call.arg}
    if call.name == "write":
        return "write", {"path": call.arg, "content": call.content}
    return call.name, {}


ROLLWAY = Family(
    "rollway", templates.ROLLWAY, (fmt.TOOL_CLOSE, fmt.IM_END), fmt.TOOL_OPEN, fmt.TOOL_CLOSE, body=_body,
    content_call_separator="", append_stable=True)


def rollway_format(tokenizer) -> ChatFormat:
    # The dialect's layout, not the tokenizer's plain ChatML template (it has no tools).
    return ChatFormat(tokenizer, ROLLWAY, chat_template=templates.ROLLWAY)
