"""``rollway report``'s data: events from the log in, series and a markdown summary out.

Pure (no Kafka, no matplotlib): :func:`collect` turns decoded events into a
:class:`RunData`; :func:`summary_markdown` writes the figures; ``rollway.report_plots``
draws them. Sources:

  * per-step series (reward, solve rate, entropy, mismatch, staleness): the train-step
    log (``TrainStep.metrics``, first entry per step wins, as in replay), completed by
    trainer ``Metrics`` for steps whose log entry is missing;
  * staleness histogram: the trainer ``Metrics`` histograms, summed over distinct steps;
  * tokens per trajectory, overall solve rate, the rolling solve rate against time and
    weight version, per task kind, and the length trade-off (``rollway.report_curves``):
    ``Reward`` (one per trajectory), kinds from the issued ``Task``'s metadata;
  * groups with a learning signal (trained vs dropped for zero variance, per step and
    rolling), trained groups per minute: ``TrainStep.groups`` / ``.dropped`` and
    ``GroupsDropped`` (``rollway.group_signal``);
  * held-out pass@1 per version: ``EvalResult``;
  * weight-apply pauses: sampler ``Metrics`` (``apply_pause_ms``), else heartbeats;
  * dead letters: ``DeadLetter`` count.
"""

from __future__ import annotations

import statistics
from typing import Iterable

import msgspec

from rollway.live_state import rerenders_per_1k_turns, solved
from rollway import group_signal
from rollway import report_curves as curves
from schemas import DeadLetter, EvalResult, GroupsDropped, Heartbeat, Metrics, Reward, Task, TrainStep


class Pause(msgspec.Struct, frozen=True):
    replica: str
    weight_version: int
    pause_ms: float
    at: float  # created_at, epoch seconds


class RunData(msgspec.Struct, kw_only=True):
    """What a report is drawn from; ``rollway report``'s ``steps.json`` decodes to one
    with the steps and evals only."""

    steps: dict[int, dict[str, float]]  # step -> metrics
    staleness_hist: list[float] = []  # tokens per staleness bin; the last bin is "older"
    rewards: list[Reward] = []  # one per trajectory, by created_at
    evals: list[EvalResult] = []  # by (weight_version, created_at)
    pauses: list[Pause] = []  # by time
    dead_letters: int = 0
    kinds: dict[str, str] = {}  # task id -> kind (Task.metadata["kind"])
    window: int = 200  # rewards in the rolling solve rate (the live view's up.solve_window)
    length_penalty: float = 0.0  # reward.length_penalty_per_token configured
    groups: list[group_signal.StepGroups] = []  # per step: groups trained and dropped (the step log)

    def empty(self) -> bool:
        return not (self.steps or self.rewards or self.evals or self.pauses)


def collect(events: Iterable[object], trainer_source: str = "trainer", *, window: int = 200,
            length_penalty: float = 0.0) -> RunData:
    steps: dict[int, dict[str, float]] = {}
    from_metrics: dict[int, Metrics] = {}
    rewards: dict[str, Reward] = {}
    evals: list[EvalResult] = []
    pauses: list[Pause] = []
    beat_pauses: dict[tuple[str, int], Pause] = {}
    dead = 0
    tasks: list[Task] = []
    ends: list[TrainStep | GroupsDropped] = []
    for e in events:
        if isinstance(e, Task):
            tasks.append(e)
        elif isinstance(e, GroupsDropped):
            ends.append(e)
        elif isinstance(e, TrainStep):
            ends.append(e)
            steps.setdefault(e.step, dict(e.metrics))
        elif isinstance(e, Metrics):
            if e.source == trainer_source and e.step >= 0:
                from_metrics.setdefault(e.step, e)
            elif e.source.startswith("sampler:") and "apply_pause_ms" in e.values:
                pauses.append(Pause(e.source.removeprefix("sampler:"), e.weight_version,
                                    e.values["apply_pause_ms"], e.created_at))
        elif isinstance(e, Reward):
            rewards.setdefault(e.trajectory_id, e)
        elif isinstance(e, EvalResult):
            evals.append(e)
        elif isinstance(e, Heartbeat):
            if e.role == "sampler" and e.updates_applied > 0:
                beat_pauses.setdefault((e.replica_id, e.updates_applied),
                                       Pause(e.replica_id, e.weight_version, e.last_pause_ms, e.created_at))
        elif isinstance(e, DeadLetter):
            dead += 1
    for step, m in from_metrics.items():
        steps.setdefault(step, dict(m.values))
    hist: list[float] = []
    for m in from_metrics.values():
        h = m.histograms.get("staleness", [])
        if len(h) > len(hist):
            hist.extend([0.0] * (len(h) - len(hist)))
        for i, v in enumerate(h):
            hist[i] += v
    # The sampler's Metrics are the durable record; heartbeats (a compacted topic) only
    # stand in when no sampler published pause metrics.
    if not pauses:
        pauses = list(beat_pauses.values())
    return RunData(
        steps=dict(sorted(steps.items())),
        staleness_hist=hist,
        rewards=sorted(rewards.values(), key=lambda r: r.created_at),
        evals=sorted(evals, key=lambda e: (e.weight_version, e.created_at)),
        pauses=sorted(pauses, key=lambda p: p.at),
        dead_letters=dead,
        kinds=curves.kinds_of(tasks),
        window=window,
        length_penalty=length_penalty,
        groups=group_signal.step_groups(ends),
    )


def series(data: RunData, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one per-step metric, steps where it is present."""
    pairs = [(s, m[key]) for s, m in data.steps.items() if key in m]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def f3(x: float) -> str:
    return f"{x:.3f}"


def summary_markdown(data: RunData, plots: list[tuple[str, str]], source: str) -> str:
    """The report's markdown: a figures table, held-out results per version, the plots
    (``(file name, caption)``)."""
    rows: list[tuple[str, str]] = []
    if data.steps:
        rows.append(("train steps", f"{len(data.steps)} (last step {max(data.steps)})"))
        for key, label in (("reward_mean", "reward mean per step"), ("solve_rate", "solve rate per step"),
                           ("entropy_full", "entropy (full)"), ("entropy_kept", "entropy (kept set)")):
            _, vals = series(data, key)
            if vals:
                rows.append((label, f"first {f3(vals[0])}, last {f3(vals[-1])}, mean {f3(statistics.fmean(vals))}"))
        _, kl = series(data, "mismatch_kl_k3")
        if kl:
            rows.append(("trainer-sampler mismatch KL (k3)",
                         f"mean {kl_fmt(statistics.fmean(kl))}, max {kl_fmt(max(kl))}, last {kl_fmt(kl[-1])}"))
        _, st = series(data, "staleness_mean")
        if st:
            rows.append(("staleness (versions)", f"mean of steps {statistics.fmean(st):.2f}"
                         + (f", tokens per bin {staleness_bins(data.staleness_hist)}" if data.staleness_hist else "")))
    rows += signal_rows(data.groups)
    if data.rewards:
        rewards = data.rewards
        tokens = [r.cost.generated_tokens for r in rewards]
        rows.append(("rewards", f"{len(rewards)}, mean {f3(statistics.fmean(r.reward for r in rewards))}"))
        rows.append(("solve rate (all rewards)", f3(sum(solved(r) for r in rewards) / len(rewards))))
        rolling = curves.rolling_solve_rate(rewards, data.window)
        if rolling.rates:
            rows.append((f"rolling solve rate (last {rolling.window} graded rewards)",
                         f"first {f3(rolling.rates[0])}, last {f3(rolling.rates[-1])}, "
                         f"best {f3(max(rolling.rates))}"))
        for kind, r in curves.rolling_by_kind(rewards, data.kinds, data.window).items():
            if r.rates:
                rows.append((f"rolling solve rate, kind {kind} (last {r.window})",
                             f"first {f3(r.rates[0])}, last {f3(r.rates[-1])}"))
        rows.append(("tokens per trajectory", f"mean {statistics.fmean(tokens):.1f}, median {statistics.median(tokens):g}, "
                                              f"max {max(tokens)}"))
        turns = sum(r.cost.turns for r in rewards)
        if turns:
            # Turns the chat template could not extend token-exactly (a new segment, never
            # trained as if sampled in the other context): issue #27's figure.
            rerenders = sum(r.cost.template_rerenders for r in rewards)
            rows.append(("template re-renders", f"{rerenders} in {turns} turns ({rerenders_per_1k_turns(rewards):.1f} "
                                                f"per 1,000 turns)"))
    if data.evals:
        first, last = data.evals[0], data.evals[-1]
        rows.append(("held-out pass@1", f"first {f3(first.pass_at_1)} @ v{first.weight_version}, "
                                        f"latest {f3(last.pass_at_1)} @ v{last.weight_version} "
                                        f"({last.pass_at_1 - first.pass_at_1:+.3f})"))
    if data.pauses:
        ms = [p.pause_ms for p in data.pauses]
        rows.append(("weight-apply pause", f"median {statistics.median(ms):.1f} ms, max {max(ms):.1f} ms "
                                           f"over {len(ms)} updates"))
    rows.append(("dead letters", str(data.dead_letters)))

    lines = ["# Rollway run report", "", f"Read from the log: {source}.", "", "| figure | value |", "|---|---|"]
    lines += [f"| {label} | {value} |" for label, value in rows]
    if data.evals:
        lines += ["", "## Held-out pass@1 per weight version", "",
                  "| version | split | pass@1 | tasks x samples | mean reward | mean tokens |", "|---|---|---|---|---|---|"]
        lines += [f"| v{e.weight_version} | {e.split} | {f3(e.pass_at_1)} | {e.tasks} x {e.samples} | "
                  f"{f3(e.mean_reward)} | {e.mean_generated_tokens:.1f} |" for e in data.evals]
    tradeoff = curves.length_tradeoff(data.rewards, data.length_penalty) if data.rewards else None
    if tradeoff is not None:
        lines += ["", "## Length penalty", "", *length_section(tradeoff)]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{caption}]({name})" for name, caption in plots]
    return "\n".join(lines) + "\n"


def signal_rows(groups: list[group_signal.StepGroups]) -> list[tuple[str, str]]:
    """The informative-group share (trained / (trained + zero-variance drops)) overall
    and by half of the run, the other ends, trained groups per minute."""
    total = group_signal.tally(groups)
    if total.informative_share is None:
        return []
    half = len(groups) // 2
    halves = [group_signal.tally(groups[:half]).informative_share, group_signal.tally(groups[half:]).informative_share]
    other = ", ".join(f"{k} {v}" for k, v in total.dropped.items() if k != "zero_variance" and v)
    rows = [("groups with a learning signal (step log)",
             f"{f3(total.informative_share)} = {total.trained} trained / ({total.trained} + {total.zero_variance} "
             f"dropped for zero variance)"
             + (f"; first / second half of the steps {' / '.join('-' if h is None else f3(h) for h in halves)}"
                if half else "")
             + (f"; other drops: {other}" if other else ""))]
    per_min = group_signal.trained_per_minute(groups)
    if per_min is not None:
        rows.append(("trained groups per minute", f"{per_min:.2f}"))
    return rows


def length_section(t: curves.LengthTradeoff) -> list[str]:
    """The solve-rate-vs-tokens bins of recent versions, the fit, the coefficient in force
    and the tangent one ``sandbox.reward.suggest_length_penalty`` picks, with how to apply it."""
    out = [f"Solve rate against generated tokens, {t.rewards} graded rewards of weight versions "
           f"v{t.versions[0]}-v{t.versions[1]} (token-quantile bins):", "",
           "| mean tokens | rewards | solve rate |", "|---|---|---|"]
    out += [f"| {b.mean_tokens:.1f} | {b.rewards} | {f3(b.solve_rate)} |" for b in t.bins]
    out += ["", f"Current length penalty: {t.current:.3g} per generated token ({t.current_source})."]
    if t.suggested is None:
        out.append(f"No tangent coefficient: {t.why_not}.")
        return out
    out.append(f"Fit: solve rate = {t.intercept:.4f} + {t.slope:.4f} ln(tokens).")
    best = t.current_tangent()
    if best is not None:
        out.append(f"Under the current coefficient the most rewarding length is {best[0]:.0f} tokens "
                   f"(fitted solve rate {f3(best[1])}).")
    out += [f"**Suggested `reward.length_penalty_per_token` = {t.suggested:.3g}** "
            f"(`sandbox.reward.suggest_length_penalty`: tangent to the fit at {t.target_tokens:.0f} tokens, the "
            f"geometric mean of the bins' lengths, fitted solve rate {f3(t.solve_rate_at_target or 0.0)}).",
            f"Apply it: {curves.apply_line(t.suggested)}."]
    return out


def kl_fmt(x: float) -> str:
    return f"{x:.3g}"


def staleness_bins(hist: list[float]) -> str:
    last = len(hist) - 1
    return ", ".join(f"{i if i < last else f'>={i}'}: {int(v)}" for i, v in enumerate(hist))
