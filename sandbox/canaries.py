"""Per-grading canary tests: copies of the task's own hidden tests that the run must get right.

For every grading, a few real hidden tests (among those the run selects, see
:mod:`sandbox.test_selection`) are copied under fresh random names built from the words
of the module's own test names, and inserted into their own module (same imports,
fixtures and helpers) at a random place after the test they copy (a method: inside its
class), so they run interleaved with the real tests, in an order that differs in every
grading. Nothing in the run names them: the grader's plugin is not told which tests are
canaries (only :mod:`sandbox.result_check`, outside the run, knows):

- a **twin** (must pass): an exact copy. When its original passes, the twin must pass;
- a **probe** (must pass): a copy in which ``assert E == <literal>`` first checks that
  the value is *not* equal to another literal (``v = E; assert not (v == <other>);
  assert v == <literal>``): a value that agrees with the first thing it is compared
  with, and stays consistent afterwards, fails it;
- a **mutant** (must fail): a copy with one top-level assertion turned false for honest
  values: ``x == <literal>`` gets another literal of the same type (an object equal to
  everything passes it), ``a < b`` becomes ``a >= b`` (a lying ``__lt__``/``__ge__``
  passes it), ``in``/``is`` become ``not in``/``is not``, ``x == y`` becomes ``x != y``,
  ``assert e`` becomes ``assert not e``; unittest's ``assertEqual``/``assertTrue``/...
  alike. An **input mutant** changes a literal argument of the call under test *and*
  the expected literal (``f(10) == 55`` -> ``f(6) == 722``): a value that remembers
  the answers it saw for an input has none for this one. The new argument costs no more
  than the old (an int of the same sign and parity, smaller; a str of the same length). When its original passes, a
  mutant must fail.

:mod:`sandbox.result_check` leaves canaries out of the score. Mutants are drawn by kind
first (a literal comparison, an ordering/membership one, another), cheap tests first (no
loops), so a run costs a few more test calls. A task with no usable test gets two
framework canaries instead (a sort that passes and one that fails), which still catch a
run that passes everything.
"""

from __future__ import annotations

import ast
import copy
import fnmatch
import math
import random
import re
from pathlib import PurePosixPath

import msgspec

from sandbox import pyast
from sandbox.test_selection import ExpectedTest, pattern_form

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
INPUT, PROBE = "input", "probe"


class Canary(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # the canary's function name (random, unique in its module)
    original: str  # the copied test's function name ("" for a framework canary)
    cls: str  # its class ("" at module level)
    path: str  # its file, as laid out in the run
    must: str  # "pass" | "fail"
    kind: str = ""  # literal | ordering | other | input (mutants), probe ("" twin), framework


class CanaryPlan(msgspec.Struct, kw_only=True):
    files: dict[str, str]  # test files with canaries inserted (path in the run -> source)
    canaries: list[Canary]
    node_ids: list[str]  # to add to the command when it names node ids


class _Candidate:
    def __init__(self, test: ExpectedTest, func: ast.FunctionDef, cost: int) -> None:
        self.test, self.func, self.cost = test, func, cost
        self.mutations = [(i, kind) for i, stmt in enumerate(func.body) if (kind := _mutation_kind(stmt))]
        self.inputs = [i for i, stmt in enumerate(func.body) if _input_site(stmt) is not None]
        self.probes = [i for i, stmt in enumerate(func.body) if _probe_site(stmt) is not None]


def plan(tests: dict[str, str], selected: list[ExpectedTest], rng: random.Random, *,
         mutants: int = 2, twins: int = 1, function_patterns: list[str] | tuple[str, ...] = ("test",)) -> CanaryPlan:
    """Canaries for one grading: ``tests`` = {path in the run: source} of the hidden
    test files; ``selected`` = the tests the run selects (only those are copied);
    ``function_patterns``: the run's ``python_functions`` (a canary's name is made to
    match the pattern its original matches, so the run collects it as it does the
    original; an original matching none is a unittest method: ``test`` prefix)."""
    trees: dict[str, ast.Module] = {}
    candidates: list[_Candidate] = []
    for test in selected:
        if test.path not in tests:
            continue
        tree = trees.get(test.path)
        if tree is None:
            try:
                tree = trees[test.path] = pyast.parse(tests[test.path])
            except (SyntaxError, ValueError):
                continue
        func = _find(tree, test)
        if func is not None and _copyable(func) and func.body[0].lineno != func.lineno \
                and name_form(test.name, function_patterns) is not None:
            candidates.append(_Candidate(test, func, _cost(func)))
    rng.shuffle(candidates)
    candidates.sort(key=lambda c: c.cost)  # stable: random among equal costs
    cheap = candidates[: max(4, len(candidates) // 2)]
    inserts: dict[str, list[tuple[int, int, str]]] = {}  # path -> (line to insert after, indent width, text)
    canaries: list[Canary] = []
    node_ids: list[str] = []
    used_names: dict[str, set[str]] = {p: _names(t) for p, t in trees.items()}

    def add(cand: _Candidate, func: ast.FunctionDef, must: str, kind: str) -> None:
        test = cand.test
        name = _fresh_name(rng, used_names[test.path], trees[test.path], name_form(test.name, function_patterns))
        func.name = name
        source = ast.unparse(ast.fix_missing_locations(func))
        after, indent = _place(trees[test.path], tests[test.path], cand.func, test.cls, rng)
        inserts.setdefault(test.path, []).append((after, len(indent), _indented(source, indent)))
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
    # Input mutant and probe: against values that remember what they were compared with.
    pool = [c for c in cheap if c.inputs]
    if pool:
        cand = rng.choice(pool[:3])
        seen = _call_literals(trees[cand.test.path])
        add(cand, _input_mutated(cand.func, rng.choice(cand.inputs), rng, seen), "fail", INPUT)
    pool = [c for c in cheap if c.probes]
    if pool:
        cand = rng.choice(pool[:3])
        local = _fresh_local(rng, used_names[cand.test.path])
        add(cand, _probed(cand.func, rng.choice(cand.probes), local, rng), "pass", PROBE)
    for cand in [c for c in cheap if id(c) not in taken][:twins]:
        add(cand, copy.deepcopy(cand.func), "pass", "")
    if not any(c.must == "fail" for c in canaries) and selected:
        # Nothing to mutate: framework canaries in the first selected file that exists.
        path = next((t.path for t in selected if t.path in trees and not t.params), None)
        form = next((f for p in function_patterns if (f := pattern_form(p)) is not None), None)
        if path is not None and form is not None:
            for must in ("pass", "fail"):
                name = _fresh_name(rng, used_names[path], trees[path], form)
                a, b = sorted(rng.sample(range(2, 99), 2))
                expected = [a, b] if must == "pass" else [b, a]
                body = trees[path].body
                after = body[rng.randrange(len(body))].end_lineno - 1 if body else -1
                inserts.setdefault(path, []).append(
                    (after, 0, f"\n\ndef {name}():\n    assert sorted([{b}, {a}]) == {expected!r}\n"))
                canaries.append(Canary(name=name, original="", cls="", path=path, must=must, kind="framework"))
                node_ids.append(f"{path}::{name}")
    files = {path: _inserted(tests[path], parts) for path, parts in inserts.items()}
    return CanaryPlan(files=files, canaries=canaries, node_ids=node_ids)


def _place(tree: ast.Module, source: str, func: ast.FunctionDef, cls: str,
           rng: random.Random) -> tuple[int, str]:
    """A random place after ``func`` in its own body (module or class): the 0-based line
    to insert after, and the body's indentation."""
    body = tree.body
    indent = ""
    if cls:
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        body = node.body
        line = source.splitlines()[body[0].lineno - 1]
        indent = line[: len(line) - len(line.lstrip(" \t"))]
    index = next(i for i, n in enumerate(body) if n is func)
    after = body[rng.randrange(index, len(body))]
    return after.end_lineno - 1, indent


def _indented(source: str, indent: str) -> str:
    lines = source.splitlines()
    return "\n\n" + "".join((indent + line if line.strip() else line) + "\n" for line in lines)


def _inserted(source: str, parts: list[tuple[int, int, str]]) -> str:
    """``parts``: (0-based line to insert after, indentation width, text). Of two texts
    after the same line (a class's last method and the module's last statement end on
    it), the more indented comes first, so it stays in the class."""
    lines = source.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    for after, _, text in sorted(parts, key=lambda p: (p[0], -p[1]), reverse=True):
        lines.insert(after + 1, text)
    return "".join(lines)


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
    for node in own_nodes(func):
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom, ast.Await, ast.Global, ast.Nonlocal)):
            return False
        if isinstance(node, ast.Name) and node.id in ("__name__", "__qualname__"):
            return False
        if isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__", "__code__", "_testMethodName",
                                                              "id", "shortDescription"):
            return False
    return True


def own_nodes(func: ast.FunctionDef | ast.AsyncFunctionDef):
    """The nodes of the function's body, not those of functions, lambdas or classes
    defined in it (canaries and witnesses both ask what a test body itself does)."""
    todo = list(func.body)
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                todo.append(child)


def _cost(func: ast.FunctionDef) -> int:
    nodes = list(own_nodes(func))
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
    return pyast.parse(repr(value), mode="eval").body


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


def _eq_sides(stmt: ast.stmt) -> tuple[ast.expr, ast.expr, str] | None:
    """(value side, literal side, where the literal is) of ``assert E == <literal>`` or
    ``self.assertEqual(E, <literal>)`` (either order)."""
    if isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Compare) and len(stmt.test.ops) == 1 \
            and isinstance(stmt.test.ops[0], ast.Eq):
        left, right = stmt.test.left, stmt.test.comparators[0]
    elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute) \
            and isinstance(stmt.value.func.value, ast.Name) and stmt.value.func.value.id == "self" \
            and stmt.value.func.attr == "assertEqual" and len(stmt.value.args) == 2 and not stmt.value.keywords:
        left, right = stmt.value.args
    else:
        return None
    if _literal(right) is not None and _literal(left) is None:
        return left, right, "right"
    if _literal(left) is not None and _literal(right) is None:
        return right, left, "left"
    return None


def _input_site(stmt: ast.stmt) -> tuple[ast.Call, list[int]] | None:
    """``f(..., <literal>, ...) == <literal>``: the call and its literal positional
    arguments (ints, floats, strings) that can be changed."""
    sides = _eq_sides(stmt)
    # A bool answer is not changed: f(other input) == (not answer) may well hold.
    if sides is None or not isinstance(sides[0], ast.Call) or isinstance(_literal(sides[1]).value, bool):
        return None
    call = sides[0]
    args = [i for i, a in enumerate(call.args) if (lit := _literal(a)) is not None
            and _other_input(lit.value, random.Random(0)) is not None]
    return (call, args) if args else None


def _other_input(value: object, rng: random.Random) -> object | None:
    """Another argument no more costly than ``value``: an int of the same sign and parity
    and a smaller magnitude, never 0 (a loop or recursion over it does no more work, a
    loop stepping by 2 still ends, a size or step stays non-zero), a str of the same
    length with one letter changed; None for anything else (or an int too small to
    change so)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and abs(value) >= 3:
        # Never 0: a size or step of 0 can loop forever where the original ends.
        step = 2 * rng.randint(1, (abs(value) - 1) // 2)
        return value - step if value > 0 else value + step
    if isinstance(value, str) and value:
        i = rng.randrange(len(value))
        letter = rng.choice([c for c in "qxzjkvw" if c != value[i]])
        return value[:i] + letter + value[i + 1:]
    return None


def _probe_site(stmt: ast.stmt) -> bool | None:
    sides = _eq_sides(stmt)
    return True if sides is not None and isinstance(_literal(sides[1]).value, (int, float, str, bytes, tuple,
                                                                                   list, bool)) else None


def _call_literals(tree: ast.Module) -> set[object]:
    """Literal arguments of every call in the module (inputs the real tests use)."""
    out: set[object] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for arg in node.args:
                lit = _literal(arg)
                if lit is not None and isinstance(lit.value, (int, str)):
                    out.add(lit.value)
    return out


def _input_mutated(func: ast.FunctionDef, index: int, rng: random.Random, seen: set[object]) -> ast.FunctionDef:
    """The input is one no call in the module uses, where one can be found: a value
    that remembers answers per input has never been shown one for it."""
    func = copy.deepcopy(func)
    stmt = func.body[index]
    call, args = _input_site(stmt)
    i = rng.choice(args)
    original = _literal(call.args[i]).value
    new = _other_input(original, rng)
    for _ in range(20):
        if new not in seen:
            break
        new = _other_input(original, rng)
    call.args[i] = _expr(new)
    _, literal, where = _eq_sides(stmt)
    _set_literal(stmt, where, _expr(_other_value(_literal(literal).value, rng)))
    if isinstance(stmt, ast.Assert):
        stmt.msg = None
    return func


def _set_literal(stmt: ast.stmt, where: str, value: ast.expr) -> None:
    if isinstance(stmt, ast.Assert):
        if where == "left":
            stmt.test.left = value
        else:
            stmt.test.comparators[0] = value
    else:
        stmt.value.args[0 if where == "left" else 1] = value


def _probed(func: ast.FunctionDef, index: int, local: str, rng: random.Random) -> ast.FunctionDef:
    """``assert E == L`` -> ``v = E; assert not (v == L'); assert v == L`` (the
    literal's side kept)."""
    func = copy.deepcopy(func)
    stmt = func.body[index]
    value, literal, where = _eq_sides(stmt)
    other = _expr(_other_value(_literal(literal).value, rng))
    name = ast.Name(id=local, ctx=ast.Load())
    pair = (other, name) if where == "left" else (name, other)
    probe = ast.Assert(test=ast.UnaryOp(op=ast.Not(), operand=ast.Compare(left=pair[0], ops=[ast.Eq()],
                                                                          comparators=[pair[1]])))
    assign = ast.Assign(targets=[ast.Name(id=local, ctx=ast.Store())], value=value)
    if isinstance(stmt, ast.Assert):
        stmt.msg = None
        if where == "left":
            stmt.test.comparators[0] = ast.Name(id=local, ctx=ast.Load())
        else:
            stmt.test.left = ast.Name(id=local, ctx=ast.Load())
    else:
        stmt.value.args[1 if where == "left" else 0] = ast.Name(id=local, ctx=ast.Load())
    func.body[index:index + 1] = [assign, probe, stmt]
    return func


def _fresh_local(rng: random.Random, used: set[str]) -> str:
    while True:
        name = rng.choice(("got", "value", "out", "res", "actual")) + "_" + rng.choice(_VOCABULARY)
        if name not in used:
            used.add(name)
            return name


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


def name_form(original: str, function_patterns: list[str] | tuple[str, ...]) -> tuple[str, str] | None:
    """The (prefix, suffix) a canary copied from the test ``original`` is named with: of
    the first pattern that collects ``original`` and can name a canary; ``("test", "")``
    for an original no pattern collects (a unittest method: unittest's own ``test``
    prefix collects it); None: the original is collected by a glob no canary can take."""
    matched = False
    for pattern in function_patterns:
        form = pattern_form(pattern)
        if original.startswith(pattern) or (any(c in pattern for c in "*?[") and fnmatch.fnmatch(original, pattern)):
            matched = True
            if form is not None:
                return form
    return None if matched else ("test", "")


def _fresh_name(rng: random.Random, used: set[str], tree: ast.Module,
                form: tuple[str, str] | None = ("test", "")) -> str:
    """``test_`` (the ``form``'s prefix, and its suffix) around two or three words from
    the module's own test names (and a small vocabulary where it has fewer than five):
    unique in the module, different in every grading."""
    prefix, suffix = form or ("test", "")
    stem = prefix.rstrip("_") or "test"
    words = sorted({w for n in used if n.startswith(stem) for w in re.split(r"_+", n.removeprefix(stem))
                    if w.isidentifier() and len(w) > 2 and w.lower() not in _STOP_WORDS})
    # The module's own words where it has enough (a name made of a fixed vocabulary would
    # stand out); the vocabulary only fills in for modules with few test names.
    pool = words if len(words) >= 5 else words + list(_VOCABULARY)
    while True:
        parts = rng.sample(pool, k=min(len(pool), rng.choice((2, 2, 3))))
        body = "_".join(parts).lower()
        name = (prefix if prefix.endswith("_") or not prefix else prefix + "_") + body
        name += suffix if suffix.startswith("_") or not suffix else "_" + suffix
        if name not in used and name.isidentifier():
            used.add(name)
            return name


def canary_names(plan: CanaryPlan) -> list[str]:
    return [c.name for c in plan.canaries]


def module_of(path: str) -> str:
    return str(PurePosixPath(path).with_suffix("")).replace("/", ".")
