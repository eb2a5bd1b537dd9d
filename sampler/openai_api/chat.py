"""The endpoint's view of a model format (``sampler.formats.ChatFormat``) and the
conversions between OpenAI messages and what a format renders.

A format gives: ``render(messages, tools) -> Render`` (a new segment's prompt, from the
tokenizer's own chat template), ``bridge(prefix, sampled_ids, messages, tools) ->
Render | None`` (the ids to append after a sampled turn, or None when equality with the
template's whole render cannot be shown), ``parse_turn(ids, truncated=) -> ParsedTurn``
(content, reasoning and calls read at the family's special-token boundaries),
``assistant_message(turn)`` (the sampled turn as the template wants it) and
``stop_token_ids``.
"""

from __future__ import annotations

from typing import Any, Sequence

from sampler.openai_api.protocol import Message, ToolCallMsg, canonical_arguments, new_tool_call_id


def load_endpoint_format(tokenizer, name: str = "auto", model_path: str | None = None):
    from sampler.formats import load_format

    return load_format(tokenizer, name=name, model_path=model_path)


def template_message(m: Message, sampled: dict[tuple, dict[str, Any]]) -> dict[str, Any]:
    """An OpenAI message as a chat template takes it: an assistant turn this episode
    sampled is the format's own rendering of it (reasoning included), others carry
    their arguments as dicts (templates serialize them with ``tojson``)."""
    if m.role == "assistant":
        return sampled[m.key()]
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
        if m.name:
            out["name"] = m.name
    return out


def template_messages(messages: Sequence[Message], sampled: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    return [template_message(m, sampled) for m in messages]


def message_from_assistant(rendered: dict[str, Any]) -> Message:
    """The format's record of a sampled turn (``ChatFormat.assistant_message``) as an
    OpenAI assistant message: what the harness gets and must send back unchanged. A turn
    whose call did not parse is its whole text as content, so the conversation renders
    what was sampled. Call ids are fresh per turn (the model never sees them)."""
    calls = tuple(ToolCallMsg(c["function"]["name"], canonical_arguments(c["function"]["arguments"]),
                              new_tool_call_id())
                  for c in rendered.get("tool_calls") or [])
    return Message("assistant", rendered.get("content") or "", calls)
