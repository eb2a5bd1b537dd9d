"""Group normalisation vs the length penalty (issue #14 item 5): the numbers behind the
``penalty_aware`` default. benchmarks/advantage_norm.py measures where each
normalisation leads a policy (docs/advantages.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from schemas import RecordRef, Reward
from trainer.config import TrainerConfig
from trainer.loss import group_advantages
from trainer.packing import pack_step
from trainer.trajectory import Group, Segment, Trajectory

TOKENS = [100, 150, 200, 250]  # an all-solved group differing only in length


def all_solved(k: float) -> torch.Tensor:
    return torch.tensor([1.0 - k * t for t in TOKENS], dtype=torch.float64)


def test_group_std_cancels_the_penalty_coefficient():
    """Scale-free: +-1.34 and +-0.45 whatever k (up to the eps of 1e-6 on a std of
    0.056 at k = 0.001), as large as solve vs fail (+-1)."""
    expected = [1.3416407, 0.4472136, -0.4472136, -1.3416407]
    for k in (0.001, 0.01):
        assert group_advantages(all_solved(k), "group_std").tolist() == pytest.approx(expected, abs=3e-5)
    assert group_advantages(torch.tensor([1.0, 0.0]), "group_std").tolist() == pytest.approx([1.0, -1.0], abs=1e-5)


def test_penalty_aware_keeps_the_coefficient_in_penalised_groups_only():
    # Penalised (budget phase): the reward differences themselves, k tokens' worth.
    assert group_advantages(all_solved(0.001), "penalty_aware", penalised=True).tolist() == \
        pytest.approx([0.075, 0.025, -0.025, -0.075], abs=1e-12)
    assert group_advantages(all_solved(0.01), "penalty_aware", penalised=True).tolist() == \
        pytest.approx([0.75, 0.25, -0.25, -0.75], abs=1e-12)
    # ... against +-0.5 for solve vs fail at equal length: a solve outweighs 500 tokens at k = 0.001.
    assert group_advantages(torch.tensor([1.0 - 0.1, 0.0 - 0.1], dtype=torch.float64), "penalty_aware", penalised=True).tolist() == \
        pytest.approx([0.5, -0.5], abs=1e-12)
    # No penalty (unconstrained phase): group_std, as before.
    assert group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), "penalty_aware").tolist() == \
        pytest.approx(group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), "group_std").tolist())
    assert TrainerConfig().advantage_norm == "penalty_aware"


def _trajectory(i: int, reward: float, length_penalty: float) -> Trajectory:
    segment = Segment(token_ids=np.array([1, 2, 3], dtype=np.int64), loss_mask=np.array([False, True, True]),
                      behaviour=np.zeros(3, dtype=np.float32),
                      kept_offsets=np.array([0, 0, 1, 2]), kept_ids=np.array([2, 3], np.int32),
                      capped=np.zeros(3, dtype=bool), versions=np.zeros(3, dtype=np.int64),
                      temperature=np.ones(3, dtype=np.float32))
    rew = Reward(trajectory_id=f"t/g/{i}/a", task_id="t", group_id="g", sample_index=i, attempt="a", score=1.0,
                 reward=reward, length_penalty=length_penalty, phase="budget" if length_penalty else "unconstrained")
    return Trajectory(f"t/g/{i}/a", "t", "g", i, len(TOKENS), "a", [segment], rew, [], RecordRef("r", 0, i))


def test_pack_step_picks_the_normalisation_from_the_groups_penalties():
    penalised = Group("t", "g", [_trajectory(i, 1.0 - 0.001 * t, 0.001 * t) for i, t in enumerate(TOKENS)])
    packed = pack_step([penalised], 0, TrainerConfig())
    assert packed.advantages == pytest.approx([0.075, 0.025, -0.025, -0.075], abs=1e-12)
    plain = Group("t", "g", [_trajectory(i, r, 0.0) for i, r in enumerate([1.0, 0.0, 1.0, 0.0])])
    assert pack_step([plain], 0, TrainerConfig()).advantages == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
