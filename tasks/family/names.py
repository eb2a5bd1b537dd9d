"""Identifier pools of the family: which file, function and argument names a task uses.

Held-out behaviours alone do not test whether the policy can *copy* an identifier from
its instruction: with a dozen fixed names per role, every name of the held-out split is
also a training name (and one BPE token), so a policy can score by recalling names. So
names come from two disjoint pools:

* ``train``: the kinds' original English names (``scale``, ``calc``, ``n``; kept so old
  ids still resolve) and the *pseudo-words* whose hash lands in the train share;
* ``heldout``: the other pseudo-words. Training tasks never use them, not even the
  warm start's transcripts or its tokenizer's corpus.

A pseudo-word is 1 to 3 consonant-vowel syllables (``bako``, ``fesuri``): tens of
thousands of names built from 70 syllables, so the training draws show a large,
never-repeating vocabulary the policy can only handle by copying, and a held-out name
is made of pieces the policy has seen in other combinations. Names that are Python
keywords, builtins or standard-library modules are never drawn (a module ``code.py``
would shadow the stdlib's) and do not resolve.

Pure and seeded: the pool of a name is a hash of the name, like a behaviour's split.
"""

from __future__ import annotations

import builtins
import hashlib
import keyword
import random
import re
import sys

from tasks.family.base import FamilyError

POOLS = ("train", "heldout")
# Percent of pseudo-words held out.
HELDOUT_NAMES_PERCENT = 25
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
# Syllables per role: a file or function name has 2-3, an argument 1-2 (short, like n, xs).
SYLLABLES = {"file": (2, 3), "function": (2, 3), "argument": (1, 2)}
# Share of training draws that take one of the kind's original English names.
LEGACY_SHARE = 0.25
_PSEUDO = re.compile(f"^(?:[{CONSONANTS}][{VOWELS}]){{1,3}}$")
_RESERVED = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | frozenset(sys.stdlib_module_names) | {"test"}


def pool_of(name: str) -> str:
    """``train`` or ``heldout`` for a pseudo-word (other names are never held out)."""
    digest = hashlib.blake2b(("rollway-names:" + name).encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "big") % 100 < HELDOUT_NAMES_PERCENT else "train"


def is_pseudo_word(name: str) -> bool:
    return bool(_PSEUDO.match(name)) and name not in _RESERVED


def check(name: str, legacy: tuple[str, ...], role: str) -> str:
    """The pool of ``name`` used as a ``role`` name; FamilyError for a name no pool holds."""
    if name in legacy:
        return "train"
    low, high = SYLLABLES[role]
    if is_pseudo_word(name) and low <= len(name) // 2 <= high:
        return pool_of(name)
    raise FamilyError(f"unknown {role} name {name!r} (neither one of {', '.join(legacy)} nor a pseudo-word of "
                      f"{low}-{high} consonant-vowel syllables)")


def draw(rng: random.Random, legacy: tuple[str, ...], role: str, pool: str, avoid: tuple[str, ...] = ()) -> str:
    """A ``role`` name of ``pool``, not in ``avoid``: from the train pool a quarter of the
    draws take a legacy name, the rest (and every held-out draw) a pseudo-word."""
    if pool not in POOLS:
        raise FamilyError(f"unknown name pool {pool!r}; valid pools: {', '.join(POOLS)}")
    low, high = SYLLABLES[role]
    while True:
        if pool == "train" and rng.random() < LEGACY_SHARE:
            name = legacy[rng.randrange(len(legacy))]
        else:
            name = "".join(CONSONANTS[rng.randrange(len(CONSONANTS))] + VOWELS[rng.randrange(len(VOWELS))]
                           for _ in range(rng.randint(low, high)))
            if not is_pseudo_word(name) or pool_of(name) != pool:
                continue
        if name not in avoid:
            return name


def names_pool(*pools: str) -> str:
    """The pool of a task from its names' pools: held out if any name is."""
    return "heldout" if "heldout" in pools else "train"
