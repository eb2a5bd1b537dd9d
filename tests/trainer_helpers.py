"""Shared by the trainer tests: import the fixtures into a test module to use them."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two OpenMP threads contend badly
    (steps 20x slower), and bit-exact comparisons need a fixed thread count anyway."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


async def publish_trajectories(cfg, trajectories, *, chunk_tokens: int = 12, **kw) -> list[str]:
    """Each trajectory's chunks, then its reward, on the bus; their ids in order. ``kw``
    goes to ``to_events`` (e.g. ``score``)."""
    from bus import EventProducer
    from tests.synthetic import to_events

    ids = []
    async with EventProducer(cfg) as producer:
        for traj in trajectories:
            chunks, reward = to_events(traj, chunk_tokens=chunk_tokens, **kw)
            for chunk in chunks:
                await producer.publish(chunk)
            await producer.publish(reward)
            ids.append(traj.trajectory_id)
    return ids
