"""The feeder's selection policies side by side on a run's *measured* solve rates.

    .venv/bin/python benchmarks/selection_replay.py dump OUT.jsonl      # a run's rewards, from Kafka
    .venv/bin/python benchmarks/selection_replay.py simulate RUN.jsonl [--groups 600 --seeds 5]

``dump`` reads ``rollway.rewards`` (the config's Kafka, e.g. KAFKA_BOOTSTRAP_SERVERS of a
run's broker) into one JSON line per graded trajectory. ``simulate`` takes the solve
rate of each skill (``metadata["skill"]`` of the family task, e.g. ``arith:mul_add``)
measured in those rewards, gives every instance of the feeder's default train draw
(``family:train``, 2,000 tasks, seed 1) its skill's rate (its kind's where the run never
sampled the skill), and draws groups of 4 with each policy from one seeded outcome
stream, counting the groups whose outcomes are not all equal (the trainer keeps only
those). It also prints, per kind, what the run itself measured.

What it shows is the selection's effect at a *fixed* policy (the rates do not move as
they would while training), and instances of one skill are assumed equally hard (the
constants matter too, so every column is optimistic by the same kind of error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POLICIES = {
    # name: TaskSelector keyword arguments beyond the shared ones
    "before: kind pooling, weight p(1-p)": dict(group_size=0),
    "kind + skill pooling, weight P(informative)": dict(skills=True, group_size=4),
    "  ... temperature 0.5": dict(skills=True, group_size=4, temperature=0.5),
    "  ... group size 8 (weight and groups)": dict(skills=True, group_size=8),
}


async def dump(out: Path) -> int:
    from bus import read_topic
    from rollway.config import load_config
    from schemas import Reward

    cfg = load_config()
    rows = [env.event for env in await read_topic(cfg.kafka, "rewards") if isinstance(env.event, Reward)]
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps({"task_id": r.task_id, "group_id": r.group_id, "score": r.score, "reward": r.reward,
                                "cheated": r.cheated, "tests_passed": r.tests_passed, "tests_total": r.tests_total,
                                "weight_version": r.weight_version, "created_at": r.created_at}) + "\n")
    print(f"{len(rows)} rewards -> {out}")
    return 0


def measured(rows: list[dict]) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """(skill -> solve rate, kind -> solve rate, per-kind report lines) of a run's rewards."""
    from tasks.family import resolve

    by_skill: dict[str, list[int]] = defaultdict(list)
    by_kind: dict[str, list[int]] = defaultdict(list)
    groups: dict[str, list[float]] = defaultdict(list)
    kind_of_group: dict[str, str] = {}
    for r in rows:
        meta = resolve(r["task_id"]).metadata
        solved = int(not r["cheated"] and r["score"] >= 1.0)
        by_skill[meta["skill"]].append(solved)
        by_kind[meta["kind"]].append(solved)
        groups[r["group_id"]].append(r["reward"])
        kind_of_group[r["group_id"]] = meta["kind"]
    lines = []
    for kind in sorted(by_kind):
        complete = [g for g, rs in groups.items() if kind_of_group[g] == kind and len(rs) >= 4]
        informative = sum(len(set(groups[g])) > 1 for g in complete)
        partial = [r["tests_passed"] / r["tests_total"] for r in rows
                   if r["tests_total"] and resolve(r["task_id"]).metadata["kind"] == kind]
        lines.append(f"{kind}: {len(by_kind[kind])} rewards, solve rate {statistics.fmean(by_kind[kind]):.3f}, "
                     f"complete groups {len(complete)}, with reward variance {informative}, mean share of hidden "
                     f"tests passed {statistics.fmean(partial) if partial else 0:.3f}")
    return ({k: statistics.fmean(v) for k, v in by_skill.items()},
            {k: statistics.fmean(v) for k, v in by_kind.items()}, lines)


def simulate_policy(specs, rate: dict[str, float], policy: dict, groups: int, seed: int) -> float:
    from tasks.selection import TaskSelector

    ids = [s.task_id for s in specs]
    kinds = {s.task_id: s.metadata["kind"] for s in specs}
    skills = {s.task_id: s.metadata["skill"] for s in specs} if policy.get("skills") else None
    g = policy.get("group_size") or 4
    selector = TaskSelector(ids, window=64, min_attempts_to_retire=16, groups=kinds, group_window=256,
                            skills=skills, skill_window=64, group_size=policy.get("group_size", 0),
                            temperature=policy.get("temperature", 1.0), seed=seed)
    rng = random.Random(seed + 1_000)
    informative = 0
    for _ in range(groups):
        task = selector.choose()
        if task is None:
            break
        outcomes = [rng.random() < rate[task] for _ in range(g)]
        informative += len(set(outcomes)) > 1
        for o in outcomes:
            selector.record(task, o)
    return informative / groups


def simulate(path: Path, groups: int, seeds: int) -> int:
    from tasks.family import generate

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    skill_rate, kind_rate, lines = measured(rows)
    print(f"{path}: {len(rows)} rewards, {len(skill_rate)} skills seen")
    for line in lines:
        print("  " + line)
    specs = generate("train", 2000, seed=1)
    rate = {s.task_id: skill_rate.get(s.metadata["skill"], kind_rate.get(s.metadata["kind"], 0.0)) for s in specs}
    print(f"\ninformative share of {groups} simulated groups, mean (min-max) over seeds 0-{seeds - 1}:")
    for name, policy in POLICIES.items():
        shares = [simulate_policy(specs, rate, policy, groups, seed) for seed in range(seeds)]
        print(f"  {name:46s} {statistics.fmean(shares):.3f} ({min(shares):.3f}-{max(shares):.3f})")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    s = sub.add_parser("simulate")
    s.add_argument("rewards", type=Path)
    s.add_argument("--groups", type=int, default=600)
    s.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    if args.cmd == "dump":
        return asyncio.run(dump(args.out))
    return simulate(args.rewards, args.groups, args.seeds)


if __name__ == "__main__":
    raise SystemExit(main())
