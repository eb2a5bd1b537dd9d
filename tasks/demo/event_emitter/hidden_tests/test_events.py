import pytest

from events import EventEmitter


def test_on_and_emit_in_order():
    em, seen = EventEmitter(), []
    em.on("x", lambda v: seen.append(("a", v)))
    em.on("x", lambda v: seen.append(("b", v)))
    assert em.emit("x", 1) == 2
    assert seen == [("a", 1), ("b", 1)]
    assert em.emit("nothing") == 0


def test_decorator_form_and_kwargs():
    em, seen = EventEmitter(), []

    @em.on("save")
    def handler(path, *, force=False):
        seen.append((path, force))

    em.emit("save", "/tmp/x", force=True)
    assert seen == [("/tmp/x", True)]
    assert handler.__name__ == "handler"


def test_once():
    em, seen = EventEmitter(), []
    em.once("x", seen.append)
    assert em.listener_count("x") == 1
    assert em.emit("x", 1) == 1
    assert em.emit("x", 2) == 0
    assert seen == [1]


def test_off_removes_earliest_registration():
    em, seen = EventEmitter(), []
    em.on("x", seen.append)
    em.on("x", seen.append)
    em.off("x", seen.append)
    assert em.listener_count("x") == 1
    em.emit("x", "v")
    assert seen == ["v"]
    em.off("x", print)  # unknown: no error


def test_snapshot_during_emit():
    em, seen = EventEmitter(), []

    def first():
        seen.append("first")
        em.off("x", second)
        em.on("x", lambda: seen.append("late"))

    def second():
        seen.append("second")

    em.on("x", first)
    em.on("x", second)
    assert em.emit("x") == 2
    assert seen == ["first", "second"]
    seen.clear()
    em.emit("x")
    assert seen == ["first", "late"]


def test_exception_stops_emit():
    em, seen = EventEmitter(), []

    def boom():
        raise RuntimeError("boom")

    em.on("x", boom)
    em.on("x", lambda: seen.append("after"))
    with pytest.raises(RuntimeError):
        em.emit("x")
    assert seen == []
