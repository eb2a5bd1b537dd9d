"""Meta-device init for MoE checkpoints (issue #28, trainer/sharded_init.py and
trainer/checkpoint_map.py): hub MoE checkpoints store each expert's matrices apart
(``mlp.experts.N.gate_proj.weight``), transformers 5 fuses them into one parameter a
layer (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``). Each rank now fills its
shard of a fused parameter from the per-expert tensors of its own experts; before, every
such checkpoint fell back to loading the whole model on every rank."""

from __future__ import annotations

import os

import pytest
import torch

from tests.fsdp_helpers import run_ranks


def _qwen3_moe(num_experts: int = 4):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=num_experts,
        num_experts_per_tok=2, vocab_size=128, tie_word_embeddings=False))


def _keys(folder) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def test_moe_checkpoints_meta_init_fills_each_ranks_experts_bit_identical_to_from_pretrained(tmp_path_factory):
    """One 2-rank launch (~15 s on 2 cores), four checkpoints, each loaded by the
    sharded trainer and compared (``torch.equal``, every gathered parameter) with the
    1-process ``from_pretrained(dtype=float32)``:

    * a tiny Qwen3-MoE as ``save_pretrained`` writes it (per-expert tensors), split over
      several .safetensors files with an index (experts of one layer in different files);
    * the same model saved fused (``save_original_format=False``: the parameters' names);
    * a tiny Mixtral, per-expert under other names (``block_sparse_moe.experts.N.w1``,
      ``w3`` -> ``gate_up_proj``; ``w2`` -> ``down_proj``; the router renamed), 3 experts
      on 2 ranks (2 and 1: uneven shards);
    * the per-expert Qwen3-MoE without ``model.norm.weight``: a parameter from_pretrained
      initialises, so meta init cannot read it and the full load is taken, logged with
      the parameter and why.

    The first three take meta init (before: the per-expert two fell back) and log it."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from safetensors.torch import load_file, save_file

    from trainer.model import load_policy

    folder = tmp_path_factory.mktemp("moe-meta")
    per_expert, fused, mixtral, lacking = (folder / n for n in ("per_expert", "fused", "mixtral", "lacking"))
    _qwen3_moe().save_pretrained(per_expert, max_shard_size="150KB")
    _qwen3_moe().save_pretrained(fused, save_original_format=False)
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, num_local_experts=3, num_experts_per_tok=2, vocab_size=128)).save_pretrained(mixtral)
    _qwen3_moe().save_pretrained(lacking)
    state = load_file(str(lacking / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(lacking / "model.safetensors"), metadata={"format": "pt"})

    assert (per_expert / "model.safetensors.index.json").exists() and len(list(per_expert.glob("*.safetensors"))) > 1
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in _keys(per_expert)
    assert "model.layers.0.mlp.experts.gate_up_proj" in _keys(fused)
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in _keys(mixtral)

    paths = [str(p) for p in (per_expert, fused, mixtral, lacking)]
    out, _ = run_ranks(2, "load", {"model_paths": paths}, folder)
    assert {p: out[p]["meta_init"] for p in paths} == {
        str(per_expert): True, str(fused): True, str(mixtral): True, str(lacking): False}
    for path in paths:
        reference = {n: p.detach() for n, p in load_policy(path, torch.device("cpu")).named_parameters()}
        got = out[path]["params"]
        assert sorted(got) == sorted(reference), path
        unequal = [n for n in reference if not torch.equal(got[n], reference[n])]
        assert not unequal, (path, unequal)
    assert "model.layers.1.mlp.experts.gate_up_proj" in out[str(per_expert)]["params"]  # fused in the model

    events = {p: out[p]["events"] for p in paths}
    assert [(e["event"], e["fused_from_per_expert"]) for e in events[str(per_expert)]] == [("meta init", 4)]
    assert [(e["event"], e["fused_from_per_expert"]) for e in events[str(fused)]] == [("meta init", 0)]
    assert [(e["event"], e["fused_from_per_expert"]) for e in events[str(mixtral)]] == [("meta init", 4)]
    (fallback,) = events[str(lacking)]
    assert fallback["event"].startswith("meta init fallback")
    assert fallback["unmapped_count"] == 1
    assert list(fallback["unmapped"]) == ["model.norm.weight"]
    assert "not in the checkpoint" in fallback["unmapped"]["model.norm.weight"]


@pytest.mark.parametrize("damage", ["truncated", "corrupt_header"])
@pytest.mark.parametrize("layout", ["one_file", "indexed_shards"])
def test_an_unreadable_safetensors_file_is_an_error_naming_it(tmp_path, layout, damage):
    """A truncated file (its tail cut off, as an interrupted copy leaves it) or one with a
    corrupt header stops the load with ``CheckpointUnreadable`` naming the file; before,
    safetensors' own error ("Error while deserializing header: incomplete metadata, file
    not fully covered") named no file, and for an indexed checkpoint it came from the
    full-load fallback on every rank. One process, no ranks: the check runs before
    sharding."""
    from trainer.sharded_init import CheckpointUnreadable, meta_policy

    folder = tmp_path / "moe"
    _qwen3_moe().save_pretrained(folder, max_shard_size="150KB" if layout == "indexed_shards" else "50GB")
    files = sorted(folder.glob("*.safetensors"))
    assert (len(files) == 1) == (layout == "one_file")
    victim = files[-1]
    if damage == "truncated":
        os.truncate(victim, victim.stat().st_size - 1000)
    else:
        with open(victim, "r+b") as f:
            f.seek(8)
            f.write(b"\x00garbage")
    with pytest.raises(CheckpointUnreadable) as raised:
        meta_policy(str(folder), torch.device("cpu"))
    assert str(victim) in str(raised.value)
    assert "truncated or corrupt" in str(raised.value)


def test_an_index_placing_a_tensor_in_the_wrong_file_is_an_error_naming_it(tmp_path):
    """An index whose file lacks a tensor it names (a shard from another save) is an
    error naming the file and tensor, not a KeyError deep in the load."""
    import json

    from trainer.sharded_init import CheckpointUnreadable, meta_policy

    folder = tmp_path / "moe"
    _qwen3_moe().save_pretrained(folder, max_shard_size="150KB")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointUnreadable) as raised:
        meta_policy(str(folder), torch.device("cpu"))
    assert str(folder / files[1]) in str(raised.value) and name in str(raised.value)


def test_the_plan_reads_fused_experts_in_from_pretrained_order(tmp_path):
    """The per-expert keys of a fused parameter, in the order from_pretrained stacks them
    (natural order: expert 10 after expert 9, not after expert 1), gate before up."""
    from trainer.checkpoint_map import StackedExperts, checkpoint_map
    from trainer.sharded_init import build_on_meta, checkpoint_index

    folder = tmp_path / "moe"
    _qwen3_moe(num_experts=12).save_pretrained(folder)
    mapping = checkpoint_map(build_on_meta(str(folder)), checkpoint_index(str(folder)))
    assert mapping.unmapped == {}
    plan = mapping.plans["model.layers.1.mlp.experts.gate_up_proj"]
    assert isinstance(plan, StackedExperts) and plan.concat_dim == 0
    prefix = "model.layers.1.mlp.experts"
    assert [[key for key, _ in sources] for sources in plan.experts] == [
        [f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight"] for e in range(12)]
    down = mapping.plans["model.layers.1.mlp.experts.down_proj"]
    assert [[key for key, _ in sources] for sources in down.experts] == [
        [f"{prefix}.{e}.down_proj.weight"] for e in range(12)]
