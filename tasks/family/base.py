"""What every task kind of the family shares: instances, ids, the split rule.

An instance is a kind plus a tuple of parameter *tokens* (short strings without dots).
Its task id is ``fam.<kind>.<token>.<token>...``: the id alone regenerates the task, so
the grader's store resolves any family id without a task folder (see
:func:`tasks.family.resolve`).

The split is decided by *behaviour*, not by id: each instance has a fingerprint (its
reference function's outputs on fixed probe inputs, for the kind's domain), and the
fingerprint's hash puts it in ``train`` or ``heldout``. So two instances that compute
the same thing (a renamed copy, ``+3 then +4`` vs ``+4 then +3``, a fix task whose fixed
function equals an implement task's) always land in the same split, and every held-out
operation/constant combination is one the train split never shows.

Names are held out too (:mod:`tasks.family.names`): ``train`` and ``heldout`` use names
of the training pool, ``heldout-names`` is held-out behaviours named from the held-out
pool. A training behaviour is never named from the held-out pool.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable, Protocol

SPLITS = ("train", "heldout", "heldout-names")
ID_PREFIX = "fam"
# Percent of behaviours held out.
HELDOUT_PERCENT = 25


class FamilyError(ValueError):
    """A family task id, split or kind that does not exist; the message says which."""


@dataclass(frozen=True)
class Built:
    instruction: str
    files: dict[str, str]
    hidden_tests: dict[str, str]
    solution: dict[str, str]


class Kind(Protocol):
    name: str

    def sample(self, rng: random.Random, names: str = "train", pseudo_share: float | None = None) -> tuple[str, ...]:
        """Random parameter tokens (any behaviour split), named from pool ``names``
        (``pseudo_share``: see :func:`tasks.family.names.draw`)."""

    def fingerprint(self, tokens: tuple[str, ...]) -> str:
        """The behaviour the solution must have; decides the split."""

    def names_pool(self, tokens: tuple[str, ...]) -> str:
        """``train`` or ``heldout``: the pool of the task's names (held out if any is)."""

    def skill(self, tokens: tuple[str, ...]) -> str:
        """A coarse behaviour class (the operations without their constants), shared by
        many instances: the feeder pools solve rates by it (tasks.selection)."""

    def build(self, tokens: tuple[str, ...]) -> Built:
        """The task; raises FamilyError on tokens that do not parse."""


def split_of_fingerprint(fingerprint: str) -> str:
    digest = hashlib.blake2b(fingerprint.encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "big") % 100 < HELDOUT_PERCENT else "train"


def behaviour_split(split: str) -> str:
    """The behaviour share a split draws from (``heldout-names`` holds out behaviours too)."""
    return "heldout" if split == "heldout-names" else split


def names_pool_of_split(split: str) -> str:
    return "heldout" if split == "heldout-names" else "train"


def split_of(behaviour: str, names: str) -> str:
    """The split of a task from its behaviour's split and its names' pool."""
    if names == "heldout":
        if behaviour != "heldout":
            raise FamilyError("held-out names only name held-out behaviours (this task's behaviour is a training one)")
        return "heldout-names"
    return behaviour


def task_id(kind: str, tokens: tuple[str, ...]) -> str:
    return ".".join((ID_PREFIX, kind, *tokens))


def stable_int(*parts: str) -> int:
    """A small deterministic integer from strings (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b("\x1f".join(parts).encode(), digest_size=4).digest(), "big")


def test_module(func: str, module: str, cases: list[tuple[str, object]], call: Callable[[str], str]) -> str:
    """Plain pytest functions comparing builtin values with ==, one per case."""
    lines = [f"from {module} import {func}\n"]
    for i, (arg_src, expected) in enumerate(cases):
        lines.append(f"\ndef test_{func}_{i}():\n    assert {call(arg_src)} == {expected!r}\n")
    return "".join(lines)


def pick(rng: random.Random, options: tuple[str, ...]) -> str:
    return options[rng.randrange(len(options))]


def check_choice(value: str, options: tuple[str, ...], what: str) -> str:
    if value not in options:
        raise FamilyError(f"unknown {what} {value!r}")
    return value
