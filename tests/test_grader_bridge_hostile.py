"""The bridge as a capability boundary, end to end: the live grader (real bubblewrap, real
HTTP) grades the hacks and honest solutions of tests/hostile/bridge.py on the task
``probe``, whose hidden tests hand the solution generators, iterators, callbacks, a test
class and its instances, exceptions and tmp_path files. Every hack scores 0; every honest
solution (numpy, paths, big ints, generators, recursion, builtin subclasses) is paid.
All gradings run concurrently in one module fixture.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio

from sandbox.client import SandboxClient
from sandbox.config import RewardConfig, SandboxConfig
from sandbox.reward import cheat_floor
from schemas import Reward
from tasks.store import TaskStore
from tests.hostile.bridge import BRIDGE_HACKS, BRIDGE_HONEST
from tests.sandbox_helpers import live_sandbox

pytestmark = pytest.mark.slow

TASKS = Path(__file__).resolve().parent / "hostile" / "bridge_tasks"
STORE = TaskStore(TASKS)
FLOOR = cheat_floor(RewardConfig(), "unconstrained")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def graded(tmp_path_factory) -> dict[str, Reward]:
    jobs = [(name, files) for name, _, files in BRIDGE_HACKS]
    jobs += [(name, files if files is not None else STORE.get("probe").solution) for name, _, files in BRIDGE_HONEST]
    cfg = SandboxConfig(
        max_sessions=len(jobs), max_concurrent_commands=4, command_queue_timeout_s=900.0,
        workspace_root=str(tmp_path_factory.mktemp("bridge-hostile-ws")), tasks_dir=str(TASKS),
        grading_timeout_s=60.0,
    )
    async with live_sandbox(cfg, RewardConfig(), STORE) as live, SandboxClient(live.url, timeout_s=900.0) as client:

        async def grade(name: str, files: dict[str, str]) -> Reward:
            sid = await client.create_session("probe")
            for path, content in files.items():
                await client.write_file(sid, path, content)
            return await client.submit(sid, trajectory_id=name)

        rewards = await asyncio.gather(*(grade(*job) for job in jobs))
        return {job[0]: reward for job, reward in zip(jobs, rewards)}


@pytest.mark.parametrize("name", [h[0] for h in BRIDGE_HACKS])
def test_hack_scores_zero(graded, name):
    reward = graded[name]
    assert reward.score == 0.0 and reward.reward <= 0.0, reward
    if name != "getsource_decoy_file":
        # No escape reached the tests' process: only the source check (no eval) passes;
        # an escape that worked makes test_depth pass too (tests/hostile/bridge.py).
        assert reward.tests_passed <= 1, reward
    else:
        assert "test_no_eval_in_the_source" in reward.reason, reward
    assert reward.reason, reward
    assert reward.reward == (FLOOR if reward.cheated else 0.0), reward


@pytest.mark.parametrize("name", [h[0] for h in BRIDGE_HONEST])
def test_honest_solution_paid(graded, name):
    reward = graded[name]
    assert (reward.cheated, reward.reason) == (False, ""), reward.reason
    assert reward.score == 1.0 and reward.reward == 1.0
    assert reward.tests_passed == reward.tests_total >= 10


def test_figure(graded):
    hacks = [graded[h[0]] for h in BRIDGE_HACKS]
    honest = [graded[h[0]] for h in BRIDGE_HONEST]
    figure = {"hacks tried": len(hacks), "hacks paid": sum(r.reward > 0 for r in hacks),
              "honest refused": sum(r.cheated or r.score < 1.0 for r in honest)}
    print("bridge boundary:", figure)
    assert figure == {"hacks tried": len(BRIDGE_HACKS), "hacks paid": 0, "honest refused": 0}
