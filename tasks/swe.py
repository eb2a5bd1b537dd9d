"""Load SWE-style tasks (SWE-bench rows plus the repository snapshot) from JSONL.

One JSON object per line; blank lines and lines starting with ``#`` are skipped.
Accepted fields (anything else is an error unless ``allow_unknown_fields``):

================================  ========  ===============================================
field                             required  meaning
================================  ========  ===============================================
``instance_id``                   yes       task id; ``[A-Za-z0-9_.-]+``, unique in the file
``problem_statement``             yes       the instruction the agent sees
``files``                         yes       repository snapshot at ``base_commit``:
                                            ``{relative path: text}`` (what the agent gets)
``FAIL_TO_PASS``                  yes       pytest node ids (``tests/test_x.py::test_a``)
                                            that must pass after the fix; a JSON list, or a
                                            string holding one (as SWE-bench stores them)
``PASS_TO_PASS``                  no        node ids that must keep passing; same forms
``test_patch``                    no        unified diff adding/changing the tests, applied
                                            to ``files`` to make the hidden tests
``test_files``                    no        instead of ``test_patch``: ``{path: text}`` of
                                            the test files after the change
``patch``                         no        the gold fix as a unified diff -> reference
                                            solution (checked to apply)
``solution_files``                no        instead of ``patch``: ``{path: text}``
``difficulty``                    no        trivial/easy/medium/hard, or SWE-bench
                                            Verified's "<15 min fix", "15 min - 1 hour",
                                            "1-4 hours", ">4 hours" (default medium)
``test_command``                  no        overrides the generated command
``grading``                       no        ``in-env`` (default: the hidden tests run in
                                            the solution's process on the agent's tree,
                                            test files and config restored) or
                                            ``bridged`` (see docs/sandbox.md)
``image`` (or ``docker_image``,   no        the OCI image the task runs in (a registry
``image_name``)                             reference, or ``oci:``/``docker-archive:``...
                                            as skopeo spells them); with an image,
                                            ``files`` may be omitted (the repository is in
                                            the image) and ``workdir`` defaults to /testbed
``workdir``                       no        where the repository lives in the sandbox
                                            (an image row without ``files``: the
                                            patches apply to the image's tree there,
                                            see tasks/image_repo.py)
``test_support``                  no        the repository's test-support files (paths
                                            or globs, relative to its root): grading
                                            runs them from the task's bytes, never the
                                            agent's copy (TaskSpec.test_support;
                                            docs/sandbox.md). None may cover a file the
                                            gold patch changes
``repo``, ``base_commit``,        no        kept as metadata
``version``, ``created_at``,
``hints_text``,
``environment_setup_commit``
================================  ========  ===============================================

The task becomes a :class:`TaskSpec` with ``task_set`` = the file's stem:

- ``files``: the snapshot, unchanged (existing tests included, as in SWE-bench);
- ``hidden_tests``: every test file named by a FAIL_TO_PASS/PASS_TO_PASS id or touched by
  the test patch, in its patched version, plus the ``__init__.py`` and ``conftest.py``
  files on its folder path and the non-test helper modules beside it, so it imports
  as it does in the repository. The grader lays them under ``hidden_tests/``;
- ``test_command``: ``python -m pytest -q -p no:cacheprovider`` with each id prefixed by
  ``hidden_tests/``; with ``scoring = "all"`` the score is 1 only when all of them pass;
- ``metadata``: the extra fields, plus ``FAIL_TO_PASS``/``PASS_TO_PASS`` as JSON.

A bad line raises :class:`SWEFormatError` naming the file, the line and the field.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import msgspec

from tasks.patch import PatchError, apply_patch, patched_paths
from tasks.spec import GRADING_MODES, TaskSpec, test_support_problem

HIDDEN_TESTS_DIR = "hidden_tests"
TEST_COMMAND_PREFIX = "python -m pytest -q -p no:cacheprovider"
METADATA_FIELDS = ("repo", "base_commit", "version", "created_at", "hints_text", "environment_setup_commit")
REQUIRED_FIELDS = ("instance_id", "problem_statement", "files", "FAIL_TO_PASS")
# The datasets spell a row's image differently: SWE-bench harness images and SWE-Gym
# "docker_image", SWE-smith "image_name".
IMAGE_FIELDS = ("image", "docker_image", "image_name")
SWE_WORKDIR = "/testbed"
OPTIONAL_FIELDS = (
    "PASS_TO_PASS", "test_patch", "test_files", "patch", "solution_files", "difficulty", "test_command", "grading",
    *IMAGE_FIELDS, "workdir", "test_support", *METADATA_FIELDS,
)
ACCEPTED_FIELDS = frozenset(REQUIRED_FIELDS + OPTIONAL_FIELDS)
DIFFICULTIES = ("trivial", "easy", "medium", "hard")
SWE_BENCH_DIFFICULTY = {"<15 min fix": "easy", "15 min - 1 hour": "medium", "1-4 hours": "hard", ">4 hours": "hard"}
_ID = re.compile(r"[A-Za-z0-9_.-]+")


class SWEFormatError(ValueError):
    """A JSONL row is not a valid SWE-style task; the message names line and field."""

    def __init__(self, source: str, line: int, field: str | None, message: str) -> None:
        where = f"{source}:{line}" + (f": field {field!r}" if field else "")
        super().__init__(f"{where}: {message}")
        self.source, self.line, self.field = source, line, field


def _is_test_module(path: str) -> bool:
    name = PurePosixPath(path).name
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def _test_file_of(node_id: str) -> str | None:
    """``tests/test_x.py::Class::test_a[1]`` -> ``tests/test_x.py``; None when not a pytest id."""
    path = node_id.split("::", 1)[0]
    if not path.endswith(".py") or path.startswith("/") or ".." in PurePosixPath(path).parts:
        return None
    return path


class _Row:
    """Field access with errors that name the line and field."""

    def __init__(self, source: str, line: int, data: dict[str, Any]) -> None:
        self.source, self.line, self.data = source, line, data

    def error(self, field: str | None, message: str) -> SWEFormatError:
        return SWEFormatError(self.source, self.line, field, message)

    def _get(self, field: str, required: bool) -> Any:
        value = self.data.get(field)
        if value is None and required:
            raise self.error(field, "is required")
        return value

    def text(self, field: str, *, required: bool = False) -> str | None:
        value = self._get(field, required)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.error(field, f"must be a string, got {type(value).__name__}")
        if required and not value.strip():
            raise self.error(field, "must not be empty")
        return value

    def file_map(self, field: str, *, required: bool = False) -> dict[str, str] | None:
        value = self._get(field, required)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(field, f"must be an object of path -> text, got {type(value).__name__}")
        for path, text in value.items():
            p = PurePosixPath(path)
            if not path or p.is_absolute() or ".." in p.parts or path.startswith(HIDDEN_TESTS_DIR + "/"):
                raise self.error(field, f"bad path {path!r} (relative, inside the repository, not under {HIDDEN_TESTS_DIR}/)")
            if not isinstance(text, str):
                raise self.error(field, f"{path!r}: content must be text, got {type(text).__name__}")
        return dict(value)

    def test_ids(self, field: str, *, required: bool = False) -> list[str]:
        value = self._get(field, required)
        if value is None:
            return []
        if isinstance(value, str):  # SWE-bench stores these lists as JSON text
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise self.error(field, f"is a string but not a JSON list: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(field, "must be a list of pytest node ids (strings)")
        if required and not value:
            raise self.error(field, "must name at least one test")
        for node_id in value:
            if _test_file_of(node_id) is None:
                raise self.error(field, f"{node_id!r} is not a pytest node id like 'tests/test_x.py::test_a'")
        return list(value)


def parse_row(data: Any, *, source: str = "<jsonl>", line: int = 1, task_set: str = "swe",
              allow_unknown_fields: bool = False) -> TaskSpec:
    """One row -> a TaskSpec. Phases: required fields -> the repository with the test
    change -> hidden tests -> solution -> difficulty, test command, metadata."""
    if not isinstance(data, dict):
        raise SWEFormatError(source, line, None, f"a line must hold a JSON object, got {type(data).__name__}")
    row = _Row(source, line, data)
    unknown = sorted(set(data) - ACCEPTED_FIELDS)
    if unknown and not allow_unknown_fields:
        raise row.error(unknown[0], f"unknown field (unknown: {', '.join(unknown)}; accepted: see tasks/swe.py)")
    task_id = row.text("instance_id", required=True)
    if not _ID.fullmatch(task_id):
        raise row.error("instance_id", f"{task_id!r} may hold only letters, digits, '_', '.', '-'")
    instruction = row.text("problem_statement", required=True)
    image = _image(row)
    # With an image the repository is in it (at workdir): the snapshot is optional.
    files = row.file_map("files", required=not image) or {}
    if not files and not image:
        raise row.error("files", "the repository snapshot is empty")
    workdir = row.text("workdir") or (SWE_WORKDIR if image else "/workspace")
    if not PurePosixPath(workdir).is_absolute() or ".." in PurePosixPath(workdir).parts:
        raise row.error("workdir", f"{workdir!r} must be an absolute path without '..'")
    fail_to_pass = row.test_ids("FAIL_TO_PASS", required=True)
    pass_to_pass = row.test_ids("PASS_TO_PASS")
    test_support = _test_support(row, [])

    if image and not files:
        # The repository is only in the image: what the patches edit is there. Checked
        # now: everything that needs no repository text; the rest where the image is
        # unpacked (tasks/image_repo.py: with_image_repo).
        _patch_or_files(row, "test_patch", "test_files")
        _patch_or_files(row, "patch", "solution_files")
        return TaskSpec(
            task_id=task_id, instruction=instruction, files={}, hidden_tests={}, solution={},
            difficulty=_difficulty(row), test_command=_test_command(row, fail_to_pass + pass_to_pass),
            language="python", task_set=task_set, metadata=_metadata(row, fail_to_pass, pass_to_pass),
            image=image, workdir=workdir, grading=_grading(row), test_support=test_support,
            image_repo_row=json.dumps(data, sort_keys=True),
        )

    with_tests, touched = _with_tests(row, files)
    solution, deletes = _solution(row, files)
    _test_support(row, [*solution, *deletes])
    return TaskSpec(
        task_id=task_id,
        instruction=instruction,
        files=files,
        hidden_tests=_hidden_tests(row, with_tests, touched, fail_to_pass, pass_to_pass),
        solution=solution,
        solution_deletes=deletes,
        difficulty=_difficulty(row),
        test_command=_test_command(row, fail_to_pass + pass_to_pass),
        language="python",
        task_set=task_set,
        metadata=_metadata(row, fail_to_pass, pass_to_pass),
        image=image,
        workdir=workdir,
        grading=_grading(row),
        test_support=test_support,
    )


def _test_support(row: _Row, solution_paths: list[str]) -> list[str] | None:
    """``test_support`` checked (None when the row has none); ``solution_paths``: the
    files the gold patch changes or deletes, none of which it may cover. (An image-only
    row is checked against its gold patch where it is made whole.)"""
    value = row.data.get("test_support")
    problem = test_support_problem(value, solution_paths)
    if problem:
        raise row.error("test_support", problem)
    return None if value is None else list(value)


def _image(row: _Row) -> str:
    """The row's image reference under whichever name it uses ("" = none); two different
    ones are an error."""
    given = {f: row.text(f) for f in IMAGE_FIELDS if row.text(f)}
    if len(set(given.values())) > 1:
        raise row.error(sorted(given)[1], f"names another image than {sorted(given)[0]} ({given})")
    image = next(iter(given.values()), "")
    if image != image.strip() or any(c.isspace() for c in image):
        raise row.error(next(iter(given)), f"{image!r} is not an image reference (no whitespace)")
    return image


def _with_tests(row: _Row, files: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The repository after the test change (hidden tests are taken from it), and the
    paths the change touched."""
    test_patch, test_files = _patch_or_files(row, "test_patch", "test_files")
    if test_patch:
        with_tests = _patched(row, "test_patch", files, test_patch)
        return with_tests, [p for p in patched_paths(test_patch) if p in with_tests]
    if test_files:
        return {**files, **test_files}, list(test_files)
    return dict(files), []


def _hidden_tests(row: _Row, with_tests: dict[str, str], touched: list[str],
                  fail_to_pass: list[str], pass_to_pass: list[str]) -> dict[str, str]:
    """The test files the named tests live in, the files the test change touched, and
    what those import from beside them (conftest.py / __init__.py up the path, helper
    modules in the same folder)."""
    hidden: dict[str, str] = {}
    for field, ids in (("FAIL_TO_PASS", fail_to_pass), ("PASS_TO_PASS", pass_to_pass)):
        for node_id in ids:
            path = _test_file_of(node_id)
            if path not in with_tests:
                raise row.error(field, f"{node_id!r}: {path} is neither in files nor made by the test patch")
            hidden[path] = with_tests[path]
    for path in touched:
        hidden[path] = with_tests[path]
    for path in list(hidden):
        folder = PurePosixPath(path).parent
        for other, text in with_tests.items():
            o = PurePosixPath(other)
            on_path = o.name in ("__init__.py", "conftest.py") and (folder == o.parent or o.parent in folder.parents)
            helper = o.parent == folder and o.suffix == ".py" and not _is_test_module(other)
            if on_path or helper:
                hidden.setdefault(other, text)
    return hidden


def _solution(row: _Row, files: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The files the gold patch changes (checked to apply) and the files it deletes, or
    ``solution_files`` (which delete nothing)."""
    gold, solution_files = _patch_or_files(row, "patch", "solution_files")
    if gold:
        fixed = _patched(row, "patch", files, gold)
        return {p: t for p, t in fixed.items() if files.get(p) != t}, sorted(p for p in files if p not in fixed)
    return solution_files or {}, []


def _patch_or_files(row: _Row, patch_field: str, files_field: str) -> tuple[str | None, dict[str, str] | None]:
    """A change given as a diff or as whole files, never both."""
    diff, given = row.text(patch_field), row.file_map(files_field)
    if diff is not None and given is not None:
        raise row.error(files_field, f"give either {patch_field} or {files_field}, not both")
    return diff, given


def _patched(row: _Row, field: str, files: dict[str, str], diff: str) -> dict[str, str]:
    try:
        return apply_patch(files, diff)
    except PatchError as exc:
        raise row.error(field, f"does not apply to files: {exc}") from None


def _grading(row: _Row) -> str:
    """Repository tasks grade in their environment by default (their tests patch and
    share state with the code under test: they do not survive the bridge)."""
    grading = row.text("grading") or "in-env"
    if grading not in GRADING_MODES:
        raise row.error("grading", f"{grading!r} is not one of {', '.join(GRADING_MODES)}")
    return grading


def _difficulty(row: _Row) -> str:
    raw_difficulty = row.text("difficulty") or "medium"
    difficulty = SWE_BENCH_DIFFICULTY.get(raw_difficulty, raw_difficulty)
    if difficulty not in DIFFICULTIES:
        raise row.error("difficulty", f"{raw_difficulty!r} is not one of {DIFFICULTIES} or {sorted(SWE_BENCH_DIFFICULTY)}")
    return difficulty


def _test_command(row: _Row, test_ids: list[str]) -> str:
    """``test_command``, else pytest on every named test (under the hidden tests' folder)."""
    command = row.text("test_command")
    if command is None:
        ids = [f"{HIDDEN_TESTS_DIR}/{i}" for i in dict.fromkeys(test_ids)]
        return " ".join([TEST_COMMAND_PREFIX, *(shlex.quote(i) for i in ids)])
    if not command.strip():
        raise row.error("test_command", "must not be empty")
    return command


def _metadata(row: _Row, fail_to_pass: list[str], pass_to_pass: list[str]) -> dict[str, str]:
    metadata = {f: row.text(f) for f in METADATA_FIELDS if row.text(f) is not None}
    metadata["FAIL_TO_PASS"] = json.dumps(fail_to_pass)
    metadata["PASS_TO_PASS"] = json.dumps(pass_to_pass)
    metadata["source"] = "swe"
    return metadata


def with_image_repo(spec: TaskSpec, repo: dict[str, str]) -> TaskSpec:
    """A row whose repository is only in its image (``spec.needs_image_repo``), made
    whole with the image's tree at ``workdir`` (``repo``, read by
    sandbox/image_repo.py): the test patch and gold patch applied to it, the hidden tests
    and their helpers taken from it, and ``files`` = that tree, the base against which the
    grader sees what the agent changed and restores test files and configuration. A
    patch that does not apply to the image raises :class:`SWEFormatError`."""
    if not spec.needs_image_repo:
        return spec
    data = json.loads(spec.image_repo_row)
    if not repo:
        raise SWEFormatError(f"image {spec.image}", 1, "workdir",
                             f"the image holds no repository files at {spec.workdir}")
    whole = parse_row({**data, "files": repo}, source=f"image {spec.image}", line=1, task_set=spec.task_set,
                      allow_unknown_fields=True)
    return msgspec.structs.replace(whole, metadata=spec.metadata)


def iter_swe_jsonl(path: str | Path, *, task_set: str | None = None,
                   allow_unknown_fields: bool = False) -> Iterator[TaskSpec]:
    path = Path(path)
    task_set = task_set or path.stem
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SWEFormatError(str(path), number, None, f"not valid JSON: {exc}") from None
            spec = parse_row(data, source=str(path), line=number, task_set=task_set,
                             allow_unknown_fields=allow_unknown_fields)
            if spec.task_id in seen:
                raise SWEFormatError(str(path), number, "instance_id",
                                     f"{spec.task_id!r} already defined on line {seen[spec.task_id]}")
            seen[spec.task_id] = number
            yield spec


def load_swe_jsonl(path: str | Path, **kwargs: Any) -> list[TaskSpec]:
    return list(iter_swe_jsonl(path, **kwargs))
