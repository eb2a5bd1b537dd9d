"""Helpers for tests and benchmarks of the sampler (and of components that need one);
they live under tests/, not in the installed ``sampler`` package.

* :func:`agent_model_dir`: the tiny model trained longer (150 steps instead of 40):
  its distributions are peaked enough that vLLM's and PyTorch's bf16 kept sets agree
  on >= 99% of positions, and it reliably writes ``<tool>...</tool>`` calls and
  ``<summary>`` answers. Built once (about 20 s of CPU) and cached like
  :func:`sampler.tiny_model.tiny_model_dir`.
* :func:`start_test_engine`: a started :class:`VLLMEngine` with the test settings.
  Close it when the module is done: vLLM allows one live in-process engine per
  process (closing any engine tears down process-global state under the others).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sampler.tiny_model import tiny_model_dir

if TYPE_CHECKING:
    from sampler.vllm_engine import VLLMEngine

AGENT_MODEL_TRAIN_STEPS = 150
TEST_ENGINE_SETTINGS = {"max_model_len": 512, "kept_set_cap": 64}


def agent_model_dir() -> Path:
    return tiny_model_dir(train_steps=AGENT_MODEL_TRAIN_STEPS)


async def start_test_engine(model_path: str | Path | None = None, **settings) -> "VLLMEngine":
    from sampler.vllm_engine import VLLMEngine

    return await VLLMEngine(str(model_path or agent_model_dir()), **{**TEST_ENGINE_SETTINGS, **settings}).start()


async def read_topic(kafka_cfg, topic: str, until, timeout_s: float = 60.0) -> list:
    """Events of ``topic`` (all partitions, from the start) until ``until(events)`` is
    true; raises TimeoutError with what was read when it never is."""
    import asyncio
    import time

    from bus import EventConsumer

    events: list = []
    deadline = time.monotonic() + timeout_s
    async with EventConsumer(kafka_cfg, [topic], group_id=None, dead_letters=False) as consumer:
        while not until(events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: condition not met after {timeout_s}s ({len(events)} events read)")
            events.extend(env.event for env in await consumer.getmany(timeout_ms=200))
            await asyncio.sleep(0)
    return events


async def read_all(kafka_cfg, topic: str, timeout_s: float = 60.0) -> list:
    """Every event of ``topic`` up to its end offsets at the time of the call."""
    import asyncio
    import time

    from bus import EventConsumer

    events: list = []
    deadline = time.monotonic() + timeout_s
    async with EventConsumer(kafka_cfg, [topic], group_id=None, dead_letters=False) as consumer:
        raw = consumer.raw
        while not raw.assignment():
            events.extend(env.event for env in await consumer.getmany(timeout_ms=100))
        ends = await raw.end_offsets(list(raw.assignment()))
        while True:
            positions = {tp: await raw.position(tp) for tp in ends}
            if all(positions[tp] >= end for tp, end in ends.items()):
                return events
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: not at the end offsets after {timeout_s}s")
            events.extend(env.event for env in await consumer.getmany(timeout_ms=200))
            await asyncio.sleep(0)
