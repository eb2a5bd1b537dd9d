"""Kept sets read off vLLM's sampler tensors, one batched pass per step.

On the ``logprobs`` path (vLLM without native sampling masks, i.e. CPU) a token's kept
set is the finite entries of vLLM's processed log-probs (temperature, top-k, top-p,
log-softmax; ``logprobs_mode="processed_logprobs"``). Asking vLLM for them as
``logprobs = cap + 1`` per request made vLLM turn cap + 1 entries per token into Python
objects (``LogprobsProcessor``) that the engine then turned back into arrays: at batch
32 on the tiny model that alone cost ~30-45% of plain vLLM's tokens/s.

:class:`KeptSetTap` wraps the sampler's ``sample`` instead (the engine core runs in the
step thread: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and, for the rows of the engine's own
requests, takes in one batched pass per step the top ``cap + 1`` processed log-probs
and ids, the number of finite entries over the vocabulary and the sampled token's
log-prob. vLLM is asked for no log-probs at all. The kept sets are the same as the
old path's: the finite entries when there are at most ``cap`` of them (or when the top
``cap + 1`` is the whole vocabulary), else the ``cap`` most likely plus the sampled
token, flagged capped with size unknown (-1), most likely first, ties by id.

The recording path (``VLLMEngine.record``) takes a step's kept sets as arrays,
``StepKeptSets.tokens``: sampled ids, log-probs, the kept sets (the same ids in the same
order as ``kept_set``), capped flags and sizes, built in numpy once per step;
each request's token is a ``StepRow`` of it (``StepKeptSets.row``, with ``kept_set``'s
checks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sampler.engine import StepRow, StepTokens
from sampler.sampling import KeptSet


@dataclass(slots=True)
class StepKeptSets:
    """One step's kept sets for the engine's rows (row r = ``rows[key]``): row r's set is
    ``ids[r, :lengths[r]]`` with ``logprobs[r, :lengths[r]]``, most likely first, ties by
    id, a capped set's sampled token last when the cap cut it off."""

    rows: dict[str, int]  # vLLM's internal request id -> row
    sampled: list[int]  # the token each row sampled
    sampled_logprobs: list[float]  # its processed log-prob
    ids: np.ndarray  # int32 [R, k], k = min(cap + 1, vocab)
    logprobs: np.ndarray  # float32 [R, k]
    lengths: list[int]
    capped: list[bool]
    # The same as arrays (from_top), for the recording path's StepTokens.
    arrays: tuple[np.ndarray, ...] | None = field(default=None, repr=False)
    _tokens: StepTokens | None = field(default=None, repr=False)
    _finite: bool = field(default=True, repr=False)  # every sampled log-prob is finite

    def tokens(self, version: int) -> StepTokens:
        """This step's rows as :class:`StepTokens` (weights ``version``; kept sets as the
        rows of ``ids``, CSR built only if read), once per step, in numpy."""
        if self._tokens is None:
            if self.arrays is None:
                raise RuntimeError("StepKeptSets built without arrays (use from_top)")
            sampled, sampled_lps, lengths, capped = self.arrays
            # (kept log-probs are not recorded: left out of the recording path's arrays)
            self._tokens = StepTokens.padded(
                sampled.astype(np.int32), sampled_lps.astype(np.float32), self.ids, lengths, capped,
                np.where(capped, -1, lengths).astype(np.int32), np.full(len(lengths), version, dtype=np.int64),
            )
        return self._tokens

    def row(self, key: str, token: int, version: int) -> StepRow:
        """The token request ``key`` sampled as a row of :meth:`tokens` (the checks of
        :meth:`kept_set`, no object built per token but the row reference)."""
        r = self.rows.get(key)
        if r is None or self.sampled[r] != token or not self._finite:
            self.kept_set(key, token)  # raises what is wrong (a non-finite log-prob: only if it is this row's)
        tokens = self._tokens
        return StepRow(self.tokens(version) if tokens is None else tokens, r)

    def kept_set(self, key: str, token: int) -> tuple[float, KeptSet]:
        """(behaviour log-prob, kept set) of the token request ``key`` sampled."""
        r = self.rows.get(key)
        if r is None:
            raise RuntimeError(f"vLLM returned a token for request {key!r} that its sampler did not report")
        if self.sampled[r] != token:
            raise RuntimeError(f"vLLM returned token {token} for request {key!r}; its sampler drew {self.sampled[r]}")
        lp = self.sampled_logprobs[r]
        if not math.isfinite(lp):
            raise ValueError(f"sampled token {token} has no finite log-prob in the engine's output")
        n = self.lengths[r]
        return lp, KeptSet(self.ids[r, :n], self.capped[r], self.logprobs[r, :n])

    @classmethod
    def from_top(cls, rows: dict[str, int], sampled: np.ndarray, sampled_logprobs: np.ndarray,
                 top_ids: np.ndarray, top_logprobs: np.ndarray, cap: int, vocab: int) -> "StepKeptSets":
        """From each row's top k = min(cap + 1, vocab) processed log-probs (any order),
        in numpy over the whole step."""
        ids, lps = _by_likelihood_then_id(top_ids, top_logprobs)
        finite = np.isfinite(lps).sum(axis=-1)
        # cap + 1 finite entries: the set may go on past them (unless they are the whole
        # vocabulary, then every finite entry is here and the set is complete).
        capped = (finite > cap) & (ids.shape[1] < vocab)
        in_head = (ids[:, :cap] == sampled[:, None]).any(axis=-1)
        appended = capped & ~in_head
        ids[appended, cap] = sampled[appended]
        lps[appended, cap] = sampled_logprobs[appended]
        lengths = np.where(capped, np.where(in_head, cap, cap + 1), finite)
        return cls(rows, sampled.tolist(), sampled_logprobs.tolist(), ids, lps, lengths.tolist(), capped.tolist(),
                   arrays=(sampled, sampled_logprobs, lengths, capped),
                   _finite=bool(np.isfinite(sampled_logprobs).all()))


def _by_likelihood_then_id(ids: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of (ids, logprobs) ordered most likely first, ties by id, -inf last.

    One sort of int64 keys instead of a two-key ``lexsort`` plus two gathers (a third of
    the time on a step's [rows, cap + 1]): the high half is the float32 bits of
    ``-logprob`` mapped to int32 so that integer order is float order, the low half the
    id (ids are >= 0). Both halves decode exactly, so the values are the sampler's (a
    -0.0 comes back as 0.0: the two compare equal, so they must tie and order by id). A
    NaN sorts last, as in lexsort (kept_set refuses a NaN sampled log-prob anyway)."""
    bits = (np.float32(0.0) - logprobs.astype(np.float32)).view(np.int32)  # 0 - x: no -0.0
    ordered = bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))  # monotone: float order == int order
    ordered[np.isnan(logprobs)] = np.iinfo(np.int32).max
    keys = np.sort((ordered.astype(np.int64) << 32) | ids.astype(np.int64), axis=-1)
    high = (keys >> 32).astype(np.int32)
    neg = (high ^ ((high >> 31) & np.int32(0x7FFFFFFF))).view(np.float32)
    return (keys & 0xFFFFFFFF).astype(np.int32), np.float32(0.0) - neg


class KeptSetTap:
    """Wraps a vLLM V1 worker's sampler; ``wanted`` holds the internal request ids whose
    rows to keep, ``step`` the last step's :class:`StepKeptSets` (None before one)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.wanted: set[str] = set()
        self.step: StepKeptSets | None = None
        self.installed = False  # set by install() on this very object: the worker is in-process

    def install(self, worker: Any) -> None:
        """Run on the worker (``LLMEngine.collective_rpc``): wrap its sampler's ``sample``."""
        runner = getattr(worker, "model_runner", None)
        sampler = getattr(runner, "sampler", None)
        if sampler is None or not hasattr(sampler, "sample") or not hasattr(runner, "input_batch"):
            raise RuntimeError("this vLLM's worker has no model_runner.sampler.sample / input_batch to read "
                               "kept sets from (vLLM V1 GPUModelRunner layout expected)")
        original = sampler.sample

        def sample(logits, sampling_metadata, *args, **kwargs):
            sampled, processed = original(logits, sampling_metadata, *args, **kwargs)
            # None: an all-greedy batch (greedy kept sets need nothing from here).
            if processed is not None and self.wanted:
                self._capture(runner.input_batch.req_ids, sampled, processed)
            return sampled, processed

        sampler.sample = sample
        self.installed = True

    def _capture(self, req_ids: list[str], sampled, processed) -> None:
        import torch

        rows = [i for i, rid in enumerate(req_ids[: processed.shape[0]]) if rid in self.wanted]
        if not rows:
            return
        if len(rows) < processed.shape[0]:
            index = torch.tensor(rows, dtype=torch.long, device=processed.device)
            processed, sampled = processed.index_select(0, index), sampled.index_select(0, index)
        drawn = sampled.long()
        vocab = processed.shape[-1]
        top_lps, top_ids = processed.topk(min(self.cap + 1, vocab), dim=-1, sorted=False)
        # On an accelerator the tensors live on the device: one small [R, cap + 1]
        # copy to the host per step (.cpu() is a no-op on CPU).
        self.step = StepKeptSets.from_top(
            {req_ids[i]: r for r, i in enumerate(rows)},
            drawn.cpu().numpy(),
            processed.gather(1, drawn.unsqueeze(1)).squeeze(1).cpu().numpy(),
            top_ids.to(torch.int32).cpu().numpy(),
            top_lps.cpu().numpy(),
            self.cap,
            vocab,
        )
