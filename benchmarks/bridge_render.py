"""The bridge's cost per turn (``ChatFormat.bridge``): rendering a window (the incremental
bridge) vs rendering the whole conversation, for each model family, at several
conversation lengths, side by side in one process.

    python benchmarks/bridge_render.py --turns 5 20 40 --repeat 30

Each family's tokenizer is built here in its published layout (as the golden tests do);
the conversation is a coding-agent transcript (one or two calls a turn, tool replies of
a few lines). Per turn count: the median over ``--repeat`` calls of the bridge of the
last turn, both ways; both must give the same ids (checked).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import cpu_name, load_average, print_aligned  # noqa: E402

FAMILIES = ["chatml-hermes", "qwen3", "qwen3-coder", "llama3-json"]


def conversation(fmt, family: str, turns: int):
    """(prefix before the last turn, the last turn's ids, the messages with its replies)."""
    from sampler.formats import TOOL_SCHEMAS
    from tests.test_formats import assistant_dict, call, sampled_ids

    rng = random.Random(turns)
    messages = [fmt.user_message("Fix `add` in solution.py so the tests pass.\nFiles: solution.py, test_add.py")]
    prefix = fmt.render(messages, TOOL_SCHEMAS)
    for t in range(turns):
        calls = [call("run", command="python -m pytest -q"), call("read", path="solution.py")]
        calls = calls[:1] if family == "llama3-json" or rng.random() < 0.5 else calls
        sampled = sampled_ids(fmt, messages, assistant_dict(family, f"Step {t}.", "", calls), prefix)
        turn = fmt.parse_turn(sampled)
        messages = messages + [fmt.assistant_message(turn)] + [
            fmt.tool_message(c.id, c.name, "F\n1 failed: assert add(2, 3) == 5\n" * 3) for c in turn.calls]
        if t == turns - 1:
            return prefix, sampled, messages
        bridge = fmt.bridge(prefix, sampled, messages, TOOL_SCHEMAS)
        prefix = dataclasses.replace(bridge, ids=prefix.ids + sampled + bridge.ids)
    raise ValueError("turns must be >= 1")


def timed(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[5, 20, 40])
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()

    from sampler.formats import TOOL_SCHEMAS, load_format
    from sampler.formats.tokenizers import build_tokenizer
    from tests.test_formats import CORPUS

    rows = []
    for family in FAMILIES:
        fmt = load_format(build_tokenizer(family, CORPUS))
        for turns in args.turns:
            prefix, sampled, messages = conversation(fmt, family, turns)
            whole = dataclasses.replace(prefix, messages=-1)
            a = fmt.bridge(whole, sampled, messages, TOOL_SCHEMAS)
            b = fmt.bridge(prefix, sampled, messages, TOOL_SCHEMAS)
            assert a is not None and b is not None and (a.ids, a.text) == (b.ids, b.text), (family, turns)
            t_whole = timed(lambda: fmt.bridge(whole, sampled, messages, TOOL_SCHEMAS), args.repeat)
            t_window = timed(lambda: fmt.bridge(prefix, sampled, messages, TOOL_SCHEMAS), args.repeat)
            rows.append((family, turns, len(messages), len(a.text), f"{1e3 * t_whole:.2f}", f"{1e3 * t_window:.2f}",
                         f"{t_whole / t_window:.1f}x"))
    print(f"# {cpu_name()}, load {load_average()}, median of {args.repeat} bridges of the last turn")
    print_aligned(["family", "turns", "messages", "chars", "whole render ms", "window ms", "whole / window"], rows)


if __name__ == "__main__":
    main()
