"""VLLMEngine.record's edges, with the fake scheduler of test_vllm_step_versions in place
of vLLM so each runs on CPU in milliseconds: a caller cancelled while its request is
being added, an engine that fails mid-record, and calls record does not take. Recording
itself against real vLLM: tests/test_engine_vllm.py."""

from __future__ import annotations

import asyncio

import pytest

from sampler.engine import EngineClosed
from sampler.recorder import TrajectoryIdentity, TrajectoryRecorder
from sampler.sampling import SamplingParams
from tests.test_vllm_step_versions import FakeScheduler, FakeSchedulerEngine
from tests.waiting import wait_until_async


def _recorder() -> TrajectoryRecorder:
    async def publish(chunk):
        return None

    ident = TrajectoryIdentity(trajectory_id="t/g/0/a", task_id="t", group_id="g", sample_index=0, group_size=1,
                               attempt="a")
    return TrajectoryRecorder(ident, publish, chunk_tokens=1000)


@pytest.fixture
async def fake():
    scheduler = FakeScheduler(async_scheduling=False)
    engine = await FakeSchedulerEngine(scheduler).start()
    yield scheduler, engine
    await engine.close()


@pytest.mark.parametrize("call", ["record", "generate"])
@pytest.mark.parametrize("held_prompt", [False, True])
async def test_a_caller_cancelled_while_its_request_is_added_leaves_nothing_running(fake, call, held_prompt):
    """The add is queued on the step thread when the caller goes: it still runs, and the
    abort queued behind it ends it; a recorder with nothing held (the fast path records
    straight away) records nothing more."""
    scheduler, engine = fake
    rec = _recorder()
    await rec.add_env([1, 2, 3], 0)
    scheduler.allow(2)
    generated, _ = await engine.record(rec, SamplingParams(temperature=0.0, max_tokens=2))  # a first turn
    assert generated == [100, 100] and rec.generated_tokens == 2
    if held_prompt:
        await rec.add_env([4], 0)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    if call == "record":
        task = asyncio.create_task(engine.record(rec, params))
    else:
        task = asyncio.create_task(anext(aiter(engine.generate([1, 2, 3], params, request_id="gone"))))
    await asyncio.sleep(0)  # the task queued its add and waits for it
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    scheduler.allow(30)
    await engine.pause()  # commands run in order: the add and the abort behind it are done
    assert scheduler.left == {} and engine.tokens_generated == 2
    await engine.resume()
    assert rec.generated_tokens == 2


async def test_an_engine_failing_mid_record_raises_in_the_caller_with_every_token_before_recorded(fake):
    scheduler, engine = fake
    real_step, steps = scheduler.step, []

    def step():
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("kernel fault")
        return real_step()

    scheduler.step = step
    rec = _recorder()
    await rec.add_env([1, 2, 3], 0)
    scheduler.allow(10)
    with pytest.raises(RuntimeError, match="kernel fault"):
        await engine.record(rec, SamplingParams(temperature=0.0, max_tokens=8))
    assert rec.generated_tokens == 3 and rec.segment_tokens == [1, 2, 3, 100, 100, 100]
    await wait_until_async(lambda: engine._closed, 10, "the engine closed after its step thread failed")
    with pytest.raises(EngineClosed):
        await engine.record(rec, SamplingParams(temperature=0.0, max_tokens=2))


async def test_record_takes_one_completion_per_call(fake):
    _, engine = fake
    with pytest.raises(ValueError, match="n=2"):
        await engine.record(_recorder(), SamplingParams(temperature=0.0, max_tokens=2, n=2))
