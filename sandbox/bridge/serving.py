"""The connection: requests out, answers back, the peer's requests served.

``Connection`` is one end of the bridge (role "tests" or "solution"), built from the
mixins of the other modules: wire (framing), codec (values), handles (what is lent, with
the capability checks on the tests' side), mirrors (exceptions), deferral. This module
holds the request loop and the dispatch of what the peer asks; on the tests' side every
request on a lent object goes through ``Handles._use``/``_attribute`` (capabilities.py).
"""

from __future__ import annotations

import importlib
import operator

from . import capabilities
from .codec import SCALARS, Codec, base_value, text
from .deferral import Deferral
from .handles import Handles
from .mirrors import Mirrors
from .proxies import plain_methods
from .wire import BridgeError, Stop, TooLarge, Wire

OPS = {
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
    "isinstance": isinstance, "issubclass": issubclass, "round": round, "basevalue": base_value,
}


class Connection(Wire, Codec, Handles, Mirrors, Deferral):
    """One end of the bridge. ``role`` is "tests" or "solution"; the tests' end guards
    what it lends (capabilities.py) and answers no imports."""

    def __init__(self, channel, role: str, *, cpu: int | None = None, pin_after: int = 0) -> None:
        """``channel``: a connected socket (both directions), or ``(read fd, write fd)``
        (the grader's two pipes)."""
        if role not in ("tests", "solution"):
            raise ValueError(role)
        if hasattr(channel, "fileno"):  # a socket
            self._rfd = self._wfd = channel.fileno()
        else:
            self._rfd, self._wfd = (int(fd) for fd in channel)
        self._cpu = cpu
        self._sends = 0
        self._pin_at = pin_after if cpu is not None and pin_after > 0 else -1
        self.sock = channel  # kept: a socket object closes its fd when collected
        self.role = role
        self.guarded = role == "tests"
        self._objects: dict = {}  # handle id -> object this side lends
        self._ids: dict = {}  # id(object) -> handle id
        self._kinds: dict = {}  # handle id -> capability kind (tests' side)
        self._raised: dict = {}  # raise-back token -> exception this side sent
        self._class_keys: dict = {}  # class -> the number naming it in descriptions (tests' side)
        self._proxies: dict = {}  # peer handle id -> local proxy (interned)
        self._methods: dict = {}  # peer class number -> plain method names
        self._proxy_classes: dict = {}
        self._described: set = set()
        self._next = 0
        self.closed = False
        # Mutable top-level arguments of the request being built (slot -> object), and the
        # ones received by the call being served (slot, object, encoding before the call).
        self._sent = None
        self._pending: list = []
        self._buf = bytearray()
        # Deferred calls (deferral.py).
        self._boundary = None
        self._deferring = False
        self._outbox = bytearray()
        self._batch: list = []
        self._batch_bytes = 0
        self._sites: list = []
        self._failure = None
        self._deferred_seen = 0
        self._deferred_error = None

    # --- requests -----------------------------------------------------------------

    def rpc(self, *head, args=None, kwargs=None):
        """Build and send one request; its mutable arguments may be written back."""
        saved = self._sent
        self._sent = {}
        try:
            msg = list(head)
            if args is not None:
                encode = self.encode
                msg.append([a if type(a) in SCALARS else encode(a) for a in args])
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
            except Stop:
                raise BridgeError("the solution process exited during a call") from None
            kind = reply[0]
            if kind == "ok" and len(reply) == 3:
                if reply[2] is not None:
                    self._write_back(reply[2])
                value = reply[1]
                return value if type(value) in SCALARS else self.decode(value)
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
            except Stop:
                return
            self._serve_one(msg)

    def _serve_one(self, msg) -> None:
        if not self.guarded:
            if msg[0] == "dcalls":
                self._serve_deferred_batch(msg)
                return
            if msg[0] == "dcallm":
                self._serve_deferred(msg)
                return
            self._deferred_seen = 0
            if self._deferred_error is not None:
                failure, self._deferred_error = self._deferred_error, None
                self._send(["dfail", *failure])
                return
        saved_pending, saved_sent = self._pending, self._sent
        self._pending, self._sent = [], None
        try:
            try:
                result = self._dispatch(msg)
                out = ["ok", result if type(result) in SCALARS else self.encode(result), None]
            except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
                out = ["err", self.encode_exception(exc), None]
            if self._pending:
                out[2] = self._collect_writebacks(self._pending)
        finally:
            self._pending, self._sent = saved_pending, saved_sent
        try:
            self._send(out)
        except TooLarge as exc:  # the answer, not the process, fails
            self._send(["err", self.encode_exception(BridgeError(f"the answer is too large to cross: {exc}")), None])

    def _dispatch(self, msg):
        kind = msg[0]
        # Most frequent first: method calls, calls, operations, attributes.
        if kind == "callm":
            fn = self._attribute(msg[1], msg[2])
            if self.guarded:
                self._callable(fn)
            return fn(*self._args(msg[3]), **self._kwargs(msg[4]))
        if kind == "call":
            fn = self._use(msg[1], "call")
            return fn(*self._args(msg[2]), **self._kwargs(msg[3]))
        if kind == "op":
            name = text(msg[1])
            fn = OPS.get(name)
            if fn is None:
                raise BridgeError(f"unknown operation {name!r}")
            args = self._args(msg[2])
            if self.guarded:
                self._check_op_args(name, args)
            return fn(*args)
        if kind == "getattr":
            return self._attribute(msg[1], msg[2])
        if kind == "import":
            if self.guarded:
                raise BridgeError("the tests' side answers no imports")
            return importlib.import_module(text(msg[1]))
        if kind == "setattr":
            if self.guarded:
                raise BridgeError("test objects are read-only to the solution")
            setattr(self._local(msg[1]), text(msg[2]), self._args(msg[3])[0])
            return None
        if kind == "delattr":
            if self.guarded:
                raise BridgeError("test objects are read-only to the solution")
            delattr(self._local(msg[1]), text(msg[2]))
            return None
        if kind == "methods":
            cls = self._use(msg[1], "methods")
            return sorted(plain_methods(cls)) if isinstance(cls, type) else []
        if kind == "sync":
            return None
        raise BridgeError(f"unknown request {kind!r}")

    def _callable(self, fn) -> None:
        """A test object's attribute the solution calls: a callable kind of its own."""
        if self._own_ref(fn) is not None or type(fn) in SCALARS:
            return
        if "call" not in capabilities.OPS[capabilities.kind_of(fn)]:
            raise capabilities.Refused(f"a test-side {type(fn).__name__} cannot be called from the solution")

    def _args(self, raw) -> list:
        if type(raw) is not list:
            raise BridgeError("malformed arguments")
        decode = self.decode
        return [a if type(a) in SCALARS else decode(a, track=True) for a in raw]

    def _kwargs(self, raw) -> dict:
        if type(raw) is not list:
            raise BridgeError("malformed keyword arguments")
        out = {}
        for item in raw:
            if not (isinstance(item, list) and len(item) == 2):
                raise BridgeError("malformed keyword arguments")
            out[text(item[0])] = self.decode(item[1], track=True)
        return out

    # --- write-back of mutable arguments ------------------------------------------------

    def _collect_writebacks(self, pending):
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


def connect(fd, role: str, *, cpu: int | None = None, pin_after: int = 0) -> Connection:
    """``fd``: ``[read fd, write fd]`` (two pipes), or one socket's fd (older graders)."""
    if isinstance(fd, int):
        import socket  # the pipes need no socket module

        channel = socket.socket(fileno=fd)
    else:
        channel = tuple(fd)
    return Connection(channel, role, cpu=cpu, pin_after=pin_after)
