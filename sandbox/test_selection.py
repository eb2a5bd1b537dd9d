"""Which hidden tests a grading run must report, known before it runs.

From the task's pytest arguments and the grader's own copy of the hidden test files
(as laid out in the run), list the tests the run selects: node ids given on the command
line, and the test functions and methods pytest's default rules collect from the files
and folders given. :mod:`sandbox.result_check` requires each of them in the report (or a
collection error/skip of its module), and :mod:`sandbox.canaries` copies some of them.

Conservative by design: what cannot be known statically is left out, never guessed
(tests made at run time, inherited methods, a task config that changes the collection
patterns, ``-k``/``-m``/``--deselect``: then only explicit node ids are expected).
"""

from __future__ import annotations

import ast
import configparser
import re
import tomllib
from pathlib import PurePosixPath

import msgspec

# pytest options that take a separate value (the value is not a path).
_VALUE_OPTIONS = frozenset({
    "-k", "-m", "-p", "-o", "-c", "-W", "-r", "--deselect", "--ignore", "--ignore-glob", "--rootdir",
    "--confcutdir", "--junitxml", "--junit-xml", "--basetemp", "--tb", "--maxfail", "--durations",
    "-n", "--override-ini", "--pyargs", "--import-mode", "--log-level", "--capture", "--color",
    "--log-cli-level", "--log-file", "--cov", "--cov-report", "--timeout", "--dist",
})
# Options after which the static list is unknown (selection by expression or state).
_FILTERS = ("-k", "-m", "--deselect", "--ignore", "--ignore-glob", "--lf", "--last-failed", "--ff", "--nf",
            "--sw", "--stepwise", "--pyargs")
# Options that stop the run at a failure: tests after it are never reported.
_STOPS = ("-x", "--exitfirst", "--maxfail", "--sw", "--stepwise")
_COLLECTION_KEYS = ("python_files", "python_classes", "python_functions")


class ExpectedTest(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # the test file, as laid out in the run (relative to the run's root)
    cls: str  # "" for a module-level function
    name: str  # function name, without parameters
    params: str = ""  # "[...]" when the node id given names one parameter set

    @property
    def nodeid(self) -> str:
        return "::".join(p for p in (self.path, self.cls, self.name + self.params) if p)


class Selection(msgspec.Struct, kw_only=True):
    expected: list[ExpectedTest]
    by_node_id: bool  # the command names node ids: canaries must be named too
    stops_early: bool  # -x / --maxfail: tests after a failure may be missing
    canaries_allowed: bool  # default collection rules apply to the files given


def options_and_paths(args: list[str]) -> tuple[list[str], list[str]]:
    options, paths = [], []
    skip_next = False
    for arg in args:
        if skip_next:
            skip_next = False
            continue
        if arg.startswith("-"):
            options.append(arg.split("=", 1)[0])
            if arg in _VALUE_OPTIONS or (len(arg) == 2 and arg in _VALUE_OPTIONS):
                skip_next = True
            continue
        paths.append(arg)
    return options, paths


def select(args: list[str], test_files: dict[str, str], config_files: dict[str, str]) -> Selection:
    """``test_files``: {path in the run: source} of every hidden test file;
    ``config_files``: the task's own root test configuration ({name: text})."""
    options, paths = options_and_paths(args)
    stops = any(o in _STOPS or (o.startswith("-x") and not o.startswith("--")) for o in options)
    filtered = any(o in _FILTERS for o in options)
    custom = _custom_collection(config_files)
    expected: list[ExpectedTest] = []
    by_node_id = False
    for arg in paths:
        path, sep, rest = arg.partition("::")
        path = _norm(path)
        if sep:
            by_node_id = True
            parts = rest.split("::")
            last, bracket, params = parts[-1].partition("[")
            expected.append(ExpectedTest(path=path, cls="::".join(parts[:-1]), name=last,
                                         params=bracket + params))
            continue
        if filtered or custom:
            continue
        for file in sorted(test_files):
            inside = file == path or path in ("", ".") or file.startswith(path.rstrip("/") + "/")
            if inside and (file == path or _default_test_file(file)):
                expected += static_tests(file, test_files[file])
    return Selection(expected=expected, by_node_id=by_node_id, stops_early=stops,
                     canaries_allowed=not custom and not filtered)


def _norm(path: str) -> str:
    p = str(PurePosixPath(path)) if path else ""
    return "" if p == "." else p.removeprefix("./")


def _default_test_file(path: str) -> bool:
    name = PurePosixPath(path).name
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def static_tests(path: str, source: str) -> list[ExpectedTest]:
    """Module-level ``def test*`` functions and ``test*`` methods of module-level
    ``Test*`` classes without ``__init__`` (pytest's default rules)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []  # a collection error: reported as such
    out: list[ExpectedTest] = []
    seen: set[tuple[str, str]] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            key = ("", node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test") and _collectable_class(node):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    if ("", node.name + "::" + item.name) not in seen:
                        seen.add(("", node.name + "::" + item.name))
                        out.append(ExpectedTest(path=path, cls=node.name, name=item.name))
            continue
        else:
            continue
        if key not in seen and not _disabled(tree, node.name):
            seen.add(key)
            out.append(ExpectedTest(path=path, cls="", name=node.name))
    return out


def _collectable_class(node: ast.ClassDef) -> bool:
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name in ("__init__", "__new__"):
            return False
        if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__test__" for t in item.targets):
            return False
    return True


def _disabled(tree: ast.Module, name: str) -> bool:
    """``test_x.__test__ = False`` somewhere at module level."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and t.attr == "__test__" and isinstance(t.value, ast.Name) \
                        and t.value.id == name:
                    return True
    return False


def _custom_collection(config_files: dict[str, str]) -> bool:
    """The task's own config changes which files, classes or functions are tests."""
    for name, text in config_files.items():
        if name == "pyproject.toml":
            try:
                section = tomllib.loads(text).get("tool", {}).get("pytest", {}).get("ini_options", {})
            except tomllib.TOMLDecodeError:
                section = {} if not any(k in text for k in _COLLECTION_KEYS) else {"?": 1}
            if any(k in section for k in _COLLECTION_KEYS) or "?" in section:
                return True
            continue
        parser = configparser.RawConfigParser()
        try:
            parser.read_string(text)
        except configparser.Error:
            if any(k in text for k in _COLLECTION_KEYS):
                return True
            continue
        for section in ("pytest", "tool:pytest"):
            if parser.has_section(section) and any(parser.has_option(section, k) for k in _COLLECTION_KEYS):
                return True
    return False


def matches(expected: ExpectedTest, nodeid: str) -> bool:
    """Does a collected node id stand for this expected test (any of its parameter
    sets, unless the command named one)? The run's root may sit above or below the
    grader's layout, so paths match by suffix."""
    path, _, rest = nodeid.partition("::")
    if not (path == expected.path or path.endswith("/" + expected.path) or expected.path.endswith("/" + path)):
        return False
    want = "::".join(p for p in (expected.cls, expected.name) if p)
    if expected.params:
        return rest == want + expected.params
    return rest == want or (rest.startswith(want + "[") and re.fullmatch(r"\[.*\]", rest[len(want):], re.S) is not None)


def path_matches(expected_path: str, nodeid_path: str) -> bool:
    return (nodeid_path == expected_path or nodeid_path.endswith("/" + expected_path)
            or expected_path.endswith("/" + nodeid_path))
