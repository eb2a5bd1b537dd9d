"""The task repository's test-support files: what grading runs from the task's own bytes
in both modes (in-env: restored in the run's tree; bridged: loaded in the tests' process),
never from the agent's copy. A hidden test that asserts through a helper
(``check(sum_to(10), 55)``) has no ``assert`` of its own; an agent that rewrote the
helper to assert nothing was paid 1.0.

Which files (:func:`support_files`):

1. those the task declares (``TaskSpec.test_support``: paths or globs);
2. those that are tests by their place (:func:`sandbox.grading_common.is_test_support`:
   a ``tests`` folder, ``test_*.py``, ``*_test.py``), as before;
3. where the task declares nothing: the Python modules the hidden tests, the task's
   conftests, or support modules already found import (statically: ``import``, ``from``,
   relative imports, ``importlib.import_module``/``__import__``/``pytest.importorskip``
   with a literal name), resolved in the repository (from its root, ``src/``, or the
   importing file's folder), whose module path has a part named as test support
   (:func:`marked`: ``testing_support``, ``test_utils``, ``helpers_test``,
   ``testutils``...).

Left alone on purpose: modules named exactly ``test``, ``tests`` or ``testing`` (any
leading ``_`` dropped) as in django/test, numpy/testing, click/testing.py,
pandas/_testing, which are code under test in their repositories; and, under rules 2
and 3, any file the reference solution changes or deletes (rule 3: anything in the
marked package that it changes), since that is code under test the agent must be able
to fix. A declared entry that covers such a file is the task's error (tasks/spec.py).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import PurePosixPath

from sandbox import pyast
from sandbox.grading_common import HIDDEN_TESTS_DIR, is_test_config, is_test_support
from sandbox.workspace import clean_relpath
from tasks.spec import TaskSpec

# A module path part that names test support (matched in lower case, leading "_" dropped).
# Never a bare test/tests/testing: those names hold code under test in real libraries.
_MARKED = re.compile(r"(?:tests?|testing)_\w+|\w+_tests?|test(?:s|ing)?_?(?:utils?|helpers?|support)")
_IMPORT_CALLS = frozenset({"import_module", "__import__", "importorskip"})


def marked(path: str) -> bool:
    """Whether a Python file's module path (``a/b.py`` -> a, b; ``a/__init__.py`` -> a)
    has a part named as test support."""
    return _marked_at(path) is not None


def _marked_at(path: str) -> int | None:
    """The index (in the path's parts) of the first part named as test support."""
    parts = PurePosixPath(path).parts
    names = [*parts[:-1], PurePosixPath(parts[-1]).stem]
    if names[-1] == "__init__":
        names.pop()
    for i, name in enumerate(names):
        if _MARKED.fullmatch(name.lstrip("_").lower()):
            return i
    return None


def support_files(spec: TaskSpec, files: Mapping[str, bytes], tests: Mapping[str, bytes], *,
                  more: Iterable[str] = (), read: Callable[[str], bytes | None] | None = None) -> dict[str, bytes]:
    """``{path: the task's bytes}`` of the repository's test-support files.

    ``files``: the task's repository as it has it (its text; an image task's configs as
    bytes too); ``tests``: the hidden test files as laid out in the run (a leading
    ``hidden_tests/`` is dropped to place them in the repository); ``more``: paths the
    repository has beyond ``files`` (an image's tree), whose bytes ``read`` gives, read
    only for the paths that could be support."""
    declared = spec.test_support is not None
    gold = {clean_relpath(p) for p in [*spec.solution, *spec.solution_deletes]}
    known = {clean_relpath(p): d for p, d in files.items()}
    if read is not None:
        for path in more:
            if path not in known and _candidate(spec, path, declared):
                data = read(path)
                if data is not None:
                    known[path] = data
    found = {p: d for p, d in known.items()
             if not is_test_config(p) and (spec.declares_test_support(p) or (is_test_support(p) and p not in gold))}
    if declared:
        return found
    # The default rule: marked modules the tests' side reaches by imports, from the hidden
    # tests and the conftests, through the support files on the way (only what is reached
    # is parsed: a real repository's tests folder holds thousands of files).
    marked_files = {p for p in known if p.endswith(".py") and marked(p) and not is_test_config(p)
                    and not _in_gold(p, gold)}
    reach = marked_files | {p for p in found if p.endswith(".py")}
    queue = [(p.removeprefix(HIDDEN_TESTS_DIR + "/"), d) for p, d in tests.items()]
    queue += [(p, d) for p, d in known.items() if PurePosixPath(p).name == "conftest.py"]
    seen: set[str] = set()
    while queue:
        path, data = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        for target in _imported_files(path, data, reach):
            found.setdefault(target, known[target])
            queue.append((target, known[target]))
    return found


def _candidate(spec: TaskSpec, path: str, declared: bool) -> bool:
    if spec.declares_test_support(path) or is_test_support(path):
        return True
    return not declared and path.endswith(".py") and marked(path)


def _in_gold(path: str, gold: set[str]) -> bool:
    """A marked file in whose marked package (the file itself when its own name is the
    marked part) the reference solution changes something: code under test."""
    at = _marked_at(path)
    parts = PurePosixPath(path).parts
    if at is None or at == len(parts) - 1:  # (a module named as support: itself)
        return path in gold
    top = "/".join(parts[: at + 1]) + "/"
    return path in gold or any(g.startswith(top) for g in gold)


def _imported_files(path: str, data: bytes, candidates: set[str]) -> list[str]:
    """The files of ``candidates`` that the module at ``path`` imports (and the package
    ``__init__`` files on the way)."""
    try:
        tree = pyast.parse(data)
    except (SyntaxError, ValueError):
        return []
    folder = PurePosixPath(path).parent
    names: set[str] = set()  # absolute module names
    relative: set[tuple[str, ...]] = set()  # relative imports, as module parts from the root
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            subs = [alias.name for alias in node.names if alias.name != "*"]
            if node.level:
                up = node.level - 1
                if up > len(folder.parts):
                    continue
                head = folder.parts[: len(folder.parts) - up] + (tuple(node.module.split(".")) if node.module else ())
                relative.add(head)
                relative.update(head + (s,) for s in subs)
            elif node.module:
                names.add(node.module)
                names.update(f"{node.module}.{s}" for s in subs)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in _IMPORT_CALLS:
                names.add(node.args[0].value)
    # An absolute name from the root, src/, or the importing file's folder (pytest's
    # rootdir-less test folders are put on sys.path); a relative one from where it points.
    bases = [(), ("src",), folder.parts]
    wanted = [(base, tuple(n.split("."))) for n in names if n for base in bases] + [((), r) for r in relative]
    found = []
    for base, module in wanted:
        for n in range(1, len(module) + 1):
            stem = "/".join((*base, *module[:n]))
            for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
                if candidate in candidates:
                    found.append(candidate)
    return found
