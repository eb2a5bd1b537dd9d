"""The policy model: loading, device, determinism and the weights hash."""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Mapping

import numpy as np
import structlog

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)


def pick_device(name: str) -> "torch.device":
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device = 'cuda' but no CUDA device is available")
    return torch.device(name)


def make_deterministic(seed: int, num_threads: int = 0) -> None:
    """Seeds and deterministic kernels. Call before the model is built."""
    # cuBLAS needs this workspace setting for deterministic GEMMs; must be set before
    # the first CUDA context.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    if num_threads > 0:
        torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def load_policy(model_path: str, device: "torch.device") -> "torch.nn.Module":
    """The model in float32 (master weights; the sampler's copy is cast on publish)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"trainer.model_path {model_path!r} is not a model directory")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device)
    model.train()
    if getattr(model.config, "use_cache", None) is not None:
        model.config.use_cache = False
    return model


def weights_hash(state: Mapping[str, "torch.Tensor"]) -> str:
    """The system's one weights digest (``syncer.hashing.state_dict_hash``: BLAKE3 over
    name, dtype, shape and raw bits of every tensor, names sorted).

    This is the train-step log's hash (of the float32 master parameters, see
    :func:`model_hash`): replay compares it bit for bit. Announced weights carry the same
    function over the published copy, so the two agree whenever that copy is the
    masters themselves (``publish_dtype = "float32"``, untied model; docs/contracts.md).
    BLAKE3 rather than sha256: the trainer hashes every step, ~11x faster measured.
    """
    from syncer.hashing import state_dict_hash

    return state_dict_hash({name: t.detach().cpu() for name, t in state.items()})


def model_hash(model: "torch.nn.Module") -> str:
    """``TrainStep.weights_hash``: the parameters as trained (float32, tied weights once,
    no buffers)."""
    return weights_hash(dict(model.named_parameters()))


def publishable_state(model: "torch.nn.Module", dtype_name: str) -> dict[str, "torch.Tensor"]:
    """HF-named CPU copies of the weights in the dtype the samplers run."""
    import torch

    dtype = getattr(torch, dtype_name)
    return {name: p.detach().to(device="cpu", dtype=dtype, copy=True) for name, p in model.state_dict().items()}
