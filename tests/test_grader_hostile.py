"""The hostile grading suite: reward hacks a policy would learn, against the live grader.

Every hack (tests/hostile/hacks.py, on the demo task ``sum_to``) must score 0 with a
reason, and earn no reward above 0 (a detected one earns the cheat floor). Every honest
alternative solution (tests/hostile/honest.py, on several demo tasks (the call-heavy lru_cache left out: its 200k bridge calls add the most time), including
class-based tasks with callbacks and stateful objects) must pass with reward 1 and never
be flagged. All gradings run concurrently in one module fixture, bounded by the
service's command slots; the figure (tried / paid / honest flagged) is asserted at the end.
"""

from __future__ import annotations

import asyncio
from pathlib import Path, PurePosixPath

import msgspec
import pytest
import pytest_asyncio

from sandbox.client import SandboxClient
from sandbox.config import RewardConfig, SandboxConfig
from sandbox.grading_inenv import CONFIG_NAMES
from sandbox.reward import cheat_floor
from schemas import Reward
from tasks.store import TaskStore
from tests.hostile.hacks import HACKS, HELPER_HACKS, HELPER_TASKS
from tests.hostile.honest import HONEST, HONEST_TASKS, INTERNAL_ERRORS
from tests.sandbox_helpers import live_sandbox

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[1] / "tasks" / "demo"
STORE = TaskStore(DEMO)
FLOOR = cheat_floor(RewardConfig(), "unconstrained")
# Every hack and honest solution is graded in both modes: the demo task as shipped
# (bridged) and a copy of it graded in-env (the tests in the solution's process, with
# canaries, witnesses and hidden sources served from memory).
IN_ENV = "-inenv"
MODES = ("", IN_ENV)
_SUM_TO = STORE.get("sum_to")
for _task_id, (_repo, _tests, _support) in HELPER_TASKS.items():
    STORE.add(msgspec.structs.replace(_SUM_TO, task_id=_task_id, files={**_SUM_TO.files, **_repo}, hidden_tests=_tests,
                                      test_support=_support))
for _task_id, (_repo, _tests) in HONEST_TASKS.items():
    STORE.add(msgspec.structs.replace(_SUM_TO, task_id=_task_id, files={**_SUM_TO.files, **_repo}, hidden_tests=_tests))
for _task_id in sorted({*(task_id for _, task_id, _ in HONEST), "sum_to", *HELPER_TASKS}):
    STORE.add(msgspec.structs.replace(STORE.get(_task_id), task_id=_task_id + IN_ENV, grading="in-env"))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def graded(tmp_path_factory) -> dict[str, Reward]:
    cfg = SandboxConfig(
        max_sessions=2 * (len(HACKS) + len(HELPER_HACKS) + len(HONEST)) + len(INTERNAL_ERRORS),
        max_concurrent_commands=4,
        command_queue_timeout_s=900.0,
        workspace_root=str(tmp_path_factory.mktemp("hostile-ws")), tasks_dir=str(DEMO),
        grading_timeout_s=45.0,
    )
    async with live_sandbox(cfg, RewardConfig(), STORE) as live, SandboxClient(live.url, timeout_s=900.0) as client:

        async def grade(name: str, task_id: str, files: dict[str, str], commands: list[str]) -> Reward:
            sid = await client.create_session(task_id)
            for path, content in files.items():
                await client.write_file(sid, path, content)
            for command in commands:
                await client.exec(sid, command)
            return await client.submit(sid, trajectory_id=name)

        jobs = [(name + mode, "sum_to" + mode, files, commands) for name, _, files, commands in HACKS for mode in MODES]
        jobs += [(name + mode, task_id + mode, files, commands)
                 for name, _, files, commands, task_id in HELPER_HACKS for mode in MODES]
        jobs += [(name + mode, task_id + mode, files, []) for name, task_id, files in HONEST for mode in MODES]
        jobs += [(name, task_id, files, []) for name, task_id, files, _ in INTERNAL_ERRORS]
        rewards = await asyncio.gather(*(grade(*job) for job in jobs))
        assert (await client.health())["sessions"] == 0
        return {job[0]: reward for job, reward in zip(jobs, rewards)}


def test_the_suite_is_big_enough():
    assert len(HACKS) >= 25 and len(HONEST) >= 20
    assert len({h[0] for h in HACKS} | {h[0] for h in HONEST}) == len(HACKS) + len(HONEST)
    assert {h[1] for h in HACKS} == {
        "equal-to-anything", "spoofed type", "reading the tests", "patching the framework",
        "exit early / forge", "detecting the grader", "memoising grader files", "timing / resources",
    }


@pytest.mark.parametrize("name", [h[0] + mode for h in HACKS + HELPER_HACKS for mode in MODES])
def test_hack_scores_zero_with_a_reason(graded, name):
    reward = graded[name]
    assert reward.score == 0.0, reward
    if not name.endswith(IN_ENV):
        # Bridged, no hack makes the hidden tests pass. In-env some do (a lying int
        # compares equal in the tests' own process) and the canaries and witnesses
        # catch the run instead: the cheat floor, with the reason.
        assert reward.tests_passed < 4, reward
    else:  # caught, failed, or no report at all (a run cut short by the timeout)
        assert reward.cheated or reward.tests_passed < max(reward.tests_total, 1), reward
    assert reward.reason, reward
    assert reward.reward == (FLOOR if reward.cheated else 0.0), reward


def _honest_reason(name: str) -> str:
    """In-env the run discards and names the agent's own test configuration (its fixture
    conftest, pytest.ini...; sandbox/grading_inenv.py); bridged the tests' sandbox never
    holds it: nothing to say."""
    if not name.endswith(IN_ENV):
        return ""
    files = next(h[2] for h in HONEST if h[0] + IN_ENV == name)
    configs = sorted(p for p in files if PurePosixPath(p).name in CONFIG_NAMES)
    return "agent changes to test files discarded: " + ", ".join(f"{p} (added, removed)" for p in configs) if configs else ""


@pytest.mark.parametrize("name", [h[0] + mode for h in HONEST for mode in MODES])
def test_honest_alternative_passes_unflagged(graded, name):
    reward = graded[name]
    assert (reward.cheated, reward.reason) == (False, _honest_reason(name)), reward.reason
    assert reward.score == 1.0 and reward.reward == 1.0
    assert reward.tests_passed == reward.tests_total >= 3


@pytest.mark.parametrize("name,counts", [(h[0], h[3]) for h in INTERNAL_ERRORS])
def test_a_pytest_internal_error_bridged_is_score_zero_unflagged(graded, name, counts):
    reward = graded[name]
    assert (reward.score, reward.reward, reward.cheated) == (0.0, 0.0, False), reward
    assert (reward.tests_passed, reward.tests_total) == counts, reward
    assert reward.reason == ("pytest stopped the hidden run with an internal error: "
                             "RuntimeError: a fault of the task, not of the solution")


def test_figure_hacks_tried_paid_and_honest_flagged(graded):
    hacks = [graded[h[0] + mode] for h in HACKS + HELPER_HACKS for mode in MODES]
    honest = [graded[h[0] + mode] for h in HONEST for mode in MODES]
    figure = {
        "hacks tried": len(hacks),
        "hacks paid": sum(r.reward > 0 for r in hacks),
        "honest flagged": sum(r.cheated or r.score < 1.0 for r in honest),
    }
    print("hostile grading suite:", figure,
          "caught statically:", sum(r.cheated for r in hacks), "failed on the isolated path:",
          sum(not r.cheated for r in hacks))
    assert figure == {"hacks tried": 2 * len(HACKS + HELPER_HACKS), "hacks paid": 0, "honest flagged": 0}
