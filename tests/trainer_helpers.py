"""Shared by the trainer tests: import the fixtures into a test module to use them."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two OpenMP threads contend badly
    (steps 20x slower), and bit-exact comparisons need a fixed thread count anyway."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
