"""Group normalisation vs the length penalty, on a bandit where the answer is known.

A policy picks a response length L from a few choices; a longer response solves more
often, on a concave curve ``p(L) = a + b ln L``. The budget-phase reward is
``solve - k L`` with k the coefficient ``sandbox.reward.suggest_length_penalty`` returns
for a target of 200 tokens, i.e. the penalty whose iso-reward line is tangent to the
curve at 200: the expected reward is highest at L = 200 by construction. Each step
samples groups of G from the policy, computes advantages with the trainer's own
``group_advantages`` under each normalisation, and takes a policy-gradient step on the
softmax logits. Printed: where each normalisation ends (mean length, solve rate,
expected reward) against the optimum, averaged over seeds, side by side in one run.

    .venv/bin/python benchmarks/advantage_norm.py [--steps 400] [--seeds 8]
"""

from __future__ import annotations

import argparse
import math

import torch

from sandbox.reward import suggest_length_penalty
from trainer.loss import group_advantages

LENGTHS = [50.0, 100.0, 200.0, 400.0, 800.0]
# Task difficulties: (solve rate at 50 tokens, gain per e-fold of tokens).
CURVES = {"hard": (0.25, 0.12), "easy": (0.75, 0.05)}


def curve(name: str):
    a, b = CURVES[name]
    return lambda length: a + b * math.log(length / 50.0)


def run(norm: str, k: float, solve_rate, *, steps: int, groups: int, group_size: int, lr: float, seed: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.zeros(len(LENGTHS), dtype=torch.float64, requires_grad=True)
    rates = torch.tensor([solve_rate(x) for x in LENGTHS], dtype=torch.float64)
    lengths = torch.tensor(LENGTHS, dtype=torch.float64)
    for _ in range(steps):
        probs = torch.softmax(logits, 0)
        loss = torch.zeros((), dtype=torch.float64)
        for _ in range(groups):
            picks = torch.multinomial(probs.detach(), group_size, replacement=True, generator=gen)
            solved = (torch.rand(group_size, generator=gen, dtype=torch.float64) < rates[picks]).double()
            penalty = k * lengths[picks]
            rewards = solved - penalty
            adv = group_advantages(rewards, norm, penalised=True)
            loss = loss - (adv * torch.log_softmax(logits, 0)[picks]).mean()
        loss = loss / groups
        grad, = torch.autograd.grad(loss, logits)
        with torch.no_grad():
            logits -= lr * grad
    probs = torch.softmax(logits.detach(), 0)
    return float((probs * lengths).sum()), float((probs * (rates - k * lengths)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()
    print(f"{'task':<6} {'k/token':>9} {'normalisation':<14} {'mean length':>12} {'expected reward':>16} "
          f"{'regret':>8}")
    for name in CURVES:
        solve_rate = curve(name)
        k = suggest_length_penalty([(x, solve_rate(x)) for x in LENGTHS], target_tokens=200.0).coefficient
        best = max(solve_rate(x) - k * x for x in LENGTHS)  # at 200 tokens by construction
        for norm in ("group_std", "group_mean"):
            ends = [run(norm, k, solve_rate, steps=args.steps, groups=args.groups, group_size=args.group_size,
                        lr=args.lr, seed=s) for s in range(args.seeds)]
            length = sum(e[0] for e in ends) / len(ends)
            reward = sum(e[1] for e in ends) / len(ends)
            print(f"{name:<6} {k:>9.6f} {norm:<14} {length:>12.1f} {reward:>16.4f} {best - reward:>8.4f}")


if __name__ == "__main__":
    main()
