"""The grader: the agent's final workspace, the task's hidden tests, a fresh sandbox.

On submit:

1. snapshot the session workspace (regular files only, no links followed);
2. look for cheating: static checks on the files the agent added or changed
   (:mod:`sandbox.cheating`) and attempts to reach the network in the session's tool-call
   log (:mod:`sandbox.netwatch`); any finding means reward 0 with the findings as reason,
   and the hidden tests do not run;
3. lay the snapshot out in a new workspace (compiled ``*.pyc`` dropped: graded code is the
   source the checks saw) and run the hidden tests in a fresh sandbox the agent never used.
   The hidden tests come from the grader's task store, are bound read-only at
   ``/workspace/hidden_tests`` and exist only for this run. pytest runs through a small
   grader-owned launcher that puts the workspace *last* on ``sys.path`` (nothing in it can
   shadow the standard library or pytest) and writes a JUnit report to ``/grader-out``,
   outside the workspace. Outcomes come from that report, never from the exit code alone:
   exit 0 with a missing report, or with failures in it, is an exit-code trick (cheating);
4. score (``all``: 1 when every test passed; ``fraction``: passed / total), reward via
   :func:`sandbox.reward.compute_reward`, publish ``Reward`` on ``rollway.rewards``.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Protocol

import msgspec
import structlog

from sandbox.cheating import find_cheats
from sandbox.config import RewardConfig, SandboxConfig
from sandbox.isolation import WORKSPACE, Bind, Limits
from sandbox.junit import ReportError, parse_junit
from sandbox.netwatch import ToolCall, network_attempts
from sandbox.reward import compute_reward
from sandbox.runner import CommandResult, Jail
from sandbox.workspace import Snapshot, Workspace, WorkspaceError, clean_relpath
from schemas import Cost, Reward
from tasks.spec import TaskSpec
from tasks.store import TaskStore

log = structlog.get_logger(__name__)

HIDDEN_TESTS_DIR = "hidden_tests"
GRADER_DIR = "/grader"
REPORT_DIR = "/grader-out"
REPORT_FILE = "junit.xml"
_MAX_REPORT_BYTES = 8 * 1024 * 1024
_MAX_NAMES_IN_REASON = 5

# The launcher the hidden run goes through (bound read-only at /grader/run_pytest.py).
# Started with ``python -P`` so neither the script's folder nor the cwd lead sys.path.
RUN_PYTEST = f'''\
import sys

# Last on sys.path: the workspace's modules import, but cannot shadow the standard
# library or the test harness.
sys.path.append({WORKSPACE!r})
import pytest

sys.exit(int(pytest.main(sys.argv[1:])))
'''


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
    ) -> None:
        self.cfg = cfg
        self.reward_cfg = reward_cfg
        self.store = store
        self.jail = jail
        self.publisher = publisher
        self.root = Path(cfg.workspace_root or tempfile.gettempdir())

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
        findings = find_cheats(spec.files, snapshot, hidden_dir=HIDDEN_TESTS_DIR)
        findings += [f"network access attempted: {e}" for e in network_attempts(calls)]
        if findings:
            return Verdict(score=0.0, cheated=True, reason="; ".join(findings))
        return await self.run_hidden_tests(spec, snapshot, uid=uid)

    async def run_hidden_tests(self, spec: TaskSpec, snapshot: Snapshot, *, uid: int) -> Verdict:
        grade_dir = self.root / f"rollway-grade-{uuid.uuid4().hex[:12]}"
        grade_dir.mkdir(mode=0o700, parents=True)
        try:
            ws, _ = Workspace.create(grade_dir / "ws", uid, {})
            for path, f in snapshot.files.items():
                if path.endswith((".pyc", ".pyo")) or "__pycache__" in path.split("/"):
                    continue
                ws.write(path, f.data, f.mode)
            hidden = grade_dir / "hidden"
            hidden.mkdir(mode=0o755)
            for rel, text in spec.hidden_tests.items():
                target = hidden / clean_relpath(rel)
                target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                target.write_text(text)
                target.chmod(0o644)
            runner = grade_dir / "runner"
            runner.mkdir(mode=0o755)
            (runner / "run_pytest.py").write_text(RUN_PYTEST)
            (runner / "run_pytest.py").chmod(0o644)
            out = Workspace.create(grade_dir / "out", uid, {})[0]
            command, uses_report = self._hidden_command(spec)
            result = await self.jail.run(
                command,
                workspace=ws.root,
                uid=uid,
                timeout_s=self.cfg.grading_timeout_s,
                binds=[
                    Bind(str(hidden), f"{WORKSPACE}/{HIDDEN_TESTS_DIR}"),
                    Bind(str(runner), GRADER_DIR),
                    Bind(str(out.root), REPORT_DIR, writable=True),
                ],
                limits=Limits(
                    cpu_seconds=self.cfg.grading_cpu_seconds,
                    memory_bytes=self.cfg.memory_bytes,
                    max_processes=self.cfg.max_processes,
                    max_file_bytes=self.cfg.max_file_bytes,
                    max_open_files=self.cfg.max_open_files,
                    tmp_bytes=self.cfg.tmp_bytes,
                ),
                label="grade",
            )
            report: bytes | None = None
            if uses_report:
                try:
                    report = out.read(REPORT_FILE, _MAX_REPORT_BYTES)
                except WorkspaceError:
                    report = None
            return self._judge(result, report, uses_report)
        finally:
            shutil.rmtree(grade_dir, ignore_errors=True)

    def _hidden_command(self, spec: TaskSpec) -> tuple[str, bool]:
        """The hidden run's command, and whether it writes a JUnit report.

        ``python -m pytest ARGS`` / ``pytest ARGS`` become the launcher with ARGS plus
        the report; any other test command runs as written and only its exit code counts."""
        argv = shlex.split(spec.test_command)
        if argv[:3] in (["python", "-m", "pytest"], ["python3", "-m", "pytest"]):
            args = argv[3:]
        elif argv[:1] == ["pytest"]:
            args = argv[1:]
        else:
            return spec.test_command, False
        if "no:cacheprovider" not in args:
            args += ["-p", "no:cacheprovider"]
        args += [f"--junitxml={REPORT_DIR}/{REPORT_FILE}", "-o", "junit_family=xunit2"]
        if not any(Path(p).name == "conftest.py" for p in spec.files):
            # The repository has no conftest of its own: load none but the hidden tests'.
            args += [f"--confcutdir={WORKSPACE}/{HIDDEN_TESTS_DIR}"]
        return shlex.join(["python", "-P", f"{GRADER_DIR}/run_pytest.py", *args]), True

    def _judge(self, result: CommandResult, report: bytes | None, uses_report: bool) -> Verdict:
        output_evidence = network_attempts(
            [ToolCall(command="<hidden tests>", exit_code=result.exit_code, stdout=result.stdout, stderr=result.stderr)]
        )
        if output_evidence:
            return Verdict(score=0.0, cheated=True,
                           reason=f"network access attempted during the hidden tests: {output_evidence[0]}")
        stopped = f" (killed: {result.killed})" if result.killed else ""
        if not uses_report:
            passed = result.exit_code == 0 and not result.killed
            return Verdict(score=float(passed), tests_passed=int(passed), tests_total=1,
                           reason="" if passed else f"test command exited {result.exit_code}{stopped}")
        if report is None:
            if result.exit_code == 0 and not result.killed:
                return Verdict(score=0.0, cheated=True,
                               reason="exit-code trick: the hidden test run exited 0 without writing its report")
            return Verdict(score=0.0, reason=f"hidden tests did not finish: exit code {result.exit_code}{stopped}, "
                                             f"no report; output: {_tail(result)}")
        try:
            outcomes = parse_junit(report)
        except ReportError as exc:
            return Verdict(score=0.0, reason=f"{exc}; exit code {result.exit_code}{stopped}")
        bad = outcomes.failed + outcomes.skipped
        if result.exit_code == 0 and (outcomes.failed or outcomes.total == 0):
            return Verdict(
                score=0.0, cheated=True, tests_passed=outcomes.passed, tests_total=outcomes.total,
                reason=f"exit-code trick: the hidden test run exited 0 but its report shows "
                       f"{len(outcomes.failed)} of {outcomes.total} tests failing",
            )
        all_passed = outcomes.total > 0 and outcomes.passed == outcomes.total
        if all_passed and result.exit_code != 0:
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
        return Verdict(score=score, tests_passed=outcomes.passed, tests_total=outcomes.total, reason=reason)


def _tail(result: CommandResult, width: int = 300) -> str:
    text = (result.stdout + "\n" + result.stderr).strip()
    return " ".join(text[-width:].split())
