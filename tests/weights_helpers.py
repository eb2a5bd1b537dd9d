"""Shared pieces of the weight-sync tests: a toy model named like an HF transformer,
its states, stores of both kinds, and a subscriber applying into a module."""

from __future__ import annotations

import contextlib
import uuid

import msgspec
import numpy as np
import torch

from syncer.apply import ModuleTarget
from syncer.bits import bits_view
from syncer.publisher import WeightPublisher
from syncer.store import LocalStore, open_store
from syncer.subscriber import WeightSubscriber

MODEL = "toy"


class Toy(torch.nn.Module):
    """Parameters named like a small HF transformer, mixed dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 64, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(64, 96, dtype=torch.bfloat16)
        self.norm = torch.nn.LayerNorm(96, dtype=torch.float32)
        self.register_buffer("scale_fp8", torch.zeros(128, dtype=torch.float8_e4m3fn))
        self.register_buffer("half_buf", torch.zeros(40, 3, dtype=torch.float16))


def initial_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(300, 64, generator=g) * 0.02).to(torch.bfloat16),
        "proj.weight": (torch.randn(96, 64, generator=g) * 0.02).to(torch.bfloat16),
        "proj.bias": torch.zeros(96, dtype=torch.bfloat16),
        "norm.weight": torch.ones(96),
        "norm.bias": torch.zeros(96),
        "scale_fp8": torch.randn(128, generator=g).to(torch.float8_e4m3fn),
        "half_buf": torch.randn(40, 3, generator=g).to(torch.float16),
    }


def optimizer_like_step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A small signed update on every float tensor (most bf16 values stay identical);
    the fp8 buffer and the LayerNorm bias stay untouched."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if name in ("scale_fp8", "norm.bias"):
            out[name] = t.clone()
            continue
        master = t.float()
        out[name] = (master - 2e-4 * torch.sign(torch.randn(master.shape, generator=g))).to(t.dtype)
    return out


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert np.array_equal(bits_view(got[name]), bits_view(want[name])), name


@contextlib.asynccontextmanager
async def weight_store(kind: str, tmp_path, cfg, request):
    """A local folder store (``file``) or an S3 one on the moto endpoint (``s3``)."""
    if kind == "file":
        async with LocalStore(tmp_path / "weights") as s:
            yield s
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        s3cfg = msgspec.structs.replace(cfg, s3_endpoint_url=endpoint)
        async with open_store(f"s3://w{uuid.uuid4().hex[:12]}/rollway", s3cfg) as s:
            await s.ensure_bucket()
            yield s


async def publish_all(cfg, store, versions, upto=3) -> WeightPublisher:
    """Versions 1..upto, published in order (trainer step 10 * version)."""
    pub = WeightPublisher(cfg, MODEL, store)
    for v in range(1, upto + 1):
        await pub.publish(v, versions[v], trainer_step=10 * v)
    return pub


def subscriber(cfg, store, module=None):
    """A subscriber applying into ``module`` (default: a fresh Toy), and its target."""
    target = ModuleTarget(module if module is not None else Toy())
    return WeightSubscriber(cfg, MODEL, store, target), target
