"""tasks.spec.pytest_arguments: which test commands the grader splits across its bridge
(pytest, however it is spelled) and which it can only run as written."""

from __future__ import annotations

import pytest

from tasks.spec import TaskSpec, pytest_arguments


@pytest.mark.parametrize("command, arguments", [
    (TaskSpec(task_id="t", instruction="i", files={}, hidden_tests={}).test_command, ["-q", "-p", "no:cacheprovider", "hidden_tests"]),
    ("python3 -m pytest -x hidden_tests", ["-x", "hidden_tests"]),
    ("python3.11 -m pytest hidden_tests", ["hidden_tests"]),
    ("/usr/bin/python3 -m pytest", []),
    ("pytest -q 'hidden tests'", ["-q", "hidden tests"]),
    ("py.test -q", ["-q"]),
    ("/opt/venv/bin/pytest a", ["a"]),
])
def test_pytest_commands_give_their_arguments(command, arguments):
    assert pytest_arguments(command) == arguments


@pytest.mark.parametrize("command", [
    "python hidden_tests/check.py", "python -m unittest", "pythonx -m pytest", "python -c 'import pytest'",
    "make test", "PYTHONPATH=. pytest", "",
])
def test_other_commands_are_not_pytest(command):
    assert pytest_arguments(command) is None
