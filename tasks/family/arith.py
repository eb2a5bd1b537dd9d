"""``arith``: implement an integer function described in words, with one example.

    Write a function `scale(n)` in `calc.py` that takes an integer n, multiplies it
    by 3, then adds 7, and returns the result. Example: scale(2) == 13.

Solution: ``def scale(n):\\n    return n * 3 + 7``. Tokens: file, function, argument,
operations (``mul3_add7``). Operations and constants are each seen in training; the
held-out split has combinations (behaviours) the train split never has. Names: the
English ones below or pseudo-words (:mod:`tasks.family.names`).
"""

from __future__ import annotations

import random

from tasks.family import names as N
from tasks.family.base import Built, FamilyError, pick, stable_int, test_module

FILES = ("calc", "mathx", "numfun", "arith")
FUNCS = ("scale", "shift", "step", "bump", "adjust", "compute", "convert", "tweak", "morph", "warp",
         "lift", "mix")
ARGS = ("n", "x", "v", "k")
OPS = ("add", "sub", "mul")
CONSTS = range(2, 10)
WORDS = {"add": "adds {k}", "sub": "subtracts {k}", "mul": "multiplies it by {k}"}
SYMBOLS = {"add": "+", "sub": "-", "mul": "*"}
PROBES = (-3, 0, 1, 2, 5, 11)
# The long form's length (``generate(..., long_share=...)``): a chain one longer than the
# usual draws, a harder level of the same skill words for the policy's frontier.
LONG_OPS = 3

Op = tuple[str, int]


def parse_ops(token: str) -> list[Op]:
    ops = []
    for part in token.split("_"):
        name, digits = part[:3], part[3:]
        if name not in OPS or not digits.isdigit() or int(digits) not in CONSTS:
            raise FamilyError(f"bad operation {part!r}")
        ops.append((name, int(digits)))
    if not 1 <= len(ops) <= LONG_OPS:
        raise FamilyError(f"need 1 to {LONG_OPS} operations, got {token!r}")
    return ops


def ops_token(ops: list[Op]) -> str:
    return "_".join(f"{name}{k}" for name, k in ops)


def sample_ops(rng: random.Random, count: int | None = None) -> list[Op]:
    """``count`` operations (default: 1 or 2, two twice as often)."""
    return [(pick(rng, OPS), rng.choice(CONSTS)) for _ in range(count or rng.choice((1, 2, 2)))]


def evaluate(ops: list[Op], x: int) -> int:
    for name, k in ops:
        x = x + k if name == "add" else x - k if name == "sub" else x * k
    return x


def expression(ops: list[Op], arg: str) -> str:
    """Python source for applying ``ops`` in order; parentheses only where needed."""
    expr, is_sum = arg, False
    for name, k in ops:
        if name == "mul" and is_sum:
            expr = f"({expr})"
        expr = f"{expr} {SYMBOLS[name]} {k}"
        is_sum = name != "mul"
    return expr


def describe(ops: list[Op]) -> str:
    words = [WORDS[name].format(k=k) for name, k in ops]
    return ", then ".join(words)


def fingerprint(ops: list[Op]) -> str:
    # Shared with the fix kind: the same function is the same behaviour in both.
    return "int:" + repr([evaluate(ops, x) for x in PROBES])


def function_source(func: str, arg: str, ops: list[Op]) -> str:
    return f"def {func}({arg}):\n    return {expression(ops, arg)}\n"


def example_input(*parts: str) -> int:
    return 1 + stable_int(*parts) % 5


def cases(ops: list[Op], example: int) -> list[tuple[str, int]]:
    inputs = [example] + [x for x in (0, -4, 7, 13) if x != example]
    return [(repr(x), evaluate(ops, x)) for x in inputs]


def draw_names(rng: random.Random, pool: str, files: tuple[str, ...], funcs: tuple[str, ...],
               args: tuple[str, ...], pseudo_share: float | None = None) -> tuple[str, str, str]:
    """File, function and argument names of ``pool``; the function's differs from both
    (a file and an argument may share a name, as ``nums`` did before pools)."""
    module = N.draw(rng, files, "file", pool, pseudo_share=pseudo_share)
    func = N.draw(rng, funcs, "function", pool, avoid=(module,), pseudo_share=pseudo_share)
    return module, func, N.draw(rng, args, "argument", pool, avoid=(func,), pseudo_share=pseudo_share)


def check_names(module: str, func: str, arg: str, files: tuple[str, ...], funcs: tuple[str, ...],
                args: tuple[str, ...]) -> str:
    """The names' pool; FamilyError for an unknown name or two roles sharing one."""
    pools = (N.check(module, files, "file"), N.check(func, funcs, "function"), N.check(arg, args, "argument"))
    if func in (module, arg):
        raise FamilyError(f"the function name must differ from the file and argument names: {module!r}, {func!r}, "
                          f"{arg!r}")
    return N.names_pool(*pools)


def skill_of(ops: list[Op]) -> str:
    return "_".join(name for name, _ in ops)


class Arith:
    name = "arith"

    has_long_form = True

    def sample(self, rng: random.Random, names: str = "train", pseudo_share: float | None = None,
               long: bool = False) -> tuple[str, ...]:
        return (*draw_names(rng, names, FILES, FUNCS, ARGS, pseudo_share),
                ops_token(sample_ops(rng, LONG_OPS if long else None)))

    def _parse(self, tokens: tuple[str, ...]):
        if len(tokens) != 4:
            raise FamilyError(f"arith takes 4 parameters, got {len(tokens)}")
        module, func, arg, ops = tokens
        check_names(module, func, arg, FILES, FUNCS, ARGS)
        return module, func, arg, parse_ops(ops)

    def fingerprint(self, tokens: tuple[str, ...]) -> str:
        return fingerprint(self._parse(tokens)[3])

    def names_pool(self, tokens: tuple[str, ...]) -> str:
        return check_names(*tokens[:3], FILES, FUNCS, ARGS)

    def skill(self, tokens: tuple[str, ...]) -> str:
        return f"arith:{skill_of(self._parse(tokens)[3])}"

    def build(self, tokens: tuple[str, ...]) -> Built:
        module, func, arg, ops = self._parse(tokens)
        ex = example_input(*tokens)
        instruction = (
            f"Write a function `{func}({arg})` in `{module}.py` that takes an integer {arg}, "
            f"{describe(ops)}, and returns the result. Example: {func}({ex}) == {evaluate(ops, ex)}."
        )
        return Built(
            instruction=instruction,
            files={f"{module}.py": f"def {func}({arg}):\n    raise NotImplementedError\n"},
            hidden_tests={f"test_{func}.py": test_module(func, module, cases(ops, ex), lambda a: f"{func}({a})")},
            solution={f"{module}.py": function_source(func, arg, ops)},
        )
