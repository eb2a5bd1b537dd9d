"""Reference transcripts in a chat format, for the warm start (trainer/warm_start.py) and
the tiny model's corpus (sampler/tiny_model.py).

A transcript is exactly the token stream :mod:`sampler.chat_loop` builds for a rollout
that takes the reference actions (read the files of a fix task, write the solution,
submit): the template's render of the task (tools as JSON schemas), then per turn the
model's canonical call text up to its end-of-turn token (policy, loss mask 1) and the
bridge to the next generation prompt (environment, mask 0).
"""

from __future__ import annotations

from typing import Any

from sampler.formats.base import ChatFormat
from sampler.formats.tools import TOOL_SCHEMAS


def spec_text(spec) -> str:
    """The task's user message (as :func:`sampler.chat_loop.task_text` writes it)."""
    listing = "\nFiles: " + ", ".join(sorted(spec.files)) if spec.files else ""
    return spec.instruction + listing


def reference_calls(spec) -> list[tuple[str, dict[str, Any], str | None]]:
    """(tool, arguments, reply) of the reference rollout; the last reply is None."""
    calls: list[tuple[str, dict[str, Any], str | None]] = []
    if spec.metadata.get("kind") == "fix":
        for path, content in spec.files.items():
            calls.append(("read", {"path": path}, content))
    for path, content in spec.solution.items():
        calls.append(("write", {"path": path, "content": content}, f"wrote {path} ({len(content.encode())} bytes)"))
    calls.append(("submit", {}, None))
    return calls


def _assistant(name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}]}


def _turn_text(fmt: ChatFormat, conversation: list[dict], assistant: dict, prefix_text: str) -> str:
    text = fmt.render_text(conversation + [assistant], TOOL_SCHEMAS, add_generation_prompt=False)
    if not text.startswith(prefix_text):
        raise ValueError(f"format {fmt.name!r}: the template renders the assistant turn over its generation prompt")
    turn = text[len(prefix_text):]
    end = min((turn.index(t) + len(t) for t in fmt.family.end_tokens if t in turn), default=len(turn))
    return turn[:end]


def name_offset(turn_text: str, name: str) -> int:
    """Character offset of the tool's name in a canonical call text."""
    for marker in (f'"name": "{name}"', f"<function={name}>", f"<tool>{name}"):
        at = turn_text.find(marker)
        if at >= 0:
            return at + marker.index(name)
    raise ValueError(f"no call of {name} in {turn_text[:80]!r}")


def token_at(fmt: ChatFormat, ids: list[int], offset: int) -> int:
    """Index of the token whose text covers character ``offset`` of ``decode(ids)``."""
    for k in range(len(ids)):
        if len(fmt.tokens.decode(ids[: k + 1])) > offset:
            return k
    raise ValueError("offset past the end of the ids")


def render_chat_transcript(spec, fmt: ChatFormat) -> tuple[list[int], list[int], int]:
    """(ids, loss mask, index of the first action's name token) of the reference rollout."""
    conversation = [fmt.user_message(spec_text(spec))]
    start = fmt.render(conversation, TOOL_SCHEMAS)
    ids, mask, prefix = list(start.ids), [0] * len(start.ids), start
    first = -1
    for name, arguments, reply in reference_calls(spec):
        assistant = _assistant(name, arguments)
        text = _turn_text(fmt, conversation, assistant, prefix.text)
        policy = fmt.tokens.encode(text)
        if first < 0:
            first = len(ids) + token_at(fmt, policy, name_offset(text, name))
        ids += policy
        mask += [1] * len(policy)
        if reply is None:
            break
        conversation += [fmt.assistant_message(fmt.parse_turn(policy)), fmt.tool_message("call_0", name, reply)]
        bridge = fmt.bridge(prefix, policy, conversation, TOOL_SCHEMAS)
        if bridge is None:
            raise ValueError(f"format {fmt.name!r}: a reference turn does not bridge ({text[:60]!r})")
        ids += bridge.ids
        mask += [0] * len(bridge.ids)
        prefix = bridge
    return ids, mask, first


def chat_transcript_text(spec, fmt_text) -> str:
    """The transcript as text (for training a tokenizer before one exists):
    ``fmt_text(messages, add_generation_prompt)`` renders with the family's template."""
    conversation = [{"role": "user", "content": spec_text(spec).strip()}]
    for name, arguments, reply in reference_calls(spec):
        conversation.append(_assistant(name, arguments))
        if reply is not None:
            conversation.append({"role": "tool", "tool_call_id": "call_0", "name": name, "content": reply})
    return fmt_text(conversation, False)


def submit_token(fmt: ChatFormat) -> int:
    """The token a submit call has where the first action's name starts; distinct from a
    write's and a read's (else the premature-submit target is not one token)."""
    firsts = {}
    for name, args in (("submit", {}), ("write", {"path": "a.py", "content": "x"}), ("read", {"path": "a.py"})):
        conversation = [fmt.user_message("x")]
        prefix = fmt.render(conversation, TOOL_SCHEMAS)
        text = _turn_text(fmt, conversation, _assistant(name, args), prefix.text)
        policy = fmt.tokens.encode(text)
        firsts[name] = policy[token_at(fmt, policy, name_offset(text, name))]
    if firsts["submit"] in (firsts["write"], firsts["read"]):
        raise ValueError("the tokenizer starts submit like write or read: no distinct first action token")
    return firsts["submit"]
