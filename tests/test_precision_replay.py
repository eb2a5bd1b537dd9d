"""Precision replay (issue #14 item 8): with ``trainer.replay_precision`` the trainer's
forward runs on its float32 masters cast to ``publish_dtype`` (bfloat16), which is the
forward a sampler serving the published copy computes, and the gradients land on the
float32 masters."""

from __future__ import annotations

import torch

from tests.trainer_helpers import one_thread  # noqa: F401
from trainer.config import TrainerConfig
from trainer.core import TrainCore
from trainer.model import load_policy
from trainer.precision import SelectedLogits, policy_logits


def _rows(vocab: int):
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    row = torch.arange(2).repeat_interleave(23)
    pos = torch.arange(23).repeat(2)
    return ids, row, pos


def test_the_replayed_forward_is_the_bf16_copys_forward_bit_for_bit(tiny_model_path):
    from transformers import AutoModelForCausalLM

    masters = load_policy(str(tiny_model_path), torch.device("cpu"))  # float32
    published = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16,
                                                     attn_implementation="sdpa").eval()
    ids, row, pos = _rows(masters.config.vocab_size)
    with torch.no_grad():
        sampler_logits = published(input_ids=ids).logits[row, pos].float()
    selected = SelectedLogits(masters)
    replayed = policy_logits(selected, ids, row, pos, torch.bfloat16)
    float32 = policy_logits(selected, ids, row, pos, None)
    assert torch.equal(replayed.detach(), sampler_logits)
    assert not torch.equal(float32.detach(), sampler_logits)
    assert (float32.detach() - sampler_logits).abs().max() > 1e-3  # what replay removes

    replayed.logsumexp(-1).sum().backward()
    for name, p in masters.named_parameters():
        assert p.dtype == torch.float32, name
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert p.grad.abs().sum() > 0, name


def test_a_step_with_precision_replay_keeps_float32_masters_and_moves_them(tiny_model_path):
    from tests.synthetic import groups_from_sampled, load_tiny, make_task_groups

    model, tok = load_tiny(str(tiny_model_path))
    groups = groups_from_sampled(make_task_groups(model, tok, 1, group_size=2, max_new_tokens=6))
    core = TrainCore(TrainerConfig(model_path=str(tiny_model_path), device="cpu", replay_precision=True,
                                   learning_rate=1e-3, muon_learning_rate=1e-3))
    before = {n: p.detach().clone() for n, p in core.model.named_parameters()}
    metrics = core.train_step(groups).metrics
    assert metrics["loss_tokens"] > 0
    assert all(p.dtype == torch.float32 for p in core.model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in core.model.named_parameters())
