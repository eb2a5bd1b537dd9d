"""Sampling parameters and the behaviour distribution they define.

The behaviour distribution of a token is what the sampler actually drew from: the
logits (float32) divided by the temperature, cut by top-k, then by top-p, and
renormalized over what is left (the *kept set*). The rules below are vLLM's
(``apply_top_k_top_p_pytorch``) so both engines keep the same sets:

- top-k keeps every token whose logit is >= the k-th largest (ties at the border stay);
- top-p sorts ascending and drops tokens while the ascending cumulative probability
  is <= 1 - p, always keeping the most likely token.

Temperature 0 is greedy: the kept set is the argmax alone and its log-prob is 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below this are greedy
# vLLM raises any temperature in (0, 0.01) to 0.01 (its _MAX_TEMP) before sampling,
# so a chunk would record a temperature other than the one sampled with: refused.
MIN_TEMPERATURE = 1e-2


def temperature_error(name: str, temperature: float) -> str | None:
    """Why ``temperature`` cannot be sampled with as recorded, or None."""
    if temperature < 0:
        return f"{name} must be >= 0, not {temperature}"
    if 0 < temperature < MIN_TEMPERATURE:
        return (f"{name} = {temperature} cannot be recorded truthfully: vLLM samples with 0.01 for any temperature "
                f"in (0, 0.01); use 0 (greedy) or at least 0.01")
    return None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to sample: the engine-neutral version of vLLM's SamplingParams."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (matched on the decoded completion)
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        error = temperature_error("temperature", self.temperature)
        if error is not None:
            raise ValueError(error)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, not {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, not {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def processed_logprobs(logits: "torch.Tensor", params: SamplingParams) -> "torch.Tensor":
    """Behaviour log-probs over the vocabulary (-inf outside the kept set).

    ``logits``: [batch, vocab], any float dtype; computed in float32 like vLLM.
    """
    import torch

    x = logits.to(torch.float32)
    if params.greedy:
        out = torch.full_like(x, float("-inf"))
        out.scatter_(-1, x.argmax(dim=-1, keepdim=True), 0.0)
        return out
    x = x / params.temperature
    vocab = x.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else None
    if top_k is None and params.top_p >= 1.0:
        return x.log_softmax(dim=-1)
    sorted_x, idx = x.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_x[:, vocab - top_k].unsqueeze(-1)
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if params.top_p < 1.0:
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1.0 - params.top_p
        drop[:, -1] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    x = torch.empty_like(x).scatter_(-1, idx, sorted_x)
    return x.log_softmax(dim=-1)


@dataclass(slots=True)
class KeptSet:
    """One position's kept set: token ids (most likely first), and whether a cap cut it.

    ``size`` is the whole set's size, also when ``ids`` holds only part of it (capped):
    the trainer rebuilds a capped set as its own top-``size``; -1 = not known (the
    engine saw only its top ``cap + 1`` entries). None: ``len(ids)`` (a complete set)."""

    ids: np.ndarray  # int32
    capped: bool = False
    logprobs: np.ndarray | None = field(default=None, repr=False)  # float32, same order
    size: int | None = None

    def __post_init__(self) -> None:
        if self.size is None:
            self.size = -1 if self.capped else int(self.ids.size)


def kept_set_from_row(row_logprobs: "torch.Tensor", cap: int | None = None, must_include: int | None = None) -> KeptSet:
    """Kept set of one processed-logprob row (finite entries), optionally capped.

    With a cap the ``cap`` most likely tokens are kept and ``must_include`` (the
    sampled token) is added when the cap cut it off.
    """
    import torch

    finite = torch.isfinite(row_logprobs)
    ids = torch.nonzero(finite, as_tuple=False).flatten()
    lps = row_logprobs[ids]
    order = torch.argsort(lps, descending=True, stable=True)
    ids, lps = ids[order], lps[order]
    size = int(ids.numel())
    capped = cap is not None and size > cap
    if capped:
        head_ids, head_lps = ids[:cap], lps[:cap]
        if must_include is not None and not bool((head_ids == must_include).any()):
            head_ids = torch.cat([head_ids, torch.tensor([must_include])])
            head_lps = torch.cat([head_lps, row_logprobs[must_include].reshape(1)])
        ids, lps = head_ids, head_lps
    return KeptSet(ids.to(torch.int32).numpy(), capped, lps.to(torch.float32).numpy(), size)
