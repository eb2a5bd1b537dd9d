"""In-env grading: the hidden tests in the solution's process, as the repository's own
test suite runs (for repository tasks, whose tests patch and share state with the code
under test: ``mock.patch("pkg.mod.func")``, ``monkeypatch.setattr`` on a module constant).

One *fresh* sandbox (the task's image where it has one, else the host root) holding the
agent's final tree (``*.pyc`` dropped), in which the grader first restores, from the
task, at their real repository paths:

- every hidden test file (the test patch's version, this grading's canaries appended)
  and the helpers beside it;
- the repository's test-support files (sandbox/test_support.py: declared, in a tests
  folder, or modules named as test support that the hidden tests import);
- every test configuration, at any depth: ``conftest.py``, ``pytest.ini``/``.pytest.ini``,
  ``pytest.toml``/``.pytest.toml``, ``tox.ini``/``setup.cfg``/``pyproject.toml``, and the
  plugin modules they name (``pytest_plugins``, ``-p`` in ``addopts``). One the agent
  added where the task has none is deleted (a changed ``pyproject.toml`` is restored, so
  the package's build config stays the task's).

pytest's inifile is pinned with ``-c`` to the one pytest would pick in the task's own
tree (when the task has one), so no config the agent leaves anywhere can be picked.

Every agent change to those paths is discarded and named in the reward's reason. The
run uses the task's own test command with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``,
``-p no:cacheprovider`` and the grader's plugin (collection record, canaries last); the
report is checked by :mod:`sandbox.result_check`. What this does and does not catch:
docs/sandbox.md.
"""

from __future__ import annotations

import ast
import asyncio
import configparser
import json
import os
import re
import secrets
import shlex
import tomllib
from pathlib import Path, PurePosixPath

from sandbox import pyast
from sandbox.config import SandboxConfig
from sandbox.grading_common import (
    HIDDEN_TESTS_DIR, PLUGIN_DIR, REPORT_DIR, REPORT_FILE, HiddenPlan, RunOutput, plugin_dir, write_ro,
)
from sandbox import image_workspace
from sandbox.image_changes import TreeChanges
from sandbox.image_repo import image_file_bytes, image_tree
from sandbox.test_support import support_files
from sandbox.images import ImageRoot
from sandbox.isolation import IMAGE_PATH, WORKSPACE, Bind, Limits
from sandbox.runner import Jail
from sandbox.workspace import Workspace, WorkspaceError, clean_relpath
from tasks.spec import TaskSpec, pytest_arguments

MAX_REPORT_BYTES = 8 * 1024 * 1024
# Files that configure pytest wherever they are (the inifile candidates, in pytest's order
# of preference within one folder, and conftests).
INIFILE_NAMES = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
CONFIG_NAMES = frozenset({"conftest.py", *INIFILE_NAMES})
_TAKES_VALUE = frozenset({"-p", "-o", "-k", "-m", "-c", "-W", "--deselect", "--ignore", "--ignore-glob", "--rootdir",
                          "--confcutdir", "--basetemp", "--override-ini", "--config-file"})
_PREFIX = HIDDEN_TESTS_DIR + "/"
_BOOT_SOURCE = (Path(__file__).parent / "grading_boot.py").read_bytes()
_PYTHON_NAME = re.compile(r"python(3(\.\d+)?)?")


def real_paths(spec: TaskSpec) -> bool:
    """SWE-style rows keep hidden tests under their repository paths (the command names
    them as ``hidden_tests/<path>``); other tasks' hidden tests live in ``hidden_tests/``."""
    return spec.metadata.get("source") == "swe"


def layout(spec: TaskSpec) -> dict[str, str]:
    """The hidden test files as the run sees them."""
    if real_paths(spec):
        return {clean_relpath(rel): text for rel, text in spec.hidden_tests.items()}
    return {f"{_PREFIX}{clean_relpath(rel)}": text for rel, text in spec.hidden_tests.items()}


def pytest_args(spec: TaskSpec, args: list[str]) -> list[str]:
    if not real_paths(spec):
        return list(args)
    out = []
    for arg in args:
        if arg == HIDDEN_TESTS_DIR:
            out.append(".")
        else:
            out.append(arg.removeprefix(_PREFIX) if arg.startswith(_PREFIX) else arg)
    return out


def command_prefix(test_command: str) -> list[str]:
    """The environment's own way of starting pytest (``pytest``, ``python -m pytest``...)."""
    argv = shlex.split(test_command)
    args = pytest_arguments(test_command) or []
    return argv[: len(argv) - len(args)]


def boot_prefix(prefix: list[str], plugin: Path, plan: HiddenPlan, root: ImageRoot | None = None) -> list[str]:
    """``python -m pytest`` as ``python /grader-plugin/<plugin>_boot.py`` (written into the
    plugin folder): the grader's plugin is imported, and the hidden sources read, before the
    agent's tree goes on sys.path (sandbox/grading_boot.py). On an image, a console script
    (``pytest``, ``py.test``: the image's, found on its PATH) the same way, run by the
    interpreter its ``#!`` line names, its own folder first on sys.path as the script would
    have it: an editable install's ``.pth`` may put the tree on sys.path from start-up, and
    then a module of the tree that pytest's imports look for ran before the plugin. Any other
    prefix (a console script on the host root, whose tree is not on sys.path at start-up, or
    one whose ``#!`` line is not a plain Python) as it is."""
    if len(prefix) == 3 and prefix[1:] == ["-m", "pytest"]:
        interpreter, path0 = [prefix[0]], None
    else:
        found = _console_script(root, prefix) if root is not None else None
        if found is None:
            return prefix
        interpreter, path0 = found
    source = _BOOT_SOURCE.replace(b"\n_PATH0 = None\n", f"\n_PATH0 = {path0!r}\n".encode(), 1)
    write_ro(plugin / f"{plan.plugin}_boot.py", source)
    return [*interpreter, f"{PLUGIN_DIR}/{plan.plugin}_boot.py"]


def _console_script(root: ImageRoot, prefix: list[str]) -> tuple[list[str], str] | None:
    """(the interpreter argv of its ``#!`` line, its folder) of a one-word prefix that is a
    console script of the image (an absolute path, or a name on the image's PATH)."""
    if len(prefix) != 1:
        return None
    program = prefix[0]
    if program.startswith("/"):
        candidates = [program]
    elif "/" not in program:
        path = root.env.get("PATH", IMAGE_PATH)
        candidates = [f"{d.rstrip('/')}/{program}" for d in path.split(":") if d.startswith("/")]
    else:
        return None  # (a script of the tree: no interpreter of the image's to trust)
    for candidate in candidates:
        data = image_file_bytes(root, candidate)
        if data is None:
            continue
        first = data.split(b"\n", 1)[0].decode("utf-8", "replace")
        words = first[2:].split() if first.startswith("#!") else []
        python = (len(words) == 1 and words[0].startswith("/") and _PYTHON_NAME.fullmatch(PurePosixPath(words[0]).name)
                  or len(words) == 2 and PurePosixPath(words[0]).name == "env" and _PYTHON_NAME.fullmatch(words[1]))
        return (words, str(PurePosixPath(candidate).parent)) if python else None
    return None


def tree(spec: TaskSpec, code: dict[str, bytes], plan: HiddenPlan, *, base_configs: dict[str, bytes] | None = None,
         changes: TreeChanges | None = None, support: dict[str, bytes] | None = None,
         runner: dict[str, bytes | None] | None = None,
         ) -> tuple[dict[str, bytes], list[str], dict[str, str]]:
    """The run's tree: the agent's files with the task's tests and test configuration
    restored; one note per agent change that was discarded; and the agent's links the
    run keeps (none at or above a file of the run, none named as test configuration).

    ``base_configs``: an image task's own test configuration as bytes (the image's tree,
    links followed inside it: sandbox/image_repo.py), for what the task's text cannot
    hold (a linked or non-UTF-8 ``setup.cfg``, a latin-1 ``conftest.py``); restored as
    regular files. ``changes``: the agent's removals and links against the image.
    ``support``: the task's test-support files as bytes (an image task's: :func:`image_support`);
    None: found in the task's text and ``base_configs``. ``runner``: more files of the
    tests' side (a test command that is not pytest: the runner script it names,
    sandbox/grading_plain.py), each the task's bytes, or None where the task has none (an
    agent's file there is removed)."""
    files = dict(code)
    original = {**(base_configs or {}), **{clean_relpath(p): t.encode() for p, t in spec.files.items()}}
    removed = set(changes.removed) if changes is not None else set()
    links = dict(changes.links) if changes is not None else {}
    notes: list[str] = []
    protected: dict[str, bytes] = {}
    for path, data in original.items():
        if PurePosixPath(path).name in CONFIG_NAMES:
            protected[path] = data
    protected.update(plugin_files(original, plan.tests))
    # The repository's test-support files too (sandbox/test_support.py): a hidden test that
    # asserts through a helper runs the task's version of it.
    if support is None:
        support = support_files(spec, original, plan.tests)
    protected.update({path: data for path, data in support.items() if path not in plan.tests})
    absent = {path for path, data in (runner or {}).items() if data is None}
    protected.update({path: data for path, data in (runner or {}).items() if data is not None})
    for path in sorted(files):
        name = PurePosixPath(path).name
        if (name in CONFIG_NAMES or path in absent) and path not in protected:
            del files[path]
            notes.append(f"{path} (added, removed)")
    for path in sorted(links):
        if (PurePosixPath(path).name in CONFIG_NAMES or path in absent) and path not in protected:
            del links[path]
            notes.append(f"{path} (added as a link, removed)")
    for path, data in protected.items():
        if path in links:
            notes.append(f"{path} (changed to a link, restored)")
        elif path in files and files[path] != data:
            notes.append(f"{path} (changed, restored)")
        elif path not in files and (base_configs is None or path in removed or path not in base_configs):
            # (An image's own config that is a link the agent left alone is no file of
            # the snapshot, and no change.)
            notes.append(f"{path} (deleted, restored)")
        files[path] = data
    for path, data in plan.tests.items():
        before = original.get(path)
        if path in files and before is not None and files[path] != before:
            notes.append(f"{path} (changed, replaced by the hidden tests)")
        elif path in files and before is None and not path.startswith(_PREFIX):
            notes.append(f"{path} (added, replaced by the hidden tests)")
        files[path] = data
    notes += _drop_shadows(files, links, code, original, [*protected, *plan.tests])
    notes += _drop_in_the_way(files, {*protected, *plan.tests})
    above = {str(parent) for path in files for parent in PurePosixPath(path).parents}
    for path in sorted(links):
        # (At, above or below a file of the run: below, the link's folder is where the
        # file goes, and the tree could not be written.)
        if path in files or path in above or any(str(p) in files for p in PurePosixPath(path).parents):
            del links[path]
            if not any(n.startswith(f"{path} ") for n in notes):
                notes.append(f"{path} (a link where the run's files go, removed)")
    return files, notes, links


def _drop_shadows(files: dict[str, bytes], links: dict[str, str], code: dict[str, bytes], original: dict[str, bytes],
                  run: list[str]) -> list[str]:
    """Remove what the agent added or changed that Python would import instead of a module
    of the run (``run``: the restored support, configuration and runner files, the hidden
    tests): a package of the same name beside it (``tests/helpers/__init__.py`` shadows
    ``tests/helpers.py``: in one folder the import system takes the package first) or an
    extension module (``helpers.cpython-311-x86_64-linux-gnu.so``, found before source), as
    files or links. Without this a restored helper was dead code: an agent's package with a
    ``check`` that asserts nothing was paid 1.0 in-env. The task's own entries stay."""
    stems = {path.removesuffix(".py"): path for path in run if path.endswith(".py")}

    def shadowed(path: str, link: bool = False) -> str | None:
        p = PurePosixPath(path)
        for parent in list(p.parents)[:-1]:
            if str(parent) in stems:
                return stems[str(parent)]
        if p.name.endswith(".so"):
            return stems.get(str(p.parent / p.name.split(".")[0]))
        return stems.get(path) if link else None  # (a link at the bare name: a package elsewhere)

    notes = []
    for path in sorted(files):
        module = shadowed(path)
        if module is not None and path not in stems.values() and original.get(path) != code.get(path, files[path]):
            del files[path]
            notes.append(f"{path} (added, shadows {module}, removed)")
    for path in sorted(links):
        module = shadowed(path, link=True)
        if module is not None:
            del links[path]
            notes.append(f"{path} (a link that shadows {module}, removed)")
    return notes


def _drop_in_the_way(files: dict[str, bytes], run: set[str]) -> list[str]:
    """Remove the agent's files that stand where the run's files (``run``) or their folders
    go: a file at a folder of the run (``tests`` where ``tests/test_x.py`` is restored) or
    below a run file's path (``tests/test_x.py/a`` after the test file was deleted and a
    folder made in its place). Both trees cannot be written: the grading failed (HTTP 400,
    no reward at all), so a wrong solution escaped its score by making its tree unwritable."""
    folders = {str(parent) for path in run for parent in PurePosixPath(path).parents}
    notes = []
    for path in sorted(files):
        if path in run:
            continue
        below = next((str(p) for p in PurePosixPath(path).parents if str(p) in run), None)
        if path in folders:
            del files[path]
            notes.append(f"{path} (a file where the run's folder {path}/ goes, removed)")
        elif below is not None:
            del files[path]
            notes.append(f"{path} (below {below}, a file of the run, removed)")
    return notes


def image_configs(root: ImageRoot, spec: TaskSpec, plan: HiddenPlan) -> dict[str, bytes]:
    """An image task's own test configuration as bytes: the image's configs (links
    followed inside the image) and the plugin modules they, the task's files or the
    hidden tests load, read from the image where the task's text has none (a latin-1
    or otherwise non-UTF-8 plugin module is no part of the text, yet must be restored
    byte-exact like any plugin)."""
    configs = dict(image_tree(root, spec.workdir).configs)
    known = {**configs, **{clean_relpath(p): t.encode() for p, t in spec.files.items()}}
    for module in sorted(_plugin_modules({**known, **plan.tests})):
        for candidate in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py"):
            if candidate not in known:
                data = image_file_bytes(root, f"{spec.workdir.rstrip('/')}/{candidate}")
                if data is not None:
                    configs[candidate] = data
    return configs


def image_support(root: ImageRoot, spec: TaskSpec, plan: HiddenPlan, configs: dict[str, bytes]) -> dict[str, bytes]:
    """An image task's test-support files (sandbox/test_support.py) as bytes: the task's
    text where it has the file, else the image's (links followed inside the image): a
    latin-1 or otherwise non-UTF-8 helper is no part of the text, yet must run as
    the task has it. ``configs``: :func:`image_configs`."""
    tree_ = image_tree(root, spec.workdir)
    top = spec.workdir.rstrip("/")
    return support_files(spec, {**configs, **{clean_relpath(p): t.encode() for p, t in spec.files.items()}},
                         plan.tests, more=[*tree_.files, *tree_.symlinks],
                         read=lambda path: image_file_bytes(root, f"{top}/{path}"))


def plugin_files(original: dict[str, bytes], tests: dict[str, bytes]) -> dict[str, bytes]:
    """The files of ``original`` (the task's tree) that are plugin modules loaded by its
    conftests and configs or by the hidden tests (``pytest_plugins``, ``-p``)."""
    found = {}
    for module in _plugin_modules({**original, **tests}):
        for candidate in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py"):
            if candidate in original:
                found[candidate] = original[candidate]
    return found


def _plugin_modules(files: dict[str, bytes]) -> set[str]:
    """Modules loaded as pytest plugins by the given conftests, test files and configs."""
    names: set[str] = set()
    for path, data in files.items():
        name = PurePosixPath(path).name
        if name.endswith(".py"):
            try:
                tree_ = pyast.parse(data)
            except (SyntaxError, ValueError):
                continue
            for stmt in tree_.body:
                if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytest_plugins"
                                                        for t in stmt.targets):
                    try:
                        value = ast.literal_eval(stmt.value)
                    except ValueError:
                        continue
                    names.update([value] if isinstance(value, str) else [v for v in value if isinstance(v, str)])
        elif name in INIFILE_NAMES:
            names.update(m for m in re.findall(r"-p\s*([A-Za-z_][\w.]*)", data.decode(errors="replace"))
                         if not m.startswith("no"))
    return names


SECRETS_DIR = "/grader-secrets"
PLACEHOLDER = b"# A hidden test file: the grader serves its source to pytest from memory.\n"


async def run(jail: Jail, cfg: SandboxConfig, limits: Limits, spec: TaskSpec, code: dict[str, bytes],
              plan: HiddenPlan, base: Path, *, uid: int, root: ImageRoot | None = None,
              changes: TreeChanges | None = None) -> RunOutput:
    """``root``: the task's image (a fresh copy-on-write tree of its ``spec.workdir``, the
    agent's removals and links (``changes``) redone on it and the run's files over it);
    None: the host root, the tree at /workspace."""
    workdir = spec.workdir if root is not None else WORKSPACE
    configs = await asyncio.to_thread(image_configs, root, spec, plan) if root is not None else None
    support = await asyncio.to_thread(image_support, root, spec, plan, configs) if root is not None else None
    files, notes, links = tree(spec, code, plan, base_configs=configs, changes=changes, support=support)
    served = {path: files[path] for path in plan.tests if _served(path)}
    files.update({path: PLACEHOLDER for path in served})
    secrets_dir = Workspace.create(base / "secrets", uid, {})[0]
    name = f"{secrets.token_hex(8)}.json"
    write_private(secrets_dir.root / name,
                  json.dumps({f"{workdir}/{p}": d.decode() for p, d in served.items()}).encode(), uid)
    plan.hidden_sources = f"{SECRETS_DIR}/{name}"
    ws, on_root = run_workspace(base, uid, files, spec, root, changes, links)
    plugin = plugin_dir(base, plan)
    out = Workspace.create(base / "out", uid, {})[0]
    pin = inifile_pin(spec, plan, workdir, configs)
    if pin[1].startswith(PLUGIN_DIR + "/"):
        write_ro(plugin / PurePosixPath(pin[1]).name, b"[pytest]\n")
    prefix = await asyncio.to_thread(boot_prefix, command_prefix(spec.test_command), plugin, plan, root)
    command = shlex.join([*prefix, *pin, *plan.args])
    try:
        result = await jail.run(
            command, workspace=ws.root, uid=uid, timeout_s=cfg.grading_timeout_s,
            binds=[Bind(str(plugin), PLUGIN_DIR), Bind(str(out.root), REPORT_DIR, writable=True),
                   Bind(str(secrets_dir.root), SECRETS_DIR, writable=True)],
            env={"PYTHONPATH": PLUGIN_DIR, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
            limits=limits, label="grade-in-env", **on_root,
        )
    finally:
        if root is not None:
            ws.remove()
    return RunOutput(result=result, report=_read(out, REPORT_FILE), collected=_read(out, plan.collected_file),
                     notes=notes)


def run_workspace(base: Path, uid: int, files: dict[str, bytes], spec: TaskSpec, root, changes, links):
    """The hidden run's tree, ``files`` at ``base/ws``: over the image root at the task's
    workdir (the agent's removals and links replayed) when ``root`` is given, else a
    plain workspace; and the jail arguments that run in it (``root`` and ``workdir``, or
    none: the jail's own workspace). The caller removes an image tree after the run."""
    if root is None:
        return Workspace.create(base / "ws", uid, files)[0], {}
    ws, _ = image_workspace.create(base / "ws", uid, files, None, root, spec.workdir,
                                   removed=changes.removed if changes is not None else (), links=links)
    return ws, {"root": root, "workdir": spec.workdir}


def inifile_pin(spec: TaskSpec, plan: HiddenPlan, workdir: str, base_configs: dict[str, bytes] | None = None,
                ) -> list[str]:
    """pytest's config, pinned: the inifile the task's own tree gives (its image's
    configs included, ``base_configs``), or (the task has none) an empty one in the
    plugin folder, so no config the run might find is read, with ``--rootdir`` at the
    repository root (where pytest roots node ids without one)."""
    known = {p: d.decode("utf-8", "replace") for p, d in (base_configs or {}).items()}
    inifile = task_inifile({**known, **{clean_relpath(p): t for p, t in spec.files.items()}}, plan.args)
    if inifile:
        return ["-c", inifile]
    pin = ["-c", f"{PLUGIN_DIR}/{plan.plugin}.ini"]
    if not any(a == "--rootdir" or a.startswith("--rootdir=") for a in plan.args):
        pin += ["--rootdir", workdir]
    return pin


def _served(path: str) -> bool:
    """Hidden files served from memory: Python modules, but not conftests (pytest loads
    them as configuration) or package markers."""
    return path.endswith(".py") and PurePosixPath(path).name not in ("conftest.py", "__init__.py")


def write_private(path: Path, data: bytes, uid: int) -> None:
    """A file only the run's uid can read, in a folder it can write (to delete it)."""
    path.write_bytes(data)
    path.chmod(0o600)
    try:
        os.chown(path, uid, uid)
    except PermissionError:
        pass  # unprivileged service: the run's uid is ours


def task_inifile(files: dict[str, str], args: list[str]) -> str | None:
    """The inifile pytest picks in the task's own tree for these arguments (as pytest
    locates it: from the arguments' common folder upwards, the first file that is a
    pytest config); None when the task has none."""
    paths, skip = [], False
    for arg in args:
        if skip or arg.startswith("-"):
            skip = arg in _TAKES_VALUE
            continue
        paths.append(PurePosixPath(arg.split("::")[0]))
    if not paths:
        paths = [PurePosixPath(".")]
    parts: list[str] = []
    for group in zip(*(p.parts for p in paths)):
        if len(set(group)) != 1:
            break
        parts.append(group[0])
    folder = PurePosixPath(*parts) if parts else PurePosixPath(".")
    folders = [folder, *folder.parents] if str(folder) != "." else [folder]
    for d in folders:
        for name in INIFILE_NAMES:
            path = str(d / name) if str(d) != "." else name
            if path in files and _is_pytest_config(name, files[path]):
                return path
    return None


def _is_pytest_config(name: str, text: str) -> bool:
    if name in ("pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml"):
        return True
    if name == "pyproject.toml":
        try:
            return "pytest" in tomllib.loads(text).get("tool", {})
        except tomllib.TOMLDecodeError:
            return False
    parser = configparser.RawConfigParser()
    try:
        parser.read_string(text)
    except configparser.Error:
        return False
    return parser.has_section("pytest" if name == "tox.ini" else "tool:pytest")


def _read(out: Workspace, name: str) -> bytes | None:
    try:
        return out.read(name, MAX_REPORT_BYTES)
    except WorkspaceError:
        return None
