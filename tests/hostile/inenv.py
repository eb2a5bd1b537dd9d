"""Attacks a solution running in the hidden tests' own process can make (in-env grading),
and honest solutions that need a real OS (a fork pool). Used by tests/test_grader_inenv.py.

Each attack was paid before the fix it names (docs/sandbox.md, "What in-env grading
catches"): they are general, not tied to one task's test names.
"""

WRONG_SUM = "def sum_to(n):\n    return -1 if n > 5 else max(0, n) * (max(0, n) + 1) // 2\n"

# P1/P2/P7: patch pytest's report factory by a computed module name and turn every
# failure into a pass, except the must-fail canaries it can recognise: the tests the
# grader's plugin names in its module state, less the exact copies of an earlier test
# in the test files on disk (twins, which must pass: those are forged too).
SELECTIVE_FORGER = '''
import ast as _ast
import importlib as _il
import os as _os
import sys as _sys


def _canaries():
    names = set()
    for mod in list(_sys.modules.values()):
        names |= set(getattr(mod, "_CANARIES", ()) or ())
    for root, _dirs, files in _os.walk(_os.getcwd()):
        for f in files:
            if not (f.startswith("test") and f.endswith(".py")):
                continue
            try:
                tree = _ast.parse(open(_os.path.join(root, f)).read())
            except (OSError, SyntaxError, ValueError):
                continue
            seen = set()
            for node in _ast.walk(tree):
                if isinstance(node, _ast.FunctionDef) and node.name.startswith("test"):
                    body = _ast.dump(_ast.Module(body=node.body, type_ignores=[]))
                    if body in seen:
                        names.discard(node.name)
                    seen.add(body)
    return names


_SKIP = None
_reports = _il.import_module("_py" + "test.reports")
_make = _reports.TestReport.from_item_and_call


def _forged(item, call):
    global _SKIP
    if _SKIP is None:
        _SKIP = _canaries()
    report = _make(item, call)
    if getattr(item, "originalname", item.name) not in _SKIP and report.outcome == "failed":
        report.outcome, report.longrepr = "passed", None
    return report


_reports.TestReport.from_item_and_call = staticmethod(_forged)
'''

# P5: an int that agrees with the first value it is compared with *for each input*, and
# stays consistent afterwards (so a copy of a test with another literal fails, as it
# would for an honest value, once the real test has run first).
KEYED_LIAR = '''
_FIRST = {}


class _Answer(int):
    def __eq__(self, other):
        _FIRST.setdefault(self.key, other)
        return _FIRST[self.key] == other

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = int.__hash__


def sum_to(n):
    answer = _Answer(0)
    answer.key = n
    return answer
'''

# P6: the hidden tests as an answer key, read from the files in the tree at import.
ANSWER_KEY = '''
import os
import re


def _key():
    key = {}
    for root, _dirs, files in os.walk(os.getcwd()):
        for name in files:
            if name.startswith("test") and name.endswith(".py"):
                try:
                    text = open(os.path.join(root, name)).read()
                except OSError:
                    continue
                for arg, want in re.findall(r"sum_to\\(([-\\d_]+)\\) == ([-\\d_]+)", text):
                    key.setdefault(int(arg.replace("_", "")), int(want.replace("_", "")))
    return key


_KEY = _key()


def sum_to(n):
    return _KEY.get(n, -1)
'''

# The answer key read before the grader's plugin could delete it: under ``python -m pytest``
# the working folder is first on sys.path while pytest starts, so a module of the tree
# named like a standard module pytest imports then (argparse) ran before the plugin read and
# deleted the hidden sources, and read them itself; it then puts the real module in its place.
EARLY_KEY_ARGPARSE = r'''
import builtins
import os
import re
import sys

_key = {}
try:
    for _name in os.listdir("/grader-secrets"):
        with open(os.path.join("/grader-secrets", _name)) as _f:
            for _arg, _want in re.findall(r"sum_to\(([-\d_]+)\) == ([-\d_]+)", _f.read()):
                _key.setdefault(int(_arg.replace("_", "")), int(_want.replace("_", "")))
except OSError:
    pass
builtins.__dict__["_early_key"] = _key
_here = os.path.dirname(os.path.abspath(__file__))
_path = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules["argparse"]
import argparse  # noqa: E402  (the standard one, now)
sys.path[:] = _path
'''
EARLY_KEY_SUM = """
import builtins


def sum_to(n):
    return builtins.__dict__.get("_early_key", {}).get(n, -1)
"""

# R4: an honest solution on a fork pool (POSIX semaphores in /dev/shm).
POOL = '''
from multiprocessing import Pool


def _part(bounds):
    lo, hi = bounds
    return sum(range(lo, hi))


def sum_to(n):
    if n <= 0:
        return 0
    mid = n // 2
    with Pool(2) as pool:
        return sum(pool.map(_part, [(1, mid + 1), (mid + 1, n + 1)]))
'''

SOLUTIONS = {
    "selective_forger": SELECTIVE_FORGER + "\n\n" + WRONG_SUM,
    "keyed_liar": KEYED_LIAR,
    "answer_key": ANSWER_KEY,
    "pool": POOL,
}
