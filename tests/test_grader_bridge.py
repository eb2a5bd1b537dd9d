"""The grading bridge's wire protocol, in one process (no sandbox): the two ends of
``sandbox.bridge`` over two pipes as the grader joins them (a socketpair for the raw
peer), the solution's end served by a thread.

The sandboxed path is covered by test_grader*.py and the hostile suite; these pin down the
codec and framing directly: values survive the trip exactly (NaN, big ints, lone
surrogates, bytes), and whatever a hostile peer writes on the socket (trailing data, bad
UTF-8, a non-list, a split or coalesced frame) is either decoded exactly or refused with
a BridgeError, never mis-read.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
from decimal import Decimal
from fractions import Fraction

import pytest

from sandbox import bridge
from sandbox.bridge import BridgeError, Connection


@pytest.fixture
def pair():
    """The tests' end, connected by two pipes to a solution end served by a thread."""
    to_solution, to_tests = os.pipe(), os.pipe()
    tests = Connection((to_tests[0], to_solution[1]), "tests")
    solution = Connection((to_solution[0], to_tests[1]), "solution")
    thread = threading.Thread(target=solution.serve_forever, daemon=True)
    thread.start()
    yield tests
    os.close(to_solution[1])  # EOF: the solution's loop returns
    thread.join(timeout=10)
    assert not thread.is_alive()
    for fd in (to_solution[0], *to_tests):
        os.close(fd)


@pytest.fixture
def raw():
    """The tests' end, with the raw socket of its peer: what a hostile peer could write."""
    a, b = socket.socketpair()
    yield Connection(a, "tests"), b
    a.close()
    b.close()


def _frame(payload: bytes) -> bytes:
    return bridge.HEADER.pack(len(payload)) + payload


VALUES = [
    0, -1, 2**200, -(3**90), 1.5, math.inf, -math.inf, "", "plain", "naïve ☃", "\ud800 lone surrogate",
    "\x00\n\"\\", b"\x00\xff bytes", bytearray(b"ab"), [1, [2, [3, []]]], (1, (2,)), {"a": [1], 2: (3,)},
    {1, 2}, frozenset({"x"}), 3 + 4j, Decimal("1.10"), Fraction(1, 3), range(1, 10, 2), None, True, False,
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_values_cross_exactly(pair, value):
    copy = pair.rpc("import", "copy")
    back = copy.copy(value)
    assert type(back) is type(value)
    assert back == value


def test_nan_crosses(pair):
    back = pair.rpc("import", "copy").copy(math.nan)
    assert type(back) is float and math.isnan(back)


def test_many_calls_and_exceptions_in_order(pair):
    operator = pair.rpc("import", "operator")
    for i in range(2000):
        assert operator.add(i, 1) == i + 1
    with pytest.raises(ZeroDivisionError):
        operator.truediv(1, 0)
    assert operator.mul("ab", 3) == "ababab"


def test_large_message_split_across_reads(pair):
    value = "x" * (3 * 1024 * 1024)  # far over one recv: the buffered path
    assert pair.rpc("import", "copy").copy(value) == value


def test_mutable_argument_written_back(pair):
    items = [3, 1, 2]
    pair.rpc("import", "random").Random(0).shuffle(items)
    assert sorted(items) == [1, 2, 3]
    bisect = pair.rpc("import", "bisect")
    bisect.insort(items, 0)
    assert items[0] == 0 and len(items) == 4


def test_coalesced_and_split_frames(raw):
    conn, peer = raw
    first, second = _frame(b'["ok",1,null]'), _frame(b'["ok",[],null]')
    peer.sendall(first + second)  # two messages in one read
    assert conn._recv() == ["ok", 1, None]
    assert conn._recv() == ["ok", [], None]
    peer.sendall(first[:3])  # a header split across reads
    peer.sendall(first[3:])
    assert conn._recv() == ["ok", 1, None]


@pytest.mark.parametrize("payload", [
    b'["ok",1,null] ',  # data after the message
    b'["ok",1,null]["ok"]',
    b'["ok",1,null',  # truncated
    b'\xff\xfe["ok"]',  # not UTF-8
    b'{"ok":1}',  # not a list
    b'[]',
    b'[1,2]',  # first item not a string
    b'',
    b'["ok",' + b"[" * 100_000 + b"]" * 100_000 + b',null]',  # deeper than the scanner recurses
], ids=lambda p: repr(p[:20]))
def test_malformed_messages_refused(raw, payload):
    conn, peer = raw
    peer.sendall(_frame(payload))
    with pytest.raises(BridgeError):
        conn._recv()


def test_oversized_header_refused(raw):
    conn, peer = raw
    peer.sendall(bridge.HEADER.pack(bridge.MAX_MESSAGE_BYTES + 1) + b"[]")
    with pytest.raises(BridgeError):
        conn._recv()


def test_peer_gone_is_a_bridge_error(raw):
    conn, peer = raw
    peer.close()
    with pytest.raises(BridgeError):
        conn.rpc("import", "copy")


def test_messages_are_ascii():
    data = bridge.dumps(["ok", "naïve ☃ \ud800", [math.nan, -math.inf, 2**100]])
    data.decode("ascii")
    assert bridge.loads(data)[1] == "naïve ☃ \ud800"


def test_busy_bridge_pins_to_one_cpu():
    """After ``pin_after`` messages an end pins itself to the grader's CPU (both ends do,
    so a busy ping-pong stays on one CPU); before that it runs where the kernel puts it."""
    import os

    saved = os.sched_getaffinity(0)
    if len(saved) < 2:
        pytest.skip("one CPU: nothing to pin to")
    cpu = max(saved)
    a, b = socket.socketpair()
    tests = Connection(a, "tests", cpu=cpu, pin_after=20)
    thread = threading.Thread(target=Connection(b, "solution").serve_forever, daemon=True)
    thread.start()
    try:
        operator = tests.rpc("import", "operator")
        for i in range(3):
            assert operator.add(i, 1) == i + 1
        assert os.sched_getaffinity(0) == saved  # 7 messages sent so far (import, getattr + call)
        for i in range(10):
            assert operator.add(i, 1) == i + 1
        assert os.sched_getaffinity(0) == {cpu}
    finally:
        os.sched_setaffinity(0, saved)  # this is pytest's own thread
        a.close()
        thread.join(timeout=10)
        b.close()


RECORDER = """
SEEN = []


class Recorder:
    def add(self, *args, **kwargs):
        SEEN.append([list(args), kwargs])

    def fail(self):
        raise ValueError("refused on purpose")

    def seen(self):
        return list(SEEN)
"""


def _run_test(test):
    """Stands in for pytest's pytest_pyfunc_call: the frame deferral stops at."""
    return test()


@pytest.fixture
def recorder(pair, tmp_path, monkeypatch):
    (tmp_path / "bridge_recorder.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pair, pair.rpc("import", "bridge_recorder").Recorder()
    sys.modules.pop("bridge_recorder", None)


def test_deferred_calls_run_in_order_batched_or_not(recorder):
    """Plain scalar calls go in "dcalls" batches; a tuple, a str or int over the batch's
    item limit and keyword calls go as they did: one order, every value exact."""
    tests, rec = recorder
    long_text, wide = "é" * 5000, 3 ** 5000

    def test():
        for i in range(600):  # several batches
            rec.add(i, str(i), i / 2, None, True)
        rec.add((1, (2,)))
        rec.add(long_text)
        rec.add(wide)
        rec.add(1, key="v")
        rec.add(2)

    sends = tests._sends
    tests.defer_calls_from(_run_test.__code__)
    tests.begin_call()
    _run_test(test)
    tests.end_call()
    assert tests._sends - sends == 1  # the settling round trip only
    expected = [[[i, str(i), i / 2, None, True], {}] for i in range(600)]
    expected += [[[(1, (2,))], {}], [[long_text], {}], [[wide], {}], [[1], {"key": "v"}], [[2], {}]]
    assert rec.seen() == expected


def test_deferred_failure_inside_a_batch_stops_the_rest(recorder):
    tests, rec = recorder

    def test():
        for i in range(50):
            rec.add(i)
        rec.fail()
        rec.add("never")

    tests.defer_calls_from(_run_test.__code__)
    tests.begin_call()
    _run_test(test)
    with pytest.raises(bridge.DeferredCallError, match=r"fail\(\) called at .*refused on purpose"):
        tests.end_call()
    assert rec.seen() == [[[i], {}] for i in range(50)]
