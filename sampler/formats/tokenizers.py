"""Tokenizers in each family's published layout, built locally (no downloads): a small
byte-level BPE with the family's added tokens (special where the authors mark them
special, ordinary added tokens where they do not: Qwen's ``<tool_call>`` and ``<think>``)
and the family's chat template. The golden tests build them; the tiny model's
``chatml-hermes`` tokenizer is one (``rollway model init --format chatml-hermes``)."""

from __future__ import annotations

from sampler.formats import templates

# (special tokens, ordinary added tokens, eos, bos, template), as each family publishes them
# (the subset a tool-calling agent meets; Qwen's vision/FIM tokens are left out).
LAYOUTS: dict[str, tuple[list[str], list[str], str, str | None, str]] = {
    "chatml-hermes": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                      ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
                      "<|im_end|>", None, templates.QWEN25),
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
              "<|im_end|>", None, templates.QWEN3),
    "qwen3-coder": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
                    "<|im_end|>", None, templates.QWEN3_CODER),
    "llama3-json": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"],
                    [], "<|eot_id|>", "<|begin_of_text|>", templates.LLAMA3_JSON),
}


def build_tokenizer(family: str, corpus: list[str], vocab_size: int = 800, *, extra_special: list[str] | None = None):
    """A ``PreTrainedTokenizerFast`` in ``family``'s layout, BPE-trained on ``corpus``
    with Qwen2's pre-tokenizer (the Qwen families' own; Llama 3's differs only in detail)."""
    return hf_tokenizer(train_tokenizer(family, corpus, vocab_size, extra_special=extra_special), family)


def train_tokenizer(family: str, corpus: list[str], vocab_size: int, *, extra_special: list[str] | None = None):
    """The raw ``tokenizers.Tokenizer``: byte-level BPE with the family's added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    special, ordinary, _eos, _bos, _template = LAYOUTS[family]
    special = special + [t for t in (extra_special or []) if t not in special]
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
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in ordinary])
    return raw


def pad_token(family: str) -> str:
    return "<|finetune_right_pad_id|>" if family == "llama3-json" else LAYOUTS[family][0][0]


def hf_tokenizer(raw, family: str):
    """``raw`` as a ``PreTrainedTokenizerFast`` with the family's eos/bos/pad and template."""
    from transformers import PreTrainedTokenizerFast

    _special, _ordinary, eos, bos, template = LAYOUTS[family]
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=eos, bos_token=bos, pad_token=pad_token(family))
    tok.chat_template = template
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
