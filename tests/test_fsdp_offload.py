"""FSDP2 CPU offload as a setting (``trainer.fsdp.cpu_offload``, issue #28): torch's
CPUOffloadPolicy goes to ``fully_shard`` on CUDA ranks; on CPU ranks, where everything is
in host memory already, the trainer refuses it with one line naming the setting instead
of ignoring it. Cheap (no ranks start: ~10 s, two ``rollway`` processes' imports); the
offloaded run itself needs a GPU (benchmarks/gpu_check_fsdp.sh)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from rollway.config import RollwayConfig
from tests.cli import run_cli
from trainer.config import FsdpConfig, TrainerConfig
from trainer.distributed import backend_for, offload_policy
from trainer.training_config import training_config_hash, training_settings

# TrainerConfig()'s hash before trainer.world_size and trainer.fsdp existed (commit f79fc5e).
HASH_BEFORE = "7f4554199ac3191a"
REFUSAL = ("trainer.fsdp.cpu_offload = true needs CUDA ranks, but this trainer runs on cpu, where parameters, "
           "gradients and optimizer state are in host memory already; set it to false")


def test_offload_is_off_by_default_and_hashed_only_when_on():
    assert TrainerConfig().fsdp == FsdpConfig(cpu_offload=False)
    assert "fsdp" not in training_settings(TrainerConfig())
    assert training_config_hash(TrainerConfig()) == HASH_BEFORE  # old logs keep replaying
    on = TrainerConfig(world_size=2, fsdp=FsdpConfig(cpu_offload=True))
    assert training_settings(on)["fsdp"] == {"cpu_offload": True}
    assert training_config_hash(on) != training_config_hash(TrainerConfig(world_size=2))
    # At one rank offload runs the sharded trainer (one GPU, state in host memory).
    assert TrainerConfig(fsdp=FsdpConfig(cpu_offload=True)).sharded
    assert not TrainerConfig().sharded and TrainerConfig(world_size=2).sharded


def test_offload_gives_fully_shard_the_cpu_offload_policy_on_cuda_and_is_refused_on_cpu():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    assert offload_policy(True, cuda) == CPUOffloadPolicy(pin_memory=True)
    assert type(offload_policy(False, cuda)) is OffloadPolicy  # the default: no offload
    assert type(offload_policy(False, torch.device("cpu"))) is OffloadPolicy
    with pytest.raises(RuntimeError) as refused:
        offload_policy(True, torch.device("cpu"))
    assert str(refused.value) == REFUSAL
    # The offloaded shards are CPU tensors: their collectives need gloo beside NCCL.
    assert (backend_for(cuda, True), backend_for(cuda, False)) == ("cuda:nccl,cpu:gloo", "nccl")
    assert backend_for(torch.device("cpu"), False) == "gloo"
    with pytest.raises(ValueError, match=r"^trainer.fsdp.cpu_offload = true needs CUDA ranks, but trainer.device"):
        TrainerConfig(world_size=2, device="cpu", fsdp=FsdpConfig(cpu_offload=True))


@pytest.mark.parametrize("command,world_size", [("trainer", 1), ("replay", 2)])
def test_a_cpu_only_machine_refuses_offload_before_any_rank_starts(tmp_path, tiny_model_path, command, world_size):
    """trainer.device "auto" on a machine without CUDA (CUDA_VISIBLE_DEVICES empty): the
    command prints one line naming the setting and exits 2; no rank is launched. At
    world size 1 too: before, the 1-process trainer would have ignored the setting."""
    config = tmp_path / "rollway.toml"
    trainer = TrainerConfig(model_path=str(tiny_model_path), world_size=world_size,
                            fsdp=FsdpConfig(cpu_offload=True))
    config.write_bytes(msgspec.toml.encode(RollwayConfig(trainer=trainer)))
    args = ["trainer", "--max-steps", "1"] if command == "trainer" else ["replay", "--from-step", "1", "--no-checkpoint"]
    result = run_cli(*args, config=config, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [f"rollway {command}: {REFUSAL}"]
    assert "launching trainer ranks" not in result.stdout + result.stderr
