"""Helpers for tests and benchmarks of the sampler (and of components that need one);
they live under tests/, not in the installed ``sampler`` package.

* :func:`agent_model_dir`: the tiny model trained longer (150 steps instead of 40):
  its distributions are peaked enough that vLLM's and PyTorch's bf16 kept sets agree
  on >= 99% of positions, and it reliably writes ``<tool>...</tool>`` calls and
  ``<summary>`` answers. Built once (about 20 s of CPU) and cached like
  :func:`sampler.tiny_model.tiny_model_dir`.
* :func:`start_test_engine`: a started :class:`VLLMEngine` with the test settings.
  Close it when the module is done: vLLM allows one live in-process engine per
  process (closing any engine tears down process-global state under the others).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sampler.tiny_model import tiny_model_dir

if TYPE_CHECKING:
    from sampler.vllm_engine import VLLMEngine

AGENT_MODEL_TRAIN_STEPS = 150
TEST_ENGINE_SETTINGS = {"max_model_len": 512, "kept_set_cap": 64}


def agent_model_dir() -> Path:
    return tiny_model_dir(train_steps=AGENT_MODEL_TRAIN_STEPS)


async def start_test_engine(model_path: str | Path | None = None, **settings) -> "VLLMEngine":
    from sampler.vllm_engine import VLLMEngine

    return await VLLMEngine(str(model_path or agent_model_dir()), **{**TEST_ENGINE_SETTINGS, **settings}).start()
