"""The receiving side's stand-ins for the peer's objects: proxies, remote methods, modules.

A proxy holds a handle id and forwards every operation to the owner (``conn.rpc``); what
the owner lets through is the owner's business (capabilities.py on the tests' side).
Comparisons with a plain value are never forwarded: the peer never sees a test's expected
value; an instance of a subclass of a builtin value type compares by its base value.
"""

from __future__ import annotations

import operator
import sys
import types

from .sites import _LOADS, call_of_load

# Dunders a proxy forwards as attributes (the rest are refused locally).
PUBLIC_DUNDERS = frozenset({"__name__", "__qualname__", "__module__", "__doc__"})
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


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
        if not isinstance(other, Proxy) or other._bridge_conn is not self._bridge_conn:
            if self._bridge_value_like:
                return local(self._bridge_conn.rpc("op", "basevalue", args=(self,)), other)
            return NotImplemented
        return self._bridge_conn.rpc("op", op, args=(self, other))
    return method


class Proxy:
    """A peer's object. Built per handle (see :meth:`make`) so callables are callable."""

    __slots__ = ("_bridge_conn", "_bridge_ref", "_bridge_kind", "_bridge_cls", "_bridge_value_like", "__weakref__")

    @staticmethod
    def make(conn, ref, kind, *, callable_: bool, cls_ref: int | None = None, value_like: bool = False,
             klass: type | None = None):
        klass = klass or (CallableProxy if callable_ else Proxy)
        p = object.__new__(klass)
        object.__setattr__(p, "_bridge_conn", conn)
        object.__setattr__(p, "_bridge_ref", ref)
        object.__setattr__(p, "_bridge_kind", kind)
        object.__setattr__(p, "_bridge_cls", cls_ref)
        object.__setattr__(p, "_bridge_value_like", value_like)
        return p

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") and name not in PUBLIC_DUNDERS:
            raise AttributeError(name)
        conn = self._bridge_conn
        methods = conn._methods.get(self._bridge_cls)
        if methods is not None and name in methods:
            method = RemoteMethod(conn, self._bridge_ref, name)
            if conn._deferring:
                _note_site(method, sys._getframe(1), name)
            return method
        return conn.rpc("getattr", self._bridge_ref, name)

    def __setattr__(self, name, value):
        self._bridge_conn.rpc("setattr", self._bridge_ref, name, args=(value,))

    def __delattr__(self, name):
        self._bridge_conn.rpc("delattr", self._bridge_ref, name)

    def __instancecheck__(self, obj):
        if isinstance(obj, Proxy) and obj._bridge_conn is self._bridge_conn:
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
    setattr(Proxy, f"__{_name}__", _forward(_name))
for _name in COMPARISONS:
    setattr(Proxy, f"__{_name}__", _compare(_name))
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
              "lshift", "rshift", "divmod"):
    setattr(Proxy, f"__{_name}__", _forward(_name))
    setattr(Proxy, f"__r{_name}__", _reflected(_name))


class CallableProxy(Proxy):
    __slots__ = ()

    def __call__(self, *args, **kwargs):
        return self._bridge_conn.rpc("call", self._bridge_ref, args=args, kwargs=kwargs)


class MethodSlot:
    """A plain method of the peer's class, as a class attribute of its proxy type:
    ``proxy.name`` is a RemoteMethod, noting where it was loaded while deferral is on."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        conn = obj._bridge_conn
        method = RemoteMethod(conn, obj._bridge_ref, self.name)
        if conn._deferring:  # _note_site, inlined: this runs once per method call of a test
            caller = sys._getframe(1)
            code = caller.f_code
            known = _LOADS.get((id(code), caller.f_lasti, self.name))
            call = known[1] if known is not None and known[0] is code else call_of_load(code, caller.f_lasti, self.name)
            if call >= 0:
                method._site = (id(caller), call)
        return method


def _note_site(method, caller, name) -> None:
    """Where the method loaded at the caller's current instruction will be called, if
    that call is a statement outside any try/except/with (sites.call_of_load)."""
    call = call_of_load(caller.f_code, caller.f_lasti, name)
    if call >= 0:
        method._site = (id(caller), call)


class RemoteMethod:
    """``obj.method`` of a peer object, called in one request."""

    __slots__ = ("_conn", "_ref", "_name", "_site")

    def __init__(self, conn, ref, name):
        self._conn, self._ref, self._name = conn, ref, name
        # (id of the frame that loaded it, offset of the discarded call the load feeds)
        self._site = None

    def __call__(self, *args, **kwargs):
        conn = self._conn
        site = self._site
        if site is not None and conn._deferring:
            frame = sys._getframe(1)
            if id(frame) == site[0] and frame.f_lasti == site[1] and conn.try_defer(frame, self, args, kwargs):
                return None
        return conn.rpc("callm", self._ref, self._name, args=args, kwargs=kwargs)

    def __eq__(self, other):
        return isinstance(other, RemoteMethod) and (other._conn, other._ref, other._name) == (self._conn, self._ref, self._name)

    def __hash__(self):
        return hash((self._ref, self._name))

    def __repr__(self):
        return f"<solution method {self._name}>"


class RemoteModule(types.ModuleType):
    """A solution module as the tests see it: attributes are fetched from the solution."""

    def __init__(self, conn, ref, name, is_package):
        super().__init__(name)
        object.__setattr__(self, "_bridge_conn", conn)
        object.__setattr__(self, "_bridge_ref", ref)
        object.__setattr__(self, "_bridge_package", is_package)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") and name not in ("__all__", "__version__"):
            raise AttributeError(name)
        return self.__dict__["_bridge_conn"].rpc("getattr", self.__dict__["_bridge_ref"], name)


def plain_methods(cls) -> set:
    """Names of plain functions defined on ``cls`` or its bases: a call of one of these
    on an instance is one request (``callm``) instead of getattr + call."""
    out = set()
    for klass in getattr(cls, "__mro__", ())[:-1]:
        for name, value in vars(klass).items():
            if isinstance(value, types.FunctionType):
                out.add(name)
    return out
