"""MoE routing replay (R3, issue #14 item 2) on tiny random-init MoE models built here.

The "flip" setup: TorchEngine samples with the original weights and records the routed
experts; the trainer loads the same model with slightly changed router weights,
labelled the same version (0). The changed routers send some positions to other
experts. The models route each position to one expert (top_k 1) with renormalised
gate weights, so a position's gate weight is exactly 1 whatever the router logits: the
expert choice is the only thing the change can alter. With R3 the trainer computes the
sampler's function exactly (log-probs equal to float32 rounding), without it the
flipped routes change the log-probs of the sampled tokens.
"""

from __future__ import annotations

import asyncio
import math

import msgspec
import numpy as np
import pytest
import torch

from sampler.routes import RouteCapture
from sampler.sampling import SamplingParams
from sampler.tiny_model import build_tiny_moe, tiny_model_dir
from sampler.torch_engine import TorchEngine
from schemas import Cost
from tests.synthetic import engine_group
from tests.trainer_helpers import one_thread  # noqa: F401
from trainer.config import TrainerConfig
from trainer.core import TrainCore
from trainer.routing import RoutingReplay
from trainer.trajectory import Group

ROUTER_NOISE = 0.005  # added to the router weights (init std 0.02): flips some routes
PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """(sampler's model, trainer's model with changed routers), Qwen3-MoE top-1."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    original = build_tiny_moe(root / "original", tiny_model_dir(), top_k=1)
    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(ROUTER_NOISE * torch.randn(p.shape, generator=gen))
    changed = root / "changed"
    model.save_pretrained(changed)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(original).save_pretrained(changed)
    return original, changed


async def _sample_group(model_dir, samples: int = 2, max_tokens: int = 24, chunk_tokens: int = 256) -> Group:
    """One group sampled by TorchEngine (float32), recorded and assembled as live data."""
    engine = await TorchEngine(model_dir, dtype="float32", max_model_len=256).start()
    try:
        prompt = engine.tokenizer(PROMPT)["input_ids"]
        params = SamplingParams(n=samples, max_tokens=max_tokens, ignore_eos=True, seed=3)
        return await engine_group(engine, prompt, params, chunk_tokens=chunk_tokens)
    finally:
        await engine.close()


def _step_metrics(model_dir, group: Group, replay: bool) -> dict[str, float]:
    # The group was sampled in float32 (_sample_group), so the trainer forwards in float32
    # too (precision replay off): the exact-match assertions isolate routing.
    core = TrainCore(TrainerConfig(model_path=str(model_dir), replay_routing=replay, replay_precision=False,
                                   device="cpu", learning_rate=1e-6, muon_learning_rate=1e-6), str(model_dir))
    return core.train_step([group]).metrics


def _recomputed_differs(model_dir, group: Group) -> float:
    """Share of recorded positions where ``model_dir``'s own top-k (one forward of the
    group's rows, as the trainer packs them) differs from the recorded experts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    capture = RouteCapture(model)
    segments = [t.segments[0] for t in group.members]
    ids = torch.tensor(np.stack([s.token_ids for s in segments]))
    with torch.no_grad():
        model.model(input_ids=ids)
    own = capture.take(*ids.shape).astype(np.int64)  # [rows, L, layers, top_k]
    recorded = np.stack([s.routes[1:] for s in segments]).astype(np.int64)  # positions 0..L-2
    own = own[:, :-1]
    differs = (np.sort(own, axis=-1) != np.sort(recorded, axis=-1)).any(axis=(-1, -2))
    return float(differs.sum() / differs.size)


def test_the_sampler_records_a_route_for_every_position_it_forwarded(moe_dirs):
    # Chunks of 4 tokens: the prompt spans several, and its head keeps its routes too.
    group = asyncio.run(_sample_group(moe_dirs[0], chunk_tokens=4))
    for traj in group.members:
        assert len(traj.chunk_refs) > 6
        seg = traj.segments[0]
        assert seg.routes.shape == (seg.num_tokens, 2, 1)  # [tokens, MoE layers, top_k]
        assert (seg.routes[0] == -1).all()  # position -1 produced nothing
        assert (seg.routes[1:] >= 0).all() and (seg.routes[1:] < 4).all()


def test_with_replay_the_trainer_matches_the_sampler_exactly_without_it_does_not(moe_dirs):
    original, changed = moe_dirs
    group = asyncio.run(_sample_group(original))
    positions = sum(t.segments[0].num_tokens - 1 for t in group.members)

    # Same weights as the sampler: replay or not, the same function (up to rounding).
    same = _step_metrics(original, group, replay=True)
    assert same["routing_recorded_positions"] == positions
    assert abs(math.log(same["is_ratio_min"])) < 1e-5 and abs(math.log(same["is_ratio_max"])) < 1e-5

    expected_differs = _recomputed_differs(changed, group)
    assert expected_differs > 0.05  # the flip setup flips routes

    off = _step_metrics(changed, group, replay=False)
    assert off["routing_recorded_positions"] == positions
    assert off["routing_differs_frac"] == pytest.approx(expected_differs, abs=0)
    assert max(abs(math.log(off["is_ratio_min"])), abs(math.log(off["is_ratio_max"]))) > 1e-2
    assert off["mismatch_kl_k3"] > 1e-6

    on = _step_metrics(changed, group, replay=True)
    assert on["routing_recorded_positions"] == positions
    assert on["routing_differs_frac"] > 0.05  # measured with replay on too
    assert abs(math.log(on["is_ratio_min"])) < 1e-5 and abs(math.log(on["is_ratio_max"])) < 1e-5
    assert on["mismatch_kl_k3"] < 1e-10


def test_replaying_the_models_own_routes_is_bit_identical_and_the_router_still_learns(tmp_path):
    """Top-2 Mixtral: the gate weights are the router's softmax at the replayed experts,
    renormalised, so replaying its own choice changes no bit, and the router weights get
    gradients through the gate weights of the replayed experts."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_moe(tmp_path / "mixtral", tiny_model_dir(), kind="mixtral", top_k=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    capture = RouteCapture(model)
    plain = model(input_ids=ids).logits
    own = torch.from_numpy(capture.take(*ids.shape))
    capture.remove()

    replay = RoutingReplay(model, replay=True)
    with replay.using(own):
        replayed = model(input_ids=ids).logits
    assert torch.equal(plain, replayed)
    assert replay.take_counts() == (24, 0)

    other = (own + 1) % 4  # every position to two other experts
    with replay.using(other):
        moved = model(input_ids=ids).logits
    assert not torch.allclose(plain, moved)
    assert replay.take_counts() == (24, 24)
    moved.logsumexp(-1).sum().backward()
    for router in replay.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_a_prompt_longer_than_a_chunk_keeps_every_route_and_a_flushed_one_is_counted():
    """Producer convention: prompt position p's routes are token p+1's row. Environment
    tokens wait for the next sampled token, which brings their prefill's routes, so a
    6-token prompt with 4-token chunks keeps its head's routes (this was lost before:
    3 positions -1). Positions published by an explicit flush before the report stay -1,
    counted."""
    from sampler.engine import SampledToken
    from sampler.recorder import TrajectoryIdentity, TrajectoryRecorder

    prompt_routes = np.arange(5 * 2, dtype=np.int16).reshape(5, 2, 1)  # positions 0..4, 2 layers

    async def run(flush_first: bool):
        chunks = []

        async def publish(chunk):
            chunks.append(chunk)

        rec = TrajectoryRecorder(TrajectoryIdentity("t", "task", "g", 0, 1, "a0"), publish, chunk_tokens=4)
        await rec.add_env(list(range(10, 16)), 0)  # 6 prompt tokens: more than a chunk
        assert chunks == []  # held for the prefill's routes
        if flush_first:
            await rec.flush()
        await rec.add_sampled(SampledToken(0, 7, -0.5, np.array([7, 8], dtype=np.int32), False, 0,
                                           routed_experts=np.array([[40], [41]], dtype=np.int16),
                                           prompt_routed_experts=prompt_routes))
        await rec.finish("length", Cost(generated_tokens=1))
        return rec, chunks

    rec, chunks = asyncio.run(run(flush_first=False))
    assert rec.routes_unrecorded == 0
    assert [c.token_array().tolist() for c in chunks] == [[10, 11, 12, 13], [14, 15, 7]]
    head = chunks[0].routed_experts_array()  # token 0 has no producer; tokens 1..3: positions 0..2
    assert head.tolist() == [[[-1], [-1]], [[0], [1]], [[2], [3]], [[4], [5]]]
    table = chunks[1].routed_experts_array()  # tokens 4, 5 (prompt) and 6 (sampled)
    assert table.tolist() == [[[6], [7]], [[8], [9]], [[40], [41]]]
    # rollway tail --decode-arrays shows the same table (it read int16 as uint8 before).
    from bus.tail import event_to_builtins

    assert event_to_builtins(chunks[1], decode_arrays=True)["routed_experts"] == table.tolist()
    bad = msgspec.structs.replace(chunks[1], routed_experts_shape=[3, 3, 1])
    with pytest.raises(ValueError, match="routed_experts has 12 bytes for shape"):
        bad.validate()

    rec, chunks = asyncio.run(run(flush_first=True))
    assert rec.routes_unrecorded == 5  # prompt tokens 1..5 were published before the report
    assert [c.token_array().tolist() for c in chunks] == [[10, 11, 12, 13], [14, 15], [7]]
    assert chunks[0].routed_experts_array() is None and chunks[1].routed_experts_array() is None
    assert chunks[2].routed_experts_array().tolist() == [[[40], [41]]]


def test_packing_puts_each_route_at_the_position_that_used_it_and_ignores_unfit_tables():
    from schemas import RecordRef, Reward
    from trainer.packing import pack_step
    from trainer.trajectory import Segment, Trajectory

    def traj(i: int, routes: np.ndarray) -> Trajectory:
        seg = Segment(token_ids=np.arange(5, dtype=np.int64), loss_mask=np.array([0, 0, 1, 1, 1], dtype=bool),
                      behaviour=np.zeros(5, dtype=np.float32),
                      kept_offsets=np.array([0, 0, 0, 1, 2, 3]), kept_ids=np.array([2, 3, 4], np.int32),
                      capped=np.zeros(5, dtype=bool), versions=np.zeros(5, dtype=np.int64),
                      temperature=np.ones(5, dtype=np.float32), routes=routes)
        reward = Reward(trajectory_id=f"t{i}", task_id="x", group_id="g", sample_index=i, attempt="a", score=0.0)
        return Trajectory(f"t{i}", "x", "g", i, 3, "a", [seg], reward, [], RecordRef("r", 0, i))

    table = np.array([-1, 0, 1, 2, 3], dtype=np.int16).reshape(5, 1, 1).repeat(2, axis=1)  # 2 layers, top-1
    wrong_layers = np.zeros((5, 3, 1), dtype=np.int16)
    out_of_range = table.copy()
    out_of_range[2] = 4  # experts 0..3
    packed = pack_step([Group("x", "g", [traj(0, table), traj(1, wrong_layers), traj(2, out_of_range)])], 0,
                       TrainerConfig(), (2, 1, 4))
    routes = packed.micro_batches[0].routes
    assert routes.shape == (3, 5, 2, 1)
    assert routes[0, :, 0, 0].tolist() == [0, 1, 2, 3, -1]  # position p: row p + 1
    assert (routes[1:] == -1).all()
    assert packed.routes_ignored == 2


def test_a_whole_sequence_table_reported_at_sample_end_is_aligned_by_position():
    """vLLM's table (row q = position q, prompt included, maybe one row past the last
    position): token q + 1 gets row q, whatever the table's length beyond the segment."""
    from sampler.engine import SampledToken
    from sampler.recorder import TrajectoryIdentity, TrajectoryRecorder

    async def run(extra_rows: int):
        chunks = []

        async def publish(chunk):
            chunks.append(chunk)

        rec = TrajectoryRecorder(TrajectoryIdentity("t", "task", "g", 0, 1, "a0"), publish)
        await rec.add_env([10, 11, 12], 0)
        for tok in (7, 8):
            await rec.add_sampled(SampledToken(0, tok, 0.0, np.array([tok], dtype=np.int32), False, 0))
        rows = 4 + extra_rows  # positions 0..3 produce tokens 1..4
        rec.attach_routed_experts(np.arange(rows, dtype=np.int16).reshape(rows, 1, 1))
        await rec.finish("stop", Cost())
        return chunks[0].routed_experts_array()[:, 0, 0].tolist()

    assert asyncio.run(run(0)) == [-1, 0, 1, 2, 3]
    assert asyncio.run(run(1)) == [-1, 0, 1, 2, 3]
