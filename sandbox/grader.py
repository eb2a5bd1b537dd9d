"""The grader: the agent's final workspace, the task's hidden tests, a fresh sandbox.

On submit:

1. snapshot the session workspace (regular files only, no links followed);
2. look for cheating: static checks on the files the agent added or changed
   (:mod:`sandbox.cheating`) and attempts to reach the network in the session's tool-call
   log (:mod:`sandbox.netwatch`); any finding means reward 0 with the findings as reason,
   and the hidden tests do not run;
3. run the hidden tests in the task's grading mode (``TaskSpec.grading``, on the task's
   image where it has one): ``bridged`` (:mod:`sandbox.grading_bridged`: the tests and
   the solution in two fresh sandboxes joined by the plain-data bridge, so solution code
   never runs in the tests' process) or ``in-env`` (:mod:`sandbox.grading_inenv`: the
   tests in the solution's process, in a fresh sandbox on the agent's tree with every
   test file and test config restored from the task). Both run this grading's canaries
   (:mod:`sandbox.canaries`) and the grader's pytest plugin, and the report is checked
   against what was selected and collected (:mod:`sandbox.result_check`): tampering is
   cheating. Outcomes come from the report, never from the exit code alone: exit 0 with
   a missing report, or with failures in it, is an exit-code trick (cheating). A task
   whose test command is not pytest runs as written, on the task's tests, test
   configuration and runner files (:mod:`sandbox.grading_plain`, on its image where it
   has one), and only its exit code counts (refused unless
   ``sandbox.allow_unisolated_grading``);
4. score (``all``: 1 when every test passed; ``fraction``: passed / total), reward via
   :func:`sandbox.reward.compute_reward`, publish ``Reward`` on ``rollway.rewards``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Protocol

import msgspec
import structlog

from sandbox import grading_bridged, grading_inenv, grading_plain, image_changes
from sandbox.cheating import find_cheats
from sandbox.config import RewardConfig, SandboxConfig
from sandbox.grading_common import (
    HIDDEN_TESTS_DIR, HiddenPlan, RunOutput, make_plan, root_configs, solution_files,
)
from sandbox.image_repo import ImageRepoCache, ImageTree, image_tree
from sandbox.images import ImageStore
from sandbox.isolation import Limits
from sandbox.junit import Report, ReportError, outcomes_of, parse_report
from sandbox.netwatch import ToolCall, network_attempts
from sandbox.quota import Quota
from sandbox.result_check import INTERNAL_ERROR_CASE, check as check_result
from sandbox.reward import compute_reward
from sandbox.runner import CommandResult, Jail
from sandbox.workspace import Snapshot, Workspace
from schemas import Cost, Reward
from tasks.spec import TaskSpec, pytest_arguments
from tasks.store import TaskStore

log = structlog.get_logger(__name__)

_MAX_NAMES_IN_REASON = 5
_PYTEST_INTERNAL_ERROR = 3  # pytest.ExitCode.INTERNAL_ERROR

class SubmitRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /sessions/{id}/submit``."""

    trajectory_id: str
    task_id: str = ""  # defaults to the session's task; must match it when given
    group_id: str = ""
    sample_index: int = 0
    attempt: str = ""
    cost: Cost = msgspec.field(default_factory=Cost)
    weight_version: int = -1
    # The trainer step the rollout's weights come from (-1 = unknown); chooses the reward
    # phase when reward.phase_unit = "step".
    trainer_step: int = -1


class Verdict(msgspec.Struct, kw_only=True):
    score: float
    tests_passed: int = 0
    tests_total: int = 0
    cheated: bool = False
    reason: str = ""


class Publisher(Protocol):
    async def publish(self, event: Reward) -> object: ...


class Grader:
    def __init__(
        self,
        cfg: SandboxConfig,
        reward_cfg: RewardConfig,
        store: TaskStore,
        jail: Jail,
        publisher: Publisher | None = None,
        *,
        quota: Quota | None = None,
        images: ImageStore | None = None,
    ) -> None:
        self.cfg = cfg
        self.reward_cfg = reward_cfg
        self.store = store
        self.jail = jail
        self.publisher = publisher
        self.quota = quota
        self.images = images if images is not None else ImageStore(cfg.images)
        self.root = Path(cfg.workspace_root or tempfile.gettempdir())
        self._bridge_runs = 0
        self.image_repos = ImageRepoCache()

    async def grade(self, request: SubmitRequest, *, snapshot: Snapshot | None, calls: list[ToolCall], uid: int,
                    snapshot_error: str = "") -> Reward:
        """Grade and return the ``Reward`` (not yet published: see :meth:`publish`)."""
        started = time.monotonic()
        spec = self.store.get(request.task_id)
        if snapshot is None:
            verdict = Verdict(score=0.0, reason=f"workspace not gradable: {snapshot_error}")
        else:
            verdict = await self.verdict(spec, snapshot, calls, uid=uid)
        parts = compute_reward(
            self.reward_cfg, score=verdict.score, cheated=verdict.cheated, cost=request.cost,
            step=request.trainer_step, weight_version=request.weight_version,
        )
        reward = Reward(
            trajectory_id=request.trajectory_id,
            task_id=request.task_id,
            group_id=request.group_id,
            sample_index=request.sample_index,
            attempt=request.attempt,
            score=verdict.score,
            tests_passed=verdict.tests_passed,
            tests_total=verdict.tests_total,
            cheated=verdict.cheated,
            reason=verdict.reason,
            cost=request.cost,
            phase=parts.phase,
            length_penalty=parts.length_penalty,
            budget_penalty=parts.budget_penalty,
            reward=parts.reward,
            weight_version=request.weight_version,
            grading_seconds=round(time.monotonic() - started, 4),
            created_at=time.time(),
        )
        log.info(
            "graded", trajectory_id=reward.trajectory_id, task_id=reward.task_id, score=reward.score,
            passed=reward.tests_passed, total=reward.tests_total, cheated=reward.cheated,
            reason=reward.reason[:300], reward=reward.reward, seconds=reward.grading_seconds,
        )
        return reward

    async def publish(self, reward: Reward) -> None:
        if self.publisher is not None:
            await self.publisher.publish(reward)

    async def verdict(self, spec: TaskSpec, snapshot: Snapshot, calls: list[ToolCall], *, uid: int) -> Verdict:
        if spec.needs_image_repo:
            spec = await self.with_image_repo(spec)
        # A pytest run (either mode) is judged by its report, not by exits, and configured
        # by the grader, never by agent test configs (sandbox/cheating.py).
        by_report = pytest_arguments(spec.test_command) is not None
        in_env = spec.grading == "in-env" and by_report
        # An image task: what the image holds as it is (its links, binaries) is not the agent's doing.
        tree = await self.image_tree(spec) if spec.image else None
        checked = image_changes.agent_view(snapshot, tree) if tree is not None else snapshot
        # Test configuration is the task's in every mode (a non-pytest run restores it too).
        findings = find_cheats(spec.files, checked, hidden_dir=HIDDEN_TESTS_DIR, in_env=in_env,
                               by_report=by_report, configs_restored=True,
                               runner_dirs=None if by_report else grading_plain.runner_dirs(spec))
        findings += [f"network access attempted: {e}" for e in network_attempts(calls)]
        if findings:
            return Verdict(score=0.0, cheated=True, reason="; ".join(findings))
        return await self.run_hidden_tests(spec, snapshot, uid=uid, tree=tree)

    async def with_image_repo(self, spec: TaskSpec) -> TaskSpec:
        """A task whose repository is only in its image, made whole from it (hidden tests,
        reference solution, base tree; sandbox/image_repo.py). An ImageError is the
        infrastructure's failure (503), as for any image task."""
        root = await self.images.acquire(spec.image)
        try:
            return await asyncio.to_thread(self.image_repos.resolve, spec, root)
        finally:
            self.images.release(root)

    async def image_tree(self, spec: TaskSpec) -> ImageTree:
        """The image's tree at the task's workdir (sandbox/image_repo.py; kept per image)."""
        root = await self.images.acquire(spec.image)
        try:
            return await asyncio.to_thread(image_tree, root, spec.workdir)
        finally:
            self.images.release(root)

    async def over_image(self, spec: TaskSpec, files: dict[str, bytes], *, removed: tuple[str, ...] = ()) -> Snapshot:
        """An image task's session snapshot with ``files`` written over the image and the
        image's ``removed`` paths deleted (``rollway tasks check`` grades without sessions)."""
        root = await self.images.acquire(spec.image)
        try:
            tree = await asyncio.to_thread(image_tree, root, spec.workdir)
            return await asyncio.to_thread(image_changes.over_image, root, spec.workdir, tree, files, removed)
        finally:
            self.images.release(root)

    async def run_hidden_tests(self, spec: TaskSpec, snapshot: Snapshot, *, uid: int,
                               tree: ImageTree | None = None) -> Verdict:
        """``tree``: an image task's image tree at its workdir (:meth:`image_tree`)."""
        grade_dir = self.root / f"rollway-grade-{uuid.uuid4().hex[:12]}"
        grade_dir.mkdir(mode=0o700, parents=True)
        # One tmpfs of the workspace quota for everything this grading writes.
        area = None
        try:
            if self.quota is not None:
                area, _ = Workspace.create(grade_dir / "area", 0, {}, self.quota)
                os.chmod(area.root, 0o755)
                base = area.root
            else:
                base = grade_dir
            args = pytest_arguments(spec.test_command)
            if args is None and not self.cfg.allow_unisolated_grading:
                reason = (f"task {spec.task_id}'s test command {spec.test_command!r} is not pytest, so its hidden "
                          f"tests would run in the solution's process; set sandbox.allow_unisolated_grading = "
                          f"true to grade it by exit code anyway")
                log.error("grading refused", task_id=spec.task_id, reason=reason)
                return Verdict(score=0.0, reason=reason)
            code = solution_files(snapshot)
            known = {**image_changes.config_texts(tree), **spec.files}
            # An image task grades on its image (an ImageError is the infrastructure's
            # failure: the service answers 503, never a reward).
            root = await self.images.acquire(spec.image) if spec.image else None
            try:
                # The agent's final tree over the image (both modes): its deletions and links too.
                changes = image_changes.tree_changes(snapshot, tree) if tree is not None else None
                if args is None:
                    # Either mode: the command as written, by its exit code, on the task's
                    # tests, test configuration and runner (sandbox/grading_plain.py).
                    output = await grading_plain.run(self.jail, self.cfg, self._limits(), spec, code, base, uid=uid,
                                                     root=root, changes=changes)
                    return self._judge(output, None)
                if spec.grading == "in-env":
                    run_args = grading_inenv.pytest_args(spec, args)
                    plan = make_plan(run_args, grading_inenv.layout(spec), run_configs(known, run_args))
                    output = await grading_inenv.run(self.jail, self.cfg, self._limits(), spec, code, plan, base,
                                                     uid=uid, root=root, changes=changes)
                else:
                    run_args = grading_bridged.pytest_args(spec, args, tree.configs if tree is not None else ())
                    plan = make_plan(run_args, grading_bridged.layout(spec), run_configs(known, run_args))
                    output = await grading_bridged.run(self.jail, self.cfg, self._limits(), spec, code, plan, base,
                                                       uid=uid, cpu=self._bridge_cpu(), root=root, changes=changes)
            finally:
                if root is not None:
                    self.images.release(root)
            return self._judge(output, plan)
        finally:
            if area is not None:
                area.remove()
            shutil.rmtree(grade_dir, ignore_errors=True)

    def _limits(self) -> Limits:
        return Limits(
            cpu_seconds=self.cfg.grading_cpu_seconds,
            memory_bytes=self.cfg.memory_bytes,
            max_processes=self.cfg.max_processes,
            max_file_bytes=self.cfg.max_file_bytes,
            max_open_files=self.cfg.max_open_files,
            tmp_bytes=self.cfg.tmp_bytes,
        )

    def _bridge_cpu(self) -> int | None:
        """The CPU both ends of this grading's bridge pin themselves to once it gets busy
        (``grading_bridge_pin_after``): round robin over this process's CPUs, so
        concurrent gradings spread. None = no pinning (off, or one CPU)."""
        if self.cfg.grading_bridge_pin_after <= 0:
            return None
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return None
        if len(cpus) < 2:
            return None
        self._bridge_runs += 1
        return cpus[self._bridge_runs % len(cpus)]

    def _judge(self, output: RunOutput, plan: HiddenPlan | None) -> Verdict:
        result = output.result
        runs = [result] if output.solution is None else [result, output.solution]
        output_evidence = network_attempts(
            [ToolCall(command="<hidden tests>", exit_code=r.exit_code, stdout=r.stdout, stderr=r.stderr) for r in runs]
        )
        if output_evidence:
            return Verdict(score=0.0, cheated=True,
                           reason=f"network access attempted during the hidden tests: {output_evidence[0]}")
        # Why the run stopped, when not by itself: the service's kill, or a limit the
        # kernel enforced (memory, processes, cpu, disk): a 137 with no kill is one of those.
        why = [f"killed: {result.killed}"] if result.killed else []
        extra = [hit for hit in result.limits if hit != result.killed]
        if extra:
            why.append("limits: " + ", ".join(extra))
        stopped = f" ({'; '.join(why)})" if why else ""
        discarded = (f"; agent changes to test files discarded: {', '.join(output.notes)}" if output.notes else "")
        if plan is None:
            passed = result.exit_code == 0 and not result.killed
            reason = "" if passed else f"test command exited {result.exit_code}{stopped}"
            if discarded:
                reason = (reason + discarded) if reason else discarded.removeprefix("; ")
            return Verdict(score=float(passed), tests_passed=int(passed), tests_total=1, reason=reason)
        report = output.report
        if report is None:
            if result.exit_code == 0 and not result.killed:
                return Verdict(score=0.0, cheated=True,
                               reason="exit-code trick: the hidden test run exited 0 without writing its report")
            return Verdict(score=0.0, reason=f"hidden tests did not finish: exit code {result.exit_code}{stopped}, "
                                             f"no report; output: {_tail(result)}{discarded}")
        try:
            parsed = parse_report(report)
        except ReportError as exc:
            return Verdict(score=0.0, reason=f"{exc}; exit code {result.exit_code}{stopped}")
        everything = outcomes_of(parsed.cases)  # canaries included: what the exit code reflects
        checked = check_result(parsed, output.collected, plan.selection, plan.canaries, wall_s=result.duration_s,
                               sites=plan.sites)
        outcomes = checked.outcomes
        internal = _internal_error(output, parsed)
        if internal is not None and set(checked.tampering) <= set(checked.absent):
            # Bridged, pytest itself aborted the run: what the report lacks is the abort's
            # doing (forged cases, counts or canaries stay tampering). Never paid.
            log.warning("grading_internal_error", error=internal, findings=checked.tampering)
            return Verdict(score=0.0, tests_passed=outcomes.passed, tests_total=outcomes.total,
                           reason=f"pytest stopped the hidden run with an internal error{stopped}: {internal}")
        if checked.tampering:
            log.warning("grading_tampering", findings=checked.tampering)
            return Verdict(score=0.0, cheated=True, tests_passed=outcomes.passed, tests_total=outcomes.total,
                           reason="tampering with the hidden test run: " + "; ".join(checked.tampering))
        bad = outcomes.failed + outcomes.skipped
        if result.exit_code == 0 and (everything.failed or everything.total == 0):
            return Verdict(
                score=0.0, cheated=True, tests_passed=outcomes.passed, tests_total=outcomes.total,
                reason=f"exit-code trick: the hidden test run exited 0 but its report shows "
                       f"{len(everything.failed)} of {everything.total} tests failing",
            )
        all_passed = outcomes.total > 0 and outcomes.passed == outcomes.total
        if everything.total > 0 and everything.passed == everything.total and result.exit_code != 0:
            return Verdict(score=0.0, tests_passed=outcomes.passed, tests_total=outcomes.total,
                           reason=f"the report shows every test passing but the run exited "
                                  f"{result.exit_code}{stopped}; not trusted")
        if self.reward_cfg.scoring == "fraction":
            score = outcomes.passed / outcomes.total if outcomes.total else 0.0
        else:
            score = 1.0 if all_passed else 0.0
        reason = ""
        if not all_passed:
            names = ", ".join(bad[:_MAX_NAMES_IN_REASON]) + (" ..." if len(bad) > _MAX_NAMES_IN_REASON else "")
            reason = (f"{outcomes.total - outcomes.passed} of {outcomes.total} hidden tests did not pass{stopped}: {names}"
                      if outcomes.total else f"no hidden test ran{stopped}")
        if discarded:
            reason = (reason + discarded) if reason else discarded.removeprefix("; ")
        return Verdict(score=score, tests_passed=outcomes.passed, tests_total=outcomes.total, reason=reason)


def _internal_error(output: RunOutput, report: Report) -> str | None:
    """pytest's last INTERNALERROR line when a bridged run ended in one: exit status 3
    (pytest's INTERNAL_ERROR) and junitxml's own case for it in the report. None otherwise.

    Bridged only: there the tests' process never runs solution code, which reaches it as
    plain data only, so neither the exit status nor the report is the solution's to
    forge; an internal error is pytest's, the task's configuration's or the grader's, or
    at most provoked through the bridge (memory pressure in the tests' process while pytest
    formats a result). Judged as score 0 without the cheat flag: never paid, and no failing
    solution escapes its 0 by provoking one (no retry). In-env the same status and case
    are the solution's to produce (it runs in pytest's process): judged by the result
    check as before."""
    if not output.bridged or output.result.exit_code != _PYTEST_INTERNAL_ERROR:
        return None
    if not any(case.label == INTERNAL_ERROR_CASE for case in report.cases):
        return None
    lines = [line.removeprefix("INTERNALERROR>").strip() for line in
             (output.result.stdout + "\n" + output.result.stderr).splitlines() if line.startswith("INTERNALERROR>")]
    lines = [line for line in lines if line]
    return lines[-1][:300] if lines else "no INTERNALERROR line in its output"


def run_configs(files: dict[str, str], args: list[str]) -> dict[str, str]:
    """The pytest config a run reads, for test selection and canary naming: the inifile
    pytest picks for these arguments in the task's tree (at any depth, any kind: in-env
    pins it with ``-c``), else the task's root config files."""
    inifile = grading_inenv.task_inifile(files, args)
    return {inifile: files[inifile]} if inifile is not None else root_configs(files)


def _tail(result: CommandResult, width: int = 300) -> str:
    text = (result.stdout + "\n" + result.stderr).strip()
    return " ".join(text[-width:].split())
