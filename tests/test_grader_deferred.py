"""Deferred bridge calls: a test's solution calls whose results it does not use go without
a round trip each, and the tests still see exactly what they would in one process.

One real pytest run over the bridge, outside any sandbox (the sandboxed path is covered by
test_grader*.py and the hostile suite): the grader's own entry scripts in two processes
joined by a socketpair, the hidden tests below against the solution module below. Each
hidden test pins one rule of ``Connection.try_defer``; its outcome and message are read
from the run's JUnit report.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from sandbox import bridge

ROOT = Path(__file__).resolve().parents[1]

SOLUTION = '''
import time

CALLS = []  # every call this process ran, in order: what the tests' side cannot see


class Store:
    def __init__(self):
        self.items = {}

    def put(self, key, value):
        CALLS.append(("put", key))
        if key == "bad":
            raise ValueError("bad key")
        self.items[key] = value

    def get(self, key):
        return self.items.get(key)

    def size(self):
        return len(self.items)

    def fill(self, out):
        out.append(len(self.items))

    def on(self, callback):
        self.callback = callback

    def fire(self, value):
        self.callback(value)

    def key(self, x):
        CALLS.append(("key", x))
        return -x

    def start(self):
        self.started = time.monotonic()

    def stop(self):
        self.stopped = time.monotonic()

    def elapsed(self):
        return self.stopped - self.started

    def stamp(self):
        self.stamped = time.time()


def calls():
    return list(CALLS)


def reset():
    CALLS.clear()
'''

HIDDEN = '''
import time
from time import sleep

import __main__

import _rollway_bridge
import pytest

import store
from store import Store

conn = __main__.connection


def test_loop_of_statement_calls_takes_few_round_trips():
    s = Store()
    n = 2 * _rollway_bridge.DEFER_SETTLE_CALLS + 10
    sent = conn._sends
    for i in range(n):
        s.put(i, i * i)
    # No round trip per call: one settles each DEFER_SETTLE_CALLS deferred calls.
    assert conn._sends - sent == 2
    assert s.size() == n and s.get(n - 1) == (n - 1) ** 2


def test_failure_is_reported_and_later_calls_never_run():
    store.reset()
    s = Store()
    s.put("a", 1)
    s.put("bad", 2)
    s.put("c", 3)  # the failed call stops the test: this one must never run
    s.size()


def test_nothing_ran_after_the_failed_call():
    assert store.calls() == [("put", "a"), ("put", "bad")]


def test_failure_is_not_swallowed_by_a_later_handler():
    s = Store()
    s.put("bad", 1)
    with pytest.raises(Exception):
        s.get("x")  # the report lands here; it is no Exception, so it is not caught


def test_failure_caught_anyway_still_fails_the_test():
    s = Store()
    s.put("bad", 1)
    try:
        s.size()
    except BaseException:
        pass


def test_failure_in_the_last_call_fails_its_own_test():
    Store().put("bad", 1)


def test_next_test_starts_clean():
    s = Store()
    s.put("ok", 1)
    assert s.get("ok") == 1


def test_call_inside_handler_raises_at_its_line():
    s = Store()
    with pytest.raises(ValueError, match="bad key"):
        s.put("bad", 1)
    try:
        s.put("bad", 1)
    except ValueError:
        pass
    assert s.size() == 0


def _helper(s):
    s.put("bad", 1)


def test_handler_in_a_calling_frame_counts():
    s = Store()
    with pytest.raises(ValueError):
        _helper(s)


def test_calls_made_by_c_code_wait_for_their_result():
    store.reset()
    s = Store()
    sorted([3, 1, 2], key=s.key)  # the result is dropped, but sorted uses the keys
    assert store.calls() == [("key", 3), ("key", 1), ("key", 2)]
    assert sorted([3, 1, 2], key=s.key) == [3, 2, 1]


def test_mutable_argument_is_written_back_before_the_next_line():
    s = Store()
    s.put("k", 1)
    out = []
    s.fill(out)
    assert out == [1]


def test_a_call_before_a_sleep_runs_before_it():
    s = Store()
    s.start()
    sleep(0.05)
    s.stop()
    assert s.elapsed() >= 0.05


def test_a_call_between_two_clock_reads_runs_between_them():
    s = Store()
    before = time.time()
    s.stamp()
    after = time.time()
    assert before <= s.stamped <= after


def test_callbacks_keep_calls_synchronous():
    seen = []
    s = Store()
    s.on(seen.append)
    s.fire(5)
    assert seen == [5]
'''

# Test name -> outcome, and for failures a piece of the message.
EXPECTED = {
    "test_loop_of_statement_calls_takes_few_round_trips": ("passed", ""),
    "test_failure_is_reported_and_later_calls_never_run": ("failed", "raised ValueError: bad key"),
    "test_nothing_ran_after_the_failed_call": ("passed", ""),
    "test_failure_is_not_swallowed_by_a_later_handler": ("failed", "DeferredCallError"),
    "test_failure_caught_anyway_still_fails_the_test": ("failed", "DeferredCallError"),
    "test_failure_in_the_last_call_fails_its_own_test": ("failed", "DeferredCallError"),
    "test_next_test_starts_clean": ("passed", ""),
    "test_call_inside_handler_raises_at_its_line": ("passed", ""),
    "test_handler_in_a_calling_frame_counts": ("passed", ""),
    "test_calls_made_by_c_code_wait_for_their_result": ("passed", ""),
    "test_mutable_argument_is_written_back_before_the_next_line": ("passed", ""),
    "test_a_call_before_a_sleep_runs_before_it": ("passed", ""),
    "test_a_call_between_two_clock_reads_runs_between_them": ("passed", ""),
    "test_callbacks_keep_calls_synchronous": ("passed", ""),
}


def _grader_dir(path: Path, script: str, config: dict) -> Path:
    path.mkdir()
    bridge.install(path)
    (path / script).write_bytes((ROOT / "sandbox" / script).read_bytes())
    (path / "bridge.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict[str, tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("deferred")
    workspace, tests = tmp / "ws", tmp / "tests"
    workspace.mkdir()
    tests.mkdir()
    (workspace / "store.py").write_text(SOLUTION)
    (tests / "test_hidden.py").write_text(HIDDEN)
    left, right = socket.socketpair()
    common = {"workspace": str(workspace), "sources": str(workspace), "modules": ["store"]}
    sol = _grader_dir(tmp / "sol", "bridge_solution.py", {**common, "fd": left.fileno()})
    run = _grader_dir(tmp / "run", "bridge_tests.py", {**common, "fd": right.fileno()})
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    solution = subprocess.Popen([sys.executable, "-P", str(sol / "bridge_solution.py")], pass_fds=(left.fileno(),),
                                env=env, cwd=workspace)
    try:
        tests_run = subprocess.run(
            [sys.executable, "-P", str(run / "bridge_tests.py"), "-q", "-p", "no:cacheprovider",
             f"--junitxml={tmp / 'junit.xml'}", f"--rootdir={tests}", str(tests)],
            pass_fds=(right.fileno(),), env=env, cwd=tests, capture_output=True, text=True, timeout=300,
        )
    finally:
        left.close()
        right.close()
        solution.wait(timeout=60)
    assert solution.returncode == 0
    assert tests_run.returncode == 1, tests_run.stdout[-3000:] + tests_run.stderr[-3000:]
    out = {}
    for case in ET.parse(tmp / "junit.xml").getroot().iter("testcase"):
        bad = [child for child in case if child.tag in ("failure", "error")]
        out[case.get("name")] = ("failed", bad[0].get("message", "") + (bad[0].text or "")) if bad else ("passed", "")
    return out


def test_every_hidden_test_ran(report):
    assert sorted(report) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_outcome(report, name):
    outcome, text = report[name]
    assert outcome == EXPECTED[name][0], text
    assert EXPECTED[name][1] in text


def test_failure_names_the_call_and_its_line(report):
    _, text = report["test_failure_is_reported_and_later_calls_never_run"]
    line = HIDDEN.splitlines().index('    s.put("bad", 2)') + 1
    assert f"the solution's put() called at " in text and f"test_hidden.py:{line} raised ValueError: bad key" in text
