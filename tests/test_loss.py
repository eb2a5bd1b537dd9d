"""The loss functions with exact numbers (trainer/loss.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from schemas.arrays import csr_arrays
from trainer import loss as L

F64 = torch.float64


def kept(rows: list[list[int]], targets: list[int]):
    offsets, ids = csr_arrays(rows)
    return L.pad_kept_sets(np.diff(offsets), ids, torch.tensor(targets))


# -- renormalised log-probs -----------------------------------------------------------------
def test_renormalised_logprob_equals_hand_computed_value():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]], dtype=F64)
    ids, lengths = kept([[0, 1, 2]], [1])
    lp = L.kept_set_logprobs(logits, torch.tensor([1]), ids, lengths, temperature=0.5)
    # z / T = [4, 2, 1, -4, 0]; over the kept set {0, 1, 2}:
    # log p(1) = 2 - log(e^4 + e^2 + e^1) = -2 - log(1 + e^-2 + e^-3)
    hand = -2.0 - math.log(1.0 + math.exp(-2.0) + math.exp(-3.0))
    assert lp.item() == pytest.approx(hand, rel=0, abs=1e-15)
    assert hand == pytest.approx(-2.1698460, abs=1e-7)
    # Same thing: full-vocabulary log-prob minus the log of the kept mass.
    full = torch.log_softmax(logits / 0.5, dim=1)[0]
    assert lp.item() == pytest.approx((full[1] - torch.logsumexp(full[[0, 1, 2]], 0)).item(), abs=1e-14)


def test_equal_logits_over_kept_set_give_exactly_minus_log_size():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 7.0]], dtype=F64)
    ids, lengths = kept([[0, 1, 2, 3]], [2])
    lp = L.kept_set_logprobs(logits, torch.tensor([2]), ids, lengths)
    assert lp.item() == -math.log(4.0)


def test_temperature_per_token():
    logits = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=F64)
    ids, lengths = kept([[0, 1], [0, 1]], [0, 0])
    lp = L.kept_set_logprobs(logits, torch.tensor([0, 0]), ids, lengths, torch.tensor([1.0, 0.5], dtype=F64))
    assert lp[0].item() == pytest.approx(-math.log1p(math.exp(-1.0)), abs=1e-15)
    assert lp[1].item() == pytest.approx(-math.log1p(math.exp(-2.0)), abs=1e-15)


# -- kept set of one ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["tis", "clip", "none"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_set_of_one_gives_logprob_zero_and_exactly_zero_gradient(mode, temperature):
    logits = torch.tensor([[3.0, -1.0, 0.25, 2.0]], requires_grad=True)
    ids, lengths = kept([[3]], [3])
    lp, keep = L.token_logprobs(logits, torch.tensor([3]), ids, lengths, torch.tensor([False]), temperature)
    assert lp.item() == 0.0
    per_token, _ = L.policy_loss_terms(lp, torch.tensor([0.0]), torch.tensor([-1.7]), L.LossSettings(mode))
    L.masked_loss_sum(per_token, keep).backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_singleton_token_contributes_no_gradient_to_a_mixed_batch():
    torch.manual_seed(0)
    base = torch.randn(2, 6)
    targets = torch.tensor([4, 1])
    settings = L.LossSettings("tis", is_cap=2.0)

    def grads(rows_kept, rows):
        logits = base[rows].clone().requires_grad_(True)
        ids, lengths = kept(rows_kept, targets[rows].tolist())
        lp, keep = L.token_logprobs(logits, targets[rows], ids, lengths, torch.zeros(len(rows), dtype=torch.bool))
        per, _ = L.policy_loss_terms(lp, torch.full((len(rows),), -0.3), torch.full((len(rows),), 0.9), settings)
        (L.masked_loss_sum(per, keep) / 2).backward()
        return logits.grad

    both = grads([[4], [1, 2, 5]], [0, 1])
    alone = grads([[1, 2, 5]], [1])
    assert torch.equal(both[0], torch.zeros(6))  # the singleton row: nothing at all
    assert torch.equal(both[1], alone[0])  # the other row is unaffected by its presence


# -- replay: only the kept set gets gradient ----------------------------------------------------------
def test_logits_outside_the_kept_set_get_exactly_zero_gradient():
    torch.manual_seed(1)
    logits = torch.randn(3, 8, requires_grad=True)
    kept_rows = [[1, 3, 5], [0, 7], [2, 3, 4, 6]]
    targets = torch.tensor([3, 7, 6])
    ids, lengths = kept(kept_rows, targets.tolist())
    lp, keep = L.token_logprobs(logits, targets, ids, lengths, torch.zeros(3, dtype=torch.bool), 0.8)
    per, _ = L.policy_loss_terms(lp, lp.detach() - 0.1, torch.tensor([1.0, -2.0, 0.5]), L.LossSettings("tis"))
    L.masked_loss_sum(per, keep).backward()
    for row, ks in enumerate(kept_rows):
        outside = [v for v in range(8) if v not in ks]
        assert torch.equal(logits.grad[row, outside], torch.zeros(len(outside)))
        assert torch.all(logits.grad[row, ks] != 0)


def test_without_replay_every_logit_gets_gradient():
    torch.manual_seed(1)
    logits = torch.randn(1, 8, requires_grad=True)
    ids, lengths = kept([[1, 3, 5]], [3])
    lp, keep = L.token_logprobs(logits, torch.tensor([3]), ids, lengths, torch.tensor([False]), replay=False)
    assert lp.item() == pytest.approx(torch.log_softmax(logits.detach(), 1)[0, 3].item(), abs=1e-7)
    per, _ = L.policy_loss_terms(lp, lp.detach(), torch.tensor([1.0]), L.LossSettings("none"))
    per.sum().backward()
    assert torch.all(logits.grad != 0)


# -- capped kept sets -----------------------------------------------------------------------------
def test_capped_kept_set_policies():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]], dtype=F64)
    targets = torch.tensor([1, 1])
    ids, lengths = kept([[0, 1], [0, 1]], [1, 1])
    capped = torch.tensor([True, False])
    full = torch.log_softmax(logits[0], 0)[1].item()
    renorm = -math.log1p(math.exp(1.0))
    lp, keep = L.token_logprobs(logits, targets, ids, lengths, capped, capped_policy="full_vocab")
    assert lp.tolist() == pytest.approx([full, renorm], abs=1e-15) and keep.tolist() == [True, True]
    lp, keep = L.token_logprobs(logits, targets, ids, lengths, capped, capped_policy="mask")
    assert keep.tolist() == [False, True]
    lp, keep = L.token_logprobs(logits, targets, ids, lengths, capped, capped_policy="kept_set")
    assert lp.tolist() == pytest.approx([renorm, renorm], abs=1e-15) and keep.tolist() == [True, True]


# -- importance sampling --------------------------------------------------------------------------
def test_tis_caps_weights_as_configured():
    ratios = torch.tensor([0.5, 1.0, 3.0, 10.0], dtype=F64)
    logp = torch.zeros(4, dtype=F64, requires_grad=True)
    behaviour = -torch.log(ratios)  # r = exp(0 - b)
    adv = torch.tensor([1.0, 1.0, -2.0, 1.0], dtype=F64)
    per, truncated = L.policy_loss_terms(logp, behaviour, adv, L.LossSettings("tis", is_cap=2.0))
    per.sum().backward()
    weights = -logp.grad / adv
    assert weights[2].item() == 2.0 and weights[3].item() == 2.0  # capped exactly at is_cap
    assert weights[:2].tolist() == pytest.approx([0.5, 1.0], abs=1e-15)
    assert truncated.tolist() == [False, False, True, True]

    logp.grad = None
    per, truncated = L.policy_loss_terms(logp, behaviour, adv, L.LossSettings("tis", is_cap=2.0, truncation=False))
    per.sum().backward()
    assert (-logp.grad / adv).tolist() == pytest.approx([0.5, 1.0, 3.0, 10.0], abs=1e-13)
    assert not truncated.any()

    logp.grad = None
    per, _ = L.policy_loss_terms(logp, behaviour, adv, L.LossSettings("tis", is_cap=5.0))
    per.sum().backward()
    assert (-logp.grad / adv)[3].item() == 5.0


def test_importance_sampling_off_is_plain_policy_gradient():
    logp = torch.tensor([-0.5, -2.0], dtype=F64, requires_grad=True)
    per, truncated = L.policy_loss_terms(logp, torch.tensor([-3.0, 0.0], dtype=F64),
                                         torch.tensor([2.0, -1.0], dtype=F64), L.LossSettings("none"))
    assert per.tolist() == [1.0, -2.0]
    per.sum().backward()
    assert logp.grad.tolist() == [-2.0, 1.0]
    assert not truncated.any()


def test_ppo_clip_zeroes_gradient_outside_the_trust_region():
    logp = torch.zeros(4, dtype=F64, requires_grad=True)
    ratios = torch.tensor([1.5, 0.5, 1.1, 0.5], dtype=F64)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0], dtype=F64)
    per, active = L.policy_loss_terms(logp, -torch.log(ratios), adv, L.LossSettings("clip", clip_epsilon=0.2))
    per.sum().backward()
    assert per[0].item() == pytest.approx(-1.2, abs=1e-15)  # clipped at 1 + eps
    assert logp.grad[0].item() == 0.0 and logp.grad[3].item() == 0.0
    assert logp.grad[1].item() == pytest.approx(-0.5, abs=1e-15)  # pessimistic branch keeps the gradient
    assert logp.grad[2].item() == pytest.approx(-1.1, abs=1e-15)
    assert active.tolist() == [True, False, False, True]


# -- advantages -------------------------------------------------------------------------------
def test_group_advantages_each_normalisation():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert L.group_advantages(r, "none").tolist() == [1.0, 0.0, 0.0, 1.0]
    assert L.group_advantages(r, "group_mean").tolist() == [0.5, -0.5, -0.5, 0.5]
    a = L.group_advantages(r, "group_std", eps=1e-6)
    assert a.tolist() == [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6)]
    r = torch.tensor([0.0, 0.0, 3.0])  # mean 1, population std sqrt(2)
    assert L.group_advantages(r, "group_std", eps=0.0).tolist() == pytest.approx(
        [-1 / math.sqrt(2), -1 / math.sqrt(2), 2 / math.sqrt(2)], abs=1e-15)
    assert not L.has_reward_variance(torch.tensor([0.3, 0.3, 0.3]))
    assert L.has_reward_variance(torch.tensor([0.3, 0.3, 0.4]))
    with pytest.raises(ValueError, match="unknown advantage"):
        L.group_advantages(r, "zscore")


# -- the entropy-collapse example ------------------------------------------------------------------
def test_punishing_the_unlikely_token_widens_the_leaders_lead():
    """Three logits; the sampled token is the least likely and gets a negative advantage.
    d(-A log p_2)/dz = p - e_2 (A = -1), so one SGD step of size 1 moves z by p - e_2:
    every other logit rises in proportion to its probability, the leader most, so its
    lead grows and the entropy falls (the mechanism of entropy collapse)."""
    z = torch.tensor([[2.0, 1.0, 0.0]], dtype=F64, requires_grad=True)
    ids, lengths = kept([[0, 1, 2]], [2])
    lp, _ = L.token_logprobs(z, torch.tensor([2]), ids, lengths, torch.tensor([False]))
    per, _ = L.policy_loss_terms(lp, lp.detach(), torch.tensor([-1.0], dtype=F64), L.LossSettings("none"))
    per.sum().backward()
    p = torch.softmax(z.detach(), 1)[0]
    assert p.tolist() == pytest.approx([0.6652409557748219, 0.24472847105479767, 0.09003057317038046], abs=1e-15)
    assert z.grad[0].tolist() == pytest.approx([-p[0].item(), -p[1].item(), 1.0 - p[2].item()], abs=1e-15)
    new = z.detach()[0] - z.grad[0]  # SGD, lr = 1
    assert new.tolist() == pytest.approx([2.6652409557748219, 1.2447284710547977, -0.9099694268296195], abs=1e-15)
    lead_before, lead_after = 1.0, (new[0] - new[1]).item()
    assert lead_after - lead_before == pytest.approx(p[0].item() - p[1].item(), abs=1e-15)
    assert lead_after == pytest.approx(1.4205124847200242, abs=1e-15)
    h = lambda logits: L.full_vocab_entropy(logits.reshape(1, -1)).item()  # noqa: E731
    assert h(new) < h(z.detach())
    assert h(z.detach()) == pytest.approx(0.8323955818399389, abs=1e-15)

    # Under replay with the leader outside the kept set, the same punishment cannot
    # touch the leader at all: its logit gets exactly zero gradient.
    z2 = z.detach().clone().requires_grad_(True)
    ids, lengths = kept([[1, 2]], [2])
    lp, _ = L.token_logprobs(z2, torch.tensor([2]), ids, lengths, torch.tensor([False]))
    per, _ = L.policy_loss_terms(lp, lp.detach(), torch.tensor([-1.0], dtype=F64), L.LossSettings("none"))
    per.sum().backward()
    assert z2.grad[0, 0].item() == 0.0


# -- diagnostics -------------------------------------------------------------------------------------
def test_entropies_and_mismatch_kl():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0]], dtype=F64)
    assert L.full_vocab_entropy(logits)[0].item() == pytest.approx(math.log(4), abs=1e-12)
    ids, lengths = kept([[0, 1], [0]], [0, 0])
    h = L.kept_set_entropy(logits, ids, lengths)
    assert h[0].item() == pytest.approx(math.log(2), abs=1e-12)
    assert h[1].item() == 0.0
    k1, k3 = L.mismatch_kl(torch.tensor([-1.0, -2.0], dtype=F64), torch.tensor([-1.0, -2.0], dtype=F64))
    assert (k1, k3) == (0.0, 0.0)
    k1, k3 = L.mismatch_kl(torch.tensor([-1.0], dtype=F64), torch.tensor([-1.5], dtype=F64))
    assert k1 == -0.5 and k3 == pytest.approx(math.exp(0.5) - 1.5, abs=1e-15)
