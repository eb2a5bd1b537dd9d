"""Capped kept sets rebuilt exactly (issue #14 item 1).

With more than ``cap`` finite entries the sampler records its top ``cap`` ids plus the
sampled token, flags the set capped and (schema 2) records the set's size; the trainer
rebuilds the set as its own top-``size``. With identical weights the importance ratio at
a capped position is then 1; before, it was 0.95 (``full_vocab``) or 1.48 (``kept_set``)
in the issue's example.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch

from sampler.sampling import SamplingParams, kept_set_from_row, processed_logprobs
from schemas import TrajectoryChunk, arrays
from trainer import loss as L

CAP = 64
PARAMS = SamplingParams(temperature=1.0, top_p=0.95)


def sampler_record(logits: torch.Tensor, sampled: int):
    """What an engine with a cap of 64 records for one position: (behaviour log-prob, kept set)."""
    lp = processed_logprobs(logits.reshape(1, -1), PARAMS)[0]
    return float(lp[sampled]), kept_set_from_row(lp, CAP, sampled)


def trainer_ratio(logits: torch.Tensor, sampled: int, behaviour: float, kept, policy: str, rebuild: bool):
    targets = torch.tensor([sampled])
    kept_ids, kept_lengths = L.pad_kept_sets(np.array([kept.ids.size]), kept.ids, targets)
    capped = torch.tensor([kept.capped])
    sizes = torch.tensor([kept.size])
    sets = None
    if rebuild:
        sets = L.rebuild_capped_sets(logits.reshape(1, -1), targets, kept_ids, kept_lengths, capped, sizes)
        kept_ids, kept_lengths, capped = sets.kept_ids, sets.kept_lengths, sets.capped
    lp, keep = L.token_logprobs(logits.reshape(1, -1), targets, kept_ids, kept_lengths, capped,
                                capped_policy=policy)
    return math.exp(float(lp[0]) - behaviour), sets


def test_issue_example_100_equal_logits_ratio_is_one_after_rebuild():
    logits = torch.zeros(100)
    sampled = 0
    behaviour, kept = sampler_record(logits, sampled)
    assert (kept.size, kept.ids.size, kept.capped) == (95, 64, True)  # top-p keeps 95; 64 recorded
    assert behaviour == pytest.approx(-math.log(95), abs=1e-6)
    full, _ = trainer_ratio(logits, sampled, behaviour, kept, "full_vocab", rebuild=False)
    partial, _ = trainer_ratio(logits, sampled, behaviour, kept, "kept_set", rebuild=False)
    rebuilt, sets = trainer_ratio(logits, sampled, behaviour, kept, "full_vocab", rebuild=True)
    assert full == pytest.approx(0.95, abs=1e-6)  # 95 / 100
    assert partial == pytest.approx(95 / 64, abs=1e-6)  # 1.484375
    assert rebuilt == pytest.approx(1.0, abs=1e-6)
    assert int(sets.kept_lengths[0]) == 95 and bool(sets.rebuilt[0]) and not bool(sets.capped[0])


def test_distinct_logits_rebuild_is_the_samplers_set_exactly():
    # Nearly flat, strictly ordered: top-p 0.95 keeps ids 0..94; the sampled token 80 is
    # outside the recorded top 64, so it is appended to the record (65 ids).
    logits = -torch.arange(100, dtype=torch.float32) * 1e-3
    sampled = 80
    behaviour, kept = sampler_record(logits, sampled)
    assert (kept.size, kept.ids.size, kept.capped) == (95, 65, True)
    assert kept.ids.tolist() == list(range(64)) + [80]
    ratio, sets = trainer_ratio(logits, sampled, behaviour, kept, "full_vocab", rebuild=True)
    assert ratio == pytest.approx(1.0, abs=1e-6)
    assert sorted(sets.kept_ids[0, :95].tolist()) == list(range(95))  # the sampler's set
    assert (bool(sets.missing[0]), bool(sets.differs[0])) == (False, False)
    # Without the rebuild: the full vocabulary and the partial set are both off.
    z = logits.double()
    kept_mass = torch.logsumexp(z[:95], 0)
    expected_full = math.exp(float(kept_mass - torch.logsumexp(z, 0)))
    expected_partial = math.exp(float(kept_mass - torch.logsumexp(z[kept.ids.tolist()], 0)))
    full, _ = trainer_ratio(logits, sampled, behaviour, kept, "full_vocab", rebuild=False)
    partial, _ = trainer_ratio(logits, sampled, behaviour, kept, "kept_set", rebuild=False)
    assert full == pytest.approx(expected_full, abs=1e-6) and full < 0.96
    assert partial == pytest.approx(expected_partial, abs=1e-6) and partial > 1.4


def test_sampled_token_outside_the_trainers_top_size_is_forced_in_and_counted():
    logits = -torch.arange(100, dtype=torch.float32) * 1e-3
    behaviour, kept = sampler_record(logits, 80)
    moved = logits.clone()
    moved[80] = -10.0  # the trainer's weights moved: token 80 is now the least likely
    ratio, sets = trainer_ratio(moved, 80, behaviour, kept, "full_vocab", rebuild=True)
    ids = sets.kept_ids[0, :95].tolist()
    assert bool(sets.missing[0]) and bool(sets.differs[0]) is False  # recorded top-64 are all in
    # The trainer's top-95 is 0..95 without 80; its least likely (95) makes room for 80.
    assert sorted(ids) == list(range(95))
    assert math.isfinite(ratio) and ratio < 1e-3


def test_uncapped_and_unknown_size_rows_are_left_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([1, 2, 3])
    kept_ids, kept_lengths = L.pad_kept_sets(np.array([2, 1, 2]), np.array([1, 5, 2, 3, 4]), targets)
    capped = torch.tensor([False, False, True])
    sizes = torch.tensor([2, 1, -1])  # row 2: capped by an engine that could not count
    sets = L.rebuild_capped_sets(logits, targets, kept_ids, kept_lengths, capped, sizes)
    assert torch.equal(sets.kept_ids, kept_ids) and torch.equal(sets.kept_lengths, kept_lengths)
    assert sets.capped.tolist() == [False, False, True] and not sets.rebuilt.any()


def chunk(kept: list[list[int]], capped: list[int], sizes: list[int] | None) -> TrajectoryChunk:
    n = len(kept)
    offsets, ids = arrays.pack_csr(kept)
    starts, versions = arrays.pack_spans([0] * n)
    return TrajectoryChunk(
        trajectory_id="t/g/0/a", task_id="t", group_id="g", sample_index=0, group_size=1, attempt="a",
        chunk_index=0, token_ids=arrays.pack([k[0] if k else 7 for k in kept], arrays.INT32),
        logprobs=arrays.pack([0.0] * n, arrays.FLOAT32), loss_mask=arrays.pack([1 if k else 0 for k in kept], arrays.UINT8),
        kept_offsets=offsets, kept_ids=ids, kept_capped=arrays.pack(capped, arrays.UINT8),
        version_starts=starts, versions=versions,
        kept_sizes=arrays.pack(sizes, arrays.INT32) if sizes is not None else b"",
    )


def test_chunk_kept_sizes_schema_2_and_schema_1_chunks_still_decode():
    from bus import codec

    new = chunk([[], [3, 4], [5, 6, 9]], [0, 0, 1], [0, 2, 95])
    new.validate()
    assert new.kept_size_array().tolist() == [0, 2, 95]
    value, headers = codec.encode(new)
    assert dict(headers)["rollway-schema"] == b"2" and codec.decode(value, headers) == new
    # A schema-1 chunk (no kept_sizes on the wire) decodes; sizes are derived: complete
    # sets their id count, capped ones unknown.
    old = chunk([[], [3, 4], [5, 6, 9]], [0, 0, 1], None)
    body = msgspec.msgpack.decode(codec.encode(old)[0])
    body.pop("kept_sizes")
    decoded = codec.decode(msgspec.msgpack.encode(body), [("rollway-type", b"TrajectoryChunk"), ("rollway-schema", b"1")])
    assert decoded.kept_sizes == b"" and decoded.kept_size_array().tolist() == [0, 2, -1]
    with pytest.raises(ValueError, match="uncapped kept set"):
        chunk([[3, 4]], [0], [3]).validate()
    with pytest.raises(ValueError, match="smaller than the recorded ids"):
        chunk([[3, 4, 5]], [1], [2]).validate()


def capped_copy(traj, cap: int):
    """The trajectory as an engine with a kept-set cap of ``cap`` records it: the ``cap``
    most likely ids (the exact sets are most likely first) plus the sampled token, the
    flag, and the whole set's size."""
    import dataclasses

    kept, capped, sizes = [], [], []
    for tok, m, ids in zip(traj.token_ids, traj.loss_mask, traj.kept):
        if m and len(ids) > cap:
            head = list(ids[:cap])
            kept.append(head if tok in head else head + [tok])
            capped.append(1)
        else:
            kept.append(list(ids))
            capped.append(0)
        sizes.append(len(ids))
    return dataclasses.replace(traj, kept=kept, capped=capped, kept_sizes=sizes)


def test_trainer_step_with_identical_weights_rebuilds_every_capped_set_ratio_one(tiny_model_path):
    """The tiny model sampled at top_p 0.9 (exact sets), recorded with a cap of 2: every
    capped set is rebuilt to the sampler's set, every ratio is 1 (float tolerance)."""
    from tests.synthetic import groups_from_sampled, load_tiny, make_task_groups
    from trainer.config import TrainerConfig
    from trainer.core import TrainCore

    model, tok = load_tiny(str(tiny_model_path))
    sampled = make_task_groups(model, tok, 2, group_size=4, max_new_tokens=10, seed=3)
    capped = [[capped_copy(t, 2) for t in g] for g in sampled]
    n_capped = sum(sum(t.capped) for g in capped for t in g)
    # Capped records that hold the whole set anyway (cap + a sampled token just below it)
    # need no rebuild.
    n_partial = sum(1 for g in capped for t in g for c, k, s in zip(t.capped, t.kept, t.kept_sizes) if c and s > len(k))
    assert n_partial > 10
    groups = groups_from_sampled(capped)

    def step(**kw):
        # The synthetic sampler draws in float32 (load_tiny), so the trainer's forward must
        # too: precision replay (default on) would put a bf16 forward against it.
        cfg = TrainerConfig(model_path=str(tiny_model_path), max_staleness=100, micro_batch_tokens=256,
                            num_threads=1, replay_precision=False, **kw)
        return TrainCore(cfg).train_step(groups).metrics

    rebuilt = step()
    assert (rebuilt["kept_rebuilt"], rebuilt["kept_rebuilt_missing"], rebuilt["kept_rebuilt_differs"]) == (
        n_partial, 0, 0)
    assert abs(rebuilt["is_ratio_min"] - 1) < 1e-4 and abs(rebuilt["is_ratio_max"] - 1) < 1e-4
    # As before (no rebuild): capped positions fall to the full vocabulary, ratios < 1.
    old = step(rebuild_capped_kept_sets=False)
    assert old["kept_rebuilt"] == 0 and old["is_ratio_min"] < 0.95
    partial = step(rebuild_capped_kept_sets=False, capped_kept_set="kept_set")
    assert partial["is_ratio_max"] > 1.05
    print(f"identical weights, {n_capped} capped positions ({n_partial} partial): ratio min/max rebuilt "
          f"{rebuilt['is_ratio_min']:.6f}/{rebuilt['is_ratio_max']:.6f}, full_vocab {old['is_ratio_min']:.4f}/"
          f"{old['is_ratio_max']:.4f}, kept_set {partial['is_ratio_min']:.4f}/{partial['is_ratio_max']:.4f}")


async def test_torch_engine_with_a_cap_records_top_cap_plus_the_token_and_the_exact_size():
    from sampler.engine import SampledToken
    from sampler.torch_engine import TorchEngine
    from tests.sampler_helpers import agent_model_dir

    exact = await TorchEngine(agent_model_dir(), max_model_len=256, dtype="float32", seed=5).start()
    capped = await TorchEngine(agent_model_dir(), max_model_len=256, dtype="float32", seed=5, kept_set_cap=2).start()
    try:
        prompt = exact.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12)
        runs = []
        for eng in (exact, capped):
            runs.append([ev async for ev in eng.generate(prompt, params, request_id="r") if isinstance(ev, SampledToken)])
    finally:
        await exact.close()
        await capped.close()
    a, b = runs
    assert [t.token_id for t in a] == [t.token_id for t in b]  # same seed, same draws
    assert any(t.kept_capped for t in b)
    for full, cut in zip(a, b):
        assert cut.kept_size == full.kept_ids.size == full.recorded_kept_size
        assert cut.kept_capped == (full.kept_ids.size > 2)
        if cut.kept_capped:
            head = full.kept_ids[:2].tolist()
            assert cut.kept_ids.tolist() == (head if cut.token_id in head else head + [cut.token_id])
        else:
            assert cut.kept_ids.tolist() == full.kept_ids.tolist()


def test_tail_decodes_kept_sizes():
    from bus.tail import event_to_builtins

    data = event_to_builtins(chunk([[], [3, 4], [5, 6, 9]], [0, 0, 1], [0, 2, 95]), decode_arrays=True)
    assert data["kept_sizes"] == [0, 2, 95] and data["kept_capped"] == [0, 0, 1]
    old = event_to_builtins(chunk([[], [3, 4], [5, 6, 9]], [0, 0, 1], None), decode_arrays=True)
    assert old["kept_sizes"] == [0, 2, -1]


def test_vllm_logprobs_path_sizes_and_the_whole_vocabulary_case():
    """The processed-logprobs path's kept sets (KeptSetTap), on a faked sampler step."""
    from sampler.vllm_kept_sets import KeptSetTap

    def step(rows, sampled, cap=2):
        tap = KeptSetTap(cap)
        tap.wanted = {f"r{i}" for i in range(len(rows))}
        tap._capture([f"r{i}" for i in range(len(rows))], torch.tensor(sampled), torch.tensor(rows))
        return tap.step

    # Every token of a 3-token vocabulary finite, cap 2: the top cap+1 is all of it -> complete.
    lp, kept = step([[-1.0, -1.2, -1.5]], [0]).kept_set("r0", 0)
    assert (kept.ids.tolist(), kept.capped, kept.size, lp) == ([0, 1, 2], False, 3, -1.0)
    # A larger vocabulary: more finite entries than the cap -> capped, size unknown.
    larger = [-1.0, -1.2, -1.5] + [float("-inf")] * 96 + [-9.0]
    lp, kept = step([larger], [2]).kept_set("r0", 2)
    assert (kept.ids.tolist(), kept.capped, kept.size) == ([0, 1, 2], True, -1)
    lp, kept = step([[-0.1, -2.4] + [float("-inf")] * 98], [1]).kept_set("r0", 1)
    assert (kept.ids.tolist(), kept.capped, kept.size) == ([0, 1], False, 2)


def test_a_recorded_size_above_the_vocabulary_is_clamped_not_a_crash():
    """One bad chunk (size > vocabulary) must not crash every step that redelivers it."""
    vocab = 10
    logits = torch.linspace(1.0, 0.0, vocab).repeat(2, 1)
    targets = torch.tensor([0, 1])
    kept_ids = torch.tensor([[0, 1], [0, 1]])
    kept_lengths = torch.tensor([2, 2])
    sets = L.rebuild_capped_sets(logits, targets, kept_ids, kept_lengths, torch.tensor([True, True]),
                                 torch.tensor([4, vocab + 5]))
    assert sets.kept_lengths.tolist() == [4, vocab]
    assert sorted(sets.kept_ids[1, :vocab].tolist()) == list(range(vocab))


@pytest.mark.parametrize("field, value", [("learning_rate", float("nan")), ("muon_learning_rate", float("inf")),
                                          ("learning_rate", 0.0), ("weight_decay", -1.0)])
def test_trainer_rates_must_be_finite_and_positive(field, value):
    from trainer.config import TrainerConfig

    with pytest.raises(ValueError, match=f"trainer.{field} must be a finite number"):
        TrainerConfig(**{field: value})
