"""Two or more learning runs side by side: entropy and trainer–sampler mismatch over train
steps in one figure, and a table of their per-step figures.

    .venv/bin/python benchmarks/compare_runs.py --out docs/results/replay.png \
        "replay on=var/runs/seed0/report" "replay off=var/runs/seed0-noreplay/report"

Each argument is ``LABEL=DIR`` where DIR holds a ``steps.json`` written by
``rollway report`` (benchmarks/learning_run.sh writes one per run).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import msgspec

from rollway.report import RunData, series


def load_run(folder: Path) -> RunData:
    """The per-step figures (and evals) ``rollway report`` wrote to ``steps.json``."""
    data = msgspec.json.decode((folder / "steps.json").read_bytes(), type=RunData)
    data.steps = dict(sorted(data.steps.items()))
    return data


def describe(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{values[0]:.4g} → {values[-1]:.4g} (mean {statistics.fmean(values):.4g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=DIR with DIR/steps.json from rollway report")
    parser.add_argument("--out", required=True, help="PNG to write")
    args = parser.parse_args()
    runs = []
    for spec in args.runs:
        label, _, folder = spec.partition("=")
        if not folder:
            parser.error(f"{spec!r}: expected LABEL=DIR")
        runs.append((label, load_run(Path(folder))))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_entropy, ax_mismatch) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for label, run in runs:
        ax_entropy.plot(*series(run, "entropy_full"), marker=".", label=label)
        ax_mismatch.plot(*series(run, "mismatch_kl_k3"), marker=".", label=label)
    ax_entropy.set(title="Policy entropy on trained tokens", xlabel="train step", ylabel="nats per token")
    ax_mismatch.set(title="Trainer–sampler mismatch (KL k3)", xlabel="train step", yscale="log")
    for ax in (ax_entropy, ax_mismatch):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, format="png")

    print("| run | train steps | entropy (full) | mismatch KL k3 | reward mean |")
    print("|---|---|---|---|---|")
    for label, run in runs:
        print(f"| {label} | {len(run.steps)} | {describe(series(run, 'entropy_full')[1])} | "
              f"{describe(series(run, 'mismatch_kl_k3')[1])} | {describe(series(run, 'reward_mean')[1])} |")
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
