"""Evaluation: pass@1 of one weight version on a task split, never trained on.

An evaluation runs every task of a split ``samples`` times through the sampler's own
engine and :class:`~sampler.agent.AgentLoop`, graded by the sandbox service's grader,
and sums the outcome up as one :class:`schemas.EvalResult` (published on
``rollway.evals`` by the caller). Two things keep eval rollouts away from training:

* trajectory chunks go to a sink that drops them: nothing reaches ``rollway.trajectories``;
* the sandbox client submits with ``publish_rewards=False``: the grader answers with the
  reward but publishes it nowhere, so neither the trainer nor the feeder sees it.

The sandbox may not know the split's tasks (a held-out split, a user's folder), so the
tasks, hidden tests included, are registered with it first (``POST /tasks``).

Used by ``rollway eval`` (one version) and ``rollway evaluator`` (every N versions,
:mod:`sampler.evaluator`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import structlog

from sampler.agent import AgentLoop
from sandbox.client import SandboxClient, SandboxError
from schemas import EvalResult, RecordRef, TrajectoryChunk
from tasks.spec import TaskSpec

if TYPE_CHECKING:
    from sampler.config import EvalConfig, SamplerConfig
    from sampler.engine import Engine

log = structlog.get_logger(__name__)

FAMILY = "family"
DIR_PREFIX = "dir:"


class EvalError(RuntimeError):
    """An evaluation cannot start (unknown split, missing model or version, no sandbox):
    the message is the one line the user sees."""


class SandboxUnreachable(EvalError):
    """No sandbox service answers (yet): the evaluator waits, ``rollway eval`` gives up."""


# -- what to evaluate ---------------------------------------------------------------------
def split_label(split: str) -> str:
    """The canonical name: "heldout" -> "family:heldout"; "dir:PATH" and "fam:name" as given."""
    split = split.strip()
    if split.startswith(DIR_PREFIX) or ":" in split:
        return split
    return f"{FAMILY}:{split}"


def load_tasks(split: str, *, max_tasks: int, seed: int) -> tuple[str, list[TaskSpec]]:
    """The split's label and its tasks, sorted by id: ``max_tasks`` instances of a family
    split (drawn with ``seed``), or the first ``max_tasks`` of a folder (0 = all)."""
    from tasks.store import TaskStore

    label = split_label(split)
    if label.startswith(DIR_PREFIX):
        source = label[len(DIR_PREFIX):]
    else:
        family = label.partition(":")[0]
        if family != FAMILY:
            raise EvalError(f"unknown task family {family!r} in split {split!r} (use family:train, "
                            "family:heldout or --tasks DIR)")
        if max_tasks < 1:
            raise EvalError("a family split needs max_tasks >= 1 (how many instances to draw)")
        source = label
    try:
        # The same loader the feeder and the grader use (folders, .jsonl, family:<split>).
        store = TaskStore(source, family_count=max(max_tasks, 1), family_seed=seed)
    except (ValueError, OSError) as exc:  # TaskFormatError, FamilyError (unknown split)
        raise EvalError(f"cannot load the tasks of {split!r}: {exc}") from None
    specs = sorted(store, key=lambda s: s.task_id)
    specs = specs[:max_tasks] if max_tasks else specs
    if not specs:
        raise EvalError(f"no tasks in {source} (a task is a folder with task.toml, repo/ and hidden_tests/)")
    return label, specs


def eval_sampler_config(ecfg: "EvalConfig", scfg: "SamplerConfig") -> "SamplerConfig":
    """The sampler's settings ``scfg`` with the evaluation's temperature and seed."""
    temperature = ecfg.temperature if ecfg.temperature >= 0 else scfg.temperature
    return msgspec.structs.replace(scfg, temperature=temperature, seed=ecfg.seed, follow_weights=False)


# -- which weights --------------------------------------------------------------------------
async def resolve_version(store, requested: int | None, *, model_name: str, store_url: str) -> int:
    """``requested`` (None = latest) checked against the store. Version 0 is the base
    model (``sampler.model_path``) and needs no store; latest on an empty store is 0."""
    from syncer import catalog as cat

    if requested == 0:
        return 0
    try:
        catalog = await cat.load_catalog(store, model_name)
    except Exception as exc:  # an unreachable S3 endpoint, a bad URL
        raise EvalError(f"cannot read the weight store {store_url}: {exc}") from None
    if requested is None:
        return max(catalog.latest, 0)
    if requested < 0 or requested not in catalog.kinds:
        known = catalog.versions
        listing = f"stored versions: {known[0]}..{known[-1]} ({len(known)})" if known else "the store is empty"
        raise EvalError(f"{model_name} v{requested} is not in {store_url}; {listing}")
    return requested


# -- outcomes -------------------------------------------------------------------------------
@dataclass
class TaskOutcome:
    task_id: str
    kind: str
    solved: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cheated: int = 0
    errors: int = 0

    @property
    def samples(self) -> int:
        return len(self.solved)

    @property
    def pass_at_1(self) -> float:
        return sum(self.solved) / len(self.solved) if self.solved else 0.0

    def to_json(self) -> dict:
        return {
            "task_id": self.task_id, "kind": self.kind, "samples": self.samples, "solved": sum(self.solved),
            "pass_at_1": self.pass_at_1, "rewards": self.rewards, "generated_tokens": self.tokens,
            "cheated": self.cheated, "errors": self.errors,
        }


@dataclass
class EvalReport:
    result: EvalResult
    tasks: list[TaskOutcome]
    record: RecordRef | None = None  # where the result was published
    publish_error: str = ""

    def to_json(self) -> dict:
        """The ``rollway eval --json`` document."""
        return {
            "result": msgspec.to_builtins(self.result),
            "record": None if self.record is None else {
                "topic": self.record.topic, "partition": self.record.partition, "offset": self.record.offset},
            "tasks": [t.to_json() for t in self.tasks],
        }


def summarize(outcomes: list[TaskOutcome], **fields) -> EvalResult:
    """One EvalResult: pass@1 is the mean over tasks of each task's solved fraction."""
    samples = [(r, n) for t in outcomes for r, n in zip(t.rewards, t.tokens)]
    kinds: dict[str, list[float]] = {}
    for t in outcomes:
        if t.kind:
            kinds.setdefault(t.kind, []).append(t.pass_at_1)
    return EvalResult(
        tasks=len(outcomes),
        pass_at_1=sum(t.pass_at_1 for t in outcomes) / len(outcomes) if outcomes else 0.0,
        mean_reward=sum(r for r, _ in samples) / len(samples) if samples else 0.0,
        mean_generated_tokens=sum(n for _, n in samples) / len(samples) if samples else 0.0,
        cheated=sum(t.cheated for t in outcomes),
        errors=sum(t.errors for t in outcomes),
        per_kind={k: sum(v) / len(v) for k, v in sorted(kinds.items())},
        **fields,
    )


# -- running --------------------------------------------------------------------------------
async def _drop_chunk(chunk: TrajectoryChunk) -> None:
    """Eval trajectories are never published: the trainer cannot train on what it never sees."""
    return None


async def check_sandbox(sandbox: SandboxClient, specs: list[TaskSpec]) -> None:
    """The service answers and can grade every task (registered when it did not know it)."""
    try:
        await sandbox.health()
    except Exception as exc:  # connection refused, timeout, an HTTP error: nothing to grade with
        raise SandboxUnreachable(f"no sandbox service at {sandbox.base_url}: {str(exc) or type(exc).__name__}") from None
    added = 0
    for spec in specs:
        try:
            added += await sandbox.register_task(spec)
        except SandboxError as exc:
            raise EvalError(f"the sandbox at {sandbox.base_url} refused task {spec.task_id!r}: {exc.message}") from None
    log.info("eval tasks registered with the sandbox", tasks=len(specs), new=added)


async def evaluate(
    engine: "Engine",
    sandbox: SandboxClient,
    scfg: "SamplerConfig",
    ecfg: "EvalConfig",
    specs: list[TaskSpec],
    *,
    split: str,
    model: str,
    evaluator: str,
) -> EvalReport:
    """Run ``ecfg.samples`` rollouts of every task at the engine's current weights.

    ``sandbox`` must submit without publishing (``publish_rewards=False``). A rollout
    that fails (sandbox error, engine error) counts as not solved and in ``errors``."""
    if sandbox.publish_rewards:
        raise ValueError("evaluation needs a SandboxClient(publish_rewards=False): eval rewards must not be published")
    version = engine.weight_version
    agent = AgentLoop(engine, sandbox, scfg, _drop_chunk, replica_id=evaluator)
    run_id = f"eval-{evaluator}-v{version}-{uuid.uuid4().hex[:8]}"
    slots = asyncio.Semaphore(ecfg.concurrency)
    # Per sample slots, so results line up with sample indices whatever order they finish in;
    # a failed rollout keeps its zeros (not solved).
    outcomes = [TaskOutcome(s.task_id, s.metadata.get("kind", ""), [False] * ecfg.samples, [0.0] * ecfg.samples,
                            [0] * ecfg.samples) for s in specs]
    logger = log.bind(split=split, weight_version=version, run=run_id)
    logger.info("evaluation started", tasks=len(specs), samples=ecfg.samples, temperature=scfg.temperature)
    t0 = time.perf_counter()

    async def rollout(outcome: TaskOutcome, spec: TaskSpec, index: int) -> None:
        task = spec.to_event(group_id=f"{spec.task_id}/{run_id}", group_size=ecfg.samples)
        async with slots:
            try:
                result = await agent.run(task, index, run_id)
            except Exception as exc:
                logger.error("eval rollout failed", task_id=spec.task_id, sample=index, error=repr(exc))
                outcome.errors += 1
                return
        reward = result.reward
        outcome.solved[index] = not reward.cheated and reward.score >= 1.0
        outcome.rewards[index] = reward.reward
        outcome.tokens[index] = result.cost.generated_tokens
        outcome.cheated += int(reward.cheated)

    async with asyncio.TaskGroup() as group:
        for outcome, spec in zip(outcomes, specs):
            for i in range(ecfg.samples):
                group.create_task(rollout(outcome, spec, i))
    result = summarize(
        outcomes, split=split, weight_version=version, model=model, samples=ecfg.samples, evaluator=evaluator,
        seconds=round(time.perf_counter() - t0, 3), created_at=time.time(), temperature=scfg.temperature,
        seed=ecfg.seed,
    )
    logger.info("evaluation done", pass_at_1=round(result.pass_at_1, 4), mean_reward=round(result.mean_reward, 4),
                errors=result.errors, seconds=result.seconds, per_kind=result.per_kind)
    return EvalReport(result, outcomes)
