"""The grader: the agent's final workspace, the task's hidden tests, a fresh sandbox.

On submit:

1. snapshot the session workspace (regular files only, no links followed);
2. look for cheating: static checks on the files the agent added or changed
   (:mod:`sandbox.cheating`) and attempts to reach the network in the session's tool-call
   log (:mod:`sandbox.netwatch`); any finding means reward 0 with the findings as reason,
   and the hidden tests do not run;
3. run the hidden tests on the isolated path: two fresh sandboxes the agent never used,
   joined by one socket (:mod:`sandbox.bridge`). The *tests' sandbox* holds the hidden
   tests (from the grader's task store, read-only), the task's own unchanged pytest
   configuration and the JUnit report folder ``/grader-out``; it runs pytest and never
   imports solution code: the workspace's modules are proxies of modules living in the
   *solution's sandbox*, which holds a copy of the snapshot (``*.pyc`` dropped: graded
   code is the source the checks saw), runs as another uid in its own pid namespace, and
   has no test file, no pytest, no report folder and no view of the tests' process. Only
   plain data crosses (values by copy, objects as opaque handles, exceptions by type and
   message), so solution code cannot read the tests' source, frames, code objects or
   constants, patch pytest or its report, or end the test run. Outcomes come from the
   report, never from the exit code alone: exit 0 with a missing report, or with failures
   in it, is an exit-code trick (cheating). A task whose test command is not pytest runs
   as written in one sandbox, and only its exit code counts;
4. score (``all``: 1 when every test passed; ``fraction``: passed / total), reward via
   :func:`sandbox.reward.compute_reward`, publish ``Reward`` on ``rollway.rewards``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Protocol

import msgspec
import structlog

from sandbox.cheating import HARNESS_MODULES, find_cheats
from sandbox.config import RewardConfig, SandboxConfig
from sandbox.isolation import WORKSPACE, Bind, Limits
from sandbox.junit import ReportError, parse_junit
from sandbox.netwatch import ToolCall, network_attempts
from sandbox.quota import Quota
from sandbox.reward import compute_reward
from sandbox.runner import CommandResult, Jail
from sandbox.workspace import Snapshot, Workspace, WorkspaceError, clean_relpath
from schemas import Cost, Reward
from tasks.spec import TaskSpec, pytest_arguments
from tasks.store import TaskStore

log = structlog.get_logger(__name__)

HIDDEN_TESTS_DIR = "hidden_tests"
SOURCES_DIR = "/solution-src"
_CONFIG_FILES = frozenset({"pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"})
# How long the solution's process may take to exit after the tests hang up.
_SOLUTION_GRACE_S = 2.0
_SOURCE = {
    name: (Path(__file__).parent / name).read_bytes()
    for name in ("bridge.py", "bridge_solution.py", "bridge_tests.py")
}
GRADER_DIR = "/grader"
REPORT_DIR = "/grader-out"
REPORT_FILE = "junit.xml"
_MAX_REPORT_BYTES = 8 * 1024 * 1024
_MAX_NAMES_IN_REASON = 5

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
    ) -> None:
        self.cfg = cfg
        self.reward_cfg = reward_cfg
        self.store = store
        self.jail = jail
        self.publisher = publisher
        self.quota = quota
        self.root = Path(cfg.workspace_root or tempfile.gettempdir())
        self._bridge_runs = 0

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
        # One tmpfs of the workspace quota for everything this grading writes.
        area = None
        try:
            if self.quota is not None:
                area, _ = Workspace.create(grade_dir / "area", 0, {}, self.quota)
                os.chmod(area.root, 0o755)
                base = area.root
            else:
                base = grade_dir
            command = self._pytest_args(spec)
            if command is None:
                if not self.cfg.allow_unisolated_grading:
                    reason = (f"task {spec.task_id}'s test command {spec.test_command!r} is not pytest, so its hidden "
                              f"tests would run in the solution's process; set sandbox.allow_unisolated_grading = "
                              f"true to grade it by exit code anyway")
                    log.error("grading refused", task_id=spec.task_id, reason=reason)
                    return Verdict(score=0.0, reason=reason)
                return await self._run_plain(spec, snapshot, base, uid=uid)
            return await self._run_bridged(spec, snapshot, base, command, uid=uid)
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

    async def _run_bridged(self, spec: TaskSpec, snapshot: Snapshot, base: Path, args: list[str], *,
                           uid: int) -> Verdict:
        """The isolated path: hidden tests in one sandbox, the solution in another, the
        bridge socket between them (:mod:`sandbox.bridge`)."""
        solution_uid = uid + self.cfg.grading_solution_uid_offset
        code = _solution_files(snapshot)
        # The solution's sandbox: its workspace copy and the serving script. No test file.
        ws, _ = Workspace.create(base / "ws", solution_uid, code)
        sol_dir = _grader_dir(base / "sol", "bridge_solution.py")
        # The tests' sandbox: the hidden tests, the task's own (unchanged) test
        # configuration, the solution's sources as read-only data (inspect.getsource), and
        # no importable solution code.
        tests_ws = base / "tests"
        tests_ws.mkdir(mode=0o755)
        for rel, text in spec.files.items():
            if _is_test_config(rel):
                _write_ro(tests_ws / clean_relpath(rel), text.encode())
        (tests_ws / HIDDEN_TESTS_DIR).mkdir(mode=0o755)
        hidden = base / "hidden"
        for rel, text in spec.hidden_tests.items():
            _write_ro(hidden / clean_relpath(rel), text.encode())
        hidden.mkdir(mode=0o755, exist_ok=True)
        sources = base / "src"
        sources.mkdir(mode=0o755)
        for rel, data in code.items():
            _write_ro(sources / rel, data)
        tests_dir = _grader_dir(base / "run", "bridge_tests.py")
        out = Workspace.create(base / "out", uid, {})[0]
        left, right = socket.socketpair()
        try:
            sol_fd, tests_fd = os.dup(left.fileno()), os.dup(right.fileno())
        finally:
            left.close()
            right.close()
        config = {"workspace": WORKSPACE, "sources": SOURCES_DIR, "modules": sorted(_top_level_modules(code)),
                  "cpu": self._bridge_cpu(), "pin_after": self.cfg.grading_bridge_pin_after}
        _write_ro(sol_dir / "bridge.json", json.dumps({**config, "fd": sol_fd}).encode())
        _write_ro(tests_dir / "bridge.json", json.dumps({**config, "fd": tests_fd}).encode())
        limits = self._limits()
        async with self.jail.slot():
            solution = asyncio.ensure_future(self.jail.run_held(
                f"python -P {GRADER_DIR}/bridge_solution.py", workspace=ws.root, uid=solution_uid,
                timeout_s=self.cfg.grading_timeout_s, binds=[Bind(str(sol_dir), GRADER_DIR)], limits=limits,
                label="grade-solution", give_fds=(sol_fd,),
            ))
            try:
                result = await self.jail.run_held(
                    shlex.join(["python", "-P", f"{GRADER_DIR}/bridge_tests.py", *args]),
                    workspace=tests_ws, uid=uid, timeout_s=self.cfg.grading_timeout_s,
                    binds=[
                        Bind(str(hidden), f"{WORKSPACE}/{HIDDEN_TESTS_DIR}"),
                        Bind(str(sources), SOURCES_DIR),
                        Bind(str(tests_dir), GRADER_DIR),
                        Bind(str(out.root), REPORT_DIR, writable=True),
                    ],
                    limits=limits, label="grade-tests", give_fds=(tests_fd,),
                )
            finally:
                # The tests hung up: the solution's process sees EOF and exits; one that
                # does not is killed (cancelling its run kills its whole sandbox).
                try:
                    solution_result = await asyncio.wait_for(asyncio.shield(solution), _SOLUTION_GRACE_S)
                except (TimeoutError, asyncio.CancelledError):
                    solution.cancel()
                    with contextlib.suppress(BaseException):
                        await solution
                    solution_result = None
        try:
            report = out.read(REPORT_FILE, _MAX_REPORT_BYTES)
        except WorkspaceError:
            report = None
        return self._judge(result, report, True, solution_result)

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

    async def _run_plain(self, spec: TaskSpec, snapshot: Snapshot, base: Path, *, uid: int) -> Verdict:
        """A task whose test command is not pytest: it runs as written in one sandbox over
        the workspace, and only its exit code counts (no isolation from the solution)."""
        ws = Workspace.create(base / "ws", uid, _solution_files(snapshot))[0]
        hidden = base / "hidden"
        for rel, text in spec.hidden_tests.items():
            _write_ro(hidden / clean_relpath(rel), text.encode())
        hidden.mkdir(mode=0o755, exist_ok=True)
        result = await self.jail.run(
            spec.test_command, workspace=ws.root, uid=uid, timeout_s=self.cfg.grading_timeout_s,
            binds=[Bind(str(hidden), f"{WORKSPACE}/{HIDDEN_TESTS_DIR}")], limits=self._limits(), label="grade",
        )
        return self._judge(result, None, False)

    def _pytest_args(self, spec: TaskSpec) -> list[str] | None:
        """pytest's arguments for the hidden run (report included), or None when the
        task's test command is not pytest."""
        args = pytest_arguments(spec.test_command)
        if args is None:
            return None
        if "no:cacheprovider" not in args:
            args += ["-p", "no:cacheprovider"]
        args += [f"--junitxml={REPORT_DIR}/{REPORT_FILE}", "-o", "junit_family=xunit2"]
        if not any(Path(p).name == "conftest.py" for p in spec.files):
            # The repository has no conftest of its own: load none but the hidden tests'.
            args += [f"--confcutdir={WORKSPACE}/{HIDDEN_TESTS_DIR}"]
        return args

    def _judge(self, result: CommandResult, report: bytes | None, uses_report: bool,
               solution: CommandResult | None = None) -> Verdict:
        runs = [result] if solution is None else [result, solution]
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


def _solution_files(snapshot: Snapshot) -> dict[str, bytes]:
    """The graded files: compiled ``*.pyc`` dropped (graded code is the source the checks
    saw), and nothing under the hidden tests' folder (the grader's own copy is used)."""
    out = {}
    for path, f in snapshot.files.items():
        if path.endswith((".pyc", ".pyo")) or "__pycache__" in path.split("/"):
            continue
        if path.split("/")[0] == HIDDEN_TESTS_DIR:
            continue
        out[clean_relpath(path)] = f.data
    return out


def _is_test_config(path: str) -> bool:
    """Files of the task repository that configure pytest (the tests' side uses the task's
    originals, never the agent's copies)."""
    parts = path.split("/")
    return parts[-1] == "conftest.py" or (len(parts) == 1 and parts[0] in _CONFIG_FILES)


def _top_level_modules(files: dict[str, bytes]) -> set[str]:
    """Top-level importable names the workspace defines (``x.py``, a ``pkg/`` with Python
    files): the only names the tests' side asks the solution for."""
    names = set()
    for path in files:
        parts = path.split("/")
        name = parts[0].removesuffix(".py") if len(parts) == 1 else parts[0]
        if (len(parts) > 1 and not path.endswith(".py")) or (len(parts) == 1 and not parts[0].endswith(".py")):
            continue
        if name.isidentifier() and name not in HARNESS_MODULES and name != HIDDEN_TESTS_DIR and name != "conftest":
            names.add(name)
    return names


def _write_ro(path: Path, data: bytes) -> None:
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o644)


def _grader_dir(path: Path, script: str) -> Path:
    """A folder with the bridge module and one entry script, bound at /grader."""
    path.mkdir(mode=0o755)
    _write_ro(path / "_rollway_bridge.py", _SOURCE["bridge.py"])
    _write_ro(path / script, _SOURCE[script])
    return path


def _tail(result: CommandResult, width: int = 300) -> str:
    text = (result.stdout + "\n" + result.stderr).strip()
    return " ".join(text[-width:].split())
