"""Identifier pools of the family: which file, function and argument names a task uses.

Held-out behaviours alone do not test whether the policy can *copy* an identifier from
its instruction: with a dozen fixed names per role, every name of the held-out split is
also a training name (and one BPE token), so a policy can score by recalling names. So
names come from two disjoint pools:

* ``train``: the kinds' original English names (``scale``, ``calc``, ``n``; kept so old
  ids still resolve) and the *pseudo-words* whose hash lands in the train share;
* ``heldout``: the other pseudo-words. Training tasks never use them, not even the
  warm start's transcripts or its tokenizer's corpus.

A pseudo-word is 1 to 3 consonant-vowel syllables (``bako``, ``fesuri``): hundreds of
thousands of names built from 70 syllables, so training draws of pseudo-words show a
large, never-repeating vocabulary the policy can only handle by copying, and a held-out
name is made of pieces the policy has seen in other combinations. Names that are Python
keywords, builtins or standard-library modules are never drawn (a module ``site.py``
would shadow the stdlib's) and do not resolve.

How many training draws take a pseudo-word is ``TRAIN_PSEUDO_SHARE`` (``generate``'s
``pseudo_names``). It is 0 by default, so the train and heldout splits are exactly the
tasks they were before names were held out: the default warm start (500 SFT steps) does
not learn to copy multi-token names, and with a quarter of the draws pseudo-words its
solve rate at temperature 1 fell to 0.01 and RL got no group with reward variance
(docs/results.md, issue #30). Every pool's names resolve whatever the share.

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
# Share of training-pool draws that take a pseudo-word (the rest an English name).
TRAIN_PSEUDO_SHARE = 0.0
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


def draw(rng: random.Random, legacy: tuple[str, ...], role: str, pool: str, avoid: tuple[str, ...] = (),
         pseudo_share: float | None = None) -> str:
    """A ``role`` name of ``pool``, not in ``avoid``. From the train pool a share
    ``pseudo_share`` (default ``TRAIN_PSEUDO_SHARE``) of draws are pseudo-words, the rest
    English names (drawn exactly as before pools existed: one ``randrange``, so share 0
    keeps every earlier task id); every held-out draw is a pseudo-word."""
    if pool not in POOLS:
        raise FamilyError(f"unknown name pool {pool!r}; valid pools: {', '.join(POOLS)}")
    share = TRAIN_PSEUDO_SHARE if pseudo_share is None else pseudo_share
    if pool == "train" and (share <= 0.0 or (share < 1.0 and rng.random() >= share)):
        options = tuple(n for n in legacy if n not in avoid)
        return options[rng.randrange(len(options))]
    low, high = SYLLABLES[role]
    while True:
        name = "".join(CONSONANTS[rng.randrange(len(CONSONANTS))] + VOWELS[rng.randrange(len(VOWELS))]
                       for _ in range(rng.randint(low, high)))
        if is_pseudo_word(name) and pool_of(name) == pool and name not in avoid:
            return name


def names_pool(*pools: str) -> str:
    """The pool of a task from its names' pools: held out if any name is."""
    return "heldout" if "heldout" in pools else "train"
