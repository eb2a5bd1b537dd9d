"""The warm start: a small Qwen2 trained from scratch, by SFT, on reference transcripts of
the task family's *train* split, so RL starts from a partial skill.

``build_warm_start(out_dir, cfg)``:

1. renders ``cfg.sft.steps * cfg.sft.batch_size`` distinct train tasks (seeded) as agent
   transcripts (:func:`trainer.sft.render_transcript`);
2. trains a byte-level BPE tokenizer on them (train split only: the held-out split is
   never seen, not even by the tokenizer);
   The transcripts are tokenized by the tokenizer as samplers load it
   (:func:`served_tokenizer`), never by the in-process object;
3. builds a Qwen2 (head_dim 64: vLLM's CPU attention needs >= 32) and runs
   :func:`trainer.sft.train_sft` single-threaded-deterministic;
4. saves bf16 safetensors + tokenizer + ``rollway_warm_start.json``.

``warm_start_dir()`` caches the result under ``.cache/models/`` keyed by the
arguments and the source of everything that shapes it (family, tool format, SFT), like
:func:`sampler.tiny_model.tiny_model_dir`. No downloads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import msgspec
import structlog

from sampler.formats.tokenizers import LAYOUTS
from trainer.sft import SFTConfig

log = structlog.get_logger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
MARKER = "rollway_warm_start.json"
# Sources whose change must rebuild the model (the cache key hashes them).
KEY_SOURCES = ("trainer/warm_start.py", "trainer/sft.py", "trainer/optim.py", "trainer/config.py", "trainer/model.py",
               "sampler/tool_format.py", "sampler/tiny_model.py", "tasks/spec.py")
KEY_SOURCE_DIRS = ("tasks/family",)
# What else shapes a warm start in a chat format (sampler/formats), keyed only for those.
CHAT_KEY_SOURCES = ("sampler/formats/sft.py", "sampler/formats/templates.py", "sampler/formats/tokenizers.py",
                    "sampler/formats/base.py", "sampler/formats/tools.py")
# The formats a warm start is built in: Rollway's dialect, and every family whose tokenizer
# layout (special tokens, eos, pad, chat template) sampler/formats/tokenizers.py publishes.
FORMATS = ("rollway", *LAYOUTS)


class WarmStartConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    vocab_size: int = 2048
    # Sized for the CPU budget: ~1.2 CPU-s per SFT step of 32 transcripts on one core,
    # so SFT fits the 10-minute, 2-core budget with room, and RL on CPU stays fast.
    hidden_size: int = 128
    layers: int = 4
    heads: int = 2
    kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 2048
    seed: int = 0
    sft: SFTConfig = msgspec.field(default_factory=SFTConfig)
    # The chat format of the transcripts and tokenizer: "chatml-hermes" (Qwen2.5's layout
    # and chat template with the tools as JSON schemas, <tool_call> special tokens;
    # sampler/formats), the main job's default; another family of FORMATS in its own
    # layout (qwen3, qwen3-coder, llama3-json); or "rollway" (the <tool> dialect).
    format: str = "chatml-hermes"
    # Share of the arith and text transcripts in their long form (three operations or
    # steps; tasks.family.generate): without any the warm start never writes a third
    # operation (0 of 72 samples, docs/results.md), so the feeder's long tasks would be
    # dead draws. 0 = the transcripts as before long forms existed.
    long_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.long_share <= 1.0:
            raise ValueError(f"long_share must lie in [0, 1], got {self.long_share}")
        if self.format not in FORMATS:
            raise ValueError(f"the warm start is built in one of the formats {', '.join(FORMATS)}, "
                             f"not {self.format!r}")
        if self.hidden_size % self.heads or self.hidden_size // self.heads < 32:
            raise ValueError(f"head_dim = hidden_size / heads must be an integer >= 32 (vLLM CPU), "
                             f"got {self.hidden_size}/{self.heads}")


def _hf_tokenizer(raw_tok):
    from transformers import PreTrainedTokenizerFast

    from sampler.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw_tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _transcript_text(spec) -> str:
    """The transcript as plain text, for training the tokenizer."""
    from sampler import tool_format as fmt
    from trainer.sft import reference_turns

    parts = [text for text, _ in fmt.task_prompt(spec.instruction, spec.files)]
    for message, reply in reference_turns(spec):
        parts += [text for text, _ in fmt.assistant_header("")] + [message]
        if reply is not None:
            parts += [text for text, _ in fmt.tool_reply(reply, closed_turn=False)]
    return "".join(parts)


def build_warm_start(out_dir: str | Path, cfg: WarmStartConfig, *, on_step=None) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sampler.tiny_model import train_tokenizer
    from tasks.family import generate
    from trainer.model import make_deterministic
    from trainer.sft import render_transcript, submit_token, train_sft

    started = time.perf_counter()
    # The key of the sources this build reads, taken before it reads them: a build takes
    # up to an hour on 2 cores, and a key taken at the end named sources edited meanwhile
    # (the folder warm_start_dir names by the key at the start then held a marker with another).
    key = cache_key(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    make_deterministic(cfg.seed, cfg.sft.num_threads)
    specs = generate("train", cfg.sft.examples, seed=cfg.seed, long_share=cfg.long_share)
    if cfg.format != "rollway":
        from sampler.formats import tokenizers
        from sampler.formats.sft import chat_transcript_text

        render = tokenizers.template_renderer(cfg.format)
        raw_tok = tokenizers.train_tokenizer(cfg.format, [chat_transcript_text(s, render) for s in specs],
                                             cfg.vocab_size)
        end, pad = LAYOUTS[cfg.format].eos, LAYOUTS[cfg.format].pad
    else:
        raw_tok = train_tokenizer([_transcript_text(s) for s in specs], cfg.vocab_size)
        end, pad = "<|im_end|>", "<|endoftext|>"
    config = Qwen2Config(
        vocab_size=len(raw_tok.get_vocab()),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden_size // cfg.heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=raw_tok.token_to_id(end),
        pad_token_id=raw_tok.token_to_id(pad),
        bos_token_id=None,
        use_cache=False,
    )
    first_actions = None
    if cfg.format != "rollway":
        from sampler.formats import load_format
        from sampler.formats import sft as chat_sft

        tokenizer = served_tokenizer(tokenizers.hf_tokenizer(raw_tok, cfg.format), config, out)
        chat = load_format(tokenizer, cfg.format)
        rendered = [chat_sft.render_chat_transcript(s, chat) for s in specs]
        examples = [(ids, mask) for ids, mask, _ in rendered]
        first_actions = [first for _, _, first in rendered]
        submit = chat_sft.submit_token(chat)
    else:
        tokenizer = served_tokenizer(_hf_tokenizer(raw_tok), config, out)
        examples = [render_transcript(s, tokenizer) for s in specs]
        submit = submit_token(tokenizer)
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(config).float()
    params = sum(p.numel() for p in model.parameters())
    lengths = sorted(len(ids) for ids, _ in examples)
    log.info("warm start: sft", params=params, examples=len(examples), tokens_median=lengths[len(lengths) // 2],
             tokens_max=lengths[-1])
    hook = None if on_step is None else (lambda step, loss: on_step(step, loss, model, tokenizer))
    summary = train_sft(model, examples, cfg.sft, pad_id=config.pad_token_id, submit_id=submit,
                        on_step=hook, first_actions=first_actions)
    info = {"config": msgspec.to_builtins(cfg), "cache_key": key, "params": params, "sft": summary,
            "build_seconds": round(time.perf_counter() - started, 1)}
    save_model(model, tokenizer, out, info)
    log.info("warm start built", path=str(out), params=params, final_loss=round(summary["final_loss"], 4),
             seconds=info["build_seconds"])
    return out


def served_tokenizer(tokenizer, config, out: Path):
    """The tokenizer as samplers will load it: saved next to the model config and read
    back with ``AutoTokenizer``, which picks the class from the config's model type (for
    Qwen2 it rebuilds the pre-tokenizer). SFT renders its transcripts with this one, so
    the model is trained on exactly the token stream it is served."""
    from transformers import AutoTokenizer

    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def save_model(model, tokenizer, out: Path, info: dict) -> None:
    """bf16 safetensors (what the samplers run), tokenizer, and the marker file last."""
    import copy

    import torch

    copy_ = copy.deepcopy(model).to(torch.bfloat16)  # the caller's float32 model stays as is
    copy_.config.use_cache = True
    copy_.config.dtype = "bfloat16"
    copy_.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (Path(out) / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True))


def cache_key(cfg: WarmStartConfig) -> str:
    from importlib.metadata import version  # not the import: keying must stay cheap

    settings = msgspec.to_builtins(cfg)
    if settings.get("format") == "rollway":
        settings.pop("format")  # the key of a rollway warm start is what it was before formats existed
    if not settings.get("long_share"):
        settings.pop("long_share", None)  # likewise without long forms
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    # transformers' Qwen2Tokenizer decides how the saved tokenizer is served
    h.update(f"transformers {version('transformers')}".encode())
    files = [REPO_ROOT / p for p in KEY_SOURCES + (CHAT_KEY_SOURCES if cfg.format != "rollway" else ())]
    for folder in KEY_SOURCE_DIRS:
        files += sorted((REPO_ROOT / folder).glob("*.py"))
    for path in files:
        h.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def is_outdated(folder: str | Path) -> bool:
    """Whether the warm start in ``folder`` was built from other sources than today's
    for the settings it records (its cache key no longer matches them). A marker without
    a key predates keyed markers (and the served-tokenizer fix): outdated. A warm start
    built with other settings on purpose (``--seed``, ``--steps``) is not outdated."""
    info = json.loads((Path(folder) / MARKER).read_text())
    if "cache_key" not in info:
        return True
    try:
        cfg = msgspec.convert(info["config"], WarmStartConfig)
    except (msgspec.ValidationError, ValueError):
        return True  # settings this version no longer has
    return cache_key(cfg) != info["cache_key"]


def warm_start_dir(cfg: WarmStartConfig | None = None, cache_root: str | Path | None = None) -> Path:
    """Build (once) and return the cached warm-start model for ``cfg``."""
    cfg = cfg or WarmStartConfig()
    key = cache_key(cfg)
    root = Path(cache_root or os.environ.get("ROLLWAY_CACHE", REPO_ROOT / ".cache")) / "models"
    final = root / f"warm-{key}"
    if (final / MARKER).exists():
        return final
    tmp = root / f".warm-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build_warm_start(tmp, cfg)
    try:
        tmp.rename(final)  # atomic: concurrent builders race harmlessly
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
