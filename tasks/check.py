"""Checking task data.

- :func:`run_hidden_tests`: a task's hidden tests on the host, outside any sandbox.
  Trusted code only (our reference solutions and starting repos); agents' code is graded
  by the sandbox service, never here.
- :func:`check_hygiene` (``rollway tasks check``): each task through the real grader
  (bubblewrap, the task's grading mode): the reference solution must pass, the untouched
  repository must fail, and the generic adversarial solutions of
  :mod:`tasks.adversaries` must not be paid.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from tasks.spec import TaskSpec, pytest_arguments

if TYPE_CHECKING:
    from sandbox.config import SandboxConfig

HIDDEN_TESTS_DIR = "hidden_tests"


class CheckResult(msgspec.Struct, kw_only=True):
    task_id: str
    returncode: int
    passed: int
    total: int
    output: str
    seconds: float = 0.0

    @property
    def all_passed(self) -> bool:
        return self.returncode == 0 and self.total > 0 and self.passed == self.total


def materialize(spec: TaskSpec, root: Path, *, with_solution: bool) -> None:
    """Lay out a grading workspace: the repo (plus the solution), hidden tests under
    ``hidden_tests/`` as the grader does."""
    files = dict(spec.files)
    if with_solution:
        files.update(spec.solution)
        for rel in spec.solution_deletes:
            files.pop(rel, None)
    for rel, text in files.items():
        _write(root, rel, text)
    for rel, text in spec.hidden_tests.items():
        _write(root, f"{HIDDEN_TESTS_DIR}/{rel}", text)


def _write(root: Path, rel: str, text: str) -> None:
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()):
        raise ValueError(f"path {rel!r} leaves the workspace")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def run_hidden_tests(spec: TaskSpec, *, with_solution: bool, timeout_s: float = 60.0) -> CheckResult:
    import time

    with tempfile.TemporaryDirectory(prefix=f"rollway-check-{spec.task_id}-") as tmp:
        root = Path(tmp)
        materialize(spec, root, with_solution=with_solution)
        report = root / ".report.xml"
        pytest_args = pytest_arguments(spec.test_command)
        is_pytest = pytest_args is not None
        if is_pytest:
            argv = [sys.executable, "-m", "pytest", *pytest_args, f"--junitxml={report}"]
        else:
            argv = shlex.split(spec.test_command)
            if argv[:1] == ["python"]:
                argv[0] = sys.executable
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONDONTWRITEBYTECODE": "1",
            # Only pytest itself: no plugins from the host environment change the result.
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "HOME": tmp,
        }
        start = time.monotonic()
        proc = subprocess.run(
            argv, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s,
        )
        seconds = time.monotonic() - start
        passed = total = 0
        if is_pytest and report.exists():
            suite = ET.parse(report).getroot()
            suites = [suite] if suite.tag == "testsuite" else list(suite.iter("testsuite"))
            for s in suites:
                n = int(s.get("tests", 0)) - int(s.get("skipped", 0))
                total += n
                passed += n - int(s.get("failures", 0)) - int(s.get("errors", 0))
        return CheckResult(
            task_id=spec.task_id,
            returncode=proc.returncode,
            passed=passed,
            total=total,
            output=(proc.stdout + proc.stderr)[-4000:],
            seconds=seconds,
        )


# --- task hygiene: the grader against the reference, the repo and adversaries ---------


class Graded(msgspec.Struct, kw_only=True):
    """One solution of a task graded by the real grader (``rollway tasks check``)."""

    solution: str  # "reference", "untouched" or an adversary's name (tasks/adversaries.py)
    must: str  # "pass" | "fail" | "known-pass" (a documented limit: reported, not a defect)
    score: float
    cheated: bool
    reason: str
    tests_passed: int = 0
    tests_total: int = 0

    @property
    def passed(self) -> bool:
        return self.score >= 1.0 and not self.cheated

    @property
    def ok(self) -> bool:
        if self.must == "pass":
            return self.passed
        if self.must == "fail":
            return not self.passed and (self.solution != "untouched" or not self.cheated)
        return True


class TaskHygiene(msgspec.Struct, kw_only=True):
    task_id: str
    grading: str
    graded: list[Graded]

    @property
    def ok(self) -> bool:
        return all(g.ok for g in self.graded)

    @property
    def defects(self) -> list[str]:
        out = []
        for g in self.graded:
            if not g.ok:
                what = "does not pass" if g.must == "pass" else "is paid"
                out.append(f"{self.task_id}: {g.solution} {what} (score {g.score}, cheated {g.cheated}"
                           f"{': ' + g.reason[:200] if g.reason else ''})")
        return out


def solutions_to_grade(spec: TaskSpec, only: list[str] | None = None,
                       ) -> list[tuple[str, str, dict[str, str], tuple[str, ...]]]:
    """(name, must, workspace files, repository paths deleted) for the reference (its
    gold patch's deletions applied), the untouched repo and the battery."""
    from tasks.adversaries import battery

    deleted = tuple(spec.solution_deletes)
    reference = {p: t for p, t in {**spec.files, **spec.solution}.items() if p not in deleted}
    jobs = [("reference", "pass", reference, deleted), ("untouched", "fail", dict(spec.files), ())]
    for adversary in battery(spec):
        jobs.append((adversary.name, "known-pass" if adversary.expected_pass else "fail", adversary.files, ()))
    return [j for j in jobs if only is None or j[0] in only]


async def check_hygiene(specs: list[TaskSpec], cfg: "SandboxConfig", *, only: list[str] | None = None,
                        progress=None) -> list[TaskHygiene]:
    """Grade every solution of every task with the real grader (bubblewrap sandboxes, the
    grading mode of each task), as many at once as the sandbox config's command slots."""
    import asyncio

    from aiohttp import web

    from sandbox.config import RewardConfig
    from sandbox.service import SandboxService
    from sandbox.workspace import Snapshot, WorkspaceFile
    from tasks.store import TaskStore

    with tempfile.TemporaryDirectory(prefix="rollway-tasks-check-") as tmp:
        store = TaskStore(tmp)
        for spec in specs:
            store.add(spec)
        service = SandboxService(msgspec.structs.replace(cfg, workspace_root=cfg.workspace_root or tmp),
                                 RewardConfig(), store)
        runner = web.AppRunner(service.app)
        await runner.setup()  # the service's start and clean-up hooks, no HTTP server
        try:
            uids: asyncio.Queue[int] = asyncio.Queue()
            for slot in range(service.cfg.max_sessions):
                uids.put_nowait(service.cfg.uid_base + slot)

            async def grade(spec: TaskSpec, name: str, must: str, files: dict[str, str],
                            deleted: tuple[str, ...]) -> Graded:
                snapshot = Snapshot(files={p: WorkspaceFile(p, t.encode()) for p, t in files.items()})
                if spec.image:  # as a session of the image holds it (its links and binaries too)
                    snapshot = await service.grader.over_image(spec, {p: t.encode() for p, t in files.items()},
                                                               removed=deleted)
                uid = await uids.get()
                try:
                    verdict = await service.grader.verdict(spec, snapshot, [], uid=uid)
                finally:
                    uids.put_nowait(uid)
                graded = Graded(solution=name, must=must, score=verdict.score, cheated=verdict.cheated,
                                reason=verdict.reason, tests_passed=verdict.tests_passed,
                                tests_total=verdict.tests_total)
                if progress is not None:
                    progress(spec, graded)
                return graded

            async def task(spec: TaskSpec) -> TaskHygiene:
                # A row whose repository is only in its image: its reference solution and
                # base tree come from the image (the whole tree is what a session holds).
                spec = await service.grader.with_image_repo(spec) if spec.needs_image_repo else spec
                jobs = solutions_to_grade(spec, only)
                graded = await asyncio.gather(*(grade(spec, *job) for job in jobs))
                return TaskHygiene(task_id=spec.task_id, grading=spec.grading, graded=list(graded))

            return list(await asyncio.gather(*(task(spec) for spec in specs)))
        finally:
            await runner.cleanup()
