"""Failpoints (bus/failpoints.py): the named points a chaos run arms to stop a process
inside a millisecond-long operation (benchmarks/chaos.py)."""

from __future__ import annotations

import pytest

from bus import failpoints


def hangs(name: str) -> bool:
    return failpoints._should_hang(name)[0]


@pytest.fixture(autouse=True)
def fresh_counts():
    failpoints._hits.clear()
    yield
    failpoints._hits.clear()


def test_unset_arms_nothing(monkeypatch):
    monkeypatch.delenv(failpoints.ENV, raising=False)
    assert failpoints.armed() == {}
    assert not hangs("checkpoint.before_rename")
    failpoints.reached("checkpoint.before_rename")  # returns at once


def test_listed_points_hang_at_their_hit(monkeypatch):
    monkeypatch.setenv(failpoints.ENV, "checkpoint.before_rename@3, weights.before_announce")
    assert failpoints.armed() == {"checkpoint.before_rename": 3, "weights.before_announce": 1}
    assert [hangs("checkpoint.before_rename") for _ in range(4)] == [False, False, True, False]
    assert hangs("weights.before_announce")
    assert not hangs("other.point")


def test_a_file_arms_points_in_a_running_process(monkeypatch, tmp_path):
    spec = tmp_path / "failpoints"
    monkeypatch.setenv(failpoints.ENV, f"@{spec}")
    assert not hangs("weights.before_announce")  # no file yet
    spec.write_text("weights.before_announce@2\n")
    assert [hangs("weights.before_announce") for _ in range(2)] == [False, True]
    spec.write_text("")  # disarmed: hits are counted afresh when armed again
    assert not hangs("weights.before_announce")
    spec.write_text("weights.before_announce@2\n")
    assert [hangs("weights.before_announce") for _ in range(2)] == [False, True]


def test_a_malformed_item_is_ignored_and_the_operation_goes_on(monkeypatch):
    monkeypatch.setenv(failpoints.ENV, "checkpoint.before_rename@abc, weights.before_announce@2")
    assert failpoints.armed() == {"weights.before_announce": 2}
    failpoints.reached("checkpoint.before_rename")  # returns: the typo arms nothing


def test_a_pausing_point_waits_while_armed_and_then_goes_on(monkeypatch, tmp_path):
    import threading

    from tests.waiting import wait_until

    spec = tmp_path / "failpoints"
    spec.write_text("checkpoint.before_rename:pause\n")
    monkeypatch.setenv(failpoints.ENV, f"@{spec}")
    assert failpoints.armed() == {"checkpoint.before_rename": 1}
    assert failpoints.paused_points() == {"checkpoint.before_rename"}
    passed = threading.Event()

    def operation() -> None:
        failpoints.reached("checkpoint.before_rename")
        passed.set()

    worker = threading.Thread(target=operation, daemon=True)
    worker.start()
    wait_until(lambda: failpoints._hits.get("checkpoint.before_rename") == 1, 10, "the point reached")
    assert not passed.is_set()  # held there while armed
    spec.write_text("")  # the driver disarms it: the operation goes on
    wait_until(passed.is_set, 10, "the operation to go on")
    worker.join(10)


def test_a_pausing_point_disarmed_the_moment_it_is_reached_goes_on(monkeypatch, tmp_path):
    """The driver disarms the point right after the process logs reaching it (what a chaos
    driver does once it sees the log line). The point's pause-or-hang decision comes from
    the same read of the spec as its hit: before, a second read found the point gone and
    the operation hung for good (test_a_pausing_point... failed on a loaded machine)."""
    import threading

    from tests.waiting import wait_until

    spec = tmp_path / "failpoints"
    spec.write_text("checkpoint.before_rename:pause\n")
    monkeypatch.setenv(failpoints.ENV, f"@{spec}")

    class DisarmOnReached:
        def warning(self, event, **kw):
            if event == "failpoint reached":
                spec.write_text("")

    monkeypatch.setattr(failpoints, "log", DisarmOnReached())
    passed = threading.Event()

    def operation() -> None:
        failpoints.reached("checkpoint.before_rename")
        passed.set()

    threading.Thread(target=operation, daemon=True).start()
    wait_until(passed.is_set, 10, "the operation to go on")
