"""A model family's chat format: prompts from the tokenizer's own chat template, tool
calls read from a turn's token ids, and the incremental "bridge" that keeps a rollout
token-exact across turns.

Rendering: ``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True)``
as text, tokenized as transformers does it (``add_special_tokens=False``). Untrusted
message text (tool output, task text) that spells an added token (``<tool_call>``,
``<|im_end|>``) is tokenized with that token split into ordinary tokens, so a file can
never inject a control token (:func:`_Tokens.untrusted`).

The bridge: after the model sampled a turn, the environment's new messages are appended
as the ids that make ``prefix + sampled + bridge`` render the whole conversation:
``text(prefix) + decode(sampled) + text(bridge)`` must equal the template's text of the
whole conversation, and the bridge must start at an added-token boundary (the sampled
end-of-turn token, or an added token that opens the bridge). Tokenizers split text at
added tokens before anything else, so the bridge's ids are then exactly the template's
own ids for that part, and the sampled ids are kept as sampled (never re-tokenized).
Where the equality fails (the template rewrote history: Qwen3 drops earlier reasoning
after a new user query; the model's call was not in the template's canonical spelling;
a turn cut inside a UTF-8 character), ``bridge`` returns None and the caller starts a new
segment with a fresh full render (counted as a template re-render).

Incremental bridge: rendering the whole conversation each turn costs time that grows with
the conversation (Jinja's sandbox walks every message: ~2 ms at 20 turns, per turn). For
a template known to be *append-stable* (appending messages after the sampled turn never
changes how earlier messages render: the families' templates as published here, Qwen3's
only while no new user query arrives) the bridge renders a constant-size window instead:
the head (system and first user message: what the template puts in its system part), the
message before the sampled turn, the sampled turn and the new messages. The window's
render must start with the window's own prompt followed by the sampled text (the same
prefix-equality check, on the window), else None (counted). The segment's cached text is
reused, never re-rendered. A template that is not one of these (a model's own template
that differs from the family's published one, e.g. a real Qwen3-Coder's unsimplified
one) keeps the full render and the whole-text check.

Tool calls: only the family's special-token ids delimit a call (``<tool_call>`` ...
``</tool_call>``; for Llama 3 JSON the whole turn); text between them goes to the
family's body parser (vLLM's for Qwen3-Coder's XML, strict JSON with a reason for the
JSON families). A call spelled as text inside file content or a string is content.
A malformed call is an error sentence in :class:`ParsedTurn`, never an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


class FormatError(ValueError):
    """A tokenizer or setting that cannot serve a format (clear message)."""


class CallError(ValueError):
    """A tool call's body that cannot be read (the message is the reply's sentence)."""


@dataclass(frozen=True, slots=True)
class Render:
    """Token ids and the template text they stand for; ``messages``: how many messages
    of the conversation the text renders (-1: unknown, the next bridge renders it all)."""

    ids: list[int]
    text: str
    messages: int = -1


@dataclass(frozen=True, slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    content: str  # the message's text outside reasoning and calls (as the template renders it)
    reasoning: str | None  # the thinking block's text (families with one), None when absent
    calls: list[ParsedCall] = field(default_factory=list)
    error: str | None = None  # why the turn's call(s) could not be read
    text: str = ""  # the whole turn decoded, without its end-of-turn token


@dataclass(frozen=True)
class Family:
    """What differs between model families (the rest is the tokenizer's template)."""

    name: str
    template: str  # used when the tokenizer brings no chat template
    end_tokens: tuple[str, ...]  # end-of-turn tokens (stops); the first present must exist
    call_open: str | None = None  # special token opening a call
    call_close: str | None = None
    think_open: str | None = None
    think_close: str | None = None
    # The call is the whole turn (Llama 3 JSON), optionally after this token.
    whole_turn_call: bool = False
    whole_turn_prefix: str | None = None
    body: Callable[["ChatFormat", str], tuple[str, dict[str, Any]]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Roles whose content is untrusted text (tokenized with added tokens split).
    untrusted_roles: tuple[str, ...] = ("user", "tool", "system")
    # Strip this many trailing newlines of the content before the first call (the
    # template puts them back): Qwen's "content\n<tool_call>".
    content_call_separator: str = "\n"
    # The family's template (``template``) never re-renders earlier messages when messages
    # are appended after a sampled turn, except when a new message has one of
    # ``history_roles`` (Qwen3: a new user query drops earlier reasoning): the bridge may
    # render only a window (see the module docstring). Holds for ``template`` only.
    append_stable: bool = False
    history_roles: tuple[str, ...] = ()


class _Tokens:
    """Tokenization as the chat template path does it, plus untrusted text."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        added = {t: i for t, i in tokenizer.get_added_vocab().items() if t}
        self.added = added
        self.added_ids = frozenset(added.values())
        self._pattern = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))) if added else None
        self._raw = None
        self._raw = self._raw_encoder()

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._raw is not None:
            return self._raw.encode(text, add_special_tokens=False).ids
        return self.tok.encode(text, add_special_tokens=False)

    def _raw_encoder(self):
        """The fast tokenizer's Rust ``Tokenizer`` when it encodes exactly as the wrapper does
        (checked on text with added tokens): one call per turn instead of transformers'
        batch path, which releases the GIL and, beside vLLM's step thread, waits up to a
        switch interval to get it back."""
        raw = getattr(self.tok, "_tokenizer", None)
        if raw is None or not callable(getattr(raw, "encode", None)):
            return None
        probe = "".join(f"a {t}\n b" for t in sorted(self.added)) + " def f(x):\n    return x  # \u00e9\u4e2d"
        try:
            same = raw.encode(probe, add_special_tokens=False).ids == self.tok.encode(probe, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - any mismatch in API: keep the wrapper
            return None
        return raw if same else None

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def holds_added(self, text: str) -> bool:
        return bool(self._pattern and self._pattern.search(text))

    def starts_with_added(self, text: str) -> bool:
        return bool(self._pattern and self._pattern.match(text))

    def untrusted(self, text: str) -> list[int]:
        """``text`` with every added-token spelling split into ordinary tokens."""
        if not self.holds_added(text):
            return self.encode(text)
        out: list[int] = []
        pos = 0
        for m in self._pattern.finditer(text):
            out += self.encode(text[pos:m.start()])
            s = m.group(0)
            out += self.encode(s[0]) + self.untrusted(s[1:])
            pos = m.end()
        return out + self.encode(text[pos:])


_SENTINEL = "\u27e6rollway-untrusted-{}\u27e7"


class ChatFormat:
    """One model family on one tokenizer (``sampler.formats.load_format`` picks it)."""

    def __init__(self, tokenizer, family: Family, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.name = family.name
        self.template = chat_template or getattr(tokenizer, "chat_template", None) or family.template
        self.tokens = _Tokens(tokenizer)
        added = self.tokens.added

        def need(tag: str | None, what: str) -> int | None:
            if tag is None:
                return None
            if tag not in added:
                raise FormatError(f"format {family.name!r}: the tokenizer has no {tag} token ({what}); tool calls are "
                                  "read from token ids, so it must be one added token; pick the model's format with "
                                  "sampler.format")
            return added[tag]

        self.call_open_id = need(family.call_open, "opens a tool call")
        self.call_close_id = need(family.call_close, "closes a tool call")
        self.think_open_id = need(family.think_open, "opens reasoning")
        self.think_close_id = need(family.think_close, "closes reasoning")
        self.whole_turn_prefix_id = added.get(family.whole_turn_prefix) if family.whole_turn_prefix else None
        ends = [added[t] for t in family.end_tokens if t in added]
        if not ends:
            raise FormatError(f"format {family.name!r}: the tokenizer has none of the end-of-turn tokens "
                              f"{', '.join(family.end_tokens)}")
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ends + ([eos] if isinstance(eos, int) else [])))
        self._vllm_parser = None
        # The window bridge only for the family's own (checked) template.
        self.incremental = family.append_stable and self.template.strip() == family.template.strip()
        # How many bridges took each path (benchmarks and tests read them).
        self.bridges = {"window": 0, "full": 0}

    def __repr__(self) -> str:
        return f"ChatFormat({self.name!r})"

    # -- rendering --------------------------------------------------------------------------
    def render_text(self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, chat_template=self.template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **self.family.template_kwargs)

    def render(self, messages: list[dict], tools: list[dict] | None) -> Render:
        """The whole conversation and the generation prompt (a segment's start)."""
        text = self.render_text(messages, tools)
        ids = self._tokenize(messages, tools, text, 0)
        if ids is None:
            # The template changed untrusted content that spells an added token (trim,
            # split): render it with those spellings broken instead.
            safe = [dict(m, content=self._break_added(m["content"])) if i in self._risky(messages) else m
                    for i, m in enumerate(messages)]
            text = self.render_text(safe, tools)
            ids = self.tokens.encode(text)
        return Render(ids, text, len(messages))

    def _break_added(self, text: str) -> str:
        return self.tokens._pattern.sub(lambda m: m.group(0)[0] + "\u200b" + m.group(0)[1:], text)

    def _risky(self, messages: list[dict]) -> list[int]:
        roles = self.family.untrusted_roles
        return [i for i, m in enumerate(messages)
                if m.get("role") in roles and isinstance(m.get("content"), str) and self.tokens.holds_added(m["content"])]

    def _tokenize(self, messages: list[dict], tools, text: str, start: int) -> list[int] | None:
        """Ids of ``text[start:]`` (``text``: the render of ``messages``): the template's
        own tokenization, except that untrusted content spelling an added token has it
        split (rendered with sentinels in its place, each piece tokenized on its own).
        None when the template does not render such content verbatim."""
        risky = self._risky(messages)
        if not risky:
            return self.tokens.encode(text[start:])
        marked = [dict(m) for m in messages]
        for n, i in enumerate(risky):
            marked[i]["content"] = _SENTINEL.format(n)
        shown = self.render_text(marked, tools)
        parts = re.split("(" + re.escape(_SENTINEL).replace(r"\{\}", r"(\d+)") + ")", shown)
        # parts: text, sentinel, index, text, sentinel, index, ...
        rebuilt, pieces, pos = [], [], 0
        for k in range(0, len(parts), 3):
            pieces.append((parts[k], True))
            rebuilt.append(parts[k])
            if k + 2 < len(parts):
                content = messages[risky[int(parts[k + 2])]]["content"]
                pieces.append((content, False))
                rebuilt.append(content)
        if "".join(rebuilt) != text:
            return None
        out: list[int] = []
        for piece, trusted in pieces:
            if pos + len(piece) <= start:
                pos += len(piece)
                continue
            cut = piece[max(0, start - pos):]
            pos += len(piece)
            out += self.tokens.encode(cut) if trusted else self.tokens.untrusted(cut)
        return out

    def bridge(self, prefix: Render, sampled_ids: Sequence[int], messages: list[dict],
               tools: list[dict] | None) -> Render | None:
        """The ids to append after ``prefix.ids + sampled_ids`` so that the segment is the
        template's render of ``messages`` (the whole conversation: the sampled turn's
        :meth:`assistant_message` and the new environment messages) with the generation
        prompt; None when that equality cannot be shown (start a new segment).
        ``messages[:prefix.messages]`` must be the messages ``prefix`` rendered, unchanged."""
        sampled_text = self.tokens.decode(sampled_ids)
        if "\ufffd" in sampled_text:
            return None  # a cut UTF-8 character: text equality says nothing
        window = self._window(prefix, messages)
        if window is None:
            self.bridges["full"] += 1
            return self._bridge_in(messages, tools, prefix.text, sampled_ids, sampled_text, prefix.text,
                                   len(messages))
        self.bridges["window"] += 1
        shown, turn = window
        head = self.render_text(shown[:turn], tools)
        return self._bridge_in(shown, tools, head, sampled_ids, sampled_text, prefix.text, len(messages))

    def _window(self, prefix: Render, messages: list[dict]) -> tuple[list[dict], int] | None:
        """The messages to render instead of the whole conversation, and the sampled turn's
        index among them; None: render it all (not append-stable, a new message that makes
        the template rewrite history, or a window no shorter than the conversation)."""
        s = prefix.messages
        if not self.incremental or not 0 <= s < len(messages) or messages[s].get("role") != "assistant":
            return None
        if any(m.get("role") in self.family.history_roles for m in messages[s + 1:]):
            return None
        # The head: up to the first message that is not a system message (templates put
        # messages[0] and, Llama 3, the first user message in their system part).
        head = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages)) + 1
        start = s - 1  # the message before the turn: templates look at neighbours' roles
        if start <= head:
            return None
        return messages[:head] + messages[start:], head + 1

    def _bridge_in(self, messages: list[dict], tools, head: str, sampled_ids: Sequence[int], sampled_text: str,
                   prefix_text: str, count: int) -> Render | None:
        """The bridge read off the render of ``messages`` (the conversation or its window),
        whose prompt before the sampled turn renders as ``head``; ``count``: the whole
        conversation's number of messages."""
        full = self.render_text(messages, tools)
        lead = head + sampled_text
        if not full.startswith(lead):
            return None
        rest = full[len(lead):]
        boundary = (sampled_ids and sampled_ids[-1] in self.tokens.added_ids) or self.tokens.starts_with_added(rest)
        if not boundary:
            return None
        ids = self._tokenize(messages, tools, full, len(lead))
        if ids is None:
            return None
        return Render(ids, prefix_text + sampled_text + rest, count)

    # -- turns ------------------------------------------------------------------------------
    def parse_turn(self, ids: Sequence[int], *, truncated: bool = False) -> ParsedTurn:
        """Content, reasoning, calls and error of one sampled turn (its generated ids).
        ``truncated``: generation stopped at max tokens (a call left open is then a
        truncation, told as such)."""
        ids = list(ids)
        if ids and ids[-1] in self.stop_token_ids:
            truncated = False
            if ids[-1] != self.call_close_id:  # rollway's turn ends at its call's close
                ids = ids[:-1]
        text = self.tokens.decode(ids)
        reasoning = None
        if self.think_close_id is not None:
            if self.think_close_id in ids:
                cut = ids.index(self.think_close_id)
                inner = ids[:cut]
                if inner and inner[0] == self.think_open_id:
                    inner = inner[1:]
                reasoning = self.tokens.decode(inner)
                ids = ids[cut + 1:]
            elif ids and ids[0] == self.think_open_id:
                why = "max tokens were reached" if truncated else "the turn ended"
                return ParsedTurn("", self.tokens.decode(ids[1:]), [],
                                  f"{why} inside the reasoning block, before any tool call", text)
        if self.family.whole_turn_call:
            return self._whole_turn(ids, reasoning, truncated, text)
        return self._delimited(ids, reasoning, truncated, text)

    def _delimited(self, ids: list[int], reasoning, truncated: bool, text: str) -> ParsedTurn:
        """Calls between the call-open and call-close ids; the content is the text before
        the first call, as the template renders it back (after reasoning: without the
        newlines the template puts after ``</think>``; before a call: without the one
        newline the template puts before it)."""
        open_id, close_id = self.call_open_id, self.call_close_id
        content_ids: list[int] = []
        bodies: list[list[int]] = []
        error = None
        i = 0
        while i < len(ids):
            if ids[i] == open_id:
                try:
                    end = ids.index(close_id, i + 1)
                except ValueError:
                    error = ("max tokens were reached inside a tool call (it was never closed); make the call shorter"
                             if truncated else "unterminated tool call: the turn ended before the call was closed")
                    break
                inner = ids[i + 1:end]
                if open_id in inner:
                    error = "a tool call opened inside another tool call"
                    break
                bodies.append(inner)
                i = end + 1
                continue
            if ids[i] == close_id:
                error = "a tool call was closed that was never opened"
                break
            if not bodies:
                content_ids.append(ids[i])
            i += 1
        content = self.tokens.decode(content_ids)
        if reasoning is not None:
            content = content.lstrip("\n")
        sep = self.family.content_call_separator
        if bodies and sep and content.endswith(sep):
            content = content[: -len(sep)]
        calls: list[ParsedCall] = []
        if error is None:
            for n, body in enumerate(bodies):
                try:
                    name, arguments = self.family.body(self, self.tokens.decode(body))
                except CallError as exc:
                    error = f"tool call {n + 1}: {exc}"
                    break
                calls.append(ParsedCall(f"call_{n}", name, arguments))
        if error is not None:
            calls = []
        return ParsedTurn(content, reasoning, calls, error, text)

    def _whole_turn(self, ids: list[int], reasoning, truncated: bool, text: str) -> ParsedTurn:
        forced = bool(ids) and ids[0] == self.whole_turn_prefix_id and self.whole_turn_prefix_id is not None
        body = self.tokens.decode(ids[1:] if forced else ids)
        if not forced and not body.lstrip().startswith("{"):
            return ParsedTurn(body, reasoning, [], None, text)
        if truncated:
            return ParsedTurn(body, reasoning, [], "max tokens were reached inside the tool call; make the call shorter",
                              text)
        try:
            name, arguments = self.family.body(self, body)
        except CallError as exc:
            return ParsedTurn(body, reasoning, [], f"tool call: {exc}", text)
        return ParsedTurn("", reasoning, [ParsedCall("call_0", name, arguments)], None, text)

    # -- messages ---------------------------------------------------------------------------
    def assistant_message(self, turn: ParsedTurn) -> dict[str, Any]:
        """The message the conversation records for a sampled turn: structured calls when
        they were read, else the turn's text as content (so the template renders what was
        sampled)."""
        if turn.calls:
            msg: dict[str, Any] = {"role": "assistant", "content": turn.content, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in turn.calls]}
        else:
            content = turn.text
            if turn.reasoning is not None and self.family.think_close:
                content = turn.text.split(self.family.think_close, 1)[-1] if self.family.think_close in turn.text else ""
            msg = {"role": "assistant", "content": content}
        if turn.reasoning is not None:
            msg["reasoning_content"] = turn.reasoning
        return msg

    @staticmethod
    def tool_message(call_id: str, name: str, content: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}

    @staticmethod
    def user_message(content: str) -> dict[str, Any]:
        """Stripped: some templates trim user text (Llama 3), which would break the bridge."""
        return {"role": "user", "content": content.strip()}


# -- call bodies ----------------------------------------------------------------------------
def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CallError(f"not valid JSON ({exc.msg} at character {exc.pos}); write "
                        '{"name": ..., "arguments": {...}}') from None


def json_body(fmt: ChatFormat, body: str, *, arguments_keys: tuple[str, ...] = ("arguments",)) -> tuple[str, dict]:
    """``{"name": ..., "arguments": {...}}`` (Hermes; Llama 3 says ``parameters``)."""
    obj = _loads(body.strip())
    if not isinstance(obj, dict):
        raise CallError(f"the call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise CallError('the call has no "name"')
    args: Any = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(args, str):  # some models send the arguments as a JSON string
        args = _loads(args)
    if not isinstance(args, dict):
        raise CallError(f'"{arguments_keys[0]}" must be a JSON object')
    return name, args


def llama_body(fmt: ChatFormat, body: str) -> tuple[str, dict]:
    return json_body(fmt, body, arguments_keys=("parameters", "arguments"))


def qwen3_xml_body(fmt: ChatFormat, body: str) -> tuple[str, dict]:
    """Qwen3-Coder's ``<function=NAME><parameter=K>V</parameter></function>``, read by
    vLLM's Qwen3 parser (values converted to the schema's types)."""
    if "<function=" not in body:
        raise CallError("no <function=NAME> in the tool call")
    parser, request = fmt._qwen3_parser()
    info = parser.extract_tool_calls(body, request)
    if not info.tools_called or not info.tool_calls:
        raise CallError("the tool call could not be read: write <function=NAME> then one <parameter=KEY>VALUE</parameter> "
                        "per argument")
    if len(info.tool_calls) > 1:
        raise CallError("one <function=...> per tool call")
    fn = info.tool_calls[0].function
    try:
        args = json.loads(fn.arguments or "{}")
    except json.JSONDecodeError:
        raise CallError("the parameters could not be read") from None
    known = fmt._tool_params().get(fn.name)
    if known is not None and not set(args) <= set(known) or known is not None and not set(known) <= set(args):
        # vLLM's reading ends a value at the first </parameter> or <parameter=: a value
        # that quotes the format (a file holding a call) reads as extra parameters.
        # Ours ends a value only where a parameter of this tool, or the end, follows.
        exact = _xml_params(body, known)
        if exact is not None:
            return fn.name, exact
    return fn.name, args


_PARAM_OPEN = re.compile(r"<parameter=([^>\n]+)>\n?")


def _xml_params(body: str, params: list[str]) -> dict[str, str] | None:
    """The parameters of ``<function=NAME>...</function>`` with the tool's known parameter
    names as the only boundaries (values are strings); None when it does not read."""
    head = re.match(r"\s*<function=[^>\n]+>\n?", body)
    end = body.rstrip().rfind("</function>")
    if head is None or end < 0 or body.rstrip()[end:] != "</function>":
        return None
    inner = body[head.end():end]
    args: dict[str, str] = {}
    pos = 0
    while inner[pos:].strip():
        pos += len(inner[pos:]) - len(inner[pos:].lstrip())
        m = _PARAM_OPEN.match(inner, pos)
        if m is None or m.group(1).strip() not in params or m.group(1).strip() in args:
            return None
        name, start = m.group(1).strip(), m.end()
        close = inner.find("</parameter>", start)
        while close >= 0:
            after = inner[close + len("</parameter>"):]
            nxt = _PARAM_OPEN.match(after.lstrip())
            if not after.strip() or (nxt and nxt.group(1).strip() in params and nxt.group(1).strip() not in args
                                     and nxt.group(1).strip() != name):
                break
            close = inner.find("</parameter>", close + 1)
        if close < 0:
            return None
        value = inner[start:close]
        args[name] = value[:-1] if value.endswith("\n") else value
        pos = close + len("</parameter>")
    return args


def _qwen3_parser(self: ChatFormat):
    if self._vllm_parser is None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers.qwen3_engine_tool_parser import Qwen3EngineToolParser

        from sampler.formats.tools import TOOL_SCHEMAS

        request = ChatCompletionRequest(model="rollway", messages=[{"role": "user", "content": ""}], tools=TOOL_SCHEMAS)
        self._vllm_parser = (Qwen3EngineToolParser(self.tokenizer, None), request)
    return self._vllm_parser


def _tool_params(self: ChatFormat) -> dict[str, list[str]]:
    from sampler.formats.tools import TOOL_SCHEMAS

    return {t["function"]["name"]: list(t["function"]["parameters"]["properties"]) for t in TOOL_SCHEMAS}


ChatFormat._qwen3_parser = _qwen3_parser  # type: ignore[attr-defined]
ChatFormat._tool_params = _tool_params  # type: ignore[attr-defined]
