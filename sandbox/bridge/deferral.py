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

from .codec import SCALARS, _loaded, text
from .proxies import Proxy
from .sites import can_defer, handled, line_of
from .wire import HEADER, MAX_MESSAGE_BYTES, BridgeError, dumps

# Deferred calls go out in one write per this many bytes; a round trip (a "sync") settles
# them after this many calls.
DEFER_WRITE_BYTES = 64 * 1024
# A batch of plain calls ("dcalls") goes out at this many bytes (an upper bound of its
# encoded size: ~100 calls of a few small ints, far fewer bytes on the wire).
DEFER_BATCH_BYTES = 16 * 1024
DEFER_SETTLE_CALLS = 4096
# How many frames up from a call site the walk to the test function's frame looks.
_MAX_WALK = 64
# A call queued in a "dcalls" batch: plain scalar arguments, each at most this many
# characters (a str) or bits (an int); an upper bound of its encoded size is counted
# against DEFER_BATCH_BYTES, so a batch stays far under the wire's message limit.
_BATCH_ITEM_CHARS = 4096
_SMALL_INT = 1 << 62
# Argument types a deferred call may carry: values that cannot be changed in place.
_IMMUTABLE = frozenset({type(None), bool, int, float, str, bytes, complex, range})
_IMMUTABLE_CLASSES = (("decimal", "Decimal"), ("fractions", "Fraction"))


class DeferredCallError(BaseException):
    """A deferred call raised in the solution. Reported at the test's next call to the
    solution, or when the test function returns, so a later line than the call's. A
    BaseException on purpose: an ``except Exception`` or a ``pytest.raises`` around that
    later line must not swallow it (and the end of the test raises it again)."""


def _effect_free(conn, v, depth: int = 0) -> bool:
    t = type(v)
    if t in _IMMUTABLE:
        return True
    if any(t is _loaded(module, name) for module, name in _IMMUTABLE_CLASSES):
        return True
    if t is tuple or t is frozenset:
        return depth < 20 and all(_effect_free(conn, x, depth + 1) for x in v)
    return isinstance(v, Proxy) and v._bridge_conn is conn


def _batch_size(name: str, args, kwargs) -> int:
    """An upper bound of the encoded size of a call whose arguments are all plain scalars
    (a str's character is at most 12 bytes of ASCII JSON: a surrogate pair), or -1."""
    size = 32 + 12 * len(name)
    for a in args:
        t = type(a)
        if t is int:
            if not -_SMALL_INT < a < _SMALL_INT:
                if a.bit_length() > _BATCH_ITEM_CHARS:
                    return -1
                size += a.bit_length() // 3
            size += 24
        elif t is str:
            if len(a) > _BATCH_ITEM_CHARS:
                return -1
            size += 4 + 12 * len(a)
        elif a is None or t is bool or t is float:
            size += 24
        else:
            return -1
    if kwargs:
        for k, v in kwargs.items():
            extra = _batch_size(k, (v,), None)
            if extra < 0:
                return -1
            size += extra
    return size


class Deferral:
    """Mixed into the connection."""

    def defer_calls_from(self, boundary_code) -> None:
        """Allow deferred calls in functions called from ``boundary_code`` (pytest's
        ``pytest_pyfunc_call``: the test function's caller)."""
        self._boundary = boundary_code if self.guarded and can_defer() else None

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
        """Queue ``method(*args, **kwargs)``, called from ``frame`` at the discarded call
        its load was made for (checked by the caller, RemoteMethod.__call__, against the
        site noted at the load: sites.call_of_load), instead of running it now, when that
        cannot change what the test observes. False: call it."""
        if self._objects:
            return False
        f = frame.f_back
        boundary = self._boundary
        if f is None or f.f_code is not boundary:  # not called by the test function itself: walk up
            for _ in range(_MAX_WALK):
                if f is None:
                    return False
                if f.f_code is boundary:
                    break
                if handled(f.f_code, f.f_lasti):
                    return False
                f = f.f_back
            else:
                return False
        if kwargs:
            size = _batch_size(method._name, args, kwargs)
        else:  # _batch_size, inlined for the usual case (a few small ints and strs)
            size = 32 + 12 * len(method._name)
            for a in args:
                t = type(a)
                if (t is int and -_SMALL_INT < a < _SMALL_INT) or t is float or t is bool or a is None:
                    size += 24
                elif t is str and len(a) <= _BATCH_ITEM_CHARS:
                    size += 4 + 12 * len(a)
                else:
                    size = _batch_size(method._name, args, kwargs)
                    break
        if size < 0:
            # Not all plain scalars: checked one by one, and sent as a frame of its own.
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
            if self._batch:
                self._flush_batch()
            outbox = self._outbox
            outbox += HEADER.pack(len(data))
            outbox += data
            if len(outbox) >= DEFER_WRITE_BYTES and len(self._sites) + 1 < DEFER_SETTLE_CALLS:
                data = bytes(outbox)
                outbox.clear()
                self._write(data)
        else:
            # Plain scalars (the usual case): queued as they are, encoded with the queued
            # calls before and after them as one "dcalls" message.
            # A tuple, as the JSON encoder writes it: an array (the args tuple as it came).
            self._batch.append((method._ref, method._name, args,
                                [[k, v] for k, v in kwargs.items()] if kwargs else ()))
            self._batch_bytes += size
            if self._batch_bytes >= DEFER_BATCH_BYTES:
                # Out now: the solution works through this batch while the test queues the next.
                self._flush_batch()
                data = bytes(self._outbox)
                self._outbox.clear()
                self._write(data)
        sites = self._sites
        sites.append((frame.f_code, frame.f_lasti, method._name))
        if len(sites) >= DEFER_SETTLE_CALLS:
            self.request(["sync"])
        return True

    def _flush_batch(self) -> None:
        """The queued scalar calls, as one frame at the end of the outbox."""
        data = dumps(["dcalls", self._batch])
        self._batch = []
        self._batch_bytes = 0
        self._outbox += HEADER.pack(len(data))
        self._outbox += data

    def _deferred_failure(self, reply, sites) -> DeferredCallError:
        """The solution's answer that a deferred call raised, as the error the test gets."""
        if not (len(reply) == 3 and type(reply[1]) is int and 0 <= reply[1] < len(sites)):
            raise BridgeError("malformed or unexpected report of a failed deferred call")
        cause = self.decode_exception(reply[2])
        code, lasti, name = sites[reply[1]]
        where = f"{code.co_filename}:{line_of(code, lasti)}"
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

    def _serve_deferred_batch(self, msg) -> None:
        """A "dcalls" message: its calls served in order as "dcallm" ones would be."""
        calls = msg[1] if len(msg) == 2 and type(msg[1]) is list else None
        if calls is None:
            self._serve_deferred(["dcallm"])  # counted as one call that failed: malformed
            return
        saved_pending, saved_sent = self._pending, self._sent
        self._pending, self._sent = [], None
        try:
            for call in calls:
                index = self._deferred_seen
                self._deferred_seen += 1
                if self._deferred_error is not None:
                    continue
                try:
                    if type(call) is not list or len(call) != 4:
                        raise BridgeError("malformed deferred call")
                    fn = getattr(self._local(call[0]), text(call[1]))
                    if call[3]:
                        fn(*self._args(call[2]), **self._kwargs(call[3]))
                    else:
                        fn(*self._args(call[2]))
                except BaseException as exc:  # noqa: BLE001 - reported to the tests' next request
                    self._deferred_error = [index, self.encode_exception(exc)]
        finally:
            self._pending, self._sent = saved_pending, saved_sent
