"""The timing engine, the timing sandbox and the synchronous-mode gate: exact behaviour,
no clocks (sleeps are replaced by a no-wait one wherever a test would wait)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from sampler.agent import AgentLoop
from sampler.config import SamplerConfig, TimingConfig
from sampler.engine import SampleDone, SampledToken
from sampler.sampling import SamplingParams
from sampler.service import SyncGate, SyncWaitAborted, make_engine
from sampler.timing_engine import RUN_CALL, SUBMIT_CALL, TimingEngine
from sampler.tiny_model import tiny_model_dir
from sandbox.timing import TimingSandbox, TimingSandboxConfig
from schemas import Task
from syncer.config import SyncerConfig

async def no_wait(_seconds: float) -> None:
    await asyncio.sleep(0)


async def started_engine(**timing) -> TimingEngine:
    # The tokenizer only (the timing engine computes nothing): the suite's cached tiny model,
    # which a fresh checkout builds, unlike var/models/tiny.
    engine = TimingEngine(str(tiny_model_dir()), TimingConfig(**timing), max_model_len=1024, sleep=no_wait)
    return await engine.start()


async def collect(engine: TimingEngine, params: SamplingParams, prompt=(5, 6, 7)):
    return [e async for e in engine.generate(list(prompt), params)]


def test_make_engine_builds_the_timing_engine():
    engine = make_engine(SamplerConfig(engine="timing", timing=TimingConfig(tokens_per_s=1000.0)), SyncerConfig())
    assert isinstance(engine, TimingEngine) and engine.timing.tokens_per_s == 1000.0


@pytest.mark.parametrize("field,value", [("tokens_per_s", 0.0), ("step_tokens", 0), ("submit_probability", 1.5),
                                         ("kept_set_size", 0), ("length_sigma", -1.0)])
def test_timing_config_names_a_bad_value(field, value):
    with pytest.raises(ValueError, match=f"sampler.timing.{field}"):
        TimingConfig(**{field: value})


async def test_completion_is_filler_then_the_drawn_call_with_exact_records():
    engine = await started_engine(median_tokens=40, length_sigma=0.0, submit_probability=1.0, kept_set_size=5)
    tok = engine.tokenizer
    events = await collect(engine, SamplingParams(max_tokens=100))
    tokens = [e for e in events if isinstance(e, SampledToken)]
    done = [e for e in events if isinstance(e, SampleDone)]
    ids = [t.token_id for t in tokens]
    assert len(ids) == 40  # sigma 0: exactly the median
    assert tok.decode(ids).endswith(SUBMIT_CALL)
    assert len(done) == 1 and done[0].finish_reason == "stop" and done[0].num_tokens == 40
    assert done[0].stop_reason == tok.encode("</tool>", add_special_tokens=False)[0]
    for t in tokens:
        assert t.kept_ids.dtype == np.int32 and t.kept_ids.size == 5 and t.kept_ids[0] == t.token_id
        assert len(set(t.kept_ids.tolist())) == 5 and t.kept_ids.max() < engine.vocab_size
        assert t.logprob == pytest.approx(-math.log(5)) and t.recorded_kept_size == 5
        assert t.weight_version == 0 and not t.kept_capped
    assert engine.tokens_generated == 40


async def test_run_call_and_a_cut_completion_ends_by_length():
    engine = await started_engine(median_tokens=40, length_sigma=0.0, submit_probability=0.0)
    ids = [e.token_id for e in await collect(engine, SamplingParams(max_tokens=100)) if isinstance(e, SampledToken)]
    assert engine.tokenizer.decode(ids).endswith(RUN_CALL)
    events = await collect(engine, SamplingParams(max_tokens=10))
    assert sum(isinstance(e, SampledToken) for e in events) == 10
    assert events[-1] == SampleDone(0, "length", 10, None)


async def test_tokens_after_a_weight_update_carry_the_new_version():
    engine = await started_engine(median_tokens=32, length_sigma=0.0, step_tokens=8)
    versions = []
    async for event in engine.generate([5, 6], SamplingParams(max_tokens=64)):
        if isinstance(event, SampledToken):
            versions.append(event.weight_version)
            if len(versions) == 8:  # end of the first step
                await engine.apply_weights({}, 7)
    assert versions == [0] * 8 + [7] * 24
    assert engine.weight_version == 7 and engine.updates_applied == 1 and not engine.paused


async def test_n_samples_interleave_and_each_ends_once():
    engine = await started_engine(median_tokens=16, length_sigma=0.0)
    events = await collect(engine, SamplingParams(max_tokens=64, n=3))
    assert [e.sample_index for e in events if isinstance(e, SampleDone)] == [0, 1, 2]
    assert sum(isinstance(e, SampledToken) for e in events) == 48


async def test_abort_ends_open_samples():
    engine = await started_engine(median_tokens=64, length_sigma=0.0, step_tokens=4)
    seen = []
    async for event in engine.generate([5], SamplingParams(max_tokens=64), request_id="r1"):
        seen.append(event)
        if len(seen) == 4:
            await engine.abort("r1")
    assert seen[-1] == SampleDone(0, "abort", 4) and len(seen) == 5


async def test_bad_prompt_is_refused_with_the_reason():
    engine = await started_engine()
    with pytest.raises(ValueError, match="out of range"):
        await collect(engine, SamplingParams(), prompt=(10**6,))


async def test_agent_rollout_on_timing_engine_and_sandbox_records_every_token():
    """The real agent loop and recorder: turns end with run calls (exec) until a submit."""
    engine = await started_engine(median_tokens=20, length_sigma=0.0, submit_probability=0.0)
    cfg = SamplerConfig(engine="timing", max_turns=3, chunk_tokens=16)
    sandbox = TimingSandbox(TimingSandboxConfig(), None, sleep=no_wait)
    chunks = []

    async def publish(chunk):
        chunks.append(chunk)

    agent = AgentLoop(engine, sandbox, cfg, publish, replica_id="r")
    task = Task(task_id="t", group_id="g", group_size=2, instruction="do it")
    result = await agent.run(task, 0, "a1")
    assert result.finish_reason == "budget_turns" and sandbox.execs == 3 and sandbox.graded == 1
    assert result.cost.generated_tokens == 60 and result.reward.score == 1.0
    mask = np.concatenate([c.loss_mask_array() for c in chunks])
    assert int(mask.sum()) == 60 and chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert sandbox.sessions == set()


async def test_timing_sandbox_scores_vary_within_a_group_and_exec_times_out():
    sandbox = TimingSandbox(TimingSandboxConfig(exec_median_s=5.0, exec_sigma=0.0), None, sleep=no_wait)
    scores = [(await sandbox.submit("s", trajectory_id=f"t{i}", sample_index=i)).score for i in range(2)]
    assert scores == [1.0, 0.0]
    result = await sandbox.exec("s", "true", timeout_s=1.0)
    assert result.timed_out and result.exit_code is None
    assert not (await sandbox.exec("s", "true", timeout_s=10.0)).timed_out


class _Versioned:
    weight_version = 0


async def test_sync_gate_starts_per_version_then_waits_for_a_newer_one():
    engine = _Versioned()
    gate = SyncGate(per_version=2, refill_after_s=3600.0)
    assert [await gate.enter(engine), await gate.enter(engine)] == [0, 0]
    third = asyncio.create_task(gate.enter(engine))
    for _ in range(5):
        await asyncio.sleep(SyncGate.POLL_S)
    assert not third.done()  # a third group with version 0 would be sampled stale-free only in async mode
    engine.weight_version = 1
    assert await third == 1 and gate.started == 1 and gate.refills == 0


async def test_sync_gate_refills_a_short_step():
    engine = _Versioned()
    gate = SyncGate(per_version=1, refill_after_s=0.01)
    assert await gate.enter(engine) == 0
    assert await gate.enter(engine) == 0  # no new version came: one more group, same weights
    assert gate.refills == 1


async def test_sync_gate_gives_up_a_waiting_task_when_the_replica_stops():
    engine = _Versioned()
    gate = SyncGate(per_version=1, refill_after_s=3600.0)
    stopping = asyncio.Event()
    assert await gate.enter(engine, stopping) == 0
    waiting = asyncio.create_task(gate.enter(engine, stopping))
    await asyncio.sleep(SyncGate.POLL_S)
    stopping.set()
    with pytest.raises(SyncWaitAborted, match="left unacknowledged"):
        await waiting
    assert gate.started == 1 and gate.refills == 0


def test_sync_mode_needs_enough_task_slots():
    with pytest.raises(ValueError, match="sync_groups_per_version"):
        SamplerConfig(sync_groups_per_version=3, max_tasks_in_flight=2)
