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


def _image_tasks(tmp_path, refs: list[str]) -> TaskStore:
    """One task per image (its tree at /testbed), as SWE-Gym has one image per instance."""
    from tasks.spec import TaskSpec

    (tmp_path / "tasks").mkdir()
    store = TaskStore(tmp_path / "tasks")
    for i, ref in enumerate(refs):
        store.add(TaskSpec(task_id=f"img{i}", instruction="-", files={"note.txt": f"{i}\n"},
                           hidden_tests={"test_x.py": ""}, image=ref, workdir="/testbed"))
    return store


async def test_trees_of_images_whose_groups_ended_give_their_slots_back_but_the_last_ones_stay(tmp_path):
    """SWE-Gym-style: every task has its own image, so an image recurs only within its
    GRPO group. Groups of G on five distinct images, one after another: after each group
    closes, the slots free for the next one and the images whose trees are kept. Trees of
    an image whose sessions are all closed stay only for the newest
    ``warm_idle_images`` (2) such images, so the next group finds CAPACITY - 2 * 2 slots,
    not fewer with every image seen. Before, every image's trees kept their slots (the
    target's floor never expires; the group size for warm_demand_ttl_s, 300 s) and held
    their image in the cache: the free slots went 10, 8, 6, 4, 2, and from the fifth
    group on no image got a tree. An image whose group comes back while it is among
    the kept ones finds its trees: all G sessions open warm."""
    from tests.image_helpers import HOSTILE, QUIRKS

    images = example_images()
    refs = [f"rollway.local/examples/{name}:1" for name in ("namekit", "gridfmt", "wordstats")] + [HOSTILE, QUIRKS]
    store = _image_tasks(tmp_path, refs)
    cfg = SandboxConfig(max_sessions=CAPACITY, workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"),
                        images=ImageConfig(cache_dir=images.cache_dir, warm_sessions_per_image=FLOOR,
                                           warm_group_window_s=60.0, warm_demand_ttl_s=600.0))
    G2 = 2
    async with live_sandbox(cfg, store=store) as live, SandboxClient(live.url) as client:
        service, pool = live.service, live.service.pool
        digests = {}

        def settled() -> bool:
            return not service._refilling and not service._releasing

        def holding() -> list[int]:
            """The images (their index) that warm trees are kept for."""
            kept = {key[0] for key, trees in pool._warm.items() if trees}
            return sorted(i for i, d in digests.items() if d in kept)

        accounting = []
        for i in range(len(refs)):
            free = len(pool._free)
            group = list(await asyncio.gather(*(client.create_session(f"img{i}") for _ in range(G2))))
            digests[i] = pool.get(group[0]).root.digest
            await wait_until_async(settled, 60, f"image {i}'s trees made")
            for sid in group:
                await client.close_session(sid)
            await wait_until_async(settled, 60, f"image {i}'s group released")
            held = sorted(i for i, d in digests.items() if d.split(":")[1] in service.images._held)
            accounting.append({"free": free, "trees_of": holding(), "held": held})
        assert accounting == [
            {"free": 10, "trees_of": [0], "held": [0]},
            {"free": 8, "trees_of": [0, 1], "held": [0, 1]},
            {"free": 6, "trees_of": [1, 2], "held": [1, 2]},
            {"free": 6, "trees_of": [2, 3], "held": [2, 3]},
            {"free": 6, "trees_of": [3, 4], "held": [3, 4]},
        ]
        assert len(pool._free) == CAPACITY - 2 * FLOOR
        # The image before last comes back: its group opens on the trees kept for it.
        again = list(await asyncio.gather(*(client.create_session("img3") for _ in range(G2))))
        assert [pool.get(s).warm for s in again] == [True] * G2
        for sid in again:
            await client.close_session(sid)
        uids = {service.cfg.uid_base + i for i in range(CAPACITY)}
    assert {uid: uid_pids(uid) for uid in uids} == {uid: [] for uid in uids}
    assert list((tmp_path / "ws").iterdir()) == []


async def test_an_image_that_needs_cache_room_gets_it_from_trees_of_images_whose_groups_ended(tmp_path):
    """A cache with room for two unpacked images, and sessions of three images one after
    another. The trees kept for an image whose sessions have all closed hold it in the
    cache; the third image needs room: those trees are dropped and the pull retried, so
    the session opens (the least recently used image is evicted). Before, the two
    images' trees held them for good and the third image's session was refused 503,
    'cache full'."""
    images = example_images()
    refs = [f"oci:{images.layout}:{name}" for name in ("namekit", "gridfmt", "wordstats")]
    store = _image_tasks(tmp_path, refs)
    cfg = SandboxConfig(max_sessions=CAPACITY, workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"),
                        images=ImageConfig(cache_dir=str(tmp_path / "cache"), max_cache_bytes=140 * 1024 * 1024,
                                           warm_sessions_per_image=FLOOR))
    async with live_sandbox(cfg, store=store) as live, SandboxClient(live.url) as client:
        service = live.service
        for i in range(len(refs)):
            sid = await client.create_session(f"img{i}")
            result = await client.exec(sid, "cat note.txt")
            assert (result.exit_code, result.stdout) == (0, f"{i}\n")
            await wait_until_async(lambda: not service._refilling, 60, f"image {i}'s trees made")
            await client.close_session(sid)
        assert [i.refs for i in service.images.list()][:1] == [[refs[2]]]
        assert len(service.images.list()) == 2
    assert list((tmp_path / "ws").iterdir()) == []
