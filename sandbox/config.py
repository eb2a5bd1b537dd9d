"""Sandbox service and reward settings."""

from __future__ import annotations

from typing import Literal

import msgspec


class ImageConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The image store of a sandbox host (:mod:`sandbox.images`): OCI images fetched with
    skopeo, unpacked once with umoci into shared read-only root filesystems."""

    # Where pulled and unpacked images live (root-only). Empty = /var/cache/rollway/images
    # as root, else ~/.cache/rollway/images.
    cache_dir: str = ""
    # Unpacked roots plus their metadata stay under this; least recently used images not in
    # use by a session are evicted to make room, and an image that cannot fit is an error.
    max_cache_bytes: int = 50 * 1024**3
    # Unpacks (and pulls) running at once on this host; more wait their turn.
    max_concurrent_unpacks: int = 2
    # Seconds a pull (skopeo copy) or an unpack (umoci) may take.
    pull_timeout_s: float = 1800.0
    # containers-policy.json(5) for skopeo; empty = the system's (/etc/containers/policy.json),
    # or accept anything when there is none.
    policy: str = ""
    # containers-registries.conf(5) for skopeo (mirrors, blocked registries, a registry
    # served over plain HTTP with ``insecure = true``); empty = the system's.
    registries_conf: str = ""
    # Registry credentials, containers-auth.json(5) (``skopeo login --authfile`` writes
    # one; Docker's ~/.docker/config.json has the same format); empty = skopeo's default
    # (${XDG_RUNTIME_DIR}/containers/auth.json, then ~/.docker/config.json).
    auth_file: str = ""
    # Sessions kept ready per image in use (created ahead, while earlier ones run); 0 = off
    # (no warm trees at all). A warm tree with its first sandbox started makes a session
    # start 0.08x `docker run --rm` against 0.12-0.14x cold (docs/environments.md). Warm
    # trees count against max_sessions and give way to real sessions when the pool is full.
    warm_sessions_per_image: int = 2
    # A GRPO group opens G sessions of one image at once, and a floor of 2 warm trees left
    # G - 2 of them cold. With this on, the pool keeps as many trees of an image ready as
    # sessions of it were open together recently (opened within warm_group_window_s of
    # each other and live at once), never fewer than warm_sessions_per_image, bounded by
    # the free slots of max_sessions; the trees above the floor go warm_demand_ttl_s after
    # the last such group of the image.
    warm_follow_demand: bool = True
    warm_group_window_s: float = 2.0
    warm_demand_ttl_s: float = 300.0
    # An image none of whose sessions is open or opening is idle (its group ended). The
    # trees of the warm_idle_images images that went idle last are kept (the image's next
    # group may come soon); an older idle image's trees are dropped at once, giving back
    # their slots and their hold on the image in the cache. In SWE-Gym-style training
    # every instance has its own image, which recurs only within its group: without this
    # bound each image's trees kept their slots (the floor for good, the group size for
    # warm_demand_ttl_s) and pinned the image in the cache. 0 = drop as soon as idle.
    warm_idle_images: int = 2

    def __post_init__(self) -> None:
        if self.max_cache_bytes <= 0:
            raise ValueError(f"sandbox.images.max_cache_bytes must be positive, got {self.max_cache_bytes}")
        if self.max_concurrent_unpacks <= 0:
            raise ValueError(f"sandbox.images.max_concurrent_unpacks must be positive, got {self.max_concurrent_unpacks}")
        if self.warm_sessions_per_image < 0:
            raise ValueError("sandbox.images.warm_sessions_per_image must be 0 (off) or positive")
        if self.warm_idle_images < 0:
            raise ValueError(f"sandbox.images.warm_idle_images must be 0 or positive, got {self.warm_idle_images}")
        if self.warm_group_window_s <= 0 or self.warm_demand_ttl_s <= 0:
            raise ValueError("sandbox.images.warm_group_window_s and warm_demand_ttl_s must be positive, got "
                             f"{self.warm_group_window_s} and {self.warm_demand_ttl_s}")


class SandboxConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The sandbox service (:mod:`sandbox.service`) and the isolation of every command."""

    host: str = "127.0.0.1"
    port: int = 8300
    # Bearer tokens of the API (sandbox/auth.py): a credentials file's "sandbox" section
    # ("" = an open API, logged at start; rollway up / compose set it).
    tokens_file: str = ""
    # Live sessions at once; one more gets 429.
    max_sessions: int = 16
    # Commands (agent exec and grading runs) at once; a command waits at most
    # command_queue_timeout_s for a slot, then gets 429.
    max_concurrent_commands: int = 4
    command_queue_timeout_s: float = 30.0
    # Default and ceiling of an exec's wall-clock timeout (the whole process tree is killed).
    command_timeout_s: float = 10.0
    max_command_timeout_s: float = 120.0
    # Per-process rlimits inside the sandbox.
    cpu_seconds: int = 10
    memory_bytes: int = 512 * 1024 * 1024
    max_processes: int = 64
    max_file_bytes: int = 16 * 1024 * 1024
    max_open_files: int = 256
    # stdout and stderr each keep this much; more is dropped and reported as truncated.
    max_output_bytes: int = 64 * 1024
    # A command that writes this much output in total is killed (killed="output").
    max_output_total_bytes: int = 8 * 1024 * 1024
    # Size of the private /tmp tmpfs of each command.
    tmp_bytes: int = 64 * 1024 * 1024
    # Sandboxed commands run as uid/gid uid_base + session slot (never root): the kernel
    # ignores RLIMIT_NPROC for root, so this is what makes the process limit hold.
    uid_base: int = 60000
    # Per-command cgroup (pids.max, memory limit for the whole tree): auto = when this
    # process may create cgroups, off, or required (fail at start without).
    cgroups: Literal["auto", "off", "required"] = "auto"
    # Python inside the sandbox: this venv (and the interpreter it points to) is bound
    # read-only at the same paths. Empty = the venv the service itself runs from.
    python_venv: str = ""
    # More host paths bound read-only at the same place inside every sandbox.
    extra_ro_binds: list[str] = []
    workspace_root: str = ""  # empty = system temp dir
    # Largest file GET/PUT through the API, and the largest workspace the grader takes
    # (counting the session's own files: an image task's untouched image files are not).
    max_file_bytes_api: int = 4 * 1024 * 1024
    max_snapshot_bytes: int = 64 * 1024 * 1024
    max_snapshot_files: int = 20000
    # Sessions untouched this long are closed (their pool slot freed).
    session_idle_timeout_s: float = 1800.0
    tasks_dir: str = "tasks/demo"
    # The grader's run of the hidden tests in a fresh sandbox.
    grading_timeout_s: float = 120.0
    grading_cpu_seconds: int = 60
    publish_rewards: bool = True
    # Hard size and file-count limit of each session workspace and each grading folder:
    # a tmpfs of that size mounted on it (sandbox/quota.py), so a full workspace is
    # ENOSPC inside the sandbox and nothing outside it. auto = when the service runs as
    # root (mounting needs it), off, or required (fail at start without).
    disk_quota: Literal["auto", "off", "required"] = "auto"
    workspace_bytes: int = 256 * 1024 * 1024
    workspace_inodes: int = 65536
    # The seccomp filter of sandbox/seccomp.py on every command (no namespaces, mounts,
    # ptrace, bpf, keyctl, perf_event_open, userfaultfd, kexec).
    seccomp: bool = True
    # Start each session's next sandbox ahead (at create, and shortly after each command:
    # bwrap, namespaces, mounts, cgroup, uid drop), waiting for its command on a pipe, so
    # an exec only hands the command over (sandbox/runner.py Jail.prestart). The same
    # isolation per command; costs one idle sandbox (3 small processes) per session.
    prestart_sandboxes: bool = True
    # Grading runs the hidden tests and the solution in two sandboxes joined by the
    # bridge (sandbox/bridge.py); the solution's runs as uid (session uid + this offset),
    # so it can neither signal nor read the tests' process.
    grading_solution_uid_offset: int = 20000
    # A task whose test command is not pytest cannot be graded across the bridge: its
    # hidden tests would run in the solution's process, where the solution can read and
    # patch them (the reward hacks of docs/sandbox.md). Off: such a task scores 0 with a
    # reason naming the command; on: it runs as written and only its exit code counts.
    allow_unisolated_grading: bool = False
    # After this many messages across the grading bridge, both of its ends pin themselves
    # to one CPU (the grader picks it, round robin over the service's CPUs). A bridge call
    # is a synchronous ping-pong: on one CPU each hand-over is a local context switch,
    # across two it is a wake-up of a sleeping CPU, which in a VM is the largest part of a
    # call (lru_cache's 200k calls: ~24% less time, docs/sandbox.md "Grading time"). Only
    # call-heavy tests get that far, so startup stays parallel. The kernel cannot move a
    # pinned pair off a busy CPU: 0 = never pin.
    grading_bridge_pin_after: int = 200
    # OCI images as sandbox roots for tasks that name one (TaskSpec.image).
    images: ImageConfig = msgspec.field(default_factory=ImageConfig)

    def __post_init__(self) -> None:
        if self.workspace_bytes <= 0 or self.workspace_inodes <= 0:
            raise ValueError("sandbox.workspace_bytes and sandbox.workspace_inodes must be positive")
        # Solution uids (session uid + offset) must lie above every claimable range
        # (sandbox/uid_claim.py): inside one they are another service's session uids, whose
        # clean-up kills them and whose start-up sweep (sandbox/stale_trees.py) reads a live
        # grading's tree as that range's.
        from sandbox.uid_claim import MAX_RANGES, RANGE_STRIDE

        if self.grading_solution_uid_offset < MAX_RANGES * RANGE_STRIDE:
            raise ValueError(f"sandbox.grading_solution_uid_offset must be at least {MAX_RANGES * RANGE_STRIDE} "
                             f"(above every uid range services claim from uid_base), "
                             f"got {self.grading_solution_uid_offset}")
        if self.grading_bridge_pin_after < 0:
            raise ValueError("sandbox.grading_bridge_pin_after must be 0 (off) or positive")
        if self.uid_base <= 0:
            raise ValueError(f"sandbox.uid_base must be a positive uid (never root), got {self.uid_base}")
        for name in ("max_sessions", "max_concurrent_commands", "max_processes", "max_open_files"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox.{name} must be positive, got {getattr(self, name)}")
        if self.max_sessions > RANGE_STRIDE // 2:  # a session's uid is uid_base + slot, in its claimed range
            raise ValueError(f"sandbox.max_sessions must be at most {RANGE_STRIDE // 2} (one uid range of "
                             f"{RANGE_STRIDE}), got {self.max_sessions}")
        if self.command_timeout_s <= 0 or self.max_command_timeout_s < self.command_timeout_s:
            raise ValueError("sandbox.command_timeout_s must be positive and at most max_command_timeout_s")


PHASES = ("unconstrained", "budget")


class RewardConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How a verified score and a rollout's cost become a reward (see :mod:`sandbox.reward`)."""

    # Reward for a fully solved task before penalties.
    solve_reward: float = 1.0
    # How the grader turns test results into the score (the grader reads this):
    # all: score 1 only when every hidden test passes; fraction: passed / total.
    scoring: Literal["all", "fraction"] = "all"
    # Linear length penalty, per generated token; charged in budget phases, and in
    # unconstrained phases too only when length_penalty_in_unconstrained is set.
    length_penalty_per_token: float = 0.0
    length_penalty_in_unconstrained: bool = False
    # Alternating phases as [phase, length] pairs, e.g. [["unconstrained", 100], ["budget", 50]]:
    # positions 0-99 unconstrained, 100-149 budget, then the cycle repeats (or, with
    # phase_cycle = false, the last phase lasts forever). Empty: always unconstrained.
    phase_schedule: list[tuple[str, int]] = msgspec.field(default_factory=list)
    # What a position counts: trainer "step" or "version" (weight version of the rollout).
    phase_unit: Literal["step", "version"] = "step"
    phase_cycle: bool = True
    # Budget phases: penalty = budget_penalty_per_unit * max(0, weighted_cost - budget), with
    # weighted_cost = w_tokens * generated + w_env_tokens * env + w_turns * turns + w_s * tool_seconds.
    budget: float = 2000.0
    budget_weight_tokens: float = 1.0
    budget_weight_env_tokens: float = 0.0
    budget_weight_turns: float = 50.0
    budget_weight_tool_seconds: float = 10.0
    budget_penalty_per_unit: float = 0.0005
    # An honest reward's penalties (length + budget) are capped at max_penalty; a detected
    # cheat earns -(max_penalty where penalties apply, else 0) - cheat_margin: strictly
    # below every honest reward of its phase (sandbox/reward.py, "cheat floor").
    max_penalty: float = 2.0
    cheat_margin: float = 0.1

    def __post_init__(self) -> None:
        if not self.cheat_margin > 0:
            raise ValueError(f"reward.cheat_margin must be positive (a cheat must earn strictly less "
                             f"than any honest attempt), got {self.cheat_margin}")
        for i, (phase, length) in enumerate(self.phase_schedule):
            if phase not in PHASES:
                raise ValueError(f"reward.phase_schedule[{i}]: unknown phase {phase!r} (known: {', '.join(PHASES)})")
            if length <= 0:
                raise ValueError(f"reward.phase_schedule[{i}]: length must be positive, got {length}")
        for name in (
            "length_penalty_per_token", "budget", "budget_weight_tokens", "budget_weight_env_tokens",
            "budget_weight_turns", "budget_weight_tool_seconds", "budget_penalty_per_unit", "max_penalty",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"reward.{name} must not be negative, got {getattr(self, name)}")
