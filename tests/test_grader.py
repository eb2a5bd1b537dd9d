"""Grading through the live service: hidden tests in a fresh sandbox, scores, cheating.

Three small tasks of our own (task folder format of tasks/spec.py) in a temporary task
store. Every cheating strategy gets reward 0 with its reason, on top of a correct
solution (so the zero comes from the detection, not from failing tests); an honest
solution that adds its own test file is not flagged.
"""

from __future__ import annotations

import contextlib

from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from sandbox.client import SandboxClient
from sandbox.config import RewardConfig, SandboxConfig
from sandbox.reward import cheat_floor
from sandbox.workspace import Snapshot, WorkspaceFile
from schemas import Cost, Reward
from tasks.spec import TaskSpec
from tasks.store import TaskStore
from tests.sandbox_helpers import live_sandbox, write_task_dir

ADD = TaskSpec(
    task_id="add_numbers",
    instruction="Implement add(a, b) in calc.py.",
    files={"calc.py": "def add(a, b):\n    raise NotImplementedError\n", "README.md": "calc\n"},
    hidden_tests={
        "test_calc.py": (
            "from calc import add\n\n"
            "def test_ints():\n    assert add(2, 3) == 5\n\n"
            "def test_negative():\n    assert add(-1, 1) == 0\n\n"
            "def test_floats():\n    assert add(0.5, 0.25) == 0.75\n"
        )
    },
    solution={"calc.py": "def add(a, b):\n    return a + b\n"},
)
WORDS = TaskSpec(
    task_id="reverse_words",
    instruction="reverse_words(s) returns the words of s in reverse order, single-spaced.",
    files={"text/__init__.py": "", "text/words.py": "def reverse_words(s):\n    return s\n"},
    hidden_tests={
        "test_words.py": (
            "from text.words import reverse_words\n\n"
            "def test_simple():\n    assert reverse_words('a b c') == 'c b a'\n\n"
            "def test_spaces():\n    assert reverse_words('  hello   world ') == 'world hello'\n"
        )
    },
    solution={"text/words.py": "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n"},
)
# Ships its own conftest.py (a fixture the hidden tests use): not the agent's doing.
STACK = TaskSpec(
    task_id="stack",
    instruction="Finish Stack.pop and Stack.peek in stack.py (IndexError when empty).",
    files={
        "stack.py": (
            "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
            "    def push(self, x):\n        self.items.append(x)\n\n"
            "    def pop(self):\n        raise NotImplementedError\n\n"
            "    def peek(self):\n        raise NotImplementedError\n"
        ),
        "conftest.py": "import pytest\n\n@pytest.fixture\ndef three():\n    return [1, 2, 3]\n",
    },
    hidden_tests={
        "test_stack.py": (
            "import pytest\nfrom stack import Stack\n\n"
            "def test_pop(three):\n    s = Stack()\n    for x in three:\n        s.push(x)\n"
            "    assert [s.pop(), s.pop(), s.pop()] == [3, 2, 1]\n\n"
            "def test_peek():\n    s = Stack()\n    s.push(7)\n    assert s.peek() == 7 and s.items == [7]\n\n"
            "def test_empty():\n    with pytest.raises(IndexError):\n        Stack().pop()\n"
            "    with pytest.raises(IndexError):\n        Stack().peek()\n"
        )
    },
    solution={
        "stack.py": (
            "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
            "    def push(self, x):\n        self.items.append(x)\n\n"
            "    def pop(self):\n        if not self.items:\n            raise IndexError('empty')\n"
            "        return self.items.pop()\n\n"
            "    def peek(self):\n        if not self.items:\n            raise IndexError('empty')\n"
            "        return self.items[-1]\n"
        )
    },
)
# Configured by pytest 9's own pytest.toml (its test functions are check_*): the tests'
# sandbox must hold it bridged as it holds a pytest.ini (it did not: nothing collected).
CHECKS = TaskSpec(
    task_id="add_checks",
    instruction=ADD.instruction,
    files={**ADD.files, "pytest.toml": "[pytest]\npython_functions = ['check_*']\n"},
    hidden_tests={"test_calc.py": ADD.hidden_tests["test_calc.py"].replace("def test_", "def check_")},
    solution=ADD.solution,
)
TASKS = {t.task_id: t for t in (ADD, WORDS, STACK, CHECKS)}
SOLVED_ADD = ADD.solution["calc.py"]
# What a detected cheat earns in an unconstrained phase with the default reward settings.
CHEAT_FLOOR = cheat_floor(RewardConfig(), "unconstrained")


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("grader-tasks")
    for spec in TASKS.values():
        write_task_dir(root, spec)
    return root


@contextlib.asynccontextmanager
async def grading_sandbox(tasks_dir, workspace_root, grading_timeout_s: float):
    cfg = SandboxConfig(
        max_sessions=8, max_concurrent_commands=4, command_timeout_s=10.0,
        workspace_root=str(workspace_root), tasks_dir=str(tasks_dir),
        max_snapshot_bytes=2 * 1024 * 1024, grading_timeout_s=grading_timeout_s,
    )
    async with live_sandbox(cfg, RewardConfig(), TaskStore(tasks_dir)) as live:
        async with SandboxClient(live.url) as client:
            live.client = client
            yield live


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sandbox(tasks_dir, tmp_path_factory):
    # A generous grading timeout: an honest grading must never be cut by a loaded
    # machine (the two sandboxed processes take ~1 s each on an idle one, far more under
    # load). The timeout itself is tested with its own sandbox below.
    async with grading_sandbox(tasks_dir, tmp_path_factory.mktemp("grader-ws"), 120.0) as live:
        yield live


async def attempt(sandbox, task_id: str, files: dict[str, str], commands: list[str] = (), **submit) -> Reward:
    """One rollout: open a session, write ``files``, run ``commands``, submit."""
    client = sandbox.client
    sid = await client.create_session(task_id)
    for path, content in files.items():
        await client.write_file(sid, path, content)
    for command in commands:
        await client.exec(sid, command)
    reward = await client.submit(sid, trajectory_id=f"traj-{sid[:8]}", group_id="g1", sample_index=2,
                                 attempt="a0", **submit)
    # Submitting closes the session.
    assert (await client.health())["sessions"] == 0 or sid not in {s.id for s in sandbox.service.pool.all()}
    return reward


# --- scores --------------------------------------------------------------------------


@pytest.mark.parametrize("task_id", sorted(TASKS))
async def test_reference_solution_passes(sandbox, task_id):
    spec = TASKS[task_id]
    cost = Cost(generated_tokens=100, turns=3, tool_seconds=1.5)
    reward = await attempt(sandbox, task_id, spec.solution, cost=cost, weight_version=7)
    n = {"add_numbers": 3, "reverse_words": 2, "stack": 3, "add_checks": 3}[task_id]
    assert (reward.score, reward.tests_passed, reward.tests_total) == (1.0, n, n)
    assert (reward.cheated, reward.reason, reward.reward, reward.phase) == (False, "", 1.0, "unconstrained")
    assert (reward.task_id, reward.group_id, reward.sample_index, reward.attempt) == (task_id, "g1", 2, "a0")
    assert reward.cost == cost and reward.weight_version == 7
    assert reward.grading_seconds > 0 and reward.created_at > 0


@pytest.mark.parametrize("task_id", sorted(TASKS))
async def test_untouched_repository_fails(sandbox, task_id):
    reward = await attempt(sandbox, task_id, {})
    assert reward.score == 0.0 and reward.reward == 0.0 and reward.cheated is False, reward.reason
    assert reward.tests_passed == 0 and reward.tests_total > 0
    assert "hidden tests did not pass" in reward.reason


async def test_wrong_solution_fails_and_names_the_failing_test(sandbox):
    reward = await attempt(sandbox, "add_numbers", {"calc.py": "def add(a, b):\n    return int(a) + int(b)\n"})
    assert (reward.score, reward.tests_passed, reward.tests_total, reward.cheated) == (0.0, 2, 3, False)
    assert reward.reason == "1 of 3 hidden tests did not pass: hidden_tests.test_calc::test_floats"


async def test_fraction_scoring(sandbox):
    grader = sandbox.service.grader
    original = grader.reward_cfg
    grader.reward_cfg = msgspec.structs.replace(original, scoring="fraction")
    try:
        reward = await attempt(sandbox, "add_numbers", {"calc.py": "def add(a, b):\n    return int(a) + int(b)\n"})
    finally:
        grader.reward_cfg = original
    assert (reward.score, reward.tests_passed, reward.tests_total) == (2 / 3, 2, 3)
    assert reward.reward == 2 / 3


async def test_budget_phase_by_trainer_step(sandbox):
    grader = sandbox.service.grader
    original = grader.reward_cfg
    grader.reward_cfg = RewardConfig(
        phase_schedule=[("unconstrained", 1), ("budget", 1)], length_penalty_per_token=2**-10,
        budget=0.0, budget_weight_tokens=1.0, budget_weight_turns=0.0, budget_weight_tool_seconds=0.0,
        budget_penalty_per_unit=2**-12,
    )
    try:
        cost = Cost(generated_tokens=512)
        budget = await attempt(sandbox, "add_numbers", ADD.solution, cost=cost, trainer_step=1)
        free = await attempt(sandbox, "add_numbers", ADD.solution, cost=cost, trainer_step=2)
    finally:
        grader.reward_cfg = original
    assert (budget.phase, budget.length_penalty, budget.budget_penalty) == ("budget", 0.5, 0.125)
    assert budget.reward == 1.0 - 0.5 - 0.125
    assert (free.phase, free.reward) == ("unconstrained", 1.0)


async def test_honest_solution_with_its_own_tests_is_not_flagged(sandbox):
    own_test = (
        "import pytest\nfrom calc import add\n\n"
        "@pytest.mark.parametrize('a,b', [(1, 2), (3, 4)])\n"
        "def test_mine(a, b):\n    assert add(a, b) == a + b\n"
    )
    cli = "import sys\nfrom calc import add\n\ndef main():\n    print(add(1, 2))\n    return 0\n\n" \
          "if __name__ == '__main__':\n    sys.exit(main())\n"
    reward = await attempt(
        sandbox, "add_numbers",
        {"calc.py": SOLVED_ADD, "tests/test_mine.py": own_test, "test_calc_extra.py": own_test, "cli.py": cli},
        commands=["python -m pytest -q tests test_calc_extra.py", "python cli.py"],
    )
    assert (reward.score, reward.cheated, reward.reason, reward.reward) == (1.0, False, "", 1.0)
    assert reward.tests_total == 3  # only the hidden tests count


async def test_unchanged_repository_conftest_is_not_flagged(sandbox):
    reward = await attempt(sandbox, "stack", STACK.solution)
    assert reward.cheated is False and reward.score == 1.0


async def test_hidden_tests_are_read_only_in_the_grading_sandbox(sandbox):
    # Code that tries to rewrite the hidden tests at import; no static trick involved.
    sneaky = (
        "try:\n    open('hidden_tests/test_calc.py', 'w').write('def test_ok():\\n    pass\\n')\n"
        "except OSError:\n    pass\n\ndef add(a, b):\n    return a - b\n"
    )
    reward = await attempt(sandbox, "add_numbers", {"calc.py": sneaky})
    assert (reward.score, reward.tests_passed, reward.tests_total, reward.cheated) == (0.0, 0, 3, False)


async def test_workspace_too_large_to_grade(sandbox):
    reward = await attempt(sandbox, "add_numbers", {"calc.py": SOLVED_ADD},
                           commands=["head -c 3000000 /dev/zero > blob.bin"])
    assert reward.score == 0.0 and reward.cheated is False
    assert reward.reason.startswith("workspace not gradable: workspace holds more than")


# --- cheating ------------------------------------------------------------------------

PASS_ALL_HOOK = (
    "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_makereport(item, call):\n    outcome = yield\n    outcome.get_result().outcome = 'passed'\n"
)
EVASIVE_EXIT = "getattr(__import__('o' + 's'), '_e' + 'xit')(0)\n"
EVASIVE_ATEXIT = "__import__('ate' + 'xit').register(getattr(__import__('o' + 's'), '_e' + 'xit'), 0)\n"

# (name, files written on top of the correct solution, commands run, expected reason part)
CHEATS = [
    ("pytest_plugins_variable", {"helpers.py": "pytest_plugins = ['evil_plugin']\n"}, [],
     "pytest plugin loaded by helpers.py"),
    ("pytest_hook_in_module", {"evil_plugin.py": "def pytest_collection_modifyitems(items):\n    items.clear()\n"},
     [], "pytest hook pytest_collection_modifyitems defined in evil_plugin.py"),
    ("entry_point_plugin", {"evil-1.0.dist-info/entry_points.txt": "[pytest11]\nevil = evil_plugin\n",
                            "evil-1.0.dist-info/METADATA": "Name: evil\nVersion: 1.0\n"}, [],
     "pytest plugin registered through package metadata"),
    ("sitecustomize", {"sitecustomize.py": "import os\n"}, [], "interpreter startup hook added: sitecustomize.py"),
    ("usercustomize", {"usercustomize.py": "import os\n"}, [], "interpreter startup hook added: usercustomize.py"),
    ("pth_file", {"lib/evil.pth": "import os; os._exit(0)\n"}, [], "interpreter startup hook added: lib/evil.pth"),
    ("writes_into_hidden_tests", {"hidden_tests/test_calc.py": "def test_ok():\n    pass\n"}, [],
     "tampering with the grader's files: hidden_tests/test_calc.py"),
    ("shadows_pytest", {"pytest.py": "import sys\nsys.exit(0)\n"}, [], "shadows the module 'pytest'"),
    ("shadows_pytest_internals", {"_pytest/__init__.py": ""}, [], "shadows the module '_pytest'"),
    # Exits, atexit handlers and `import pytest` in solution code are findings only for a test
    # command that is not pytest (test_a_non_pytest_test_command_is_graded_only_when_allowed);
    # a pytest run judges them by its report (tests/hostile/honest.py, both modes).
    ("pytest_internals", {"calc.py": SOLVED_ADD + "import _pytest.runner\n"}, [], "imports pytest internals"),
    ("symlink_out", {}, ["ln -s /etc/passwd data.txt"], "symlink out of the workspace: data.txt -> /etc/passwd"),
    ("symlink_into_hidden_tests", {}, ["ln -s /tmp hidden_tests"], "tampering with the grader's files: symlink"),
    ("network_client", {}, ["curl -s --max-time 1 http://127.0.0.1:9/ || true"],
     "network access attempted: tool call 1 (curl -s --max-time 1 http://127.0.0.1:9/ || true): runs network client 'curl'"),
    ("pip_install", {}, ["pip install requests || true"], "runs network client 'pip install'"),
    ("network_unreachable_seen", {}, ["python -c \"raise OSError(101, 'Network is unreachable')\""],
     "connect to a non-local address failed (network unreachable)"),
    ("resolver_failure_seen", {}, ["python -c \"import socket; raise socket.gaierror(-3, 'Temporary failure in name resolution')\""],
     "host name lookup failed"),
]


@pytest.mark.parametrize("name,files,commands,reason", CHEATS, ids=[c[0] for c in CHEATS])
async def test_cheating_gets_zero_with_its_reason(sandbox, name, files, commands, reason):
    reward = await attempt(sandbox, "add_numbers", {"calc.py": SOLVED_ADD, **files}, commands=commands)
    assert reward.cheated is True, reward
    assert reason in reward.reason, reward.reason
    assert reward.score == 0.0 and reward.reward == CHEAT_FLOOR


# Test configuration the agent writes is no finding for a pytest run (sandbox/cheating.py):
# the grader configures it, and bridged the tests' sandbox holds only the task's own. So
# even a hostile one beside a right fix changes nothing: paid on the fix's merits (these
# were the cheat floor; on a wrong fix they score 0: tests/hostile/hacks.py CONFIG_HACKS).
INERT_CONFIGS = [
    ("conftest_at_root", {"conftest.py": PASS_ALL_HOOK}),
    ("conftest_in_subdir_exits", {"pkg/conftest.py": "import sys\nsys.exit(0)\n"}),
    ("pytest_ini_deselects_everything", {"pytest.ini": "[pytest]\naddopts = -k nothing\n"}),
    ("tox_ini_collect_only", {"tox.ini": "[pytest]\naddopts = --co\n"}),
]


@pytest.mark.parametrize("name,files", INERT_CONFIGS, ids=[c[0] for c in INERT_CONFIGS])
async def test_agent_test_configuration_never_reaches_the_hidden_run(sandbox, name, files):
    reward = await attempt(sandbox, "add_numbers", {"calc.py": SOLVED_ADD, **files})
    assert (reward.score, reward.reward, reward.cheated, reward.reason) == (1.0, 1.0, False, ""), reward
    assert reward.tests_passed == reward.tests_total == 3


# Tricks the static checks do not see. The solution runs in its own process (the bridge):
# its exits end that process only, never the tests' run, whose report says what failed.
async def test_evasive_exit_at_import_ends_only_the_solution_process(sandbox):
    reward = await attempt(sandbox, "add_numbers", {"calc.py": EVASIVE_EXIT + SOLVED_ADD})
    # The test module's own import of calc fails: a collection error, reported as such.
    assert (reward.score, reward.tests_passed, reward.tests_total, reward.reward) == (0.0, 0, 1, 0.0), reward.reason
    assert reward.reason == "1 of 1 hidden tests did not pass: hidden_tests.test_calc"


async def test_evasive_atexit_after_failing_tests_changes_nothing(sandbox):
    wrong = "def add(a, b):\n    return a - b\n"
    reward = await attempt(sandbox, "add_numbers", {"calc.py": EVASIVE_ATEXIT + wrong})
    assert (reward.score, reward.tests_passed, reward.tests_total, reward.reward) == (0.0, 0, 3, 0.0), reward.reason
    assert reward.reason.startswith("3 of 3 hidden tests did not pass")


async def test_network_attempt_during_the_hidden_run(sandbox):
    noisy = ("import sys\n\ndef add(a, b):\n"
             "    sys.stderr.write('OSError: [Errno 101] Network is unreachable\\n')\n    return a - b\n")
    reward = await attempt(sandbox, "add_numbers", {"calc.py": noisy})
    assert reward.cheated is True and reward.reward == CHEAT_FLOOR
    assert reward.reason.startswith("network access attempted during the hidden tests")


async def test_hanging_solution_is_killed_and_fails(tasks_dir, tmp_path):
    hang = "def add(a, b):\n    while True:\n        pass\n"
    async with grading_sandbox(tasks_dir, tmp_path / "ws", 5.0) as short_timeout:
        reward = await attempt(short_timeout, "add_numbers", {"calc.py": hang})
    assert (reward.score, reward.cheated) == (0.0, False)
    assert reward.reason.startswith("hidden tests did not finish: exit code 137 (killed: timeout), no report")
    # Cut at the 5 s hidden-test timeout (the reason says killed: timeout); no upper
    # bound: how long pytest takes to start around it depends on the machine's load.
    assert reward.grading_seconds >= 5.0



# --- defense in depth: the hidden run itself, with the static checks bypassed -----------


def snapshot_of(files: dict[str, str]) -> Snapshot:
    return Snapshot(files={p: WorkspaceFile(p, c.encode()) for p, c in files.items()})


async def test_hidden_run_ignores_a_root_conftest(sandbox):
    grader = sandbox.service.grader
    wrong = "def add(a, b):\n    return a - b\n"
    verdict = await grader.run_hidden_tests(ADD, snapshot_of({"calc.py": wrong, "conftest.py": PASS_ALL_HOOK}),
                                            uid=sandbox.service.cfg.uid_base + 100)
    assert (verdict.score, verdict.tests_passed, verdict.tests_total) == (0.0, 0, 3)


async def test_hidden_run_cannot_be_shadowed_by_workspace_modules(sandbox):
    grader = sandbox.service.grader
    fake = "import sys\nprint('all passed')\nsys.exit(0)\n"
    files = {"calc.py": "def add(a, b):\n    return a - b\n", "pytest.py": fake, "json.py": fake, "xml/__init__.py": fake}
    verdict = await grader.run_hidden_tests(ADD, snapshot_of(files), uid=sandbox.service.cfg.uid_base + 100)
    assert (verdict.score, verdict.tests_passed, verdict.tests_total, verdict.cheated) == (0.0, 0, 3, False)


async def test_hidden_run_drops_compiled_files(sandbox, tmp_path):
    # An unchecked-hash .pyc is used without looking at the source: left in place, the
    # graded code would be the correct one hidden in bytecode, not the wrong source.
    import py_compile
    import sys

    grader = sandbox.service.grader
    (tmp_path / "calc.py").write_text(SOLVED_ADD)
    pyc = py_compile.compile(str(tmp_path / "calc.py"), cfile=str(tmp_path / "calc.pyc"),
                             invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    snap = snapshot_of({"calc.py": "def add(a, b):\n    return a - b\n"})
    cached = f"__pycache__/calc.{sys.implementation.cache_tag}.pyc"
    snap.files[cached] = WorkspaceFile(cached, Path(pyc).read_bytes())
    verdict = await grader.run_hidden_tests(ADD, snap, uid=sandbox.service.cfg.uid_base + 100)
    assert (verdict.score, verdict.tests_passed, verdict.tests_total) == (0.0, 0, 3)




async def test_a_grading_cancelled_while_the_solution_outlives_the_tests_ends_cancelled(sandbox):
    """The tests are done and the solution's process will not exit (it replaced the
    os._exit its server ends with): the grader waits a grace period, then kills it. A
    cancel that lands in that wait (shutdown, the session closed) must end the grading
    cancelled, the solution's sandbox killed; before, the cancel was taken for the grace
    period's own timeout and the grading returned a verdict."""
    import asyncio

    from sandbox.runner import uid_pids
    from tests.waiting import wait_until_async

    grader = sandbox.service.grader
    uid = sandbox.service.cfg.uid_base + 101
    solution_uid = uid + sandbox.service.cfg.grading_solution_uid_offset
    lingering = SOLVED_ADD + "\nimport os, time\nos._exit = lambda code: time.sleep(3600)\n"
    grading = asyncio.ensure_future(grader.run_hidden_tests(ADD, snapshot_of({"calc.py": lingering}), uid=uid))
    seen = {"tests": False}

    def in_grace_wait() -> bool:
        seen["tests"] = seen["tests"] or bool(uid_pids(uid))
        return seen["tests"] and not uid_pids(uid) and bool(uid_pids(solution_uid))

    await wait_until_async(in_grace_wait, 120, "the tests ended, the solution lingering", task=grading,
                           poll_s=0.01)
    grading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await grading
    assert uid_pids(solution_uid) == []


# --- a test command that is not pytest ------------------------------------------------

EXIT_CODE_TASK = TaskSpec(
    task_id="exit_code_add",
    instruction="Implement add(a, b) in calc.py.",
    test_command="python hidden_tests/check_calc.py",
    files={"calc.py": "def add(a, b):\n    raise NotImplementedError\n"},
    hidden_tests={"check_calc.py": "import sys\nsys.path.insert(0, '.')\nfrom calc import add\nassert add(2, 3) == 5\n"},
    solution={"calc.py": "def add(a, b):\n    return a + b\n"},
)


@pytest.mark.parametrize("allowed", [False, True])
async def test_a_non_pytest_test_command_is_graded_only_when_allowed(tmp_path, allowed):
    tasks = tmp_path / "tasks"
    write_task_dir(tasks, EXIT_CODE_TASK)
    cfg = SandboxConfig(max_sessions=2, workspace_root=str(tmp_path / "ws"), tasks_dir=str(tasks),
                        allow_unisolated_grading=allowed)
    async with live_sandbox(cfg, RewardConfig(), TaskStore(tasks)) as live, SandboxClient(live.url) as client:
        live.client = client
        solved = await attempt(live, EXIT_CODE_TASK.task_id, EXIT_CODE_TASK.solution)
        untouched = await attempt(live, EXIT_CODE_TASK.task_id, {})
        # The exit code is the verdict and the tests run in the solution's process: an
        # atexit handler could set it (a pytest run, either mode, judges by its report).
        with_atexit = await attempt(live, EXIT_CODE_TASK.task_id,
                                    {"calc.py": "import atexit, os\natexit.register(os._exit, 0)\n\n\n"
                                                "def add(a, b):\n    return a - b\n"})
    assert (with_atexit.score, with_atexit.reward, with_atexit.cheated) == (0.0, CHEAT_FLOOR, True)
    assert with_atexit.reason == "exit-code trick: calc.py registers atexit handlers"
    if allowed:
        # Only the exit code counts: one "test", passed or not.
        assert (solved.score, solved.tests_passed, solved.tests_total, solved.cheated) == (1.0, 1, 1, False)
        assert (untouched.score, untouched.tests_passed, untouched.tests_total) == (0.0, 0, 1)
    else:
        for reward in (solved, untouched):
            assert (reward.score, reward.reward, reward.cheated) == (0.0, 0.0, False)
            assert reward.reason == (
                "task exit_code_add's test command 'python hidden_tests/check_calc.py' is not pytest, so its hidden "
                "tests would run in the solution's process; set sandbox.allow_unisolated_grading = true to grade "
                "it by exit code anyway")
