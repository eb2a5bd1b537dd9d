"""Rollouts sampled with plain torch, as real ``TrajectoryChunk``/``Reward`` events.

Tests and the benchmark need trajectories whose behaviour log-probs and kept sets come
from a real model, without a sampler service: this module does top-p sampling the way
an engine does (temperature, nucleus, renormalise, draw), records the kept set and the
behaviour log-prob over it per generated token, optionally splices environment tokens
(a tool output, loss mask 0) into the middle, and cuts the result into chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from schemas import Cost, Reward, TrajectoryChunk, arrays

if TYPE_CHECKING:
    import torch


@dataclass
class SampledTrajectory:
    task_id: str
    group_id: str
    sample_index: int
    group_size: int
    attempt: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    kept: list[list[int]]
    capped: list[int]
    versions: list[int]
    temperature: float
    top_p: float
    finish_reason: str = "length"
    extra: dict = field(default_factory=dict)

    @property
    def trajectory_id(self) -> str:
        return f"{self.task_id}/{self.group_id}/{self.sample_index}/{self.attempt}"

    @property
    def generated(self) -> list[int]:
        return [t for t, m in zip(self.token_ids, self.loss_mask) if m]


def nucleus(probs: "torch.Tensor", top_p: float) -> "torch.Tensor":
    """Token ids top-p keeps (descending probability): the smallest prefix reaching top_p."""
    import torch

    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    before = torch.cumsum(sorted_p, 0) - sorted_p
    return order[before < top_p] if top_p < 1.0 else order[sorted_p > 0]


def sample_group(
    model: "torch.nn.Module",
    prompt_ids: Sequence[int],
    *,
    task_id: str,
    group_id: str,
    group_size: int = 4,
    max_new_tokens: int = 12,
    temperature: float = 1.0,
    top_p: float = 0.9,
    kept_cap: int | None = None,
    version: int = 0,
    seed: int = 0,
    env_tokens: Sequence[int] = (),
    env_after: int | None = None,
    attempt: str = "a0",
    sample_indices: Sequence[int] | None = None,
) -> list[SampledTrajectory]:
    """Sample ``group_size`` trajectories (or the given ``sample_indices``) of a task."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    indices = list(sample_indices if sample_indices is not None else range(group_size))
    rows = len(indices)
    # Every row has the same length at every step (same prompt, same splice point),
    # so the group is sampled as one batch.
    tokens = [[int(t) for t in prompt_ids] for _ in range(rows)]
    n0 = len(tokens[0])
    mask = [[0] * n0 for _ in range(rows)]
    lps = [[0.0] * n0 for _ in range(rows)]
    kept: list[list[list[int]]] = [[[] for _ in range(n0)] for _ in range(rows)]
    capped = [[0] * n0 for _ in range(rows)]
    generated = 0
    env_done = False
    while generated < max_new_tokens:
        if env_after is not None and generated == env_after and env_tokens and not env_done:
            env_done = True
            for r in range(rows):
                for t in env_tokens:
                    tokens[r].append(int(t)); mask[r].append(0); lps[r].append(0.0); kept[r].append([])
                    capped[r].append(0)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(tokens, device=device)).logits[:, -1].float().cpu()
        for r in range(rows):
            scaled = logits[r] / temperature
            keep = nucleus(torch.softmax(scaled, dim=0), top_p)
            renorm = torch.log_softmax(scaled[keep], dim=0)
            choice = int(torch.multinomial(renorm.exp(), 1, generator=gen))
            token = int(keep[choice])
            ids = keep.tolist()
            was_capped = 0
            if kept_cap is not None and len(ids) > kept_cap:
                was_capped = 1
                ids = ids[:kept_cap] + ([token] if token not in ids[:kept_cap] else [])
            tokens[r].append(token); mask[r].append(1); lps[r].append(float(renorm[choice]))
            kept[r].append(ids); capped[r].append(was_capped)
        generated += 1
    return [
        SampledTrajectory(
            task_id=task_id, group_id=group_id, sample_index=index, group_size=group_size,
            attempt=attempt, token_ids=tokens[r], loss_mask=mask[r], logprobs=lps[r], kept=kept[r],
            capped=capped[r], versions=[version] * len(tokens[r]), temperature=temperature, top_p=top_p,
        )
        for r, index in enumerate(indices)
    ]


def parity_score(traj: SampledTrajectory) -> float:
    """A stand-in grader: solved when the generated ids sum to an even number."""
    return 1.0 if sum(traj.generated) % 2 == 0 else 0.0


def to_events(
    traj: SampledTrajectory,
    *,
    score: float | None = None,
    reward: float | None = None,
    chunk_tokens: int = 16,
    replica_id: str = "synthetic",
    score_fn: Callable[[SampledTrajectory], float] = parity_score,
) -> tuple[list[TrajectoryChunk], Reward]:
    """The trajectory as chunk events (``chunk_tokens`` each, last one final) and its reward."""
    n = len(traj.token_ids)
    chunks = []
    starts = list(range(0, n, chunk_tokens))
    for i, s in enumerate(starts):
        e = min(s + chunk_tokens, n)
        offsets, ids = arrays.pack_csr(traj.kept[s:e])
        vstarts, versions = arrays.pack_spans(traj.versions[s:e])
        final = i == len(starts) - 1
        chunks.append(TrajectoryChunk(
            trajectory_id=traj.trajectory_id, task_id=traj.task_id, group_id=traj.group_id,
            sample_index=traj.sample_index, group_size=traj.group_size, attempt=traj.attempt,
            replica_id=replica_id, chunk_index=i,
            token_ids=arrays.pack(traj.token_ids[s:e], arrays.INT32),
            logprobs=arrays.pack(traj.logprobs[s:e], arrays.FLOAT32),
            loss_mask=arrays.pack(traj.loss_mask[s:e], arrays.UINT8),
            kept_offsets=offsets, kept_ids=ids,
            kept_capped=arrays.pack(traj.capped[s:e], arrays.UINT8),
            version_starts=vstarts, versions=versions,
            temperature=traj.temperature, top_p=traj.top_p,
            final=final, finish_reason=traj.finish_reason if final else "",
            cost=Cost(generated_tokens=len(traj.generated), env_tokens=n - len(traj.generated)) if final else None,
        ))
    s = score_fn(traj) if score is None else score
    r = s if reward is None else reward
    rew = Reward(
        trajectory_id=traj.trajectory_id, task_id=traj.task_id, group_id=traj.group_id,
        sample_index=traj.sample_index, attempt=traj.attempt, score=s, reward=r,
        tests_passed=int(s >= 1.0), tests_total=1, weight_version=max(traj.versions),
        cost=Cost(generated_tokens=len(traj.generated)),
    )
    return chunks, rew


def prompt_ids(tokenizer, instruction: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": instruction}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text)["input_ids"]


def make_task_groups(
    model: "torch.nn.Module",
    tokenizer,
    num_groups: int,
    *,
    group_size: int = 4,
    max_new_tokens: int = 12,
    top_p: float = 0.9,
    version: int = 0,
    seed: int = 0,
    prefix: str = "task",
    env_after: int | None = 4,
    require_variance: bool = True,
) -> list[list[SampledTrajectory]]:
    """``num_groups`` groups of distinct tasks, with environment tokens spliced in, and
    (by default) resampled until the parity scores differ within each group."""
    env = tokenizer("<output>ok</output>")["input_ids"] if env_after is not None else []
    groups = []
    for g in range(num_groups):
        attempt_seed = seed * 100_003 + g * 101
        while True:
            trajs = sample_group(
                model, prompt_ids(tokenizer, f"Fix `f{g}` in solution.py so the tests pass."),
                task_id=f"{prefix}-{g}", group_id=f"g{g}", group_size=group_size,
                max_new_tokens=max_new_tokens, top_p=top_p, version=version, seed=attempt_seed,
                env_tokens=env, env_after=env_after,
            )
            scores = {parity_score(t) for t in trajs}
            if not require_variance or len(scores) > 1:
                break
            attempt_seed += 1
        groups.append(trajs)
    return groups


def load_tiny(model_path: str):
    """(float32 model in eval mode, tokenizer) from a model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_path)


def versions_array(traj: SampledTrajectory) -> np.ndarray:
    return np.asarray(traj.versions, dtype=np.int64)


def groups_from_sampled(
    sampled: Sequence[Sequence[SampledTrajectory]], *, chunk_tokens: int = 16, topic: str = "offline"
) -> list:
    """Trainer ``Group`` objects straight from sampled trajectories, through the same
    event encoding and assembly as live data (record positions are made up)."""
    from schemas import RecordRef
    from trainer.trajectory import assemble, groups_from_trajectories

    trajectories = []
    offset = 0
    for group in sampled:
        for traj in group:
            chunks, reward = to_events(traj, chunk_tokens=chunk_tokens)
            refs = [RecordRef(f"{topic}.trajectories", 0, offset + i) for i in range(len(chunks))]
            offset += len(chunks)
            trajectories.append(assemble(chunks, refs, reward, RecordRef(f"{topic}.rewards", 0, offset)))
            offset += 1
    return groups_from_trajectories(trajectories)
