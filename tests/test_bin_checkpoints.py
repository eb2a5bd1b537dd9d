"""Model folders as PyTorch pickles (issue #28): ``pytorch_model.bin``, or shards
``pytorch_model-0000x-of-0000y.bin`` with ``pytorch_model.bin.index.json``, as many
Qwen/Llama fine-tunes still ship. Both trainers load them to exactly the parameters of
the same weights as .safetensors: the single-process one through from_pretrained, the
sharded one through meta-device init, which now reads each rank's rows of a .bin from
``torch.load(weights_only=True, mmap=True)`` (before: every .bin checkpoint fell back to
loading the whole model on every rank, and an indexed one's unreadable shard was an
error naming no file).

transformers 5's ``save_pretrained`` writes safetensors whatever ``safe_serialization``
says, so the .bin folders are written as transformers 4 wrote them: ``torch.save`` of
the state dict, split by huggingface_hub's ``split_torch_state_dict_into_shards`` (the
splitter ``save_pretrained`` uses) with the ``pytorch_model{suffix}.bin`` pattern."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.fsdp_helpers import run_ranks


def _qwen3_moe():
    """Per-expert tensors in the checkpoint, fused parameters in the model: the .bin
    exercises meta init's stacked path too."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4,
        num_experts_per_tok=2, vocab_size=128, tie_word_embeddings=False))


def _qwen2_tied():
    """A tied head (one tensor in the checkpoint for two names in the model), bfloat16
    as the samplers' checkpoints are."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    return Qwen2ForCausalLM(Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=160, tie_word_embeddings=True)).to(torch.bfloat16)


def _safetensors_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def _as_bin(src: Path, dst: Path, max_shard_size: str | None = None, legacy: bool = False) -> Path:
    """``src``'s weights (every tensor save_pretrained wrote, same names, same bits) as
    one ``pytorch_model.bin`` or as indexed shards; the config files copied."""
    from huggingface_hub import split_torch_state_dict_into_shards

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    state = _safetensors_state(src)
    if max_shard_size is None:
        torch.save(state, dst / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
        return dst
    split = split_torch_state_dict_into_shards(state, filename_pattern="pytorch_model{suffix}.bin",
                                               max_shard_size=max_shard_size)
    assert split.is_sharded
    for filename, names in split.filename_to_tensors.items():
        torch.save({name: state[name] for name in names}, dst / filename)
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": split.metadata, "weight_map": split.tensor_to_filename}))
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Each model as safetensors (indexed shards for the MoE), one .bin, indexed .bin shards."""
    root = tmp_path_factory.mktemp("bin-ckpt")
    out = {}
    for name, build, shard in (("moe", _qwen3_moe, "150KB"), ("tied", _qwen2_tied, "20KB")):
        st = root / f"{name}-st"
        build().save_pretrained(st, max_shard_size=shard)
        out[f"{name}-st"] = st
        out[f"{name}-bin"] = _as_bin(st, root / f"{name}-bin")
        out[f"{name}-bins"] = _as_bin(st, root / f"{name}-bins", max_shard_size=shard)
    for name in ("moe", "tied"):
        assert sorted(p.name for p in out[f"{name}-bin"].glob("*.bin")) == ["pytorch_model.bin"]
        assert len(list(out[f"{name}-bins"].glob("pytorch_model-*-of-*.bin"))) > 2
        for layout in ("bin", "bins"):
            assert not list(out[f"{name}-{layout}"].glob("*.safetensors"))
    return out


def _cfg(path: Path):
    from trainer.config import TrainerConfig

    return TrainerConfig(model_path=str(path), device="cpu", num_threads=1)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_equal(got: dict, reference: dict, what: str) -> None:
    assert sorted(got) == sorted(reference), what
    unequal = [n for n in reference if got[n].dtype != reference[n].dtype or not torch.equal(got[n], reference[n])]
    assert not unequal, (what, unequal)


def test_the_single_process_trainer_loads_bin_folders_bit_identical_to_safetensors(folders):
    """``TrainCore`` (the trainer at world size 1) from each folder: float32 parameters
    equal (``torch.equal``, same dtype) to the safetensors folder's, tied head included;
    the state dict in the .bin is the one in the .safetensors (same names and bits)."""
    from trainer.core import TrainCore

    for name in ("moe", "tied"):
        reference = _params(TrainCore(_cfg(folders[f"{name}-st"])).model)
        assert all(t.dtype == torch.float32 for t in reference.values())
        for layout in ("bin", "bins"):
            _assert_equal(_params(TrainCore(_cfg(folders[f"{name}-{layout}"])).model), reference, f"{name}-{layout}")
    assert "lm_head.weight" not in reference  # tied: one parameter


def test_meta_init_reads_bin_folders_row_by_row_bit_identical_on_two_ranks(folders, tmp_path_factory):
    """The sharded trainer on 2 ranks (one launch, ~15 s on 2 cores) builds from the
    single and the indexed .bin of both models with meta-device init (each rank reads its
    rows from the memory-mapped .bin; the MoE's fused expert parameters from per-expert
    tensors) and gathers exactly the parameters of the 1-process float32 load of the
    safetensors folder. Before, every .bin took the whole-model fallback
    (``meta_init`` False)."""
    from trainer.model import load_policy

    paths = [str(folders[f"{name}-{layout}"]) for name in ("moe", "tied") for layout in ("bin", "bins")]
    out, _ = run_ranks(2, "load", {"model_paths": paths}, tmp_path_factory.mktemp("bin-ranks"))
    assert {p: out[p]["meta_init"] for p in paths} == dict.fromkeys(paths, True)
    for name in ("moe", "tied"):
        reference = {n: p.detach() for n, p in load_policy(str(folders[f"{name}-st"]), torch.device("cpu"))
                     .named_parameters()}
        for layout in ("bin", "bins"):
            _assert_equal(out[str(folders[f"{name}-{layout}"])]["params"], reference, f"{name}-{layout}")
    fused = [(e["event"], e["fused_from_per_expert"]) for e in out[str(folders["moe-bins"])]["events"]]
    assert fused == [("meta init", 4)]


def test_checkpoint_index_of_a_bin_folder_names_each_tensors_file(folders):
    from trainer.checkpoint_files import checkpoint_index

    st = _safetensors_state(folders["moe-st"])
    single = checkpoint_index(str(folders["moe-bin"]))
    assert sorted(single) == sorted(st)
    assert set(single.values()) == {folders["moe-bin"] / "pytorch_model.bin"}
    index = json.loads((folders["moe-bins"] / "pytorch_model.bin.index.json").read_text())["weight_map"]
    assert checkpoint_index(str(folders["moe-bins"])) == {k: folders["moe-bins"] / f for k, f in index.items()}


def _damaged(folders, tmp_path: Path, layout: str, damage: str) -> tuple[Path, Path]:
    """A copy of the MoE's .bin folder with one file damaged: (folder, the file named)."""
    folder = tmp_path / f"{layout}-{damage}"
    shutil.copytree(folders[f"moe-{layout}"], folder)
    victim = sorted(folder.glob("*.bin"))[-1]
    if damage == "truncated":  # an interrupted copy: the zip's central directory is gone
        os.truncate(victim, victim.stat().st_size - 1000)
    elif damage == "missing":  # the index names a shard the folder lacks
        victim.unlink()
    return folder, victim


@pytest.mark.parametrize("layout,damage", [("bin", "truncated"), ("bins", "truncated"), ("bins", "missing")])
def test_an_unreadable_or_missing_bin_is_an_error_naming_it_in_both_trainers(folders, tmp_path, layout, damage):
    """Meta init (the sharded trainer's load, checked before sharding) and the
    single-process trainer both raise ``CheckpointUnreadable`` naming the file. Before:
    the sharded trainer fell back to from_pretrained, whose errors name no file
    ("PytorchStreamReader failed reading zip archive: failed finding central directory";
    a missing shard: an OSError from the hub's shard resolution), and the single-process
    trainer raised those directly."""
    from trainer.core import TrainCore
    from trainer.sharded_init import CheckpointUnreadable, meta_policy

    folder, victim = _damaged(folders, tmp_path, layout, damage)
    with pytest.raises(CheckpointUnreadable) as sharded:
        meta_policy(str(folder), torch.device("cpu"))
    with pytest.raises(CheckpointUnreadable) as single:
        TrainCore(_cfg(folder))
    for raised in (sharded, single):
        assert str(raised.value).startswith(f"{victim}: not a readable .bin file"), str(raised.value)


def test_the_safetensors_path_and_the_single_process_trainer_name_a_truncated_file(folders, tmp_path):
    """The single-process trainer now checks every weights file before from_pretrained,
    so a truncated .safetensors shard is ``CheckpointUnreadable`` naming it there too
    (before: safetensors' "incomplete metadata, file not fully covered", no file)."""
    from trainer.core import TrainCore
    from trainer.sharded_init import CheckpointUnreadable

    folder = tmp_path / "st"
    shutil.copytree(folders["moe-st"], folder)
    victim = sorted(folder.glob("*.safetensors"))[-1]
    os.truncate(victim, victim.stat().st_size - 1000)
    with pytest.raises(CheckpointUnreadable) as raised:
        TrainCore(_cfg(folder))
    assert str(raised.value).startswith(f"{victim}: not a readable .safetensors file")


class _Payload:
    """Pickles as a call of :func:`_touch`: what a hostile .bin carries."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_touch, (str(self.marker),))


def _touch(path: str) -> None:
    Path(path).write_text("unpickled")


def test_a_bin_holding_anything_but_tensors_is_refused_without_unpickling_it(folders, tmp_path):
    """A .bin whose pickle would call a function (here one that writes a marker file; a
    real one would run a shell) is ``CheckpointUnreadable`` naming the file, and the
    function never runs: ``weights_only=True`` refuses the global before calling it."""
    from trainer.sharded_init import CheckpointUnreadable, checkpoint_index

    folder = tmp_path / "hostile"
    shutil.copytree(folders["tied-bin"], folder)
    marker = tmp_path / "marker"
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save(dict(state, payload=_Payload(marker)), folder / "pytorch_model.bin")
    with pytest.raises(CheckpointUnreadable) as raised:
        checkpoint_index(str(folder))
    assert str(raised.value).startswith(f"{folder / 'pytorch_model.bin'}: not a readable .bin file")
    assert not marker.exists()


def test_a_pre_zip_bin_falls_back_to_the_whole_load_with_the_same_weights(folders, tmp_path):
    """torch's pre-1.6 pickle format cannot be memory-mapped: meta init logs the
    fallback and loads the whole model (from_pretrained reads that format), to the same
    parameters. One process: the fallback is decided before any sharding."""
    import structlog.testing

    from trainer.model import load_policy
    from trainer.sharded_init import meta_policy

    folder = _as_bin(folders["tied-st"], tmp_path / "legacy", legacy=True)
    assert (folder / "pytorch_model.bin").read_bytes()[:2] != b"PK"
    with structlog.testing.capture_logs() as logs:
        model, mapping = meta_policy(str(folder), torch.device("cpu"))
    assert mapping is None
    (event,) = [e for e in logs if e["event"].startswith("meta init")]
    assert event["event"].startswith("meta init fallback") and "zip-format" in event["why"]
    _assert_equal(_params(model), _params(load_policy(str(folders["tied-st"]), torch.device("cpu"))), "legacy")
