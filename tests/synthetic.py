"""Rollouts sampled with plain torch, as real ``TrajectoryChunk``/``Reward`` events.

Tests and the trainer benchmark need trajectories whose behaviour log-probs and kept
sets come from a real model, without a sampler service or a sandbox. Everything that
decides what goes on the bus is the samplers' own code:

* the behaviour distribution, the draw and the kept set are
  :func:`sampler.sampling.processed_logprobs` and :func:`sampler.sampling.kept_set_from_row`,
  exactly as :class:`sampler.torch_engine.TorchEngine` steps (vLLM's top-p rule);
* the chunks are written by :class:`sampler.recorder.TrajectoryRecorder`, so they are
  byte for byte what a sampler would publish for the same tokens.

What stays made up: the whole group is decoded as one batch without a KV cache,
environment tokens (a tool output, loss mask 0) are spliced in at a fixed step, and the
reward is a stand-in grader (:func:`parity_score`) instead of the sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Coroutine, Sequence

import numpy as np

from sampler.engine import SampledToken
from sampler.recorder import TrajectoryIdentity, TrajectoryRecorder
from sampler.sampling import SamplingParams, kept_set_from_row, processed_logprobs
from schemas import Cost, Reward, TrajectoryChunk

if TYPE_CHECKING:
    import torch


@dataclass
class SampledTrajectory:
    """One rollout, token by token (tests edit these fields before encoding)."""

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
    # Kept-set size per token where ``kept`` holds only part of a capped set (None: the
    # recorder derives it: complete sets their id count, capped ones unknown).
    kept_sizes: list[int] | None = None

    @property
    def trajectory_id(self) -> str:
        return f"{self.task_id}/{self.group_id}/{self.sample_index}/{self.attempt}"

    @property
    def generated(self) -> list[int]:
        return [t for t, m in zip(self.token_ids, self.loss_mask) if m]


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
    version: int = 0,
    seed: int = 0,
    env_tokens: Sequence[int] = (),
    env_after: int | None = None,
) -> list[SampledTrajectory]:
    """``group_size`` trajectories of a task; ``env_tokens`` spliced in after ``env_after``
    generated tokens. Each step draws like ``TorchEngine``: the processed log-probs of
    :mod:`sampler.sampling`, one multinomial draw per row, the exact kept set."""
    import torch

    params = SamplingParams(temperature=temperature, top_p=top_p)
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    # Every row has the same length at every step (same prompt, same splice point),
    # so the group is sampled as one batch.
    tokens = [[int(t) for t in prompt_ids] for _ in range(group_size)]
    n0 = len(tokens[0])
    mask = [[0] * n0 for _ in range(group_size)]
    lps = [[0.0] * n0 for _ in range(group_size)]
    kept: list[list[list[int]]] = [[[] for _ in range(n0)] for _ in range(group_size)]
    for generated in range(max_new_tokens):
        if generated == env_after:
            for r in range(group_size):
                for t in env_tokens:
                    tokens[r].append(int(t)); mask[r].append(0); lps[r].append(0.0); kept[r].append([])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(tokens, device=device)).logits[:, -1].float().cpu()
        lp = processed_logprobs(logits, params)
        if params.greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(-1)
        chosen = lp.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
        for r in range(group_size):
            tokens[r].append(int(sampled[r])); mask[r].append(1); lps[r].append(float(chosen[r]))
            kept[r].append(kept_set_from_row(lp[r]).ids.tolist())
    n = len(tokens[0])
    return [
        SampledTrajectory(
            task_id=task_id, group_id=group_id, sample_index=r, group_size=group_size, attempt="a0",
            token_ids=tokens[r], loss_mask=mask[r], logprobs=lps[r], kept=kept[r], capped=[0] * n,
            versions=[version] * n, temperature=temperature, top_p=top_p,
        )
        for r in range(group_size)
    ]


def parity_score(traj: SampledTrajectory) -> float:
    """A stand-in grader: solved when the generated ids sum to an even number."""
    return 1.0 if sum(traj.generated) % 2 == 0 else 0.0


def _run_to_end(coro: Coroutine):
    """Run a coroutine that never suspends (the recorder with a publish that only
    collects) without an event loop, so sync and async callers can both use it."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the recorder suspended: its publish must not await anything")


async def _record(traj: SampledTrajectory, chunk_tokens: int, replica_id: str) -> list[TrajectoryChunk]:
    chunks: list[TrajectoryChunk] = []

    async def collect(chunk: TrajectoryChunk) -> None:
        chunks.append(chunk)

    rec = TrajectoryRecorder(
        TrajectoryIdentity(
            trajectory_id=traj.trajectory_id, task_id=traj.task_id, group_id=traj.group_id,
            sample_index=traj.sample_index, group_size=traj.group_size, attempt=traj.attempt,
            replica_id=replica_id, temperature=traj.temperature, top_p=traj.top_p,
        ),
        collect, chunk_tokens=chunk_tokens,
    )
    for i, (tok, m, version) in enumerate(zip(traj.token_ids, traj.loss_mask, traj.versions)):
        if m:
            await rec.add_sampled(SampledToken(
                traj.sample_index, int(tok), float(traj.logprobs[i]), np.asarray(traj.kept[i], dtype=np.int32),
                bool(traj.capped[i]), int(version),
                kept_size=None if traj.kept_sizes is None else int(traj.kept_sizes[i])))
        else:
            await rec.add_env([int(tok)], int(version))
    await rec.finish(traj.finish_reason, Cost(generated_tokens=rec.generated_tokens, env_tokens=rec.env_tokens,
                                              segments=rec.segment_index + 1))
    return chunks


def to_events(
    traj: SampledTrajectory,
    *,
    score: float | None = None,
    reward: float | None = None,
    chunk_tokens: int = 16,
    replica_id: str = "synthetic",
    score_fn: Callable[[SampledTrajectory], float] = parity_score,
) -> tuple[list[TrajectoryChunk], Reward]:
    """The trajectory as the chunks a sampler's ``TrajectoryRecorder`` publishes for it
    (``chunk_tokens`` each, the last one final) and its reward."""
    chunks = _run_to_end(_record(traj, chunk_tokens, replica_id))
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


def assemble_events(chunks: Sequence[TrajectoryChunk], refs: Sequence, reward: Reward, reward_ref):
    """A trainer ``Trajectory`` from a trajectory's events, checked at the trainer's
    boundary (``check_chunk``) and assembled as live records are."""
    from trainer.trajectory import assemble, check_chunk

    return assemble([check_chunk(c) for c in chunks], refs, reward, reward_ref)


def groups_from_sampled(
    sampled: Sequence[Sequence[SampledTrajectory]], *, chunk_tokens: int = 16, topic: str = "offline"
) -> list:
    """Trainer ``Group`` objects straight from sampled trajectories, through the same
    event encoding and assembly as live data (record positions are made up)."""
    from schemas import RecordRef
    from trainer.trajectory import groups_from_trajectories

    trajectories = []
    offset = 0
    for group in sampled:
        for traj in group:
            chunks, reward = to_events(traj, chunk_tokens=chunk_tokens)
            refs = [RecordRef(f"{topic}.trajectories", 0, offset + i) for i in range(len(chunks))]
            offset += len(chunks)
            trajectories.append(assemble_events(chunks, refs, reward, RecordRef(f"{topic}.rewards", 0, offset)))
            offset += 1
    return groups_from_trajectories(trajectories)


async def engine_group(engine, prompt: Sequence[int], params: SamplingParams, *, task_id: str = "task",
                       group_id: str = "g", chunk_tokens: int = 256):
    """A trainer ``Group`` of ``params.n`` samples drawn by a real engine (TorchEngine or
    VLLMEngine) from ``prompt``, each recorded by its own ``TrajectoryRecorder`` as a
    sampler does (kept sets, versions, routed experts) and assembled as the trainer does.
    Stand-in rewards alternate 0, 1 so the group has variance."""
    from schemas import RecordRef
    from trainer.trajectory import Group

    samples = params.n
    chunks: list[list[TrajectoryChunk]] = [[] for _ in range(samples)]
    recorders = []
    for i in range(samples):
        async def publish(chunk: TrajectoryChunk, i: int = i) -> None:
            chunks[i].append(chunk)
        recorders.append(TrajectoryRecorder(
            TrajectoryIdentity(trajectory_id=f"{task_id}/{group_id}/{i}", task_id=task_id, group_id=group_id,
                               sample_index=i, group_size=samples, attempt="a0",
                               temperature=params.temperature, top_p=params.top_p, top_k=params.top_k),
            publish, chunk_tokens=chunk_tokens))
        await recorders[i].add_env(list(prompt), engine.weight_version)
    finish = ["length"] * samples
    async for event in engine.generate(list(prompt), params):
        if isinstance(event, SampledToken):
            await recorders[event.sample_index].add_sampled(event)
        else:
            finish[event.sample_index] = event.finish_reason
            if event.routed_experts is not None:
                recorders[event.sample_index].attach_routed_experts(event.routed_experts)
    members = []
    for i, rec in enumerate(recorders):
        await rec.finish(finish[i], Cost(generated_tokens=rec.generated_tokens))
        tid = rec.identity.trajectory_id
        reward = Reward(trajectory_id=tid, task_id=task_id, group_id=group_id, sample_index=i, attempt="a0",
                        score=float(i % 2), reward=float(i % 2), weight_version=rec.newest_generated_version)
        refs = [RecordRef("engine.trajectories", 0, k) for k in range(len(chunks[i]))]
        members.append(assemble_events(chunks[i], refs, reward, RecordRef("engine.rewards", 0, i)))
    return Group(task_id, group_id, members)
