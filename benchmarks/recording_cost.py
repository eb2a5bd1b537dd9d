"""Recording cost without a model: CPU microseconds per generated token of the sampler's
recording path, from one decoding step's sampler output to encoded ``TrajectoryChunk``
bytes, at batch 32 / 256 / 1024 (issue #29).

    .venv/bin/python benchmarks/recording_cost.py [--batch 32 256 1024] [--tokens 200000] [--repeat 3]

A synthetic step stream stands in for vLLM: every step, each of ``batch`` slots
samples one token, with the processed log-probs of its top ``cap + 1`` (cap 64) as
``KeptSetTap`` captures them from vLLM's sampler. Kept-set sizes are a mix (per token:
45% 1 id, 25% 2-8, 15% 9-32, 10% 33-64, 5% more than the cap: capped, 64 ids plus the
sampled one). Each slot runs rollouts: 1-4 turns, each turn 64-512 environment tokens
(prompt / tool output, ``add_env``) then a 64-1024-token completion, then the final chunk
and a fresh rollout in the slot. Everything after the sampler is the real code: the
tap's ordering (``StepKeptSets.from_top``), the recorder (``TrajectoryRecorder``: held
environment tokens, chunking at 256 tokens / 512 KiB, version spans, the final chunk)
and the bus's encoder (``bus.codec.encode``, the bytes a producer would send; the sink
counts them and sends nothing).

Rows (all in one run, interleaved per repeat; CPU time by ``time.process_time``, the
median of ``--repeat`` runs):

* ``tap ordering``: ``StepKeptSets.from_top`` alone (the step thread's numpy pass over
  the step's [batch, cap + 1] top log-probs; the same in both paths, not counted in them);
* ``per-token (before #29)``: the path before issue #29: per token the step's kept set
  is looked up (``StepKeptSets.kept_set``), a ``SampledToken`` built and appended with
  ``add_sampled_now`` (the awaited ``add_sampled`` where it needs to publish), into the
  recorder as it was then (``benchmarks/recording_baseline.py``, a frozen copy);
* ``SampledToken -> #29 recorder``: the same ``SampledToken``s into today's recorder
  (the path of engines that stream a ``SampledToken`` per token: TorchEngine, the
  timing engine, ``Engine.record`` over ``generate``);
* ``arrays (#29)``: the step's arrays built once (``StepKeptSets.tokens``: CSR kept sets
  in numpy), each row handed to the recorder as a ``StepRow`` and copied into its
  array buffers (``add_sampled_now``, else ``add_sampled``): ``VLLMEngine.record``'s path.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import recording_baseline  # noqa: E402
from benchmarks.harness import cpu_name, load_average, print_aligned  # noqa: E402
from bus.codec import encode  # noqa: E402
from sampler import recorder as recorder_module  # noqa: E402
from sampler.engine import SampledToken  # noqa: E402
from sampler.recorder import TrajectoryRecorder  # noqa: E402
from sampler.vllm_kept_sets import StepKeptSets  # noqa: E402
from schemas import Cost  # noqa: E402

CAP = 64
VOCAB = 151_936  # Qwen2.5's: kept ids span the real range
# (probability, smallest, largest) kept-set size; sizes above the cap are capped.
SIZE_MIX = [(0.45, 1, 1), (0.25, 2, 8), (0.15, 9, 32), (0.10, 33, 64), (0.05, 65, 200)]
DISTINCT_STEPS = 16  # synthetic steps per batch size, cycled
MIN_STEPS = 400  # per run: most slots cross a chunk or turn boundary (mean completion 544)


@dataclass
class TapInput:
    """What ``KeptSetTap`` hands ``StepKeptSets.from_top`` for one step."""

    rows: dict[str, int]
    sampled: np.ndarray
    sampled_logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def kept_sizes(rng: np.random.Generator, n: int) -> np.ndarray:
    probs = np.array([p for p, _, _ in SIZE_MIX])
    kind = rng.choice(len(SIZE_MIX), size=n, p=probs / probs.sum())
    lo = np.array([a for _, a, _ in SIZE_MIX])[kind]
    hi = np.array([b for _, _, b in SIZE_MIX])[kind]
    return rng.integers(lo, hi + 1)


def synthetic_step(rng: np.random.Generator, batch: int, keys: list[str]) -> TapInput:
    k = CAP + 1
    sizes = kept_sizes(rng, batch)
    top_ids = rng.integers(0, VOCAB, size=(batch, k), dtype=np.int64)
    # Distinct ids per row (a row of the top-k never repeats an id).
    top_ids = (top_ids + np.arange(k) * (VOCAB // k)) % VOCAB
    top_lps = np.sort(rng.standard_normal((batch, k)).astype(np.float32) - 3.0, axis=1)[:, ::-1].copy()
    top_lps[np.arange(k)[None, :] >= sizes[:, None]] = -np.inf  # outside top-k/top-p: -inf
    # Sampled: most often the most likely, else another finite entry of the top.
    finite = np.minimum(sizes, k)
    pick = np.where(rng.random(batch) < 0.7, 0, (rng.random(batch) * finite).astype(np.int64))
    sampled = top_ids[np.arange(batch), pick]
    sampled_lps = top_lps[np.arange(batch), pick]
    order = rng.permuted(np.tile(np.arange(k), (batch, 1)), axis=1)  # topk(sorted=False)
    rows_ix = np.arange(batch)[:, None]
    return TapInput({key: r for r, key in enumerate(keys)}, sampled, sampled_lps,
                    top_ids[rows_ix, order].astype(np.int32), top_lps[rows_ix, order])


def from_top(tap: TapInput) -> StepKeptSets:
    return StepKeptSets.from_top(tap.rows, tap.sampled, tap.sampled_logprobs, tap.top_ids, tap.top_logprobs,
                                 CAP, VOCAB)


class Sink:
    """The bus's encoder, nothing sent: counts chunks and their encoded bytes."""

    def __init__(self) -> None:
        self.chunks = 0
        self.bytes = 0

    async def publish(self, chunk) -> None:
        value, headers = encode(chunk)
        self.chunks += 1
        self.bytes += len(value) + sum(len(k) + len(v) for k, v in headers)
        return None


class Slot:
    """One batch row's rollouts: turns of environment tokens then a completion."""

    def __init__(self, index: int, rng: np.random.Generator, path: "Path_", sink: Sink) -> None:
        self.index, self.rng, self.path, self.sink = index, rng, path, sink
        self.serial = 0
        self.rec = None
        self.turns_left = 0
        self.left = 0  # tokens of the current completion still to sample

    async def next_turn(self, version: int) -> None:
        """Before this step's token: start a rollout / a turn where the last one ended."""
        if self.left > 0:
            return
        if self.rec is not None and self.turns_left == 0:
            await self.rec.finish("stop", Cost(generated_tokens=self.rec.generated_tokens,
                                               env_tokens=self.rec.env_tokens))
            self.rec = None
        if self.rec is None:
            self.serial += 1
            self.rec = self.path.recorder(f"t{self.index}-{self.serial}", self.sink)
            self.turns_left = int(self.rng.integers(1, 5))
        env = self.rng.integers(0, VOCAB, size=int(self.rng.integers(64, 513))).tolist()
        await self.rec.add_env(env, version)
        self.left = int(self.rng.integers(64, 1025))
        self.turns_left -= 1


class Path_:
    name = ""

    def recorder(self, trajectory_id: str, sink: Sink): ...

    async def step(self, kept: StepKeptSets, keys: list[str], slots: list[Slot], version: int) -> None: ...


def _identity(module, trajectory_id: str):
    return module.TrajectoryIdentity(trajectory_id=trajectory_id, task_id="task", group_id="g", sample_index=0,
                                     group_size=8, attempt="a0", replica_id="r0", temperature=1.0, top_p=0.95)


class PerToken(Path_):
    """Before #29: a SampledToken per token (as VLLMEngine._dispatch built them) into
    the recorder as it was (``add_sampled_now``, else the awaited ``add_sampled``)."""

    name = "per-token (before #29)"

    def recorder(self, trajectory_id: str, sink: Sink):
        return recording_baseline.TrajectoryRecorder(_identity(recording_baseline, trajectory_id), sink.publish)

    async def step(self, kept: StepKeptSets, keys: list[str], slots: list[Slot], version: int) -> None:
        for r, slot in enumerate(slots):
            lp, ks = kept.kept_set(keys[r], kept.sampled[r])
            token = SampledToken(0, int(kept.sampled[r]), lp, ks.ids, ks.capped, version,
                                 kept_logprobs=ks.logprobs, kept_size=ks.size)
            if not slot.rec.add_sampled_now(token):
                await slot.rec.add_sampled(token)
            slot.left -= 1


class Arrays(Path_):
    """Issue #29: the step's arrays (``StepKeptSets.tokens``: CSR kept sets, built once
    per step in numpy), a ``StepRow`` per token handed to ``add_sampled_now`` (else the
    awaited ``add_sampled``), which copies the row into the recorder's array buffers;
    what ``VLLMEngine.record`` does."""

    name = "arrays (#29)"

    def recorder(self, trajectory_id: str, sink: Sink):
        return TrajectoryRecorder(_identity(recorder_module, trajectory_id), sink.publish)

    async def step(self, kept: StepKeptSets, keys: list[str], slots: list[Slot], version: int) -> None:
        kept._tokens = None  # a fresh step: its arrays are built again (cycled synthetic steps)
        sampled = kept.sampled
        for r, slot in enumerate(slots):
            row = kept.row(keys[r], sampled[r], version)
            if not slot.rec.add_sampled_now(row):
                await slot.rec.add_sampled(row)
            slot.left -= 1


class Tokens(PerToken):
    """The per-token engine loop (a ``SampledToken`` each, as TorchEngine, the timing
    engine and ``generate`` streams hand them out) into the recorder of #29."""

    name = "SampledToken -> #29 recorder"

    def recorder(self, trajectory_id: str, sink: Sink):
        return TrajectoryRecorder(_identity(recorder_module, trajectory_id), sink.publish)


PATHS: list[type[Path_]] = [PerToken, Tokens, Arrays]


async def run_path(path: Path_, batch: int, tokens: int, seed: int) -> tuple[float, int, Sink]:
    """CPU seconds to record ``tokens`` generated tokens (rounded up to whole steps) and
    the tokens recorded."""
    rng = np.random.default_rng(seed)
    keys = [f"{i}-req" for i in range(batch)]
    steps_in = [synthetic_step(rng, batch, keys) for _ in range(DISTINCT_STEPS)]
    kept_steps = [from_top(s) for s in steps_in]  # the tap's pass is timed on its own
    sink = Sink()
    slots = [Slot(i, np.random.default_rng(seed * 7919 + i), path, sink) for i in range(batch)]
    # Stationary from the first timed step: every slot is in a rollout, at a random
    # point of its completion (untimed), so turns start at the steady-state rate.
    for slot in slots:
        await slot.next_turn(0)
        await slot.rec.flush()  # the setup's environment tokens are not timed
        slot.left = int(slot.rng.integers(1, slot.left + 1))
    steps = max(-(-tokens // batch), MIN_STEPS)
    t0 = time.process_time()
    for s in range(steps):
        version = s // 200  # a weight update every 200 steps: spans change mid-chunk
        for slot in slots:
            if slot.left <= 0:  # (the agent loop's work between turns, not per token)
                await slot.next_turn(version)
        await path.step(kept_steps[s % DISTINCT_STEPS], keys, slots, version)
    cpu = time.process_time() - t0
    return cpu, steps * batch, sink


def time_tap(batch: int, tokens: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    keys = [f"{i}-req" for i in range(batch)]
    steps_in = [synthetic_step(rng, batch, keys) for _ in range(DISTINCT_STEPS)]
    steps = max(-(-tokens // batch), MIN_STEPS)
    t0 = time.process_time()
    for s in range(steps):
        from_top(steps_in[s % DISTINCT_STEPS])
    return (time.process_time() - t0) / (steps * batch)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--tokens", type=int, default=200_000, help="generated tokens per row and repeat (at least %d steps)" % MIN_STEPS)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    print(f"CPU: {cpu_name()}; load average before: {load_average()}")
    mean_size = float(np.mean(np.minimum(kept_sizes(np.random.default_rng(1), 100_000), CAP + 1)))
    print(f"kept-set mix {SIZE_MIX} (cap {CAP}): {mean_size:.1f} ids per sampled token on average")
    paths = [cls() for cls in PATHS]
    results: dict[tuple[str, int], list[float]] = {}
    info: dict[tuple[str, int], tuple[int, int]] = {}
    for batch in args.batch:
        for rep in range(args.repeat):
            results.setdefault(("tap ordering", batch), []).append(time_tap(batch, args.tokens, args.seed + rep))
            for path in paths:
                cpu, n, sink = asyncio.run(run_path(path, batch, args.tokens, args.seed + rep))
                results.setdefault((path.name, batch), []).append(cpu / n)
                info[(path.name, batch)] = (sink.chunks, sink.bytes)
    names = ["tap ordering", *[p.name for p in paths]]
    header = ["batch", *[f"{n} us/token" for n in names]]
    rows = []
    for batch in args.batch:
        rows.append([batch, *[f"{statistics.median(results[(n, batch)]) * 1e6:.2f}" for n in names]])
    print_aligned(header, rows)
    for (name, batch), (chunks, nbytes) in sorted(info.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"  {name} batch {batch}: {chunks} chunks, {nbytes / max(chunks, 1) / 1024:.1f} KiB each (last repeat)")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
