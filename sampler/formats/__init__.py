"""Model formats (``sampler.format``): how a model family's prompts are rendered, how its
tool calls are read from token ids, and how a rollout stays token-exact across turns.

    fmt = load_format(tokenizer, "auto")        # or rollway | chatml-hermes | qwen3 | qwen3-coder | llama3-json
    start = fmt.render(messages, TOOL_SCHEMAS)  # Render(ids, text): a segment's start
    turn = fmt.parse_turn(sampled_ids, truncated=...)
    messages += [fmt.assistant_message(turn), fmt.tool_message(call.id, call.name, output)]
    nxt = fmt.bridge(start, sampled_ids, messages, TOOL_SCHEMAS)   # ids to append, or None: new segment

See :mod:`sampler.formats.base` for the rules, docs/sampler.md ("Model formats").
"""

from __future__ import annotations

from pathlib import Path

from sampler.formats import templates
from sampler.formats.base import (
    CallError, ChatFormat, Family, FormatError, ParsedCall, ParsedTurn, Render, json_body, llama_body, qwen3_xml_body,
)
from sampler.formats.tools import TOOL_NAMES, TOOL_SCHEMAS, apply_edit, check_call

FORMATS = ("rollway", "chatml-hermes", "qwen3", "qwen3-coder", "llama3-json")

FAMILIES: dict[str, Family] = {
    "chatml-hermes": Family(
        "chatml-hermes", templates.QWEN25, ("<|im_end|>", "<|endoftext|>"), "<tool_call>", "</tool_call>",
        body=json_body, append_stable=True),
    # Qwen3 with thinking; its template drops the reasoning of turns before the last user query.
    "qwen3": Family(
        "qwen3", templates.QWEN3, ("<|im_end|>", "<|endoftext|>"), "<tool_call>", "</tool_call>",
        think_open="<think>", think_close="</think>", body=json_body, template_kwargs={"enable_thinking": True},
        append_stable=True, history_roles=("user", "system")),
    "qwen3-coder": Family(
        "qwen3-coder", templates.QWEN3_CODER, ("<|im_end|>", "<|endoftext|>"), "<tool_call>", "</tool_call>",
        body=qwen3_xml_body, content_call_separator="\n\n", append_stable=True),
    "llama3-json": Family(
        "llama3-json", templates.LLAMA3_JSON, ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
        whole_turn_call=True, whole_turn_prefix="<|python_tag|>", body=llama_body, content_call_separator="",
        append_stable=True),
}


def detect(tokenizer, model_path: str | Path | None = None) -> str:
    """The format a tokenizer (and its model folder) speaks, from its added tokens and
    chat template."""
    added = set(tokenizer.get_added_vocab())
    template = getattr(tokenizer, "chat_template", None) or ""
    if model_path is not None and not template:
        path = Path(model_path) / "chat_template.jinja"
        template = path.read_text() if path.exists() else ""
    if {"<tool>", "</tool>"} <= added:
        return "rollway"
    if {"<tool_call>", "</tool_call>"} <= added:
        if "<function=" in template or "<parameter=" in template:
            return "qwen3-coder"
        if "<think>" in added and ("reasoning_content" in template or "<think>" in template):
            return "qwen3"
        return "chatml-hermes"
    if {"<|start_header_id|>", "<|eot_id|>"} <= added:
        return "llama3-json"
    raise FormatError(
        "sampler.format = 'auto' cannot tell this model's format: its tokenizer has none of <tool>/</tool> (rollway), "
        "<tool_call>/</tool_call> (chatml-hermes, qwen3, qwen3-coder) or <|start_header_id|>/<|eot_id|> (llama3-json); "
        f"set sampler.format to one of {', '.join(FORMATS)}")


def load_format(tokenizer, name: str = "auto", model_path: str | Path | None = None) -> ChatFormat:
    """The :class:`ChatFormat` ``name`` on ``tokenizer`` (``auto``: :func:`detect`)."""
    if name == "auto":
        name = detect(tokenizer, model_path)
    if name == "rollway":
        from sampler.formats.rollway import rollway_format

        return rollway_format(tokenizer)
    if name not in FAMILIES:
        raise FormatError(f"unknown sampler.format {name!r}; use auto or one of {', '.join(FORMATS)}")
    return ChatFormat(tokenizer, FAMILIES[name])


__all__ = [
    "CallError", "ChatFormat", "FAMILIES", "FORMATS", "Family", "FormatError", "ParsedCall", "ParsedTurn", "Render",
    "TOOL_NAMES", "TOOL_SCHEMAS", "apply_edit", "check_call", "detect", "load_format",
]
