"""The engine interface every sampler backend implements.

An engine turns prompt token ids into sampled tokens and reports, for each token,
exactly what the sampler decided: the behaviour log-prob (after temperature,
renormalized over the kept set), the kept set itself (and whether a cap cut it), the
weight version that produced the token and, for MoE models where the engine offers
it, the routed experts.

    async for event in engine.generate(prompt_ids, params, request_id="r1"):
        if isinstance(event, SampledToken): ...
        else: ...  # SampleDone: one per sample, after its last token

Engines are also the weight target of ``docs/contracts.md``: ``weight_version`` and
``apply_weights(tensors, version) -> pause seconds``; ``pause()``/``resume()`` hold
generation between two decoding steps (requests stay alive and continue after).
"""

from __future__ import annotations

import abc
import contextlib
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

import msgspec
import numpy as np
import structlog

from sampler.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from sampler.recorder import TrajectoryRecorder

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class SampledToken:
    """One generated token and what the sampler decided for it."""

    sample_index: int
    token_id: int
    logprob: float  # behaviour log-prob under the kept-set-renormalized distribution
    kept_ids: np.ndarray  # int32, contains token_id
    kept_capped: bool  # True when the kept set was larger than the engine's cap
    weight_version: int
    # MoE models: the experts [moe_layers, top_k] the position that produced this token
    # (the one before it) was routed to; docs/contracts.md, "Routing".
    routed_experts: np.ndarray | None = None
    # Behaviour log-probs of kept_ids (same order) where the engine knows them.
    kept_logprobs: np.ndarray | None = None
    # Size of the whole kept set (kept_ids may hold only part of it when capped);
    # None: len(kept_ids) when not capped, unknown (-1) when capped.
    kept_size: int | None = None
    # On a sample's first token, for engines that report them: the routes of the prompt
    # positions 0..P-2 [P-1, moe_layers, top_k], i.e. of prompt tokens 1..P-1.
    prompt_routed_experts: np.ndarray | None = None

    @property
    def recorded_kept_size(self) -> int:
        if self.kept_size is not None:
            return int(self.kept_size)
        return -1 if self.kept_capped else int(self.kept_ids.size)


# One token as recorders buffer it (packed, little-endian; 18 bytes): id, behaviour
# log-prob, kept-set size (-1 unknown), kept ids recorded, loss mask, capped flag.
TOKEN_RECORD = np.dtype([("id", "<i4"), ("logprob", "<f4"), ("kept_size", "<i4"), ("kept_len", "<i4"),
                         ("mask", "u1"), ("capped", "u1")])
_RECORD_BYTES = np.dtype((np.void, TOKEN_RECORD.itemsize))  # a record as one opaque value (.tolist(): bytes)


class StepTokens:
    """Tokens one engine step sampled, as arrays, one row per sample that produced one:
    the form engines hand recorders (``TrajectoryRecorder.add_sampled(StepRow(step, r))``:
    the recorder copies row r into its buffers, no object per token). Row r's kept set
    is ``kept_ids[kept_offsets[r]:kept_offsets[r + 1]]`` (CSR, the sampled token in it).

    :meth:`padded` builds one from a [R, k] matrix of kept ids, row r's set its first
    ``lengths[r]`` entries (the sampler tap's layout); its CSR arrays are then built
    only when read. ``columns`` (Python lists of the per-row values, the kept ids as
    little-endian bytes) is built once per step, on first use, for the recorders'
    per-row reads: set a step's fields (routes too) before any row of it is read."""

    __slots__ = ("token_ids", "logprobs", "_kept_offsets", "_kept_ids", "kept_capped", "kept_sizes", "versions",
                 "kept_logprobs", "routed_experts", "prompt_routed_experts", "_columns", "_padded")

    def __init__(
        self,
        token_ids: np.ndarray,  # int32 [R]
        logprobs: np.ndarray,  # float32 [R]: behaviour log-prob (renormalized over the kept set)
        kept_offsets: np.ndarray | None,  # int32 [R + 1], CSR (None: padded)
        kept_ids: np.ndarray | None,  # int32 [kept_offsets[-1]]
        kept_capped: np.ndarray,  # bool [R]: the set was larger than the engine's cap
        kept_sizes: np.ndarray,  # int32 [R]: the whole set's size, -1 unknown (SampledToken.kept_size)
        versions: np.ndarray,  # int64 [R]: the weight version that produced each row
        kept_logprobs: np.ndarray | None = None,  # float32 [kept_offsets[-1]], same order, where known
        routed_experts: np.ndarray | None = None,  # [R, moe_layers, top_k] (SampledToken.routed_experts)
        prompt_routed_experts: list[np.ndarray | None] | None = None,  # per row, SampledToken's
    ) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs
        self._kept_offsets = kept_offsets
        self._kept_ids = kept_ids
        self.kept_capped = kept_capped
        self.kept_sizes = kept_sizes
        self.versions = versions
        self.kept_logprobs = kept_logprobs
        self.routed_experts = routed_experts
        self.prompt_routed_experts = prompt_routed_experts
        self._columns: tuple | None = None
        self._padded: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def padded(cls, token_ids: np.ndarray, logprobs: np.ndarray, kept: np.ndarray, lengths: np.ndarray,
               kept_capped: np.ndarray, kept_sizes: np.ndarray, versions: np.ndarray) -> "StepTokens":
        """Kept sets as rows of ``kept`` (int32 [R, k]), row r's the first ``lengths[r]``."""
        step = cls(token_ids, logprobs, None, None, kept_capped, kept_sizes, versions)
        step._padded = (kept, lengths)
        return step

    def _csr(self) -> None:
        kept, lengths = self._padded
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        self._kept_ids = kept[np.arange(kept.shape[1])[None, :] < np.asarray(lengths)[:, None]].astype(np.int32)
        self._kept_offsets = offsets

    @property
    def kept_offsets(self) -> np.ndarray:
        if self._kept_offsets is None:
            self._csr()
        return self._kept_offsets

    @property
    def kept_ids(self) -> np.ndarray:
        if self._kept_ids is None:
            self._csr()
        return self._kept_ids

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def columns(self) -> tuple[list[int], list[bytes], list[int], list[int], list[int], bytes, bool]:
        """What recorders read per row, built on first use: (token ids, each row's
        :data:`TOKEN_RECORD` as its own 18-byte ``bytes`` (one C pass here instead of a
        slice per row in the recorder), each row's kept ids as [start, end) byte offsets
        into the kept bytes, versions, the kept ids as int32 little-endian bytes, whether
        the step has no routes at all: the recorders' short path)."""
        cols = self._columns
        if cols is None:
            n = len(self.token_ids)
            if self._padded is not None:
                kept, lengths = self._padded
                lengths = np.asarray(lengths, dtype=np.int64)
                starts = np.arange(n, dtype=np.int64) * (4 * kept.shape[1])
                ends = starts + 4 * lengths
                kept_bytes = np.ascontiguousarray(kept, dtype="<i4").tobytes()
            else:
                offsets = np.asarray(self._kept_offsets, dtype=np.int64)
                lengths = np.diff(offsets)
                starts, ends = 4 * offsets[:-1], 4 * offsets[1:]
                kept_bytes = np.ascontiguousarray(self._kept_ids, dtype="<i4").tobytes()
            records = np.empty(n, dtype=TOKEN_RECORD)
            records["id"] = self.token_ids
            records["logprob"] = self.logprobs
            records["kept_size"] = self.kept_sizes
            records["kept_len"] = lengths
            records["mask"] = 1
            records["capped"] = self.kept_capped
            plain = self.routed_experts is None and self.prompt_routed_experts is None
            cols = self._columns = (self.token_ids.tolist(), records.view(_RECORD_BYTES).tolist(),
                                    starts.tolist(), ends.tolist(),
                                    self.versions.tolist(), kept_bytes, plain)
        return cols

    @classmethod
    def of(cls, tokens: "list[SampledToken]") -> "StepTokens":
        """The step of ``SampledToken``s (one row each)."""
        kept = [np.asarray(t.kept_ids, dtype=np.int32).reshape(-1) for t in tokens]
        offsets = np.zeros(len(kept) + 1, dtype=np.int32)
        np.cumsum([k.size for k in kept], out=offsets[1:])
        have_lps = all(t.kept_logprobs is not None for t in tokens)
        routed = [t.routed_experts for t in tokens]
        prompt = [t.prompt_routed_experts for t in tokens]
        return cls(
            np.array([t.token_id for t in tokens], dtype=np.int32),
            np.array([t.logprob for t in tokens], dtype=np.float32),
            offsets,
            np.concatenate(kept) if kept else np.zeros(0, dtype=np.int32),
            np.array([bool(t.kept_capped) for t in tokens], dtype=bool),
            np.array([t.recorded_kept_size for t in tokens], dtype=np.int32),
            np.array([t.weight_version for t in tokens], dtype=np.int64),
            np.concatenate([t.kept_logprobs for t in tokens]).astype(np.float32) if have_lps and tokens else None,
            np.stack([np.asarray(r) for r in routed]) if routed and all(r is not None for r in routed) else None,
            prompt if any(p is not None for p in prompt) else None,
        )

    def token(self, row: int, sample_index: int = 0) -> SampledToken:
        """Row ``row`` as a ``SampledToken`` (for streams that hand out one per token)."""
        a, b = int(self.kept_offsets[row]), int(self.kept_offsets[row + 1])
        size = int(self.kept_sizes[row])
        return SampledToken(
            sample_index, int(self.token_ids[row]), float(self.logprobs[row]), self.kept_ids[a:b],
            bool(self.kept_capped[row]), int(self.versions[row]),
            routed_experts=None if self.routed_experts is None else self.routed_experts[row],
            kept_logprobs=None if self.kept_logprobs is None else self.kept_logprobs[a:b],
            kept_size=size,
            prompt_routed_experts=None if self.prompt_routed_experts is None else self.prompt_routed_experts[row],
        )


class StepRow(msgspec.Struct, gc=False):
    """Row ``row`` of a :class:`StepTokens`: one sampled token, as engines that record
    from their step hand it to ``TrajectoryRecorder.add_sampled`` / ``add_sampled_now``.
    A Struct (built in C: one per generated token, ~0.08 us against ~0.25 us for a
    ``__slots__`` class's ``__init__``; issue #29); ``gc=False``: a row never refers back
    to itself."""

    step: "StepTokens"
    row: int

    @property
    def token_id(self) -> int:
        return (self.step._columns or self.step.columns)[0][self.row]


@dataclass(slots=True)
class SampleDone:
    """A sample finished: ``stop`` (stop token/string or EOS), ``length``, ``abort``."""

    sample_index: int
    finish_reason: str
    num_tokens: int
    stop_reason: int | str | None = None
    # MoE routed experts for engines that hand them over only when the sample ends (vLLM
    # does): its whole sequence by position [positions, layers, top_k], row q = position
    # q (TrajectoryRecorder.attach_routed_experts aligns it).
    routed_experts: np.ndarray | None = None


EngineEvent = SampledToken | SampleDone  # (StepRow only in VLLMEngine.record's own delivery)


async def record_event(recorder: "TrajectoryRecorder", event: EngineEvent, generated: list[int]) -> SampleDone | None:
    """One engine event into ``recorder`` (:meth:`Engine.record`'s awaited path): a token
    is recorded and its id appended to ``generated``; a sample's end gives the recorder
    routes handed over at the end and is returned."""
    if isinstance(event, (SampledToken, StepRow)):
        await recorder.add_sampled(event)
        generated.append(event.token_id)
        return None
    if event.routed_experts is not None:
        recorder.attach_routed_experts(event.routed_experts)
    return event


class EngineClosed(RuntimeError):
    """The engine was closed; no more requests."""


def new_request_id() -> str:
    return uuid.uuid4().hex


class Engine(abc.ABC):
    """Async sampler backend. Subclasses: :class:`sampler.vllm_engine.VLLMEngine`,
    :class:`sampler.torch_engine.TorchEngine`."""

    #: Which path produces kept sets ("native" sampling mask, "logprobs", "exact").
    kept_set_source: str = ""
    kept_set_cap: int | None = None

    @property
    @abc.abstractmethod
    def weight_version(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abc.abstractmethod
    def tokenizer(self): ...

    def effective_params(self, params: SamplingParams) -> SamplingParams:
        """The parameters this engine actually samples with (recorded on chunks)."""
        return params

    @abc.abstractmethod
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[EngineEvent]:
        """Stream tokens of ``params.n`` samples (interleaved); each sample ends with a
        :class:`SampleDone`. Breaking out of the iteration aborts the request."""

    async def record(self, recorder: "TrajectoryRecorder", params: SamplingParams) -> tuple[list[int], SampleDone | None]:
        """Generate one completion (``params.n == 1``) of ``recorder``'s segment and record
        every token into it, routes included. Returns the generated ids and the sample's
        end (None when the stream stopped without one). Engines may record from their
        per-step delivery instead of waking the caller per token (VLLMEngine does), so
        the recorder belongs to the call until it returns: nothing else may add to it
        meanwhile."""
        if params.n != 1:
            raise ValueError(f"record takes one completion per call, not n={params.n}")
        generated: list[int] = []
        done: SampleDone | None = None
        stream = self.generate(list(recorder.segment_tokens), params)
        async with contextlib.aclosing(stream):
            async for event in stream:
                done = await record_event(recorder, event, generated) or done
        return generated, done

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request; its open samples end with ``SampleDone('abort')``."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Return once no decoding step runs and none will start until resume()."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @property
    @abc.abstractmethod
    def paused(self) -> bool: ...

    @abc.abstractmethod
    async def apply_weights(self, tensors: dict[str, "torch.Tensor"], version: int) -> float:
        """Pause, load ``tensors`` (HF names) in place, set the version, resume.
        Returns the seconds generation was held."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class InProcessEngine(Engine):
    """What the in-process engines (:class:`~sampler.vllm_engine.VLLMEngine`,
    :class:`~sampler.torch_engine.TorchEngine`) share: the model, context length, loaded
    weight version and tokenizer, generation stats, and the checks opening a request."""

    def __init__(
        self, model_path: str | Path, *, max_model_len: int, dtype: str, seed: int, weight_version: int
    ) -> None:
        self.model_path = str(model_path)
        self._max_model_len = max_model_len
        self.dtype = dtype
        self.seed = seed
        self._version = weight_version
        self._tokenizer = None  # set when the model is loaded
        self.vocab_size = 0
        self._closed = False
        # Stats (heartbeats, benchmarks).
        self.tokens_generated = 0
        self.steps = 0
        self.updates_applied = 0
        self.last_pause_s = 0.0

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self):
        return self._tokenizer

    async def _apply_paused(self, load: Callable[[], Awaitable[None]], version: int, tensors: int) -> float:
        """The frame of ``apply_weights``: pause (unless already paused), ``load`` the
        weights, set the version, resume. Returns (and logs) the seconds generation was
        held; a failed load leaves the version as it was."""
        t0 = time.perf_counter()
        was_paused = self.paused
        await self.pause()
        try:
            await load()
            self._version = int(version)
            self.updates_applied += 1
        finally:
            if not was_paused:
                await self.resume()
        self.last_pause_s = time.perf_counter() - t0
        log.info("weights applied", version=version, tensors=tensors, pause_ms=round(self.last_pause_s * 1e3, 2))
        return self.last_pause_s

    def _ensure_open(self, started: bool) -> None:
        if self._closed or not started:
            raise EngineClosed("engine is closed" if self._closed else "engine not started (await start())")

    def _open_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None, started: bool
    ) -> str:
        """Check the engine and the prompt; the request id to use."""
        self._ensure_open(started)
        validate_prompt(prompt_ids, params, self._max_model_len, self.vocab_size)
        return request_id or new_request_id()


def validate_prompt(prompt_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """Clear errors for prompts no engine can serve."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len}")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
