"""Muon for MoE experts (issue #14 item 4): fused 3-D expert tensors get Muon per expert
matrix, batched over the expert dimension, on tiny MoE models built locally from
transformers' config classes (no downloads)."""

from __future__ import annotations

import pytest
import torch

from trainer.config import TrainerConfig
from trainer.optim import ExpertMuon, HybridOptimizer, split_parameters

COMMON = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=8, num_experts_per_tok=2)


def tiny_moe(kind: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    torch.manual_seed(0)
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(**COMMON, num_experts=4, moe_intermediate_size=8, decoder_sparse_step=1,
                                mlp_only_layers=[])
    else:
        config = MixtralConfig(**COMMON, num_local_experts=4)
    return AutoModelForCausalLM.from_config(config).float()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_experts_go_to_muon_router_stays_muon_embeddings_and_norms_adamw(kind):
    model = tiny_moe(kind)
    muon, experts, adamw = (sorted(n for n, _ in part) for part in split_parameters(model))
    layers = [f"model.layers.{i}." for i in range(2)]
    assert experts == sorted(f"{l}mlp.experts.{m}" for l in layers for m in ("gate_up_proj", "down_proj"))
    assert muon == sorted([f"{l}self_attn.{p}_proj.weight" for l in layers for p in "qkvo"]
                          + [f"{l}mlp.gate.weight" for l in layers])  # the router: a 2-D hidden matrix
    norms = [f"{l}{n}.weight" for l in layers for n in ("input_layernorm", "post_attention_layernorm")]
    if kind == "qwen3_moe":
        norms += [f"{l}self_attn.{n}.weight" for l in layers for n in ("q_norm", "k_norm")]
    assert adamw == sorted(["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"] + norms)
    # Most of an MoE's matrix parameters are experts: before, all of these went to AdamW.
    n_expert = sum(p.numel() for _, p in split_parameters(model)[1])
    n_muon = sum(p.numel() for _, p in split_parameters(model)[0])
    assert n_expert > n_muon


def test_expert_muon_equals_torch_muon_on_each_expert_matrix():
    """Batched over experts, gate and up halves apart: the same update torch.optim.Muon
    gives each matrix as a dense 2-D parameter (two steps, so momentum counts)."""
    torch.manual_seed(1)
    experts, inter, hidden = 3, 8, 16
    gate_up = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden))
    down = torch.nn.Parameter(torch.randn(experts, hidden, inter))
    dense = [torch.nn.Parameter(m.detach().clone()) for e in range(experts)
             for m in (gate_up[e, :inter], gate_up[e, inter:], down[e])]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
    batched = ExpertMuon([("l.mlp.experts.gate_up_proj", gate_up), ("l.mlp.experts.down_proj", down)],
                         adjust_lr_fn="match_rms_adamw", **kw)
    reference = torch.optim.Muon(dense, adjust_lr_fn="match_rms_adamw", **kw)
    for _ in range(2):
        grads = (torch.randn_like(gate_up), torch.randn_like(down))
        gate_up.grad, down.grad = (g.clone() for g in grads)
        for e in range(experts):
            dense[3 * e].grad = grads[0][e, :inter].clone()
            dense[3 * e + 1].grad = grads[0][e, inter:].clone()
            dense[3 * e + 2].grad = grads[1][e].clone()
        batched.step()
        reference.step()
    for e in range(experts):
        torch.testing.assert_close(gate_up[e, :inter], dense[3 * e], rtol=0, atol=0)
        torch.testing.assert_close(gate_up[e, inter:], dense[3 * e + 1], rtol=0, atol=0)
        torch.testing.assert_close(down[e], dense[3 * e + 2], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_one_step_on_a_tiny_moe_moves_every_expert_by_an_orthogonalised_update(kind):
    model = tiny_moe(kind)
    cfg = TrainerConfig(muon_learning_rate=0.01, learning_rate=1e-3, weight_decay=0.0)
    opt = HybridOptimizer(model, cfg)
    assert set(opt.optimizers) == {"muon", "muon_experts", "adamw"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    params = dict(model.named_parameters())
    for name in opt.expert_names:
        delta = (params[name].detach() - before[name])
        per_expert = 2 if name.endswith("gate_up_proj") else 1
        experts, rows, cols = delta.shape
        for e in range(experts):
            if not before[name][e].ne(params[name][e]).any():
                continue  # an expert no token was routed to gets no gradient: no update
            for m in delta[e].reshape(per_expert, rows // per_expert, cols):
                r, c = m.shape
                # lr * 0.2 * sqrt(max(r, c)) * NS(.): Newton-Schulz lifts the leading
                # singular values to about 1 (0.5..1.5), whatever the gradient's scale (an
                # expert that saw few tokens has a low-rank gradient: its tail stays small).
                s = torch.linalg.svdvals(m / (0.01 * 0.2 * max(r, c) ** 0.5))
                assert 0.5 < s.max() < 1.5, (name, e, s)
    moved = [n for n in opt.expert_names if not torch.equal(params[n], before[n])]
    assert moved == opt.expert_names
    # Optimizer state (momentum per expert tensor) survives a round trip.
    state = opt.state_dict()
    again = HybridOptimizer(model, cfg)
    again.load_state_dict(state)
    for a, b in zip(again.optimizers["muon_experts"].buffers, opt.optimizers["muon_experts"].buffers):
        assert torch.equal(a, b)
