"""``TorchEngine``: a plain PyTorch sampler over the Hugging Face model.

The reference for parity tests and the fallback where vLLM is missing. Kept sets are
exact (every token with a finite processed log-prob, never capped): the distribution
is computed by :func:`sampler.sampling.processed_logprobs` with vLLM's top-k/top-p
rules. Decoding runs on one worker thread, one step at a time: concurrent requests
interleave at step granularity, and pause/apply_weights wait for the running step, so
each token's weight version is exact. No batching across requests: this is a
reference, not a server.

MoE models: the experts each router picked are recorded (``record_routed_experts``) by
the producer convention of docs/contracts.md ("Routing"): a sampled token carries the
routes of the position that produced it, and a sample's first token also carries the
prefill's routes of the prompt positions (``prompt_routed_experts``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator

import structlog

from sampler.engine import EngineClosed, EngineEvent, InProcessEngine, SampleDone, SampledToken
from sampler.sampling import KeptSet, SamplingParams, kept_set_from_row, processed_logprobs

if TYPE_CHECKING:
    import torch

    from sampler.config import SamplerConfig

log = structlog.get_logger(__name__)


class TorchEngine(InProcessEngine):
    kept_set_source = "exact"
    kept_set_cap = None
    accepts_partial_updates = True  # tensors left out keep their values

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_model_len: int = 1024,
        dtype: str = "bfloat16",
        seed: int = 0,
        weight_version: int = 0,
        kept_set_cap: int | None = None,
        record_routed_experts: bool = True,
    ) -> None:
        super().__init__(model_path, max_model_len=max_model_len, dtype=dtype, seed=seed,
                         weight_version=weight_version)
        # None: record every kept set whole. A cap records the ``cap`` most likely ids
        # (plus the sampled token) and the set's exact size, flagged capped.
        self.kept_set_cap = kept_set_cap
        self.record_routed_experts = record_routed_experts  # False after loading a dense model
        self._routes = None  # sampler.routes.RouteCapture of an MoE model
        self.model = None
        self._eos_ids: set[int] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine")
        self._running = asyncio.Event()
        self._running.set()
        self._aborted: set[str] = set()
        self._active: set[str] = set()
        self._seed_counter = 0

    @classmethod
    def from_config(cls, cfg: "SamplerConfig", weight_version: int = 0) -> "TorchEngine":
        return cls(cfg.model_path, max_model_len=cfg.max_model_len, dtype=cfg.dtype, seed=cfg.seed,
                   weight_version=weight_version, record_routed_experts=cfg.record_routed_experts)

    async def start(self) -> "TorchEngine":
        if self.model is None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._load)
        return self

    async def __aenter__(self) -> "TorchEngine":
        return await self.start()

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, self.dtype))
        self.model.eval()
        from sampler.routes import RouteCapture, moe_routers

        self.record_routed_experts = self.record_routed_experts and bool(moe_routers(self.model))
        if self.record_routed_experts:
            self._routes = RouteCapture(self.model)
        self.vocab_size = self.model.config.vocab_size
        eos = self.model.config.eos_token_id
        self._eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self._tokenizer.eos_token_id is not None:
            self._eos_ids.add(self._tokenizer.eos_token_id)
        log.info("torch engine ready", model=self.model_path, dtype=self.dtype, vocab=self.vocab_size)

    async def close(self) -> None:
        self._closed = True
        self._running.set()
        self._executor.shutdown(wait=True)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- generation ----------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[EngineEvent]:
        import torch

        request_id = self._open_request(prompt_ids, params, request_id, started=self.model is not None)
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already running")
        self._active.add(request_id)
        n = params.n
        if params.seed is not None:
            seed = params.seed
        else:
            self._seed_counter += 1
            seed = self.seed * 1_000_003 + self._seed_counter
        gen = torch.Generator().manual_seed(seed)
        tokens = [0] * n
        done: dict[int, str] = {}
        texts = [""] * n
        completions: list[list[int]] = [[] for _ in range(n)]
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self._eos_ids
        state = {"cache": None, "next": torch.tensor([list(prompt_ids)] * n), "length": len(prompt_ids)}
        try:
            while len(done) < n:
                if request_id in self._aborted:
                    for i in range(n):
                        if i not in done:
                            done[i] = "abort"
                            yield SampleDone(i, "abort", tokens[i])
                    return
                await self._running.wait()
                if self._closed:
                    raise EngineClosed("engine closed")
                version = self._version
                prefill = state["cache"] is None
                sampled, lps, kept, routes = await self._run(self._step, state, params, gen)
                self.steps += 1
                state["length"] += 1
                for i in range(n):
                    if i in done:
                        continue
                    tok = int(sampled[i])
                    tokens[i] += 1
                    completions[i].append(tok)
                    self.tokens_generated += 1
                    token = SampledToken(i, tok, float(lps[i]), kept[i].ids, kept[i].capped, version,
                                         kept_logprobs=kept[i].logprobs, kept_size=kept[i].size)
                    if routes is not None:
                        # The step's last position produced this token; the prefill's
                        # other positions are the prompt's (rows of prompt tokens 1..P-1).
                        token.routed_experts = routes[i, -1]
                        if prefill:
                            token.prompt_routed_experts = routes[i, :-1]
                    yield token
                    reason = stop_reason = None
                    if tok in stop_ids:
                        reason, stop_reason = "stop", (tok if tok in params.stop_token_ids else None)
                    elif params.stop:
                        texts[i] = self._tokenizer.decode(completions[i], skip_special_tokens=False)
                        hit = next((s for s in params.stop if s in texts[i]), None)
                        if hit is not None:
                            reason, stop_reason = "stop", hit
                    if reason is None and (tokens[i] >= params.max_tokens or state["length"] >= self._max_model_len):
                        reason = "length"
                    if reason is not None:
                        done[i] = reason
                        yield SampleDone(i, reason, tokens[i], stop_reason)
        finally:
            self._active.discard(request_id)
            self._aborted.discard(request_id)

    def _step(self, state: dict, params: SamplingParams, gen: "torch.Generator"):
        import torch

        with torch.no_grad():
            out = self.model(input_ids=state["next"], past_key_values=state["cache"], use_cache=True)
        routes = self._routes.take(*state["next"].shape) if self._routes is not None else None
        state["cache"] = out.past_key_values
        logits = out.logits[:, -1, :].float()
        lp = processed_logprobs(logits, params)
        if params.greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(-1)
        state["next"] = sampled.unsqueeze(-1)
        kept = [kept_set_from_row(lp[i], self.kept_set_cap, int(sampled[i])) for i in range(lp.shape[0])]
        chosen = lp.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
        return sampled.tolist(), chosen.tolist(), kept, routes

    async def abort(self, request_id: str) -> None:
        if request_id in self._active:
            self._aborted.add(request_id)

    # -- scoring (teacher forcing) ---------------------------------------------------------
    async def score(
        self, prompt_ids: list[int], completion_ids: list[int], params: SamplingParams
    ) -> list[tuple[float, KeptSet]]:
        """Behaviour log-prob and exact kept set of each given completion token."""
        return await self._run(self._score, list(prompt_ids), list(completion_ids), params)

    def _score(self, prompt_ids: list[int], completion_ids: list[int], params: SamplingParams):
        import torch

        ids = torch.tensor([prompt_ids + completion_ids])
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0].float()
        if self._routes is not None:
            self._routes.take(*ids.shape)  # scoring records nothing
        rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(completion_ids)]
        lp = processed_logprobs(rows, params)
        out = []
        for i, tok in enumerate(completion_ids):
            out.append((float(lp[i, tok]), kept_set_from_row(lp[i])))
        return out

    # -- pause, resume, weights ---------------------------------------------------------------
    async def pause(self) -> None:
        self._running.clear()
        await self._run(lambda: None)  # the step in progress (if any) has finished

    async def resume(self) -> None:
        self._running.set()

    async def apply_weights(self, tensors: dict[str, "torch.Tensor"], version: int) -> float:
        from syncer.apply import apply_to_module

        async def load() -> None:
            await self._run(apply_to_module, self.model, tensors)

        return await self._apply_paused(load, version, len(tensors))

