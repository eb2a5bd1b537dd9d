"""A learnable task family: procedural, seeded small coding tasks with a held-out split.

Kinds (each a module here): ``arith`` (implement an integer function described in
words), ``text`` (a string transform), ``lists`` (filter/map/sum a list), ``fix`` (read
a module and fix the planted bug in one of its two functions). Every task fits in a
few hundred tokens and is solved by one short function whose tokens come mostly from
the instruction, so a tiny model can learn the skill and carry it to unseen
operation/constant combinations.

    from tasks.family import KINDS, generate, split_names
    generate("train", 2000, seed=0)      # list[TaskSpec], deterministic
    resolve("fam.arith.calc.scale.n.mul3_add7")   # any family id -> its TaskSpec

Splits are disjoint by behaviour (see :mod:`tasks.family.base`); ``heldout-names`` holds
out the names too (:mod:`tasks.family.names`). Task ids encode the kind and parameters,
so the grader regenerates a task from its id alone.
"""

from __future__ import annotations

import functools
import random
from typing import Sequence

from tasks.family.arith import Arith
from tasks.family.base import (ID_PREFIX, SPLITS, FamilyError, Kind, behaviour_split, names_pool_of_split, split_of,
                               split_of_fingerprint, task_id)
from tasks.family.fix import Fix
from tasks.family.lists import Lists
from tasks.family.text import Text
from tasks.spec import TaskSpec

_KINDS: dict[str, Kind] = {k.name: k for k in (Arith(), Text(), Lists(), Fix())}
KINDS: tuple[str, ...] = tuple(_KINDS)
TASK_SET_PREFIX = "family:"


class _SplitNames(tuple):
    """``("train", "heldout", "heldout-names")``; also callable (``split_names()``), so both spellings work."""

    def __call__(self) -> tuple[str, ...]:
        return tuple(self)


split_names = _SplitNames(SPLITS)

# Draws per wanted task before giving up: a split/kind whose distinct space is smaller
# than the request must fail loudly, not loop forever.
_MAX_DRAWS_PER_TASK = 200


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise FamilyError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    return split


def _kinds(kinds: Sequence[str] | None) -> list[str]:
    chosen = list(kinds) if kinds is not None else list(KINDS)
    unknown = [k for k in chosen if k not in _KINDS]
    if unknown or not chosen:
        raise FamilyError(f"unknown task kind(s) {unknown or chosen}; valid kinds: {', '.join(KINDS)}")
    return chosen


def generate(split: str, count: int, *, seed: int = 0, kinds: Sequence[str] | None = None,
             pseudo_names: float | None = None, long_share: float = 0.0) -> list[TaskSpec]:
    """``count`` distinct tasks of ``split``, kinds in turn; the same arguments give the
    same list (and a longer ``count`` extends a shorter one's list). ``pseudo_names``:
    the share of training-pool names drawn as pseudo-words (default
    ``names.TRAIN_PSEUDO_SHARE``, 0: the kinds' English names, the tasks as before).
    ``long_share``: the share of draws of a kind with a long form (arith, text: three
    operations or steps) that take it; 0 (the default) draws exactly the list it drew
    before long forms existed (the choice has its own random stream)."""
    check_split(split)
    chosen = _kinds(kinds)
    if count < 0:
        raise FamilyError(f"count must be >= 0, got {count}")
    if not 0.0 <= long_share <= 1.0:
        raise FamilyError(f"long_share must lie in [0, 1], got {long_share}")
    rngs = {k: random.Random(f"rollway-family:{split}:{seed}:{k}") for k in chosen}
    long_rngs = {k: random.Random(f"rollway-family-long:{split}:{seed}:{k}") for k in chosen}
    behaviours, names = behaviour_split(split), names_pool_of_split(split)
    seen: set[str] = set()
    out: list[TaskSpec] = []
    for i in range(count):
        name = chosen[i % len(chosen)]
        kind, rng = _KINDS[name], rngs[name]
        long = (long_share > 0 and getattr(kind, "has_long_form", False)
                and long_rngs[name].random() < long_share)
        for _ in range(_MAX_DRAWS_PER_TASK):
            tokens = kind.sample(rng, names, pseudo_names, long=True) if long else kind.sample(rng, names, pseudo_names)
            tid = task_id(name, tokens)
            if tid not in seen and split_of_fingerprint(kind.fingerprint(tokens)) == behaviours:
                break
        else:
            raise FamilyError(f"could not draw {count} distinct {split} tasks of kind {name!r}")
        seen.add(tid)
        out.append(resolve(tid))
    return out


def is_family_id(task_id: str) -> bool:
    return task_id.startswith(ID_PREFIX + ".")


@functools.lru_cache(maxsize=8192)
def resolve(task_id: str) -> TaskSpec:
    """The task a family id names (raises FamilyError for an id that names none)."""
    prefix, _, rest = task_id.partition(".")
    kind_name, _, params = rest.partition(".")
    if prefix != ID_PREFIX or kind_name not in _KINDS or not params:
        raise FamilyError(f"not a family task id: {task_id!r} (expected {ID_PREFIX}.<kind>.<params>, "
                          f"kinds: {', '.join(KINDS)})")
    kind = _KINDS[kind_name]
    tokens = tuple(params.split("."))
    built = kind.build(tokens)
    split = split_of(split_of_fingerprint(kind.fingerprint(tokens)), kind.names_pool(tokens))
    return TaskSpec(
        task_id=task_id,
        instruction=built.instruction,
        files=built.files,
        hidden_tests=built.hidden_tests,
        solution=built.solution,
        difficulty="easy",
        task_set=TASK_SET_PREFIX + split,
        metadata={"kind": kind_name, "split": split, "skill": kind.skill(tokens)},
    )


def parse_task_set(name: str) -> str | None:
    """The split of a ``family:<split>`` task-set name; None for anything else."""
    if not name.startswith(TASK_SET_PREFIX):
        return None
    return check_split(name[len(TASK_SET_PREFIX):])


__all__ = ["KINDS", "FamilyError", "generate", "is_family_id", "parse_task_set", "resolve", "split_names"]
