"""Handles: the table of objects this side lends the peer, and the peer's objects here.

Every object lent to the peer gets a number; the peer names it by that number and nothing
else. On the tests' side each lent object also has a KIND (capabilities.kind_of), and
``_use`` checks every request against it: the operation must be in the kind's allowlist,
an attribute must be allowed for the kind, and whatever comes back is classified again
when it is encoded. The solution's side lends without limits (the tests may look at
anything of the solution's).
"""

from __future__ import annotations

import types

from . import capabilities
from .codec import MAX_DEPTH, VALUE_BASES, integer, text
from .proxies import CallableProxy, MethodSlot, Proxy, RemoteMethod, RemoteModule, plain_methods
from .wire import BridgeError


class Handles:
    """Mixed into the connection."""

    # --- lending ------------------------------------------------------------------

    def _export(self, v, kind: str = capabilities.OBJECT) -> int:
        key = id(v)
        ref = self._ids.get(key)
        if ref is None or self._objects.get(ref) is not v:
            self._next += 1
            ref = self._next
            self._objects[ref] = v
            self._ids[key] = ref
            self._kinds[ref] = kind
        return ref

    def _handle(self, v, depth: int):
        """The ``["h", id, description]`` of a non-value; on the tests' side only within
        the capability table."""
        if depth > MAX_DEPTH:
            raise BridgeError("handle description nested too deeply")
        kind = capabilities.kind_of(v) if self.guarded else capabilities.OBJECT
        return ["h", self._export(v, kind), self._describe(v, depth)]

    def _describe(self, v, depth: int):
        if isinstance(v, type) and issubclass(v, BaseException):
            bases = [self._encode_exc_class(b, depth) for b in v.__bases__ if issubclass(b, BaseException)]
            return ["exc", v.__name__, v.__qualname__, str(getattr(v, "__module__", ""))[:200], bases]
        if isinstance(v, type):
            return ["cls", v.__name__, v.__qualname__]
        if isinstance(v, types.ModuleType):  # the solution's side only (modules are never lent by the tests)
            return ["mod", v.__name__, hasattr(v, "__path__")]
        cls = type(v)
        methods = None
        cls_ref = self._class_key(cls)
        if cls_ref not in self._described:
            self._described.add(cls_ref)
            methods = sorted(plain_methods(cls))
            if self.guarded:
                methods = [m for m in methods if capabilities.attribute_allowed(self._kinds[self._ids[id(v)]], m)]
        return ["obj", cls_ref, methods, callable(v), isinstance(v, VALUE_BASES)]

    def _class_key(self, cls) -> int:
        """A number for an object's class (the peer caches method names by it). The tests'
        side never lends the class itself this way: the number names nothing."""
        if not self.guarded:
            return self._export(cls)
        key = self._class_keys.get(cls)
        if key is None:
            self._next += 1
            key = self._class_keys[cls] = -self._next
        return key

    def _own_ref(self, v):
        """The encoding of one of the peer's objects going home (a proxy, a remote method,
        a mirror class or exception), or None."""
        if isinstance(v, Proxy):
            return ["r", v._bridge_ref] if v._bridge_conn is self else None
        if isinstance(v, RemoteMethod):
            return ["m", v._ref, v._name] if v._conn is self else None
        if isinstance(v, type) and v.__dict__.get("_bridge_conn") is self:  # a mirror class
            return ["r", v.__dict__["_bridge_ref"]]
        if isinstance(v, BaseException) and getattr(v, "__dict__", {}).get("_bridge_conn") is self:
            return ["X", ["r", v.__dict__["_bridge_ref"]]]
        return None

    # --- the peer's requests on lent objects -----------------------------------------

    def _local(self, ref):
        """An object this side lent, named by the peer."""
        if type(ref) is not int or ref not in self._objects:
            raise BridgeError(f"unknown handle {ref!r}")
        return self._objects[ref]

    def _use(self, ref, op: str):
        """The lent object ``ref``, if its kind allows ``op``."""
        obj = self._local(ref)
        if self.guarded and op not in capabilities.OPS[self._kinds[ref]]:
            raise capabilities.Refused(f"{op!r} is not an operation the solution may do on a test-side "
                                       f"{self._kinds[ref]}")
        return obj

    def _attribute(self, ref, name):
        """``getattr(lent object, name)``, if the kind allows the name."""
        obj = self._local(ref)
        name = text(name)
        if self.guarded:
            kind = self._kinds[ref]
            if not capabilities.attribute_allowed(kind, name):
                exc = AttributeError(f"{name!r} of a test-side {kind} is not reachable from the solution")
                exc.__dict__["_bridge_refusal"] = True
                raise exc
            value = getattr(obj, name)
            if name in capabilities.NAMING and not (value is None or type(value) is str):
                raise capabilities.Refused(f"{name} of a test-side {kind} is not a string")
            return value
        return getattr(obj, name)

    def _check_op_args(self, op: str, args) -> None:
        """An operation's arguments that are lent objects must allow it (the tests' side)."""
        ids, kinds = self._ids, self._kinds
        for a in args:
            ref = ids.get(id(a))
            if ref is not None and self._objects.get(ref) is a and op not in capabilities.OPS[kinds[ref]]:
                raise capabilities.Refused(f"{op!r} is not an operation the solution may do on a test-side "
                                           f"{kinds[ref]}")

    def _restore(self, op, depth):
        """Decoding of the handle tags: this side's objects coming home, the peer's new ones."""
        tag = op[0]
        if tag == "r":
            return self._local(op[1])
        if tag == "m":
            return self._attribute(op[1], op[2])
        if tag == "h":
            return self._proxy(op[1], op[2], depth)
        raise BridgeError(f"unknown value tag {tag!r} on the grading bridge")

    # --- the peer's objects here ---------------------------------------------------

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
            proxy = RemoteModule(self, ref, text(desc[1]), bool(desc[2]))
        elif kind == "cls":
            proxy = Proxy.make(self, ref, f"class {text(desc[2])}", callable_=True)
        elif kind == "obj":
            cls_ref, methods = integer(desc[1]), desc[2]
            if methods is not None:
                if not isinstance(methods, list) or not all(isinstance(m, str) for m in methods):
                    raise BridgeError("malformed method list")
                self._methods.setdefault(cls_ref, frozenset(methods))
            proxy = Proxy.make(self, ref, "object", callable_=bool(desc[3]), cls_ref=cls_ref,
                               klass=self._proxy_class(cls_ref, bool(desc[3])),
                               value_like=len(desc) > 4 and desc[4] is True)
        else:
            raise BridgeError(f"unknown handle kind {kind!r}")
        self._proxies[ref] = proxy
        return proxy

    def _proxy_class(self, cls_ref: int, callable_: bool) -> type | None:
        """The proxy type for instances of the peer's class ``cls_ref``: its plain methods
        as class attributes (MethodSlot), so ``obj.method`` skips ``__getattr__``."""
        key = (cls_ref, callable_)
        if key not in self._proxy_classes:
            base = CallableProxy if callable_ else Proxy
            names = [m for m in self._methods.get(cls_ref, ()) if not m.startswith("_") and not hasattr(base, m)]
            ns: dict = {"__slots__": ()}
            ns.update({m: MethodSlot(m) for m in names})
            self._proxy_classes[key] = type(base.__name__, (base,), ns) if names else None
        return self._proxy_classes[key]
