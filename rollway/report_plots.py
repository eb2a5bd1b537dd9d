"""``rollway report``'s PNG plots (matplotlib, Agg: no display needed). One function per
plot; each returns its file name and caption, or None when the log has no data for it."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from rollway.report import RunData, series

Plot = tuple[str, str]


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # headless: CI, pipes, machines without a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.grid(True, alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, ax, out: Path, name: str, caption: str, *, title: str, xlabel: str,
          ylabel: str | None = None, legend: bool = False) -> Plot:
    """Label the axes, write ``name`` under ``out``, close the figure."""
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / name, format="png")
    plt.close(fig)
    return name, caption


def _over_train_steps(data: RunData, out: Path, lines: list[tuple[str, str, dict]], *, title: str,
                      name: str, caption: str, ylabel: str | None = None) -> Plot | None:
    """Train-step metrics, one line each: ``lines`` = (metric, label, extra plot options)."""
    curves = [(series(data, metric), label, options) for metric, label, options in lines]
    if not any(steps for (steps, _), _, _ in curves):
        return None
    plt, fig, ax = _figure()
    for (steps, values), label, options in curves:
        ax.plot(steps, values, label=label, marker=".", **options)
    return _save(plt, fig, ax, out, name, caption, title=title, xlabel="train step", ylabel=ylabel, legend=True)


def reward_solve_rate(data: RunData, out: Path) -> Plot | None:
    return _over_train_steps(
        data, out, [("reward_mean", "reward mean", {}), ("solve_rate", "solve rate", {})],
        title="Reward and solve rate of the trained groups",
        name="reward_solve_rate.png", caption="reward and solve rate over train steps",
    )


def heldout_pass_at_1(data: RunData, out: Path) -> Plot | None:
    if not data.evals:
        return None
    plt, fig, ax = _figure()
    for split in sorted({e.split for e in data.evals}):
        evals = [e for e in data.evals if e.split == split]
        ax.plot([e.weight_version for e in evals], [e.pass_at_1 for e in evals], marker="o", label=split)
    ax.set_ylim(0, 1)
    return _save(plt, fig, ax, out, "heldout_pass_at_1.png", "held-out pass@1 per weight version",
                 title="Held-out pass@1 per weight version", xlabel="weight version", ylabel="pass@1", legend=True)


def entropy(data: RunData, out: Path) -> Plot | None:
    return _over_train_steps(
        data, out,
        [("entropy_full", "full distribution", {}), ("entropy_kept", "renormalized over the kept set", {})],
        title="Policy entropy on trained tokens", ylabel="nats per token",
        name="entropy.png", caption="entropy over train steps",
    )


def mismatch(data: RunData, out: Path) -> Plot | None:
    return _over_train_steps(
        data, out, [("mismatch_kl_k3", "KL estimate k3", {}), ("mismatch_kl_k1", "KL estimate k1", {"alpha": 0.6})],
        title="Trainer-sampler mismatch (trainer vs recorded log-probs)",
        name="mismatch.png", caption="trainer-sampler mismatch over train steps",
    )


def staleness(data: RunData, out: Path) -> Plot | None:
    if not data.staleness_hist or not any(data.staleness_hist):
        return None
    plt, fig, ax = _figure()
    last = len(data.staleness_hist) - 1
    labels = [str(i) if i < last else f">={i}" for i in range(len(data.staleness_hist))]
    ax.bar(labels, data.staleness_hist)
    return _save(plt, fig, ax, out, "staleness.png", "staleness histogram", title="Staleness of trained tokens",
                 xlabel="staleness (weight versions behind the trainer)", ylabel="trained tokens")


def tokens_per_trajectory(data: RunData, out: Path) -> Plot | None:
    if not data.rewards:
        return None
    plt, fig, ax = _figure()
    ax.hist([r.cost.generated_tokens for r in data.rewards], bins=min(30, max(len(data.rewards), 1)))
    return _save(plt, fig, ax, out, "tokens_per_trajectory.png", "tokens per trajectory",
                 title="Tokens per trajectory", xlabel="generated tokens per trajectory", ylabel="trajectories")


def apply_pauses(data: RunData, out: Path) -> Plot | None:
    if not data.pauses:
        return None
    plt, fig, ax = _figure()
    for replica in sorted({p.replica for p in data.pauses}):
        ps = [p for p in data.pauses if p.replica == replica]
        ax.plot([p.weight_version for p in ps], [p.pause_ms for p in ps], marker="o", linestyle="", label=replica)
    return _save(plt, fig, ax, out, "apply_pauses.png", "weight-apply pauses",
                 title="Weight-apply pauses of the samplers", xlabel="weight version applied", ylabel="pause (ms)",
                 legend=True)


PLOTS: list[Callable[[RunData, Path], Plot | None]] = [
    reward_solve_rate, heldout_pass_at_1, entropy, mismatch, staleness, tokens_per_trajectory, apply_pauses,
]


def draw_all(data: RunData, out: Path) -> list[Plot]:
    out.mkdir(parents=True, exist_ok=True)
    return [plot for draw in PLOTS if (plot := draw(data, out)) is not None]
