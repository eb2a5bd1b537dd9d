"""``TimingEngine``: tokens at an accelerator's pace, without a model.

Benchmarks of the system's scheduling (async vs sync, many replicas) need samplers that
generate as fast as a GPU would, on a machine whose two cores are also running the
broker and the trainer. This engine draws its tokens instead of computing them, at
``sampler.timing.tokens_per_s`` per sequence (sequences of a batch decode in parallel,
as on an accelerator), ``step_tokens`` tokens per emulated decoding step. Everything
after the engine is the real path: the agent loop, the recorder, chunks on Kafka, the
weight subscriber applying versions (the tensors are accepted and not used).

A completion is filler text followed by one tool call the agent loop understands:
``<tool>submit</tool>`` with probability ``submit_probability``, else a ``run`` call
(the sandbox decides how long it takes). Its length is lognormal (median
``median_tokens``, ``length_sigma``), cut to the request's ``max_tokens`` (the call is
then cut too: the agent answers with a format error and the turn still counts). Each
token's kept set is ``kept_set_size`` ids holding the token, drawn uniformly: its
behaviour log-prob is ``-log(size)``.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, AsyncIterator

import numpy as np
import structlog

from sampler import tool_format as fmt
from sampler.engine import EngineClosed, EngineEvent, InProcessEngine, SampleDone, SampledToken
from sampler.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from sampler.config import SamplerConfig, TimingConfig

log = structlog.get_logger(__name__)

RUN_CALL = f"{fmt.TOOL_OPEN}run\ntrue{fmt.TOOL_CLOSE}"
SUBMIT_CALL = f"{fmt.TOOL_OPEN}submit{fmt.TOOL_CLOSE}"
FILLER_TEXT = " x"


class TimingEngine(InProcessEngine):
    kept_set_source = "timing"
    kept_set_cap = None
    accepts_partial_updates = True  # no tensors are kept: any subset is fine

    def __init__(self, model_path: str, timing: "TimingConfig", *, max_model_len: int = 1024,
                 weight_version: int = 0, sleep=asyncio.sleep) -> None:
        super().__init__(model_path, max_model_len=max_model_len, dtype="none", seed=timing.seed,
                         weight_version=weight_version)
        self.timing = timing
        self._sleep = sleep  # tests pass a no-wait sleep
        self._rng = np.random.default_rng(timing.seed)
        self._running = asyncio.Event()
        self._running.set()
        self._aborted: set[str] = set()
        self._active: set[str] = set()
        self._run_ids: list[int] = []
        self._submit_ids: list[int] = []
        self._filler_id = 0

    @classmethod
    def from_config(cls, cfg: "SamplerConfig", weight_version: int = 0) -> "TimingEngine":
        return cls(cfg.model_path, cfg.timing, max_model_len=cfg.max_model_len, weight_version=weight_version)

    async def start(self) -> "TimingEngine":
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_path)
            self.use_tokenizer(tok)
        return self

    def use_tokenizer(self, tok) -> None:
        """Set the tokenizer (``start`` loads the model folder's)."""
        self._tokenizer = tok
        self.vocab_size = len(tok)
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        self._run_ids, self._submit_ids = encode(RUN_CALL), encode(SUBMIT_CALL)
        self._filler_id = encode(FILLER_TEXT)[0]
        if self.timing.kept_set_size > self.vocab_size:
            raise ValueError(f"sampler.timing.kept_set_size {self.timing.kept_set_size} exceeds the "
                             f"vocabulary ({self.vocab_size})")
        log.info("timing engine ready", tokenizer=self.model_path, tokens_per_s=self.timing.tokens_per_s,
                 median_tokens=self.timing.median_tokens)

    async def __aenter__(self) -> "TimingEngine":
        return await self.start()

    async def close(self) -> None:
        self._closed = True
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    # -- what a completion is -------------------------------------------------------------
    def draw_completion(self, max_tokens: int) -> list[int]:
        """Filler then a tool call, lognormal length, cut to ``max_tokens``."""
        t = self.timing
        call = self._submit_ids if self._rng.random() < t.submit_probability else self._run_ids
        length = int(round(t.median_tokens * math.exp(t.length_sigma * self._rng.standard_normal())))
        length = max(length, len(call))
        return ([self._filler_id] * (length - len(call)) + call)[:max_tokens]

    def kept_set(self, token_id: int) -> np.ndarray:
        """``kept_set_size`` distinct ids holding ``token_id`` (which comes first)."""
        size = self.timing.kept_set_size
        # A run of ids from a random start (distinct by construction; cheaper per token
        # than choice without replacement), skipping token_id itself.
        start = int(self._rng.integers(self.vocab_size - 1))
        others = (start + np.arange(size - 1)) % (self.vocab_size - 1)
        others = others + (others >= token_id)
        return np.concatenate(([token_id], others)).astype(np.int32)

    # -- generation -------------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[EngineEvent]:
        request_id = self._open_request(prompt_ids, params, request_id, started=self._tokenizer is not None)
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already running")
        self._active.add(request_id)
        room = self._max_model_len - len(prompt_ids)
        completions = [self.draw_completion(min(params.max_tokens, room)) for _ in range(params.n)]
        logprob = -math.log(self.timing.kept_set_size)
        step = self.timing.step_tokens
        emitted = 0
        try:
            while emitted < max(len(c) for c in completions):
                if request_id in self._aborted:
                    for i, c in enumerate(completions):
                        if emitted < len(c):
                            yield SampleDone(i, "abort", emitted)
                    return
                await self._running.wait()
                if self._closed:
                    raise EngineClosed("engine closed")
                await self._sleep(step / self.timing.tokens_per_s)
                await self._running.wait()  # a weight update during the step: its tokens are the new version's
                version = self._version
                self.steps += 1
                for offset in range(step):
                    position = emitted + offset
                    for i, c in enumerate(completions):
                        if position >= len(c):
                            continue
                        self.tokens_generated += 1
                        yield SampledToken(i, c[position], logprob, self.kept_set(c[position]), False, version,
                                           kept_size=self.timing.kept_set_size)
                        if position + 1 == len(c):
                            # Whole call: stopped at </tool>; cut by max_tokens: length.
                            stopped = c[-1] == self._run_ids[-1]
                            yield SampleDone(i, "stop" if stopped else "length", len(c),
                                             c[-1] if stopped else None)
                emitted += step
        finally:
            self._active.discard(request_id)
            self._aborted.discard(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self._active:
            self._aborted.add(request_id)

    # -- pause, resume, weights ---------------------------------------------------------------
    async def pause(self) -> None:
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()

    async def apply_weights(self, tensors: dict[str, "torch.Tensor"], version: int) -> float:
        """Set the version (the tensors are not used); steps wait while it happens."""

        async def load() -> None:
            pass

        return await self._apply_paused(load, version, len(tensors))
