"""The grading bridge's capability boundary and codec, in one process (no sandbox).

The two ends of ``sandbox.bridge`` over a socketpair, the solution's end served by a
thread, and a "solution" module (SOLUTION below) that tries what a hostile policy would
on whatever test-side object it is handed: navigate a generator to its frame, a callback
to its globals, a class to its subclasses, an object to a module; call a system function
found on a test object; raise the test framework's exceptions; forge raw requests. Each
must end in an error inside the solution (the test side's objects never reachable), while
honest use (calling callbacks, iterating, comparing, numpy values, paths, big ints)
works. End-to-end cases through the real grader are in test_grader_bridge_hostile.py.
"""

from __future__ import annotations

import functools
import io
import itertools
import math
import os
import re
import socket
import sys
import threading
import types
from fractions import Fraction
from pathlib import Path, PurePosixPath
from unittest import mock

import numpy as np
import pytest

from sandbox import bridge
from sandbox.bridge import BridgeError, Connection, Refused, capabilities, kind_of

SOLUTION = '''
import sys


def nav(obj, *names):
    for name in names:
        obj = getattr(obj, name)
    return obj


def call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def call_method(obj, name, *args):
    return getattr(obj, name)(*args)


def total(items):
    return sum(items)


def catch(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return [type(exc).__name__, str(exc), list(exc.args), sorted(k for k in vars(exc) if not k.startswith("_"))]
    return None


def reraise(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        raise exc


def raise_class_of(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        raise type(exc)("forged by the solution")


def same(x):
    return x


def args_of(exc):
    return [type(exc).__name__, list(exc.args), str(exc)]


def numpy_values():
    import numpy as np
    return [np.int64(7), np.float64(0.5), np.bool_(True), np.str_("s"), np.arange(6).reshape(2, 3),
            np.zeros((0, 3)), np.array([1.5, 2.5], dtype=np.float32), np.array([{"a": 1}], dtype=object)]


def big(n):
    return 7 ** n


def cyclic():
    x = [1]
    x.append(x)
    return x


def deep(n):
    x = []
    for _ in range(n):
        x = [x]
    return x


def huge():
    return "x" * 5000


def connection():
    """The solution's own end of the bridge: what a hack that finds it in gc can do."""
    import gc
    for obj in gc.get_objects():
        if type(obj).__name__ == "Connection" and getattr(obj, "role", "") == "solution":
            return obj


def forge(*msg):
    """A raw request from the solution's side, past every proxy."""
    return connection().request(list(msg))
'''

_module = types.ModuleType("bridge_probe_solution")
exec(SOLUTION, _module.__dict__)  # noqa: S102 - the "solution" module of these tests
sys.modules["bridge_probe_solution"] = _module


class Box:
    """A test-side object with public attributes that lead out (module, system function)."""

    def __init__(self, value=3):
        self.value = value
        self.os = os
        self.run = os.system
        self.items = [1, 2]

    def get(self):
        return self.value


class Boom(Exception):
    pass


def _gen():
    yield 1
    yield 2


@pytest.fixture(scope="module")
def ends():
    """(tests' end, the solution module as the tests see it)."""
    a, b = socket.socketpair()
    tests, solution = Connection(a, "tests"), Connection(b, "solution")
    thread = threading.Thread(target=solution.serve_forever, daemon=True)
    thread.start()
    yield tests, tests.rpc("import", "bridge_probe_solution")
    a.close()
    thread.join(timeout=10)
    b.close()


@pytest.fixture
def probe(ends):
    return ends[1]


# --- the capability table itself ------------------------------------------------------------


def stable_id(obj) -> str:
    """repr without memory addresses: xdist workers must collect the same test ids."""
    return re.sub(r" (at 0x[0-9a-f]+|id='[0-9]+')", "", repr(obj))


@pytest.mark.parametrize("obj", [
    sys._getframe(), _gen.__code__, os, sys, types.TracebackType, eval, exec, compile, getattr, setattr, open,
    __import__, globals, vars, os.system, os.fork, sys.exit, pytest.exit, pytest.fail.Exception,
    pytest.exit.Exception, type, Box.mro, Box.__subclasses__, Box.__dict__, object.__subclasses__,
    types.FunctionType, ValueError("x"), functools.partial(os.system, "true"), type(_gen()), type(sys._getframe()),
], ids=stable_id)
def test_never_a_handle(obj):
    with pytest.raises(Refused):
        kind_of(obj)


@pytest.mark.parametrize(("obj", "kind"), [
    (lambda x: x, capabilities.FUNCTION), (_gen, capabilities.FUNCTION), ([].append, capabilities.FUNCTION),
    (str.lower, capabilities.FUNCTION), (len, capabilities.FUNCTION), (sorted, capabilities.FUNCTION),
    (math.sqrt, capabilities.FUNCTION), (Box, capabilities.CLASS), (Box().get, capabilities.FUNCTION),
    (Box(), capabilities.OBJECT), (_gen(), capabilities.GENERATOR), (Boom, capabilities.EXC_CLASS),
    (int, capabilities.CLASS), (itertools.count(), capabilities.OBJECT), (io.StringIO(), capabilities.OBJECT),
    (mock.Mock(), capabilities.OBJECT), (threading.Lock(), capabilities.OBJECT),
    (types.SimpleNamespace(a=1), capabilities.OBJECT),
], ids=stable_id)
def test_handle_kinds(obj, kind):
    assert kind_of(obj) == kind


# --- navigation from the solution's side ------------------------------------------------------


@pytest.mark.parametrize("names", [
    ("gi_frame",), ("gi_code",), ("gi_yieldfrom",), ("gi_frame", "f_globals"), ("gi_running",),
])
def test_generator_internals_unreachable(probe, names):
    with pytest.raises(AttributeError, match="not reachable from the solution"):
        probe.nav(_gen(), *names)


def test_generator_driven_honestly(probe):
    assert probe.total(x * x for x in range(4)) == 14
    gen = _gen()
    assert probe.call_method(gen, "send", None) == 1
    assert probe.nav(gen, "__name__") == "_gen"


@pytest.mark.parametrize("names", [("os",), ("os", "system"), ("run",), ("get", "__func__"), ("get", "__self__"),
                                   ("__init__", "__globals__")])
def test_object_paths_out_refused(probe, names):
    with pytest.raises((AttributeError, TypeError)):
        probe.nav(Box(), *names)


def test_object_public_values_and_methods(probe):
    box = Box(9)
    assert probe.nav(box, "value") == 9
    assert probe.nav(box, "items") == [1, 2]
    assert probe.call_method(box, "get") == 9
    assert probe.call(Box, 4).get() == 4  # a test class instantiated by the solution comes home as itself


@pytest.mark.parametrize("names", [("mro",), ("__subclasses__",), ("__mro__",), ("__base__",), ("get", "__code__")])
def test_class_navigation_refused(probe, names):
    with pytest.raises((AttributeError, TypeError)):
        probe.nav(Box, *names)


@pytest.mark.parametrize("names", [("__globals__",), ("__code__",), ("__closure__",), ("__wrapped__",)])
def test_function_internals_unreachable(probe, names):
    with pytest.raises(AttributeError):
        probe.nav(lambda: 1, *names)


def test_system_function_on_a_test_object_is_not_called(probe):
    with pytest.raises(TypeError, match="cannot cross|cannot be called"):
        probe.call_method(Box(), "run", "touch /tmp/bridge-capabilities-pwned")
    assert not os.path.exists("/tmp/bridge-capabilities-pwned")


def test_callbacks_honestly(probe):
    seen = []
    probe.call(seen.append, 5)
    assert seen == [5]
    assert probe.call(lambda a, b=0: a * 10 + b, 4, b=2) == 42
    assert probe.call(str.upper, "abc") == "ABC"
    assert probe.call(sorted, [3, 1, 2]) == [1, 2, 3]
    m = mock.Mock(return_value=3)
    assert probe.call(m, 1) == 3
    m.assert_called_once_with(1)


# --- exceptions: mirrors by value, never handles -------------------------------------------


def test_test_exception_crosses_without_message_or_traceback(probe):
    def fails():
        raise AssertionError("the expected value is 42")

    def fails_with_attributes():
        exc = Boom("the expected value is 42")
        exc.expected = 42
        raise exc

    assert probe.catch(fails) == ["AssertionError", "", [], []]
    assert probe.catch(fails_with_attributes) == ["Boom", "", [], []]


def test_raised_back_is_the_original(probe):
    def fails():
        raise Boom("mine")

    with pytest.raises(Boom, match="mine"):
        probe.reraise(fails)


def test_framework_exception_cannot_be_forged(probe):
    """The solution re-raises a new instance of the class of pytest's own outcome
    exceptions, which a test's callback raised: it arrives as the builtin base, never as
    the framework's class (that would skip, fail or stop the run as the solution likes)."""
    for fn in (lambda: pytest.exit("x"), lambda: pytest.skip("x"), lambda: pytest.fail("x")):
        with pytest.raises(BaseException) as info:
            probe.raise_class_of(fn)
        assert type(info.value).__module__ != "_pytest.outcomes", type(info.value)
        assert not isinstance(info.value, (pytest.exit.Exception, pytest.skip.Exception, pytest.fail.Exception))


def test_exception_value_is_a_mirror(probe):
    """An exception handed over as a value: the solution sees its class only; handed
    back, it is the original."""
    original = ValueError("the expected value is 42")
    assert probe.same(original) is original
    assert probe.args_of(original) == ["ValueError", [], ""]


# --- raw requests forged on the solution's side ---------------------------------------------


def test_forged_requests_refused(ends):
    tests, probe = ends
    gen = _gen()
    probe.same(gen)  # the solution now holds a handle to it
    ref = tests._ids[id(gen)]
    for msg in (["getattr", ref, "gi_frame"], ["callm", ref, "__reduce__", [], []], ["call", ref, [], []],
                ["op", "getitem", [["V", [["r", ref]]], 0]], ["setattr", ref, "x", [1]], ["import", "os"],
                ["methods", ref], ["getattr", 10**6, "x"]):
        with pytest.raises((AttributeError, TypeError, BridgeError)):
            probe.forge(*msg)


def test_solution_cannot_raise_a_test_class_it_was_not_given(ends):
    tests, probe = ends
    class Lent(Exception):
        pass

    tests._export(Lent, capabilities.OBJECT)  # lent as something else: not an exception class
    ref = tests._ids[id(Lent)]
    with pytest.raises(BridgeError):
        tests.decode_exception(["x", ["V", [["r", ref]]], ["V", [["t", 0, None]]], "", [], 0])


# --- values ------------------------------------------------------------------------


def test_numpy_values(probe):
    i, f, b, s, arr, empty, f32, objects = probe.numpy_values()
    assert (type(i), i) == (int, 7) and (type(f), f) == (float, 0.5) and (type(b), b) == (bool, True)
    assert (type(s), s) == (str, "s")
    assert type(arr) is np.ndarray and arr.dtype == np.int64 and arr.shape == (2, 3)
    assert (arr == np.arange(6).reshape(2, 3)).all()
    assert empty.shape == (0, 3) and f32.dtype == np.float32
    assert objects == [{"a": 1}]
    assert probe.same(np.int64(3)) == 3 and probe.same(np.arange(3)).tolist() == [0, 1, 2]


@pytest.mark.parametrize("n", [10, 20_000])
def test_ints_of_any_size(probe, n):
    assert probe.big(n) == 7 ** n  # 20,000: about 16,900 digits, over str()'s 4,300
    assert probe.same(-(7 ** n)) == -(7 ** n)
    assert probe.same(Fraction(7 ** n, 3)) == Fraction(7 ** n, 3)
    assert probe.same([7 ** n, range(0, 7 ** n, 7 ** (n // 2))]) == [7 ** n, range(0, 7 ** n, 7 ** (n // 2))]


def test_cycles_are_a_clear_error_and_the_bridge_lives_on(probe):
    with pytest.raises(BridgeError, match="contains itself"):
        probe.cyclic()
    x = {}
    x["self"] = x
    with pytest.raises(BridgeError, match="contains itself"):
        probe.same(x)
    shared = [1]
    assert probe.same([shared, shared]) == [[1], [1]]  # shared, not cyclic: fine
    assert probe.total([1, 2]) == 3


def test_depth_bounded(probe):
    assert probe.deep(5000) is not None
    with pytest.raises(BridgeError, match="deeper than"):
        probe.deep(bridge.MAX_VALUE_DEPTH + 10)
    assert probe.total([1]) == 1


def test_answer_too_large_is_an_error_in_the_test(probe, monkeypatch):
    monkeypatch.setattr(bridge.wire, "MAX_MESSAGE_BYTES", 1000)
    with pytest.raises(BridgeError, match="too large"):
        probe.huge()
    monkeypatch.undo()
    assert probe.total([2]) == 2


def test_paths_cross_as_values(probe):
    back = probe.same(Path("/grader-scratch/pytest/t0/in.txt"))
    assert type(back) is type(Path("/x")) and back == Path("/grader-scratch/pytest/t0/in.txt")
    assert probe.same(PurePosixPath("a/b")) == PurePosixPath("a/b")

    class Where(os.PathLike):
        def __fspath__(self):
            return "/somewhere"

    assert probe.same(Where()) == Path("/somewhere")


def test_module_source_comes_from_the_graders_copy(ends, tmp_path):
    """A module that declares another ``__file__`` cannot point inspect.getsource at it."""
    tests, _ = ends
    (tmp_path / "decoyed.py").write_text("__file__ = '/workspace/decoy.py'\nVALUE = 1\n")
    (tmp_path / "decoy.py").write_text("VALUE = 1  # looks innocent\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("__file__ = 'elsewhere'\n")
    sys.path.insert(0, str(tmp_path))
    try:
        finder = bridge.SolutionFinder(tests, {"decoyed", "pkg"}, str(tmp_path), "/solution-src")
        finder.sources = str(tmp_path) + "/"
        spec = finder.find_spec("decoyed")
        assert spec.origin == f"{tmp_path}/decoyed.py"
        spec = finder.find_spec("pkg")
        assert spec.origin == f"{tmp_path}/pkg/__init__.py" and spec.submodule_search_locations is not None
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("decoyed", None)
        sys.modules.pop("pkg", None)
