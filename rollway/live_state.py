"""The live view's state: events from the log in, a table model out.

Pure: no Kafka, no terminal, no clock of its own (``model(now=...)``). ``rollway up``
feeds it every event it reads from ``metrics``, ``health``, ``rewards``, ``evals`` and
``dlq`` and renders :meth:`LiveState.model` once a second (``rollway.live_view``).

Where the figures come from:
  * trainer ``Metrics`` (source ``trainer.metrics_source``): step, published version,
    per-step reward / solve rate, entropy, mismatch, staleness, training tokens/s,
    groups trained (sum of ``groups`` over distinct steps), groups dropped by reason
    (``count_groups_dropped_<reason>``: zero_variance, stale, invalid, abandoned) and
    trajectories dropped by reason (``count_dropped_duplicate`` / ``_late`` /
    ``_invalid``, ``count_trajectories_dropped_stale``), the counters of each trainer
    process summed over processes (a restarted trainer counts from zero again, told
    apart by ``process_started_at``);
  * sampler ``Heartbeat``: weight version, status, tokens/s, last weight-apply pause
    per replica (any role that heartbeats is listed);
  * ``Reward``: rolling reward mean and solve rate over the last ``window`` rewards;
  * ``EvalResult``: newest held-out pass@1 and the first one of the same split;
  * ``DeadLetter``: count by kind, last error; feeder ``Metrics``: groups published.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

import msgspec

from schemas import DeadLetter, EvalResult, Heartbeat, Metrics, Reward


class ReplicaRow(msgspec.Struct, kw_only=True):
    replica_id: str
    role: str
    status: str
    weight_version: int
    tokens_per_s: float
    last_pause_ms: float
    updates_applied: int
    in_flight: int
    age_s: float  # seconds since its last heartbeat


class ComponentRow(msgspec.Struct, kw_only=True):
    name: str
    state: str
    restarts: int
    pid: int | None
    last_exit: int | None
    log_path: str


class EvalFigure(msgspec.Struct, kw_only=True):
    split: str
    weight_version: int
    pass_at_1: float
    tasks: int
    samples: int


class ViewModel(msgspec.Struct, kw_only=True):
    """Everything the view shows; numbers raw (None = not seen yet), rows in display order."""

    elapsed_s: float
    train_step: int | None
    published_version: int | None
    sampling_tokens_per_s: float  # sum over live samplers
    training_tokens_per_s: float | None
    groups_trained: int
    groups_dropped: dict[str, int]  # reason -> groups dropped, summed over trainer processes
    trajectories_dropped: dict[str, int]  # reason -> trajectories dropped alone (their group lives on)
    groups_published: int | None
    step_reward_mean: float | None
    rewards_seen: int
    window_rewards: int  # rewards in the rolling window
    reward_mean: float | None  # rolling, over the window
    solve_rate: float | None  # rolling, over the window
    # Rolling, over the window's rewards (their Cost): new segments the chat template forced
    # (sampler/formats, a turn that could not be bridged token-exactly) per 1,000 turns.
    template_rerenders_per_1k_turns: float | None = None
    # Groups trained / (trained + dropped for zero variance): the share of groups decided
    # on their rewards that carried a learning signal (rollway.group_signal).
    informative_share: float | None = None
    eval_latest: EvalFigure | None
    eval_first: EvalFigure | None  # first eval of the latest one's split
    entropy_full: float | None
    entropy_kept: float | None
    mismatch_kl: float | None  # k3 estimator, trainer vs sampler log-probs
    staleness_mean: float | None
    staleness_max: float | None
    apply_pause_ms: float | None  # largest last pause over samplers that applied an update
    dead_letters: int
    dead_letters_by_kind: dict[str, int]
    last_dead_letter: str
    undecodable: int  # records the view itself could not decode
    replicas: list[ReplicaRow]
    components: list[ComponentRow]
    notices: list[str]


def informative_share(trained: int, zero_variance: int) -> float | None:
    decided = trained + zero_variance
    return trained / decided if decided else None


# Trainer counters the view sums over processes: groups dropped (one per group, by
# reason) and trajectories dropped on their own (label -> counter).
GROUP_DROP_PREFIX = "count_groups_dropped_"
TRAJECTORY_DROPS = {"duplicate": "count_dropped_duplicate", "late": "count_dropped_late",
                    "invalid": "count_dropped_invalid", "stale": "count_trajectories_dropped_stale"}
_COUNTED = frozenset(TRAJECTORY_DROPS.values())
# Heartbeats older than this many seconds do not count towards the live tokens/s.
LIVE_BEAT_S = 15.0


class LiveState:
    def __init__(self, *, trainer_source: str = "trainer", feeder_source: str = "feeder", window: int = 200,
                 max_notices: int = 5) -> None:
        self.trainer_source = trainer_source
        self.feeder_source = feeder_source
        self.window: deque[Reward] = deque(maxlen=window)
        self._reward_ids: set[str] = set()
        self.rewards_seen = 0
        self.trainer: Metrics | None = None  # newest trainer step's metrics
        self._step_groups: dict[int, float] = {}
        # process_started_at -> newest counter values of that trainer process
        self._counters: dict[float, dict[str, float]] = {}
        self.feeder: Metrics | None = None
        self.beats: dict[str, Heartbeat] = {}
        self.evals: list[EvalResult] = []
        self.dead_letters: list[DeadLetter] = []
        self.undecodable = 0
        self.notices: deque[str] = deque(maxlen=max_notices)

    # -- events in --------------------------------------------------------------------------
    def apply(self, event: object) -> None:
        if isinstance(event, Metrics):
            self._metrics(event)
        elif isinstance(event, Heartbeat):
            old = self.beats.get(event.replica_id)
            if old is None or event.created_at >= old.created_at:
                self.beats[event.replica_id] = event
        elif isinstance(event, Reward):
            if event.trajectory_id not in self._reward_ids:  # a re-published reward counts once
                self._reward_ids.add(event.trajectory_id)
                self.rewards_seen += 1
                self.window.append(event)
        elif isinstance(event, EvalResult):
            self.evals.append(event)
        elif isinstance(event, DeadLetter):
            self.dead_letters.append(event)

    def note(self, line: str) -> None:
        """A supervisor notice (restart, crash) shown under the tables."""
        self.notices.append(line)

    def _metrics(self, m: Metrics) -> None:
        if m.source == self.feeder_source:
            if self.feeder is None or m.created_at >= self.feeder.created_at:
                self.feeder = m
            return
        if m.source != self.trainer_source or m.step < 0:
            return
        if m.step not in self._step_groups:
            self._step_groups[m.step] = m.values.get("groups", 0.0)
        if self.trainer is None or m.step > self.trainer.step:  # first entry of a step wins, as in the log
            self.trainer = m
        process = m.values.get("process_started_at", 0.0)
        counters = self._counters.setdefault(process, {})
        for key, value in m.values.items():
            if key.startswith(GROUP_DROP_PREFIX) or key in _COUNTED:
                # Counters only grow within one process; keep the largest seen.
                counters[key] = max(counters.get(key, 0.0), value)

    @property
    def train_step(self) -> int | None:
        return self.trainer.step if self.trainer is not None else None

    # -- table model out --------------------------------------------------------------------
    def model(self, *, now: float, elapsed_s: float = 0.0, components: Iterable[object] = ()) -> ViewModel:
        t = self.trainer.values if self.trainer is not None else {}

        def tv(key: str) -> float | None:
            return t.get(key) if self.trainer is not None and key in t else None

        groups_dropped: dict[str, int] = {}
        trajectories_dropped: dict[str, int] = {}
        for counters in self._counters.values():
            for key, value in counters.items():
                if key.startswith(GROUP_DROP_PREFIX):
                    reason = key.removeprefix(GROUP_DROP_PREFIX)
                    groups_dropped[reason] = groups_dropped.get(reason, 0) + int(value)
            for label, key in TRAJECTORY_DROPS.items():
                if key in counters:
                    trajectories_dropped[label] = trajectories_dropped.get(label, 0) + int(counters[key])
        window = list(self.window)
        replicas = sorted(
            (ReplicaRow(replica_id=b.replica_id, role=b.role, status=b.status, weight_version=b.weight_version,
                        tokens_per_s=b.tokens_per_s, last_pause_ms=b.last_pause_ms,
                        updates_applied=b.updates_applied, in_flight=b.in_flight,
                        age_s=max(now - b.created_at, 0.0))
             for b in self.beats.values()),
            key=lambda r: (r.role, r.replica_id),
        )
        live = [r for r in replicas if r.role == "sampler" and r.status in ("serving", "paused")
                and r.age_s <= LIVE_BEAT_S]
        pauses = [r.last_pause_ms for r in replicas if r.role == "sampler" and r.updates_applied > 0]
        latest, first = self._evals()
        kinds: dict[str, int] = {}
        for d in self.dead_letters:
            kinds[d.error_kind] = kinds.get(d.error_kind, 0) + 1
        last_dl = self.dead_letters[-1] if self.dead_letters else None
        return ViewModel(
            elapsed_s=elapsed_s,
            train_step=self.train_step,
            published_version=int(t["published_version"]) if "published_version" in t else None,
            sampling_tokens_per_s=sum(r.tokens_per_s for r in live),
            training_tokens_per_s=tv("tokens_per_s"),
            groups_trained=int(sum(self._step_groups.values())),
            groups_dropped=dict(sorted(groups_dropped.items())),
            trajectories_dropped=dict(sorted(trajectories_dropped.items())),
            groups_published=int(self.feeder.values.get("published_groups", 0)) if self.feeder else None,
            step_reward_mean=tv("reward_mean"),
            rewards_seen=self.rewards_seen,
            window_rewards=len(window),
            reward_mean=sum(r.reward for r in window) / len(window) if window else None,
            solve_rate=sum(1 for r in window if solved(r)) / len(window) if window else None,
            template_rerenders_per_1k_turns=rerenders_per_1k_turns(window),
            informative_share=informative_share(int(sum(self._step_groups.values())),
                                                groups_dropped.get("zero_variance", 0)),
            eval_latest=latest,
            eval_first=first,
            entropy_full=tv("entropy_full"),
            entropy_kept=tv("entropy_kept"),
            mismatch_kl=tv("mismatch_kl_k3"),
            staleness_mean=tv("staleness_mean"),
            staleness_max=tv("staleness_max"),
            apply_pause_ms=max(pauses) if pauses else None,
            dead_letters=len(self.dead_letters),
            dead_letters_by_kind=dict(sorted(kinds.items())),
            last_dead_letter=f"{last_dl.topic}@{last_dl.offset}: {last_dl.error}" if last_dl else "",
            undecodable=self.undecodable,
            replicas=replicas,
            components=[ComponentRow(name=c.name, state=c.state, restarts=c.restarts, pid=c.pid,
                                     last_exit=c.last_exit, log_path=c.log_path) for c in components],
            notices=list(self.notices),
        )

    def _evals(self) -> tuple[EvalFigure | None, EvalFigure | None]:
        if not self.evals:
            return None, None
        latest = max(self.evals, key=lambda e: (e.weight_version, e.created_at))
        same = [e for e in self.evals if e.split == latest.split]
        first = min(same, key=lambda e: (e.weight_version, e.created_at))
        return eval_figure(latest), eval_figure(first)


def rerenders_per_1k_turns(rewards: list[Reward]) -> float | None:
    turns = sum(r.cost.turns for r in rewards)
    return 1000.0 * sum(r.cost.template_rerenders for r in rewards) / turns if turns else None


def solved(reward: Reward) -> bool:
    """A solve, as the feeder counts it by default: full score and no cheating."""
    return reward.score >= 1.0 and not reward.cheated


def eval_figure(e: EvalResult) -> EvalFigure:
    return EvalFigure(split=e.split, weight_version=e.weight_version, pass_at_1=e.pass_at_1,
                      tasks=e.tasks, samples=e.samples)
