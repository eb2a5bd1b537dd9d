"""Which task to sample next: favour tasks the current policy sometimes solves.

Pure and seeded (no I/O, no clock), so the feeder's choices are reproducible and the
policy is unit-testable with exact numbers.

For each task, over its last ``window`` outcomes (``n`` attempts, ``s`` solved), with a
Beta(``a``, ``b``) prior::

    p      = (s + a) / (n + a + b)        posterior mean solve rate
    weight = p * (1 - p)                   Bernoulli variance: the learning signal of a
                                           group is largest when its samples disagree
    P(task) = weight / sum of weights over active tasks

With ``group_size`` G (the feeder passes its own), the weight is instead the chance that
a group of G samples is *informative* (not all equal: the trainer drops the rest)::

    weight = (1 - p^G - (1 - p)^G) ^ (1 / temperature)

``temperature`` < 1 sharpens the draws towards tasks whose groups are likely to carry a
signal, > 1 flattens them (1: proportional to the chance itself).

Group size by solve rate: with ``group_size_max`` M > G, a task's group grows from G
until the chance reaches ``informative_target``, at most to M::

    G(task) = min{g in G..M : 1 - p^g - (1 - p)^g >= target}   (M where none reaches it)

and its weight is the chance at G(task). A policy that solves a skill 9 times in 10
gives a group of 8 a 0.57 chance of disagreeing, one of 16 a 0.81 chance: the extra
samples buy the failures the trainer learns from. The size is fixed before sampling,
from estimates only, so it never looks at the group's own outcomes (no bias: a group is
never cut or extended because of what its samples scored).

Pooling by kind: with ``groups`` (task id -> kind, e.g. the family's ``arith``), the
prior's mean is the kind's recent solve rate instead of a / (a + b)::

    m      = (S + a) / (N + a + b)        over the kind's last ``group_window`` outcomes
    p      = (s + (a + b) m) / (n + a + b)

so a task never tried yet is weighted by how its kind is doing: when every instance is
fresh (thousands of generated tasks, each drawn about once), per-task counts carry no
information, and without pooling the draws spread evenly over kinds the policy always
or never solves, whose groups have no variance. Without groups (or with no outcomes of
the kind yet) m = a / (a + b) and p is the plain posterior above.

Pooling by skill: a kind mixes behaviours of very different difficulty (one addition vs
a multiplication then a subtraction; a bug in the first or the second operation), and a
kind at 0.5 made of skills at 0 and 1 yields no informative group at all. With
``skills`` (task id -> skill, the family's ``metadata["skill"]``), the skill's recent
outcomes sit between the kind and the task::

    m_skill = (S_s + (a + b) m) / (N_s + a + b)    over the skill's last ``skill_window``
    p       = (s + (a + b) m_skill) / (n + a + b)

An unseen task of an unpooled (or untried) kind has p = a / (a + b) (0.25 weight with
the default a = b = 1, the maximum), so new tasks are tried early. A task is retired for good once it has at least
``min_attempts_to_retire`` outcomes in its window and its window solve rate ``s / n`` is
>= ``retire_at_or_above`` (always solved: nothing left to learn) or <=
``retire_at_or_below`` (never solved: no signal, only cost). ``min_attempts_to_retire
= 0`` never retires.

Kind floor: with ``kind_floor`` f > 0 and kinds known (``kinds``: task id -> kind), each
kind with any active weight gets at least f of the draws, spread over its tasks by their
weights; the rest follows the weights across kinds::

    P(task) = (1 - K f) * w / W  +  f * w / W_kind        K: kinds with W_kind > 0

So a sharp temperature (which sends nearly every draw to the few skills whose groups
disagree) cannot starve a kind the policy does not yet solve: its draws keep measuring
it. The floor weights tasks, never groups: what the trainer keeps is decided by the
assembler once a group is complete (tests/test_dynamic_sampling.py).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Iterable, Mapping

import msgspec
import structlog

from tasks.config import FeederConfig

log = structlog.get_logger(__name__)

RETIRED_SOLVED = "always solved"
RETIRED_UNSOLVED = "never solved"


class TaskStats(msgspec.Struct, kw_only=True):
    window: deque = msgspec.field(default_factory=deque)  # recent outcomes, 1 = solved
    attempts: int = 0  # all outcomes ever recorded
    solved: int = 0
    retired: str = ""  # reason, empty while active

    @property
    def window_attempts(self) -> int:
        return len(self.window)

    @property
    def window_solved(self) -> int:
        return sum(self.window)


def _disagreement(p: float, size: int) -> float:
    """The chance that ``size`` samples at solve rate ``p`` are not all equal."""
    return 1.0 - p ** size - (1.0 - p) ** size


def _floor_for(floor: float, task_ids: list[str], kinds: Mapping[str, str] | None) -> float:
    """The kind floor a task set can take: ``floor``, or half a kind's equal share where
    ``floor`` times the number of kinds reaches 1. rollway up's main job sets a floor for
    the family's four kinds, and a user's task set may have twenty kinds or more: the
    feeder then starts with each kind at 1 / (2 K) of the draws instead of refusing."""
    if not floor:
        return floor
    count = len({(kinds or {}).get(t, "") for t in task_ids})
    if floor * count < 1:
        return floor
    reduced = 0.5 / count
    log.warning("selection_kind_floor_reduced", configured=floor, kinds=count, floor=reduced,
                reason="feeder.selection_kind_floor times the task set's kinds reaches 1")
    return reduced


class TaskSelector:
    def __init__(
        self,
        task_ids: Iterable[str],
        *,
        prior_successes: float = 1.0,
        prior_failures: float = 1.0,
        window: int = 64,
        min_attempts_to_retire: int = 16,
        retire_at_or_above: float = 1.0,
        retire_at_or_below: float = 0.0,
        seed: int = 0,
        groups: Mapping[str, str] | None = None,
        group_window: int = 256,
        skills: Mapping[str, str] | None = None,
        skill_window: int = 64,
        group_size: int = 0,
        temperature: float = 1.0,
        kinds: Mapping[str, str] | None = None,
        kind_floor: float = 0.0,
        group_size_max: int = 0,
        informative_target: float = 0.8,
    ) -> None:
        if group_window < 1:
            raise ValueError(f"group_window must be at least 1, got {group_window}")
        if skill_window < 1:
            raise ValueError(f"skill_window must be at least 1, got {skill_window}")
        if group_size < 0:
            raise ValueError(f"group_size must be >= 0 (0: weight by the variance p(1 - p)), got {group_size}")
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if group_size_max and group_size_max < max(group_size, 1):
            raise ValueError(f"group_size_max must be 0 (fixed groups) or at least group_size ({group_size}), "
                             f"got {group_size_max}")
        if group_size_max and not group_size:
            raise ValueError("group_size_max needs group_size (the informative weight): a variance weight has no "
                             "group to grow")
        if not 0.0 < informative_target < 1.0:
            raise ValueError(f"informative_target must be in (0, 1), got {informative_target}")
        if not 0 <= min_attempts_to_retire <= window:
            raise ValueError(f"min_attempts_to_retire must be within 0..window ({window}), got {min_attempts_to_retire}")
        self.prior_successes = prior_successes
        self.prior_failures = prior_failures
        self.window = window
        self.min_attempts_to_retire = min_attempts_to_retire
        self.retire_at_or_above = retire_at_or_above
        self.retire_at_or_below = retire_at_or_below
        self._rng = random.Random(seed)
        # insertion order is the order of the cumulative walk in choose(): keep it fixed
        self.stats: dict[str, TaskStats] = {}
        for task_id in task_ids:
            if task_id in self.stats:
                raise ValueError(f"duplicate task id {task_id!r}")
            self.stats[task_id] = TaskStats(window=deque(maxlen=window))
        if not self.stats:
            raise ValueError("no tasks to select from")
        self.groups: dict[str, str] = {t: g for t, g in (groups or {}).items() if t in self.stats}
        self.group_windows: dict[str, deque] = {g: deque(maxlen=group_window) for g in self.groups.values()}
        self.skills: dict[str, str] = {t: k for t, k in (skills or {}).items() if t in self.stats}
        self.skill_windows: dict[str, deque] = {k: deque(maxlen=skill_window) for k in self.skills.values()}
        self.group_size = group_size
        self.group_size_max = group_size_max
        self.informative_target = informative_target
        self.temperature = temperature
        # The floor's kinds are its own mapping (kind pooling, groups, may be off); a task
        # without a kind counts as the kind "".
        self.kinds: dict[str, str] = {t: (kinds or {}).get(t, "") for t in self.stats}
        if kind_floor < 0 or kind_floor * len(set(self.kinds.values())) >= 1:
            raise ValueError(f"kind_floor must be >= 0 and below 1 / (number of kinds, "
                             f"{len(set(self.kinds.values()))}), got {kind_floor}")
        self.kind_floor = kind_floor

    @classmethod
    def from_config(cls, task_ids: Iterable[str], cfg: FeederConfig,
                    groups: Mapping[str, str] | None = None,
                    skills: Mapping[str, str] | None = None) -> "TaskSelector":
        task_ids = list(task_ids)
        return cls(
            task_ids,
            prior_successes=cfg.prior_successes,
            prior_failures=cfg.prior_failures,
            window=cfg.solve_rate_window,
            min_attempts_to_retire=cfg.min_attempts_to_retire,
            retire_at_or_above=cfg.retire_at_or_above,
            retire_at_or_below=cfg.retire_at_or_below,
            seed=cfg.seed,
            groups=groups if cfg.pool_by_kind_window else None,
            group_window=max(1, cfg.pool_by_kind_window),
            skills=skills if cfg.pool_by_skill_window else None,
            skill_window=max(1, cfg.pool_by_skill_window),
            group_size=cfg.group_size if cfg.selection_weight == "informative" else 0,
            temperature=cfg.selection_temperature,
            kinds=groups if cfg.selection_kind_floor else None,
            kind_floor=_floor_for(cfg.selection_kind_floor, task_ids, groups),
            group_size_max=cfg.group_size_max if cfg.selection_weight == "informative" else 0,
            informative_target=cfg.informative_target,
        )

    # -- observations ---------------------------------------------------------------
    def record(self, task_id: str, solved: bool) -> str:
        """Count one outcome; returns the retirement reason when this outcome retired the task."""
        stats = self.stats[task_id]
        stats.window.append(1 if solved else 0)
        if task_id in self.groups:
            self.group_windows[self.groups[task_id]].append(1 if solved else 0)
        if task_id in self.skills:
            self.skill_windows[self.skills[task_id]].append(1 if solved else 0)
        stats.attempts += 1
        stats.solved += bool(solved)
        if stats.retired or not self.min_attempts_to_retire or stats.window_attempts < self.min_attempts_to_retire:
            return ""
        rate = stats.window_solved / stats.window_attempts
        if rate >= self.retire_at_or_above:
            stats.retired = RETIRED_SOLVED
        elif rate <= self.retire_at_or_below:
            stats.retired = RETIRED_UNSOLVED
        return stats.retired

    # -- the policy -----------------------------------------------------------------
    def solve_rate(self, task_id: str) -> float:
        """Posterior mean solve rate over the task's window."""
        stats = self.stats[task_id]
        a, b = self.prior_successes, self.prior_failures
        return (stats.window_solved + (a + b) * self.prior_mean(task_id)) / (stats.window_attempts + a + b)

    def kind_mean(self, task_id: str) -> float:
        """The kind's posterior solve rate (a / (a + b) unpooled)."""
        a, b = self.prior_successes, self.prior_failures
        group = self.groups.get(task_id)
        if group is None:
            return a / (a + b)
        outcomes = self.group_windows[group]
        return (sum(outcomes) + a) / (len(outcomes) + a + b)

    def prior_mean(self, task_id: str) -> float:
        """The prior's mean for this task: its skill's posterior solve rate (itself with
        the kind's as prior) when pooled by skill, else the kind's."""
        m = self.kind_mean(task_id)
        skill = self.skills.get(task_id)
        if skill is None:
            return m
        outcomes = self.skill_windows[skill]
        return (sum(outcomes) + (self.prior_successes + self.prior_failures) * m) / (
            len(outcomes) + self.prior_successes + self.prior_failures)

    def group_size_for(self, task_id: str) -> int:
        """How many samples the task's next group gets: ``group_size``, grown (with
        ``group_size_max``) until the group's chance of being informative reaches
        ``informative_target``, at most ``group_size_max``."""
        return self._size_at(self.solve_rate(task_id))

    def _size_at(self, p: float) -> int:
        if not self.group_size_max:
            return self.group_size
        for size in range(self.group_size, self.group_size_max + 1):
            if _disagreement(p, size) >= self.informative_target:
                return size
        return self.group_size_max

    def informative_chance(self, task_id: str) -> float:
        """The chance that the task's next group (:meth:`group_size_for` samples) does not
        have every reward equal, at its posterior solve rate (``group_size`` 0: p(1 - p))."""
        p = self.solve_rate(task_id)
        if not self.group_size:
            return p * (1.0 - p)
        return _disagreement(p, self._size_at(p))

    def weight(self, task_id: str) -> float:
        if self.stats[task_id].retired:
            return 0.0
        chance = self.informative_chance(task_id)
        return chance if self.temperature == 1.0 else chance ** (1.0 / self.temperature)

    def weights(self) -> dict[str, float]:
        return {task_id: self.weight(task_id) for task_id in self.stats}

    def probabilities(self) -> dict[str, float]:
        weights = self.weights()
        total = sum(weights.values())
        if not total:
            return {t: 0.0 for t in weights}
        if not self.kind_floor:
            return {t: w / total for t, w in weights.items()}
        mass: dict[str, float] = {}
        for t, w in weights.items():
            mass[self.kinds[t]] = mass.get(self.kinds[t], 0.0) + w
        floored = sum(1 for m in mass.values() if m > 0)
        rest = 1.0 - self.kind_floor * floored
        return {t: (rest * w / total + self.kind_floor * w / mass[self.kinds[t]] if w else 0.0)
                for t, w in weights.items()}

    def expected_informative(self) -> float | None:
        """The chance that the next draw gives an informative group, by the current
        estimates (None without a group size): sum over tasks of P(task) x its chance."""
        if not self.group_size:
            return None
        probs = self.probabilities()
        return sum(q * self.informative_chance(t) for t, q in probs.items() if q)

    def active(self) -> list[str]:
        return [t for t, s in self.stats.items() if not s.retired]

    def retired(self) -> dict[str, str]:
        return {t: s.retired for t, s in self.stats.items() if s.retired}

    def choose(self) -> str | None:
        """A task drawn with probability proportional to its weight (with a kind floor:
        by :meth:`probabilities`); None when all are retired."""
        weights = self.probabilities() if self.kind_floor else self.weights()
        total = sum(weights.values())
        if total <= 0:
            return None
        x = self._rng.random() * total
        last = None
        for task_id, w in weights.items():
            if w <= 0:
                continue
            last = task_id
            x -= w
            if x < 0:
                return task_id
        return last  # floating-point remainder: the last active task
