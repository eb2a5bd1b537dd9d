"""The feeder's selection rules replayed against a run's solve rates *as they moved*.

    .venv/bin/python benchmarks/selection_timeline.py RUN/rewards.jsonl [--seeds 2] [--only NAME ...]

``benchmarks/selection_replay.py simulate`` holds each skill's rate fixed for the whole run;
this one follows the logged run in time (issue #30 point 2), because the share falls as the
policy learns. From the run's rewards (one JSON line per graded trajectory, as
``learning_run.sh`` dumps them) it fits:

* each kind's solve rate per ``--segment-min`` minutes of the run, and each skill's offset
  from its kind in logit space over the whole run (a penalised fit, prior sd 3): a skill
  keeps its place in its kind while the kind moves, and a skill the run drew rarely in a
  stretch still has a rate there;
* each kind's spread of instances around their skill (logit sd, fitted by likelihood on
  the logged groups): instances of one skill differ by their constants (lists
  ``lt6.add9`` failed twice where ``lt4.add3`` passed), and a group's samples share their
  instance's rate; without the spread the model overstates every rule.

Then each rule draws as many groups as the run decided, from the feeder's default train
draw (family:train, 2,000 tasks, seed 1), through the real ``TaskSelector``, outcomes
seen ``--delay`` groups late (the feeder's max_outstanding_groups), and counts the groups
whose outcomes are not all equal. The rule ``default`` replays the run's own selection:
compare its figure with the run's share to read the model's error.

Assumptions (the figures are a model, not a measurement): the policy's rates follow the
logged ones whatever the rule draws. A rule that draws hard-but-solvable skills and
re-draws instances that disagreed would, in a real run, train on them and push them
towards always solved sooner (and a redrawn instance is learned as an instance, not a
skill), so a rule's gain over ``default`` is an upper bound, the more so the more it
re-draws (the ``repeats`` column).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import statistics
import sys
from collections import defaultdict, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RULES = {
    # name: (group size, TaskSelector keyword arguments beyond the shared ones)
    "default: kind pooling, p(1-p)": (4, dict()),
    "informative + skill, T 0.5 (the 12-03 run)": (4, dict(skills=True, informative=True, temperature=0.5)),
    "informative + skill, T 0.1": (4, dict(skills=True, informative=True, temperature=0.1)),
    "informative + skill, T 0.1, kind floor 0.05": (4, dict(skills=True, informative=True, temperature=0.1,
                                                            kind_floor=0.05)),
    "group 8, default selection": (8, dict()),
    "group 8, informative + skill, T 0.5": (8, dict(skills=True, informative=True, temperature=0.5)),
    "group 8, informative + skill, T 0.1, kind floor 0.05": (8, dict(skills=True, informative=True,
                                                                     temperature=0.1, kind_floor=0.05)),
    "group 8, ... prior a = b = 0.25": (8, dict(skills=True, informative=True, temperature=0.1, kind_floor=0.05,
                                                 prior=0.25)),
    "group 8, ... prior 0.25, T 0.05": (8, dict(skills=True, informative=True, temperature=0.05, kind_floor=0.05,
                                                 prior=0.25)),
    # groups that grow with the solve rate (feeder.group_size_max, informative_target)
    "group 8-16 to 0.8, ... prior 0.25, T 0.05": (8, dict(skills=True, informative=True, temperature=0.05,
                                                          kind_floor=0.05, prior=0.25, size_max=16, target=0.8)),
    "group 8-16 to 0.7, ... prior 0.25, T 0.05": (8, dict(skills=True, informative=True, temperature=0.05,
                                                          kind_floor=0.05, prior=0.25, size_max=16, target=0.7)),
    "group 8-24 to 0.8, ... prior 0.25, T 0.05": (8, dict(skills=True, informative=True, temperature=0.05,
                                                          kind_floor=0.05, prior=0.25, size_max=24, target=0.8)),
    "group 6-16 to 0.8, ... prior 0.25, T 0.05": (6, dict(skills=True, informative=True, temperature=0.05,
                                                          kind_floor=0.05, prior=0.25, size_max=16, target=0.8)),
}
PRIOR_SD = 3.0
SPREADS = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0)
Z = [i / 5 for i in range(-20, 21)]  # N(0, 1) on a grid, for the instance spread
_W = [math.exp(-z * z / 2) for z in Z]
W = [w / sum(_W) for w in _W]


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(-40.0, min(40.0, x))))


def logit(q: float) -> float:
    q = min(max(q, 1e-3), 1 - 1e-3)
    return math.log(q / (1 - q))


def solved(r: dict) -> int:
    return int(not r["cheated"] and r["score"] >= 1.0)


class RateModel:
    """p(instance, time) = sigmoid(mu + spread_kind * z_instance), mu chosen so the mean over
    instances is sigmoid(logit kind(segment) + offset_skill)."""

    def __init__(self, rows: list[dict], segment_min: float) -> None:
        from tasks.family import resolve

        self.t0 = min(r["created_at"] for r in rows)
        self.t1 = max(r["created_at"] for r in rows)
        self.nseg = max(1, round((self.t1 - self.t0) / 60 / segment_min))
        counts: dict = defaultdict(lambda: [0, 0])
        by_skill: dict = defaultdict(list)
        self.meta = {t: resolve(t).metadata for t in {r["task_id"] for r in rows}}
        for r in rows:
            m, j = self.meta[r["task_id"]], self.segment_of(r["created_at"])
            counts[m["kind"], j][0] += solved(r)
            counts[m["kind"], j][1] += 1
            by_skill[m["skill"]].append((j, solved(r)))
        self.kind_logit = {key: logit((s + 0.5) / (n + 1)) for key, (s, n) in counts.items()}
        self.offset = {skill: self._fit_offset(skill.split(":")[0], obs) for skill, obs in by_skill.items()}
        self._mu: dict = {}
        self.spread = self._fit_spread(rows)

    def segment_of(self, t: float) -> int:
        return min(self.nseg - 1, int((t - self.t0) / (self.t1 - self.t0 + 1e-9) * self.nseg))

    def _fit_offset(self, kind: str, obs: list[tuple[int, int]]) -> float:
        x = 0.0
        for _ in range(30):  # Newton steps on the penalised log-likelihood
            g, h = -x / PRIOR_SD ** 2, -1 / PRIOR_SD ** 2
            for j, ok in obs:
                p = sig(self.kind_logit.get((kind, j), 0.0) + x)
                g += ok - p
                h -= p * (1 - p)
            x -= g / h
        return x

    def mean(self, kind: str, skill: str, j: int) -> float:
        return sig(self.kind_logit.get((kind, j), 0.0) + self.offset.get(skill, 0.0))

    def mu(self, q: float, s: float) -> float:
        key = (round(q, 4), s)
        if key not in self._mu:
            lo, hi = -40.0, 40.0
            for _ in range(60):
                mid = (lo + hi) / 2
                if sum(w * sig(mid + s * z) for z, w in zip(Z, W)) < q:
                    lo = mid
                else:
                    hi = mid
            self._mu[key] = (lo + hi) / 2
        return self._mu[key]

    def _fit_spread(self, rows: list[dict]) -> dict[str, float]:
        groups: dict = defaultdict(list)
        for r in rows:
            groups[r["group_id"]].append(r)
        data: dict = defaultdict(list)
        for g in groups.values():
            if len(g) < 4:  # groups of any size the run drew (4, 8 or grown), not their first rewards
                continue
            m = self.meta[g[0]["task_id"]]
            data[m["kind"]].append((len(g), sum(map(solved, g)), self.mean(m["kind"], m["skill"],
                                                                           self.segment_of(g[0]["created_at"]))))
        spread = {}
        for kind, d in data.items():
            def loglik(s: float) -> float:
                total = 0.0
                for n, k, q in d:
                    mu = self.mu(q, s)
                    total += math.log(max(1e-300, sum(w * math.comb(n, k) * sig(mu + s * z) ** k
                                                      * (1 - sig(mu + s * z)) ** (n - k) for z, w in zip(Z, W))))
                return total
            spread[kind] = max(SPREADS, key=loglik)
        return spread

    def rate(self, task_id: str, kind: str, skill: str, j: int, seed: int) -> float:
        s = self.spread.get(kind, 0.0)
        digest = hashlib.blake2b(f"{seed}:{task_id}".encode(), digest_size=8).digest()
        z = random.Random(int.from_bytes(digest, "big")).gauss(0, 1)  # the instance's place, for the whole run
        return sig(self.mu(self.mean(kind, skill, j), s) + s * z)


def run_rule(specs, model: RateModel, groups: int, group_size: int, rule: dict, seed: int, delay: int) -> dict:
    from tasks.selection import TaskSelector

    ids = [s.task_id for s in specs]
    kinds = {s.task_id: s.metadata["kind"] for s in specs}
    skills = {s.task_id: s.metadata["skill"] for s in specs}
    prior = rule.get("prior", 1.0)
    selector = TaskSelector(ids, window=64, min_attempts_to_retire=16, groups=kinds, group_window=256,
                            skills=skills if rule.get("skills") else None, skill_window=64,
                            group_size=group_size if rule.get("informative") else 0,
                            temperature=rule.get("temperature", 1.0), kinds=kinds,
                            kind_floor=rule.get("kind_floor", 0.0), prior_successes=prior, prior_failures=prior,
                            group_size_max=rule.get("size_max", 0), informative_target=rule.get("target", 0.8),
                            seed=seed)
    rng = random.Random(seed + 1_000)
    pending: deque = deque()
    informative: list[bool] = []
    drawn: set = set()
    repeats = 0
    per_kind: dict = defaultdict(int)
    samples = 0
    for i in range(groups):
        task = selector.choose()
        size = selector.group_size_for(task) if selector.group_size_max else group_size
        samples += size
        repeats += task in drawn
        drawn.add(task)
        per_kind[kinds[task]] += 1
        p = model.rate(task, kinds[task], skills[task], min(model.nseg - 1, i * model.nseg // groups), seed)
        outcomes = [rng.random() < p for _ in range(size)]
        informative.append(len(set(outcomes)) > 1)
        pending.append((task, outcomes))
        while len(pending) > delay:  # the feeder sees a group's rewards after later groups are out
            done, outs = pending.popleft()
            for o in outs:
                selector.record(done, o)
    half = len(informative) // 2
    return {"all": statistics.fmean(informative), "first": statistics.fmean(informative[:half]),
            "second": statistics.fmean(informative[half:]), "repeats": repeats / groups,
            "samples": samples / groups,
            "kinds": {k: n / groups for k, n in per_kind.items()}}


def logged(rows: list[dict], model: RateModel) -> str:
    groups: dict = defaultdict(list)
    for r in rows:
        groups[r["group_id"]].append(r)
    mid = (model.t0 + model.t1) / 2
    halves: dict = defaultdict(list)
    for g in groups.values():
        if len(g) >= 4:
            halves[g[0]["created_at"] >= mid].append(len({r["reward"] for r in g}) > 1)
    both = halves[False] + halves[True]
    return (f"the run itself: {len(both)} complete groups, informative {statistics.fmean(both):.3f} "
            f"(halves {statistics.fmean(halves[False]):.3f} / {statistics.fmean(halves[True]):.3f})")


def main() -> int:
    from tasks.family import generate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rewards", type=Path)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--segment-min", type=float, default=5.0)
    parser.add_argument("--delay", type=int, default=16)
    parser.add_argument("--only", nargs="*", default=[], help="rules whose name contains any of these")
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.rewards.read_text().splitlines() if line.strip()]
    model = RateModel(rows, args.segment_min)
    n_groups = len({r["group_id"] for r in rows})
    print(f"{args.rewards}: {len(rows)} rewards, {n_groups} groups, {model.nseg} segments; "
          f"instance spread (logit sd) {model.spread}")
    print(logged(rows, model))
    specs = generate("train", 2000, seed=1)
    print(f"\nrule: informative share of {n_groups} replayed groups, mean (min-max) over seeds 0-{args.seeds - 1}; "
          "first / second half; share of draws that repeat a task; draws per kind")
    for name, (size, rule) in RULES.items():
        if args.only and not any(o in name for o in args.only):
            continue
        res = [run_rule(specs, model, n_groups, size, rule, seed, args.delay) for seed in range(args.seeds)]
        shares = [r["all"] for r in res]
        kinds = " ".join(f"{k} {statistics.fmean(r['kinds'].get(k, 0.0) for r in res):.2f}"
                         for k in ("arith", "lists", "text", "fix"))
        print(f"  {name:54s} {statistics.fmean(shares):.3f} ({min(shares):.3f}-{max(shares):.3f}); "
              f"{statistics.fmean(r['first'] for r in res):.3f} / {statistics.fmean(r['second'] for r in res):.3f}; "
              f"repeats {statistics.fmean(r['repeats'] for r in res):.2f}; "
              f"samples/group {statistics.fmean(r['samples'] for r in res):.1f}; {kinds}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
