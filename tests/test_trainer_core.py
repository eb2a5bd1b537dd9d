"""The training step on the tiny model: determinism, replay's zero gradients, the
optimizer split, checkpoints (trainer/core.py, trainer/optim.py, trainer/checkpoint.py)."""

from __future__ import annotations

import dataclasses
import os

import msgspec
import pytest
import torch

from tests.synthetic import groups_from_sampled, load_tiny, make_task_groups
from tests.trainer_helpers import one_thread  # noqa: F401  autouse fixture
from trainer import checkpoint as ckpt
from trainer.config import TrainerConfig
from trainer.core import TrainCore
from trainer.packing import pack_step


@pytest.fixture(scope="module")
def sampled(tiny_model_path):
    model, tok = load_tiny(str(tiny_model_path))
    return make_task_groups(model, tok, 4, group_size=4, max_new_tokens=10, env_after=4, seed=3)


@pytest.fixture(scope="module")
def groups(sampled):
    return groups_from_sampled(sampled)


def config(path, **kw) -> TrainerConfig:
    base = dict(model_path=str(path), learning_rate=1e-3, muon_learning_rate=1e-3, max_staleness=100,
                micro_batch_tokens=256, num_threads=1)
    base.update(kw)
    return TrainerConfig(**base)


def params(core: TrainCore) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in core.model.named_parameters()}


def test_two_trainers_fed_the_same_batches_are_bit_identical(tiny_model_path, groups):
    a, b = TrainCore(config(tiny_model_path)), TrainCore(config(tiny_model_path))
    assert a.cfg.replay_precision  # the default: bit-identity holds for the bf16 forward
    batches = [groups[:2], groups[2:], groups[1:3]]
    hashes_a = [a.train_step(g).weights_hash for g in batches]
    hashes_b = [b.train_step(g).weights_hash for g in batches]
    assert hashes_a == hashes_b
    assert len(set(hashes_a)) == 3  # every step changed the weights
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def singleton(traj):
    """The trajectory as if top-p had kept only the sampled token every time."""
    kept = [[t] if m else [] for t, m in zip(traj.token_ids, traj.loss_mask)]
    return dataclasses.replace(traj, kept=kept, logprobs=[0.0] * len(traj.token_ids))


def test_a_step_on_singleton_kept_sets_changes_nothing(tiny_model_path, sampled):
    groups = groups_from_sampled([[singleton(t) for t in g] for g in sampled[:2]])
    core = TrainCore(config(tiny_model_path, weight_decay=0.0))
    before = params(core)
    result = core.train_step(groups)
    assert result.metrics["kept_one_frac"] == 1.0
    assert result.metrics["grad_norm"] == 0.0
    after = params(core)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_lm_head_rows_outside_every_kept_set_do_not_move(tiny_model_path, groups):
    in_kept = set()
    for g in groups[:2]:
        for t in g.members:
            for s in t.segments:
                in_kept.update(int(x) for x in s.kept_ids)
    core = TrainCore(config(tiny_model_path, weight_decay=0.0))
    head = core.model.get_output_embeddings().weight
    before = head.detach().clone()
    core.train_step(groups[:2])
    outside = [v for v in range(head.shape[0]) if v not in in_kept]
    assert len(outside) > 100
    assert torch.equal(head.detach()[outside], before[outside])
    assert not torch.equal(head.detach()[sorted(in_kept)], before[sorted(in_kept)])
    # Without replay the full-vocabulary softmax moves every row.
    full = TrainCore(config(tiny_model_path, weight_decay=0.0, replay_kept_sets=False))
    full.train_step(groups[:2])
    moved = (full.model.get_output_embeddings().weight.detach()[outside] != before[outside]).any(dim=1)
    assert bool(moved.all())


def test_environment_tokens_are_not_loss_tokens(tiny_model_path, sampled, groups):
    packed = pack_step(groups, 0, config(tiny_model_path))
    generated = sum(sum(t.loss_mask) for g in sampled for t in g)
    total = sum(len(t.token_ids) for g in sampled for t in g)
    env_and_prompt = total - generated
    assert env_and_prompt > 0
    assert packed.loss_tokens == packed.generated_tokens == generated
    assert packed.total_tokens == total
    # Targets are exactly the generated tokens, predicted from the position before.
    mb = packed.micro_batches[0]
    row0 = groups[0].members[0].segments[0]
    gen_pos = [i for i, m in enumerate(row0.loss_mask) if m]
    n0 = len(gen_pos)
    assert mb.pos[:n0].tolist() == [p - 1 for p in gen_pos]
    assert mb.targets[:n0].tolist() == [int(row0.token_ids[p]) for p in gen_pos]


def test_stale_tokens_are_masked_under_mask_tokens(tiny_model_path, sampled):
    n = len(sampled[0][0].token_ids)
    versions = [0] * (n - 4) + [5] * 4  # the last 4 tokens are fresh
    g = groups_from_sampled([[dataclasses.replace(t, versions=versions) for t in sampled[0]]])
    packed = pack_step(g, 5, config(tiny_model_path, stale_policy="mask_tokens", max_staleness=2))
    assert packed.loss_tokens == 4 * 4
    assert packed.generated_tokens == sum(sum(t.loss_mask) for t in sampled[0])
    core = TrainCore(config(tiny_model_path, stale_policy="mask_tokens", max_staleness=2))
    core.step = 5
    result = core.train_step(g)
    assert result.metrics["masked_stale_tokens"] == packed.generated_tokens - 16
    assert result.histograms["staleness"][0] == 16 and result.histograms["staleness"][-1] == packed.generated_tokens - 16


def test_optimizer_split_muon_for_hidden_matrices(tiny_model_path):
    core = TrainCore(config(tiny_model_path))
    opt = core.optimizer
    assert isinstance(opt.optimizers["muon"], torch.optim.Muon)
    assert isinstance(opt.optimizers["adamw"], torch.optim.AdamW)
    assert all(n.startswith("model.layers.") and n.endswith("_proj.weight") for n in opt.muon_names)
    assert len(opt.muon_names) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(opt.adamw_names)
    assert any(n.endswith(".bias") for n in opt.adamw_names)
    assert all(p.ndim == 2 for n, p in core.model.named_parameters() if n in opt.muon_names)


def test_checkpoint_round_trip_continues_bit_identically(tiny_model_path, groups, tmp_path):
    straight = TrainCore(config(tiny_model_path))
    for g in (groups[:2], groups[2:], groups[:2], groups[2:]):
        straight.train_step(g)

    first = TrainCore(config(tiny_model_path))
    first.train_step(groups[:2])
    first.train_step(groups[2:])
    saver = ckpt.AsyncCheckpointer(tmp_path, keep=2)
    future = saver.save(first.snapshot(), first.weights_hash())
    # Training does not wait for the write: the snapshot is a copy.
    first.train_step(groups[:2])
    info = future.result()
    saver.close()
    assert info.step == 2 and (tmp_path / "step-00000002" / "state.pt").exists()

    resumed = TrainCore(config(tiny_model_path))
    (found,) = ckpt.list_checkpoints(tmp_path)
    resumed.restore(ckpt.load_checkpoint(found))
    assert resumed.step == 2 and resumed.weights_hash() == found.weights_hash
    resumed.train_step(groups[:2])
    last = resumed.train_step(groups[2:])
    assert last.weights_hash == straight.weights_hash()
    assert last.step == 4


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    snap = {"step": 0, "weight_version": 0, "model": {"w": torch.arange(4.0)}}
    for step in range(1, 6):
        ckpt.write_checkpoint(tmp_path, dict(snap, step=step, weight_version=step), f"h{step}")
    ckpt.prune(tmp_path, keep=3)
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [3, 4, 5]
    # A crash mid-write leaves a hidden temporary folder: never listed, removed at start.
    partial = tmp_path / ".step-00000006.tmp-123-456"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"half")
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [3, 4, 5]
    # The trainer's start-up claims the folder (trainer/checkpoint_owner.py) and cleans then.
    from trainer.checkpoint_owner import FolderOwnership, Owner

    writer = ckpt.AsyncCheckpointer(tmp_path, keep=3)
    writer.claim(FolderOwnership(tmp_path, Owner(1, 0)))
    writer.close()
    assert not partial.exists()
    assert sorted(os.listdir(tmp_path)) == [".owner-p1-e0", "step-00000003", "step-00000004", "step-00000005"]


def test_config_rejects_bad_values():
    with pytest.raises(msgspec.ValidationError, match="advantage_norm"):
        msgspec.convert({"advantage_norm": "zscore"}, TrainerConfig)
    with pytest.raises(ValueError, match="max_version_fraction"):
        TrainerConfig(max_version_fraction=0.0)
    with pytest.raises(msgspec.ValidationError, match="importance_sampling"):
        msgspec.convert({"importance_sampling": "ppo"}, TrainerConfig)


def test_greedy_tokens_are_accepted_and_carry_no_gradient(tiny_model_path, sampled):
    greedy = [dataclasses.replace(singleton(t), temperature=0.0) for t in sampled[0]]
    (group,) = groups_from_sampled([greedy])
    assert all((s.temperature[s.loss_mask] == 1.0).all() for t in group.members for s in t.segments)
    core = TrainCore(config(tiny_model_path, weight_decay=0.0))
    before = core.weights_hash()
    assert core.train_step([group]).weights_hash == before
    # A "greedy" token with more than one kept id is a contradiction: refused.
    from trainer.trajectory import InvalidTrajectory

    bad = dataclasses.replace(sampled[0][0], temperature=0.0)
    with pytest.raises(InvalidTrajectory, match="greedy token"):
        groups_from_sampled([[bad]])


def test_step_log_and_announced_hashes_agree_when_the_masters_are_published(tiny_model_path, groups):
    from syncer.hashing import state_dict_hash
    from trainer.model import model_hash, publishable_state

    core = TrainCore(config(tiny_model_path))
    core.train_step(groups[:2])
    # The tiny model is untied with no persistent buffers: its float32 published copy is
    # exactly the masters, and one hash function gives one digest.
    assert model_hash(core.model) == state_dict_hash(publishable_state(core.model, "float32"))
    assert model_hash(core.model) != state_dict_hash(publishable_state(core.model, "bfloat16"))
