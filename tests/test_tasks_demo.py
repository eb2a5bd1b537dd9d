"""The demo task set: format and spread of difficulty (that every task is real, its
reference solution paid and its untouched repo not, is tests/test_grader_demo.py)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from tasks.store import TaskStore

DEMO = Path(__file__).resolve().parents[1] / "tasks" / "demo"
STORE = TaskStore(DEMO)
TASK_IDS = STORE.ids()
MIN_BY_DIFFICULTY = {"trivial": 10, "easy": 12, "medium": 12, "hard": 6}


def _count_test_functions(source: str) -> int:
    tree = ast.parse(source)
    return sum(
        1 for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
    )


def test_set_size_and_difficulty_spread():
    counts = Counter(spec.difficulty for spec in STORE)
    assert len(STORE) >= 40
    assert set(counts) <= set(MIN_BY_DIFFICULTY), counts
    for level, minimum in MIN_BY_DIFFICULTY.items():
        assert counts[level] >= minimum, (level, counts)


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_task_is_well_formed(task_id):
    spec = STORE.get(task_id)
    assert spec.task_set == "demo" and spec.language == "python"
    assert len(spec.instruction.strip()) >= 40
    assert spec.metadata.get("kind") in {"bugfix", "implement", "refactor"}
    assert spec.files, "the agent starts from at least one file"
    assert spec.solution, "a reference solution exists"
    # the solution edits the repo; it never ships tests of its own into hidden_tests
    assert not any(p.startswith("hidden_tests") for p in spec.solution)
    # several test functions, so a fractional score means something
    assert sum(_count_test_functions(src) for src in spec.hidden_tests.values()) >= 3
    for path in list(spec.files) + list(spec.solution) + list(spec.hidden_tests):
        assert "__pycache__" not in path and not path.startswith("/")


# That every reference solution passes and every untouched repo fails (with the same
# tests collected: a collection error would make every half-done attempt score 0) is
# checked through the live grader, where it matters, in tests/test_grader_demo.py.
