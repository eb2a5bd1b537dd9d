"""Weight versions of VLLMEngine's tokens under a weight update mid-request, with a fake
scheduler in place of vLLM's LLMEngine so it runs on CPU (issue #14 item 6).

The fake "computes" each token as 100 + the weights it holds, so every token says
which weights made it. With synchronous scheduling (step() returns the batch it
launched) the label is always right. With async scheduling, vLLM's GPU default, step()
returns the batch launched one step earlier: an update between two steps labels a
token of v with v+1, so the engine refuses such an engine at start."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from sampler.engine import SampledToken
from sampler.sampling import SamplingParams
from sampler.vllm_engine import EngineConfigError, VLLMEngine, require_sync_scheduling


class FakeScheduler:
    """A stand-in for vLLM's LLMEngine: one token per request per step, made with the
    weights held at launch; ``async_scheduling`` returns each batch one step late."""

    def __init__(self, async_scheduling: bool) -> None:
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
        self.renderer = SimpleNamespace(render_cmpl=lambda prompts: prompts)
        self.weights = 0
        self.left: dict[str, int] = {}
        self.in_flight: list = []
        self.permits = 0  # steps the test allows; the step thread idles (runs commands) at 0
        self.lock = threading.Lock()

    def allow(self, steps: int) -> None:
        with self.lock:
            self.permits += steps

    def add_request(self, request_id, prompt, params) -> None:
        self.left[request_id] = params.max_tokens

    def has_unfinished_requests(self) -> bool:
        with self.lock:
            return self.permits > 0 and bool(self.left or self.in_flight)

    def step(self) -> list:
        with self.lock:
            self.permits -= 1
        batch = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            if done:
                del self.left[rid]
            batch.append(SimpleNamespace(request_id=rid, finished=done, outputs=[SimpleNamespace(
                index=0, token_ids=[100 + self.weights], finish_reason="length" if done else None,
                stop_reason=None, routed_experts=None)]))
        if self.vllm_config.scheduler_config.async_scheduling:
            batch, self.in_flight = self.in_flight, batch
        return batch

    def set_weight_version(self, version: str) -> None:
        self.weights = int(version)  # the update lands between two steps, like apply_model's

    def apply_model(self, fn):
        return [{"mode": "fake"}]

    def reset_prefix_cache(self) -> None:
        pass

    def abort_request(self, ids) -> None:
        for rid in ids:
            self.left.pop(rid, None)

    class engine_core:  # noqa: N801 - the attribute path VLLMEngine shuts down through
        @staticmethod
        def shutdown() -> None:
            pass


class FakeSchedulerEngine(VLLMEngine):
    def __init__(self, scheduler: FakeScheduler, check: bool = True) -> None:
        super().__init__("fake-model", max_model_len=64, apply_mode="direct", record_routed_experts=False)
        self.scheduler = scheduler
        self.check = check

    def _build(self) -> None:
        self._engine = self.scheduler
        self._tokenizer = None
        self.vocab_size = 1000
        self.kept_set_source = "logprobs"
        if self.check:
            require_sync_scheduling(self._engine)


async def labelled_tokens(scheduler: FakeScheduler, engine: VLLMEngine) -> list[tuple[int, int]]:
    """(token, recorded version) of a 6-token request; weights 0 -> 1 after 2 tokens."""
    tokens: list[tuple[int, int]] = []
    stream = engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6))
    scheduler.allow(2 + int(scheduler.vllm_config.scheduler_config.async_scheduling))
    async for event in stream:
        if isinstance(event, SampledToken):
            tokens.append((event.token_id, event.weight_version))
            if len(tokens) == 2:
                await engine.apply_weights({}, 1)
                scheduler.allow(10)
    return tokens


async def test_sync_scheduling_labels_every_token_with_the_weights_that_made_it():
    scheduler = FakeScheduler(async_scheduling=False)
    engine = await FakeSchedulerEngine(scheduler).start()
    try:
        tokens = await asyncio.wait_for(labelled_tokens(scheduler, engine), 60)
    finally:
        await engine.close()
    assert tokens == [(100, 0), (100, 0), (101, 1), (101, 1), (101, 1), (101, 1)]


async def test_async_scheduling_is_refused_because_it_mislabels():
    with pytest.raises(EngineConfigError, match="vLLM async scheduling is on"):
        await FakeSchedulerEngine(FakeScheduler(async_scheduling=True)).start()
    # What the check prevents: the batch in flight when the update lands was made by
    # weights 0 and comes back after it, labelled 1.
    scheduler = FakeScheduler(async_scheduling=True)
    engine = await FakeSchedulerEngine(scheduler, check=False).start()
    try:
        tokens = await asyncio.wait_for(labelled_tokens(scheduler, engine), 60)
    finally:
        await engine.close()
    assert tokens == [(100, 0), (100, 0), (100, 1), (101, 1), (101, 1), (101, 1)]
