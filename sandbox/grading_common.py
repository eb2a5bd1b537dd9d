"""What both grading modes share: the hidden run's plan (tests as laid out in the run,
the selection, this grading's canaries, the grader's pytest plugin), what a run gives
back, and the small file helpers."""

from __future__ import annotations

import json
import random
import secrets
import sys
from pathlib import Path, PurePosixPath

import msgspec

from sandbox.canaries import Canary, plan as plan_canaries
from sandbox.witnesses import Site, instrument
from sandbox.runner import CommandResult
from sandbox.test_selection import Selection, select
from sandbox.workspace import Snapshot, clean_relpath

HIDDEN_TESTS_DIR = "hidden_tests"
REPORT_DIR = "/grader-out"
REPORT_FILE = "junit.xml"
PLUGIN_DIR = "/grader-plugin"
# The root files pytest reads its config from (pytest 9 reads pytest.toml/.pytest.toml first).
CONFIG_FILES = frozenset({"pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg",
                          "pyproject.toml"})
HARNESS_EXTRA_MODULES = frozenset({"conftest"})
_PLUGIN_SOURCE = (Path(__file__).parent / "grading_plugin.py").read_bytes()


class HiddenPlan(msgspec.Struct, kw_only=True):
    """One grading's hidden run, decided before it starts."""

    args: list[str]  # pytest's arguments (selection, canaries' node ids, plugin, report)
    tests: dict[str, bytes]  # hidden test files as laid out in the run (canaries appended)
    selection: Selection
    canaries: list[Canary]
    plugin: str  # the plugin's module name (random per grading)
    collected_file: str  # file name of the collection record in the report folder
    report_dir: str = REPORT_DIR  # where the run writes both (inside its sandbox)
    witness: str = ""  # the completion witness's builtin name (random per grading)
    sites: list[Site] = []  # the tests that call it, with their nonces
    hidden_sources: str = ""  # in-env: where the plugin finds the hidden sources (then deletes them)


class RunOutput(msgspec.Struct, kw_only=True):
    result: CommandResult  # the tests' process
    report: bytes | None
    collected: bytes | None
    solution: CommandResult | None = None  # bridged: the solution's process
    bridged: bool = False  # the tests ran in their own process (sandbox/grading_bridged.py)
    notes: list[str] = []  # what the run changed in the agent's tree (in-env), for the reason


def make_plan(args: list[str], tests: dict[str, str], config_files: dict[str, str], *,
              canaries: bool = True, report_dir: str = REPORT_DIR) -> HiddenPlan:
    """``args``: the task's pytest arguments as they apply to this run's layout;
    ``tests``: {path in the run: source} of the hidden test files."""
    selection = select(args, tests, config_files)
    rng = random.Random(secrets.randbits(64))
    files = dict(tests)
    found: list[Canary] = []
    extra: list[str] = []
    if canaries and selection.canaries_allowed:
        planned = plan_canaries(tests, selection.expected, rng, function_patterns=selection.function_patterns)
        files.update(planned.files)
        found = planned.canaries
        if selection.by_node_id:
            extra = planned.node_ids
    witness = f"_rw_{secrets.token_hex(6)}"
    witnessed = instrument(files, witness, rng)
    plugin = f"_rw_{secrets.token_hex(8)}"
    collected = f"collected-{secrets.token_hex(4)}.json"
    run_args = _with_node_ids(list(args), extra, rng)
    if "no:cacheprovider" not in run_args:
        run_args += ["-p", "no:cacheprovider"]
    run_args += ["-p", plugin, f"--junitxml={report_dir}/{REPORT_FILE}", "-o", "junit_family=xunit2"]
    return HiddenPlan(args=run_args, tests={p: t.encode() for p, t in witnessed.files.items()}, selection=selection,
                      canaries=found, plugin=plugin, collected_file=collected, report_dir=report_dir,
                      witness=witness, sites=witnessed.sites)


def _with_node_ids(args: list[str], node_ids: list[str], rng: random.Random) -> list[str]:
    """The canaries' node ids, each after a random node id the command names (so their
    place on the command line tells nothing either)."""
    for node_id in node_ids:
        places = [i for i, a in enumerate(args) if "::" in a and not a.startswith("-")]
        if places:
            args.insert(rng.choice(places) + 1, node_id)
        else:
            args.append(node_id)
    return args


def plugin_dir(base: Path, plan: HiddenPlan) -> Path:
    """The folder bound at PLUGIN_DIR: the plugin under its random name and its config."""
    path = base / "plugin"
    path.mkdir(mode=0o755)
    write_ro(path / f"{plan.plugin}.py", _PLUGIN_SOURCE)
    config = {"out": f"{plan.report_dir}/{plan.collected_file}", "witness": plan.witness,
              "hidden": plan.hidden_sources or None}
    write_ro(path / f"{plan.plugin}.json", json.dumps(config).encode())
    return path


def with_bytecode(files: dict[str, bytes], at: str) -> dict[str, bytes]:
    """``files`` (grader modules a sandbox imports from ``at``) plus their compiled
    ``__pycache__`` copies for this interpreter, checked against the source's hash (not its
    mtime, which every grading's copy changes): each sandbox then skips compiling them
    (~50 ms of CPU per side for the bridge package). Another interpreter (an image's
    Python) looks for its own cache tag and compiles as before."""
    import importlib.util
    import py_compile
    import tempfile

    tag = sys.implementation.cache_tag
    if tag is None:
        return dict(files)
    out = dict(files)
    with tempfile.TemporaryDirectory() as tmp:
        for rel, data in files.items():
            if not rel.endswith(".py"):
                continue
            src = Path(tmp) / "src.py"
            src.write_bytes(data)
            target = Path(importlib.util.cache_from_source(str(Path(tmp) / rel)))
            py_compile.compile(str(src), cfile=str(target), dfile=f"{at}/{rel}", doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
            out[str(target.relative_to(tmp))] = target.read_bytes()
    return out


def solution_files(snapshot: Snapshot) -> dict[str, bytes]:
    """The graded files: compiled ``*.pyc`` dropped (graded code is the source the checks
    saw), and nothing under the hidden tests' folder (the grader's own copy is used)."""
    out = {}
    for path, f in snapshot.files.items():
        if path.endswith((".pyc", ".pyo")) or "__pycache__" in path.split("/"):
            continue
        if path.split("/")[0] == HIDDEN_TESTS_DIR:
            continue
        out[clean_relpath(path)] = f.data
    return out


def is_test_config(path: str) -> bool:
    """Files of the task repository that configure pytest (the tests' side uses the task's
    originals, never the agent's copies)."""
    parts = path.split("/")
    return parts[-1] == "conftest.py" or (len(parts) == 1 and parts[0] in CONFIG_FILES)


def is_test_support(path: str) -> bool:
    """A Python module of the task's repository where tests live (a ``tests`` folder at any
    depth, or named ``test_*.py``/``*_test.py``), other than its test configuration. The
    hidden tests may import it as their helper (``from tests.helpers import check``), so
    the grader runs the task's version of it, never the agent's: an agent's ``check`` that
    asserts nothing was paid in both modes. (``test``/``testing`` folders are left out:
    they hold code under test too, ``django/test``, ``numpy/testing``.)"""
    parts = PurePosixPath(path).parts
    name = parts[-1]
    if not name.endswith(".py") or is_test_config(path):
        return False
    return name.startswith("test_") or name.removesuffix(".py").endswith("_test") or "tests" in parts[:-1]


def root_configs(files: dict[str, str]) -> dict[str, str]:
    return {p: t for p, t in files.items() if "/" not in p and p in CONFIG_FILES}


def write_ro(path: Path, data: bytes) -> None:
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o644)
