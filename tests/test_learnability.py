"""Learning works end to end on the task family: RL steps of the real trainer core on a
fixed tiny batch of one family kind make the policy prefer the trajectories the real
grader rewarded.

The batch: two ``arith`` train tasks, a group of four rollouts each, laid out exactly as
the agent loop records them (:func:`trainer.sft.render_transcript`): the reference
solution twice and two planted-wrong solutions. Each written file is graded by the live
sandbox grader (reward 1 or 0). Behaviour log-probs and kept sets (top_p = 1: the whole
vocabulary) come from the model itself, so the first step is on-policy. After a few
``TrainCore.train_step`` calls on those groups, every rewarded trajectory is more likely
than before, and the policy's preference ``log p(right) - log p(wrong)`` rises for every
pair of a group. Fixed seeds, one thread; no thresholds
on exact floats, only directions and a margin that any working update clears by far.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from sandbox.client import SandboxClient
from sandbox.config import RewardConfig, SandboxConfig
from sampler import tool_format as fmt
from sampler.tiny_model import tiny_model_dir
from schemas import RecordRef
from tasks.family import generate
from tasks.store import TaskStore
from tests.sandbox_helpers import live_sandbox
from tests.synthetic import SampledTrajectory, assemble_events, to_events
from trainer.config import TrainerConfig
from trainer.sft import render_transcript

from tests.trainer_helpers import one_thread  # noqa: F401  (fixture)

STEPS = 4


def wrong_variants(spec) -> list:
    """The reference with its last constant changed: two planted-wrong solutions."""
    path, source = next(iter(spec.solution.items()))
    digit = next(ch for ch in reversed(source) if ch.isdigit())
    at = source.rindex(digit)
    out = []
    for delta in (1, 2):
        wrong = source[:at] + str((int(digit) + delta) % 10) + source[at + 1:]
        out.append(spec.__class__(**{**{f: getattr(spec, f) for f in spec.__struct_fields__},
                                     "solution": {path: wrong}}))
    return out


async def grade_all(specs) -> list[float]:
    cfg = SandboxConfig(max_sessions=len(specs), max_concurrent_commands=max(2, os.cpu_count() or 2),
                        command_queue_timeout_s=600.0)
    async with live_sandbox(cfg, RewardConfig(), TaskStore("tasks/demo")) as live, SandboxClient(live.url) as client:

        async def grade(i: int, spec) -> float:
            sid = await client.create_session(spec.task_id)
            for path, content in spec.solution.items():
                await client.write_file(sid, path, content)
            return (await client.submit(sid, trajectory_id=f"learn-{i}")).reward

        return list(await asyncio.gather(*(grade(i, s) for i, s in enumerate(specs))))


def sequence_logprobs(model, ids: list[int], mask: list[int]) -> np.ndarray:
    """Per-token log-probs of the policy tokens under ``model`` (full vocabulary)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
    return lp[np.asarray(mask[1:], dtype=bool)]


def test_rl_steps_raise_the_rewarded_samples():
    import torch

    from trainer.core import TrainCore
    from trainer.trajectory import groups_from_trajectories

    model_path = str(tiny_model_dir())
    core = TrainCore(TrainerConfig(model_path=model_path, device="cpu", num_threads=1, seed=0,
                                   learning_rate=1e-3, muon_learning_rate=1e-3, max_staleness=STEPS + 1,
                                   groups_per_step=2), model_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    vocab = list(range(core.model.config.vocab_size))
    tasks = generate("train", 2, seed=7, kinds=["arith"])
    members = [[t, *wrong_variants(t), t] for t in tasks]  # right, wrong, wrong, right
    flat = [s for group in members for s in group]
    scores = asyncio.run(grade_all(flat))
    assert scores == [1.0, 0.0, 0.0, 1.0] * len(tasks)  # the real grader tells them apart

    rendered = [render_transcript(s, tok) for s in flat]
    core.model.eval()
    before = [sequence_logprobs(core.model, ids, mask) for ids, mask in rendered]
    trajectories, offset = [], 0
    for i, ((ids, mask), spec, score, lps) in enumerate(zip(rendered, flat, scores, before)):
        behaviour = [0.0] * len(ids)
        for pos, lp in zip(np.flatnonzero(mask), lps):
            behaviour[pos] = float(lp)
        g = i // 4
        sampled = SampledTrajectory(
            task_id=tasks[g].task_id, group_id=f"learn-g{g}", sample_index=i % 4, group_size=4, attempt="a0",
            token_ids=ids, loss_mask=mask, logprobs=behaviour, kept=[vocab if m else [] for m in mask],
            capped=[0] * len(ids), versions=[0] * len(ids), temperature=1.0, top_p=1.0, finish_reason="submitted")
        chunks, reward = to_events(sampled, score=score, chunk_tokens=64)
        refs = [RecordRef("learn.trajectories", 0, offset + k) for k in range(len(chunks))]
        offset += len(chunks)
        trajectories.append(assemble_events(chunks, refs, reward, RecordRef("learn.rewards", 0, offset)))
    groups = groups_from_trajectories(trajectories)
    assert [sorted(g.rewards()) for g in groups] == [[0.0, 0.0, 1.0, 1.0]] * 2

    for _ in range(STEPS):
        result = core.train_step(groups)
        assert np.isfinite(result.metrics["loss"]) and result.metrics["grad_norm"] > 0
    core.model.eval()
    after = [sequence_logprobs(core.model, ids, mask) for ids, mask in rendered]

    delta = [float(a.sum() - b.sum()) for a, b in zip(after, before)]
    assert torch.isfinite(torch.tensor(delta)).all()
    for i, score in enumerate(scores):
        if score == 1.0:
            assert delta[i] > 0.5, (i, delta)  # rewarded: more likely (nats, whole sequence)
    # Right and wrong share all tokens but one constant, and those shared tokens may rise
    # for both; what must rise is the preference of the rewarded over each unrewarded one.
    for g in range(len(tasks)):
        right = 4 * g
        for wrong in (4 * g + 1, 4 * g + 2):
            preference_before = before[right].sum() - before[wrong].sum()
            preference_after = after[right].sum() - after[wrong].sum()
            assert preference_after > preference_before + 1.0, (g, wrong, preference_before, preference_after)
