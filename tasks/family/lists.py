"""``lists``: filter and/or map a list of integers, then return the list or its sum.

    Write a function `pick(xs)` in `listfun.py` that takes a list of integers xs, keeps
    the items greater than 4, multiplies each by 2, and returns them as a list.
    Example: pick([3, 5, 8]) == [10, 16].

Solution: ``return [x * 2 for x in xs if x > 4]`` (``sum([...])`` for sums).
"""

from __future__ import annotations

import random

from tasks.family.arith import check_names, draw_names
from tasks.family.base import Built, FamilyError, check_choice, pick, stable_int, test_module

FILES = ("listfun", "seqs", "listops", "nums")
FUNCS = ("pick", "select", "gather", "sift", "collect", "crunch", "reduce_it", "total", "keep",
         "process", "harvest", "fold_it")
ARGS = ("xs", "nums", "items", "values")
FILTERS = ("all", "even", "odd", "gt", "lt")
MAPS = ("same", "mul", "add", "sub", "sq")
AGGS = ("list", "sum")
CONSTS = range(2, 10)
PROBES = ([], [1, 2, 3], [5, -2, 8, 7, 4], [10, 0, -5, 3, 9, 6])
EXAMPLES = ([3, 5, 8], [1, 4, 9, 2], [6, -1, 7], [2, 3, 10, 5])
TEST_INPUTS = ([], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [-6, 11, 4, -3], [12])


def parse_part(token: str, options: tuple[str, ...], with_const: tuple[str, ...], what: str) -> tuple[str, int]:
    name = token.rstrip("0123456789")
    digits = token[len(name):]
    if name not in options or (name in with_const) != bool(digits):
        raise FamilyError(f"bad {what} {token!r}")
    if digits and int(digits) not in CONSTS:
        raise FamilyError(f"bad {what} constant in {token!r}")
    return name, int(digits or 0)


def apply(flt: tuple[str, int], mp: tuple[str, int], agg: str, xs: list[int]) -> object:
    keep = {"all": lambda x: True, "even": lambda x: x % 2 == 0, "odd": lambda x: x % 2 == 1,
            "gt": lambda x: x > flt[1], "lt": lambda x: x < flt[1]}[flt[0]]
    f = {"same": lambda x: x, "mul": lambda x: x * mp[1], "add": lambda x: x + mp[1],
         "sub": lambda x: x - mp[1], "sq": lambda x: x * x}[mp[0]]
    out = [f(x) for x in xs if keep(x)]
    return sum(out) if agg == "sum" else out


def source(flt: tuple[str, int], mp: tuple[str, int], agg: str, var: str) -> str:
    item = {"same": "x", "mul": f"x * {mp[1]}", "add": f"x + {mp[1]}", "sub": f"x - {mp[1]}", "sq": "x * x"}[mp[0]]
    cond = {"all": "", "even": " if x % 2 == 0", "odd": " if x % 2 == 1", "gt": f" if x > {flt[1]}",
            "lt": f" if x < {flt[1]}"}[flt[0]]
    comp = f"[{item} for x in {var}{cond}]"
    return f"sum({comp})" if agg == "sum" else comp


def describe(flt: tuple[str, int], mp: tuple[str, int], agg: str) -> str:
    words = []
    if flt[0] != "all":
        words.append({"even": "keeps the even items", "odd": "keeps the odd items",
                      "gt": f"keeps the items greater than {flt[1]}", "lt": f"keeps the items less than {flt[1]}"}[flt[0]])
    if mp[0] != "same":
        words.append({"mul": f"multiplies each by {mp[1]}", "add": f"adds {mp[1]} to each",
                      "sub": f"subtracts {mp[1]} from each", "sq": "squares each"}[mp[0]])
    words.append("returns their sum" if agg == "sum" else "returns them as a list")
    return ", ".join(words[:-1]) + (", and " if len(words) > 1 else "") + words[-1]


class Lists:
    name = "lists"

    def sample(self, rng: random.Random, names: str = "train", pseudo_share: float | None = None) -> tuple[str, ...]:
        while True:
            flt, mp, agg = pick(rng, FILTERS), pick(rng, MAPS), pick(rng, AGGS)
            if flt == "all" and mp == "same" and agg == "list":
                continue  # the identity: nothing to do
            flt += str(rng.choice(CONSTS)) if flt in ("gt", "lt") else ""
            mp += str(rng.choice(CONSTS)) if mp in ("mul", "add", "sub") else ""
            return (*draw_names(rng, names, FILES, FUNCS, ARGS, pseudo_share), flt, mp, agg)

    def _parse(self, tokens: tuple[str, ...]):
        if len(tokens) != 6:
            raise FamilyError(f"lists takes 6 parameters, got {len(tokens)}")
        module, func, arg, flt_tok, mp_tok, agg = tokens
        flt = parse_part(flt_tok, FILTERS, ("gt", "lt"), "filter")
        mp = parse_part(mp_tok, MAPS, ("mul", "add", "sub"), "map")
        check_choice(agg, AGGS, "result")
        if flt[0] == "all" and mp[0] == "same" and agg == "list":
            raise FamilyError("the identity transform is not a task")
        check_names(module, func, arg, FILES, FUNCS, ARGS)
        return module, func, arg, flt, mp, agg

    def names_pool(self, tokens: tuple[str, ...]) -> str:
        return check_names(*tokens[:3], FILES, FUNCS, ARGS)

    def skill(self, tokens: tuple[str, ...]) -> str:
        _, _, _, flt, mp, agg = self._parse(tokens)
        return f"lists:{flt[0]}_{mp[0]}_{agg}"

    def fingerprint(self, tokens: tuple[str, ...]) -> str:
        _, _, _, flt, mp, agg = self._parse(tokens)
        return "list:" + repr([apply(flt, mp, agg, list(p)) for p in PROBES])

    def build(self, tokens: tuple[str, ...]) -> Built:
        module, func, arg, flt, mp, agg = self._parse(tokens)
        ex = EXAMPLES[stable_int(*tokens) % len(EXAMPLES)]
        instruction = (
            f"Write a function `{func}({arg})` in `{module}.py` that takes a list of integers {arg}, "
            f"{describe(flt, mp, agg)}. Example: {func}({ex!r}) == {apply(flt, mp, agg, list(ex))!r}."
        )
        cases = [(repr(x), apply(flt, mp, agg, list(x))) for x in (ex, *TEST_INPUTS)]
        return Built(
            instruction=instruction,
            files={f"{module}.py": f"def {func}({arg}):\n    raise NotImplementedError\n"},
            hidden_tests={f"test_{func}.py": test_module(func, module, cases, lambda a: f"{func}({a})")},
            solution={f"{module}.py": f"def {func}({arg}):\n    return {source(flt, mp, agg, arg)}\n"},
        )
