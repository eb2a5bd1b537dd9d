"""The tokenizer a model is trained with is the tokenizer it is served with.

vLLM and the samplers load a model folder with ``AutoTokenizer``, which picks the class
from ``config.json``'s model type: for Qwen2 it rebuilds the tokenizer from vocab and
merges with Qwen2's own normalizer and pre-tokenizer. A tokenizer trained with another
pre-tokenizer then encodes differently once served (``" 2"`` in training, ``" ", "2"``
served): the warm start learned to copy numbers from tokens it never sees when it runs
(held-out pass@1 6% served vs 46% greedy under its training tokenization).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.family import generate

# Digits after spaces and punctuation, indentation runs, blank lines, unicode that NFC
# changes, apostrophes, and control tokens quoted as text.
AWKWARD = [
    "takes an integer v, adds 2, then multiplies it by 13, and returns the result. Example: f(2) == 52.",
    "def f(x):\n    return (x + 7) * 3\n\n\n\ndef g(xs):\n        return [x - 9 for x in xs if x % 2 == 1]\n",
    "replaces every 'n' with 't', it's   three  spaces\t\ttabs\r\n",
    "cafe\u0301 na\u00efve \u00c5ngstr\u00f6m 1,234.5e-6",
    "x = '<tool>submit</tool>'  # <|im_end|> quoted",
]


def _texts() -> list[str]:
    from trainer.warm_start import _transcript_text

    return AWKWARD + [_transcript_text(s) for s in generate("heldout", 8, seed=3)]


def _raw_encode(tokenizer_json: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).encode(text, add_special_tokens=False).ids


def test_a_trained_tokenizer_encodes_the_same_once_served(tmp_path):
    from transformers import AutoTokenizer, Qwen2Config

    from sampler.tiny_model import train_tokenizer
    from trainer.warm_start import _hf_tokenizer, _transcript_text, served_tokenizer

    raw = train_tokenizer([_transcript_text(s) for s in generate("train", 200, seed=0)] + AWKWARD, 600)
    config = Qwen2Config(vocab_size=len(raw.get_vocab()), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, eos_token_id=raw.token_to_id("<|im_end|>"),
                         pad_token_id=raw.token_to_id("<|endoftext|>"))
    served = served_tokenizer(_hf_tokenizer(raw), config, tmp_path)
    assert type(served).__name__ == "Qwen2Tokenizer"  # what AutoTokenizer gives vLLM for this folder
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in _texts():
        trained = raw.encode(text, add_special_tokens=False).ids
        assert served.encode(text, add_special_tokens=False) == trained, text
        assert reloaded.encode(text, add_special_tokens=False) == trained, text
    # Digits are single tokens, apart from the space before them: copying a number from
    # the instruction into code is the same tokens in both places.
    pieces = [served.decode([i]) for i in served.encode("adds 27, so v + 27", add_special_tokens=False)]
    assert pieces[pieces.index("2") - 1: pieces.index("2") + 2] == [" ", "2", "7"]


def test_the_tiny_model_folder_serves_its_own_tokenizer():
    from transformers import AutoTokenizer

    from sampler.tiny_model import tiny_model_dir

    folder = tiny_model_dir()
    served = AutoTokenizer.from_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    for text in _texts():
        assert served.encode(text, add_special_tokens=False) == _raw_encode(folder / "tokenizer.json", text), text


@pytest.mark.parametrize("kind", ["arith", "fix"])
def test_sft_transcripts_are_rendered_with_the_served_tokenizer(tmp_path, kind):
    """render_transcript with the served tokenizer gives ids the raw trained tokenizer
    agrees with on every untrusted span (instruction, files, tool replies)."""
    from transformers import Qwen2Config

    from sampler.tiny_model import train_tokenizer
    from trainer.sft import render_transcript
    from trainer.warm_start import _hf_tokenizer, _transcript_text, served_tokenizer

    specs = generate("train", 50, seed=1, kinds=[kind])
    raw = train_tokenizer([_transcript_text(s) for s in specs], 500)
    config = Qwen2Config(vocab_size=len(raw.get_vocab()), eos_token_id=raw.token_to_id("<|im_end|>"),
                         pad_token_id=raw.token_to_id("<|endoftext|>"))
    served = served_tokenizer(_hf_tokenizer(raw), config, tmp_path)
    from sampler import tool_format as fmt

    ids, _ = render_transcript(specs[0], served)
    untrusted = [text for text, trusted in fmt.task_prompt(specs[0].instruction, specs[0].files) if not trusted]
    assert untrusted and any(char.isdigit() for char in untrusted[0])
    for text in untrusted:  # the instruction (with its numbers) and the file list
        want = raw.encode(text, add_special_tokens=False).ids
        assert any(ids[i: i + len(want)] == want for i in range(len(ids))), \
            f"the transcript's tokens for {text!r} differ from the trained tokenizer's"
