"""Held-out names (issue #30 point 3): the family's ``heldout-names`` split holds out
behaviours *and* names (files, functions, arguments), training names come from a large
pool, and evaluation draws are deterministic per seed. Pure (no Kafka, no sandbox); the
real grader runs every split's reference solutions in tests/test_task_family.py."""

from __future__ import annotations

import random
import re

import pytest

from sampler.evaluation import load_tasks
from tasks.family import KINDS, FamilyError, generate, resolve, split_names
from tasks.family import names as N
from tasks.family.base import split_of_fingerprint

COUNT = 800  # per split: 200 of each kind


def names_of(spec) -> set[str]:
    """Every identifier the task names: its file(s), functions and their arguments."""
    files = {path.removesuffix(".py") for path in spec.files}
    source = "".join(spec.solution.values())
    funcs = set(re.findall(r"def (\w+)\(", source))
    args = set(re.findall(r"def \w+\((\w+)\)", source))
    return files | funcs | args


@pytest.fixture(scope="module")
def splits() -> dict[str, list]:
    return {split: generate(split, COUNT, seed=0) for split in split_names}


def test_the_split_exists_with_its_metadata(splits):
    assert "heldout-names" in split_names
    for split, specs in splits.items():
        assert {s.metadata["split"] for s in specs} == {split}
        assert {s.task_set for s in specs} == {f"family:{split}"}
        assert [s.metadata["kind"] for s in specs[:4]] == list(KINDS)
        assert all(s.metadata["skill"].startswith(s.metadata["kind"] + ":") for s in specs)


def test_name_pools_are_disjoint(splits):
    train = set().union(*(names_of(s) for s in splits["train"]))
    behaviours_only = set().union(*(names_of(s) for s in splits["heldout"]))
    held = set().union(*(names_of(s) for s in splits["heldout-names"]))
    # Held-out names appear in no training task, and every one is a held-out pseudo-word.
    assert held and not held & train
    assert all(N.is_pseudo_word(n) and N.pool_of(n) == "heldout" for n in held)
    # The behaviour-only held-out split uses training names (what it measured before).
    assert all(N.pool_of(n) == "train" or not N.is_pseudo_word(n) for n in behaviours_only)
    assert all(N.pool_of(n) == "train" or not N.is_pseudo_word(n) for n in train)


def test_training_draws_keep_the_english_names_by_default(splits):
    # TRAIN_PSEUDO_SHARE = 0: train and heldout are the tasks they were before names were
    # held out (these ids are what the family generated then), so the default warm start
    # and the documented evaluation sets are unchanged.
    assert N.TRAIN_PSEUDO_SHARE == 0.0
    assert [s.task_id for s in generate("train", 4, seed=0)] == [
        "fam.arith.numfun.adjust.n.sub4_sub4", "fam.text.words.remix.s.lower", "fam.lists.listops.pick.xs.lt7.add2.sum",
        "fam.fix.numfun.warp.v.add8_sub5.1_mul2.convert.add7_add3.h"]
    assert not any(N.is_pseudo_word(n) for split in ("train", "heldout") for s in splits[split] for n in names_of(s))


def test_training_names_come_from_a_large_pool_with_pseudo_names():
    specs = generate("train", 800, seed=0, pseudo_names=0.75)
    funcs = [f for s in specs for f in re.findall(r"def (\w+)\(", "".join(s.solution.values()))]
    # 800 tasks (1,000 functions with the fix helpers): most names are new.
    assert len(set(funcs)) > 0.6 * len(funcs)
    pseudo = [f for f in funcs if N.is_pseudo_word(f)]
    assert 0.65 < len(pseudo) / len(funcs) < 0.85
    assert all(N.pool_of(n) == "train" for n in pseudo)
    assert all(resolve(s.task_id) == s for s in specs[:100])


def test_held_out_names_name_held_out_behaviours_only(splits):
    from tasks.family import _KINDS

    for spec in splits["heldout-names"]:
        kind = spec.metadata["kind"]
        tokens = tuple(spec.task_id.split(".")[2:])
        assert split_of_fingerprint(_KINDS[kind].fingerprint(tokens)) == "heldout"
        assert resolve(spec.task_id) == spec
    # A training behaviour named with a held-out name does not resolve.
    held_name = next(n for n in sorted(names_of(splits["heldout-names"][0])) if len(n) >= 4)
    train_arith = next(s for s in splits["train"] if s.metadata["kind"] == "arith")
    module, func, arg, ops = train_arith.task_id.split(".")[2:]
    renamed = f"fam.arith.{module}.{held_name}.{arg}.{ops}"
    with pytest.raises(FamilyError, match="held-out names only name held-out behaviours"):
        resolve(renamed)


@pytest.mark.parametrize("bad, message", [
    ("fam.arith.site.bako.n.add3", "unknown file name 'site'"),  # a stdlib module, pseudo-word shaped
    ("fam.arith.calc.print.n.add3", "unknown function name 'print'"),
    ("fam.arith.calc.Bako.n.add3", "unknown function name 'Bako'"),
    ("fam.arith.calc.bako.bako.add3", "must differ"),
    ("fam.arith.bako.bako.n.add3", "must differ"),
])
def test_names_outside_every_pool_are_refused(bad, message):
    with pytest.raises(FamilyError, match=message):
        resolve(bad)


def test_old_ids_still_resolve():
    spec = resolve("fam.arith.calc.scale.n.mul3_add7")
    assert spec.metadata == {"kind": "arith", "split": "train", "skill": "arith:mul_add"}
    assert "scale(n)" in spec.instruction


def test_evaluation_draws_are_deterministic_per_seed_and_differ_between_seeds():
    draws = {seed: load_tasks("heldout-names", max_tasks=100, seed=seed) for seed in (0, 1, 2)}
    for seed, (label, specs) in draws.items():
        assert label == "family:heldout-names" and len(specs) == 100
        again = load_tasks("heldout-names", max_tasks=100, seed=seed)[1]
        assert [s.task_id for s in again] == [s.task_id for s in specs]
    ids = [{s.task_id for s in specs} for _, specs in draws.values()]
    assert ids[0] != ids[1] and ids[1] != ids[2] and ids[0] != ids[2]
    # The two held-out evaluations of a seed are of different tasks, never of training ones.
    train = {s.task_id for s in generate("train", 2000, seed=1)}  # the feeder's default draw
    for seed in (0, 1, 2):
        behaviours_only = {s.task_id for s in load_tasks("heldout", max_tasks=100, seed=seed)[1]}
        assert not behaviours_only & ids[seed] and not (behaviours_only | ids[seed]) & train


def test_name_draws_follow_the_pool():
    rng = random.Random(3)
    for role in ("file", "function", "argument"):
        held = [N.draw(rng, ("calc",), role, "heldout") for _ in range(200)]
        assert all(N.pool_of(n) == "heldout" and N.check(n, ("calc",), role) == "heldout" for n in held)
    with pytest.raises(FamilyError, match="unknown name pool 'dev'"):
        N.draw(rng, ("calc",), "file", "dev")
