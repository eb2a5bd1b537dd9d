"""Feeder settings."""

from __future__ import annotations

import msgspec


class FeederConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # A task folder (task folders and SWE-style *.jsonl files), one .jsonl file, or the
    # procedural family: "family:train" (or "family:heldout", for evaluation-style runs).
    tasks_dir: str = "tasks/demo"
    # With tasks_dir = "family:<split>": how many tasks of the split, and their seed.
    family_tasks: int = 2000
    # Not the warm start's seed (WarmStartConfig.seed = 0): RL draws train instances the
    # SFT transcripts did not show (overlap measured in docs/results.md), so a group's
    # outcome reflects the skill, not a memorised instance.
    family_seed: int = 1
    # With tasks_dir = "family:<split>": the share of arith and text draws in their long
    # form (three operations or steps; tasks.family.generate's long_share), a harder level
    # of the same skills that keeps the frontier open once the short forms are solved
    # (docs/results.md, #30 point 2). Useful only with a warm start that saw the long form
    # (rollway model init --long-share). 0 = the draws as before.
    family_long_share: float = 0.0
    group_size: int = 4
    # Grow a task's group from group_size up to this many samples until the chance that
    # its rewards are not all equal (by the task's estimated solve rate) reaches
    # informative_target (tasks.selection, "Group size by solve rate"); needs
    # selection_weight = "informative". 0 = every group has group_size samples.
    group_size_max: int = 0
    informative_target: float = 0.8
    # Pace: at most this many groups per second (a steady rate, no bursts).
    groups_per_second: float = 1.0
    # Backpressure: stop publishing while this many published groups are not yet fully
    # rewarded (samplers or graders are behind); resume as groups complete.
    max_outstanding_groups: int = 16
    # A group still incomplete after this long stops counting as outstanding (a lost
    # group must not block the feeder forever).
    outstanding_timeout_s: float = 900.0
    # Stop after publishing this many groups (0 = run until stopped or nothing is left).
    max_groups: int = 0
    # Rebuild solve statistics from the whole rewards log on start (the log is the
    # system of record), rather than only counting rewards from now on.
    replay_rewards: bool = True
    metrics_interval_s: float = 30.0
    # --- selection policy (tasks.selection.TaskSelector) ---
    # A reward counts as solved when not cheated and score >= success_threshold.
    success_threshold: float = 1.0
    # Beta prior on each task's solve rate; unseen tasks get the prior's p(1 - p).
    prior_successes: float = 1.0
    prior_failures: float = 1.0
    # Solve rates are over each task's most recent outcomes, so they follow the policy.
    solve_rate_window: int = 64
    # Retire a task once it has this many outcomes in its window and its window solve
    # rate is >= retire_at_or_above or <= retire_at_or_below (too easy / too hard);
    # 0 = never retire.
    min_attempts_to_retire: int = 16
    retire_at_or_above: float = 1.0
    retire_at_or_below: float = 0.0
    # Pool solve rates by task kind (metadata "kind", e.g. the family's arith/text/...):
    # a task's prior is its kind's solve rate over this many recent outcomes, so fresh
    # instances of kinds the policy always or never solves are drawn less (their groups
    # carry no gradient). 0 = no pooling.
    pool_by_kind_window: int = 256
    # Pool solve rates by skill too (metadata "skill": a kind's behaviour class, e.g.
    # arith's "mul_add"), over this many recent outcomes of the skill, with the kind's
    # rate as its prior: kinds mix easy and hard skills. 0 = no skill pooling (the
    # components' default: tasks without skills; the main job, rollway up's MAIN_JOB,
    # pools at 64: docs/results.md, issue #30).
    pool_by_skill_window: int = 0
    # What a task's weight is: "informative", the chance that a group of group_size
    # samples has reward variance (1 - p^G - (1-p)^G: the trainer drops the others), or
    # "variance", the Bernoulli variance p(1 - p) (the components' default; the main job
    # weights by "informative": 0.513 of groups with a signal against 0.257 in 30-minute
    # runs, with its other selection settings, docs/results.md).
    selection_weight: str = "variance"
    # Weight ** (1 / temperature): < 1 draws more from tasks likely to give an
    # informative group, > 1 spreads draws more evenly.
    selection_temperature: float = 1.0
    # Each task kind gets at least this share of the draws (spread over its tasks by their
    # weights), so a sharp temperature cannot starve a kind; must be below 1 / (number of
    # kinds). 0 = no floor (the components' default; the main job's is 0.05 with
    # temperature 0.05, measured in docs/results.md, issue #30).
    selection_kind_floor: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.group_size >= 1, f"feeder.group_size must be at least 1, got {self.group_size}"),
            (self.group_size_max == 0 or self.group_size_max >= self.group_size,
             f"feeder.group_size_max must be 0 (fixed groups) or at least group_size ({self.group_size}), "
             f"got {self.group_size_max}"),
            (self.group_size_max == 0 or self.selection_weight == "informative",
             "feeder.group_size_max needs feeder.selection_weight = 'informative' (the size follows the chance "
             "that a group is informative)"),
            (0.0 < self.informative_target < 1.0,
             f"feeder.informative_target must be in (0, 1), got {self.informative_target}"),
            (self.groups_per_second > 0, f"feeder.groups_per_second must be positive, got {self.groups_per_second}"),
            (self.max_outstanding_groups >= 1, "feeder.max_outstanding_groups must be at least 1"),
            (self.outstanding_timeout_s > 0, "feeder.outstanding_timeout_s must be positive"),
            (self.max_groups >= 0, "feeder.max_groups must not be negative"),
            (self.family_tasks >= 1, f"feeder.family_tasks must be at least 1, got {self.family_tasks}"),
            (0.0 <= self.family_long_share <= 1.0,
             f"feeder.family_long_share must lie in [0, 1], got {self.family_long_share}"),
            (self.prior_successes > 0 and self.prior_failures > 0, "feeder.prior_successes and prior_failures must be positive"),
            (self.solve_rate_window >= 1, "feeder.solve_rate_window must be at least 1"),
            (self.pool_by_kind_window >= 0, "feeder.pool_by_kind_window must not be negative"),
            (self.pool_by_skill_window >= 0, "feeder.pool_by_skill_window must not be negative"),
            (self.selection_weight in ("informative", "variance"),
             f"feeder.selection_weight must be 'informative' or 'variance', got {self.selection_weight!r}"),
            (self.selection_temperature > 0,
             f"feeder.selection_temperature must be positive, got {self.selection_temperature}"),
            (0.0 <= self.selection_kind_floor < 1.0,
             f"feeder.selection_kind_floor must be in [0, 1), got {self.selection_kind_floor}"),
            (0 <= self.min_attempts_to_retire <= self.solve_rate_window,
             f"feeder.min_attempts_to_retire must be within 0..solve_rate_window ({self.solve_rate_window}), "
             f"got {self.min_attempts_to_retire}"),
            (0.0 <= self.retire_at_or_below < self.retire_at_or_above <= 1.0,
             "feeder: need 0 <= retire_at_or_below < retire_at_or_above <= 1"),
            (0.0 < self.success_threshold <= 1.0, "feeder.success_threshold must be in (0, 1]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.tasks_dir.startswith("family:"):
            from tasks.family import parse_task_set

            parse_task_set(self.tasks_dir)  # one-line error naming the valid splits
