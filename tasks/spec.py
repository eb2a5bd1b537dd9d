"""The task format: a small repository, an instruction, hidden tests, metadata.

On disk a task is a folder ``<tasks_dir>/<task_id>/``::

    task.toml        instruction, difficulty, language, test_command, metadata
    repo/            files the agent starts from (its workspace)
    hidden_tests/    tests the grader runs; never shown to the agent
    solution/        reference solution: files that overwrite repo/ files

``TaskSpec.to_event`` makes the ``Task`` event samplers see: repository files and
instruction only. Hidden tests and the solution stay with the grader's task store.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import PurePosixPath

import msgspec

from schemas import Task

GRADING_MODES = ("bridged", "in-env")


class TaskSpec(msgspec.Struct, kw_only=True):
    task_id: str
    instruction: str
    files: dict[str, str]
    hidden_tests: dict[str, str]
    solution: dict[str, str] = {}
    # Paths of the repository the reference solution deletes (a gold patch's ``+++
    # /dev/null``): ``solution`` can only add or overwrite files. Grader-side only.
    solution_deletes: list[str] = []
    # Run by the grader inside the fresh sandbox, from the workspace root.
    test_command: str = "python -m pytest -q -p no:cacheprovider hidden_tests"
    difficulty: str = "easy"  # trivial | easy | medium | hard
    language: str = "python"
    task_set: str = "demo"
    metadata: dict[str, str] = {}
    # An OCI image whose root filesystem the task's sandboxes run on ("" = the host root,
    # as before); see sandbox/images.py and docs/environments.md. ``workdir``: where the
    # repository lives inside the sandbox (an image task's tree is a copy-on-write layer
    # over the image's ``workdir``).
    image: str = ""
    workdir: str = "/workspace"
    # How the grader runs the hidden tests (sandbox/grader.py, docs/sandbox.md):
    # "bridged": tests and solution in two sandboxes joined by the plain-data bridge (for
    # function-level tasks: the family and demo sets); "in-env": the tests in the
    # solution's process, in a fresh sandbox on the agent's final tree with every test
    # file and test config restored from the task (repository tasks: SWE-style rows).
    grading: str = "bridged"
    # A SWE-style row whose repository is only in its image (no ``files``): its test patch
    # and gold patch edit files the row does not hold, so its hidden tests, reference
    # solution and base tree are made where the image is unpacked (tasks/image_repo.py),
    # from this row (the JSON text as given). Never sent to samplers (to_event omits it).
    image_repo_row: str = ""
    # The repository's test-support files (paths or globs, see ``declares_test_support``):
    # helpers the hidden tests import or read, which the grader always runs from the
    # task's own bytes (its text, or its image's for an image-only repository), never
    # from the agent's copy (sandbox/test_support.py). None: not declared, the default
    # rule applies; a list (``[]`` too) replaces that rule's guess by name. Grader-side
    # only: to_event does not send it (the agent needs it for nothing; a file in it that
    # the agent edits is simply restored).
    test_support: list[str] | None = None

    @property
    def needs_image_repo(self) -> bool:
        return bool(self.image_repo_row)

    def __post_init__(self) -> None:
        if self.grading not in GRADING_MODES:
            raise ValueError(f"task {self.task_id}: grading = {self.grading!r} is not one of {', '.join(GRADING_MODES)}")
        problem = test_support_problem(self.test_support, [*self.solution, *self.solution_deletes])
        if problem:
            raise ValueError(f"task {self.task_id}: test_support {problem}")

    def declares_test_support(self, path: str) -> bool:
        """Whether ``path`` (relative to the repository root) is one the task declares as
        test support: an entry is a path or a glob over whole path segments (``*``, ``?``,
        ``[...]`` within a segment; ``**`` for any number of segments); one that names a
        folder covers everything under it."""
        return bool(self.test_support) and any(_declared(path, entry) for entry in self.test_support)

    def to_event(self, group_id: str, group_size: int, created_at: float = 0.0) -> Task:
        return Task(
            task_id=self.task_id,
            group_id=group_id,
            group_size=group_size,
            instruction=self.instruction,
            files=dict(self.files),
            language=self.language,
            difficulty=self.difficulty,
            task_set=self.task_set,
            metadata=dict(self.metadata),
            created_at=created_at,
            image=self.image,
            workdir=self.workdir,
        )


def test_support_problem(entries: object, solution_paths: list[str]) -> str:
    """What is wrong with a ``test_support`` value ("" when nothing): a list of relative
    paths or globs, none of them matching a file the reference solution changes or
    deletes (that file is code under test: the agent must be able to change it)."""
    if entries is None:
        return ""
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        return "must be a list of paths or globs"
    for entry in entries:
        parts = PurePosixPath(entry).parts
        if not entry.strip() or PurePosixPath(entry).is_absolute() or ".." in parts:
            return f"entry {entry!r} must be a path relative to the repository root, without '..'"
        for path in solution_paths:
            if _declared(path, entry):
                return f"entry {entry!r} covers {path}, which the reference solution changes (code under test)"
    return ""


def _declared(path: str, entry: str) -> bool:
    parts = PurePosixPath(path).parts
    pattern = PurePosixPath(entry).parts
    # The entry matches the path or one of its folders (a folder covers what is under it).
    return any(_segments(parts[:n], pattern) for n in range(1, len(parts) + 1))


def _segments(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_segments(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _segments(parts[1:], pattern[1:])


_PYTHON = re.compile(r"python(3(\.\d+)?)?")


def pytest_arguments(test_command: str) -> list[str] | None:
    """pytest's arguments when ``test_command`` runs pytest (``pytest ...``,
    ``py.test ...`` or ``python[3[.N]] -m pytest ...``, by name or path), else None: a
    command the grader can only run as written (sandbox/grader.py)."""
    argv = shlex.split(test_command)
    if not argv:
        return None
    program = PurePosixPath(argv[0]).name
    if program in ("pytest", "py.test"):
        return argv[1:]
    if _PYTHON.fullmatch(program) and argv[1:3] == ["-m", "pytest"]:
        return argv[3:]
    return None
