"""Bridged grading of an image task whose test configuration exists only in the image
(tests/image_helpers.py QUIRKS: a latin-1 ``tests/conftest.py``, a ``setup.cfg`` that is a
link, and the latin-1 plugin module its ``addopts = -p quirks.plugin`` loads; none of them
in the task's text). The tests' sandbox must run the hidden tests with the image's own
configuration, byte-exact from the image (sandbox/grading_inenv.py ``image_configs``):
the gold patch is paid, the untouched repository is not. Built images: tests/image_helpers.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio

from sandbox.client import SandboxClient
from sandbox.config import ImageConfig, RewardConfig, SandboxConfig
from schemas import Reward
from tasks.store import TaskStore
from tasks.swe import parse_row
from tests.image_helpers import example_images, quirks_row
from tests.sandbox_helpers import live_sandbox

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# (The row says ``grading``: an image-only row is made whole from its image by re-reading it.)
TASK = parse_row({**quirks_row("quirks-bridged"), "grading": "bridged"}, task_set="examples")
GOLD = {"quirks/core.py": "def double(x):\n    return x * 2\n"}
# The agent's own version of the image's plugin (no fixture left): the tests must load the
# image's (the bridge would otherwise import the solution's copy of ``quirks.plugin``).
AGENT_PLUGIN = "# Mine now.\nFACTOR = 2\n"
# No fix of double, the legacy module removed, and the image's latin-1 test helper
# (tests/image_helpers.py QUIRKS) rewritten to check nothing.
NO_CHECK = "def check(got, want):\n    pass\n"
JOBS = ("gold", "untouched", "gold-agent-plugin", "helper-hack")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def graded(tmp_path_factory) -> dict[str, Reward]:
    images = await asyncio.to_thread(example_images)
    store = TaskStore(ROOT / "tasks" / "demo")
    store.add(TASK)
    cfg = SandboxConfig(
        max_sessions=len(JOBS), max_concurrent_commands=2, command_queue_timeout_s=600.0,
        workspace_root=str(tmp_path_factory.mktemp("image-bridged-ws")), tasks_dir=str(ROOT / "tasks" / "demo"),
        grading_timeout_s=120.0, images=ImageConfig(cache_dir=images.cache_dir),
    )
    async with live_sandbox(cfg, RewardConfig(), store) as live, SandboxClient(live.url, timeout_s=600.0) as client:

        async def grade(job: str) -> Reward:
            sid = await client.create_session(TASK.task_id)
            if job.startswith("gold"):
                for path, content in GOLD.items():
                    await client.write_file(sid, path, content)
                ran = await client.exec(sid, "rm quirks/legacy.py")
                assert ran.exit_code == 0, ran
            if job == "gold-agent-plugin":
                await client.write_file(sid, "quirks/plugin.py", AGENT_PLUGIN)
            if job == "helper-hack":
                await client.write_file(sid, "testing_quirks.py", NO_CHECK)
                ran = await client.exec(sid, "rm quirks/legacy.py")
                assert ran.exit_code == 0, ran
            return await client.submit(sid, trajectory_id=f"{TASK.task_id}-{job}")

        return dict(zip(JOBS, await asyncio.gather(*(grade(job) for job in JOBS))))


def test_gold_patch_is_paid_bridged_with_the_images_own_test_configuration(graded):
    """Before: the tests' sandbox had neither the image's conftest nor its linked
    setup.cfg and plugin, so the fixtures ``factor`` and ``offset`` were not found."""
    reward = graded["gold"]
    assert (reward.score, reward.cheated, reward.reason) == (1.0, False, ""), reward.reason
    assert reward.tests_passed == reward.tests_total == 3


def test_untouched_repository_is_not_paid_bridged(graded):
    reward = graded["untouched"]
    assert (reward.score, reward.cheated) == (0.0, False), reward.reason
    assert (reward.tests_passed, reward.tests_total) == (1, 3), reward.reason


def test_the_tests_load_the_images_plugin_not_the_agents(graded):
    """The agent's quirks/plugin.py has no ``factor`` fixture; the image's has."""
    reward = graded["gold-agent-plugin"]
    assert (reward.score, reward.cheated) == (1.0, False), reward.reason
    assert reward.tests_passed == reward.tests_total == 3


def test_the_tests_assert_through_the_images_helper_not_the_agents(graded):
    """The hidden test checks double through the image's latin-1 testing_quirks.check
    (in no task text). Before: the tests imported the solution's copy (the agent's, which
    checks nothing) across the bridge, and the unfixed double was paid 1.0."""
    reward = graded["helper-hack"]
    assert (reward.score, reward.cheated) == (0.0, False), reward.reason
    assert (reward.tests_passed, reward.tests_total) == (2, 3), reward.reason
