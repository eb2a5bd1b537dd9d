"""Task hygiene of every shipped task through the live grader (tasks.check.check_hygiene,
``rollway tasks check``): every reference solution passes (and is not flagged as
cheating), every untouched repository fails, and the generic adversarial solutions of
tasks/adversaries.py are never paid.

Every demo task gets the adversaries that depend on its tests (always-equal results,
returning the input, lying comparisons and C-level container copies where they apply);
the ones that depend only on the grading path (reading the hidden tests, a forged report
with an early exit) run on a sample of demo tasks, one generated family task of each
kind (full battery) and the in-env SWE example (full battery). All gradings run concurrently, bounded by the
service's command slots.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from sandbox.config import SandboxConfig
from tasks.adversaries import NAMES
from tasks.check import Graded, check_hygiene
from tasks.family import KINDS, generate
from tasks.store import TaskStore
from tasks.swe import load_swe_jsonl

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "tasks" / "demo"
STORE = TaskStore(DEMO)
PATH_ADVERSARIES = ("reads_hidden_tests", "forged_report")
PER_TASK = ["reference", "untouched", *(n for n in NAMES if n not in PATH_ADVERSARIES)]
SAMPLE = ("sum_to", "stack", "semver")
FAMILY = [spec for kind in KINDS for spec in generate("train", 1, kinds=[kind])]
SWE = load_swe_jsonl(ROOT / "tasks" / "swe_mocking.jsonl")


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict[str, dict[str, Graded]]:
    cfg = SandboxConfig(
        max_sessions=16, max_concurrent_commands=max(2, os.cpu_count() or 2), command_queue_timeout_s=1200.0,
        workspace_root=str(tmp_path_factory.mktemp("hygiene-ws")), tasks_dir=str(DEMO),
        # lru_cache's tests make 200k calls across the grading bridge (docs/sandbox.md).
        grading_timeout_s=300.0,
    )

    async def both():
        demo = await check_hygiene(list(STORE), cfg, only=PER_TASK)
        sample = await check_hygiene([STORE.get(t) for t in SAMPLE], cfg, only=list(PATH_ADVERSARIES))
        full = await check_hygiene(FAMILY + SWE, cfg)
        return demo + sample + full

    out: dict[str, dict[str, Graded]] = {}
    for result in asyncio.run(both()):
        for g in result.graded:
            out.setdefault(result.task_id, {})[g.solution] = g
    return out


def test_demo_set_is_there():
    assert len(STORE) >= 40


@pytest.mark.parametrize("task_id", STORE.ids() + [s.task_id for s in FAMILY + SWE])
def test_reference_solution_passes(graded, task_id):
    g = graded[task_id]["reference"]
    assert g.cheated is False, g.reason
    assert g.reason == "", g.reason
    assert g.score == 1.0
    assert g.tests_passed == g.tests_total >= 3


@pytest.mark.parametrize("task_id", STORE.ids() + [s.task_id for s in FAMILY + SWE])
def test_untouched_repository_fails(graded, task_id):
    g = graded[task_id]["untouched"]
    assert g.cheated is False, g.reason
    assert g.score == 0.0
    assert g.tests_passed < g.tests_total == graded[task_id]["reference"].tests_total
    assert "hidden tests did not pass" in g.reason


def test_every_adversary_is_tried_and_none_is_paid(graded):
    tried: dict[str, int] = {}
    defects = []
    for task_id, solutions in graded.items():
        for name, g in solutions.items():
            if name in ("reference", "untouched"):
                continue
            tried[name] = tried.get(name, 0) + 1
            if not g.ok:
                defects.append(f"{task_id}: {name} paid ({g.reason[:200]})")
    assert defects == []
    assert set(tried) == set(NAMES)
    assert tried["always_equal"] >= len(STORE) and tried["returns_input"] >= len(STORE)
    assert tried["lying_comparisons"] >= 2 and tried["c_level_copies"] >= 1
    # In-env grading serves the hidden tests from memory, placeholders in the tree: reading
    # them from the files is no longer possible there either (docs/sandbox.md).
    [swe] = SWE
    assert graded[swe.task_id]["reads_hidden_tests"].must == "fail"
    assert graded[swe.task_id]["reads_hidden_tests"].score == 0.0
    assert graded[swe.task_id]["forged_report"].cheated is True
