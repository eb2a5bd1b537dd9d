"""Canaries under a repository's own collection rules (sandbox/canaries.py,
sandbox/test_selection.py): a repository whose pytest config sets ``python_functions``
to something other than ``test`` (in a ``pytest.toml``, a native ``[tool.pytest]`` table,
a config in a subfolder that pytest picks, ``-o`` in ``addopts``, a ``*_suffix`` glob).

Before: the grader's test selection read only the root ``pytest.ini``/``tox.ini``/
``setup.cfg``/``pyproject.toml [tool.pytest.ini_options]``, so in those cases it planted
canaries named ``test_*`` that the run never collected, and an honest gold patch was
refused as tampering. Now the selection reads the config pytest reads (the inifile the
run pins) and names canaries after the pattern their original matches, so they are
collected and still catch tampering (an object equal to everything earns the floor).
Live grader, in-env, host root, all gradings at once."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from sandbox.client import SandboxClient
from sandbox.config import RewardConfig, SandboxConfig
from schemas import Reward
from tasks.images.examples import unified_diff
from tasks.store import TaskStore
from tasks.swe import parse_row
from tests.sandbox_helpers import live_sandbox

pytestmark = pytest.mark.slow

BUGGY = {"calc/__init__.py": "def add(a, b):\n    return a - b\n"}
FIXED = {"calc/__init__.py": "def add(a, b):\n    return a + b\n"}
ALWAYS_EQUAL = ("class Answer(int):\n    def __eq__(self, other):\n        return True\n"
                "    def __ne__(self, other):\n        return False\n    __hash__ = int.__hash__\n\n"
                "def add(a, b):\n    return Answer(0)\n")


def _tests(prefix: str, suffix: str) -> str:
    name = lambda stem: f"{prefix}{stem}{suffix}"  # noqa: E731
    return (f"from calc import add\n\n\ndef {name('add')}():\n    assert add(2, 3) == 5\n\n\n"
            f"def {name('add_negative')}():\n    assert add(-1, -1) == -2\n\n\n"
            f"def {name('order')}():\n    assert add(1, 2) < 4\n\n\n"
            f"def test_not_collected():\n    assert False\n")


# name -> (config files, test name prefix, suffix)
REPOS = {
    "toml": ({"pytest.toml": '[pytest]\npython_functions = ["check_*"]\n'}, "check_", ""),
    "native-pyproject": ({"pyproject.toml": '[tool.pytest]\npython_functions = ["check_*"]\n'}, "check_", ""),
    "subfolder": ({"tests/pytest.ini": "[pytest]\npython_functions = check_*\n"}, "check_", ""),
    "addopts": ({"pytest.ini": "[pytest]\naddopts = -o python_functions=check_*\n"}, "check_", ""),
    "root-ini": ({"pytest.ini": "[pytest]\npython_functions = check_*\n"}, "check_", ""),
    "suffix-glob": ({"setup.cfg": "[tool:pytest]\npython_functions = *_check\n"}, "", "_check"),
}


def _row(name: str) -> dict:
    configs, prefix, suffix = REPOS[name]
    ids = [f"tests/test_calc.py::{prefix}{stem}{suffix}" for stem in ("add", "add_negative", "order")]
    return {"instance_id": f"rules-{name}", "problem_statement": "add(a, b) subtracts; make it add.",
            "files": {**BUGGY, **configs}, "patch": unified_diff(BUGGY, FIXED),
            "test_patch": unified_diff({}, {"tests/test_calc.py": _tests(prefix, suffix)}),
            "FAIL_TO_PASS": ids[:2], "PASS_TO_PASS": ids[2:]}


SPECS = {name: parse_row(_row(name), task_set="rules") for name in REPOS}
SOLUTIONS = {"gold": FIXED["calc/__init__.py"], "untouched": None, "always-equal": ALWAYS_EQUAL}
JOBS = [(name, kind) for name in REPOS for kind in SOLUTIONS]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def graded(tmp_path_factory) -> dict[tuple[str, str], Reward]:
    store = TaskStore(tmp_path_factory.mktemp("rules-tasks"))
    for spec in SPECS.values():
        store.add(spec)
    cfg = SandboxConfig(max_sessions=len(JOBS), max_concurrent_commands=4, command_queue_timeout_s=600.0,
                        workspace_root=str(tmp_path_factory.mktemp("rules-ws")), grading_timeout_s=120.0)
    async with live_sandbox(cfg, RewardConfig(), store) as live, SandboxClient(live.url, timeout_s=600.0) as client:

        async def grade(name: str, kind: str) -> Reward:
            sid = await client.create_session(SPECS[name].task_id)
            if SOLUTIONS[kind] is not None:
                await client.write_file(sid, "calc/__init__.py", SOLUTIONS[kind])
            return await client.submit(sid, trajectory_id=f"{name}-{kind}")

        rewards = await asyncio.gather(*(grade(*job) for job in JOBS))
        return dict(zip(JOBS, rewards))


@pytest.mark.parametrize("name", list(REPOS))
def test_an_honest_gold_patch_is_paid_under_the_repositorys_own_rules(graded, name):
    reward = graded[(name, "gold")]
    assert (reward.score, reward.cheated, reward.reason) == (1.0, False, ""), reward.reason
    assert reward.tests_passed == reward.tests_total == 3


@pytest.mark.parametrize("name", list(REPOS))
def test_the_untouched_repository_is_not_paid(graded, name):
    reward = graded[(name, "untouched")]
    assert (reward.score, reward.cheated) == (0.0, False), reward.reason
    assert (reward.tests_passed, reward.tests_total) == (1, 3)


@pytest.mark.parametrize("name", list(REPOS))
def test_the_canaries_run_and_catch_an_object_equal_to_everything(graded, name):
    reward = graded[(name, "always-equal")]
    assert (reward.score, reward.cheated) == (0.0, True), reward.reason
    assert "tampering with the hidden test run: a copy of" in reward.reason, reward.reason
