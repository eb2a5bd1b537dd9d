"""Reward phase per group (issue #14 item 3): a group straddling a phase boundary is
graded in one phase, so identical solves get identical rewards.

The sampler service runs a 2-sample group one rollout at a time on the torch engine;
the weight version moves from 4 to 5 (a phase boundary) between the two rollouts. The
sandbox is a stand-in that scores every rollout 1.0 and prices it with the grader's own
reward function (``sandbox.reward.compute_reward``), with the step the sampler submits.
"""

from __future__ import annotations

import msgspec
import pytest
import pytest_asyncio

from sandbox.client import ExecResult
from sandbox.config import RewardConfig
from sandbox.reward import compute_reward
from schemas import Cost, Reward, Task

# Steps 0-4 unconstrained, 5 on budget; the budget phase charges 0.1 per generated token.
REWARD = RewardConfig(phase_unit="step", phase_cycle=False, length_penalty_per_token=0.1,
                      phase_schedule=[("unconstrained", 5), ("budget", 1000)])
START_VERSION = 4


class SolvingSandbox:
    """Every rollout solves the task (score 1.0); rewards as the grader computes them."""

    def __init__(self) -> None:
        self.submits: list[dict] = []

    async def create_session(self, task_id: str, files: dict[str, str]) -> str:
        return f"s{len(self.submits)}"

    async def exec(self, session: str, command: str, timeout_s: float | None = None) -> ExecResult:
        return ExecResult(exit_code=0, stdout="ok\n", duration_s=0.0)

    async def read_file(self, session: str, path: str) -> str:
        return ""

    async def write_file(self, session: str, path: str, content: str) -> int:
        return len(content)

    async def close_session(self, session: str) -> None:
        return None

    async def submit(self, session: str, *, trajectory_id: str, task_id: str, group_id: str, sample_index: int,
                     attempt: str, cost: Cost, weight_version: int, trainer_step: int = -1) -> Reward:
        self.submits.append(dict(sample_index=sample_index, weight_version=weight_version, trainer_step=trainer_step))
        parts = compute_reward(REWARD, score=1.0, cheated=False, cost=cost, step=trainer_step,
                               weight_version=weight_version)
        return Reward(trajectory_id=trajectory_id, task_id=task_id, group_id=group_id, sample_index=sample_index,
                      attempt=attempt, score=1.0, cost=cost, phase=parts.phase, length_penalty=parts.length_penalty,
                      reward=parts.reward, weight_version=weight_version)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def engine():
    from sampler.torch_engine import TorchEngine
    from tests.sampler_helpers import agent_model_dir

    eng = await TorchEngine(agent_model_dir(), max_model_len=512, weight_version=START_VERSION).start()
    yield eng
    await eng.close()


async def test_identical_solves_straddling_a_phase_boundary_get_identical_rewards(engine):
    from bus.config import KafkaConfig
    from bus import Envelope
    from sampler.agent import AgentLoop
    from sampler.config import SamplerConfig
    from sampler.service import SamplerService
    from syncer.config import SyncerConfig

    # One turn whose tool call is prefilled in full, one generated token: every rollout
    # costs exactly 1 generated token, so the two rewards can differ only by phase.
    cfg = SamplerConfig(engine="torch", model_path="unused", max_model_len=512, max_turns=1,
                        max_tokens_per_turn=1, assistant_prefill="<tool>run\nls</tool>", max_in_flight=1)
    sandbox = SolvingSandbox()
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}

    async def publish(chunk):
        if chunk.final and chunk.sample_index == 0:
            # The trainer publishes step 5 (same tensors) after sample 0 finished and
            # before sample 1 (waiting for the only slot) starts.
            await engine.apply_weights(weights, START_VERSION + 1)

    service = SamplerService(cfg, engine, kafka=KafkaConfig(), syncer=SyncerConfig(), model_name="m", replica_id="r")
    service.agent = AgentLoop(engine, sandbox, cfg, publish, replica_id="r")
    task = Task(task_id="t", group_id="t/g", group_size=2, instruction="Fix it.")
    await service._handle(Envelope(task, "rollway.tasks", 0, 0, 0, b"t", ()))

    assert [s["weight_version"] for s in sandbox.submits] == [4, 5]  # the group straddles the boundary
    assert [s["trainer_step"] for s in sandbox.submits] == [4, 4]  # ... and is graded at its start step
    assert service.rollouts_done == 2
    # What the old rule (phase at each trajectory's newest version) gave the same group:
    old = [compute_reward(REWARD, score=1.0, cheated=False, cost=Cost(generated_tokens=1), step=v,
                          weight_version=v).reward for v in (4, 5)]
    assert old == [1.0, 0.9]
    rewards = [compute_reward(REWARD, score=1.0, cheated=False, cost=Cost(generated_tokens=1), step=s["trainer_step"],
                              weight_version=s["weight_version"]) for s in sandbox.submits]
    assert [(r.phase, r.reward) for r in rewards] == [("unconstrained", 1.0), ("unconstrained", 1.0)]


async def test_a_lone_rollout_is_graded_at_the_version_it_started_with(engine):
    """AgentLoop.run without a group phase step: the version served as the rollout starts."""
    from sampler.agent import AgentLoop
    from sampler.config import SamplerConfig

    cfg = SamplerConfig(engine="torch", model_path="unused", max_model_len=512, max_turns=1,
                        max_tokens_per_turn=1, assistant_prefill="<tool>run\nls</tool>")
    start = engine.weight_version
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}

    class NewWeightsAtSessionStart(SolvingSandbox):
        async def create_session(self, task_id: str, files: dict[str, str]) -> str:
            # After the rollout took its phase step, before its first token (the
            # recorder publishes the prompt's chunks only with the first sampled token,
            # so a chunk callback is too late for this).
            await engine.apply_weights(weights, start + 1)
            return await super().create_session(task_id, files)

    sandbox = NewWeightsAtSessionStart()

    async def publish(chunk):
        return None

    task = Task(task_id="t", group_id="t/g2", group_size=1, instruction="Fix it.")
    result = await AgentLoop(engine, sandbox, msgspec.structs.replace(cfg, chunk_tokens=8), publish).run(task, 0, "a")
    assert sandbox.submits == [dict(sample_index=0, weight_version=start + 1, trainer_step=start)]
    assert result.reward.reward == compute_reward(REWARD, score=1.0, cheated=False, cost=result.cost, step=start,
                                                  weight_version=start + 1).reward
