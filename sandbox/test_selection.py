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
import shlex
import tomllib
from pathlib import PurePosixPath

import msgspec

from sandbox import pyast

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
    canaries_allowed: bool  # canaries can be named so that the run collects them
    # python_functions as the run applies it (canaries are named to match it).
    function_patterns: list[str] = msgspec.field(default_factory=lambda: ["test"])


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
    rules = collection_rules(config_files, args)
    custom = rules != DEFAULT_RULES
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
    # Canaries copy tests named by node id (or found by the default rules) into their own
    # files and classes, collected there; under custom rules their names follow the
    # run's python_functions (sandbox/canaries.py name_form), so they are collected too.
    functions = rules["python_functions"] if rules is not None else []
    nameable = rules is not None and (not custom or (by_node_id and any(pattern_form(p) for p in functions)))
    return Selection(expected=expected, by_node_id=by_node_id, stops_early=stops,
                     canaries_allowed=nameable and not filtered, function_patterns=functions or ["test"])


def pattern_form(pattern: str) -> tuple[str, str] | None:
    """(prefix, suffix) of the names a python_functions pattern collects that a canary
    can take: a prefix (pytest: a name starting with it), or a glob with one ``*`` and no
    other glob character. None: another glob (no canary is named after it)."""
    if not any(c in pattern for c in "*?["):
        return (pattern, "") if pattern else None
    if pattern.count("*") == 1 and not any(c in pattern for c in "?["):
        prefix, suffix = pattern.split("*")
        return prefix, suffix
    return None


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
        tree = pyast.parse(source)
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


DEFAULT_RULES = {"python_files": ["test_*.py", "*_test.py"], "python_classes": ["Test"], "python_functions": ["test"]}


def _config_options(name: str, text: str) -> dict[str, object] | None:
    """The pytest options of one config file ({} when it has none), as pytest reads
    them: ``[pytest]`` (pytest.ini, tox.ini), ``[tool:pytest]`` (setup.cfg),
    ``[tool.pytest.ini_options]`` or native ``[tool.pytest]`` (pyproject.toml),
    ``[pytest]`` (pytest.toml). None: the file cannot be read as its kind."""
    base = PurePosixPath(name).name
    if base.endswith(".toml"):
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            return None
        if base == "pyproject.toml":
            tool = data.get("tool", {}).get("pytest", {})
            return {**{k: v for k, v in tool.items() if k != "ini_options"}, **tool.get("ini_options", {})}
        return dict(data.get("pytest", {}))
    parser = configparser.RawConfigParser()
    try:
        parser.read_string(text)
    except configparser.Error:
        return None
    section = "tool:pytest" if base == "setup.cfg" else "pytest"
    return dict(parser.items(section)) if parser.has_section(section) else {}


def _overrides(args: list[str]) -> dict[str, str]:
    """``-o key=value`` / ``--override-ini`` options (the last one of a key wins)."""
    out: dict[str, str] = {}
    for i, arg in enumerate(args):
        value = None
        if arg in ("-o", "--override-ini") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--override-ini="):
            value = arg.split("=", 1)[1]
        elif arg.startswith("-o") and len(arg) > 2:
            value = arg[2:]
        if value and "=" in value:
            key, _, val = value.partition("=")
            out[key.strip()] = val
    return out


def collection_rules(config_files: dict[str, str], args: list[str]) -> dict[str, list[str]] | None:
    """``python_files``/``python_classes``/``python_functions`` as the run applies them:
    the config (``config_files``: the one pytest reads, or the task's root configs), its
    ``addopts`` overrides, then the command's. None: they cannot be known (a config that
    does not parse but names one of them, or two configs that disagree)."""
    found: list[dict[str, object]] = []
    for name, text in config_files.items():
        options = _config_options(name, text)
        if options is None:
            if any(k in text for k in _COLLECTION_KEYS):
                return None
            continue
        if options:
            found.append(options)
    rules: dict[str, list[str]] = {k: list(v) for k, v in DEFAULT_RULES.items()}
    seen: dict[str, list[str]] = {}
    for options in found:
        addopts = options.get("addopts", "")
        addopts = shlex.split(addopts) if isinstance(addopts, str) else [str(a) for a in addopts]
        values: dict[str, object] = {**options, **_overrides(addopts)}
        for key in _COLLECTION_KEYS:
            if key in values:
                value = values[key]
                patterns = value.split() if isinstance(value, str) else [str(v) for v in value]
                if key in seen and seen[key] != patterns:
                    return None
                seen[key] = patterns
    rules.update(seen)
    for key, value in _overrides(args).items():
        if key in _COLLECTION_KEYS:
            rules[key] = value.split()
    return rules


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
