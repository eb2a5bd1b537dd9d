"""``text``: a string transform of one or two steps (three in the long form), described in words.

    Write a function `tidy(s)` in `words.py` that takes a string s, reverses it, then
    appends 'ab', and returns the result. Example: tidy('cat') == 'tacab'.

Solution: ``return s[::-1] + 'ab'``. Steps: upper/lower case, reverse, prepend or
append a two-letter string, repeat k times, replace one letter with another.
"""

from __future__ import annotations

import random

from tasks.family.arith import check_names, draw_names
from tasks.family.base import Built, FamilyError, pick, stable_int, test_module

FILES = ("words", "strx", "textfun", "strops")
FUNCS = ("tidy", "dress", "wrap", "mangle", "remix", "polish", "encode", "garble", "style", "twist",
         "format_it", "render")
ARGS = ("s", "text", "word", "t")
AFFIXES = ("ab", "xy", "ok", "zz", "qe", "mo", "ra", "tu")
LETTERS = "aeiorstn"
PROBES = ("Hello", "banana", "", "Rain", "stone")
EXAMPLES = ("cat", "Rose", "tree", "Anna", "moon", "Star")
TEST_INPUTS = ("", "Banana", "sea", "Ion", "ratio")
LONG_STEPS = 3  # the long form (as arith's LONG_OPS)


def parse_step(token: str) -> tuple[str, str]:
    name, _, arg = token.partition("-")
    ok = {
        "upper": arg == "", "lower": arg == "", "rev": arg == "",
        "pre": arg in AFFIXES, "suf": arg in AFFIXES,
        "rep": arg in ("2", "3"),
        "sub": len(arg) == 2 and arg[0] in LETTERS and arg[1] in LETTERS and arg[0] != arg[1],
    }
    if not ok.get(name, False):
        raise FamilyError(f"bad text step {token!r}")
    return name, arg


def sample_step(rng: random.Random) -> str:
    name = pick(rng, ("upper", "lower", "rev", "pre", "suf", "rep", "sub"))
    if name in ("pre", "suf"):
        return f"{name}-{pick(rng, AFFIXES)}"
    if name == "rep":
        return f"rep-{pick(rng, ('2', '3'))}"
    if name == "sub":
        a, b = rng.sample(LETTERS, 2)
        return f"sub-{a}{b}"
    return name


def apply(steps: list[tuple[str, str]], s: str) -> str:
    for name, arg in steps:
        if name == "upper":
            s = s.upper()
        elif name == "lower":
            s = s.lower()
        elif name == "rev":
            s = s[::-1]
        elif name == "pre":
            s = arg + s
        elif name == "suf":
            s = s + arg
        elif name == "rep":
            s = s * int(arg)
        else:
            s = s.replace(arg[0], arg[1])
    return s


def expression(steps: list[tuple[str, str]], var: str) -> str:
    """Python source; ``level``: 0 atom, 1 product (``a * 2``), 2 sum (``a + 'x'``)."""
    expr, level = var, 0
    for name, arg in steps:
        if name in ("upper", "lower", "rev", "sub"):
            expr = f"({expr})" if level else expr
            expr += {"upper": ".upper()", "lower": ".lower()", "rev": "[::-1]"}.get(
                name, f".replace('{arg[:1]}', '{arg[1:]}')")
            level = 0
        elif name == "rep":
            expr, level = (f"({expr})" if level == 2 else expr) + f" * {arg}", 1
        elif name == "pre":
            expr, level = f"'{arg}' + {expr}", 2
        else:
            expr, level = f"{expr} + '{arg}'", 2
    return expr


WORDS = {"upper": "converts it to upper case", "lower": "converts it to lower case", "rev": "reverses it",
         "pre": "puts '{a}' in front", "suf": "appends '{a}'", "rep": "repeats it {a} times",
         "sub": "replaces every '{a0}' with '{a1}'"}


def describe(steps: list[tuple[str, str]]) -> str:
    words = [WORDS[n].format(a=a, a0=a[:1], a1=a[1:]) for n, a in steps]
    return ", then ".join(words)


class Text:
    name = "text"

    has_long_form = True

    def sample(self, rng: random.Random, names: str = "train", pseudo_share: float | None = None,
               long: bool = False) -> tuple[str, ...]:
        steps = [sample_step(rng) for _ in range(LONG_STEPS if long else rng.choice((1, 2, 2)))]
        return (*draw_names(rng, names, FILES, FUNCS, ARGS, pseudo_share), "_".join(steps))

    def _parse(self, tokens: tuple[str, ...]):
        if len(tokens) != 4:
            raise FamilyError(f"text takes 4 parameters, got {len(tokens)}")
        module, func, arg, steps_tok = tokens
        steps = [parse_step(t) for t in steps_tok.split("_")]
        if not 1 <= len(steps) <= LONG_STEPS:
            raise FamilyError(f"need 1 to {LONG_STEPS} steps, got {steps_tok!r}")
        check_names(module, func, arg, FILES, FUNCS, ARGS)
        return module, func, arg, steps

    def names_pool(self, tokens: tuple[str, ...]) -> str:
        return check_names(*tokens[:3], FILES, FUNCS, ARGS)

    def skill(self, tokens: tuple[str, ...]) -> str:
        return "text:" + "_".join(name for name, _ in self._parse(tokens)[3])

    def fingerprint(self, tokens: tuple[str, ...]) -> str:
        steps = self._parse(tokens)[3]
        return "str:" + repr([apply(steps, p) for p in PROBES])

    def build(self, tokens: tuple[str, ...]) -> Built:
        module, func, arg, steps = self._parse(tokens)
        ex = EXAMPLES[stable_int(*tokens) % len(EXAMPLES)]
        instruction = (
            f"Write a function `{func}({arg})` in `{module}.py` that takes a string {arg}, "
            f"{describe(steps)}, and returns the result. Example: {func}({ex!r}) == {apply(steps, ex)!r}."
        )
        cases = [(repr(x), apply(steps, x)) for x in (ex, *TEST_INPUTS)]
        return Built(
            instruction=instruction,
            files={f"{module}.py": f"def {func}({arg}):\n    raise NotImplementedError\n"},
            hidden_tests={f"test_{func}.py": test_module(func, module, cases, lambda a: f"{func}({a})")},
            solution={f"{module}.py": f"def {func}({arg}):\n    return {expression(steps, arg)}\n"},
        )
