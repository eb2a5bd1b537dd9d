"""``rollway report``'s PNG plots (matplotlib, Agg: no display needed). One function per
plot; each returns its file name and caption, or None when the log has no data for it."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from rollway import report_curves as curves
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
        ax.legend(fontsize="small")
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


EVAL_COLORS = ["tab:orange", "tab:green", "tab:purple", "tab:brown"]  # held-out splits, apart from the solve rate


def _run_start(data: RunData) -> float:
    times = [r.created_at for r in data.rewards if r.created_at > 0] + [e.created_at for e in data.evals
                                                                         if e.created_at > 0]
    return min(times) if times else 0.0


def _minutes(at: list[float], start: float) -> list[float]:
    return [(t - start) / 60.0 for t in at]


def solve_rate_over_time(data: RunData, out: Path) -> Plot | None:
    """The run's headline: the rolling solve rate of every graded reward, and held-out
    pass@1 on the same clock."""
    rolling = curves.rolling_solve_rate(data.rewards, data.window) if data.rewards else None
    if rolling is None or not rolling.rates:
        return None
    start = _run_start(data)
    plt, fig, ax = _figure()
    ax.plot(_minutes(rolling.at, start), rolling.rates, color="tab:blue",
            label=f"solve rate, last {rolling.window} graded rewards")
    for split, color in zip(sorted({e.split for e in data.evals}), EVAL_COLORS):
        evals = [e for e in data.evals if e.split == split and e.created_at > 0]
        ax.plot(_minutes([e.created_at for e in evals], start), [e.pass_at_1 for e in evals], marker="o",
                linestyle="--", color=color, label=f"held-out pass@1 ({split})")
    ax.set_ylim(0, 1)
    return _save(plt, fig, ax, out, "solve_rate.png", "rolling solve rate of all graded rewards and held-out pass@1 "
                 "over time", title="Solve rate over time", xlabel="minutes since the first reward",
                 ylabel="fraction solved", legend=True)


def solve_rate_by_version(data: RunData, out: Path) -> Plot | None:
    rows = curves.solve_rate_by_version(data.rewards, data.window) if data.rewards else []
    if not rows:
        return None
    plt, fig, ax = _figure()
    biggest = max(r.rewards for r in rows)
    ax.scatter([r.version for r in rows], [r.rate for r in rows], s=[8 + 60 * r.rewards / biggest for r in rows],
               alpha=0.35, color="tab:blue", label="rewards of that version (size: count)")
    window = curves.window_for(sum(r.rewards for r in rows), data.window)
    ax.plot([r.version for r in rows], [r.rolling for r in rows], color="tab:blue",
            label=f"rolling, newest versions holding {window} rewards")
    for split, color in zip(sorted({e.split for e in data.evals}), EVAL_COLORS):
        evals = [e for e in data.evals if e.split == split]
        ax.plot([e.weight_version for e in evals], [e.pass_at_1 for e in evals], marker="o", linestyle="--",
                color=color, label=f"held-out pass@1 ({split})")
    ax.set_ylim(0, 1)
    return _save(plt, fig, ax, out, "solve_rate_by_version.png",
                 "solve rate by the weight version (trainer step) that produced the rewards",
                 title="Solve rate by weight version", xlabel="weight version (= trainer step)",
                 ylabel="fraction solved", legend=True)


def solve_rate_per_kind(data: RunData, out: Path) -> Plot | None:
    per_kind = curves.rolling_by_kind(data.rewards, data.kinds, data.window) if data.rewards else {}
    per_kind = {k: r for k, r in per_kind.items() if r.rates}
    if not per_kind:
        return None
    start = _run_start(data)
    plt, fig, ax = _figure()
    colors = {}
    for kind, r in per_kind.items():
        (line,) = ax.plot(_minutes(r.at, start), r.rates, label=f"{kind} (last {r.window})")
        colors[kind] = line.get_color()
    for e in (e for e in data.evals if e.created_at > 0):
        for kind, value in e.per_kind.items():
            if kind in colors:
                ax.plot(_minutes([e.created_at], start), [value], marker="o", color=colors[kind], linestyle="")
    ax.set_ylim(0, 1)
    return _save(plt, fig, ax, out, "solve_rate_per_kind.png",
                 "rolling solve rate per task kind (dots: held-out pass@1 of that kind)",
                 title="Solve rate per task kind (dots: held-out pass@1)", xlabel="minutes since the first reward",
                 ylabel="fraction solved", legend=True)


def length_tradeoff(data: RunData, out: Path) -> Plot | None:
    t = curves.length_tradeoff(data.rewards, data.length_penalty) if data.rewards else None
    if t is None or not t.bins:
        return None
    plt, fig, ax = _figure()
    xs = [b.mean_tokens for b in t.bins]
    biggest = max(b.rewards for b in t.bins)
    ax.scatter(xs, [b.solve_rate for b in t.bins], s=[20 + 80 * b.rewards / biggest for b in t.bins], zorder=3,
               color="tab:blue", label=f"v{t.versions[0]}-v{t.versions[1]}: {t.rewards} rewards, token bins")
    lo, hi = min(xs) * 0.8, max(xs) * 1.2
    if t.suggested is not None:
        grid = [lo + (hi - lo) * i / 100 for i in range(101)]
        ax.plot(grid, [t.fit(x) for x in grid], color="tab:blue", alpha=0.6,
                label=f"fit {t.intercept:.3f} + {t.slope:.3f} ln(tokens)")
        best = t.current_tangent()
        if best is not None:
            ax.plot([lo, hi], [best[1] + t.current * (x - best[0]) for x in (lo, hi)], linestyle="--",
                    color="tab:red", label=f"current k={t.current:.3g}: iso-reward line (best at {best[0]:.0f} tok)")
            if lo <= best[0] <= hi:
                ax.plot([best[0]], [best[1]], marker="o", color="tab:red")
        else:
            top = max(t.fit(x) for x in grid)
            ax.plot([lo, hi], [top, top], linestyle="--", color="tab:red",
                    label=f"current k={t.current:.3g}: iso-reward line (longer always pays)")
        target, at = t.target_tokens or 0.0, t.solve_rate_at_target or 0.0
        ax.plot([lo, hi], [at + t.suggested * (x - target) for x in (lo, hi)], linestyle=":", color="tab:green",
                label=f"suggested k={t.suggested:.3g}: tangent at {target:.0f} tok")
        ax.plot([target], [at], marker="o", color="tab:green")
    ax.set_xlim(lo, hi)
    rates = [b.solve_rate for b in t.bins]
    ax.set_ylim(max(-0.02, min(rates) - 0.15), min(1.02, max(rates) + 0.3))  # room for the legend above
    return _save(plt, fig, ax, out, "length_tradeoff.png",
                 "solve rate vs generated tokens of recent versions, the current length penalty's iso-reward line "
                 "and the suggested tangent coefficient",
                 title="Length trade-off: solve rate vs tokens", xlabel="generated tokens per trajectory",
                 ylabel="fraction solved", legend=True)


def reward_solve_rate(data: RunData, out: Path) -> Plot | None:
    return _over_train_steps(
        data, out, [("reward_mean", "reward mean", {}), ("solve_rate", "solve rate", {})],
        title="Reward and solve rate of the trained groups (zero-variance groups excluded)",
        name="reward_solve_rate.png", caption="reward and solve rate of the trained groups over train steps",
    )


def informative_groups(data: RunData, out: Path) -> Plot | None:
    """Per step, the share of groups decided on their rewards that had variance (trained
    / (trained + dropped for zero variance)), and that share over the last 40 such groups."""
    from rollway import group_signal

    rows = [r for r in data.groups if r.trained + r.dropped.get("zero_variance", 0)]
    if not rows:
        return None
    plt, fig, ax = _figure()
    ax.plot([r.step for r in rows], [r.trained / (r.trained + r.dropped.get("zero_variance", 0)) for r in rows],
            marker=".", linestyle="none", alpha=0.5, label="per step")
    rolling = group_signal.rolling_share(data.groups, window=40)
    ax.plot([s for s, _ in rolling], [v for _, v in rolling], label="last 40 decided groups")
    ax.set_ylim(0, 1.05)
    return _save(plt, fig, ax, out, "informative_groups.png",
                 "share of sampled groups with a learning signal (trained vs dropped for zero variance)",
                 title="Groups with reward variance (the rest teach nothing and are dropped)",
                 xlabel="train step", ylabel="share of decided groups", legend=True)


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
    solve_rate_over_time, solve_rate_by_version, solve_rate_per_kind, length_tradeoff, reward_solve_rate,
    informative_groups, heldout_pass_at_1, entropy, mismatch, staleness, tokens_per_trajectory, apply_pauses,
]


def draw_all(data: RunData, out: Path) -> list[Plot]:
    out.mkdir(parents=True, exist_ok=True)
    return [plot for draw in PLOTS if (plot := draw(data, out)) is not None]
