"""``rollway tasks check`` (tasks.check.check_hygiene) applies a gold patch's deletions:
a reference solution that deletes a file of the repository is graded on a tree where the
file is gone, for a task whose repository is in its row (host root) and for one whose
repository is only in its image. Before: ``TaskSpec.solution`` could only add or overwrite
files, so such a reference solution failed its own hidden tests."""

from __future__ import annotations

import asyncio

import pytest

from sandbox.config import ImageConfig, SandboxConfig
from tasks.check import check_hygiene
from tasks.images.examples import unified_diff
from tasks.swe import parse_row
from tests.image_helpers import example_images, quirks_row

pytestmark = pytest.mark.slow

BASE = {"shapes/__init__.py": "from shapes.area import square\n",
        "shapes/area.py": "def square(x):\n    return x + x\n",
        "shapes/legacy.py": "from shapes.area import square as sq\n"}
TEST = ("import importlib.util\n\nfrom shapes import square\n\n\n"
        "def test_square():\n    assert square(3) == 9\n\n\n"
        "def test_legacy_is_gone():\n    assert importlib.util.find_spec('shapes.legacy') is None\n")
GOLD = unified_diff(BASE, {"shapes/area.py": "def square(x):\n    return x * x\n"}) + (
    "--- a/shapes/legacy.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-from shapes.area import square as sq\n")
HOST_ROW = {"instance_id": "shapes-1", "problem_statement": "square(x) is wrong; drop shapes.legacy.",
            "files": BASE, "patch": GOLD, "test_patch": unified_diff({}, {"tests/test_shapes.py": TEST}),
            "FAIL_TO_PASS": ["tests/test_shapes.py::test_square", "tests/test_shapes.py::test_legacy_is_gone"]}


def test_a_gold_patchs_deletions_are_parsed():
    spec = parse_row(HOST_ROW, task_set="t")
    assert spec.solution_deletes == ["shapes/legacy.py"] and list(spec.solution) == ["shapes/area.py"]
    # Never sent to samplers.
    assert "solution_deletes" not in repr(spec.to_event("g", 1))


def test_tasks_check_applies_the_reference_solutions_deletions(tmp_path):
    images = example_images()
    host, image = parse_row(HOST_ROW, task_set="t"), parse_row(quirks_row("quirks-check"), task_set="t")
    cfg = SandboxConfig(max_sessions=4, max_concurrent_commands=2, command_queue_timeout_s=600.0,
                        workspace_root=str(tmp_path), grading_timeout_s=120.0,
                        images=ImageConfig(cache_dir=images.cache_dir))
    results = asyncio.run(check_hygiene([host, image], cfg, only=["reference", "untouched"]))
    graded = {(r.task_id, g.solution): g for r in results for g in r.graded}
    for task_id in ("shapes-1", "quirks-check"):
        ref, untouched = graded[(task_id, "reference")], graded[(task_id, "untouched")]
        assert (ref.score, ref.cheated, ref.reason) == (1.0, False, ""), (task_id, ref.reason)
        assert ref.tests_passed == ref.tests_total, task_id
        assert (untouched.score, untouched.cheated) == (0.0, False), (task_id, untouched.reason)
