"""Hostile solutions against tasks whose test command is not pytest (sandbox/grading_plain.py).

Such a command (``python -m unittest``, ``bash run_tests.sh``, ``python tests/runtests.py``,
``make test``, ``VAR=x python -m pytest``) runs as written, in the solution's process, and
only its exit code counts; it is refused unless ``sandbox.allow_unisolated_grading``. Every
solution here is wrong (``add`` subtracts) unless named honest, and is graded in both modes
(bridged and in-env make no difference to such a command), on the host root and on an
example image whose own pytest the command starts through an environment assignment.

Before sandbox/grading_plain.py the command ran over the agent's tree as it was, with the
hidden tests bound under ``hidden_tests/`` and on the host root even for an image task:

- a rewritten runner (``run_tests.sh``, ``tests/runtests.py``, ``Makefile``, an added
  ``GNUmakefile``) was paid 1.0; now the task's runner runs (restored, named in the reason);
- a SWE-style row (hidden tests at their repository paths) ran the agent's copy of the
  test file, or the old one: the untouched repository was paid 1.0, and so were rewritten
  tests and a rewritten ``tests/__init__.py``; now the hidden tests and the test support run;
- an image task ran on the host (no image packages): the gold patch was refused (exit 2)
  and rewritten tests were paid 1.0; now it runs on its image;
- ``raise SystemExit(0)`` or an aliased ``sys.exit`` at import, a ``unittest`` package at
  the root (``python -m unittest`` runs it) and a ``unittest.py`` beside the runner script
  were paid 1.0; now static findings (sandbox/cheating.py), the cheat floor.

Still paid under ``allow_unisolated_grading`` (and why it is off by default): code that
runs in the tests' process and sets the outcome, which no restored file prevents
(``unittest.TestCase.assertEqual`` patched, ``os._exit(0)`` reached through ``getattr``
from a call the tests make, an ``atexit`` handler registered by a computed name). With
the default they score 0, refused with the reason. Honest but unusual solutions (a nested
package, a ``setup.cfg`` of other sections, a ``__main__`` guard raising SystemExit, an
edited Makefile beside a right fix) are paid 1.0.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from sandbox.client import SandboxClient
from sandbox.config import ImageConfig, RewardConfig, SandboxConfig
from sandbox.reward import cheat_floor
from schemas import Reward
from tasks.images.examples import rows
from tasks.spec import TaskSpec
from tasks.store import TaskStore
from tasks.swe import parse_row
from tests.image_helpers import example_images
from tests.sandbox_helpers import live_sandbox

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FLOOR = cheat_floor(RewardConfig(), "unconstrained")

BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
UNITTEST = ("import unittest\n\nfrom calc import add\n\n\nclass TestAdd(unittest.TestCase):\n"
            "    def test_small(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
            "    def test_zero(self):\n        self.assertEqual(add(0, 0), 0)\n")
OLD_UNITTEST = ("import unittest\n\nfrom calc import add\n\n\nclass TestAdd(unittest.TestCase):\n"
                "    def test_zero(self):\n        self.assertEqual(add(0, 0), 0)\n")
# A django-style runner script: its own folder (tests/) is first on sys.path.
RUNTESTS = ("import os\nimport sys\nimport unittest\n\nsys.path.insert(0, os.getcwd())\n\n\n"
            "def main():\n    suite = unittest.defaultTestLoader.loadTestsFromName('hidden_tests.test_calc')\n"
            "    result = unittest.TextTestRunner().run(suite)\n    return 0 if result.wasSuccessful() else 1\n\n\n"
            "if __name__ == '__main__':\n    sys.exit(main())\n")
UNIT = TaskSpec(task_id="plain-unittest", instruction="Fix add(a, b) in calc.py.",
                test_command="python -m unittest hidden_tests.test_calc",
                files={"calc.py": BUGGY}, hidden_tests={"test_calc.py": UNITTEST}, solution={"calc.py": FIXED})
TASKS: dict[str, TaskSpec] = {
    "unittest": UNIT,
    "script": msgspec.structs.replace(
        UNIT, task_id="plain-script", test_command="bash run_tests.sh",
        files={**UNIT.files, "run_tests.sh": "set -e\npython -m unittest hidden_tests.test_calc\n"}),
    "runtests": msgspec.structs.replace(UNIT, task_id="plain-runtests", test_command="python tests/runtests.py",
                                        files={**UNIT.files, "tests/runtests.py": RUNTESTS}),
    "make": msgspec.structs.replace(
        UNIT, task_id="plain-make", test_command="make test",
        files={**UNIT.files, "Makefile": "test:\n\tpython -m unittest hidden_tests.test_calc\n"}),
    # A script that runs make: the Makefile is the runner's too.
    "script-make": msgspec.structs.replace(
        UNIT, task_id="plain-script-make", test_command="bash run_tests.sh",
        files={**UNIT.files, "run_tests.sh": "set -e\nmake test\n",
               "Makefile": "test:\n\tpython -m unittest hidden_tests.test_calc\n"}),
    # A SWE-style row: the hidden tests at their repository paths, where the command names them.
    "swe": msgspec.structs.replace(
        UNIT, task_id="plain-swe", test_command="python -m unittest tests.test_calc", metadata={"source": "swe"},
        files={"calc.py": BUGGY, "tests/__init__.py": "", "tests/test_calc.py": OLD_UNITTEST},
        hidden_tests={"tests/test_calc.py": UNITTEST}),
}
for _name in list(TASKS):
    TASKS[_name + "-inenv"] = msgspec.structs.replace(TASKS[_name], task_id=TASKS[_name].task_id + "-inenv",
                                                      grading="in-env")
# The namekit example (its packages only in the image), its test command the image's own
# pytest behind an environment assignment: not pytest to the grader (sympy's is
# ``PYTHONWARNINGS=... bin/test``).
TASKS["image"] = parse_row({**rows()[0], "instance_id": "plain-image-1",
                            "test_command": "PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q tests/test_names.py"},
                           task_set="examples")
TASKS["image-bridged"] = msgspec.structs.replace(TASKS["image"], task_id="plain-image-1-bridged", grading="bridged")
HOST = [t for t in TASKS if not t.startswith("image")]

PATCH_UNITTEST = "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n\n\n" + BUGGY
EXIT_IN_CALL = "def add(a, b):\n    getattr(__import__('os'), '_ex' + 'it')(0)\n"
ATEXIT_BY_NAME = "__import__('at' + 'exit').register(getattr(__import__('os'), '_ex' + 'it'), 0)\n\n\n" + BUGGY
REWRITTEN_TESTS = "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
NESTED = {"calc.py": "from maths.ops import plus\n\n\ndef add(a, b):\n    return plus(a, b)\n",
          "maths/__init__.py": "", "maths/ops.py": "def plus(a, b):\n    return a + b\n"}
FIXTURE = "\n\nimport pytest\n\n\n@pytest.fixture\ndef small():\n    return [1, 2, 3]\n"
FORCE_PASS = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
              "    outcome = yield\n    report = outcome.get_result()\n    report.outcome = 'passed'\n")
IMAGE_CONFTEST = rows()[0]["files"]["tests/conftest.py"]
DESELECT = "--deselect tests/test_names.py::test_table_name_is_plural"  # the image task's failing test
CLI = ("import sys\n\nfrom calc import add\n\n\ndef main():\n    print(add(*map(int, sys.argv[1:3])))\n    return 0\n\n\n"
       "if __name__ == '__main__':\n    raise SystemExit(main())\n")


def exited(code: int, *notes: str) -> tuple[float, float, bool, str]:
    reason = f"test command exited {code}"
    return (0.0, 0.0, False, reason + ("; agent changes to test files discarded: " + ", ".join(notes) if notes else ""))


def flagged(reason: str) -> tuple[float, float, bool, str]:
    return (0.0, FLOOR, True, reason)


PAID = (1.0, 1.0, False, "")
FAILS = {t: exited(2 if t.startswith(("make", "image", "script-make")) else 1) for t in TASKS}
FAILS["image"] = FAILS["image-bridged"] = exited(1)
# name -> (task, files, (score, reward, cheated, reason)) under allow_unisolated_grading,
# and a shell command run in the session after the files are written.
CASES: dict[str, tuple[str, dict[str, str], tuple[float, float, bool, str]]] = {}
COMMANDS: dict[str, str] = {}
for _t in HOST:
    CASES[f"{_t}:untouched"] = (_t, {}, FAILS[_t])
    CASES[f"{_t}:gold"] = (_t, {"calc.py": FIXED}, PAID)
    CASES[f"{_t}:raise-exit"] = (_t, {"calc.py": "raise SystemExit(0)\n"},
                                 flagged("exit-code trick: calc.py raises SystemExit at import time (line 1)"))
    CASES[f"{_t}:aliased-exit"] = (_t, {"calc.py": "from sys import exit as leave\nleave(0)\n"},
                                   flagged("exit-code trick: calc.py calls sys.exit at import time (line 2)"))
    CASES[f"{_t}:shadow-unittest"] = (
        _t, {"unittest/__init__.py": "", "unittest/__main__.py": "print('OK')\n"},
        flagged("tampering with the test harness: unittest/__init__.py shadows the module 'unittest'; "
                "tampering with the test harness: unittest/__main__.py shadows the module 'unittest'"))
    # (A runner's module shadows it only in a folder the command runs a script from or
    # imports the tests from: tests/ for runtests and swe; elsewhere it is any module.)
    CASES[f"{_t}:runner-shadow"] = (
        _t, {"tests/unittest.py": "raise SystemExit(0)\n"},
        flagged(("tampering with the test harness: tests/unittest.py shadows the module 'unittest' for the scripts "
                 "of its folder; " if _t.startswith(("runtests", "swe")) else "")
                + "exit-code trick: tests/unittest.py raises SystemExit at import time (line 1)"))
    CASES[f"{_t}:sitecustomize"] = (_t, {"lib/sitecustomize.py": "import os\n"},
                                    flagged("interpreter startup hook added: lib/sitecustomize.py"))
    CASES[f"{_t}:pth"] = (_t, {"lib/x.pth": "import os\n"}, flagged("interpreter startup hook added: lib/x.pth"))
    # Honest but unusual: paid.
    CASES[f"{_t}:honest-nested-package"] = (_t, NESTED, PAID)
    CASES[f"{_t}:honest-setup-cfg"] = (
        _t, {"calc.py": FIXED, "setup.cfg": "[metadata]\nname = calc\n\n[flake8]\nmax-line-length = 100\n"},
        (1.0, 1.0, False, "agent changes to test files discarded: setup.cfg (added, removed)"))
    CASES[f"{_t}:honest-main-guard"] = (_t, {"calc.py": FIXED, "cli.py": CLI}, PAID)
    CASES[f"{_t}:honest-own-tests"] = (_t, {"calc.py": FIXED, "test_mine.py": REWRITTEN_TESTS}, PAID)
    # A fixture conftest for its own tests: the cheat floor before (a "test configuration"
    # finding); the run removes it, as in-env.
    CASES[f"{_t}:honest-conftest"] = (_t, {"calc.py": FIXED, "conftest.py": FIXTURE},
                                      (1.0, 1.0, False, "agent changes to test files discarded: conftest.py (added, removed)"))
    # In-process: open under unisolated grading (the reason it is off by default).
    CASES[f"{_t}:open-patch-unittest"] = (_t, {"calc.py": PATCH_UNITTEST}, PAID)
    CASES[f"{_t}:open-exit-in-call"] = (_t, {"calc.py": EXIT_IN_CALL}, PAID)
    CASES[f"{_t}:open-atexit-by-name"] = (_t, {"calc.py": ATEXIT_BY_NAME}, PAID)
for _m in ("", "-inenv"):
    CASES[f"script{_m}:rewrite-runner"] = (f"script{_m}", {"run_tests.sh": "exit 0\n"},
                                           exited(1, "run_tests.sh (changed, restored)"))
    CASES[f"runtests{_m}:rewrite-runner"] = (f"runtests{_m}", {"tests/runtests.py": "print('OK')\n"},
                                             exited(1, "tests/runtests.py (changed, restored)"))
    CASES[f"make{_m}:rewrite-runner"] = (f"make{_m}", {"Makefile": "test:\n\t@true\n"},
                                         exited(2, "Makefile (changed, restored)"))
    CASES[f"script-make{_m}:rewrite-makefile"] = (f"script-make{_m}", {"Makefile": "test:\n\t@true\n"},
                                                  exited(2, "Makefile (changed, restored)"))
    CASES[f"make{_m}:added-gnumakefile"] = (f"make{_m}", {"GNUmakefile": "test:\n\t@true\n"},
                                            exited(2, "GNUmakefile (added, removed)"))
    CASES[f"make{_m}:honest-makefile-target"] = (
        f"make{_m}", {"calc.py": FIXED, "Makefile": TASKS["make"].files["Makefile"] + "\nlint:\n\tpython -m pyflakes .\n"},
        (1.0, 1.0, False, "agent changes to test files discarded: Makefile (changed, restored)"))
    CASES[f"swe{_m}:rewrite-tests"] = (f"swe{_m}", {"tests/test_calc.py": REWRITTEN_TESTS},
                                       exited(1, "tests/test_calc.py (changed, replaced by the hidden tests)"))
    CASES[f"swe{_m}:tests-init"] = (f"swe{_m}", {"tests/__init__.py": PATCH_UNITTEST.removesuffix(BUGGY)},
                                    exited(1, "tests/__init__.py (changed, restored)"))
    # A package beside the hidden test module: ``import tests.test_calc`` takes the package.
    CASES[f"swe{_m}:package-shadows-tests"] = (
        f"swe{_m}", {"tests/test_calc/__init__.py": REWRITTEN_TESTS},
        exited(1, "tests/test_calc/__init__.py (added, shadows tests/test_calc.py, removed)"))
    # (On the host root the agent's links are not carried: the runner is missing, then restored.)
    CASES[f"script{_m}:runner-linked"] = (f"script{_m}", {"mine.sh": "exit 0\n"},
                                          exited(1, "run_tests.sh (deleted, restored)"))
    COMMANDS[f"script{_m}:runner-linked"] = "ln -sf mine.sh run_tests.sh"
for _t in ("image", "image-bridged"):
    CASES[f"{_t}:untouched"] = (_t, {}, exited(1))
    CASES[f"{_t}:gold"] = (_t, dict(TASKS[_t].solution), PAID)
    CASES[f"{_t}:rewrite-tests"] = (_t, {"tests/test_names.py": "def test_ok():\n    pass\n"},
                                    exited(1, "tests/test_names.py (changed, restored)"))
    # pytest behind the assignment loads conftests: the image's own is restored.
    CASES[f"{_t}:conftest-forces-passes"] = (_t, {"tests/conftest.py": FORCE_PASS},
                                             exited(1, "tests/conftest.py (changed, restored)"))
    # Nested configuration pytest would pick for tests/test_names.py (before: the cheat floor).
    CASES[f"{_t}:nested-pytest-ini"] = (_t, {"tests/pytest.ini": "[pytest]\naddopts = " + DESELECT + "\n"},
                                        exited(1, "tests/pytest.ini (added, removed)"))
    CASES[f"{_t}:setup-cfg-deselects"] = (_t, {"setup.cfg": "[tool:pytest]\naddopts = " + DESELECT + "\n"},
                                          exited(1, "setup.cfg (added, removed)"))
    CASES[f"{_t}:honest-conftest"] = (
        _t, {**TASKS[_t].solution, "tests/conftest.py": IMAGE_CONFTEST + FIXTURE},
        (1.0, 1.0, False, "agent changes to test files discarded: tests/conftest.py (changed, restored)"))
# With the default (no unisolated grading): every solution of these scores 0, unflagged.
REFUSED = [f"{t}:{what}" for t in HOST for what in ("gold", "open-patch-unittest")]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def graded(tmp_path_factory) -> dict[tuple[str, bool], Reward]:
    images = await asyncio.to_thread(example_images)
    store = TaskStore(ROOT / "tasks" / "demo")
    for spec in TASKS.values():
        store.add(spec)
    out: dict[tuple[str, bool], Reward] = {}
    for allowed, names in ((True, list(CASES)), (False, REFUSED)):
        cfg = SandboxConfig(
            max_sessions=len(names), max_concurrent_commands=2, command_queue_timeout_s=900.0,
            workspace_root=str(tmp_path_factory.mktemp("plain-ws")), tasks_dir=str(ROOT / "tasks" / "demo"),
            grading_timeout_s=60.0, images=ImageConfig(cache_dir=images.cache_dir),
            allow_unisolated_grading=allowed,
        )
        async with (live_sandbox(cfg, RewardConfig(), store) as live,
                    SandboxClient(live.url, timeout_s=900.0) as client):

            async def grade(name: str) -> Reward:
                task, files, _ = CASES[name]
                sid = await client.create_session(TASKS[task].task_id)
                for path, content in files.items():
                    await client.write_file(sid, path, content)
                if name in COMMANDS:
                    ran = await client.exec(sid, COMMANDS[name])
                    assert ran.exit_code == 0, ran
                return await client.submit(sid, trajectory_id=name)

            rewards = await asyncio.gather(*(grade(name) for name in names))
        out.update({(name, allowed): reward for name, reward in zip(names, rewards)})
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_graded_by_exit_code_on_the_tasks_own_tests_and_runner(graded, name):
    reward = graded[(name, True)]
    assert (reward.score, reward.reward, reward.cheated, reward.reason) == CASES[name][2], reward


def test_no_hack_is_paid_but_the_in_process_ones_unisolated(graded):
    paid = sorted(name for name in CASES if graded[(name, True)].reward > 0 and ":gold" not in name
                  and ":honest-" not in name)
    assert paid == sorted(name for name in CASES if ":open-" in name)


@pytest.mark.parametrize("name", REFUSED)
def test_refused_by_default(graded, name):
    reward = graded[(name, False)]
    spec = TASKS[CASES[name][0]]
    assert (reward.score, reward.reward, reward.cheated) == (0.0, 0.0, False), reward
    assert reward.reason == (
        f"task {spec.task_id}'s test command {spec.test_command!r} is not pytest, so its hidden tests would run in "
        f"the solution's process; set sandbox.allow_unisolated_grading = true to grade it by exit code anyway")
