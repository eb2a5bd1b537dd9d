"""The bridge between the hidden tests and the solution: two processes, plain data between.

The grader runs the hidden tests and the agent's code in two separate sandboxes (two
bubblewrap instances with their own pid namespaces and uids, see :mod:`sandbox.grader`)
joined by one Unix socket. This module is the protocol both ends speak; the grader copies
it into each sandbox as ``/grader/_rollway_bridge.py``. It uses the standard library only.

What crosses, by value (a fresh copy on the receiving side):
  None, bool, int, float, str, bytes, bytearray, list, tuple, dict, set, frozenset,
  Decimal, Fraction, complex, range; ``Counter``, ``OrderedDict`` and ``defaultdict`` as
  plain dicts. An instance of any other subclass of a builtin value type (an IntEnum, a
  namedtuple, a ``Stack(list)``) is a handle whose comparisons with plain values use its
  base value, read through the base type's own methods: an ``int`` whose ``__eq__`` always
  says True compares as the plain ``int`` it holds.

What crosses as an opaque handle: everything else (class instances, functions,
generators, classes, modules). The receiver gets a proxy whose operations (attribute
access, calls, ``len``, iteration, comparisons with other proxies, ...) are forwarded
to the owner and run there; results come back by the same rules. A handle that goes
back to its owner becomes the original object again (so ``f is f`` and callbacks work).
Exceptions cross as their builtin type, or as a local mirror class (same name, same
builtin base, so ``pytest.raises(InsufficientFunds)`` and ``isinstance(e, ValueError)``
work), with args, message and public attributes by value.

Why this cannot be gamed from the solution side:
- the solution process never holds a test object except what a test passed to it on
  purpose (arguments, callbacks); those are handles, and the test side refuses them any
  private attribute (``__globals__``, ``__code__``, ``__closure__``, frames: nothing
  starting with ``_`` except ``__name__``/``__qualname__``/``__module__``);
- comparisons between a solution object and a test's plain value are never forwarded:
  the solution never sees an expected value, and ``proxy == 5`` is ``False``;
- a remote module is offered to the tests only for top-level names the workspace
  itself defines (the grader passes the list): pytest's own optional imports never
  reach solution code;
- everything the solution sends is decoded strictly (tags, types, known handle ids);
  anything else is a :class:`BridgeError` in the test that received it.

Known differences from running in one process (documented in docs/sandbox.md): a
mutable argument (list, dict, set, bytearray) is copied, and mutations the callee makes
to it are written back into the caller's object when the call returns (so in-place
algorithms work), but aliasing across calls is not kept; comparisons between a solution
object and a plain value are False (except for builtin subclasses, by base value); a
method called for its effect alone may run later than its line and report its error at
a later line of the same test (deferred calls, see Connection.try_defer).
"""

from __future__ import annotations

import base64
import builtins
import collections
import dis
import importlib
import importlib.abc
import importlib.util
import json
import operator
import os
import socket
import struct
import sys
import types
from decimal import Decimal
from fractions import Fraction

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Handle descriptions nest (an exception class's bases); values do not (postfix form).
MAX_DEPTH = 50
MAX_ITEMS = 5_000_000
_HEADER = struct.Struct("<I")
_READ_SIZE = 64 * 1024

BUILTIN_EXCEPTIONS = {
    name: obj for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}
# Exceptions that stop the receiving interpreter or pytest session: from the solution
# side they arrive as RuntimeError, so solution code cannot end the test run early.
_STOPPERS = (SystemExit, KeyboardInterrupt, GeneratorExit)
# Attributes of test-side objects the solution side may read (the rest of the private
# namespace leads to globals, code objects, closures and frames).
_PUBLIC_DUNDERS = frozenset({"__name__", "__qualname__", "__module__"})

_VALUE_BASES = (bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset)
# Standard-library subclasses of builtin containers that honest code returns all the time:
# sent by value as their base type.
_STDLIB_CONTAINERS = frozenset({collections.Counter, collections.OrderedDict, collections.defaultdict})

_OPS = {
    "len": len, "iter": iter, "next": next, "reversed": reversed, "str": str, "repr": repr,
    "hash": hash, "bool": bool, "format": format, "int": int, "float": float, "index": operator.index,
    "contains": lambda a, b: b in a, "getitem": operator.getitem, "setitem": operator.setitem,
    "delitem": operator.delitem, "eq": operator.eq, "ne": operator.ne, "lt": operator.lt,
    "le": operator.le, "gt": operator.gt, "ge": operator.ge, "add": operator.add, "sub": operator.sub,
    "mul": operator.mul, "truediv": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod,
    "pow": operator.pow, "matmul": operator.matmul, "and": operator.and_, "or": operator.or_,
    "xor": operator.xor, "lshift": operator.lshift, "rshift": operator.rshift, "neg": operator.neg,
    "pos": operator.pos, "abs": abs, "invert": operator.invert, "divmod": divmod,
    "enter": lambda o: o.__enter__(), "exit": lambda o, *a: o.__exit__(*a),
    "isinstance": isinstance, "issubclass": issubclass, "round": round, "basevalue": lambda v: _base_value(v),
}
_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
# Values that are their own encoding (JSON scalars, exact types): the hot paths test this
# set inline instead of calling encode/decode once per argument.
_SCALARS = frozenset({type(None), bool, int, float, str})
# Argument types a deferred call may carry: values that cannot be changed in place (no
# write-back to wait for) and that never make this side export a handle.
_IMMUTABLE = frozenset({type(None), bool, int, float, str, bytes, complex, Decimal, Fraction, range})
# Deferred calls go out in one write per this many bytes, without waiting (the solution
# runs them while the tests build the next ones); a round trip (a "sync") settles them
# after this many calls: bounds how far the tests run ahead of a failed call and what
# either side holds meanwhile.
DEFER_WRITE_BYTES = 64 * 1024
DEFER_SETTLE_CALLS = 4096
# How many frames up from a call site the walk to the test function's frame looks.
_MAX_WALK = 64
# Deferral needs the exception table and source positions of CPython 3.11+ bytecode.
_CAN_DEFER = sys.version_info >= (3, 11) and hasattr(dis, "_parse_exception_table")


class _Emit:
    """Encoder stack marker: emit this instruction once the children are out."""

    __slots__ = ("op",)

    def __init__(self, op) -> None:
        self.op = op


class BridgeError(RuntimeError):
    """The other side broke the protocol, refused an operation, or went away."""


class _Stop(Exception):
    """The peer closed the connection."""


class DeferredCallError(BaseException):
    """A deferred call (see :meth:`Connection.try_defer`) raised in the solution. Reported
    at the test's next call to the solution, or when the test function returns, so a
    later line than the call's. A BaseException on purpose: an ``except Exception`` or a
    ``pytest.raises`` around that later line must not swallow it (and the end of the test
    raises it again if something did): the test fails, as it would have at the call."""


def _code_facts(code) -> tuple[dict[int, dict[str, int]], list[tuple[int, int]]]:
    """What the bytecode of a test's code object says about its call sites:
    ({offset of a CALL whose result is discarded (the next instruction is POP_TOP):
    {method name: offset of the LOAD_METHOD/LOAD_ATTR of that name at the call's own
    source position, the latest before the call}}, [(start, end) of every range an
    exception handler covers])."""
    discarded: dict[int, dict[str, int]] = {}
    try:
        instrs = list(dis.get_instructions(code))
        handled = [(e.start, e.end) for e in dis._parse_exception_table(code)]
    except Exception:  # noqa: BLE001 - bytecode this interpreter cannot read: never defer
        return {}, [(0, sys.maxsize)]
    loads: dict[tuple, dict[str, int]] = {}  # source start -> {name: latest load offset}
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
_SITES: dict[tuple[int, int, str], tuple[object, int]] = {}
_HANDLED: dict[tuple[int, int], tuple[object, bool]] = {}
_FACTS: dict[int, tuple[object, tuple]] = {}


def _facts(code) -> tuple:
    known = _FACTS.get(id(code))
    if known is None or known[0] is not code:
        known = _FACTS[id(code)] = (code, _code_facts(code))
    return known[1]


def _site_verdict(code, lasti: int, name: str) -> int:
    """Offset of the instruction that loaded the method ``name`` called by the CALL at
    ``lasti``, when that call discards its result and no handler covers it; else -1."""
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
    """Whether an exception handler of ``code`` covers the instruction at ``lasti``."""
    key = (id(code), lasti)
    known = _HANDLED.get(key)
    if known is None or known[0] is not code:
        known = _HANDLED[key] = (code, any(start <= lasti < end for start, end in _facts(code)[1]))
    return known[1]


def _line_of(code, offset: int) -> int | None:
    for ins in dis.get_instructions(code):
        if ins.offset == offset and ins.positions is not None:
            return ins.positions.lineno
    return None


def _effect_free(conn, v, depth: int = 0) -> bool:
    """A value that crosses to ``conn``'s peer without this side exporting a handle or
    waiting for a write-back: immutable plain data, or the peer's own objects."""
    t = type(v)
    if t in _IMMUTABLE:
        return True
    if t is tuple or t is frozenset:
        return depth < 20 and all(_effect_free(conn, x, depth + 1) for x in v)
    return isinstance(v, _Proxy) and v._bridge_conn is conn


# The wire format is compact JSON (NaN and infinities allowed), ASCII only. It is written
# and read through the json module's C encoder and scanner, built once: json.dumps and
# json.loads rebuild an encoder, detect the encoding and wrap the C code in several Python
# calls per message, which was about 10 of the ~15 us of Python each side spent per bridge
# call (profiled; docs/sandbox.md). Same format, same strictness.
_c_encoder = getattr(json.encoder, "c_make_encoder", None)


def _unencodable(o):
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


if _c_encoder is not None:
    # (markers, default, encoder, indent, key_separator, item_separator, sort_keys,
    # skipkeys, allow_nan). No circular-reference markers: messages are built here and
    # never cyclic (a cycle would still end in RecursionError, not a hang).
    _encode_chunks = _c_encoder(None, _unencodable, json.encoder.encode_basestring_ascii, None,
                                ":", ",", False, False, True)

    def _dumps(msg) -> bytes:
        return "".join(_encode_chunks(msg, 0)).encode("ascii")
else:  # an interpreter without the _json accelerator
    _encoder = json.JSONEncoder(separators=(",", ":"), allow_nan=True, check_circular=False)

    def _dumps(msg) -> bytes:
        return _encoder.encode(msg).encode("ascii")

# The C scanner when _json is there (JSONDecoder picks it): strict strings, NaN and
# infinities accepted, as json.loads.
_scan_once = json.decoder.JSONDecoder().scan_once


def _loads(payload: bytes):
    """One message, decoded strictly: UTF-8, one JSON value and nothing after it, a list
    whose first item is a string."""
    try:
        text = payload.decode("utf-8")
        msg, end = _scan_once(text, 0)
    except StopIteration:
        raise BridgeError("undecodable message on the grading bridge") from None
    except (ValueError, RecursionError) as exc:
        raise BridgeError(f"undecodable message on the grading bridge: {exc}") from None
    if end != len(text):
        raise BridgeError("undecodable message on the grading bridge: data after the message")
    if type(msg) is not list or not msg or type(msg[0]) is not str:
        raise BridgeError("malformed message on the grading bridge")
    return msg


def _base_value(v):
    """The plain value of an instance of a subclass of a builtin value type, read
    through the base type's own methods (never the subclass's overrides)."""
    if isinstance(v, bool):
        return bool(int.__int__(v))
    if isinstance(v, int):
        return int.__int__(v)
    if isinstance(v, float):
        return float.__float__(v)
    if isinstance(v, complex):
        return complex(float.__float__(complex.real.__get__(v)), float.__float__(complex.imag.__get__(v)))
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, bytes):
        return bytes.__bytes__(v) if hasattr(bytes, "__bytes__") else bytes(memoryview(v))
    if isinstance(v, bytearray):
        return bytearray(memoryview(v))
    if isinstance(v, list):
        return list(list.__iter__(v))
    if isinstance(v, tuple):
        return tuple(tuple.__iter__(v))
    if isinstance(v, dict):
        return {k: val for k, val in dict.items(v)}
    if isinstance(v, frozenset):
        return frozenset(frozenset.__iter__(v))
    if isinstance(v, set):
        return set(set.__iter__(v))
    raise TypeError(type(v))


class Connection:
    """One end of the bridge. ``role`` is "tests" or "solution"; the tests' end guards
    what it exports (see module docs) and answers no imports."""

    def __init__(self, sock: socket.socket, role: str, *, cpu: int | None = None, pin_after: int = 0) -> None:
        if role not in ("tests", "solution"):
            raise ValueError(role)
        # After ``pin_after`` messages sent, this end pins itself to ``cpu`` (the other end
        # does the same after as many): a busy bridge is a ping-pong, cheapest on one CPU.
        self._cpu = cpu
        self._sends = 0
        self._pin_at = pin_after if cpu is not None and pin_after > 0 else -1
        self.sock = sock
        self.role = role
        self.guarded = role == "tests"
        self._objects: dict[int, object] = {}  # handle id -> object this side exports
        self._ids: dict[int, int] = {}  # id(object) -> handle id
        self._proxies: dict[int, object] = {}  # peer handle id -> local proxy (interned)
        self._methods: dict[int, frozenset] = {}  # peer class handle id -> plain method names
        self._proxy_classes: dict[tuple[int, bool], type | None] = {}  # see _proxy_class
        self._described: set[int] = set()
        self._next = 1
        self.closed = False
        # Mutable top-level arguments of the request being built (slot -> object), and the
        # ones received by the call being served (slot, object, encoding before the call).
        self._sent: dict[int, object] | None = None
        self._pending: list = []
        self._buf = bytearray()
        # Deferred calls, tests' side: the frame below the test function's (pytest's
        # pytest_pyfunc_call), whether a test function is running, the encoded calls not
        # yet sent, the call sites of those not yet settled by a round trip, and a failure
        # reported during the running test.
        self._boundary = None
        self._deferring = False
        self._outbox = bytearray()
        self._sites: list[tuple] = []
        self._failure: DeferredCallError | None = None
        # Solution's side: deferred calls received since the last ordinary request, and
        # the first of them that raised ([index, encoded exception]).
        self._deferred_seen = 0
        self._deferred_error: list | None = None

    # --- framing ----------------------------------------------------------------

    def _send(self, msg) -> None:
        self._sends += 1
        if self._sends == self._pin_at:
            self._pin()
        data = _dumps(msg)
        if len(data) > MAX_MESSAGE_BYTES:
            raise BridgeError(f"message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
        frame = _HEADER.pack(len(data)) + data
        if self._outbox:
            # Deferred calls go out ahead of the message, in the same write.
            frame = bytes(self._outbox) + frame
            self._outbox.clear()
        try:
            # Header and body in one write: one syscall, and the peer's one recv sees both.
            self.sock.sendall(frame)
        except OSError as exc:
            self.closed = True
            raise BridgeError(f"the other side of the grading bridge went away ({exc})") from None

    def _pin(self) -> None:
        try:
            os.sched_setaffinity(0, {self._cpu})
        except (AttributeError, OSError, TypeError, ValueError, OverflowError):
            pass  # a CPU outside this sandbox's set, say: calls stay correct, only slower

    def _fill(self, n: int) -> None:
        """Read until the buffer holds ``n`` bytes."""
        while len(self._buf) < n:
            self._buf += self._read(max(_READ_SIZE, n - len(self._buf)))

    def _read(self, size: int) -> bytes:
        """One recv: the bytes, ``_Stop`` when the peer closed, BridgeError when it broke."""
        try:
            data = self.sock.recv(size)
        except OSError as exc:
            self.closed = True
            raise BridgeError(f"the other side of the grading bridge went away ({exc})") from None
        if not data:
            self.closed = True
            raise _Stop()
        return data

    def _recv(self):
        if not self._buf:
            # The usual case in a round trip: nothing buffered, and one recv brings exactly
            # one whole message (header and body, sent in one write). Parsed straight from
            # the received bytes: no copy into and out of the buffer.
            data = self._read(_READ_SIZE)
            if len(data) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(data, 0)
                if size > MAX_MESSAGE_BYTES:
                    raise BridgeError(f"message of {size} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
                if size + _HEADER.size == len(data):
                    return _loads(data[_HEADER.size:])
            self._buf += data
        self._fill(_HEADER.size)
        (size,) = _HEADER.unpack_from(self._buf, 0)
        if size > MAX_MESSAGE_BYTES:
            raise BridgeError(f"message of {size} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
        end = _HEADER.size + size
        self._fill(end)
        payload = bytes(self._buf[_HEADER.size:end])
        del self._buf[:end]
        return _loads(payload)

    # --- requests -----------------------------------------------------------------

    def rpc(self, *head, args=None, kwargs=None):
        """Build and send one request; its mutable arguments may be written back."""
        saved = self._sent
        self._sent = {}
        try:
            msg = list(head)
            if args is not None:
                encode = self.encode
                msg.append([a if type(a) in _SCALARS else encode(a) for a in args])
            if kwargs is not None:
                msg.append([[k, self.encode(v)] for k, v in kwargs.items()] if kwargs else [])
            return self.request(msg)
        finally:
            self._sent = saved

    def request(self, msg):
        """Send one request; serve the peer's nested requests (callbacks) until its answer."""
        if self.closed:
            raise BridgeError("the solution process is gone (the grading bridge is closed)")
        sites = self._sites
        if sites:
            self._sites = []  # settled by this request's answer
        self._send(msg)
        while True:
            try:
                reply = self._recv()
            except _Stop:
                raise BridgeError("the solution process exited during a call") from None
            kind = reply[0]
            if kind == "ok" and len(reply) == 3:
                if reply[2] is not None:
                    self._write_back(reply[2])
                value = reply[1]
                return value if type(value) in _SCALARS else self.decode(value)
            if kind == "err" and len(reply) == 3:
                self._write_back(reply[2])
                raise self.decode_exception(reply[1])
            if kind == "dfail":
                raise self._deferred_failure(reply, sites)
            self._serve_one(reply)

    def serve_forever(self) -> None:
        """The solution side's main loop: answer requests until the tests hang up."""
        while True:
            try:
                msg = self._recv()
            except _Stop:
                return
            self._serve_one(msg)

    def _serve_one(self, msg) -> None:
        if not self.guarded:
            if msg[0] == "dcallm":
                self._serve_deferred(msg)
                return
            self._deferred_seen = 0
            if self._deferred_error is not None:
                # A deferred call raised: this request is not run, its answer is the failure
                # (the tests stop there, as they would have at the failed call).
                failure, self._deferred_error = self._deferred_error, None
                self._send(["dfail", *failure])
                return
        saved_pending, saved_sent = self._pending, self._sent
        self._pending, self._sent = [], None
        try:
            try:
                result = self._dispatch(msg)
                out = ["ok", result if type(result) in _SCALARS else self.encode(result), None]
            except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
                out = ["err", self.encode_exception(exc), None]
            if self._pending:
                out[2] = self._collect_writebacks(self._pending)
        finally:
            self._pending, self._sent = saved_pending, saved_sent
        self._send(out)

    def _dispatch(self, msg):
        kind = msg[0]
        # Most frequent first: method calls, calls, operations, attributes.
        if kind == "callm":
            name = _text(msg[2])
            self._check_name(name)
            fn = getattr(self._local(msg[1]), name)
            return fn(*self._args(msg[3]), **self._kwargs(msg[4]))
        if kind == "call":
            fn = self._local(msg[1])
            return fn(*self._args(msg[2]), **self._kwargs(msg[3]))
        if kind == "op":
            name = _text(msg[1])
            fn = _OPS.get(name)
            if fn is None:
                raise BridgeError(f"unknown operation {name!r}")
            return fn(*self._args(msg[2]))
        if kind == "getattr":
            obj, name = self._local(msg[1]), _text(msg[2])
            self._check_name(name)
            return getattr(obj, name)
        if kind == "import":
            if self.guarded:
                raise BridgeError("the tests' side answers no imports")
            return importlib.import_module(_text(msg[1]))
        if kind == "setattr":
            if self.guarded:
                raise BridgeError("test objects are read-only to the solution")
            setattr(self._local(msg[1]), _text(msg[2]), self._args(msg[3])[0])
            return None
        if kind == "delattr":
            if self.guarded:
                raise BridgeError("test objects are read-only to the solution")
            delattr(self._local(msg[1]), _text(msg[2]))
            return None
        if kind == "methods":
            cls = self._local(msg[1])
            return sorted(_plain_methods(cls)) if isinstance(cls, type) else []
        if kind == "sync":
            return None
        raise BridgeError(f"unknown request {kind!r}")

    # --- deferred calls ------------------------------------------------------------------
    #
    # A test that calls a solution method for its effect alone (``cache.put(k, v)`` as a
    # statement) does not need to wait for it: the call is queued, sent with later ones in
    # one write, and answered by no message, so a loop of such calls costs no round trip
    # each (the cost of lru_cache's 200k calls was almost all round-trip wake-ups).
    # What stays exactly as in a synchronous call:
    # - the solution runs the same calls in the same order and sees the same values (the
    #   call message is the same, only its kind says "no answer");
    # - a call raises at most once, and a raised call fails the test: the solution skips
    #   every later deferred call and answers the tests' next request (not run) with the
    #   failure, which the tests raise as DeferredCallError; the end of each test function
    #   settles what is left. So only calls whose exception would have failed the test
    #   anyway are deferred: no try/except/with (no handler at all) may cover the call in
    #   any frame between it and the test function;
    # - the test never reads what the call changed before the solution has run it: the
    #   only way to observe solution state is another request, which goes out after the
    #   queued calls on the same stream; and a deferred call cannot reach back into the
    #   tests (no callback, no write-back): this side has exported no object at all, and
    #   the arguments are immutable values or the solution's own objects.
    # - the clock: the tests' entry script settles the queue before the tests read a clock
    #   or sleep through the time module (bridge_tests.py), so a call made before
    #   ``time.sleep`` runs before it, and one made before ``time.time()`` ran by then.
    # What differs: an error is reported at a later line of the same test, after the test
    # ran its own code past the call (never more solution code); time read another way
    # (datetime.now, a timeout in threading) may see a queued call not yet run; and the
    # solution can tell from timing that nobody waits for its answer: it learns that the
    # result is unused, which the tests never look at.

    def defer_calls_from(self, boundary_code) -> None:
        """Allow deferred calls in functions called from ``boundary_code`` (pytest's
        ``pytest_pyfunc_call``: the test function's caller)."""
        self._boundary = boundary_code if _CAN_DEFER and self.guarded else None

    def begin_call(self) -> None:
        """A test function starts."""
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
        """Wait until the solution has run every deferred call sent so far (one round
        trip); raise DeferredCallError if one of them raised."""
        if self._sites:
            self.request(["sync"])

    def try_defer(self, frame, method, args, kwargs) -> bool:
        """Queue ``method(*args, **kwargs)``, called from ``frame``, instead of running it
        now, when that cannot change what the test observes (see above). False: call it."""
        if self._objects or method._site[0] != id(frame):
            return False
        lasti = frame.f_lasti
        if _site_verdict(frame.f_code, lasti, method._name) != method._site[1]:
            return False
        # No handler in any frame up to the test function's.
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
            if type(a) not in _SCALARS and not _effect_free(self, a):
                return False
        if kwargs:
            for v in kwargs.values():
                if type(v) not in _SCALARS and not _effect_free(self, v):
                    return False
            encode = self.encode
            kw = [[k, encode(v)] for k, v in kwargs.items()]
        else:
            kw = []
        data = _dumps(["dcallm", method._ref, method._name,
                       [a if type(a) in _SCALARS else self.encode(a) for a in args], kw])
        if len(data) > MAX_MESSAGE_BYTES:
            return False  # sent the usual way, which refuses it
        outbox = self._outbox
        outbox += _HEADER.pack(len(data))
        outbox += data
        sites = self._sites
        sites.append((frame.f_code, lasti, method._name))
        if len(sites) >= DEFER_SETTLE_CALLS:
            self.request(["sync"])
        elif len(outbox) >= DEFER_WRITE_BYTES:
            self._write_outbox()
        return True

    def _write_outbox(self) -> None:
        data = bytes(self._outbox)
        self._outbox.clear()
        try:
            self.sock.sendall(data)
        except OSError as exc:
            self.closed = True
            raise BridgeError(f"the other side of the grading bridge went away ({exc})") from None

    def _deferred_failure(self, reply, sites) -> DeferredCallError:
        """The solution's answer that a deferred call raised, as the error the test gets."""
        if not (len(reply) == 3 and type(reply[1]) is int and 0 <= reply[1] < len(sites)):
            raise BridgeError("malformed or unexpected report of a failed deferred call")
        cause = self.decode_exception(reply[2])
        code, lasti, name = sites[reply[1]]
        where = f"{code.co_filename}:{_line_of(code, lasti)}"
        try:
            text = f"{type(cause).__name__}: {cause}"
        except Exception:  # noqa: BLE001
            text = type(cause).__name__
        failure = DeferredCallError(
            f"the solution's {name}() called at {where} raised {text} (a call whose result the test "
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
            name = _text(msg[2])
            self._check_name(name)
            getattr(self._local(msg[1]), name)(*self._args(msg[3]), **self._kwargs(msg[4]))
        except BaseException as exc:  # noqa: BLE001 - reported to the tests' next request
            self._deferred_error = [index, self.encode_exception(exc)]
        finally:
            self._pending, self._sent = saved_pending, saved_sent

    def _check_name(self, name: str) -> None:
        if self.guarded and name.startswith("_") and name not in _PUBLIC_DUNDERS:
            raise AttributeError(f"{name!r}: private attributes of test objects are not reachable from the solution")

    def _local(self, ref):
        """An object this side exports, named by the peer as a handle id."""
        if type(ref) is not int or ref not in self._objects:
            raise BridgeError(f"unknown handle {ref!r}")
        return self._objects[ref]

    def _args(self, raw) -> list:
        if type(raw) is not list:
            raise BridgeError("malformed arguments")
        decode = self.decode
        return [a if type(a) in _SCALARS else decode(a, track=True) for a in raw]

    def _kwargs(self, raw) -> dict:
        if type(raw) is not list:
            raise BridgeError("malformed keyword arguments")
        out = {}
        if not raw:
            return out
        for item in raw:
            if not (isinstance(item, list) and len(item) == 2):
                raise BridgeError("malformed keyword arguments")
            out[_text(item[0])] = self.decode(item[1], track=True)
        return out

    # --- write-back of mutable arguments ------------------------------------------------

    def _collect_writebacks(self, pending) -> list | None:
        """After a call: the new contents of every mutable argument that changed."""
        out = []
        for slot, obj, before in pending:
            try:
                now = self.encode(obj)
            except Exception:  # noqa: BLE001 - unencodable now: leave the caller's copy
                continue
            if now != before:
                out.append([slot, now])
        return out or None

    def _write_back(self, raw) -> None:
        if raw is None:
            return
        if not isinstance(raw, list):
            raise BridgeError("malformed write-back")
        for item in raw:
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int):
                raise BridgeError("malformed write-back")
            target = (self._sent or {}).get(item[0])
            if target is None:
                raise BridgeError(f"write-back to an unknown argument {item[0]!r}")
            value = self.decode(item[1])
            if type(value) is not type(target):
                raise BridgeError("write-back changes the type of an argument")
            if isinstance(target, (list, bytearray)):
                target[:] = value
            else:
                target.clear()
                target.update(value)

    # --- values ---------------------------------------------------------------------

    def encode(self, v, depth: int = 0):
        """A value as the peer will rebuild it: a JSON scalar, or ``["V", ops]`` with the
        value in postfix form (scalars push themselves, lists are instructions). Flat, so
        nesting depth costs no recursion on either side (a 5000-deep list crosses)."""
        t = type(v)
        if v is None or t is bool or t is int or t is str or t is float:
            return v
        if depth > MAX_DEPTH:
            raise BridgeError("value nested too deeply to send")
        out: list = []
        stack: list = [v]
        top = True
        while stack:
            x = stack.pop()
            t = type(x)
            if x is None or t is bool or t is int or t is str or t is float:
                out.append(x)
            elif t is _Emit:
                out.append(x.op)
            else:
                self._encode_node(x, t, out, stack, top, depth)
            top = False
            if len(out) > MAX_ITEMS:
                raise BridgeError(f"value too large to send (over {MAX_ITEMS} items; a cycle?)")
        return ["V", out]

    def _encode_node(self, v, t, out, stack, top, depth) -> None:
        slot = None
        if top and self._sent is not None and (t is list or t is bytearray or t is dict or t is set):
            slot = len(self._sent) + 1
            self._sent[slot] = v
        if t is list or t is tuple or t is set or t is frozenset:
            items = list(v)
            tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[t]
            stack.append(_Emit([tag, len(items), slot]))
            stack.extend(reversed(items))
        elif t is dict:
            stack.append(_Emit(["d", len(v), slot]))
            pairs = []
            for k, x in v.items():
                pairs += (k, x)
            stack.extend(reversed(pairs))
        elif t is bytes:
            out.append(["b", base64.b64encode(v).decode()])
        elif t is bytearray:
            out.append(["y", base64.b64encode(bytes(v)).decode(), slot])
        elif t is complex:
            out.append(["c", v.real, v.imag])
        elif t is Decimal:
            out.append(["D", str(v)])
        elif t is Fraction:
            out.append(["Q", v.numerator, v.denominator])
        elif t is range:
            out.append(["R", v.start, v.stop, v.step])
        elif t in _STDLIB_CONTAINERS:
            stack.append(_base_value(v))
        elif isinstance(v, _Proxy) and v._bridge_conn is self:
            out.append(["r", v._bridge_ref])
        elif isinstance(v, _RemoteMethod) and v._conn is self:
            out.append(["m", v._ref, v._name])
        elif isinstance(v, type) and v.__dict__.get("_bridge_conn") is self:  # a mirror class
            out.append(["r", v.__dict__["_bridge_ref"]])
        elif isinstance(v, BaseException) and getattr(v, "__dict__", {}).get("_bridge_conn") is self:
            out.append(["r", v.__dict__["_bridge_ref"]])
        else:
            out.append(["h", self._export(v), self._describe(v, depth + 1)])

    def _export(self, v) -> int:
        key = id(v)
        ref = self._ids.get(key)
        if ref is None or self._objects.get(ref) is not v:
            ref = self._next
            self._next += 1
            self._objects[ref] = v
            self._ids[key] = ref
        return ref

    def _describe(self, v, depth: int):
        if isinstance(v, type) and issubclass(v, BaseException):
            bases = [self._encode_exc_class(b, depth) for b in v.__bases__ if issubclass(b, BaseException)]
            return ["exc", v.__name__, v.__qualname__, str(getattr(v, "__module__", ""))[:200], bases]
        if isinstance(v, type):
            return ["cls", v.__name__, v.__qualname__]
        if isinstance(v, types.ModuleType):
            file = getattr(v, "__file__", None)
            return ["mod", v.__name__, file if isinstance(file, str) else None, hasattr(v, "__path__")]
        cls = type(v)
        methods = None
        cls_ref = self._export(cls)
        if cls_ref not in self._described:
            self._described.add(cls_ref)
            methods = sorted(_plain_methods(cls))
        return ["obj", cls_ref, methods, callable(v), isinstance(v, _VALUE_BASES)]

    def _encode_exc_class(self, cls, depth):
        if BUILTIN_EXCEPTIONS.get(cls.__name__) is cls:
            return ["B", cls.__name__]
        return self.encode(cls, depth)

    def decode(self, raw, depth: int = 0, *, track: bool = False):
        if raw is None or isinstance(raw, (bool, int, float, str)):
            return raw
        if depth > MAX_DEPTH or not (isinstance(raw, list) and len(raw) == 2 and raw[0] == "V"
                                     and isinstance(raw[1], list) and raw[1]):
            raise BridgeError("malformed value on the grading bridge")
        stack: list = []
        op = None
        for op in raw[1]:
            if op is None or isinstance(op, (bool, int, float, str)):
                stack.append(op)
                continue
            if not (isinstance(op, list) and op and isinstance(op[0], str)):
                raise BridgeError("malformed value on the grading bridge")
            try:
                stack.append(self._decode_op(op, stack, depth + 1))
            except BridgeError:
                raise
            except (TypeError, ValueError, IndexError, KeyError, ArithmeticError) as exc:
                raise BridgeError(f"malformed {op[0]!r} value on the grading bridge: {exc}") from None
        if len(stack) != 1:
            raise BridgeError("malformed value on the grading bridge (stack)")
        value = stack[0]
        if track and isinstance(op, list) and op[0] in ("l", "d", "s", "y") and type(op[-1]) is int:
            self._pending.append((op[-1], value, self.encode_plain(value)))
        return value

    def _decode_op(self, op, stack, depth):
        tag = op[0]
        if tag in ("l", "t", "s", "f", "d"):
            n = _integer(op[1])
            take = 2 * n if tag == "d" else n
            if not 0 <= take <= len(stack):
                raise BridgeError("malformed container on the grading bridge")
            items = stack[len(stack) - take:] if take else []
            del stack[len(stack) - take:]
            if tag == "l":
                return items
            if tag == "t":
                return tuple(items)
            if tag == "s":
                return set(items)
            if tag == "f":
                return frozenset(items)
            return {items[i]: items[i + 1] for i in range(0, take, 2)}
        if tag == "b":
            return base64.b64decode(_text(op[1]), validate=True)
        if tag == "y":
            return bytearray(base64.b64decode(_text(op[1]), validate=True))
        if tag == "c":
            return complex(_number(op[1]), _number(op[2]))
        if tag == "D":
            return Decimal(_text(op[1]))
        if tag == "Q":
            return Fraction(_integer(op[1]), _integer(op[2]))
        if tag == "R":
            return range(_integer(op[1]), _integer(op[2]), _integer(op[3]))
        if tag == "r":
            return self._local(op[1])
        if tag == "m":
            return getattr(self._local(op[1]), self._checked_name(_text(op[2])))
        if tag == "h":
            return self._proxy(op[1], op[2], depth)
        raise BridgeError(f"unknown value tag {tag!r} on the grading bridge")

    def encode_plain(self, v):
        """Encoding used to notice changes to a mutable argument (no slot tracking)."""
        saved = self._sent
        self._sent = None
        try:
            return self.encode(v)
        finally:
            self._sent = saved

    def _checked_name(self, name: str) -> str:
        self._check_name(name)
        return name

    def _proxy(self, ref, desc, depth):
        if type(ref) is not int:
            raise BridgeError("malformed handle")
        known = self._proxies.get(ref)
        if known is not None:
            return known
        if not isinstance(desc, list) or not desc:
            raise BridgeError("malformed handle description")
        kind = desc[0]
        if kind == "exc":
            proxy = self._mirror_exception_class(ref, desc, depth)
        elif kind == "mod":
            proxy = _RemoteModule(self, ref, _text(desc[1]), desc[2], bool(desc[3]))
        elif kind == "cls":
            proxy = _Proxy._make(self, ref, f"class {_text(desc[2])}", callable_=True)
        elif kind == "obj":
            cls_ref, methods = desc[1], desc[2]
            if type(cls_ref) is not int:
                raise BridgeError("malformed object description")
            if methods is not None:
                if not isinstance(methods, list) or not all(isinstance(m, str) for m in methods):
                    raise BridgeError("malformed method list")
                self._methods.setdefault(cls_ref, frozenset(methods))
            proxy = _Proxy._make(self, ref, "object", callable_=bool(desc[3]), cls_ref=cls_ref,
                                 klass=self._proxy_class(cls_ref, bool(desc[3])),
                                 value_like=len(desc) > 4 and desc[4] is True)
        else:
            raise BridgeError(f"unknown handle kind {kind!r}")
        self._proxies[ref] = proxy
        return proxy

    def _proxy_class(self, cls_ref: int, callable_: bool) -> type | None:
        """The proxy type for instances of the peer's class ``cls_ref``: its plain methods
        as class attributes (_MethodSlot), so ``obj.method`` skips the failed lookup that
        reaching ``__getattr__`` costs. None: the shared proxy type."""
        key = (cls_ref, callable_)
        if key not in self._proxy_classes:
            base = _CallableProxy if callable_ else _Proxy
            names = [m for m in self._methods.get(cls_ref, ()) if not m.startswith("_") and not hasattr(base, m)]
            ns: dict = {"__slots__": ()}
            ns.update({m: _MethodSlot(m) for m in names})
            self._proxy_classes[key] = type(base.__name__, (base,), ns) if names else None
        return self._proxy_classes[key]

    def _mirror_exception_class(self, ref, desc, depth):
        name, qualname, module, bases_raw = _text(desc[1]), _text(desc[2]), _text(desc[3]), desc[4]
        bases = []
        for b in bases_raw:
            if isinstance(b, list) and b[:1] == ["B"]:
                base = BUILTIN_EXCEPTIONS.get(_text(b[1]))
                if base is None:
                    raise BridgeError(f"unknown builtin exception {b[1]!r}")
            else:
                base = self.decode(b, depth)
                if not (isinstance(base, type) and issubclass(base, BaseException)):
                    raise BridgeError("an exception class must derive from exceptions")
            if self.guarded and issubclass(base, _STOPPERS):
                base = RuntimeError
            bases.append(base)
        ns = {"__module__": module, "__qualname__": qualname, "_bridge_conn": self, "_bridge_ref": ref,
              "__str__": _mirror_str, "__repr__": _mirror_repr}
        try:
            cls = type(name, tuple(dict.fromkeys(bases)) or (Exception,), ns)
        except TypeError:
            cls = type(name, (Exception,), ns)
        return cls

    # --- exceptions -------------------------------------------------------------------

    def encode_exception(self, exc: BaseException):
        if getattr(exc, "__dict__", {}).get("_bridge_conn") is self:
            return ["r", exc.__dict__["_bridge_ref"]]
        cls = type(exc)
        try:
            cls_enc = self._encode_exc_class(cls, 0)
        except Exception:  # noqa: BLE001
            cls_enc = ["B", "RuntimeError"]
        if self.guarded:
            # An exception raised by test code (a failing assert in a callback, say) goes
            # to the solution as its class alone: its message could hold expected values.
            # Raised back, it is the original object again.
            return ["x", cls_enc, self.encode(()), "", [], self._export(exc)]
        try:
            args = self.encode(tuple(exc.args))
        except Exception:  # noqa: BLE001
            args = self.encode(tuple(str(a) for a in exc.args))
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001
            message = f"<{cls.__name__}: str() failed>"
        attrs = []
        for key, value in list(getattr(exc, "__dict__", {}).items()):
            if isinstance(key, str) and not key.startswith("_"):
                try:
                    attrs.append([key, self.encode(value)])
                except Exception:  # noqa: BLE001
                    pass
        return ["x", cls_enc, args, message, attrs, self._export(exc)]

    def decode_exception(self, raw) -> BaseException:
        if isinstance(raw, list) and raw[:1] == ["r"]:
            obj = self._local(raw[1])
            if not isinstance(obj, BaseException):
                raise BridgeError("the peer raised something that is not an exception")
            return obj
        if not (isinstance(raw, list) and len(raw) == 6 and raw[0] == "x"):
            raise BridgeError("malformed exception on the grading bridge")
        cls_raw, args, message, attrs, ref = raw[1], raw[2], _text(raw[3]), raw[4], raw[5]
        if isinstance(cls_raw, list) and cls_raw[:1] == ["B"]:
            cls = BUILTIN_EXCEPTIONS.get(_text(cls_raw[1]))
            if cls is None:
                raise BridgeError(f"unknown builtin exception {cls_raw[1]!r}")
        else:
            cls = self.decode(cls_raw)
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise BridgeError("the peer raised something that is not an exception")
        args = self.decode(args)
        if not isinstance(args, tuple):
            raise BridgeError("malformed exception arguments")
        if self.guarded and issubclass(cls, _STOPPERS):
            return RuntimeError(f"the solution raised {cls.__name__}: {message}")
        try:
            exc = cls.__new__(cls, *args)
            BaseException.__init__(exc, *args)
        except Exception:  # noqa: BLE001 - an OSError subclass with odd args, say
            exc = cls.__new__(cls)
            BaseException.__init__(exc, *args)
        exc.__dict__["_bridge_message"] = message
        # Raised back to its owner, it becomes the original exception object again.
        exc.__dict__["_bridge_conn"] = self
        exc.__dict__["_bridge_ref"] = ref
        if isinstance(attrs, list):
            for item in attrs:
                if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and not item[0].startswith("_"):
                    try:
                        setattr(exc, item[0], self.decode(item[1]))
                    except AttributeError:
                        pass
        return exc


def _mirror_str(self) -> str:
    return self.__dict__.get("_bridge_message", BaseException.__str__(self))


def _mirror_repr(self) -> str:
    return f"{type(self).__name__}({_mirror_str(self)!r})"


def _plain_methods(cls) -> set:
    """Names of plain functions defined on ``cls`` or its bases: a call of one of these
    on an instance is one request (``callm``) instead of getattr + call."""
    out = set()
    for klass in getattr(cls, "__mro__", ())[:-1]:
        for name, value in vars(klass).items():
            if isinstance(value, types.FunctionType):
                out.add(name)
    return out


def _text(v) -> str:
    if type(v) is not str:
        raise BridgeError(f"expected a string on the grading bridge, got {type(v).__name__}")
    return v


def _integer(v) -> int:
    if type(v) is not int:
        raise BridgeError("expected an integer on the grading bridge")
    return v


def _number(v) -> float:
    if type(v) not in (int, float):
        raise BridgeError("expected a number on the grading bridge")
    return float(v)


# --- proxies on the receiving side --------------------------------------------------


def _forward(op):
    def method(self, *args):
        return self._bridge_conn.rpc("op", op, args=(self, *args))
    method.__name__ = f"__{op}__"
    return method


def _reflected(op):
    def method(self, other):
        return self._bridge_conn.rpc("op", op, args=(other, self))
    return method


def _compare(op):
    local = getattr(operator, op)

    def method(self, other):
        # Forwarded only between two objects of the same peer: a plain value (a test's
        # expected value) never reaches the other side. An instance of a subclass of a
        # builtin value type (an IntEnum, a namedtuple, a list subclass) compares here by
        # its base value, read by the base type's own methods: its overrides never run.
        if not isinstance(other, _Proxy) or other._bridge_conn is not self._bridge_conn:
            if self._bridge_value_like:
                return local(self._bridge_conn.rpc("op", "basevalue", args=(self,)), other)
            return NotImplemented
        return self._bridge_conn.rpc("op", op, args=(self, other))
    return method


class _Proxy:
    """A peer's object. Built per handle (see :meth:`_make`) so callables are callable."""

    __slots__ = ("_bridge_conn", "_bridge_ref", "_bridge_kind", "_bridge_cls", "_bridge_value_like", "__weakref__")

    @staticmethod
    def _make(conn, ref, kind, *, callable_: bool, cls_ref: int | None = None, value_like: bool = False,
              klass: type | None = None):
        klass = klass or (_CallableProxy if callable_ else _Proxy)
        p = object.__new__(klass)
        object.__setattr__(p, "_bridge_conn", conn)
        object.__setattr__(p, "_bridge_ref", ref)
        object.__setattr__(p, "_bridge_kind", kind)
        object.__setattr__(p, "_bridge_cls", cls_ref)
        object.__setattr__(p, "_bridge_value_like", value_like)
        return p

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") and name not in _PUBLIC_DUNDERS and name != "__doc__":
            raise AttributeError(name)
        conn = self._bridge_conn
        methods = conn._methods.get(self._bridge_cls)
        if methods is not None and name in methods:
            method = _RemoteMethod(conn, self._bridge_ref, name)
            if conn._deferring:
                # Where it was loaded: a call may be deferred only where this same
                # instruction's method object is what the CALL calls (Connection.try_defer).
                caller = sys._getframe(1)
                method._site = (id(caller), caller.f_lasti)
            return method
        return conn.rpc("getattr", self._bridge_ref, name)

    def __setattr__(self, name, value):
        self._bridge_conn.rpc("setattr", self._bridge_ref, name, args=(value,))

    def __delattr__(self, name):
        self._bridge_conn.rpc("delattr", self._bridge_ref, name)

    def __instancecheck__(self, obj):
        if isinstance(obj, _Proxy) and obj._bridge_conn is self._bridge_conn:
            return self._bridge_conn.rpc("op", "isinstance", args=(obj, self))
        return False

    def __iter__(self):
        return self._bridge_conn.rpc("op", "iter", args=(self,))

    def __next__(self):
        return self._bridge_conn.rpc("op", "next", args=(self,))

    def __hash__(self):
        return self._bridge_conn.rpc("op", "hash", args=(self,))

    def __bool__(self):
        return self._bridge_conn.rpc("op", "bool", args=(self,))

    def __enter__(self):
        return self._bridge_conn.rpc("op", "enter", args=(self,))

    def __exit__(self, exc_type, exc, tb):
        return self._bridge_conn.rpc("op", "exit", args=(self, exc_type, exc, None))

    def __repr__(self):
        try:
            return self._bridge_conn.rpc("op", "repr", args=(self,))
        except Exception as exc:  # noqa: BLE001 - repr must not raise inside pytest's reporting
            return f"<solution {self._bridge_kind} (repr failed: {type(exc).__name__})>"

    def __str__(self):
        return self._bridge_conn.rpc("op", "str", args=(self,))

    def __format__(self, spec):
        return self._bridge_conn.rpc("op", "format", args=(self, spec))

    def __reduce_ex__(self, protocol):
        raise TypeError("solution objects cannot be pickled")


for _name in ("len", "reversed", "contains", "getitem", "setitem", "delitem", "int", "float", "index",
              "neg", "pos", "abs", "invert", "round"):
    setattr(_Proxy, f"__{_name}__", _forward(_name))
for _name in _COMPARISONS:
    setattr(_Proxy, f"__{_name}__", _compare(_name))
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
              "lshift", "rshift", "divmod"):
    setattr(_Proxy, f"__{_name}__", _forward(_name))
    setattr(_Proxy, f"__r{_name}__", _reflected(_name))


class _CallableProxy(_Proxy):
    __slots__ = ()

    def __call__(self, *args, **kwargs):
        return self._bridge_conn.rpc("call", self._bridge_ref, args=args, kwargs=kwargs)


class _MethodSlot:
    """A plain method of the peer's class, as a class attribute of its proxy type:
    ``proxy.name`` is a _RemoteMethod, noting where it was loaded while deferral is on
    (Connection.try_defer)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        conn = obj._bridge_conn
        method = _RemoteMethod(conn, obj._bridge_ref, self.name)
        if conn._deferring:
            caller = sys._getframe(1)
            method._site = (id(caller), caller.f_lasti)
        return method


class _RemoteMethod:
    """``obj.method`` of a peer object, called in one request."""

    __slots__ = ("_conn", "_ref", "_name", "_site")

    def __init__(self, conn, ref, name):
        self._conn, self._ref, self._name = conn, ref, name
        self._site = None  # (id of the frame, offset of the instruction) that loaded it

    def __call__(self, *args, **kwargs):
        conn = self._conn
        if self._site is not None and conn._deferring and conn.try_defer(sys._getframe(1), self, args, kwargs):
            return None
        return conn.rpc("callm", self._ref, self._name, args=args, kwargs=kwargs)

    def __eq__(self, other):
        return isinstance(other, _RemoteMethod) and (other._conn, other._ref, other._name) == (self._conn, self._ref, self._name)

    def __hash__(self):
        return hash((self._ref, self._name))

    def __repr__(self):
        return f"<solution method {self._name}>"


class _RemoteModule(types.ModuleType):
    """A solution module as the tests see it: attributes are fetched from the solution."""

    def __init__(self, conn, ref, name, file, is_package):
        super().__init__(name)
        object.__setattr__(self, "_bridge_conn", conn)
        object.__setattr__(self, "_bridge_ref", ref)
        object.__setattr__(self, "_bridge_file", file)
        object.__setattr__(self, "_bridge_package", is_package)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") and name not in ("__all__", "__version__"):
            raise AttributeError(name)
        return self.__dict__["_bridge_conn"].rpc("getattr", self.__dict__["_bridge_ref"], name)


# --- the tests' side: importing solution modules ----------------------------------------


class SolutionFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: a module the tests import that nothing local provides,
    whose top-level name the workspace defines, is the solution's module (a proxy)."""

    def __init__(self, conn: Connection, tops: set[str], workspace: str, sources: str) -> None:
        self.conn = conn
        self.tops = tops
        self.workspace = workspace.rstrip("/") + "/"
        self.sources = sources.rstrip("/") + "/"

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.tops:
            return None
        try:
            module = self.conn.rpc("import", fullname)
        except ModuleNotFoundError:
            return None
        if not isinstance(module, _RemoteModule):
            raise BridgeError(f"the solution answered the import of {fullname!r} with something that is not a module")
        file = module.__dict__["_bridge_file"]
        origin = None
        if isinstance(file, str) and file.startswith(self.workspace) and ".." not in file.split("/"):
            origin = self.sources + file[len(self.workspace):]
        spec = importlib.util.spec_from_loader(fullname, self, origin=origin,
                                               is_package=module.__dict__["_bridge_package"])
        spec.has_location = origin is not None
        spec._bridge_module = module
        return spec

    def create_module(self, spec):
        return spec._bridge_module

    def exec_module(self, module):
        return None


def connect(fd: int, role: str, *, cpu: int | None = None, pin_after: int = 0) -> Connection:
    return Connection(socket.socket(fileno=fd), role, cpu=cpu, pin_after=pin_after)
