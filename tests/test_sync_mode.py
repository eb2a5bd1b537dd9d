"""Synchronous RL mode (``sampler.sync_groups_per_version``) on a real broker: a
replica with free task slots starts one group per weight version and the next only
after a newer version is loaded, so every group's tokens come from one version. The
timing engine and timing sandbox stand in for the model and the sandbox (no waits)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bus import EventProducer
from bus.reader import read_topic
from sampler.config import SamplerConfig, TimingConfig
from sampler.service import SamplerService
from sampler.timing_engine import TimingEngine
from sampler.tiny_model import tiny_model_dir
from sandbox.timing import TimingSandbox, TimingSandboxConfig
from schemas import Task, TrajectoryChunk
from syncer.config import SyncerConfig
from tests.waiting import wait_until_async

pytestmark = [pytest.mark.kafka]

GROUP_SIZE = 2


async def no_wait(_seconds: float) -> None:
    await asyncio.sleep(0)


async def test_sync_mode_starts_one_group_per_version(kafka_config):
    scfg = SamplerConfig(engine="timing", model_path=str(tiny_model_dir()), group_id=f"{kafka_config.topic_prefix}s",
                         max_tasks_in_flight=3, max_in_flight=6, max_turns=2, follow_weights=False,
                         sync_groups_per_version=1, sync_refill_after_s=3600.0,
                         timing=TimingConfig(median_tokens=16, length_sigma=0.0, submit_probability=1.0))
    engine = await TimingEngine(scfg.model_path, scfg.timing, sleep=no_wait).start()
    async with EventProducer(kafka_config) as producer:
        await producer.publish_many([Task(task_id=f"t{i}", group_id=f"t{i}/g", group_size=GROUP_SIZE,
                                          instruction="x") for i in range(4)])
        sandbox = TimingSandbox(TimingSandboxConfig(), producer, sleep=no_wait)
        service = SamplerService(scfg, engine, kafka=kafka_config, syncer=SyncerConfig(), model_name="m",
                                 replica_id="r0", sandbox=sandbox)
        run = asyncio.create_task(service.run(install_signals=False))
        gate = service.sync_gate
        try:
            for version in range(3):
                # The group of this version is done and the next task waits at the gate.
                await wait_until_async(lambda: service.tasks_done == version + 1 and gate._lock.locked(),
                                       60, f"group {version} done, the next one waiting", task=run)
                assert gate.started == 1 and gate.version == version and service.in_flight == 0
                await engine.apply_weights({}, version + 1)
            await wait_until_async(lambda: service.tasks_done == 4, 60, "the fourth group, with version 3",
                                   task=run)
        finally:
            service.request_stop()
            await asyncio.wait_for(run, 60)
    assert service.tasks_done == 4 and gate.refills == 0
    chunks = [e.event for e in await read_topic(kafka_config, "trajectories")
              if isinstance(e.event, TrajectoryChunk)]
    versions: dict[str, set[int]] = {}
    for chunk in chunks:
        generated = chunk.version_array()[chunk.loss_mask_array().astype(bool)]
        versions.setdefault(chunk.task_id, set()).update(np.unique(generated).tolist())
    # Each group sampled with exactly one version, one group per version: staleness 0.
    # (Which task got which version depends on the order the partitions are read in.)
    assert sorted(versions) == ["t0", "t1", "t2", "t3"]
    assert all(len(s) == 1 for s in versions.values())
    assert sorted(next(iter(s)) for s in versions.values()) == [0, 1, 2, 3]
