"""A tiny Qwen2-style model and byte-level BPE tokenizer, built locally (no downloads).

Rollway's tests and demos need a real Hugging Face checkpoint that vLLM (CPU) and
plain PyTorch can both load. ``build_tiny_model`` makes one in a few seconds:

1. a deterministic synthetic corpus of agent transcripts in Rollway's tool-call
   format (so the model has seen the format) plus small Python snippets;
2. a byte-level BPE tokenizer trained on it with ``tokenizers``;
3. a 2-layer Qwen2 (hidden 128, 2 heads of 64: vLLM's CPU attention rejects
   head_dim < 32) briefly trained on the corpus so its next-token distributions are
   peaked like a real model's (a random init is near uniform, which makes every top-p
   kept set almost the whole vocabulary);
4. saved as bf16 safetensors with a chat template.

Everything is seeded; the same arguments give bit-identical files.
``tiny_model_dir()`` caches the result under ``.cache/models/`` keyed by a hash of
this file and the arguments.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool>",
    "</tool>",
    "<output>",
    "</output>",
    "<summary>",
    "</summary>",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_FUNCS = ["add", "mul", "clamp", "reverse", "count_words", "fib", "is_prime", "flatten",
          "merge", "dedupe", "median", "parse_int", "slugify", "chunk", "rotate"]
_VARS = ["x", "y", "n", "items", "text", "values", "seq", "k", "lo", "hi", "acc", "word"]
_CMDS = ["python -m pytest -q", "ls", "cat solution.py", "python solution.py",
         "grep -n def solution.py", "python -c 'import solution'"]


def _snippet(rng: random.Random) -> str:
    f = rng.choice(_FUNCS)
    a, b = rng.sample(_VARS, 2)
    body = rng.choice([
        f"    return {a} + {b}\n",
        f"    if {a} < {b}:\n        return {a}\n    return {b}\n",
        f"    out = []\n    for {a} in {b}:\n        out.append({a})\n    return out\n",
        f"    {a} = 0\n    for i in range({b}):\n        {a} += i\n    return {a}\n",
        f"    return sorted({a}, key=lambda v: v * {b})\n",
    ])
    return f"def {f}({a}, {b}):\n{body}"


def _transcript(rng: random.Random) -> str:
    f = rng.choice(_FUNCS)
    parts = [f"<|im_start|>user\nFix `{f}` in solution.py so the tests pass.<|im_end|>\n",
             "<|im_start|>assistant\n"]
    for _ in range(rng.randint(1, 3)):
        cmd = rng.choice(_CMDS)
        parts.append(f"I will look first.\n<tool>run\n{cmd}</tool><|im_end|>\n")
        out = rng.choice(["1 passed", "1 failed", "solution.py", f"def {f}(x, y):", "ok"])
        parts.append(f"<|im_start|>tool\n<output>{out}</output><|im_end|>\n<|im_start|>assistant\n")
    parts.append(f"<tool>write solution.py\n{_snippet(rng)}</tool><|im_end|>\n")
    parts.append("<|im_start|>tool\n<output>wrote solution.py</output><|im_end|>\n")
    parts.append("<|im_start|>assistant\n<tool>submit</tool><|im_end|>\n")
    if rng.random() < 0.2:
        parts.append("<|im_start|>assistant\n<summary>Edited solution.py; tests pass.</summary><|im_end|>\n")
    return "".join(parts)


def _chat_transcript(rng: random.Random, render) -> str:
    """The same episode as :func:`_transcript` in a chat format: the template's render
    with the tools, Hermes-style ``<tool_call>`` JSON calls and ``tool`` replies."""
    f = rng.choice(_FUNCS)

    def call(name: str, **arguments) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}]}

    messages = [{"role": "user", "content": f"Fix `{f}` in solution.py so the tests pass.\nFiles: solution.py"}]
    for _ in range(rng.randint(1, 3)):
        messages.append(call("run", command=rng.choice(_CMDS)))
        out = rng.choice(["1 passed", "1 failed", "solution.py", f"def {f}(x, y):", "ok"])
        messages.append({"role": "tool", "tool_call_id": "call_0", "name": "run", "content": out})
    messages.append(call("write", path="solution.py", content=_snippet(rng)))
    messages.append({"role": "tool", "tool_call_id": "call_0", "name": "write", "content": "wrote solution.py"})
    messages.append(call("submit"))
    return render(messages, False)


def synthetic_corpus(num_docs: int = 600, seed: int = 0, format: str = "rollway") -> list[str]:
    """Agent transcripts (every other document) in ``format`` and code snippets."""
    rng = random.Random(seed)
    if format == "rollway":
        return [_transcript(rng) if i % 2 == 0 else _snippet(rng) for i in range(num_docs)]
    from sampler.formats.tokenizers import template_renderer

    render = template_renderer(format)
    return [_chat_transcript(rng, render) if i % 2 == 0 else _snippet(rng) for i in range(num_docs)]


def train_tokenizer(corpus: list[str], vocab_size: int):
    """A byte-level BPE whose normalizer and pre-tokenizer are exactly Qwen2's.

    Why Qwen2's: the saved folder says ``model_type: qwen2``, so ``AutoTokenizer`` (and
    with it vLLM and every sampler) loads it as ``Qwen2Tokenizer``, which rebuilds the
    tokenizer from vocab + merges with *its own* pre-tokenizer (digits one by one, spaces
    split from the word that follows). Trained with another pre-tokenizer, the tokenizer a
    model is trained with and the one it is served with disagree (``" 2"`` vs ``" ", "2"``):
    the warm start learned to copy numbers as tokens the samplers never show it."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def build_tiny_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    train_steps: int = 40,
    seed: int = 0,
    format: str = "rollway",
) -> Path:
    """Write a Hugging Face checkpoint (config, bf16 safetensors, tokenizer) to out_dir.
    ``format``: ``rollway`` (the dialect's ``<tool>`` tokens) or ``chatml-hermes`` (Qwen2.5's
    layout: ``<tool_call>``/``</tool_call>`` added tokens and its chat template with tools;
    sampler/formats)."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if format not in ("rollway", "chatml-hermes"):
        raise ValueError(f"the tiny model is built in the rollway or chatml-hermes format, not {format!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = synthetic_corpus(seed=seed, format=format)
    if format == "rollway":
        raw_tok = train_tokenizer(corpus, vocab_size)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=raw_tok,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            bos_token=None,
            additional_special_tokens=SPECIAL_TOKENS[3:],
        )
        tokenizer.chat_template = CHAT_TEMPLATE
    else:
        from sampler.formats import tokenizers

        raw_tok = tokenizers.train_tokenizer(format, corpus, vocab_size)
        tokenizer = tokenizers.hf_tokenizer(raw_tok, format)
    real_vocab = len(raw_tok.get_vocab())

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=real_vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config).float()
    _pretrain(model, raw_tok, corpus, train_steps, seed)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "rollway_tiny.json").write_text(json.dumps({"seed": seed, "train_steps": train_steps, "format": format}))
    log.info("tiny model built", path=str(out), vocab=real_vocab, params=sum(p.numel() for p in model.parameters()))
    return out


def _pretrain(model, raw_tok, corpus: list[str], steps: int, seed: int) -> None:
    """A few hundred AdamW steps on the corpus: enough to make distributions peaked."""
    import torch

    if steps <= 0:
        return
    ids: list[int] = []
    for doc in corpus:
        ids.extend(raw_tok.encode(doc).ids)
    data = torch.tensor(ids, dtype=torch.long)
    seq, batch = 128, 16
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    log.info("tiny model pretrained", steps=steps, final_loss=round(loss.item(), 3))


def tiny_model_dir(cache_root: str | Path | None = None, **kwargs) -> Path:
    """Build (once) and return the cached tiny model for these arguments."""
    import inspect

    # Key on every argument with defaults filled in, so seed=0 and no seed share a cache.
    params = {
        name: p.default for name, p in inspect.signature(build_tiny_model).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    unknown = set(kwargs) - set(params)
    if unknown:
        raise TypeError(f"tiny_model_dir: unknown arguments {sorted(unknown)}")
    params.update(kwargs)
    key_src = Path(__file__).read_bytes() + json.dumps(params, sort_keys=True).encode()
    key = hashlib.sha256(key_src).hexdigest()[:12]
    root = Path(cache_root or os.environ.get("ROLLWAY_CACHE", REPO_ROOT / ".cache")) / "models"
    final = root / f"tiny-{key}"
    if (final / "rollway_tiny.json").exists():
        return final
    tmp = root / f".tiny-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(tmp, **kwargs)
    try:
        tmp.rename(final)  # atomic: concurrent builders race harmlessly
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_tiny_moe(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    *,
    kind: str = "qwen3_moe",
    hidden_size: int = 64,
    layers: int = 2,
    experts: int = 4,
    top_k: int = 1,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """A random-init sparse MoE (transformers' Qwen3-MoE or Mixtral, every layer sparse,
    top-k weights renormalised) with ``tokenizer_dir``'s tokenizer, saved to ``out_dir``.
    No training: routing replay tests need routes, not skill."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, Qwen3MoeConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=hidden_size // 2, num_experts_per_tok=top_k, max_position_embeddings=2048,
                  tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(**common, num_experts=experts, moe_intermediate_size=hidden_size // 2,
                                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    elif kind == "mixtral":
        config = MixtralConfig(**common, num_local_experts=experts)
    else:
        raise ValueError(f"unknown MoE kind {kind!r} (qwen3_moe, mixtral)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
