"""The tool-call format the agent emits and the environment's replies.

A turn of the assistant ends with one tool call (generation stops at ``</tool>``)::

    <tool>run
    python -m pytest -q</tool>          run a shell command in the workspace
    <tool>read solution.py</tool>       read a file
    <tool>write solution.py
    def add(x, y):
        return x + y
    </tool>                             write a file (everything after the first newline)
    <tool>submit</tool>                 done: grade the workspace

The environment answers in a ``tool`` message whose body is wrapped in
``<output>...</output>``; these tokens are environment tokens (loss mask 0)::

    <|im_end|>\n<|im_start|>tool\n<output>1 passed</output><|im_end|>\n

Tool output is tokenized with special tokens *split*: a file containing the text
``<tool>`` cannot inject a control token. The call is read from the turn's token ids
(:mod:`sampler.tool_calls`): only the special ``<tool>`` and ``</tool>`` tokens delimit
it. Self-compaction asks for ``<summary>...</summary>`` (see :mod:`sampler.agent`).
"""

from __future__ import annotations

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"
SUMMARY_OPEN, SUMMARY_CLOSE = "<summary>", "</summary>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


# Environment text is built from pieces (text, trusted): trusted pieces are our own
# markup and may contain special tokens; untrusted pieces (task text, tool output,
# summaries) are tokenized with special tokens split.
Piece = tuple[str, bool]


def task_prompt(instruction: str, files: dict[str, str] | None = None) -> list[Piece]:
    """The first user message of every segment (no generation header)."""
    listing = "\nFiles: " + ", ".join(sorted(files)) if files else ""
    return [(f"{IM_START}user\n", True), (instruction + listing, False), (f"{IM_END}\n", True)]


def summary_resume_prompt(summary: str) -> list[Piece]:
    return [
        (f"{IM_START}user\nSummary of your earlier work:\n{SUMMARY_OPEN}", True),
        (summary, False),
        (f"{SUMMARY_CLOSE}{IM_END}\n", True),
    ]


def compaction_request() -> list[Piece]:
    """Ask for a summary (between two messages); the answer is prefilled with ``<summary>``."""
    return [(
        f"{IM_START}user\nYour context is almost full. Summarize your working state "
        f"(what you tried, what you learned, what is left) in {SUMMARY_OPEN}...{SUMMARY_CLOSE}."
        f"{IM_END}\n{IM_START}assistant\n{SUMMARY_OPEN}",
        True,
    )]


def assistant_header(prefill: str = "") -> list[Piece]:
    return [(f"{IM_START}assistant\n{prefill}", True)]


def tool_reply(body: str, closed_turn: bool) -> list[Piece]:
    """Environment text after a tool call; ``closed_turn``: the model already ended its
    message with ``<|im_end|>``."""
    head = "" if closed_turn else IM_END
    return [
        (f"{head}\n{IM_START}tool\n{OUTPUT_OPEN}", True),
        (body, False),
        (f"{OUTPUT_CLOSE}{IM_END}\n", True),
    ]
