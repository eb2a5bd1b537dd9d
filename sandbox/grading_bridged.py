"""Bridged grading: the hidden tests in one sandbox, the solution in another, the bridge
(two pipes) between them (:mod:`sandbox.bridge`).

The *tests' sandbox* holds the hidden tests (from the grader's task store, read-only,
this grading's canaries appended), the task's own unchanged pytest configuration (an
image task's from its image, byte-exact, the plugin modules it loads run from those bytes), the
grader's plugin (``/grader-plugin``) and the JUnit report folder ``/grader-out``; it runs
pytest and never imports solution code: the workspace's modules are proxies of modules
living in the *solution's sandbox*, which holds a copy of the snapshot (``*.pyc``
dropped), runs as another uid in its own pid namespace, and has no test file, no
pytest, no report folder and no view of the tests' process.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shlex
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from sandbox.cheating import HARNESS_MODULES
from sandbox.config import SandboxConfig
from sandbox.grading_common import (
    HIDDEN_TESTS_DIR, PLUGIN_DIR, REPORT_DIR, REPORT_FILE, HiddenPlan, RunOutput, is_test_config, plugin_dir,
    with_bytecode,
    write_ro,
)
from sandbox import grading_inenv, image_workspace
from sandbox.image_changes import TreeChanges
from sandbox.images import ImageRoot
from sandbox.isolation import WORKSPACE, Bind, Limits
from sandbox.runner import Jail
from sandbox.test_support import support_files
from sandbox.workspace import Workspace, WorkspaceError, clean_relpath
from tasks.spec import TaskSpec

SOURCES_DIR = "/solution-src"
GRADER_DIR = "/grader"
# Under GRADER_DIR in the tests' sandbox: an image task's own pytest plugin modules.
PLUGIN_COPIES = "repo-plugins"
# A folder both sandboxes see, writable by both uids: pytest's temporary folders are made
# there (bridge_tests.py), so a tmp_path a test hands the solution opens on both sides.
SCRATCH_DIR = "/grader-scratch"
# How long the solution's process may take to exit after the tests hang up.
_SOLUTION_GRACE_S = 2.0
_HERE = Path(__file__).parent
_SOURCE = {name: (_HERE / name).read_bytes() for name in ("bridge_solution.py", "bridge_tests.py")}


def _bridge_files() -> dict[str, bytes]:
    """The bridge as the sandboxes import it: the package ``sandbox/bridge`` copied as
    ``_rollway_bridge/`` (or the single module of older checkouts)."""
    if (_HERE / "bridge.py").exists():
        return {"_rollway_bridge.py": (_HERE / "bridge.py").read_bytes()}
    from sandbox.bridge import FILES

    return {f"_rollway_bridge/{name}": (_HERE / "bridge" / name).read_bytes() for name in FILES}


_BRIDGE = with_bytecode(_bridge_files(), GRADER_DIR)  # compiled once per service, not per sandbox
MAX_REPORT_BYTES = 8 * 1024 * 1024
_PIPE_BYTES = 1024 * 1024
# .pth files of rollway's own editable install in the host interpreter: its finder maps
# packages no sandbox can see, and importing it is ~15-20 ms of each sandboxed start.
_OWN_PTH_PREFIXES = ("__editable__.rollway-",)


def layout(spec: TaskSpec) -> dict[str, str]:
    """The hidden test files as the tests' sandbox sees them (under ``hidden_tests/``)."""
    return {f"{HIDDEN_TESTS_DIR}/{clean_relpath(rel)}": text for rel, text in spec.hidden_tests.items()}


def pytest_args(spec: TaskSpec, args: list[str], image_configs: Iterable[str] = ()) -> list[str]:
    """``image_configs``: the paths of an image task's own test configuration (its image's
    conftests count as the repository's)."""
    if not any(Path(p).name == "conftest.py" for p in [*spec.files, *image_configs]):
        # The repository has no conftest of its own: load none but the hidden tests'.
        workdir = spec.workdir if spec.image else WORKSPACE
        args = args + [f"--confcutdir={workdir}/{HIDDEN_TESTS_DIR}"]
    return args


async def run(jail: Jail, cfg: SandboxConfig, limits: Limits, spec: TaskSpec, code: dict[str, bytes],
              plan: HiddenPlan, base: Path, *, uid: int, cpu: int | None, root: ImageRoot | None = None,
              changes: TreeChanges | None = None) -> RunOutput:
    """``root``: the task's image (both sandboxes run on it, the repository at
    ``spec.workdir``); None: the host root, the repository at /workspace. ``changes``:
    the agent's removals and links against the image, redone on the solution's fresh
    tree of it (as in-env grading does), so a file the agent deleted stays deleted."""
    solution_uid = uid + cfg.grading_solution_uid_offset
    workdir = spec.workdir if root is not None else WORKSPACE
    on_root = {"root": root, "workdir": workdir} if root is not None else {}
    # The solution's sandbox: its workspace copy and the serving script. No test file.
    if root is not None:
        removed, links = (changes.removed, changes.links) if changes is not None else ((), {})
        # A link at or above a file of the tree cannot be made (the file wins, as in-env).
        above = {str(parent) for path in code for parent in PurePosixPath(path).parents}
        links = {p: t for p, t in links.items() if p not in code and p not in above}
        ws, _ = image_workspace.create(base / "ws", solution_uid, code, None, root, workdir, removed=removed,
                                       links=links)
    else:
        ws, _ = Workspace.create(base / "ws", solution_uid, code)
    sol_dir = _grader_dir(base / "sol", "bridge_solution.py")
    # The tests' sandbox: the hidden tests, the task's own (unchanged) test
    # configuration, the solution's sources as read-only data (inspect.getsource), and
    # no importable solution code.
    tests_ws = base / "tests"
    tests_ws.mkdir(mode=0o755)
    own = {clean_relpath(rel): text.encode() for rel, text in spec.files.items() if is_test_config(rel)}
    plugins: dict[str, bytes] = {}
    support: dict[str, bytes] | None = None
    if root is not None:
        # The image's own test configuration, byte-exact from the image (what the task's
        # text cannot hold: a latin-1 conftest, a linked setup.cfg, the plugin modules
        # they load), as in-env grading restores it; the task's text wins where it has
        # the file, as there. Never the agent's versions: the solution's tree is not read.
        image_own = await asyncio.to_thread(grading_inenv.image_configs, root, spec, plan)
        plugins = grading_inenv.plugin_files(
            {**image_own, **{clean_relpath(p): t.encode() for p, t in spec.files.items()}}, plan.tests)
        own = {p: d for p, d in {**image_own, **own}.items() if p not in plugins}
        support = await asyncio.to_thread(grading_inenv.image_support, root, spec, plan, image_own)
    own, plugins = tests_side(spec, plan, own, plugins, support)
    for rel, data in own.items():
        write_ro(tests_ws / rel, data)
    (tests_ws / HIDDEN_TESTS_DIR).mkdir(mode=0o755)
    hidden = base / "hidden"
    prefix = HIDDEN_TESTS_DIR + "/"
    for path, data in plan.tests.items():
        write_ro(hidden / path.removeprefix(prefix), data)
    # A conftest of the repository's tree on a hidden test's path (its folder or above,
    # not the root's, which applies as it is) that the hidden tests lack (one only in the
    # image): beside them too, as the task's own are (tasks/swe.py).
    folders = {PurePosixPath(p.removeprefix(prefix)).parent for p in plan.tests}
    for rel, data in own.items():
        at = PurePosixPath(rel)
        if (at.name == "conftest.py" and str(at.parent) != "." and prefix + rel not in plan.tests
                and any(f == at.parent or at.parent in f.parents for f in folders)):
            write_ro(hidden / rel, data)
    hidden.mkdir(mode=0o755, exist_ok=True)
    sources = base / "src"
    sources.mkdir(mode=0o755)
    for rel, data in code.items():
        write_ro(sources / rel, data)
    tests_dir = _grader_dir(base / "run", "bridge_tests.py")
    # The plugin modules those configs load run in the tests' process from the image's
    # bytes (the bridge would import the solution's copy: the agent's), laid under the
    # grader's folder: a package folder in the tests' workspace would be a namespace
    # package hiding the solution's where the workdir is on sys.path (a root conftest).
    for rel, data in plugins.items():
        write_ro(tests_dir / PLUGIN_COPIES / rel, data)
    local_modules = {_module_name(p): f"{GRADER_DIR}/{PLUGIN_COPIES}/{p}" for p in plugins}
    plugin = plugin_dir(base, plan)
    out = Workspace.create(base / "out", uid, {})[0]
    scratch = base / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o1777)
    sol_fds, tests_fds = _pipes()
    config = {"workspace": workdir, "sources": SOURCES_DIR, "modules": sorted(top_level_modules(code)),
              "cpu": cpu, "pin_after": cfg.grading_bridge_pin_after, "scratch": SCRATCH_DIR,
              "local_modules": local_modules}
    # The host's interpreter starts with -S and the entry script runs site itself, less the
    # editable install of rollway (sandbox/bridge/sitepath.py); an image's Python as it is.
    python = "python -P" if root is not None else "python -P -S"
    if root is None:
        config["site_skip"] = list(_OWN_PTH_PREFIXES)
    write_ro(sol_dir / "bridge.json", json.dumps({**config, "fd": list(sol_fds)}).encode())
    write_ro(tests_dir / "bridge.json", json.dumps({**config, "fd": list(tests_fds)}).encode())
    async with jail.slot():
        solution = asyncio.ensure_future(jail.run_held(
            f"{python} {GRADER_DIR}/bridge_solution.py", workspace=ws.root, uid=solution_uid,
            timeout_s=cfg.grading_timeout_s,
            binds=[Bind(str(sol_dir), GRADER_DIR), Bind(str(scratch), SCRATCH_DIR, writable=True)], limits=limits,
            label="grade-solution", give_fds=sol_fds, output_limit=_solution_output_limit(cfg), **on_root,
        ))
        try:
            result = await jail.run_held(
                shlex.join([*python.split(), f"{GRADER_DIR}/bridge_tests.py", *plan.args]),
                workspace=tests_ws, uid=uid, timeout_s=cfg.grading_timeout_s,
                binds=[
                    Bind(str(hidden), f"{workdir}/{HIDDEN_TESTS_DIR}"),
                    Bind(str(sources), SOURCES_DIR),
                    Bind(str(tests_dir), GRADER_DIR),
                    Bind(str(plugin), PLUGIN_DIR),
                    Bind(str(out.root), REPORT_DIR, writable=True),
                    Bind(str(scratch), SCRATCH_DIR, writable=True),
                ],
                env={"PYTHONPATH": PLUGIN_DIR, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
                limits=limits, label="grade-tests", give_fds=tests_fds, **on_root,
            )
        finally:
            # The tests hung up: the solution's process sees EOF and exits; one that
            # does not is killed (cancelling its run kills its whole sandbox).
            try:
                solution_result = await asyncio.wait_for(asyncio.shield(solution), _SOLUTION_GRACE_S)
            except TimeoutError:
                solution.cancel()
                with contextlib.suppress(BaseException):
                    await solution
                solution_result = None
            except asyncio.CancelledError:  # our caller's cancel, not the grace period's end
                solution.cancel()
                with contextlib.suppress(BaseException):
                    await solution
                raise
    return RunOutput(result=result, report=_read(out, REPORT_FILE), collected=_read(out, plan.collected_file),
                     solution=solution_result, bridged=True)


def tests_side(spec: TaskSpec, plan: HiddenPlan, own: dict[str, bytes], plugins: dict[str, bytes],
               support: dict[str, bytes] | None = None) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The task's files the tests' sandbox holds: ``own`` (test configuration, written in
    its workspace) and ``plugins`` (modules loaded in the tests' process from these
    bytes), with the repository's test-support files added (sandbox/test_support.py;
    ``support``: an image task's, from ``grading_inenv.image_support``; None: found in
    the task's text). Their Python modules load as the plugin modules do: the solution's
    copy is the agent's to rewrite. A declared support file that is not Python (data the
    hidden tests read) is laid in the tests' workspace at its path."""
    if support is None:
        support = support_files(spec, {clean_relpath(p): t.encode() for p, t in spec.files.items()}, plan.tests)
    modules = {p: d for p, d in support.items() if p.endswith(".py") and p not in own}
    data = {p: d for p, d in support.items() if not p.endswith(".py") and p not in own}
    return {**own, **data}, {**modules, **plugins}


def _solution_output_limit(cfg: SandboxConfig) -> int:
    """How much the solution's process may print before it is killed. Not the tool calls'
    ``max_output_total_bytes`` (8 MiB): a chatty honest solution (a print per loop step)
    went past it and was killed mid-test. What the same solution may print graded in-env,
    where pytest captures it into a file of the sandbox's /tmp (``tmp_bytes``), or more."""
    return max(cfg.max_output_total_bytes, cfg.tmp_bytes)


def _module_name(path: str) -> str:
    """``pkg/plugin.py`` -> ``pkg.plugin``; ``pkg/sub/__init__.py`` -> ``pkg.sub``."""
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _pipes() -> tuple[tuple[int, int], tuple[int, int]]:
    """The bridge: one pipe each way, ((solution's read, solution's write), (tests' read,
    tests' write)). A round trip over two pipes costs about half one over a Unix
    socketpair (docs/sandbox.md); each process gets only its two ends (Jail closes ours
    once it has started), so either side sees EOF when the other exits."""
    to_solution, to_tests = os.pipe(), os.pipe()
    for r, w in (to_solution, to_tests):
        with contextlib.suppress(OSError, AttributeError):
            # Room for a batch of deferred calls in one write (the default is 64 KiB).
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    return (to_solution[0], to_tests[1]), (to_tests[0], to_solution[1])


def _read(out: Workspace, name: str) -> bytes | None:
    try:
        return out.read(name, MAX_REPORT_BYTES)
    except WorkspaceError:
        return None


def top_level_modules(files: dict[str, bytes]) -> set[str]:
    """Top-level importable names the workspace defines (``x.py``, a ``pkg/`` with Python
    files): the only names the tests' side asks the solution for."""
    names = set()
    for path in files:
        parts = path.split("/")
        name = parts[0].removesuffix(".py") if len(parts) == 1 else parts[0]
        if (len(parts) > 1 and not path.endswith(".py")) or (len(parts) == 1 and not parts[0].endswith(".py")):
            continue
        if name.isidentifier() and name not in HARNESS_MODULES and name != HIDDEN_TESTS_DIR and name != "conftest":
            names.add(name)
    return names


def _grader_dir(path: Path, script: str) -> Path:
    """A folder with the bridge module and one entry script, bound at /grader."""
    path.mkdir(mode=0o755)
    for rel, data in _BRIDGE.items():
        write_ro(path / rel, data)
    write_ro(path / script, _SOURCE[script])
    return path
