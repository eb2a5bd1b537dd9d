"""The demo task set: format, spread of difficulty, and that every task is real:
its reference solution passes all hidden tests and the unmodified repo fails some."""

from __future__ import annotations

import ast
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tasks.check import CheckResult, run_hidden_tests
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


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, bool], CheckResult]:
    """Every task twice (reference solution, unmodified repo), pytest in a subprocess each."""
    jobs = [(task_id, with_solution) for task_id in TASK_IDS for with_solution in (True, False)]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        outs = pool.map(lambda job: run_hidden_tests(STORE.get(job[0]), with_solution=job[1]), jobs)
        return dict(zip(jobs, outs))


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


@pytest.mark.slow
@pytest.mark.parametrize("task_id", TASK_IDS)
def test_reference_solution_passes(results, task_id):
    res = results[(task_id, True)]
    assert res.all_passed, res.output
    assert res.total >= 3


@pytest.mark.slow
@pytest.mark.parametrize("task_id", TASK_IDS)
def test_unmodified_repo_fails(results, task_id):
    res = results[(task_id, False)]
    # exit code 1 = some tests failed; 2 would be a collection error, which would make
    # every score of a half-done attempt 0 instead of a fraction
    assert res.returncode == 1, res.output
    assert res.total == results[(task_id, True)].total, res.output
    assert res.passed < res.total
