"""The RL loss, as pure functions of tensors (no model, no config objects).

Per generated token ``t`` the trainer has its logits ``z_t`` (vocab V), the sampled
token ``y_t``, the sampler's temperature ``T_t``, the kept set ``K_t`` the sampler's
top-p/top-k left available, and the behaviour log-prob ``b_t`` the sampler recorded
(log-prob of ``y_t`` under its distribution renormalised over ``K_t``).

* Sampling distribution replay: the trainer's log-prob is computed over the same
  support the sampler drew from (a kept set too large to record whole is rebuilt as the
  trainer's top-``size``, :func:`rebuild_capped_sets`), ``l_t = z_t[y]/T - logsumexp(z_t[K_t]/T)``. Logits
  outside ``K_t`` get exactly zero gradient (they are never gathered). A kept set of one
  gives ``l_t = 0`` exactly and a gradient of exactly zero: the sampler had no choice,
  so the token carries no policy-gradient signal. Without replay (ablation) ``l_t`` is
  the full-vocabulary ``log_softmax(z_t/T)[y]``.
* Importance sampling against ``b_t`` corrects for the sampler's weights being older
  than the trainer's (asynchrony) and for numeric trainer/sampler mismatch:
  ``tis``  -- loss ``-sg(min(r, cap)) * A * l`` with ``r = exp(l - b)`` (truncated IS;
             the weight is a constant, the gradient is ``w A grad l``);
  ``clip`` -- PPO's surrogate ``-min(r A, clip(r, 1-eps, 1+eps) A)`` against ``b``;
  ``none`` -- ``-A * l`` (plain policy gradient with a group baseline).
  With truncation off (ablation) ``tis`` uses the raw ratio and ``clip`` does not clip.
* Advantages are group-normalised rewards (GRPO): ``group_std`` divides by the
  population standard deviation plus eps, ``group_mean`` only subtracts the group mean
  (Dr. GRPO: no per-group rescaling, so easy and hard groups are not re-weighted), and
  ``none`` uses the raw reward. ``penalty_aware`` (the default) is ``group_std`` for a
  group whose rewards carry no length or budget penalty and ``group_mean`` for one
  that does: dividing by the group's std makes advantages scale-free, which in an
  all-solved group differing only in length cancels the penalty coefficient (tokens
  [100, 150, 200, 250] at 0.001/token: +-1.34 and +-0.45, as large as solve vs fail;
  the same at 0.01/token), so the tangent-tuned coefficient of
  ``suggest_length_penalty`` would have no effect. Centred only, the advantage is the
  reward difference itself (+-0.075 and +-0.025 there, vs +-0.5 for solve vs fail):
  the coefficient keeps its meaning, a token is worth k of a solve. docs/advantages.md.
* The loss is a token-level mean: the sum over every loss token of the step divided by
  the number of loss tokens in the step (callers pass the step's count so gradient
  accumulation over micro-batches is exact). Environment tokens (loss mask 0) are not
  loss tokens; masked tokens contribute neither loss nor gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


# -- advantages ------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, norm: str = "group_std", eps: float = 1e-6, *,
                     penalised: bool = False) -> torch.Tensor:
    """Advantages of one group's rewards (1-D, one per sample). ``penalised``: the
    rewards carry a length or budget penalty (``penalty_aware`` centres them only)."""
    rewards = rewards.to(torch.float64)
    if norm == "penalty_aware":
        norm = "group_mean" if penalised else "group_std"
    if norm == "none":
        return rewards.clone()
    centred = rewards - rewards.mean()
    if norm == "group_mean":
        return centred
    if norm == "group_std":
        return centred / (rewards.std(unbiased=False) + eps)
    raise ValueError(f"unknown advantage normalisation {norm!r}")


def has_reward_variance(rewards: torch.Tensor) -> bool:
    """False when every sample of the group scored the same: no learning signal."""
    return bool((rewards != rewards[0]).any())


# -- log-probs ---------------------------------------------------------------------------
def pad_kept_sets(lengths: "np.ndarray", ids: "np.ndarray", targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept sets in CSR form (``lengths`` [n], ``ids`` concatenated in row order) ->
    (ids [n, Kmax] padded with the target id, lengths [n])."""
    import numpy as np

    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.size
    width = max(int(lengths.max()) if n else 0, 1)
    out = np.repeat(targets.cpu().numpy().astype(np.int64).reshape(n, 1), width, axis=1)
    if ids.size:
        rows = np.repeat(np.arange(n), lengths)
        cols = np.arange(ids.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[rows, cols] = ids
    return torch.from_numpy(out), torch.from_numpy(lengths)


def kept_set_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    kept_ids: torch.Tensor,
    kept_lengths: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """log-prob of ``targets`` under softmax(logits / T) renormalised over the kept sets.

    ``kept_ids`` [n, K] holds each row's kept ids in its first ``kept_lengths`` entries
    (the padding may be any valid id). Only gathered logits receive gradient.
    """
    scaled = logits / _as_column(temperature, logits)
    width = kept_ids.shape[1]
    valid = torch.arange(width, device=logits.device).unsqueeze(0) < kept_lengths.to(logits.device).unsqueeze(1)
    kept_logits = scaled.gather(1, kept_ids.to(logits.device))
    kept_logits = torch.where(valid, kept_logits, torch.full_like(kept_logits, NEG_INF))
    target_logit = scaled.gather(1, targets.to(logits.device).unsqueeze(1)).squeeze(1)
    return target_logit - torch.logsumexp(kept_logits, dim=1)


def full_vocab_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor | float = 1.0
) -> torch.Tensor:
    scaled = logits / _as_column(temperature, logits)
    return torch.log_softmax(scaled, dim=1).gather(1, targets.to(logits.device).unsqueeze(1)).squeeze(1)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    kept_ids: torch.Tensor,
    kept_lengths: torch.Tensor,
    capped: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
    *,
    replay: bool = True,
    capped_policy: str = "full_vocab",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, keep mask) for the loss.

    With replay, a token whose kept set was capped by the engine (incomplete) gets the
    full-vocabulary log-prob (``full_vocab``; an upper bound on the missing mass is
    1 - top_p), is left out of the loss (``mask``), or is renormalised over the
    incomplete set anyway (``kept_set``). Capped sets of known size are rebuilt before
    this (:func:`rebuild_capped_sets`) and arrive here uncapped.
    """
    keep = torch.ones_like(targets, dtype=torch.bool, device=logits.device)
    if not replay:
        return full_vocab_logprobs(logits, targets, temperature), keep
    lp = kept_set_logprobs(logits, targets, kept_ids, kept_lengths, temperature)
    capped = capped.to(device=logits.device, dtype=torch.bool)
    if capped.any():
        if capped_policy == "full_vocab":
            rows = capped.nonzero().squeeze(1)
            temp = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
            full = full_vocab_logprobs(logits[rows], targets.to(logits.device)[rows], temp)
            lp = lp.index_put((rows,), full)
        elif capped_policy == "mask":
            keep = keep & ~capped
        elif capped_policy != "kept_set":
            raise ValueError(f"unknown capped kept-set policy {capped_policy!r}")
    return lp, keep


@dataclass(frozen=True)
class RebuiltSets:
    """Kept sets after rebuilding the capped ones of known size (same layout as the
    inputs of :func:`token_logprobs`) and, per row, what happened."""

    kept_ids: torch.Tensor  # [n, K'] long
    kept_lengths: torch.Tensor  # [n] long
    capped: torch.Tensor  # [n] bool: still capped (size unknown)
    rebuilt: torch.Tensor  # [n] bool: rebuilt as the trainer's top-size
    missing: torch.Tensor  # [n] bool: rebuilt, but the sampled token was not in the top-size
    differs: torch.Tensor  # [n] bool: rebuilt, and a recorded id is not in it (sets differ)


@torch.no_grad()
def rebuild_capped_sets(
    logits: torch.Tensor,
    targets: torch.Tensor,
    kept_ids: torch.Tensor,
    kept_lengths: torch.Tensor,
    capped: torch.Tensor,
    kept_sizes: torch.Tensor,
) -> RebuiltSets:
    """Rebuild each capped kept set whose size the sampler recorded as the trainer's own
    top-``size`` tokens.

    The sampler's set is its top-``size`` (top-p and top-k keep the most likely tokens),
    so with the sampler's weights the rebuilt set is the sampler's set exactly (up to ties
    and float noise at its edge) and the ratio is 1; a capped record holds only the
    sampler's top ``cap`` (plus the sampled token), which alone gives a ratio of
    ``size / cap``-ish, and the full vocabulary ``1 / (1 - missing mass)``-ish. Order by
    logit equals order by ``logit / T`` for any T > 0, so the temperature does not matter.
    When the sampled token is not among the trainer's top-``size`` (weights moved), it
    replaces the least likely one (``missing``): the set keeps its size and holds the
    token, so its log-prob stays finite. Indices only: no gradient flows through the
    choice, the loss gathers the chosen logits as for a recorded set.
    """
    device = logits.device
    targets = targets.to(device)
    capped = capped.to(device=device, dtype=torch.bool)
    # A size above the vocabulary cannot come from a sampler of this model; clamp it so
    # one bad record cannot crash every step that redelivers it (topk would raise).
    kept_sizes = kept_sizes.to(device).clamp(max=logits.shape[1])
    kept_ids = kept_ids.to(device)
    kept_lengths = kept_lengths.to(device)
    n = targets.shape[0]
    none = torch.zeros(n, dtype=torch.bool, device=device)
    # A capped record holding as many ids as the set has (the cap plus a sampled token
    # from just below it) is the whole set: nothing to rebuild.
    capped = capped & (kept_sizes != kept_lengths)
    todo = capped & (kept_sizes > kept_lengths)
    rows = todo.nonzero().squeeze(1)
    if rows.numel() == 0:
        return RebuiltSets(kept_ids, kept_lengths, capped, none, none, none)
    sizes = kept_sizes[rows]
    k = int(sizes.max())
    top = logits[rows].topk(k, dim=1, sorted=True).indices
    tgt = targets[rows]
    valid = torch.arange(k, device=device).unsqueeze(0) < sizes.unsqueeze(1)
    inside = ((top == tgt.unsqueeze(1)) & valid).any(dim=1)
    out_rows = (~inside).nonzero().squeeze(1)
    top[out_rows, sizes[out_rows] - 1] = tgt[out_rows]
    top = torch.where(valid, top, tgt.unsqueeze(1))
    # Did the sampler record an id the rebuilt set lacks? (its ids are its top cap + the token)
    width = kept_ids.shape[1]
    rec = kept_ids[rows]
    rec_valid = torch.arange(width, device=device).unsqueeze(0) < kept_lengths[rows].unsqueeze(1)
    found = (rec.unsqueeze(2) == top.unsqueeze(1)).any(dim=2) | ~rec_valid
    new_width = max(width, k)
    ids = targets.unsqueeze(1).expand(n, new_width).clone()
    ids[:, :width] = kept_ids
    ids[rows] = tgt.unsqueeze(1).expand(-1, new_width)
    ids[rows, :k] = top
    lengths = kept_lengths.clone()
    lengths[rows] = sizes
    still = capped.clone()
    still[rows] = False
    rebuilt, missing, differs = none.clone(), none.clone(), none.clone()
    rebuilt[rows] = True
    missing[rows] = ~inside
    differs[rows] = ~found.all(dim=1)
    return RebuiltSets(ids, lengths, still, rebuilt, missing, differs)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _as_column(temperature: torch.Tensor | float, logits: torch.Tensor) -> torch.Tensor | float:
    if isinstance(temperature, torch.Tensor):
        return temperature.to(device=logits.device, dtype=logits.dtype).reshape(-1, 1)
    return float(temperature)


# -- the policy loss ------------------------------------------------------------------------
@dataclass(frozen=True)
class LossSettings:
    importance_sampling: str = "tis"  # tis | clip | none
    is_cap: float = 2.0
    clip_epsilon: float = 0.2
    truncation: bool = True


def importance_ratio(logprobs: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    return torch.exp(logprobs - behaviour.to(logprobs))


def policy_loss_terms(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    settings: LossSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, per-token 'truncated' flag). Sum and divide by the step's count."""
    adv = advantages.to(logprobs)
    mode = settings.importance_sampling
    if mode == "none":
        return -adv * logprobs, torch.zeros_like(logprobs, dtype=torch.bool)
    ratio = importance_ratio(logprobs, behaviour)
    if mode == "tis":
        raw = ratio.detach()
        truncated = raw > settings.is_cap
        weight = raw.clamp(max=settings.is_cap) if settings.truncation else raw
        return -weight * adv * logprobs, truncated & settings.truncation
    if mode == "clip":
        if not settings.truncation:
            return -ratio * adv, torch.zeros_like(logprobs, dtype=torch.bool)
        eps = settings.clip_epsilon
        unclipped = ratio * adv
        clipped = ratio.clamp(1.0 - eps, 1.0 + eps) * adv
        # The clipped branch is active (gradient zero) where it is strictly smaller.
        active = (clipped < unclipped).detach()
        return -torch.minimum(unclipped, clipped), active
    raise ValueError(f"unknown importance sampling mode {mode!r}")


def masked_loss_sum(per_token: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Sum of the kept tokens' loss; masked tokens contribute exactly nothing."""
    return torch.where(keep, per_token, torch.zeros_like(per_token)).sum()


# -- diagnostics (no gradient) -----------------------------------------------------------------
@torch.no_grad()
def full_vocab_entropy(logits: torch.Tensor, temperature: torch.Tensor | float = 1.0) -> torch.Tensor:
    x = _at_least_float32(logits)
    logp = torch.log_softmax(x / _as_column(temperature, x), dim=1)
    return -(logp.exp() * logp).sum(dim=1)


@torch.no_grad()
def kept_set_entropy(
    logits: torch.Tensor,
    kept_ids: torch.Tensor,
    kept_lengths: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Entropy of the trainer's distribution renormalised over each kept set."""
    x = _at_least_float32(logits)
    scaled = x / _as_column(temperature, x)
    width = kept_ids.shape[1]
    valid = torch.arange(width, device=logits.device).unsqueeze(0) < kept_lengths.to(logits.device).unsqueeze(1)
    kept_logits = scaled.gather(1, kept_ids.to(logits.device)).masked_fill(~valid, NEG_INF)
    logp = torch.log_softmax(kept_logits, dim=1)
    p = logp.exp()
    return -(torch.where(valid, p * logp, torch.zeros_like(p))).sum(dim=1)


@torch.no_grad()
def mismatch_kl(logprobs: torch.Tensor, behaviour: torch.Tensor) -> tuple[float, float]:
    """KL(behaviour || trainer) estimated from tokens drawn by the behaviour policy:
    k1 = E[b - l] (unbiased, noisy) and k3 = E[r - 1 - log r] with r = exp(l - b)
    (unbiased, low variance, never negative)."""
    if logprobs.numel() == 0:
        return 0.0, 0.0
    log_ratio = logprobs.double() - behaviour.to(logprobs.device).double()
    k1 = (-log_ratio).mean()
    k3 = (log_ratio.exp() - 1.0 - log_ratio).mean()
    return float(k1), float(k3)
