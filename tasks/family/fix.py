"""``fix``: a module of two small integer functions, one with a planted bug.

    `scale(n)` in `calc.py` has a bug. It should take an integer n, multiply it by 3,
    then add 7, and return the result. Example: scale(2) should be 13. Fix the bug and
    keep the other function as it is.

The repository holds the buggy function and a correct helper; the hidden tests check
both, so the agent has to read the file, then write it back with the one fix. Tokens:
file, function, argument, correct operations, bug (``<index>_<op>``: that operation
replaced), helper name, helper operations, order (``t`` target first, ``h`` helper first).
The split follows the fixed function's behaviour (shared with ``arith``); the helper's
behaviour is drawn from the same split, so no held-out function leaks into training.
"""

from __future__ import annotations

import random

from tasks.family import arith as A
from tasks.family import names as N
from tasks.family.base import Built, FamilyError, check_choice, pick, split_of_fingerprint, test_module

BASE_WORDS = {"add": "add {k}", "sub": "subtract {k}", "mul": "multiply it by {k}"}


def describe_base(ops: list[A.Op]) -> str:
    words = [BASE_WORDS[name].format(k=k) for name, k in ops]
    return words[0] if len(words) == 1 else f"{words[0]}, then {words[1]}"


def apply_bug(ops: list[A.Op], bug: str) -> list[A.Op]:
    index, _, op = bug.partition("_")
    if not index.isdigit() or int(index) >= len(ops):
        raise FamilyError(f"bad bug {bug!r}")
    buggy = list(ops)
    buggy[int(index)] = A.parse_ops(op)[0]
    return buggy


def breaks(ops: list[A.Op], buggy: list[A.Op], example: int) -> bool:
    """The bug changes the result on some hidden test input (so the repo fails)."""
    return any(A.evaluate(ops, x) != A.evaluate(buggy, x) for x in [example, 0, -4, 7, 13])


class Fix:
    name = "fix"

    def sample(self, rng: random.Random, names: str = "train", pseudo_share: float | None = None) -> tuple[str, ...]:
        module, func, arg = A.draw_names(rng, names, A.FILES, A.FUNCS, A.ARGS, pseudo_share)
        ops = A.sample_ops(rng)
        while True:
            index = rng.randrange(len(ops))
            bug = f"{index}_{A.ops_token([(pick(rng, A.OPS), rng.choice(A.CONSTS))])}"
            tokens_so_far = (module, func, arg, A.ops_token(ops), bug)
            if breaks(ops, apply_bug(ops, bug), A.example_input(*tokens_so_far)):
                break
        split = split_of_fingerprint(A.fingerprint(ops))
        helper = N.draw(rng, A.FUNCS, "function", names, avoid=(module, func, arg), pseudo_share=pseudo_share)
        helper_ops = A.sample_ops(rng)
        while split_of_fingerprint(A.fingerprint(helper_ops)) != split:
            helper_ops = A.sample_ops(rng)
        return (*tokens_so_far, helper, A.ops_token(helper_ops), pick(rng, ("t", "h")))

    def _parse(self, tokens: tuple[str, ...]):
        if len(tokens) != 8:
            raise FamilyError(f"fix takes 8 parameters, got {len(tokens)}")
        module, func, arg, ops_tok, bug, helper, helper_tok, order = tokens
        A.check_names(module, func, arg, A.FILES, A.FUNCS, A.ARGS)
        N.check(helper, A.FUNCS, "function")
        if helper in (module, func, arg):
            raise FamilyError(f"the helper function's name {helper!r} is taken by the file, function or argument")
        check_choice(order, ("t", "h"), "order")
        ops, helper_ops = A.parse_ops(ops_tok), A.parse_ops(helper_tok)
        buggy = apply_bug(ops, bug)
        example = A.example_input(*tokens[:5])
        if not breaks(ops, buggy, example):
            raise FamilyError(f"bug {bug!r} does not change the function")
        if split_of_fingerprint(A.fingerprint(helper_ops)) != split_of_fingerprint(A.fingerprint(ops)):
            raise FamilyError("the helper's behaviour is in the other split")
        return module, func, arg, ops, buggy, helper, helper_ops, order, example

    def fingerprint(self, tokens: tuple[str, ...]) -> str:
        return A.fingerprint(self._parse(tokens)[3])

    def names_pool(self, tokens: tuple[str, ...]) -> str:
        self._parse(tokens)
        return N.names_pool(A.check_names(*tokens[:3], A.FILES, A.FUNCS, A.ARGS), N.check(tokens[5], A.FUNCS, "function"))

    def skill(self, tokens: tuple[str, ...]) -> str:
        ops = self._parse(tokens)[3]
        return f"fix:{A.skill_of(ops)}:{tokens[4].partition('_')[0]}"

    def build(self, tokens: tuple[str, ...]) -> Built:
        module, func, arg, ops, buggy, helper, helper_ops, order, ex = self._parse(tokens)

        def module_source(target_ops: list[A.Op]) -> str:
            parts = [A.function_source(func, arg, target_ops), A.function_source(helper, arg, helper_ops)]
            return "\n\n".join(parts if order == "t" else parts[::-1])

        instruction = (
            f"`{func}({arg})` in `{module}.py` has a bug. It should take an integer {arg}, {describe_base(ops)}, "
            f"and return the result. Example: {func}({ex}) should be {A.evaluate(ops, ex)}. "
            f"Fix the bug and keep the other function as it is."
        )
        tests = test_module(func, module, A.cases(ops, ex), lambda a: f"{func}({a})")
        tests += f"\nfrom {module} import {helper}\n" + "".join(
            f"\n\ndef test_{helper}_{i}():\n    assert {helper}({x}) == {A.evaluate(helper_ops, x)!r}\n"
            for i, x in enumerate((1, 6)))
        return Built(
            instruction=instruction,
            files={f"{module}.py": module_source(buggy)},
            hidden_tests={f"test_{func}.py": tests},
            solution={f"{module}.py": module_source(ops)},
        )
