"""Tensors as raw bits: the codec never looks at values, only at their bit patterns.

Every tensor is viewed (zero-copy) as a flat array of unsigned integers of its element
width: bf16/fp16 as uint16, fp32 as uint32, fp8 (e4m3/e5m2) as uint8, and so on. XOR
of two such views is exact whatever the dtype, including NaNs and signed zeros.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

UINT_BY_ITEMSIZE = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def dtype_name(dtype: "torch.dtype") -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the manifest spelling)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in manifest")
    return dtype


def _int_dtype(itemsize: int) -> "torch.dtype":
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def check_supported(tensor: "torch.Tensor", name: str = "tensor") -> None:
    if tensor.device.type != "cpu":
        raise ValueError(f"{name}: weights must be CPU tensors, got device {tensor.device}")
    if tensor.is_complex() or tensor.element_size() not in UINT_BY_ITEMSIZE:
        raise ValueError(f"{name}: dtype {tensor.dtype} is not supported (need an element of 1, 2, 4 or 8 bytes)")
    import torch

    if tensor.layout != torch.strided:
        raise ValueError(f"{name}: only dense (strided) tensors are supported")


def bits_view(tensor: "torch.Tensor", name: str = "tensor") -> np.ndarray:
    """Flat unsigned-integer numpy view of a CPU tensor's bits (copies only if the
    tensor is not contiguous)."""
    check_supported(tensor, name)
    flat = tensor.detach().contiguous().reshape(-1)
    itemsize = flat.element_size()
    return flat.view(_int_dtype(itemsize)).numpy().view(UINT_BY_ITEMSIZE[itemsize])
