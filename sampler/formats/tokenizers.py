"""Tokenizers in each family's published layout, built locally (no downloads): a small
byte-level BPE with the family's added tokens (special where the authors mark them
special, ordinary added tokens where they do not: Qwen's ``<tool_call>`` and ``<think>``)
and the family's chat template. The golden tests build them; so do the tiny model
(``rollway model tiny --format chatml-hermes``) and the warm start in every family
(``rollway model init --format chatml-hermes|qwen3|qwen3-coder|llama3-json``)."""

from __future__ import annotations

from dataclasses import dataclass

from sampler.formats import templates


@dataclass(frozen=True)
class Layout:
    """A family's tokenizer layout as its authors publish it (the subset a tool-calling
    agent meets; Qwen's vision/FIM tokens are left out). The one table of these facts:
    the golden tests, the tiny model and the warm start (``rollway model init``) read it."""

    special: tuple[str, ...]  # special tokens, in id order (the BPE's first ids)
    ordinary: tuple[str, ...]  # added tokens the authors do not mark special
    eos: str  # ends an assistant turn: the tokenizer's and the model config's eos
    pad: str  # the model config's pad (a special token the model never has to write)
    template: str
    bos: str | None = None


_QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_CALLS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

LAYOUTS: dict[str, Layout] = {
    "chatml-hermes": Layout(_QWEN, _QWEN_CALLS, "<|im_end|>", "<|endoftext|>", templates.QWEN25),
    "qwen3": Layout(_QWEN, _QWEN_CALLS + ("<think>", "</think>"), "<|im_end|>", "<|endoftext|>", templates.QWEN3),
    "qwen3-coder": Layout(_QWEN, _QWEN_CALLS + ("<think>", "</think>"), "<|im_end|>", "<|endoftext|>",
                          templates.QWEN3_CODER),
    "llama3-json": Layout(("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"),
                          (), "<|eot_id|>", "<|finetune_right_pad_id|>", templates.LLAMA3_JSON,
                          bos="<|begin_of_text|>"),
}


def build_tokenizer(family: str, corpus: list[str], vocab_size: int = 800, *, extra_special: list[str] | None = None):
    """A ``PreTrainedTokenizerFast`` in ``family``'s layout, BPE-trained on ``corpus``
    with Qwen2's pre-tokenizer (the Qwen families' own; Llama 3's differs only in detail)."""
    return hf_tokenizer(train_tokenizer(family, corpus, vocab_size, extra_special=extra_special), family)


def train_tokenizer(family: str, corpus: list[str], vocab_size: int, *, extra_special: list[str] | None = None):
    """The raw ``tokenizers.Tokenizer``: byte-level BPE with the family's added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    layout = LAYOUTS[family]
    special = list(layout.special) + [t for t in (extra_special or []) if t not in layout.special]
    raw = Tokenizer(models.BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    raw.decoder = decoders.ByteLevel()
    raw.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(corpus, trainer=trainer)
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in layout.ordinary])
    return raw


def hf_tokenizer(raw, family: str):
    """``raw`` as a ``PreTrainedTokenizerFast`` with the family's eos/bos/pad and template."""
    from transformers import PreTrainedTokenizerFast

    layout = LAYOUTS[family]
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=layout.eos, bos_token=layout.bos, pad_token=layout.pad)
    tok.chat_template = layout.template
    return tok


def template_renderer(family: str):
    """``render(messages, add_generation_prompt) -> text`` with the family's template and the
    agent's tools, before the model's own tokenizer exists (a throwaway one renders)."""
    from sampler.formats.tools import TOOL_SCHEMAS

    tok = build_tokenizer(family, ["x"], vocab_size=300)

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return tok.apply_chat_template(messages, tools=TOOL_SCHEMAS, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)

    return render
