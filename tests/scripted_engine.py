"""A policy with a script: an :class:`~sampler.engine.Engine` that answers each
generation with token ids a test chose, through the real tokenizer.

The agent loop's tests need exact turns (a write whose content quotes a text-spelled
tool call, a NUL byte in a command, a context filled to a given token), which no
sampled model produces on demand. Everything else stays real: the tokenizer, the agent
loop, the recorder and the sandbox service. The engine enforces what vLLM does with a
prompt (``validate_prompt``: shorter than ``max_model_len``) and with stops (generation
ends at the first stop id, which is kept, or after ``max_tokens``), and records every
call so tests can check the exact numbers the agent asked for. ``respond`` returning
None is a generation that never ends (until cancelled): a rollout caught mid-turn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import numpy as np

from sampler.engine import EngineEvent, InProcessEngine, SampleDone, SampledToken, validate_prompt
from sampler.sampling import SamplingParams


@dataclass
class Call:
    prompt_len: int
    max_tokens: int
    prompt: list[int]
    output: list[int]


class ScriptedEngine(InProcessEngine):
    kept_set_source = "exact"

    def __init__(self, tokenizer, respond: Callable[[list[int], SamplingParams], list[int] | None], *,
                 max_model_len: int = 512, weight_version: int = 0) -> None:
        # The shared engine state (context length, version, tokenizer properties); no model.
        super().__init__("scripted", max_model_len=max_model_len, dtype="none", seed=0,
                         weight_version=weight_version)
        self._tokenizer = tokenizer
        self.respond = respond
        self.calls: list[Call] = []
        self.hanging = 0  # generations waiting forever right now

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[EngineEvent]:
        validate_prompt(prompt_ids, params, self._max_model_len, len(self._tokenizer))
        script = self.respond(list(prompt_ids), params)
        if script is None:
            self.hanging += 1
            try:
                await asyncio.Event().wait()
            finally:
                self.hanging -= 1
        out: list[int] = []
        for tok in script[: params.max_tokens]:
            out.append(tok)
            if tok in params.stop_token_ids:
                break
        self.calls.append(Call(len(prompt_ids), params.max_tokens, list(prompt_ids), out))
        for tok in out:
            yield SampledToken(0, tok, 0.0, np.array([tok], dtype=np.int32), False, self._version)
        reason = "stop" if out and out[-1] in params.stop_token_ids else "length"
        yield SampleDone(0, reason, len(out))

    async def abort(self, request_id: str) -> None:
        return None

    async def pause(self) -> None:
        return None

    async def resume(self) -> None:
        return None

    @property
    def paused(self) -> bool:
        return False

    async def apply_weights(self, tensors, version: int) -> float:
        self._version = version
        return 0.0

    async def close(self) -> None:
        return None


def turn_ids(tokenizer, *pieces: tuple[str, bool]) -> list[int]:
    """Ids of a scripted turn: trusted pieces may hold special tokens, others are text."""
    out: list[int] = []
    for text, special in pieces:
        out += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not special)
    return out


def call_ids(tokenizer, body: str) -> list[int]:
    """A well-formed call: the special <tool> and </tool> around ``body`` spelled as text."""
    return turn_ids(tokenizer, ("<tool>", True), (body, False), ("</tool>", True))
