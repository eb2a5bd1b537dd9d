"""``rollway model tiny|init``: build local models (no downloads).

* ``tiny``: the tiny Qwen2 + BPE tokenizer the tests and demos use;
* ``init``: the warm start: a small Qwen2 fine-tuned (SFT) on reference transcripts of
  the task family's train split (:mod:`trainer.warm_start`), so RL starts from a partial
  skill. Cached under ``.cache/models/warm-<key>``; ``--out DIR`` copies it there.
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    tiny = sub.add_parser("tiny", help="build the tiny Qwen2 model + BPE tokenizer")
    tiny.add_argument("--out", help="write it here (default: print the cached path)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--train-steps", type=int, default=150,
                      help="pre-training steps on the synthetic agent corpus (150: writes tool calls; "
                           "the test suite's default model uses 40)")
    tiny.add_argument("--format", default="rollway", choices=["rollway", "chatml-hermes"],
                      help="tokenizer layout and transcripts: rollway's <tool> dialect (default) or chatml-hermes "
                           "(Qwen2.5's <tool_call> tokens and chat template with tools; sampler/formats)")
    init = sub.add_parser("init", help="build the warm-start model: SFT on the task family's train split")
    init.add_argument("--out", help="copy it here (default: print the cached path)")
    init.add_argument("--seed", type=int, default=None, help="model, data and SFT seed (default 0)")
    init.add_argument("--steps", type=int, default=None, help="SFT steps (default: trainer.warm_start default, 2000)")
    init.add_argument("--premature-submit-rate", type=float, default=None,
                      help="share of the imitated teacher's episodes that submit before writing code "
                           "(default: trainer.warm_start default; 0 = a flawless teacher)")
    # Checked by WarmStartConfig against trainer.warm_start.FORMATS (not argparse choices:
    # the table lives in sampler/formats, too heavy to import for `rollway --help`).
    init.add_argument("--format", default=None, metavar="FORMAT",
                      help="transcripts, tokenizer layout and chat template: chatml-hermes (default), qwen3, "
                           "qwen3-coder, llama3-json (each family's special tokens and template; sampler/formats) "
                           "or rollway (the <tool> dialect)")
    init.add_argument("--threads", type=int, default=None, help="torch threads (default: trainer.sft num_threads, 1: deterministic)")
    init.add_argument("--long-share", type=float, default=None,
                      help="share of arith/text transcripts in the long form (three operations or steps; "
                           "tasks.family.generate's long_share; default 0); the feeder's family_long_share "
                           "draws them in RL")


def _copy_out(cached, out_arg: str | None, marker: str) -> int:
    import os
    import shutil
    from pathlib import Path

    if not out_arg:
        print(cached)
        return 0
    out = Path(out_arg)
    if out.exists() and (out / "config.json").exists():
        if not (out / marker).exists():
            print(f"{out} already holds a different model (no {marker}); leaving it")
            return 0
        if (out / marker).read_bytes() == (cached / marker).read_bytes():
            print(out)
            return 0
        # A model this command wrote, from other sources or settings (e.g. before a fix
        # to the warm start): serving it silently would hide the fix, so replace it.
        # Copy beside it first, then swap, so a failed copy leaves the old one whole.
        fresh = out.with_name(f".{out.name}.new-{os.getpid()}")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.copytree(cached, fresh)
        out.rename(old)
        fresh.rename(out)
        shutil.rmtree(old, ignore_errors=True)
        print(f"{out}: replaced an outdated model (its {marker} differs from the current build)")
        return 0
    shutil.copytree(cached, out, dirs_exist_ok=True)
    print(out)
    return 0


def run(args: argparse.Namespace) -> int:
    from rollway.logging import configure_logging

    configure_logging("model")
    if args.action == "tiny":
        from sampler.tiny_model import tiny_model_dir

        cached = tiny_model_dir(seed=args.seed, train_steps=args.train_steps, format=args.format)
        return _copy_out(cached, args.out, "rollway_tiny.json")

    import sys

    import msgspec

    from rollway.config import describe
    from trainer.warm_start import MARKER, WarmStartConfig, warm_start_dir

    try:
        cfg = init_config(args)
    except msgspec.ValidationError as exc:
        print(f"rollway model: {describe(exc, WarmStartConfig)}", file=sys.stderr)
        return 2
    return _copy_out(warm_start_dir(cfg), args.out, MARKER)


def init_config(args: argparse.Namespace):
    """The WarmStartConfig ``rollway model init`` builds: the warm start's own defaults
    (not rollway.toml's) and the flags, converted and validated once like every
    command's (msgspec.ValidationError when a flag is out of range)."""
    import msgspec

    from rollway.commands import given
    from trainer.warm_start import WarmStartConfig

    data = msgspec.to_builtins(WarmStartConfig())
    data.update(given(seed=args.seed, format=args.format, long_share=args.long_share))
    data["sft"].update(given(steps=args.steps, seed=args.seed, num_threads=args.threads,
                            premature_submit_rate=args.premature_submit_rate))
    return msgspec.convert(data, WarmStartConfig)
