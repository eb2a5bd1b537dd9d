"""Grading in the task's image (sandbox/grading_inenv.py and sandbox/grading_bridged.py
with ``root=``): the example image task set (tasks/images/examples.jsonl, packages that
exist only in the images) through the live grader. In-env (the SWE rows' default): every
gold patch is paid, every untouched repository is not; the same task graded bridged runs
both sandboxes on the image's own Python and pays the gold patch too. The images are
built once per machine (tests/image_helpers.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from sandbox.client import SandboxClient
from sandbox.config import ImageConfig, RewardConfig, SandboxConfig
from schemas import Reward
from tasks.store import TaskStore
from tasks.images.examples import EXAMPLES as EXAMPLE_DEFS
from tasks.images.examples import rows
from tasks.swe import load_swe_jsonl, parse_row
from tests.image_helpers import example_images, quirks_row
from tests.sandbox_helpers import live_sandbox

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = load_swe_jsonl(ROOT / "tasks" / "images" / "examples.jsonl")
BRIDGED = msgspec.structs.replace(EXAMPLES[0], task_id=EXAMPLES[0].task_id + "-bridged", grading="bridged")
# Bridged grading of a solution that deletes a file of the image's repository (README.md):
# the solution's sandbox must hold the agent's tree, so the file is gone there too. The
# hidden test asks the solution's process (through the bridge) whether it sees the file.
BRIDGED_DELETE = msgspec.structs.replace(
    BRIDGED, task_id=EXAMPLES[0].task_id + "-bridged-delete",
    hidden_tests={**BRIDGED.hidden_tests, "tests/test_gone.py": (
        "from probe import readme_gone\n\n\ndef test_readme_is_gone():\n    assert readme_gone() is True\n")},
    test_command=BRIDGED.test_command + " hidden_tests/tests/test_gone.py::test_readme_is_gone")
PROBE = ("import os\n\n\ndef readme_gone():\n"
         "    return not os.path.lexists(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'README.md'))\n")
# The same instance as SWE-Gym ships it: no ``files``, the repository (with its own
# tests/conftest.py fixture) only in the image; its test patch edits a file there.
REPO_IN_IMAGE = parse_row({**{k: v for k, v in rows()[0].items() if k != "files"},
                           "instance_id": EXAMPLES[0].task_id + "-repo-in-image"}, task_set="examples")
GOLD = {REPO_IN_IMAGE.task_id: dict(EXAMPLE_DEFS[0].fixed)}
# A repository with what real images hold and a task's text cannot (tests/image_helpers.py
# QUIRKS): its own links (one absolute), latin-1 Python (a conftest and the plugin its
# config loads), its setup.cfg a link, nested .git/.hg; the gold patch deletes a file.
QUIRKS_TASK = parse_row(quirks_row("quirks-1"), task_set="examples")
GOLD[QUIRKS_TASK.task_id] = {"quirks/core.py": "def double(x):\n    return x * 2\n"}
GOLD[BRIDGED_DELETE.task_id] = {**EXAMPLES[0].solution, "probe.py": PROBE}
# Shell run in the session after the gold files are written ("gold" jobs), and the
# agent's view of the nested version-control entries, kept for a test.
AFTER_GOLD = {QUIRKS_TASK.task_id: "rm quirks/legacy.py && ls -a vendor/thing vendor/other .",
              BRIDGED_DELETE.task_id: "rm README.md"}
ESCAPE = (QUIRKS_TASK.task_id, "escape")  # the gold patch plus a link it added to a host path
# No fix of double; the legacy module removed, and the image's latin-1 test helper (only in
# the image: tests/image_helpers.py QUIRKS) rewritten to check nothing.
HELPER_HACK = (QUIRKS_TASK.task_id, "helper")
NO_CHECK = "def check(got, want):\n    pass\n"
VCS_SEEN: dict[str, str] = {}
JOBS = ([(s.task_id, gold) for s in EXAMPLES for gold in (True, False)] + [(BRIDGED.task_id, True)]
        + [(BRIDGED_DELETE.task_id, True)]
        + [(REPO_IN_IMAGE.task_id, gold) for gold in (True, False)]
        + [(QUIRKS_TASK.task_id, gold) for gold in (True, False)] + [ESCAPE, HELPER_HACK])


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def graded(tmp_path_factory) -> dict[tuple[str, bool], Reward]:
    images = await asyncio.to_thread(example_images)
    store = TaskStore(ROOT / "tasks" / "demo")
    for spec in [*EXAMPLES, BRIDGED, BRIDGED_DELETE, REPO_IN_IMAGE, QUIRKS_TASK]:
        store.add(spec)
    cfg = SandboxConfig(
        max_sessions=len(JOBS), max_concurrent_commands=4, command_queue_timeout_s=600.0,
        workspace_root=str(tmp_path_factory.mktemp("image-grading-ws")), tasks_dir=str(ROOT / "tasks" / "demo"),
        grading_timeout_s=120.0, images=ImageConfig(cache_dir=images.cache_dir),
    )
    async with live_sandbox(cfg, RewardConfig(), store) as live, SandboxClient(live.url, timeout_s=600.0) as client:

        async def grade(task_id: str, gold: bool | str) -> Reward:
            spec = store.get(task_id)
            sid = await client.create_session(task_id)
            if gold == "helper":
                await client.write_file(sid, "testing_quirks.py", NO_CHECK)
                ran = await client.exec(sid, "rm quirks/legacy.py")
                assert ran.exit_code == 0, ran
                return await client.submit(sid, trajectory_id=f"{task_id}-{gold}")
            for path, content in (GOLD.get(task_id, spec.solution) if gold else {}).items():
                await client.write_file(sid, path, content)
            if gold and task_id in AFTER_GOLD:
                command = AFTER_GOLD[task_id] + (" && ln -s /etc/passwd added_link" if gold == "escape" else "")
                ran = await client.exec(sid, command)
                assert ran.exit_code == 0, ran
                if task_id == QUIRKS_TASK.task_id:
                    VCS_SEEN[str(gold)] = ran.stdout
            return await client.submit(sid, trajectory_id=f"{task_id}-{gold}")

        rewards = await asyncio.gather(*(grade(*job) for job in JOBS))
        return dict(zip(JOBS, rewards))


def test_examples_are_image_tasks_graded_in_env():
    assert len(EXAMPLES) >= 3
    assert all(s.image and s.workdir == "/testbed" and s.grading == "in-env" for s in EXAMPLES)


@pytest.mark.parametrize("task_id", [s.task_id for s in EXAMPLES])
def test_gold_patch_is_paid_in_the_image(graded, task_id):
    reward = graded[(task_id, True)]
    assert (reward.score, reward.reward, reward.cheated, reward.reason) == (1.0, 1.0, False, "")
    assert reward.tests_passed == reward.tests_total >= 2


@pytest.mark.parametrize("task_id", [s.task_id for s in EXAMPLES])
def test_untouched_repository_is_not_paid_in_the_image(graded, task_id):
    reward = graded[(task_id, False)]
    assert (reward.score, reward.reward, reward.cheated) == (0.0, 0.0, False), reward.reason
    assert reward.tests_passed < reward.tests_total
    assert "hidden tests did not pass" in reward.reason


def test_bridged_grading_runs_on_the_image_too(graded):
    reward = graded[(BRIDGED.task_id, True)]
    assert (reward.score, reward.reward, reward.cheated, reward.reason) == (1.0, 1.0, False, ""), reward.reason


def test_bridged_grading_redoes_the_agents_deletions_over_the_image(graded):
    """Before: the solution's sandbox was a fresh tree of the image with the agent's files
    written over it, so README.md (deleted by the agent) was back: 2 of 3 passed."""
    reward = graded[(BRIDGED_DELETE.task_id, True)]
    assert (reward.score, reward.cheated, reward.reason) == (1.0, False, ""), reward.reason
    assert reward.tests_passed == reward.tests_total == 3


def test_a_repository_only_in_its_image_is_graded_against_the_image(graded):
    """Before: the test patch could not apply (its base was not in the row), and in-env
    grading dropped the image's own conftest.py as if the agent had added it."""
    assert REPO_IN_IMAGE.needs_image_repo and REPO_IN_IMAGE.files == {}
    gold, untouched = graded[(REPO_IN_IMAGE.task_id, True)], graded[(REPO_IN_IMAGE.task_id, False)]
    assert (gold.score, gold.cheated, gold.reason) == (1.0, False, ""), gold.reason
    assert gold.tests_passed == gold.tests_total == 2
    assert (untouched.score, untouched.cheated) == (0.0, False), untouched.reason
    assert (untouched.tests_passed, untouched.tests_total) == (1, 2)


def test_what_the_image_holds_is_not_taken_for_the_agents_doing(graded):
    """Before: the image's absolute link was "symlink out of the workspace", the latin-1
    plugin's hook a planted "pytest hook", the latin-1 conftest an added config (removed),
    the linked setup.cfg not found (an empty inifile pinned, its ``-p`` plugin lost), the
    deleted legacy module back from the image, the nested .git/.hg in the task's files."""
    gold, untouched = graded[(QUIRKS_TASK.task_id, True)], graded[(QUIRKS_TASK.task_id, False)]
    assert (gold.score, gold.cheated, gold.reason) == (1.0, False, ""), gold.reason
    assert gold.tests_passed == gold.tests_total == 3
    assert (untouched.score, untouched.cheated) == (0.0, False), untouched.reason
    assert (untouched.tests_passed, untouched.tests_total) == (1, 3)


def test_a_link_the_agent_adds_out_of_the_workspace_is_still_refused(graded):
    reward = graded[ESCAPE]
    assert (reward.score, reward.cheated) == (0.0, True)
    assert reward.reason == "symlink out of the workspace: added_link -> /etc/passwd"


def test_nested_version_control_entries_never_reach_the_session(graded):
    listing = VCS_SEEN["True"].split()
    assert ".git" not in listing and ".hg" not in listing and "thing.py" in listing and "other.py" in listing
    assert "setup.cfg" in listing and "vendor_python" in listing


def test_an_image_only_test_helper_the_agent_rewrote_is_not_what_runs(graded):
    """The hidden test checks double through the image's latin-1 testing_quirks.check
    (in no task text: the repository is only in the image). Before: the agent's copy,
    which checks nothing, ran, and the unfixed double was paid 1.0."""
    reward = graded[HELPER_HACK]
    assert (reward.score, reward.cheated) == (0.0, False), reward.reason
    assert (reward.tests_passed, reward.tests_total) == (2, 3), reward.reason
    assert reward.reason.endswith("agent changes to test files discarded: testing_quirks.py (changed, restored)")
