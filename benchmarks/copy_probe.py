"""What the warm start writes when it gets to the write, per kind and split (no sandbox).

    .venv/bin/python benchmarks/copy_probe.py [--model var/models/tiny] [--tasks 40]

For each task the reference episode is replayed up to the write (the prompt, for ``fix``
the read and the file it returned, then ``<tool>write <path>\\n``), and the model
continues greedily until ``</tool>``. The written file is compared with the reference
solution: ``exact`` (the whole file), ``names`` (the function's ``def name(arg):`` line
as the instruction names it, i.e. the names were copied), and for ``fix`` ``target``
(the function to fix, fixed), ``helper`` (the other function copied unchanged) and
``buggy`` (the planted bug copied back unfixed).
Greedy decoding of the write alone: an upper bound on what an episode at temperature 1
does, and it leaves out the premature-submit habit, so it isolates the skill.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


COLUMNS = ("exact", "names", "target", "helper", "buggy")


def prefix_ids(spec, tokenizer) -> tuple[list[int], list[int], str]:
    """(the episode before the write, the write message's first tokens, its text head)."""
    from sampler import tool_format as fmt
    from trainer.sft import encode_pieces

    ids = encode_pieces(tokenizer, fmt.task_prompt(spec.instruction, spec.files))
    if spec.metadata.get("kind") == "fix":
        for path, content in spec.files.items():
            ids += encode_pieces(tokenizer, fmt.assistant_header(""))
            ids += tokenizer.encode(f"{fmt.TOOL_OPEN}read {path}{fmt.TOOL_CLOSE}", add_special_tokens=False)
            ids += encode_pieces(tokenizer, fmt.tool_reply(content, closed_turn=False))
    (path, content), = spec.solution.items()
    ids += encode_pieces(tokenizer, fmt.assistant_header(""))
    # The write message as SFT tokenized it (whole), cut before the first token that
    # reaches past "<tool>write <path>\n" (BPE may merge the newline with the code).
    head = f"{fmt.TOOL_OPEN}write {path}\n"
    message = tokenizer.encode(f"{head}{content}{fmt.TOOL_CLOSE}", add_special_tokens=False)
    n = max(i for i in range(len(message) + 1) if head.startswith(tokenizer.decode(message[:i])))
    return ids, message[:n], head


def write_of(model, tokenizer, spec, max_new: int = 120) -> str:
    import torch

    before, started, head = prefix_ids(spec, tokenizer)
    stop = tokenizer.convert_tokens_to_ids("</tool>")
    with torch.no_grad():
        out = model.generate(torch.tensor([before + started]), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=stop, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, len(before):], skip_special_tokens=False)
    return text.removeprefix(head).split("</tool>")[0]


def functions(source: str) -> dict[str, str]:
    """name -> its source (a def and its indented body) of a module's functions."""
    out: dict[str, str] = {}
    for m in re.finditer(r"^def (\w+)\(.*?(?=^def |\Z)", source, flags=re.S | re.M):
        out[m.group(1)] = m.group(0).strip()
    return out


def judge(spec, written: str) -> dict[str, bool]:
    (reference,) = spec.solution.values()
    ref_funcs = functions(reference)
    target = re.search(r"`(\w+)\((\w+)\)`", spec.instruction)
    signature = f"def {target.group(1)}({target.group(2)}):"
    got = {"exact": written.strip() == reference.strip(), "names": signature in written}
    if spec.metadata["kind"] == "fix":
        (buggy,) = spec.files.values()
        helper = next(name for name in ref_funcs if name != target.group(1))
        got["target"] = functions(written).get(target.group(1)) == ref_funcs[target.group(1)]
        got["helper"] = functions(written).get(helper) == ref_funcs[helper]
        got["buggy"] = functions(written).get(target.group(1)) == functions(buggy)[target.group(1)]
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="var/models/tiny")
    parser.add_argument("--tasks", type=int, default=40, help="per kind and split")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.family import KINDS, generate, split_names

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    print(f"{args.model}: greedy write after the reference prefix, {args.tasks} tasks per kind and split "
          f"(eval seed {args.seed})")
    print(f"{'split':14s} {'kind':6s} " + " ".join(f"{k:>7s}" for k in COLUMNS))
    for split in split_names:
        for kind in KINDS:
            specs = generate(split, args.tasks, seed=args.seed, kinds=[kind])
            rows = [judge(s, write_of(model, tokenizer, s)) for s in specs]
            cells = [f"{statistics.fmean(r[k] for r in rows):7.3f}" if k in rows[0] else f"{'-':>7s}"
                     for k in COLUMNS]
            print(f"{split:14s} {kind:6s} " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
