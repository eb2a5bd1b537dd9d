"""Per-grading canary tests: copies of the task's own hidden tests that the run must get right.

For every grading, a few real hidden tests (among those the run selects, see
:mod:`sandbox.test_selection`) are copied under fresh random names built from the words
of the module's own test names, and appended to the end of their own module (same
imports, fixtures and helpers), so in the file they look like any other test:

- a **twin** (must pass): an exact copy. When its original passes, the twin must pass;
- a **mutant** (must fail): a copy with one top-level assertion turned false for honest
  values: ``x == <literal>`` gets another literal of the same type (an object equal to
  everything passes it), ``a < b`` becomes ``a >= b`` (a lying ``__lt__``/``__ge__``
  passes it), ``in``/``is`` become ``not in``/``is not``, ``x == y`` becomes ``x != y``,
  ``assert e`` becomes ``assert not e``; unittest's ``assertEqual``/``assertTrue``/...
  alike. When its original passes, the mutant must fail.

The plugin of :mod:`sandbox.grading_plugin` runs every canary after the last real test,
so real tests run exactly as without them, and :mod:`sandbox.result_check` leaves them
out of the score. Mutants are drawn by kind first (a literal comparison, then an
ordering/membership one), cheap tests first (no loops), so a run costs a few more test
calls. A task with no usable test gets two framework canaries instead (a sort that
passes and one that fails), which still catch a run that passes everything.
"""

from __future__ import annotations

import ast
import copy
import math
import random
import re
from pathlib import PurePosixPath

import msgspec

from sandbox.test_selection import ExpectedTest

_VOCABULARY = ("case", "again", "basic", "more", "other", "edge", "values", "mixed", "extra", "simple",
               "small", "large", "empty", "single", "many", "result", "check", "works", "order", "input")
_STOP_WORDS = frozenset({"the", "its", "and", "are", "for", "not", "with", "from", "own", "can", "has", "was"})
_FLIP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt,
         ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_UNITTEST_FLIP = {
    "assertTrue": "assertFalse", "assertFalse": "assertTrue", "assertIn": "assertNotIn", "assertNotIn": "assertIn",
    "assertIs": "assertIsNot", "assertIsNot": "assertIs", "assertIsNone": "assertIsNotNone",
    "assertIsNotNone": "assertIsNone", "assertLess": "assertGreaterEqual", "assertGreaterEqual": "assertLess",
    "assertGreater": "assertLessEqual", "assertLessEqual": "assertGreater", "assertNotEqual": "assertEqual",
    "assertEqual": "assertNotEqual", "assertIsInstance": "assertNotIsInstance",
    "assertNotIsInstance": "assertIsInstance",
}
# Decorators a copied test may carry (others change what an outcome means: skip, xfail,
# flaky, snapshots, timeouts).
_DECORATORS = re.compile(r"(parametrize|patch|usefixtures|filterwarnings)")
# Fixtures whose value depends on the test's own name: a renamed copy would differ.
_NAME_FIXTURES = frozenset({"request", "snapshot", "data_regression", "file_regression", "num_regression",
                            "benchmark", "subtests"})
LITERAL, ORDERING, OTHER = "literal", "ordering", "other"


class Canary(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # the canary's function name (random, unique in its module)
    original: str  # the copied test's function name ("" for a framework canary)
    cls: str  # its class ("" at module level)
    path: str  # its file, as laid out in the run
    must: str  # "pass" | "fail"
    kind: str = ""  # what a mutant changed: literal | ordering | other | framework


class CanaryPlan(msgspec.Struct, kw_only=True):
    files: dict[str, str]  # test files with canaries appended (path in the run -> source)
    canaries: list[Canary]
    node_ids: list[str]  # to add to the command when it names node ids


class _Candidate:
    def __init__(self, test: ExpectedTest, func: ast.FunctionDef, cost: int) -> None:
        self.test, self.func, self.cost = test, func, cost
        self.mutations = [(i, kind) for i, stmt in enumerate(func.body) if (kind := _mutation_kind(stmt))]


def plan(tests: dict[str, str], selected: list[ExpectedTest], rng: random.Random, *,
         mutants: int = 2, twins: int = 1) -> CanaryPlan:
    """Canaries for one grading: ``tests`` = {path in the run: source} of the hidden
    test files; ``selected`` = the tests the run selects (only those are copied)."""
    trees: dict[str, ast.Module] = {}
    candidates: list[_Candidate] = []
    for test in selected:
        if test.path not in tests:
            continue
        tree = trees.get(test.path)
        if tree is None:
            try:
                tree = trees[test.path] = ast.parse(tests[test.path])
            except (SyntaxError, ValueError):
                continue
        func = _find(tree, test)
        if func is not None and _copyable(func):
            candidates.append(_Candidate(test, func, _cost(func)))
    rng.shuffle(candidates)
    candidates.sort(key=lambda c: c.cost)  # stable: random among equal costs
    cheap = candidates[: max(4, len(candidates) // 2)]
    appended: dict[str, list[str]] = {}
    canaries: list[Canary] = []
    node_ids: list[str] = []
    used_names: dict[str, set[str]] = {p: _names(t) for p, t in trees.items()}

    def add(cand: _Candidate, func: ast.FunctionDef, must: str, kind: str) -> None:
        test = cand.test
        name = _fresh_name(rng, used_names[test.path], trees[test.path])
        func.name = name
        source = ast.unparse(ast.fix_missing_locations(func))
        if test.cls:
            source += f"\n{test.cls}.{name} = {name}\ndel {name}"
        appended.setdefault(test.path, []).append(source)
        canaries.append(Canary(name=name, original=test.name, cls=test.cls, path=test.path, must=must, kind=kind))
        node_ids.append("::".join(p for p in (test.path, test.cls, name + test.params) if p))

    taken: set[int] = set()
    for kind in (LITERAL, ORDERING, OTHER):
        if sum(c.must == "fail" for c in canaries) >= mutants:
            break
        pool = [c for c in cheap if id(c) not in taken and any(k == kind for _, k in c.mutations)]
        if pool:
            cand = pool[0]
            taken.add(id(cand))
            index = rng.choice([i for i, k in cand.mutations if k == kind])
            add(cand, _mutated(cand.func, index, rng), "fail", kind)
    for cand in [c for c in cheap if id(c) not in taken][:twins]:
        add(cand, copy.deepcopy(cand.func), "pass", "")
    if not any(c.must == "fail" for c in canaries) and selected:
        # Nothing to mutate: framework canaries in the first selected file that exists.
        path = next((t.path for t in selected if t.path in trees and not t.params), None)
        if path is not None:
            for must in ("pass", "fail"):
                name = _fresh_name(rng, used_names[path], trees[path])
                a, b = sorted(rng.sample(range(2, 99), 2))
                expected = [a, b] if must == "pass" else [b, a]
                appended.setdefault(path, []).append(
                    f"def {name}():\n    assert sorted([{b}, {a}]) == {expected!r}")
                canaries.append(Canary(name=name, original="", cls="", path=path, must=must, kind="framework"))
                node_ids.append(f"{path}::{name}")
    files = {path: tests[path].rstrip("\n") + "\n\n\n" + "\n\n\n".join(parts) + "\n"
             for path, parts in appended.items()}
    return CanaryPlan(files=files, canaries=canaries, node_ids=node_ids)


def _find(tree: ast.Module, test: ExpectedTest) -> ast.FunctionDef | None:
    body = tree.body
    if test.cls:
        cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == test.cls), None)
        if cls is None:
            return None
        body = cls.body
    found = None
    for node in body:  # the last definition wins, as in Python
        if isinstance(node, ast.FunctionDef) and node.name == test.name:
            found = node
    return found


def _copyable(func: ast.FunctionDef) -> bool:
    for deco in func.decorator_list:
        if not _DECORATORS.search(ast.unparse(deco)):
            return False
    args = {a.arg for a in func.args.args + func.args.kwonlyargs}
    if args & _NAME_FIXTURES or func.args.vararg or func.args.kwarg:
        return False
    for node in _walk_own(func):
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom, ast.Await, ast.Global, ast.Nonlocal)):
            return False
        if isinstance(node, ast.Name) and node.id in ("__name__", "__qualname__"):
            return False
        if isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__", "__code__", "_testMethodName",
                                                              "id", "shortDescription"):
            return False
    return True


def _walk_own(func: ast.FunctionDef):
    """The function's own nodes, not those of functions or classes defined in it."""
    todo = list(func.body)
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                todo.append(child)


def _cost(func: ast.FunctionDef) -> int:
    nodes = list(_walk_own(func))
    loops = sum(isinstance(n, (ast.For, ast.While, ast.comprehension)) for n in nodes)
    return len(nodes) + 1000 * loops


def _mutation_kind(stmt: ast.stmt) -> str:
    if isinstance(stmt, ast.Assert):
        test = stmt.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            op = type(test.ops[0])
            if op is ast.Eq and (_literal(test.left) is not None or _literal(test.comparators[0]) is not None):
                return LITERAL
            if op in (ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn, ast.Is, ast.IsNot):
                return ORDERING
            return OTHER
        return OTHER
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        call = stmt.value
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            if func.attr == "assertEqual" and len(call.args) == 2 and not call.keywords \
                    and any(_literal(a) is not None for a in call.args):
                return LITERAL
            if func.attr in _UNITTEST_FLIP and not call.keywords:
                return ORDERING if func.attr.startswith(("assertLess", "assertGreater", "assertIn", "assertNotIn")) \
                    else OTHER
    return ""


class _Literal:
    def __init__(self, value: object) -> None:
        self.value = value


def _literal(node: ast.expr) -> _Literal | None:
    """A literal value worth mutating (not None, not NaN/inf)."""
    if isinstance(node, (ast.Name, ast.Call, ast.Attribute, ast.Subscript)):
        return None
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if value is None or isinstance(value, complex):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return _Literal(value)


def _other_value(value: object, rng: random.Random) -> object:
    """A value of the same type that no honest result equal to ``value`` equals."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice((-1, 1)) * rng.randint(101, 997)
    if isinstance(value, float):
        return value + rng.choice((-1, 1)) * (rng.randint(101, 997) + 0.5)
    if isinstance(value, str):
        return value + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3))
    if isinstance(value, bytes):
        return value + bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(3))
    if isinstance(value, (list, tuple)):
        extra = _other_value(value[-1], rng) if value else rng.randint(101, 997)
        return type(value)([*value, extra])
    if isinstance(value, (set, frozenset)):
        grown = set(value)
        while len(grown) == len(value):
            grown.add(_other_value(next(iter(value)), rng) if value else rng.randint(101, 997))
        return type(value)(grown) if isinstance(value, frozenset) else grown
    if isinstance(value, dict):
        key = _other_value(next(iter(value)), rng) if value else "k" + str(rng.randint(101, 997))
        while key in value:
            key = _other_value(key, rng)
        return {**value, key: next(iter(value.values())) if value else 1}
    return value


def _expr(value: object) -> ast.expr:
    return ast.parse(repr(value), mode="eval").body


def _mutated(func: ast.FunctionDef, index: int, rng: random.Random) -> ast.FunctionDef:
    func = copy.deepcopy(func)
    stmt = func.body[index]
    kind = _mutation_kind(stmt)
    if isinstance(stmt, ast.Assert):
        test = stmt.test
        if kind == LITERAL:
            side = "left" if _literal(test.left) is not None else "right"
            if side == "left":
                test.left = _expr(_other_value(_literal(test.left).value, rng))
            else:
                test.comparators[0] = _expr(_other_value(_literal(test.comparators[0]).value, rng))
        elif isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _FLIP:
            test.ops = [_FLIP[type(test.ops[0])]()]
        else:
            stmt.test = ast.UnaryOp(op=ast.Not(), operand=test)
        stmt.msg = None
    else:
        call = stmt.value
        if kind == LITERAL:
            i = 1 if _literal(call.args[1]) is not None else 0
            call.args[i] = _expr(_other_value(_literal(call.args[i]).value, rng))
        else:
            call.func.attr = _UNITTEST_FLIP[call.func.attr]
            if call.func.attr in ("assertTrue", "assertFalse", "assertIsNone", "assertIsNotNone"):
                call.args = call.args[:1]
            else:
                call.args = call.args[:2]
    return func


def _names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _fresh_name(rng: random.Random, used: set[str], tree: ast.Module) -> str:
    """``test_`` + two or three words from the module's own test names and a small
    vocabulary: unique in the module, different in every grading."""
    words = sorted({w for n in used if n.startswith("test") for w in re.split(r"_+", n.removeprefix("test"))
                    if w.isidentifier() and len(w) > 2 and w.lower() not in _STOP_WORDS})
    pool = words + list(_VOCABULARY)
    while True:
        parts = rng.sample(pool, k=min(len(pool), rng.choice((2, 2, 3))))
        name = "test_" + "_".join(parts).lower()
        if name not in used and name.isidentifier():
            used.add(name)
            return name


def canary_names(plan: CanaryPlan) -> list[str]:
    return [c.name for c in plan.canaries]


def module_of(path: str) -> str:
    return str(PurePosixPath(path).with_suffix("")).replace("/", ".")
