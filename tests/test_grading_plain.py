"""What a test command that is not pytest runs from the task (sandbox/grading_plain.py),
without a sandbox: the repository paths it names or its program reads on its own, and
which of them are restored from the task (never code under test)."""

from __future__ import annotations

import pytest

from sandbox.grading_plain import command_paths, runner_dirs, runner_files
from tasks.spec import TaskSpec


@pytest.mark.parametrize("command,paths", [
    ("bash run_tests.sh", ["bash", "run_tests.sh"]),
    ("./tests/runtests.py --settings=test_sqlite model_fields", ["tests/runtests.py", "test_sqlite", "model_fields"]),
    ("PYTHONWARNINGS='ignore::UserWarning' bin/test -C --verbose", ["bin/test"]),
    ("make -C . test", ["GNUmakefile", "makefile", "Makefile", "make", "test"]),
    ("python -m tests.runner --config=ci/conf.toml", ["python", "tests/runner.py", "tests/runner/__main__.py",
                                                      "tests/runner/__init__.py", "tests.runner", "ci/conf.toml"]),
    ("bash -c 'cd /testbed && nox -s tests'", ["bash", "cd", "&&", "noxfile.py", "nox", "tests"]),
    ("/testbed/scripts/check.sh", ["scripts/check.sh"]),
    ("python ../outside.py /etc/passwd", ["python"]),
    ("unbalanced 'quote", []),
])
def test_command_paths(command, paths):
    assert command_paths(command, "/testbed") == paths


TASK = TaskSpec(task_id="t", instruction="", test_command="bash run_tests.sh && python -m doctest calc.py && make check",
                files={"run_tests.sh": "exit 1\n", "calc.py": "", "Makefile": "check:\n\ttrue\n"},
                hidden_tests={"test_calc.py": ""}, solution={"calc.py": "x = 1\n"}, workdir="/testbed")


def test_runner_files_are_the_tasks_named_files_and_implicit_inputs_but_never_code_under_test():
    original = {path: text.encode() for path, text in TASK.files.items()}
    assert runner_files(TASK, original) == {
        "run_tests.sh": b"exit 1\n",  # named: the task's copy runs
        "GNUmakefile": None, "makefile": None,  # make reads them first: an agent's is removed
        "Makefile": b"check:\n\ttrue\n",
    }  # calc.py, named by the command, is what the reference solution changes: the agent's runs


def test_a_named_script_is_read_for_the_runner_files_it_names_in_turn():
    """run_tests.sh says ``make check``: the Makefile is the runner's too (and what make
    reads first); the Python helper the Makefile runs as well. A Python script is not read
    (its imports are test support, sandbox/test_support.py)."""
    task = TaskSpec(task_id="t", instruction="", test_command="bash run_tests.sh", workdir="/testbed",
                    files={"run_tests.sh": "set -e  # runs calc.py's checks\nmake check\n",
                           "Makefile": "check:\n\tpython tools/check.py\n", "tools/check.py": "import tools.more\n",
                           "tools/more.py": "", "calc.py": ""},
                    hidden_tests={"test_calc.py": ""}, solution={"calc.py": "x = 1\n"})
    original = {path: text.encode() for path, text in task.files.items()}
    assert runner_files(task, original) == {
        "run_tests.sh": original["run_tests.sh"], "GNUmakefile": None, "makefile": None,
        "Makefile": original["Makefile"], "tools/check.py": original["tools/check.py"],
    }


def test_a_path_a_runner_script_names_that_the_task_lacks_is_removed_but_not_a_module_of_dash_m():
    """``-include local.mk`` and ``[ -f ci/env.sh ] && . ci/env.sh`` read a file only if it is
    there: an agent's one set the outcome (``SHELL := /bin/true``: paid 1.0), so it is None
    (removed). A module of ``-m`` the task lacks may be the solution's (a package the
    reference adds as a module), and a bare word (a make target, ``set``) names no file."""
    task = TaskSpec(task_id="t", instruction="", test_command="bash run_tests.sh", workdir="/testbed",
                    files={"run_tests.sh": "set -e\n[ -f ci/env.sh ] && . ci/env.sh\nmake check\n",
                           "Makefile": "-include local.mk\ncheck:\n\tpython -m calc.selftest\n", "calc/__init__.py": ""},
                    hidden_tests={"test_calc.py": ""}, solution={"calc/selftest.py": "x = 1\n"})
    original = {path: text.encode() for path, text in task.files.items()}
    assert runner_files(task, original) == {
        "run_tests.sh": original["run_tests.sh"], "ci/env.sh": None, "GNUmakefile": None, "makefile": None,
        "Makefile": original["Makefile"], "local.mk": None,
    }


def test_runner_dirs_are_the_folders_the_command_runs_scripts_from_or_imports_tests_from():
    task = TaskSpec(task_id="t", instruction="", test_command="bash run_tests.sh", workdir="/testbed",
                    files={"run_tests.sh": "python tests/runtests.py\n", "tests/runtests.py": "import tools.x\n",
                           "lib/calc.py": ""},
                    hidden_tests={"test_calc.py": ""}, solution={"lib/calc.py": "x = 1\n"})
    dirs = runner_dirs(task)
    assert {"tests", "hidden_tests", "."} <= dirs
    assert "lib" not in dirs
