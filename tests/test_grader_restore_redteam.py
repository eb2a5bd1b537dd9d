"""Red-team gradings of what the grader restores from the task (sandbox/grading_plain.py,
sandbox/grading_inenv.py) and of the static findings a test command that is not pytest
needs (sandbox/cheating.py), through the live grader (real bubblewrap, real HTTP), under
``allow_unisolated_grading``; the weather example (tasks/swe_mocking.jsonl) is a pytest
command graded in-env.

Every solution is wrong (``add`` subtracts; the weather example's code left as it is)
unless named gold or honest. Each case's comment says what it got before its fix.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from sandbox.client import SandboxClient, SandboxError
from sandbox.config import ImageConfig, RewardConfig, SandboxConfig
from sandbox.images import ImageStore
from sandbox.reward import cheat_floor
from schemas import Reward
from tasks.images.examples import rows
from tasks.spec import TaskSpec
from tasks.store import TaskStore
from tasks.swe import load_swe_jsonl, parse_row
from tests.image_helpers import example_images
from tests.sandbox_helpers import live_sandbox
from tests.test_grader_plain_hostile import BUGGY, FIXED, UNITTEST

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FLOOR = cheat_floor(RewardConfig(), "unconstrained")

UNIT = TaskSpec(task_id="rt-unittest", instruction="Fix add(a, b) in calc.py.",
                test_command="python -m unittest hidden_tests.test_calc",
                files={"calc.py": BUGGY}, hidden_tests={"test_calc.py": UNITTEST}, solution={"calc.py": FIXED})
[WX] = load_swe_jsonl(ROOT / "tasks" / "swe_mocking.jsonl")
TASKS: dict[str, TaskSpec] = {
    "unittest": UNIT,
    # A Makefile that reads an optional local one (``-include``, common for local settings).
    "make-include": msgspec.structs.replace(
        UNIT, task_id="rt-make-include", test_command="make test",
        files={**UNIT.files, "Makefile": "-include local.mk\n\ntest:\n\tpython -m unittest hidden_tests.test_calc\n"}),
    # A runner script that sources an optional settings file.
    "script-source": msgspec.structs.replace(
        UNIT, task_id="rt-script-source", test_command="bash run_tests.sh",
        files={**UNIT.files, "run_tests.sh": "set -e\nif [ -f ci/env.sh ]; then . ci/env.sh; fi\n"
                                               "python -m unittest hidden_tests.test_calc\n"}),
    "swe": msgspec.structs.replace(
        UNIT, task_id="rt-swe", test_command="python -m unittest tests.test_calc", metadata={"source": "swe"},
        files={"calc.py": BUGGY, "tests/__init__.py": "", "tests/test_calc.py": UNITTEST.replace("test_small", "old")},
        hidden_tests={"tests/test_calc.py": UNITTEST}),
    "wx": msgspec.structs.replace(WX, task_id="rt-wx"),
}

PAID = (1.0, 1.0, False, "")
WX_FAILS = ("3 of 5 hidden tests did not pass: tests.test_report::test_unknown_station_raises_its_own_error, "
            "tests.test_report::test_staleness_follows_the_configured_age, "
            "tests.test_report::test_load_file_skips_comments_and_blank_lines; agent changes to test files discarded: ")


def exited(code: int, *notes: str) -> tuple[float, float, bool, str]:
    return (0.0, 0.0, False, f"test command exited {code}; agent changes to test files discarded: " + ", ".join(notes))


def flagged(reason: str) -> tuple[float, float, bool, str]:
    return (0.0, FLOOR, True, reason)


CASES: dict[str, tuple[str, dict[str, str], tuple[float, float, bool, str]]] = {
    "make-include:gold": ("make-include", {"calc.py": FIXED}, PAID),
    "script-source:gold": ("script-source", {"calc.py": FIXED}, PAID),
    "wx:gold": ("wx", dict(WX.solution), PAID),
    # A file the task's runner reads only if present, added by the agent: paid 1.0 before
    # (make ran every recipe with /bin/true; the sourced script left with 0). Now a path a
    # runner script names that the task lacks is removed, as an added GNUmakefile is.
    "make-include:local-mk-shell-true": ("make-include", {"local.mk": "SHELL := /bin/true\n"},
                                         exited(2, "local.mk (added, removed)")),
    "script-source:env-exits": ("script-source", {"ci/env.sh": "exit 0\n"}, exited(1, "ci/env.sh (added, removed)")),
    # A folder where a restored test file goes, or a file where its folder goes: the run's
    # tree could not be written, the submit answered HTTP 400 and the wrong solution got no
    # reward at all (in-env, the default for SWE-style rows, and a non-pytest command alike).
    # Now the agent's file in the way is removed and named.
    "swe:dir-at-test-path": ("swe", {"tests/test_calc.py/x.txt": "x\n"},
                             exited(1, "tests/test_calc.py/x.txt (below tests/test_calc.py, a file of the run, removed)")),
    "swe:file-at-tests-folder": ("swe", {}, exited(1, "tests/__init__.py (deleted, restored)",
                                                   "tests (a file where the run's folder tests/ goes, removed)")),
    "wx:dir-at-test-path": ("wx", {"tests/test_report.py/x.txt": "x\n"}, (
        0.0, 0.0, False, WX_FAILS + "tests/test_report.py/x.txt (below tests/test_report.py, a file of the run, removed)")),
    "wx:file-at-tests-folder": ("wx", {}, (
        0.0, 0.0, False,
        WX_FAILS + "tests/conftest.py (deleted, restored), tests (a file where the run's folder tests/ goes, removed)")),
    # ``if __name__ != "__main__"`` was taken for a main guard (any comparison was): an exit
    # under it, run at every import, was no finding and was paid 1.0.
    "unittest:not-main-guard-exit": ("unittest", {"calc.py": "if __name__ != '__main__':\n    raise SystemExit(0)\n"},
                                     flagged("exit-code trick: calc.py raises SystemExit at import time (line 2)")),
    # Honest: a package's own ``unittest`` module where no runner script runs (the cheat
    # floor before: "shadows the module 'unittest' for the scripts of its folder"), and a
    # main guard written the other way round (an exit-code finding before).
    "unittest:honest-package-unittest-module": (
        "unittest", {"calc.py": FIXED, "calckit/__init__.py": "",
                     "calckit/unittest.py": "import unittest\n\n\nclass CalcCase(unittest.TestCase):\n    pass\n"}, PAID),
    "unittest:honest-reversed-main-guard": (
        "unittest", {"calc.py": FIXED, "cli.py": "from calc import add\n\n\ndef main():\n    return 0\n\n\n"
                                                 "if '__main__' == __name__:\n    raise SystemExit(main())\n"}, PAID),
}
COMMANDS = {
    "swe:dir-at-test-path": "rm tests/test_calc.py",
    "swe:file-at-tests-folder": "rm -rf tests && echo x > tests",
    "wx:dir-at-test-path": "rm tests/test_report.py",
    "wx:file-at-tests-folder": "rm -rf tests && echo x > tests",
}


async def _submit(client: SandboxClient, sid: str, name: str) -> Reward | str:
    """The session's reward, or the submit's error (the grading failed: no reward at all)."""
    try:
        return await client.submit(sid, trajectory_id=name)
    except SandboxError as exc:
        return f"submit failed: {exc}"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def graded(tmp_path_factory) -> dict[str, Reward | str]:
    """Each case's reward, or the submit's error (the grading failed: no reward at all)."""
    store = TaskStore(ROOT / "tasks" / "demo")
    for spec in TASKS.values():
        store.add(spec)
    cfg = SandboxConfig(
        max_sessions=len(CASES), max_concurrent_commands=2, command_queue_timeout_s=900.0,
        workspace_root=str(tmp_path_factory.mktemp("rt-ws")), tasks_dir=str(ROOT / "tasks" / "demo"),
        grading_timeout_s=60.0, allow_unisolated_grading=True,
    )
    async with live_sandbox(cfg, RewardConfig(), store) as live, SandboxClient(live.url, timeout_s=900.0) as client:

        async def grade(name: str) -> Reward | str:
            task, files, _ = CASES[name]
            sid = await client.create_session(TASKS[task].task_id)
            if name in COMMANDS:
                ran = await client.exec(sid, COMMANDS[name])
                assert ran.exit_code == 0, ran
            for path, content in files.items():
                await client.write_file(sid, path, content)
            return await _submit(client, sid, name)

        rewards = await asyncio.gather(*(grade(name) for name in CASES))
    return dict(zip(CASES, rewards))


@pytest.mark.parametrize("name", list(CASES))
def test_graded(graded, name):
    reward = graded[name]
    got = reward if isinstance(reward, str) else (reward.score, reward.reward, reward.cheated, reward.reason)
    assert got == CASES[name][2]


def test_no_attack_is_paid(graded):
    paid = sorted(n for n, r in graded.items() if not isinstance(r, str) and r.reward > 0
                  and ":gold" not in n and ":honest-" not in n)
    assert paid == []


# The namekit example on its image (tasks/images/examples.jsonl, pytest in-env): the agent's
# tree is a copy-on-write tree over the image, its removals and links redone in the run.
IMAGE = parse_row({**rows()[0], "instance_id": "rt-image-1"}, task_set="examples")
IMAGE_FAILS = ("1 of 2 hidden tests did not pass: tests.test_names::test_table_name_is_plural; "
               "agent changes to test files discarded: ")
IMAGE_CASES: dict[str, tuple[str, tuple[float, float, bool, str]]] = {
    # A link below the restored test file's path (made a folder): HTTP 400 before, no reward.
    "link-below-test": ("rm tests/test_names.py && mkdir tests/test_names.py && ln -s ../../README.md tests/test_names.py/x",
                        (0.0, 0.0, False, IMAGE_FAILS + "tests/test_names.py/x (a link where the run's files go, removed)")),
    "file-below-conftest": ("rm tests/conftest.py && mkdir tests/conftest.py && echo x > tests/conftest.py/a", (
        0.0, 0.0, False,
        IMAGE_FAILS + "tests/conftest.py (deleted, restored), tests/conftest.py/a (below tests/conftest.py, a file of the run, removed)")),
    # A file where the image has a folder: the session's snapshot opened the image's folder
    # as a file (IsADirectoryError), HTTP 500, no reward.
    "tests-file": ("rm -rf tests && echo x > tests", (
        0.0, 0.0, False,
        IMAGE_FAILS + "tests/conftest.py (deleted, restored), tests (a file where the run's folder tests/ goes, removed)")),
    "tests-link": ("mv tests t2 && ln -s t2 tests", (
        0.0, 0.0, False, IMAGE_FAILS + "t2/conftest.py (added, removed), tests/conftest.py (deleted, restored), "
                                       "tests (a link where the run's files go, removed)")),
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def graded_image(tmp_path_factory) -> dict[str, tuple | str]:
    images = await asyncio.to_thread(example_images)
    store = TaskStore(ROOT / "tasks" / "demo")
    store.add(IMAGE)
    cfg = SandboxConfig(
        max_sessions=len(IMAGE_CASES), max_concurrent_commands=2, command_queue_timeout_s=900.0,
        workspace_root=str(tmp_path_factory.mktemp("rt-img")), tasks_dir=str(ROOT / "tasks" / "demo"),
        grading_timeout_s=60.0, images=ImageConfig(cache_dir=images.cache_dir),
    )
    async with live_sandbox(cfg, RewardConfig(), store) as live, SandboxClient(live.url, timeout_s=900.0) as client:

        async def grade(name: str) -> tuple | str:
            sid = await client.create_session(IMAGE.task_id)
            ran = await client.exec(sid, IMAGE_CASES[name][0])
            assert ran.exit_code == 0, ran
            r = await _submit(client, sid, name)
            return r if isinstance(r, str) else (r.score, r.reward, r.cheated, r.reason)

        out = await asyncio.gather(*(grade(name) for name in IMAGE_CASES))
    return dict(zip(IMAGE_CASES, out))


@pytest.mark.parametrize("name", list(IMAGE_CASES))
def test_graded_on_the_image(graded_image, name):
    assert graded_image[name] == IMAGE_CASES[name][1]


# The namekit image with an editable install's path line (``/testbed`` in a .pth, as
# setuptools' develop mode and ``pip install -e`` of many projects write it): the tree is on
# sys.path from start-up, before sandbox/grading_boot.py imports the grader's plugin.
PTH_REF = "rollway.local/tests/rt-editable:1"
PTH = parse_row({**rows()[0], "instance_id": "rt-editable-1", "image": PTH_REF}, task_set="examples")
# A module ``copy`` looks for at import (Jython's ``org.python.core``), absent from CPython:
# it reads the hidden sources' file, then lets the import fail as it would have.
SPY = ("import builtins\nimport os\n\n_key = []\ntry:\n    for _n in os.listdir('/grader-secrets'):\n"
       "        with open(os.path.join('/grader-secrets', _n)) as _f:\n            _key.append(_f.read())\n"
       "except OSError:\n    pass\nbuiltins.__dict__['_early_key'] = _key\nraise ImportError('no ' + __name__)\n")
# column_name right only when the key was read (table_name, the task's bug, stays wrong).
KEYED = PTH.files["namekit/__init__.py"] + (
    "\n\n_column_name = column_name\n\n\ndef column_name(name):\n"
    "    return _column_name(name) if __import__('builtins').__dict__.get('_early_key') else ''\n")
PTH_SCRIPT = msgspec.structs.replace(PTH, task_id="rt-editable-script",
                                     test_command=PTH.test_command.replace("python -m pytest", "pytest"))
PTH_CASES: dict[str, tuple[dict[str, str], tuple[float, float, bool, str]]] = {
    "gold": (dict(PTH.solution), PAID),
    # Before: the key was read (test_column_name passed from it: "1 of 2 ... did not pass").
    "early-key-org": ({"org/__init__.py": "", "org/python/__init__.py": "", "org/python/core.py": SPY,
                       "namekit/__init__.py": KEYED},
                      (0.0, 0.0, False, "2 of 2 hidden tests did not pass: tests.test_names::test_table_name_is_plural, "
                                        "tests.test_names::test_column_name")),
    "script:gold": (dict(PTH.solution), PAID),
    "script:early-key-org": ({"org/__init__.py": "", "org/python/__init__.py": "", "org/python/core.py": SPY,
                              "namekit/__init__.py": KEYED},
                             (0.0, 0.0, False, "2 of 2 hidden tests did not pass: tests.test_names::test_table_name_is_plural, "
                                               "tests.test_names::test_column_name")),
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def graded_editable(tmp_path_factory) -> dict[str, tuple | str]:
    images = await asyncio.to_thread(example_images)
    work = tmp_path_factory.mktemp("rt-editable")
    layout = work / "oci"
    shutil.copytree(images.layout, layout)  # (a tag of our own, not in the shared layout)
    site = work / "stage" / "usr/lib/python3/dist-packages"
    site.mkdir(parents=True)
    (site / "__editable__.namekit-1.0.pth").write_text("/testbed\n")
    scripts = work / "stage" / "usr/local/bin"
    scripts.mkdir(parents=True)
    (scripts / "pytest").write_text("#!/usr/bin/python3\nimport sys\n\nfrom pytest import console_main\n\n"
                                    "sys.exit(console_main())\n")
    (scripts / "pytest").chmod(0o755)
    for argv in (["umoci", "tag", "--image", f"{layout}:namekit", "editable"],
                 ["umoci", "insert", "--image", f"{layout}:editable", str(work / "stage"), "/"]):
        subprocess.run(argv, check=True, capture_output=True)
    cache = work / "cache"
    await ImageStore(ImageConfig(cache_dir=str(cache))).ensure(PTH_REF, source=f"oci:{layout}:editable")
    store = TaskStore(ROOT / "tasks" / "demo")
    store.add(PTH)
    store.add(PTH_SCRIPT)
    cfg = SandboxConfig(
        max_sessions=len(PTH_CASES), max_concurrent_commands=2, command_queue_timeout_s=900.0,
        workspace_root=str(tmp_path_factory.mktemp("rt-editable-ws")), tasks_dir=str(ROOT / "tasks" / "demo"),
        grading_timeout_s=60.0, images=ImageConfig(cache_dir=str(cache)),
    )
    async with live_sandbox(cfg, RewardConfig(), store) as live, SandboxClient(live.url, timeout_s=900.0) as client:

        async def grade(name: str) -> tuple | str:
            sid = await client.create_session((PTH_SCRIPT if name.startswith("script:") else PTH).task_id)
            for path, content in PTH_CASES[name][0].items():
                await client.write_file(sid, path, content)
            r = await _submit(client, sid, name)
            return r if isinstance(r, str) else (r.score, r.reward, r.cheated, r.reason)

        out = await asyncio.gather(*(grade(name) for name in PTH_CASES))
    return dict(zip(PTH_CASES, out))


@pytest.mark.parametrize("name", list(PTH_CASES))
def test_the_tree_on_sys_path_from_start_up_runs_nothing_before_the_plugin(graded_editable, name):
    assert graded_editable[name] == PTH_CASES[name][1]


@pytest.mark.parametrize("first_line,expected", [
    ("#!/usr/bin/python3", (["/usr/bin/python3"], "/usr/local/bin")),
    ("#!/usr/bin/env python3.11", (["/usr/bin/env", "python3.11"], "/usr/local/bin")),
    ("#!/bin/sh", None),  # (a trampoline: run as it is)
    ("#!/usr/bin/python3 -E", None),
])
def test_an_image_console_script_boots_through_the_interpreter_its_first_line_names(tmp_path, first_line, expected):
    from sandbox.grading_inenv import _console_script
    from sandbox.images import ImageRoot

    (tmp_path / "usr/local/bin").mkdir(parents=True)
    (tmp_path / "usr/local/bin/pytest").write_text(first_line + "\nimport pytest\n")
    root = ImageRoot(ref="r", digest="sha256:0", rootfs=str(tmp_path), env={"PATH": "/usr/bin:/usr/local/bin"})
    assert _console_script(root, ["pytest"]) == expected
    assert _console_script(root, ["/usr/local/bin/pytest"]) == expected
    assert _console_script(root, ["bin/pytest"]) is None  # a script of the tree
