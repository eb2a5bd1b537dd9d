"""Load tasks from a folder of task folders (see :mod:`tasks.spec`), a SWE-style
``.jsonl`` file, or the procedural family (``family:train`` / ``family:heldout``)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tasks.spec import TaskSpec


class TaskFormatError(ValueError):
    """A task folder does not follow the format; the message names the folder and field."""


def _read_tree(root: Path) -> dict[str, str]:
    if not root.is_dir():
        return {}
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def load_task(folder: str | Path, task_set: str = "demo") -> TaskSpec:
    folder = Path(folder)
    meta_file = folder / "task.toml"
    if not meta_file.exists():
        raise TaskFormatError(f"{folder}: missing task.toml")
    try:
        meta = tomllib.loads(meta_file.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TaskFormatError(f"{meta_file}: invalid TOML: {exc}") from exc
    if not meta.get("instruction"):
        raise TaskFormatError(f"{meta_file}: 'instruction' is required")
    hidden = _read_tree(folder / "hidden_tests")
    if not hidden:
        raise TaskFormatError(f"{folder}: hidden_tests/ is empty")
    fields = {k: v for k, v in meta.items() if k in TaskSpec.__struct_fields__}
    unknown = set(meta) - set(fields)
    if unknown:
        raise TaskFormatError(f"{meta_file}: unknown keys {sorted(unknown)}")
    return TaskSpec(
        task_id=meta.get("task_id", folder.name),
        files=_read_tree(folder / "repo"),
        hidden_tests=hidden,
        solution=_read_tree(folder / "solution"),
        task_set=meta.get("task_set", task_set),
        **{k: v for k, v in fields.items() if k not in ("task_id", "task_set")},
    )


class TaskStore:
    """All tasks of a folder, by id. The grader's and the feeder's view of the data.

    ``tasks_dir`` is a folder of task folders (plus any ``*.jsonl`` files in it, read as
    SWE-style tasks, see :mod:`tasks.swe`), a single SWE-style ``.jsonl`` file, or
    ``family:<split>``: ``family_count`` generated tasks of that split (seed
    ``family_seed``, a ``family_long_share`` of arith/text draws in their long form, see
    :mod:`tasks.family`).

    Whatever it holds, :meth:`get` also resolves any family task id (``fam.<kind>...``):
    the id regenerates the task, so a grader serving one task set can grade the family's
    train and held-out tasks too (evaluation needs no second store)."""

    def __init__(self, tasks_dir: str | Path, *, family_count: int = 2000, family_seed: int = 0,
                 family_long_share: float = 0.0) -> None:
        from tasks.family import generate, parse_task_set
        from tasks.swe import load_swe_jsonl

        self.root = Path(tasks_dir)
        self._tasks: dict[str, TaskSpec] = {}
        split = parse_task_set(str(tasks_dir))
        if split is not None:
            jsonl_files = []
            for spec in generate(split, family_count, seed=family_seed, long_share=family_long_share):
                self._tasks[spec.task_id] = spec
        elif self.root.is_file() and self.root.suffix == ".jsonl":
            jsonl_files = [self.root]
        elif self.root.is_dir():
            for folder in sorted(p for p in self.root.iterdir() if p.is_dir() and (p / "task.toml").exists()):
                spec = load_task(folder, task_set=self.root.name)
                self._tasks[spec.task_id] = spec
            jsonl_files = sorted(self.root.glob("*.jsonl"))
        else:
            raise TaskFormatError(f"tasks folder {self.root} does not exist")
        for path in jsonl_files:
            for spec in load_swe_jsonl(path):
                if spec.task_id in self._tasks:
                    raise TaskFormatError(f"{path}: task id {spec.task_id!r} is defined twice in {self.root}")
                self._tasks[spec.task_id] = spec

    def get(self, task_id: str) -> TaskSpec:
        from tasks.family import FamilyError, is_family_id, resolve

        spec = self._tasks.get(task_id)
        if spec is not None:
            return spec
        if is_family_id(task_id):
            try:
                return resolve(task_id)
            except FamilyError as exc:
                raise KeyError(f"unknown task {task_id!r}: {exc}") from None
        raise KeyError(f"unknown task {task_id!r} in {self.root}") from None

    def add(self, spec: TaskSpec) -> None:
        self._tasks[spec.task_id] = spec

    def ids(self) -> list[str]:
        return list(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self):
        return iter(self._tasks.values())
