"""``rollway model tiny``: build the local tiny model and tokenizer (no downloads)."""

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


def run(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from rollway.logging import configure_logging
    from sampler.tiny_model import tiny_model_dir

    configure_logging("model")
    cached = tiny_model_dir(seed=args.seed, train_steps=args.train_steps)
    if args.out:
        out = Path(args.out)
        if out.exists() and (out / "config.json").exists():
            print(f"{out} already holds a model; leaving it")
            return 0
        shutil.copytree(cached, out, dirs_exist_ok=True)
        print(out)
    else:
        print(cached)
    return 0
