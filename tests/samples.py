"""One fully populated example of every event type, with fixed values (golden tests,
round trips, tail tests)."""

from __future__ import annotations

import numpy as np

from schemas import (
    Cost,
    DeadLetter,
    EvalResult,
    GroupDrop,
    GroupsDropped,
    GroupRef,
    Heartbeat,
    Metrics,
    RecordRef,
    Reward,
    Task,
    TrainedTrajectory,
    TrainStep,
    TrajectoryChunk,
    WeightVersion,
    arrays,
)

T0 = 1_700_000_000.5


def sample_chunk(n: int = 4, trajectory_id: str = "task-1/g0/s0/a1", final: bool = True) -> TrajectoryChunk:
    tokens = np.arange(10, 10 + n, dtype=np.int32)
    kept = [[10 + i, 99] if i % 2 == 0 else [10 + i] for i in range(n)]
    offsets, ids = arrays.pack_csr(kept)
    starts, versions = arrays.pack_spans([3] * (n // 2) + [4] * (n - n // 2))
    return TrajectoryChunk(
        trajectory_id=trajectory_id,
        task_id="task-1",
        group_id="task-1/g0",
        sample_index=0,
        group_size=4,
        attempt="a1",
        replica_id="sampler-0",
        chunk_index=0,
        segment_index=0,
        token_ids=arrays.pack(tokens, arrays.INT32),
        logprobs=arrays.pack([-0.5 if i % 2 == 0 else 0.0 for i in range(n)], arrays.FLOAT32),
        loss_mask=arrays.pack([1] * n, arrays.UINT8),
        kept_offsets=offsets,
        kept_ids=ids,
        kept_capped=arrays.pack([0] * n, arrays.UINT8),
        version_starts=starts,
        versions=versions,
        temperature=1.0,
        top_p=0.95,
        top_k=-1,
        final=final,
        finish_reason="submitted" if final else "",
        cost=Cost(generated_tokens=n, env_tokens=0, turns=1, tool_seconds=0.25) if final else None,
        created_at=T0,
    )


def sample_events() -> list:
    return [
        Task(task_id="task-1", group_id="task-1/g0", group_size=4, instruction="Fix add().",
             files={"solution.py": "def add(a, b):\n    return a - b\n"}, difficulty="trivial",
             metadata={"source": "demo"}, created_at=T0),
        sample_chunk(),
        Reward(trajectory_id="task-1/g0/s0/a1", task_id="task-1", group_id="task-1/g0", sample_index=0,
               attempt="a1", score=1.0, tests_passed=3, tests_total=3,
               cost=Cost(generated_tokens=4, turns=1, tool_seconds=0.25), phase="budget",
               length_penalty=0.004, budget_penalty=0.0, reward=0.996, weight_version=4,
               grading_seconds=0.5, created_at=T0),
        WeightVersion(model="rollway-tiny", version=5, kind="delta", base_version=4, keyframe_version=0,
                      manifest_url="file:///tmp/w/v5/manifest.json", weights_hash="ab" * 16, num_tensors=27,
                      raw_bytes=919_296, stored_bytes=10_001, trainer_step=5, created_at=T0),
        Heartbeat(replica_id="sampler-0", role="sampler", status="serving", weight_version=5, in_flight=2,
                  tokens_per_s=123.5, last_pause_ms=1.25, updates_applied=3, host="h", pid=42,
                  details={"engine": "vllm"}, created_at=T0),
        TrainStep(step=7, weight_version=7, weights_hash="cd" * 16,
                  trajectories=[TrainedTrajectory(trajectory_id="task-1/g0/s0/a1",
                                                  chunks=[RecordRef("rollway.trajectories", 1, 10)],
                                                  reward=RecordRef("rollway.rewards", 0, 3))],
                  metrics={"loss": -0.25}, seed=7, created_at=T0, groups=[GroupRef("task-1", "g0")],
                  dropped=[GroupDrop("task-2", "g1", "zero_variance")], config_hash="0123456789abcdef"),
        GroupsDropped(after_step=7, dropped=[GroupDrop("task-3", "g0", "abandoned")], created_at=T0),
        Metrics(source="trainer", step=7, weight_version=7, values={"loss": -0.25, "reward_mean": 0.5},
                histograms={"staleness": [0.0, 1.0, 1.0]}, created_at=T0),
        EvalResult(split="family:heldout", weight_version=7, model="tiny", tasks=100, samples=1,
                   pass_at_1=0.31, mean_reward=0.29, mean_generated_tokens=41.5, cheated=0,
                   per_kind={"affine": 0.4}, evaluator="cli", seconds=12.5, created_at=T0),
        DeadLetter(topic="rollway.tasks", partition=1, offset=9, key=b"k", value=b"\xff\x00",
                   headers=[("rollway-type", b"Task")], error="cannot decode Task", error_kind="decode",
                   consumer_group="rollway-samplers", attempts=0, created_at=T0),
    ]
