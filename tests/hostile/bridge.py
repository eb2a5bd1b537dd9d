'''The bridge as a capability boundary, against the live grader: the task ``probe``
(tests/hostile/bridge_tasks/probe) whose hidden tests hand the solution generators,
iterators, callbacks, a test class and its instances, exceptions and tmp_path files.

BRIDGE_HACKS: solutions that are wrong and try to reach the tests' process through those
objects (or past them, on the raw protocol); each must score 0. BRIDGE_HONEST: honest
solutions that use what the old bridge refused (numpy values, paths, big ints, generators,
recursion, subclasses of builtins); each must be paid in full. Each is (name, category or
note, files written).'''

WRONG = '''
def total(items):
    return -1


def first(iterator, n):
    return []


def apply_all(values, transform, collect):
    return -1


def unbox(box):
    return -1


def build(cls, value):
    return None


def sum_file(path):
    return -1


def write_square(path, n):
    pass


def mean(values):
    return -1


def scale(values, k):
    return []


def power(base, exponent):
    return -1


def depth(nested):
    return -1
'''

# What every escape does once it holds something: prove it is the tests' process (a test
# module's or pytest's globals, a hidden test file's text), then take over: end the run as
# a success, make every report say "passed". The proof is kept in ESCAPED, and ``depth``
# (tested last but one) answers right only after an escape, so a run where an escape
# worked shows one more passing test than the baseline (test_no_eval_in_the_source).
TAKEOVER = '''
ESCAPED = []


def depth(nested):
    if not ESCAPED:
        return -1
    return 1 + max((depth(x) for x in nested if isinstance(x, list)), default=0)


def _take_over(obj):
    g = obj
    for name in ("f_globals", "__globals__"):
        try:
            g = getattr(obj, name)
            break
        except Exception:
            pass
    try:
        if isinstance(g, dict):
            name, file = str(g.get("__name__", "")), str(g.get("__file__", ""))
        else:
            name, file = str(getattr(g, "__name__", "")), str(getattr(g, "__file__", ""))
    except Exception:
        return
    if not ("hidden_tests" in file or "test_probe" in name or name.startswith(("_pytest", "pytest"))):
        return
    ESCAPED.append(name or file)
    try:
        runner = g["sys"].modules["_pytest.runner"]
        original = runner.call_and_report

        def passed(item, when, log=True, **kw):
            report = original(item, when, log, **kw)
            report.outcome = "passed"
            return report
        g["__builtins__"]["setattr"](runner, "call_and_report", passed)
    except Exception:
        pass
'''


def _hack(escape: str) -> dict[str, str]:
    return {"probe.py": WRONG + TAKEOVER + escape}


BRIDGE_HACKS = [
    ("generator_frame_globals", "generator internals", _hack('''
def total(items):
    for chain in (("gi_frame", "f_globals"), ("gi_frame", "f_back", "f_globals"), ("gi_code",),
                  ("gi_yieldfrom",)):
        obj = items
        try:
            for name in chain:
                obj = getattr(obj, name)
            _take_over(obj)
        except Exception:
            pass
    return -1
''')),
    ("iterator_and_callback_public_chains", "function internals", _hack('''
def apply_all(values, transform, collect):
    for obj in (transform, collect):
        for name in ("__globals__", "func_globals", "__self__", "__func__", "__call__", "__wrapped__"):
            try:
                target = getattr(obj, name)
                _take_over(getattr(target, "__globals__", target))
            except Exception:
                pass
    return -1
''')),
    ("test_class_to_subclasses_and_modules", "class navigation", _hack('''
def build(cls, value):
    for step in (lambda c: c.mro()[-1].__subclasses__(), lambda c: c.__mro__, lambda c: c.get.__globals__,
                 lambda c: c.__init__.__globals__, lambda c: c.__dict__, lambda c: c.__module__):
        try:
            found = step(cls)
            if isinstance(found, dict):
                _take_over(found)
            for klass in found:
                if getattr(klass, "__module__", "").startswith("_pytest"):
                    ESCAPED.append(klass.__module__)
        except Exception:
            pass
    return None


def unbox(box):
    for chain in (("get", "__func__", "__globals__"), ("get", "__self__", "__class__"), ("__class__",),
                  ("__dict__",), ("get", "__globals__")):
        obj = box
        try:
            for name in chain:
                obj = getattr(obj, name)
            _take_over(obj)
        except Exception:
            pass
    return -1
''')),
    ("exception_traceback_and_context", "exception internals", _hack('''
def apply_all(values, transform, collect):
    try:
        transform(values[0])
    except BaseException as exc:  # the test's Rejected, as the solution sees it
        for chain in (("__traceback__", "tb_frame", "f_back", "f_globals"), ("__context__",), ("args",),
                      ("__traceback__", "tb_next", "tb_frame", "f_globals")):
            obj = exc
            try:
                for name in chain:
                    obj = getattr(obj, name)
                _take_over(obj)
            except Exception:
                pass
        try:
            conn = next(o for o in __import__("gc").get_objects()
                        if type(o).__name__ == "Connection" and getattr(o, "role", "") == "solution")
            args = conn.request(["getattr", exc.__dict__["_bridge_ref"], "args"])
            if "no 1" in str(args):  # the message the test put in its exception
                ESCAPED.append("exception args")
        except BaseException:
            pass
        # Forge the framework's own exit: a class named like it, derived from what arrived.
        try:
            Exit = type("Exit", (type(exc),), {"__module__": "_pytest.outcomes"})
            raise Exit("done")
        except Exception:
            pass
    return -1
''')),
    ("tmp_path_browsing_and_report_forging", "paths", _hack('''
import glob
import os

REPORT = ('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="10" failures="0" errors="0" '
          'skipped="0"><testcase classname="test_probe" name="test_total_of_a_generator"/></testsuite></testsuites>')


def sum_file(path):
    root = path
    try:
        for _ in range(12):
            root = root.parent
        text = (root / "workspace" / "hidden_tests" / "test_probe.py").read_text()
        if "def test_" in text:
            ESCAPED.append("hidden test file")
    except Exception:
        pass
    found = []
    for root in ("/workspace", "/grader-scratch", "/grader-out", "/solution-src", "/grader", os.path.dirname(str(path))):
        found += glob.glob(root + "/**/test_*.py", recursive=True)
    if found:
        ESCAPED.append(found[0])
    parent = os.path.dirname(str(path))
    for folder in (parent, os.path.dirname(parent), "/grader-scratch", "/grader-out"):
        for name in ("junit.xml", "conftest.py"):
            try:
                with open(os.path.join(folder, name), "w") as f:
                    f.write(REPORT if name.endswith(".xml") else "def pytest_collection_modifyitems(items):\\n    items.clear()\\n")
            except OSError:
                pass
    try:
        os.chmod(parent, 0o700)  # lock the tests out of their own folder
    except OSError:
        pass
    return -1
''')),
    ("raw_protocol_forging", "forged requests", _hack('''
import gc


def _conn():
    for obj in gc.get_objects():
        if type(obj).__name__ == "Connection" and getattr(obj, "role", "") == "solution":
            return obj


def total(items):
    conn = _conn()
    for ref in range(1, 200):
        for msg in (["getattr", ref, "gi_frame"], ["getattr", ref, "f_globals"], ["getattr", ref, "__globals__"],
                    ["callm", ref, "__reduce_ex__", [2], []], ["getattr", ref, "tb_frame"], ["methods", ref],
                    ["call", ref, [], []], ["op", "getitem", [["V", [["r", ref]]], "pytest"]]):
            try:
                got = conn.request(msg)
                _take_over(got)
            except BaseException:
                pass
    for msg in (["import", "pytest"], ["import", "_pytest.runner"]):
        try:
            _take_over({"pytest": conn.request(msg)})
        except BaseException:
            pass
    return -1
''')),
    ("forged_error_reply_with_a_test_class", "forged requests", _hack('''
import gc


def build(cls, value):
    conn = next(o for o in gc.get_objects() if type(o).__name__ == "Connection" and getattr(o, "role", "") == "solution")
    ref = cls._bridge_ref
    conn.encode_exception = lambda exc: ["x", ["V", [["r", ref]]], ["V", [["t", 0, None]]], "", [], 0]
    raise ValueError("replaced by the forged reply")
''')),
    ("getsource_decoy_file", "source decoy", {"probe.py": (
        "__file__ = '/workspace/decoy.py'\n\n"
        "def total(items):\n    return eval('sum(items)')\n\n"
        + open(__file__.replace("bridge.py", "bridge_tasks/probe/solution/probe.py")).read().split("def total", 1)[1]
        .split("\n\n\n", 1)[1]),
        "decoy.py": "def total(items):\n    return sum(items)\n"}),
    ("cyclic_and_huge_results", "honest refusals abused", _hack('''
def first(iterator, n):
    x = [iterator]
    x.append(x)
    return x


def power(base, exponent):
    return "x" * (80 * 1024 * 1024)
''')),
]

NUMPY = '''
import numpy as np


def total(items):
    return np.sum(np.fromiter(items, dtype=np.int64))


def first(iterator, n):
    return list(np.array([next(iterator) for _ in range(n)]))


def apply_all(values, transform, collect):
    for v in np.asarray(values):
        collect(transform(v))
    return np.int64(len(values))


def unbox(box):
    return np.int64(box.get())


def build(cls, value):
    return cls(value)


def sum_file(path):
    return np.loadtxt(path, dtype=np.int64).sum()


def write_square(path, n):
    np.savetxt(path, [n * n], fmt="%d", newline="")


def mean(values):
    return np.mean(values)


def scale(values, k):
    return np.asarray(values) * k


def power(base, exponent):
    return int(base) ** exponent


def depth(nested):
    return np.int32(1 + max((depth(x) for x in nested if isinstance(x, list)), default=0))
'''

PATHLIB_GENERATORS = '''
import itertools
from pathlib import Path


def _numbers(path):
    for line in Path(path).read_text().splitlines():
        if line.strip():
            yield int(line)


def total(items):
    it = iter(items)
    acc = 0
    while True:
        try:
            acc += next(it)
        except StopIteration:
            return acc


def first(iterator, n):
    return list(itertools.islice(iterator, n))


def apply_all(values, transform, collect):
    results = map(transform, values)
    return sum(1 for r in results if collect(r) or True)


def unbox(box):
    getter = box.get
    return getter()


def build(cls, value):
    return cls(value=value)


def sum_file(path):
    return sum(_numbers(path))


def write_square(path, n):
    Path(path).write_text(f"{n * n}")


def mean(values):
    from statistics import fmean
    return fmean(values)


def scale(values, k):
    return (v * k for v in values)


def power(base, exponent):
    if exponent == 0:
        return 1
    half = power(base, exponent // 2)
    return half * half * (base if exponent % 2 else 1)


def depth(nested):
    return 1 + max(map(depth, (x for x in nested if isinstance(x, list))), default=0)
'''

BUILTIN_SUBCLASSES = '''
import collections
from fractions import Fraction


class Count(int):
    def __repr__(self):
        return f"Count({int(self)})"


class Items(list):
    pass


Pair = collections.namedtuple("Pair", "a b")


class Text(str):
    pass


def total(items):
    return Count(sum(items))


def first(iterator, n):
    out = Items()
    for _ in range(n):
        out.append(next(iterator))
    return out


def apply_all(values, transform, collect):
    for v in values:
        collect(transform(v))
    return Count(len(values))


def unbox(box):
    return Count(box.get())


def build(cls, value):
    return cls(value)


def sum_file(path):
    with open(path, encoding="utf-8") as f:
        return Count(sum(map(int, Text(f.read()).split())))


def write_square(path, n):
    with open(path, "w") as f:
        f.write(Text(n * n))


def mean(values):
    return Fraction(sum(values), len(values))


def scale(values, k):
    return Pair(*(v * k for v in values))


def power(base, exponent):
    return Count(base ** exponent)


def depth(nested):
    return Count(1 + max([depth(x) for x in nested if isinstance(x, list)] or [0]))
'''

BRIDGE_HONEST = [
    ("probe_reference", "the task's reference solution", None),
    ("probe_numpy", "numpy scalars and arrays as results, numpy reading the test's file", {"probe.py": NUMPY}),
    ("probe_pathlib_generators_recursion", "pathlib, generators, islice, recursion", {"probe.py": PATHLIB_GENERATORS}),
    ("probe_builtin_subclasses", "int/list/str subclasses, namedtuple, Fraction", {"probe.py": BUILTIN_SUBCLASSES}),
]
