"""Rendering the live view's model (:class:`rollway.live_state.ViewModel`): a ``rich``
table for terminals, one status line for CI and pipes. No state lives here."""

from __future__ import annotations

from rollway.live_state import ViewModel
from rollway.supervisor import describe_exit

DASH = "-"


def num(value: float | None, digits: int = 3) -> str:
    return DASH if value is None else f"{value:.{digits}f}"


def clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:d}:{s // 60 % 60:02d}:{s % 60:02d}"


def figures(m: ViewModel) -> list[tuple[str, str]]:
    """The headline figures as (label, value) rows, in display order."""
    dropped = sum(m.groups_dropped.values())
    reasons = ", ".join(f"{k} {v}" for k, v in m.groups_dropped.items() if v)
    lone = ", ".join(f"{k} {v}" for k, v in m.trajectories_dropped.items() if v) or "none"
    if m.eval_latest is None:
        held_out = "no evaluation yet"
    else:
        e, f = m.eval_latest, m.eval_first
        held_out = f"{e.pass_at_1:.3f} @ v{e.weight_version} ({e.split}, {e.tasks} tasks x {e.samples})"
        if f is not None and f.weight_version != e.weight_version:
            held_out += f"  first {f.pass_at_1:.3f} @ v{f.weight_version}"
    dlq = str(m.dead_letters)
    if m.dead_letters:
        dlq += " (" + ", ".join(f"{k} {v}" for k, v in m.dead_letters_by_kind.items()) + f"); last {m.last_dead_letter[:80]}"
    return [
        ("train step", DASH if m.train_step is None else
         f"{m.train_step}" + ("" if m.published_version is None else f"  (published v{m.published_version})")),
        ("tokens/s", f"sampling {m.sampling_tokens_per_s:.1f}  training {num(m.training_tokens_per_s, 1)}"),
        ("groups", f"trained {m.groups_trained}  dropped {dropped}" + (f" ({reasons})" if reasons else "")
         + ("" if m.groups_published is None else f"  published {m.groups_published}")
         + ("" if m.informative_share is None else f"  with a learning signal {m.informative_share:.2f}")),
        ("trajectories dropped", lone),
        ("reward mean", f"{num(m.reward_mean)} (last {m.window_rewards} of {m.rewards_seen} rewards)"
         f"  last step {num(m.step_reward_mean)}"),
        ("solve rate", f"{num(m.solve_rate)} (last {m.window_rewards} rewards)"),
        ("template re-renders", f"{num(m.template_rerenders_per_1k_turns, 1)} per 1,000 turns"
         f" (last {m.window_rewards} rewards)"),
        ("held-out pass@1", held_out),
        ("entropy", f"full {num(m.entropy_full)}  kept set {num(m.entropy_kept)}"),
        ("mismatch KL (k3)", num(m.mismatch_kl, 5)),
        ("staleness", f"mean {num(m.staleness_mean, 2)}  max {num(m.staleness_max, 0)}"),
        ("weight-apply pause", DASH if m.apply_pause_ms is None else f"{m.apply_pause_ms:.1f} ms"),
        ("dead letters", dlq),
    ]


def component_text(c) -> str:
    text = c.state
    if c.restarts:
        text += f" ({c.restarts} restart{'s' if c.restarts != 1 else ''})"
    return text


def status_line(m: ViewModel) -> str:
    """One line for ``--no-tui``: the same figures, compact."""
    versions = " ".join(f"{r.replica_id}=v{r.weight_version}" for r in m.replicas if r.role == "sampler")
    parts = [
        f"[{clock(m.elapsed_s)}]",
        f"step {DASH if m.train_step is None else m.train_step}",
        f"weights {versions or DASH}",
        f"tok/s {m.sampling_tokens_per_s:.0f}",
        f"groups {m.groups_trained} trained/{sum(m.groups_dropped.values())} dropped"
        + "".join(f" {k}={v}" for k, v in m.groups_dropped.items() if v)
        + ("" if m.informative_share is None else f" signal={m.informative_share:.2f}"),
        f"reward {num(m.reward_mean)}",
        f"solve {num(m.solve_rate)}",
        f"pass@1 {DASH if m.eval_latest is None else f'{m.eval_latest.pass_at_1:.3f}@v{m.eval_latest.weight_version}'}",
        f"entropy {num(m.entropy_kept)}",
        f"mismatch {num(m.mismatch_kl, 5)}",
        f"stale {num(m.staleness_mean, 2)}",
        f"pause {DASH if m.apply_pause_ms is None else f'{m.apply_pause_ms:.0f}ms'}",
        f"dlq {m.dead_letters}",
        "| " + " ".join(f"{c.name}:{component_text(c).replace(' ', '')}" for c in m.components),
    ]
    return " ".join(parts)


def render(m: ViewModel, title: str = "rollway up"):
    """A rich renderable of the whole view (imports rich here: only the TUI needs it)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Table(title=f"{title}  {clock(m.elapsed_s)}", show_header=False, expand=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    for label, value in figures(m):
        head.add_row(label, value)

    replicas = Table(title="replicas (from heartbeats)", title_justify="left")
    for col in ("replica", "role", "status", "weights", "tok/s", "apply pause", "updates", "in flight", "beat"):
        replicas.add_column(col)
    for r in m.replicas:
        replicas.add_row(r.replica_id, r.role, r.status, f"v{r.weight_version}", f"{r.tokens_per_s:.1f}",
                         f"{r.last_pause_ms:.1f} ms", str(r.updates_applied), str(r.in_flight), f"{r.age_s:.0f}s ago")

    comps = Table(title="components", title_justify="left")
    for col in ("component", "state", "restarts", "pid", "last exit", "log"):
        comps.add_column(col)
    colour = {"running": "green", "restarting": "yellow", "crashed": "bold red", "finished": "cyan"}
    for c in m.components:
        comps.add_row(c.name, Text(c.state, style=colour.get(c.state, "")), str(c.restarts),
                      DASH if c.pid is None else str(c.pid),
                      DASH if c.last_exit is None else describe_exit(c.last_exit), c.log_path)
    parts = [head, replicas, comps]
    if m.notices:
        parts.append(Text("\n".join(m.notices), style="yellow"))
    if m.undecodable:
        parts.append(Text(f"{m.undecodable} undecodable records skipped by the view", style="dim"))
    return Group(*parts)
