"""Grading a task whose test command is not pytest (``sandbox.allow_unisolated_grading``):
the command runs as written, in the solution's process, and only its exit code counts.

No report, canary or witness can judge such a run, so the solution's code can set the
exit code (patch ``unittest``, leave with 0 from a call the tests make): that is why it is
refused by default. What the grader can do is what in-env grading does for pytest
(sandbox/grading_inenv.py): run the command on the task's own tests' side, not the
agent's. One fresh sandbox (the task's image at its ``workdir`` where it has one, the
host root otherwise) holds the agent's final tree with, restored from the task:

- the hidden tests, at their real repository paths for SWE-style rows (the command names
  them there) and under ``hidden_tests/`` otherwise;
- the repository's test-support files and test configuration at any depth, as in-env;
- the runner: every file of the task the command names (``bash run_tests.sh``,
  ``./tests/runtests.py``, ``bin/test``, ``python -m tests.runner``) and the files the
  program it starts reads on its own (make's makefiles, nox's ``noxfile.py``), unless the
  reference solution changes it (then it is code under test: ``python -m doctest calc.py``).
  One the agent added where the task has none (a ``GNUmakefile``, which make reads
  before ``Makefile``) is removed.

Every agent change discarded is named in the reward's reason, as in-env.
"""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path, PurePosixPath

from sandbox import grading_inenv
from sandbox.config import SandboxConfig
from sandbox.grading_common import HiddenPlan, RunOutput
from sandbox.image_changes import TreeChanges
from sandbox.image_repo import image_file_bytes
from sandbox.images import ImageRoot
from sandbox.isolation import Limits
from sandbox.runner import Jail
from sandbox.test_selection import Selection
from sandbox.workspace import clean_relpath
from tasks.spec import TaskSpec

# Files a program reads without being told (where the command names none with -f/--file).
IMPLICIT_INPUTS: dict[str, tuple[str, ...]] = {
    "make": ("GNUmakefile", "makefile", "Makefile"),
    "gmake": ("GNUmakefile", "makefile", "Makefile"),
    "nox": ("noxfile.py",),
}
_SCRIPT_DEPTH = 3  # the command, the scripts it names, the scripts they name
_MAX_SCRIPT_BYTES = 64 * 1024
_NO_SELECTION = Selection(expected=[], by_node_id=False, stops_early=False, canaries_allowed=False)


def command_paths(test_command: str, workdir: str) -> list[str]:
    """Repository paths the command may run or read: every word that is a relative path
    (or an absolute one under ``workdir``), the value of ``--opt=path``, the module files
    of ``-m module``, the implicit inputs of the programs it starts; the words of a quoted
    inner command (``bash -c "..."``) too. A superset: only the task's files among them count."""
    return [path for path, _ in _named_paths(test_command, workdir)]


def _named_paths(test_command: str, workdir: str) -> list[tuple[str, bool]]:
    """:func:`command_paths`, each with whether it is a module file of ``-m module`` (code
    the command imports, maybe the solution's own)."""
    try:
        words = shlex.split(test_command)
    except ValueError:
        return []
    out: list[tuple[str, bool]] = []
    top = workdir.rstrip("/") + "/"
    after_m = False
    for word in words:
        if any(c.isspace() for c in word):
            out += _named_paths(word, workdir)
            continue
        value = word.split("=", 1)[1] if word.startswith("-") and "=" in word else word
        is_module = after_m
        if after_m:
            module = value.replace(".", "/")
            out += [(f"{module}.py", True), (f"{module}/__main__.py", True), (f"{module}/__init__.py", True)]
        after_m = word == "-m"
        if value.startswith(top):
            value = value.removeprefix(top)
        if not value or value.startswith(("-", "/")) or "=" in value:
            continue
        out += [(name, False) for name in IMPLICIT_INPUTS.get(PurePosixPath(value).name, ())]
        try:
            out.append((clean_relpath(value), is_module))
        except ValueError:
            continue
    seen: dict[str, bool] = {}
    for path, module in out:
        seen[path] = seen.get(path, False) or module
    return list(seen.items())


def runner_files(spec: TaskSpec, original: dict[str, bytes]) -> dict[str, bytes | None]:
    """``{path: the task's bytes, or None where the task has no such file}`` of the
    runner (:func:`command_paths`): named files of the task, implicit inputs whether or
    not the task has them; never a file the reference solution changes or deletes. A
    named file that is not Python (a shell script, a makefile) is read for the paths its
    lines name in turn (``run_tests.sh`` saying ``make test``: the Makefile is the
    runner's too), a few levels deep; a path those lines name that the task lacks is
    None too (an optional file the runner reads: ``-include local.mk``), unless it is a
    module of ``-m``."""
    gold = {clean_relpath(p) for p in [*spec.solution, *spec.solution_deletes]}
    implicit = {name for names in IMPLICIT_INPUTS.values() for name in names}
    out: dict[str, bytes | None] = {}
    level = _named_paths(spec.test_command, spec.workdir)
    for depth in range(_SCRIPT_DEPTH):
        found: list[tuple[str, bool]] = []
        for path, module in level:
            if path in gold or path in out:
                continue
            if path in original:
                out[path] = original[path]
                if not path.endswith(".py") and len(original[path]) <= _MAX_SCRIPT_BYTES:
                    for line in original[path].decode(errors="replace").splitlines():
                        found += _named_paths(line.split("#", 1)[0], spec.workdir)
            elif PurePosixPath(path).name in implicit or (depth > 0 and not module and _file_like(path)):
                # A file a runner script names that the task lacks is one it reads only if
                # present (``-include local.mk``, ``[ -f ci/env.sh ] && . ci/env.sh``): an
                # agent's there set the runner's outcome (``SHELL := /bin/true``, ``exit 0``;
                # paid 1.0). Not a module of ``-m``: that may be the solution's own code.
                out[path] = None
        level = found
    return out


def runner_dirs(spec: TaskSpec) -> frozenset[str]:
    """Folders the command may run a script from, or put on sys.path: every path the
    command and the task's files it names (Python scripts too, a few levels deep) name,
    each with its parents, and the hidden tests' folders (a runner imports the tests from
    theirs; pytest puts a test's folder first). A superset: a module named like a test
    runner's (``unittest.py``) counts as shadowing it only in one of these
    (sandbox/cheating.py)."""
    original = {clean_relpath(p): t.encode() for p, t in spec.files.items()}
    seen: set[str] = set()
    level = _named_paths(spec.test_command, spec.workdir)
    for _ in range(_SCRIPT_DEPTH):
        found: list[tuple[str, bool]] = []
        for path, _module in level:
            if path in seen:
                continue
            seen.add(path)
            data = original.get(path)
            if data is not None and len(data) <= _MAX_SCRIPT_BYTES:
                for line in data.decode(errors="replace").splitlines():
                    found += _named_paths(line.split("#", 1)[0], spec.workdir)
        level = found
    dirs: set[str] = set()
    for path in [*seen, *grading_inenv.layout(spec)]:
        p = PurePosixPath(path)
        dirs.update([str(p), *(str(q) for q in p.parents)])
    return frozenset(dirs)


def _file_like(path: str) -> bool:
    """A word of a script that names a file (a folder in it, a suffix, a dotfile), not a
    bare word (``set``, ``python``, a make target)."""
    name = PurePosixPath(path).name
    return "/" in path or name.startswith(".") or bool(PurePosixPath(name).suffix)


async def run(jail: Jail, cfg: SandboxConfig, limits: Limits, spec: TaskSpec, code: dict[str, bytes], base: Path,
              *, uid: int, root: ImageRoot | None = None, changes: TreeChanges | None = None) -> RunOutput:
    """``root``: the task's image (the command runs on it, in a fresh copy-on-write tree of
    its ``workdir`` with the agent's removals and links redone); None: the host root."""
    tests = {path: text.encode() for path, text in grading_inenv.layout(spec).items()}
    plan = HiddenPlan(args=[], tests=tests, selection=_NO_SELECTION, canaries=[], plugin="", collected_file="")
    original = {clean_relpath(p): t.encode() for p, t in spec.files.items()}
    configs = support = None
    if root is not None:
        configs = await asyncio.to_thread(grading_inenv.image_configs, root, spec, plan)
        support = await asyncio.to_thread(grading_inenv.image_support, root, spec, plan, configs)
        top = spec.workdir.rstrip("/")
        for path in command_paths(spec.test_command, spec.workdir):
            if path not in original:
                data = await asyncio.to_thread(image_file_bytes, root, f"{top}/{path}")
                if data is not None:
                    original[path] = data
    runner = runner_files(spec, original)
    files, notes, links = grading_inenv.tree(spec, code, plan, base_configs=configs, changes=changes,
                                             support=support, runner=runner)
    ws, on_root = grading_inenv.run_workspace(base, uid, files, spec, root, changes, links)
    try:
        result = await jail.run(spec.test_command, workspace=ws.root, uid=uid, timeout_s=cfg.grading_timeout_s,
                                limits=limits, label="grade-plain", **on_root)
    finally:
        if root is not None:
            ws.remove()
    return RunOutput(result=result, report=None, collected=None, notes=notes)
