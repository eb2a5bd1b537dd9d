"""Deferred calls (the tests' side): a solution method called for its effect alone does
not wait for its answer.

A test that calls a solution method as a statement (``cache.put(k, v)``) does not need
to wait for it: the call is queued, sent with later ones in one write, and answered by no
message, so a loop of such calls costs no round trip each. What stays exactly as in a
synchronous call:
- the solution runs the same calls in the same order and sees the same values;
- a call raises at most once, and a raised call fails the test: the solution skips every
  later deferred call and answers the tests' next request (not run) with the failure,
  which the tests raise as DeferredCallError; the end of each test function settles what
  is left. So only calls whose exception would have failed the test anyway are deferred:
  no try/except/with may cover the call in any frame between it and the test function;
- the test never reads what the call changed before the solution ran it (every
  observation is a later request on the same stream); a deferred call cannot reach back
  into the tests (this side has lent no object, the arguments are immutable values or
  the solution's own objects);
- the clock: the tests' entry script settles the queue before the tests read a clock or
  sleep through the time module (bridge_tests.py).
What differs: an error is reported at a later line of the same test; time read another
way may see a queued call not yet run; the solution can tell from timing that nobody
waits for its answer.
"""

from __future__ import annotations

import dis
import sys
from decimal import Decimal
from fractions import Fraction

from .codec import SCALARS, text
from .proxies import Proxy
from .wire import HEADER, MAX_MESSAGE_BYTES, BridgeError, dumps

# Deferred calls go out in one write per this many bytes; a round trip (a "sync") settles
# them after this many calls.
DEFER_WRITE_BYTES = 64 * 1024
DEFER_SETTLE_CALLS = 4096
# How many frames up from a call site the walk to the test function's frame looks.
_MAX_WALK = 64
# Deferral needs the exception table and source positions of CPython 3.11+ bytecode.
CAN_DEFER = sys.version_info >= (3, 11) and hasattr(dis, "_parse_exception_table")
# Argument types a deferred call may carry: values that cannot be changed in place.
_IMMUTABLE = frozenset({type(None), bool, int, float, str, bytes, complex, Decimal, Fraction, range})


class DeferredCallError(BaseException):
    """A deferred call raised in the solution. Reported at the test's next call to the
    solution, or when the test function returns, so a later line than the call's. A
    BaseException on purpose: an ``except Exception`` or a ``pytest.raises`` around that
    later line must not swallow it (and the end of the test raises it again)."""


def _code_facts(code) -> tuple:
    """({offset of a CALL whose result is discarded: {method name: offset of the load of
    that name at the call's own source position}}, [(start, end) of every handled range])."""
    discarded: dict = {}
    try:
        instrs = list(dis.get_instructions(code))
        handled = [(e.start, e.end) for e in dis._parse_exception_table(code)]
    except Exception:  # noqa: BLE001 - bytecode this interpreter cannot read: never defer
        return {}, [(0, sys.maxsize)]
    loads: dict = {}
    for i, ins in enumerate(instrs):
        pos = ins.positions
        if pos is None or pos.lineno is None or pos.col_offset is None:
            continue
        start = (pos.lineno, pos.col_offset)
        if ins.opname in ("LOAD_METHOD", "LOAD_ATTR") and type(ins.argval) is str:
            loads.setdefault(start, {})[ins.argval] = ins.offset
        elif ins.opname == "CALL" and i + 1 < len(instrs) and instrs[i + 1].opname == "POP_TOP" and start in loads:
            discarded[ins.offset] = dict(loads[start])
    return discarded, handled


# Per call site, cached: (code object, kept alive so its id is not reused) -> verdict.
_SITES: dict = {}
_HANDLED: dict = {}
_FACTS: dict = {}


def _facts(code) -> tuple:
    known = _FACTS.get(id(code))
    if known is None or known[0] is not code:
        known = _FACTS[id(code)] = (code, _code_facts(code))
    return known[1]


def _site_verdict(code, lasti: int, name: str) -> int:
    key = (id(code), lasti, name)
    known = _SITES.get(key)
    if known is None or known[0] is not code:
        discarded, _ = _facts(code)
        load = discarded.get(lasti, {}).get(name, -1)
        if _handled(code, lasti):
            load = -1
        known = _SITES[key] = (code, load)
    return known[1]


def _handled(code, lasti: int) -> bool:
    key = (id(code), lasti)
    known = _HANDLED.get(key)
    if known is None or known[0] is not code:
        known = _HANDLED[key] = (code, any(start <= lasti < end for start, end in _facts(code)[1]))
    return known[1]


def _line_of(code, offset: int):
    for ins in dis.get_instructions(code):
        if ins.offset == offset and ins.positions is not None:
            return ins.positions.lineno
    return None


def _effect_free(conn, v, depth: int = 0) -> bool:
    t = type(v)
    if t in _IMMUTABLE:
        return True
    if t is tuple or t is frozenset:
        return depth < 20 and all(_effect_free(conn, x, depth + 1) for x in v)
    return isinstance(v, Proxy) and v._bridge_conn is conn


class Deferral:
    """Mixed into the connection."""

    def defer_calls_from(self, boundary_code) -> None:
        """Allow deferred calls in functions called from ``boundary_code`` (pytest's
        ``pytest_pyfunc_call``: the test function's caller)."""
        self._boundary = boundary_code if CAN_DEFER and self.guarded else None

    def begin_call(self) -> None:
        self._deferring = self._boundary is not None
        self._failure = None

    def end_call(self) -> None:
        """A test function returned or raised: settle its deferred calls; raise the
        failure of any of them (again, if the test caught it)."""
        self._deferring = False
        failure = None
        try:
            self.settle()
        except DeferredCallError as exc:
            failure = exc
        failure, self._failure = failure or self._failure, None
        if failure is not None:
            raise failure

    def settle(self) -> None:
        """Wait until the solution has run every deferred call sent so far."""
        if self._sites:
            self.request(["sync"])

    def try_defer(self, frame, method, args, kwargs) -> bool:
        """Queue ``method(*args, **kwargs)``, called from ``frame``, instead of running it
        now, when that cannot change what the test observes. False: call it."""
        if self._objects or method._site[0] != id(frame):
            return False
        lasti = frame.f_lasti
        if _site_verdict(frame.f_code, lasti, method._name) != method._site[1]:
            return False
        f = frame.f_back
        boundary = self._boundary
        for _ in range(_MAX_WALK):
            if f is None:
                return False
            if f.f_code is boundary:
                break
            if _handled(f.f_code, f.f_lasti):
                return False
            f = f.f_back
        else:
            return False
        for a in args:
            if type(a) not in SCALARS and not _effect_free(self, a):
                return False
        if kwargs:
            for v in kwargs.values():
                if type(v) not in SCALARS and not _effect_free(self, v):
                    return False
            encode = self.encode
            kw = [[k, encode(v)] for k, v in kwargs.items()]
        else:
            kw = []
        data = dumps(["dcallm", method._ref, method._name,
                      [a if type(a) in SCALARS else self.encode(a) for a in args], kw])
        if len(data) > MAX_MESSAGE_BYTES:
            return False  # sent the usual way, which refuses it
        outbox = self._outbox
        outbox += HEADER.pack(len(data))
        outbox += data
        sites = self._sites
        sites.append((frame.f_code, lasti, method._name))
        if len(sites) >= DEFER_SETTLE_CALLS:
            self.request(["sync"])
        elif len(outbox) >= DEFER_WRITE_BYTES:
            data = bytes(outbox)
            outbox.clear()
            self._write(data)
        return True

    def _deferred_failure(self, reply, sites) -> DeferredCallError:
        """The solution's answer that a deferred call raised, as the error the test gets."""
        if not (len(reply) == 3 and type(reply[1]) is int and 0 <= reply[1] < len(sites)):
            raise BridgeError("malformed or unexpected report of a failed deferred call")
        cause = self.decode_exception(reply[2])
        code, lasti, name = sites[reply[1]]
        where = f"{code.co_filename}:{_line_of(code, lasti)}"
        try:
            text_ = f"{type(cause).__name__}: {cause}"
        except Exception:  # noqa: BLE001
            text_ = type(cause).__name__
        failure = DeferredCallError(
            f"the solution's {name}() called at {where} raised {text_} (a call whose result the test "
            f"does not use does not wait for the solution; its error is reported at the test's next "
            f"call to the solution or when the test returns)")
        failure.__cause__ = cause
        self._failure = failure
        return failure

    def _serve_deferred(self, msg) -> None:
        """The solution's side of a deferred call: run it, answer nothing; remember the
        first that raised and skip the rest until the tests' next request."""
        index = self._deferred_seen
        self._deferred_seen += 1
        if self._deferred_error is not None:
            return
        saved_pending, saved_sent = self._pending, self._sent
        self._pending, self._sent = [], None
        try:
            if len(msg) != 5:
                raise BridgeError("malformed deferred call")
            getattr(self._local(msg[1]), text(msg[2]))(*self._args(msg[3]), **self._kwargs(msg[4]))
        except BaseException as exc:  # noqa: BLE001 - reported to the tests' next request
            self._deferred_error = [index, self.encode_exception(exc)]
        finally:
            self._pending, self._sent = saved_pending, saved_sent
