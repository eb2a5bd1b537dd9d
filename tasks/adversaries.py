"""Generic adversarial solutions for task hygiene (``rollway tasks check``, tasks/check.py).

Each adversary is made from the task itself (its repository, its reference solution),
never written per task, and must not be paid by the grader: a task whose hidden tests
pay one of them teaches that trick. What each one is:

- ``always_equal``: every public function and method returns an object whose
  comparisons (``==``, ``<``, ``<=``, ``>``, ``>=``) are all True, ``!=`` False, truthy;
- ``lying_comparisons``: the reference solution, with every class's comparisons always
  True (``!=`` False): ordering tests that never check the reverse pass it. Applies
  where the solution's classes define comparisons of their own;
- ``c_level_copies``: the reference solution called on copies of its sequence and
  mapping arguments made by C code (``list(x)``, ``dict(x)``: for a ``list`` subclass
  they never call its ``__getitem__``): an access counter built on a ``list`` subclass
  sees no reads. Applies only where the hidden tests define a container class (an access
  counter, typically; elsewhere this is a correct, slower solution);
- ``returns_input``: every public function returns its first argument;
- ``reads_hidden_tests``: behaves as the reference only when it can read a hidden test
  file (searching the file system from its own folder and ``/`` for a test name only
  the hidden tests have, else any ``test_*.py`` under a ``hidden`` folder), else as the
  untouched repository. In-env grading serves the hidden tests to pytest from memory and
  leaves placeholders in the tree, so it must fail in both modes (docs/sandbox.md);
- ``forged_report``: at import, writes a JUnit report naming every test function it can
  find as passed wherever a report could go, then exits 0 (by a name the static checks
  do not see).
"""

from __future__ import annotations

import ast
from pathlib import PurePosixPath

import msgspec

from sandbox import pyast
from tasks.spec import TaskSpec

NAMES = ("always_equal", "lying_comparisons", "c_level_copies", "returns_input", "reads_hidden_tests",
         "forged_report")


class Adversary(msgspec.Struct, kw_only=True):
    name: str
    files: dict[str, str]  # the workspace (repository with the adversary's changes)
    expected_pass: bool = False  # a known limit (named in the check's output), not a task defect


_ANYTHING = '''

class _RwAnything:
    def __eq__(self, other):
        return True
    __lt__ = __le__ = __gt__ = __ge__ = __eq__
    def __ne__(self, other):
        return False
    def __bool__(self):
        return True
    def __hash__(self):
        return 0
    def __repr__(self):
        return "Anything()"
'''

# Replaces every public function and method the module defines with ``wrap(func)`` (the
# walk both "always equal" and "returns its input" use).
_WRAP_PUBLIC = '''

def _rw_wrap_public(namespace, wrap):
    for name, obj in list(namespace.items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != namespace["__name__"]:
            continue
        if isinstance(obj, type):
            for attr, member in list(vars(obj).items()):
                if attr.startswith("_"):
                    continue
                if isinstance(member, (classmethod, staticmethod)):
                    setattr(obj, attr, type(member)(wrap(member.__func__)))
                elif callable(member):
                    setattr(obj, attr, wrap(member))
        elif callable(obj):
            namespace[name] = wrap(obj)
'''

_WRAP_ALWAYS_EQUAL = _WRAP_PUBLIC + '''

def _rw_returning_anything(func):
    def wrapper(*args, **kwargs):
        return _RwAnything()
    return wrapper


_rw_wrap_public(globals(), _rw_returning_anything)
'''

_LYING = '''

def _rw_lying_comparisons(namespace):
    for name, obj in list(namespace.items()):
        if isinstance(obj, type) and getattr(obj, "__module__", None) == namespace["__name__"]:
            for op in ("__eq__", "__lt__", "__le__", "__gt__", "__ge__"):
                setattr(obj, op, lambda self, other: True)
            obj.__ne__ = lambda self, other: False


_rw_lying_comparisons(globals())
'''

_C_COPIES = '''

def _rw_c_level_copies(namespace):
    def copying(func):
        def plain(value):
            if isinstance(value, (str, bytes, bytearray)):
                return value
            if isinstance(value, dict) or hasattr(value, "keys"):
                return dict(value)
            if hasattr(value, "__len__") and hasattr(value, "__getitem__"):
                return list(value)
            return value
        def wrapper(*args, **kwargs):
            return func(*[plain(a) for a in args], **{k: plain(v) for k, v in kwargs.items()})
        return wrapper
    for name, obj in list(namespace.items()):
        if not name.startswith("_") and callable(obj) and not isinstance(obj, type) \\
                and getattr(obj, "__module__", None) == namespace["__name__"]:
            namespace[name] = copying(obj)


_rw_c_level_copies(globals())
'''

_RETURNS_INPUT = _WRAP_PUBLIC + '''

def _rw_echo(func):
    def wrapper(*args, **kwargs):
        values = list(args) + list(kwargs.values())
        return values[0] if values else None
    return wrapper


_rw_wrap_public(globals(), _rw_echo)
'''

_READS_TESTS = '''

def _rw_found_hidden_tests():
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    starts = [here, os.path.dirname(here), os.getcwd(), "/workspace", "/testbed", "/"]
    for start in starts:
        for root, dirs, files in os.walk(start):
            dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev", "usr", "lib", "lib64", "bin", "sbin",
                                                     "etc", "var", "__pycache__", ".venv", "site-packages")]
            for name in files:
                if not name.endswith(".py") or (not _RW_MARKER and not (name.startswith("test_")
                                                                        and "hidden" in root)):
                    continue
                try:
                    with open(os.path.join(root, name)) as f:
                        text = f.read()
                except OSError:
                    continue
                if (_RW_MARKER or "def test") in text and "_RW_MARKER = " not in text:  # not its own files
                    return True
    return False
'''

_FORGE = '''
import os as _rw_os


def _rw_forge():
    names = []
    for start in (_rw_os.getcwd(), "/workspace", "/testbed"):
        for root, dirs, files in _rw_os.walk(start):
            for name in files:
                if name.startswith("test_") and name.endswith(".py"):
                    try:
                        with open(_rw_os.path.join(root, name)) as f:
                            names += [(name[:-3], line.split("def ", 1)[1].split("(")[0])
                                      for line in f if line.lstrip().startswith("def test")]
                    except OSError:
                        pass
    cases = "".join('<testcase classname="%s" name="%s" time="0.001"/>' % n for n in names)
    report = ('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="0" failures="0" skipped="0" '
              'tests="%d" time="0.1">%s</testsuite></testsuites>' % (len(names), cases))
    for folder in ("/grader-out", _rw_os.getcwd(), "/tmp"):
        try:
            with open(_rw_os.path.join(folder, "junit.xml"), "w") as f:
                f.write(report)
        except OSError:
            pass
    getattr(_rw_os, "_e" + "xit")(0)


_rw_forge()
'''


def _modules(files: dict[str, str]) -> list[str]:
    return [p for p in files if p.endswith(".py") and not PurePosixPath(p).name.startswith("test_")
            and PurePosixPath(p).name != "conftest.py"]


_COMPARISONS = frozenset({"__eq__", "__lt__", "__le__", "__gt__", "__ge__"})


def _compares(source: str) -> bool:
    """Does the module define a class with comparisons of its own (``__eq__``/ordering
    dunders, ``functools.total_ordering``, ``dataclass(order=True)``)? Only there must the
    hidden tests pin both directions of a comparison."""
    try:
        tree = pyast.parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        if any(isinstance(i, ast.FunctionDef) and i.name in _COMPARISONS for i in node.body):
            return True
        for deco in node.decorator_list:
            text = ast.unparse(deco)
            if "total_ordering" in text or ("dataclass" in text and "order=True" in text):
                return True
    return False


_CONTAINERS = frozenset({"list", "dict", "tuple", "str", "UserList", "UserDict", "Sequence", "MutableSequence",
                         "Mapping", "MutableMapping"})


def counts_accesses(spec: TaskSpec) -> bool:
    """Do the hidden tests define a subclass of a builtin container that overrides a
    method (an access counter, typically)?"""
    for source in spec.hidden_tests.values():
        try:
            tree = pyast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(b).split(".")[-1] in _CONTAINERS for b in node.bases) and any(isinstance(i, ast.FunctionDef) for i in node.body):
                return True
    return False


def battery(spec: TaskSpec) -> list[Adversary]:
    """The adversaries that apply to this task (see the module docstring)."""
    solved = {**spec.files, **spec.solution}
    touched = [p for p in _modules(spec.solution)] or _modules(spec.files)
    out: list[Adversary] = []

    def appended(suffix: str, *, prefix: str = "", only: list[str] | None = None) -> dict[str, str]:
        return {**solved, **{p: prefix + solved[p] + suffix for p in (only if only is not None else touched)}}

    out.append(Adversary(name="always_equal", files=appended(_ANYTHING + _WRAP_ALWAYS_EQUAL)))
    with_classes = [p for p in touched if _compares(solved[p])]
    if with_classes:
        out.append(Adversary(name="lying_comparisons", files=appended(_LYING, only=with_classes)))
    if counts_accesses(spec):
        out.append(Adversary(name="c_level_copies", files=appended(_C_COPIES)))
    out.append(Adversary(name="returns_input", files=appended(_RETURNS_INPUT)))
    # Reference behaviour only when a hidden test file is readable, else the untouched code.
    reads = dict(spec.files)
    marker = _hidden_only_name(spec)
    for p in touched:
        reference = spec.solution.get(p, spec.files.get(p, ""))
        untouched = spec.files.get(p, "")
        reads[p] = (f"_RW_MARKER = {marker!r}\n" + _READS_TESTS + "\n\nif _rw_found_hidden_tests():\n"
                    + _indent(reference) + "\nelse:\n" + _indent(untouched or "pass\n"))
    out.append(Adversary(name="reads_hidden_tests", files=reads))
    first = touched[0] if touched else None
    if first is not None:
        out.append(Adversary(name="forged_report", files={**solved, first: _FORGE + solved[first]}))
    return out


def _hidden_only_name(spec: TaskSpec) -> str:
    """``def <name>(`` of a hidden test function that no repository file names ("" if
    there is none)."""
    visible = "\n".join(spec.files.values()) + "\n".join(spec.solution.values())
    for text in spec.hidden_tests.values():
        try:
            tree = pyast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and node.name not in visible:
                return f"def {node.name}("
    return ""


def _indent(source: str) -> str:
    body = source if source.strip() else "pass\n"
    lines = [("    " + line) if line.strip() else line for line in body.splitlines()]
    # `from __future__` must be first in a module: drop it (annotations stay strings-free).
    return "\n".join(line for line in lines if "from __future__ import" not in line) + "\n    pass\n"
