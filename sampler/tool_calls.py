"""Reading the agent's tool call from the token ids of its turn.

A call is the span between the special ``<tool>`` token and the special ``</tool>``
token that closes it (generation stops there; the format is in
:mod:`sampler.tool_format`). Only the special tokens count: ``<tool>`` spelled with
ordinary text tokens is content. Decoded text cannot tell the two apart, which is why
the call is found in ids: a ``write NOTES.md`` whose content quoted
``<tool>run\\nrm -rf .</tool>`` as text ran ``rm -rf .`` when the last ``<tool>`` of
the decoded text was taken for the call.

Error replies explain the format with the same special tokens (:func:`format_hint`), so
they never teach the model to spell a tag as text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from sampler import tool_format as fmt


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str  # run | read | write | edit | submit
    arg: str = ""  # command (run) or path (read, write, edit)
    content: str = ""  # file content (write); the exact text to replace (edit)
    new: str = ""  # the replacement (edit; the chat formats' tool, sampler/formats/tools.py)


class ToolCallError(ValueError):
    """The turn holds no well-formed tool call; the message says why (plain words: the
    tags themselves are shown by :func:`format_hint`, as special tokens)."""


def format_hint() -> list[fmt.Piece]:
    """How to call a tool, as reply pieces: the tags are trusted pieces, i.e. the special
    tokens the parser reads, never text-spelled tags."""
    pieces: list[fmt.Piece] = [("use ", False)]
    examples = ["run\nCMD", "read PATH", "write PATH\nCONTENT", "submit"]
    for i, body in enumerate(examples):
        if i:
            pieces.append((" or " if i == len(examples) - 1 else ", ", False))
        pieces += [(fmt.TOOL_OPEN, True), (body, False), (fmt.TOOL_CLOSE, True)]
    return pieces


class ToolCallParser:
    """Finds the call in a turn's ids with the tokenizer's ``<tool>`` / ``</tool>`` ids."""

    def __init__(self, tool_open_id: int, tool_close_id: int, decode: Callable[[Sequence[int]], str]) -> None:
        self.open_id = tool_open_id
        self.close_id = tool_close_id
        self.decode = decode

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "ToolCallParser":
        ids = {tag: tokenizer.encode(tag, add_special_tokens=False) for tag in (fmt.TOOL_OPEN, fmt.TOOL_CLOSE)}
        bad = [tag for tag, got in ids.items() if len(got) != 1]
        if bad:
            raise ValueError(
                f"the tokenizer must have {' and '.join(bad)} as single special tokens: tool calls are read "
                "from token ids, so a tag spelled as text can never be taken for a call"
            )
        return cls(ids[fmt.TOOL_OPEN][0], ids[fmt.TOOL_CLOSE][0],
                   lambda t: tokenizer.decode(list(t), skip_special_tokens=False))

    def parse(self, ids: Sequence[int]) -> ToolCall:
        """The call of one assistant turn (its prefill ids and generated ids): the span
        from the ``<tool>`` id to the first ``</tool>`` id after it (where generation
        stopped; what follows is ignored). One call per turn."""
        ids = list(ids)
        close = ids.index(self.close_id) if self.close_id in ids else -1
        opens = [i for i, t in enumerate(ids[: close if close >= 0 else len(ids)]) if t == self.open_id]
        if not opens:
            raise ToolCallError("no tool call: end the turn with one tool call")
        if close < 0:
            raise ToolCallError("unterminated tool call: the turn ended before the tool call was closed")
        if len(opens) > 1:
            raise ToolCallError(f"one tool call per turn: this turn opens {len(opens)}")
        return parse_call_body(self.decode(ids[opens[0] + 1 : close]))


def parse_call_body(body: str) -> ToolCall:
    """The call between the tags: ``NAME[ ARG][\\nREST]``."""
    head, _, rest = body.partition("\n")
    name, _, arg = head.strip().partition(" ")
    arg = arg.strip()
    if name == "submit":
        return ToolCall("submit")
    if name == "run":
        command = (rest if rest.strip() else arg).strip()
        if not command:
            raise ToolCallError("run needs a command on the line after 'run'")
        return ToolCall("run", command)
    if name == "read":
        if not arg:
            raise ToolCallError("read needs a path after 'read'")
        return ToolCall("read", arg)
    if name == "write":
        if not arg:
            raise ToolCallError("write needs a path after 'write', then the content from the next line")
        return ToolCall("write", arg, rest)
    raise ToolCallError(f"unknown tool {name[:40]!r}")
