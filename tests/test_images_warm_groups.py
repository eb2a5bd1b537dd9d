"""Warm image trees sized to the GRPO group (issue #26, sandbox.images.warm_follow_demand).

A GRPO group opens G sessions of one image at once; a floor of 2 warm trees left G - 2 of
them cold. The pool now keeps as many trees of an image ready as sessions of it were open
together recently, within the free slots of max_sessions, and drops the extra trees once
the groups stop. Live service, real overlay trees and prestarted bwrap sandboxes on the
example image (built once per machine by tests/image_helpers.py). Cheap: ~20 trees and
sandboxes in all, a few seconds here.
"""

from __future__ import annotations

import asyncio
import json
import shutil

from sandbox.client import SandboxClient
from sandbox.config import ImageConfig, SandboxConfig
from sandbox.runner import uid_pids
from tasks.store import TaskStore
from tests.image_helpers import REPO, example_images
from tests.sandbox_helpers import live_sandbox
from tests.waiting import wait_until_async

G = 4
CAPACITY = 10
FLOOR = 2


async def test_warm_trees_follow_the_group_size_within_max_sessions_and_shrink_back(tmp_path):
    images = example_images()
    examples = REPO / "tasks/images/examples.jsonl"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(examples, tasks / "examples.jsonl")
    task = json.loads(examples.read_text().splitlines()[0])["instance_id"]
    # A long group window and demand life: nothing here may depend on this machine's speed.
    cfg = SandboxConfig(max_sessions=CAPACITY, workspace_root=str(tmp_path / "ws"), tasks_dir=str(tasks),
                        images=ImageConfig(cache_dir=images.cache_dir, warm_sessions_per_image=FLOOR,
                                           warm_group_window_s=60.0, warm_demand_ttl_s=600.0))
    async with live_sandbox(cfg, store=TaskStore(tasks)) as live, SandboxClient(live.url) as client:
        pool = live.service.pool
        seen = []  # sessions + warm trees at every poll: never more than max_sessions

        def warm_is(n: int):
            seen.append(len(pool) + pool.warm)
            return pool.warm == n

        async def group() -> list[str]:
            return list(await asyncio.gather(*(client.create_session(task) for _ in range(G))))

        # The image's first group: the pool learns its size and makes G trees for the next.
        first = await group()
        await wait_until_async(lambda: warm_is(G), 60, f"{G} warm trees after a group of {G}")
        key = (pool.get(first[0]).root.digest, pool.get(first[0]).workdir)
        assert pool.warm_target(key) == G
        for sid in first:
            await client.close_session(sid)

        # The next group of the image: every session opens on a tree made ahead.
        second = await group()
        assert [pool.get(s).warm for s in second] == [True] * G
        results = await asyncio.gather(*(client.exec(s, "ls namekit") for s in second))
        assert [(r.exit_code, r.stdout) for r in results] == [(0, "__init__.py\n")] * G
        await wait_until_async(lambda: warm_is(G), 60, f"{G} warm trees again")

        # A second group while the first runs: 2G sessions together, but only
        # CAPACITY - 2G slots are free: the warm trees stop there.
        third = await group()
        assert [pool.get(s).warm for s in third] == [True] * G
        assert pool.warm_target(key) == 2 * G
        await wait_until_async(lambda: warm_is(CAPACITY - 2 * G), 60, "the free slots filled with warm trees")
        for sid in second + third:
            await client.close_session(sid)

        # A lone session while the demand of 2G is recent: the refill makes 2G trees.
        lone = await client.create_session(task)
        await wait_until_async(lambda: warm_is(2 * G), 60, f"{2 * G} warm trees")
        assert pool.warm_target(key) == 2 * G
        await client.close_session(lone)

        # The groups stop: once the demand is older than warm_demand_ttl_s, the service's
        # trim drops the trees above the floor (the life shortened here instead of waited).
        pool.demand_ttl_s = 0.01
        await wait_until_async(lambda: warm_is(FLOOR), 30, f"the warm trees back to the floor of {FLOOR}")
        assert pool.warm_target(key) == FLOOR
        assert max(seen) == CAPACITY  # reached (third group), never passed
        uids = {live.service.cfg.uid_base + i for i in range(CAPACITY)}
    assert {uid: uid_pids(uid) for uid in uids} == {uid: [] for uid in uids}
    assert list((tmp_path / "ws").iterdir()) == []
