"""Run a task's hidden tests on the host, outside any sandbox: for checking task data.

Trusted code only (our reference solutions and starting repos). Agents' code is graded
by the sandbox service, never here.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import msgspec

from tasks.spec import TaskSpec, pytest_arguments

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
