"""Supervised fine-tuning on reference transcripts in Rollway's exact tool format.

A transcript is the token stream the agent loop (:mod:`sampler.agent`) would build for
a rollout that solves the task the reference way::

    <task prompt>                              environment (mask 0)
    <|im_start|>assistant\\n                     environment
    <tool>read calc.py</tool>                  policy (mask 1)      fix tasks only
    <|im_end|>\\n<|im_start|>tool\\n<output>...file...</output><|im_end|>\\n
    <|im_start|>assistant\\n<tool>write calc.py\\n...solution...</tool>     policy
    <|im_end|>\\n<|im_start|>tool\\n<output>wrote calc.py (N bytes)</output><|im_end|>\\n
    <|im_start|>assistant\\n<tool>submit</tool>                          policy

Environment text is encoded exactly as ``AgentLoop.encode`` does (untrusted pieces with
special tokens split); the loss is on policy tokens only. The loop reuses the trainer's
deterministic setup (:func:`trainer.model.make_deterministic`) and optimizer
(:class:`trainer.optim.HybridOptimizer`: Muon for hidden matrices, AdamW for the rest).
"""

from __future__ import annotations

import math
import random
import time
from typing import TYPE_CHECKING, Callable, Sequence

import msgspec
import structlog

from sampler import tool_format as fmt
from tasks.spec import TaskSpec

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)


class SFTConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # 2,000 steps for the default chatml-hermes warm start (premature_submit_rate 0.5): its
    # transcripts are ~650 tokens (the template's tool schemas), and 500 or 1,000 steps left
    # it too weak for RL to reach +20 points in 30 minutes (docs/results.md, issue #27);
    # ~26 min of build on a quiet 2-core machine. The rollway format's warm start learns
    # the same in 500 (`rollway model init --format rollway --steps 500`, its documented runs).
    steps: int = 2000
    batch_size: int = 16
    # Distinct train tasks rendered (recycled in epochs); fixed, not steps * batch.
    examples: int = 9600
    learning_rate: float = 3e-3  # AdamW: embeddings, norms, head
    muon_learning_rate: float = 3e-3  # Muon (RMS matched to AdamW)
    warmup_steps: int = 20
    # Linear decay from the peak to this fraction of it at the last step. Annealing to
    # zero buys a lower final loss for the same CPU budget than a constant rate.
    final_lr_fraction: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    # One intra-op thread: deterministic, and on a shared 2-core machine two OpenMP
    # threads contend badly (tests/trainer_helpers.py saw 20x slower steps).
    num_threads: int = 1
    log_every: int = 25
    # The imitated teacher submits before writing any code in this share of its
    # episodes (the premature-submit habit of weak agents): the first action's name is
    # taught as a soft target, ``submit`` with this probability and the reference action
    # otherwise. Equivalent in expectation to mixing in that share of submit-only
    # demonstrations, without taking the content examples away. 0 = a flawless teacher:
    # its warm start learns the skill RL then has to extend to held-out combinations,
    # which 30 minutes of CPU RL did not do (docs/results.md, "a flawless teacher").
    premature_submit_rate: float = 0.5

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.examples < 1:
            raise ValueError("sft.steps, sft.batch_size and sft.examples must be >= 1")
        if not 0.0 <= self.premature_submit_rate < 1.0:
            raise ValueError(f"sft.premature_submit_rate must be in [0, 1), got {self.premature_submit_rate}")


def encode_pieces(tokenizer, pieces: Sequence[fmt.Piece]) -> list[int]:
    """``AgentLoop.encode``: trusted markup with special tokens, untrusted text split."""
    out: list[int] = []
    for text, trusted in pieces:
        if text:
            out.extend(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not trusted))
    return out


def reference_turns(spec: TaskSpec) -> list[tuple[str, str | None]]:
    """(assistant message, tool reply) of the reference rollout; the last reply is None."""
    turns: list[tuple[str, str | None]] = []
    if spec.metadata.get("kind") == "fix":
        # The module has a second function to keep: read it before rewriting it.
        for path, content in spec.files.items():
            turns.append((f"{fmt.TOOL_OPEN}read {path}{fmt.TOOL_CLOSE}", content))
    for path, content in spec.solution.items():
        turns.append((f"{fmt.TOOL_OPEN}write {path}\n{content}{fmt.TOOL_CLOSE}",
                      f"wrote {path} ({len(content.encode())} bytes)"))
    turns.append((f"{fmt.TOOL_OPEN}submit{fmt.TOOL_CLOSE}", None))
    return turns


def render_transcript(spec: TaskSpec, tokenizer) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of the reference rollout, as the agent loop lays it out."""
    ids = encode_pieces(tokenizer, fmt.task_prompt(spec.instruction, spec.files))
    mask = [0] * len(ids)
    for message, reply in reference_turns(spec):
        header = encode_pieces(tokenizer, fmt.assistant_header(""))
        # The model's own text: special tokens (<tool>, </tool>) are single tokens.
        policy = tokenizer.encode(message, add_special_tokens=False)
        ids += header + policy
        mask += [0] * len(header) + [1] * len(policy)
        if reply is not None:
            # Generation stops at </tool> (not <|im_end|>), so the reply closes the turn.
            env = encode_pieces(tokenizer, fmt.tool_reply(reply, closed_turn=False))
            ids += env
            mask += [0] * len(env)
    return ids, mask


def first_action_index(mask: Sequence[int]) -> int:
    """Index of the first action's name token (``write``, ``read``) in a rendered
    transcript: the token after the first policy token, ``<tool>``."""
    return list(mask).index(1) + 1


def submit_token(tokenizer) -> int:
    """The first token of a ``submit`` call's name after ``<tool>`` (the warm start's BPE
    makes ``submit`` one token: every transcript ends with it). Its continuation to
    ``</tool>`` is learned from every transcript's final call."""
    submit = tokenizer.encode(f"{fmt.TOOL_OPEN}submit{fmt.TOOL_CLOSE}", add_special_tokens=False)[1]
    others = {tokenizer.encode(f"{fmt.TOOL_OPEN}{name} x", add_special_tokens=False)[1] for name in ("write", "read")}
    if submit in others:
        raise ValueError("the tokenizer starts submit like write or read: no distinct first action token")
    return submit


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.float32)
    for row, (tokens, m) in enumerate(examples):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


# Below this many shared tokens a second forward pass costs about what sharing saves.
MIN_SHARED_PREFIX = 64


def shared_prefix_length(ids: "torch.Tensor") -> int:
    """How many leading tokens every row of ``ids`` has in common, at most one less than
    the width (the rows' own part is never empty)."""
    differs = (ids != ids[:1]).any(dim=0).nonzero()
    length = int(differs[0, 0]) if len(differs) else ids.shape[1]
    return min(length, ids.shape[1] - 1)


def batch_logits(model, ids: "torch.Tensor") -> "torch.Tensor":
    """``model(input_ids=ids).logits``, with the prefix every row shares run once: its
    keys and values are computed for one row and repeated for the others (gradients flow
    back through the repeat). A chat format's transcripts all open with the same system
    prompt and tool schemas (~520 of ~650 tokens in chatml-hermes), which otherwise cost
    most of an SFT step; the logits equal the plain forward's up to float rounding
    (tests/test_sft.py)."""
    import torch

    rows = ids.shape[0]
    prefix = shared_prefix_length(ids)
    if rows == 1 or prefix < MIN_SHARED_PREFIX:
        return model(input_ids=ids).logits
    shared = model(input_ids=ids[:1, :prefix], use_cache=True)
    cache = shared.past_key_values
    cache.batch_repeat_interleave(rows)
    rest = model(input_ids=ids[:, prefix:], past_key_values=cache).logits
    return torch.cat([shared.logits.expand(rows, -1, -1), rest], dim=1)


def masked_loss(model, ids: "torch.Tensor", mask: "torch.Tensor",
                premature: tuple["torch.Tensor", int, float] | None = None) -> "torch.Tensor":
    """Mean next-token cross-entropy over policy tokens. Right padding under a causal
    mask never reaches a real token, so no attention mask is needed.

    ``premature = (first_action_index per row, submit token, rate)``: at each row's first
    action the target is the mixture ``rate * submit + (1 - rate) * reference``, so the
    cross-entropy there is ``(1 - rate) CE(reference) + rate CE(submit)``."""
    import torch
    import torch.nn.functional as F

    logits = batch_logits(model, ids)[:, :-1].float()
    targets, weights = ids[:, 1:], mask[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    total = (ce * weights.reshape(-1)).sum()
    if premature is not None:
        index, token, rate = premature
        rows = torch.arange(ids.shape[0])
        at = index - 1  # logits at position i predict token i + 1
        reference = ce.view(ids.shape[0], -1)[rows, at]
        alternative = -F.log_softmax(logits[rows, at], dim=-1)[:, token]
        total = total + rate * (alternative - reference).sum()
    return total / weights.sum().clamp(min=1.0)


def lr_factor(step: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    return 1.0 - (1.0 - cfg.final_lr_fraction) * (step - cfg.warmup_steps) / span


def train_sft(
    model: "torch.nn.Module",
    examples: list[tuple[list[int], list[int]]],
    cfg: SFTConfig,
    *,
    pad_id: int,
    submit_id: int | None = None,
    on_step: Callable[[int, float], None] | None = None,
    first_actions: Sequence[int] | None = None,
) -> dict[str, float]:
    """``cfg.steps`` optimizer steps over ``examples`` (shuffled by ``cfg.seed``, in
    epochs). Returns summary numbers; the model is trained in place. ``submit_id`` (see
    :func:`submit_token`) is needed when ``cfg.premature_submit_rate > 0``."""
    import torch

    from trainer.config import TrainerConfig
    from trainer.optim import HybridOptimizer

    if not examples:
        raise ValueError("no SFT examples")
    if cfg.premature_submit_rate > 0 and submit_id is None:
        raise ValueError("sft.premature_submit_rate > 0 needs the submit token id")
    opt = HybridOptimizer(model, TrainerConfig(learning_rate=cfg.learning_rate,
                                               muon_learning_rate=cfg.muon_learning_rate, weight_decay=0.0))
    base_lr = {name: [g["lr"] for g in o.param_groups] for name, o in opt.optimizers.items()}
    order_rng = random.Random(cfg.seed)
    order: list[int] = []
    model.train()
    started = time.perf_counter()
    losses: list[float] = []
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            epoch = list(range(len(examples)))
            order_rng.shuffle(epoch)
            order += epoch
        picked, order = order[: cfg.batch_size], order[cfg.batch_size :]
        batch = [examples[i] for i in picked]
        ids, mask = _batch(batch, pad_id)
        premature = None
        if cfg.premature_submit_rate > 0:
            # The first action's name token: after <tool> in the dialect; chat formats
            # give it per example (sampler/formats/sft.py).
            first = torch.tensor([first_actions[i] if first_actions is not None else first_action_index(batch[j][1])
                                  for j, i in enumerate(picked)])
            premature = (first, submit_id, cfg.premature_submit_rate)
        factor = lr_factor(step, cfg)
        for name, o in opt.optimizers.items():
            for group, lr in zip(o.param_groups, base_lr[name]):
                group["lr"] = lr * factor
        loss = masked_loss(model, ids, mask, premature)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.max_grad_norm, foreach=False)
        opt.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
        if cfg.log_every and (step + 1) % cfg.log_every == 0:
            recent = losses[-cfg.log_every :]
            log.info("sft", step=step + 1, loss=round(sum(recent) / len(recent), 4),
                     elapsed_s=round(time.perf_counter() - started, 1))
    opt.zero_grad()
    model.eval()
    tail = losses[-max(1, min(len(losses), cfg.log_every or 10)) :]
    return {"steps": float(cfg.steps), "final_loss": sum(tail) / len(tail),
            "first_loss": losses[0], "seconds": time.perf_counter() - started,
            "loss_is_finite": float(all(math.isfinite(x) for x in losses))}
