"""Exceptions on the bridge: mirrors by value, never handles.

An exception crosses as ``["x", class, args, message, attributes, token]``: its class as a
builtin exception (by name) or as the owner's exception class (a mirror class on the
receiving side: same name, same builtin bases, so ``pytest.raises(InsufficientFunds)`` and
``isinstance(e, ValueError)`` work), its args, message and public attributes by value.
``token`` lets the receiver raise it back: raised back to its owner it is the original
exception object again; the token is good for nothing else (it is not a handle).

From the tests' side the solution gets less: the class only (no args, message or
attributes: they could hold expected values); a class of the test framework goes as its
nearest builtin base; and nothing of the exception's internals (traceback, frames,
context) ever crosses. From the solution's side, SystemExit, KeyboardInterrupt and
GeneratorExit arrive as RuntimeError (solution code cannot end the test run), and an
exception class is instantiated on the tests' side only if it is a mirror of the
solution's own, a builtin, or a test exception class the tests handed over themselves.
"""

from __future__ import annotations

import builtins

from . import capabilities
from .codec import text
from .wire import BridgeError

BUILTIN_EXCEPTIONS = {
    name: obj for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}
# The bridge's own error crosses as itself (the receiver's BridgeError), so a refused value
# or a cycle reads the same on both sides.
BUILTIN_EXCEPTIONS["BridgeError"] = BridgeError
STOPPERS = (SystemExit, KeyboardInterrupt, GeneratorExit)
# Raise-back tokens kept per side: an exception older than this many is raised back as a
# copy (the mirror), not as the original object.
MAX_RAISED = 4096


def _mirror_str(self) -> str:
    return self.__dict__.get("_bridge_message", BaseException.__str__(self))


def _mirror_repr(self) -> str:
    return f"{type(self).__name__}({_mirror_str(self)!r})"


def _builtin_base(cls) -> str:
    for klass in cls.__mro__:
        if BUILTIN_EXCEPTIONS.get(klass.__name__) is klass:
            return klass.__name__ if klass is not BridgeError else "RuntimeError"
    return "Exception"


class Mirrors:
    """Mixed into the connection."""

    def encode_exception(self, exc: BaseException):
        own = exc.__dict__.get("_bridge_conn") if hasattr(exc, "__dict__") else None
        if own is self:
            return ["r", exc.__dict__["_bridge_ref"]]
        cls = type(exc)
        try:
            cls_enc = self._encode_exc_class(cls, 0)
        except Exception:  # noqa: BLE001
            cls_enc = ["B", _builtin_base(cls)]
        token = self._raise_token(exc)
        if self.guarded and not isinstance(exc, capabilities.Refused):
            return ["x", cls_enc, self.encode(()), "", [], token]
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
        return ["x", cls_enc, args, message, attrs, token]

    def _raise_token(self, exc) -> int:
        """A number the peer can only raise back (never a handle)."""
        self._next += 1
        raised = self._raised
        raised[self._next] = exc
        if len(raised) > MAX_RAISED:  # the oldest go (a generator's StopIteration, say)
            del raised[next(iter(raised))]
        return self._next

    def _encode_exc_class(self, cls, depth):
        if BUILTIN_EXCEPTIONS.get(cls.__name__) is cls or cls is BridgeError:
            return ["B", cls.__name__]
        if self.guarded:
            try:
                capabilities.kind_of(cls)
            except capabilities.Refused:
                return ["B", _builtin_base(cls)]
        return self.encode(cls, depth)

    def decode_exception(self, raw) -> BaseException:
        if isinstance(raw, list) and raw[:1] == ["r"] and len(raw) == 2:
            exc = self._raised.get(raw[1]) if type(raw[1]) is int else None
            if exc is None:
                raise BridgeError("the peer raised an exception this side never sent")
            return exc
        if not (isinstance(raw, list) and len(raw) == 6 and raw[0] == "x"):
            raise BridgeError("malformed exception on the grading bridge")
        cls_raw, args, message, attrs, token = raw[1], raw[2], text(raw[3]), raw[4], raw[5]
        if isinstance(cls_raw, list) and cls_raw[:1] == ["B"]:
            cls = BUILTIN_EXCEPTIONS.get(text(cls_raw[1]))
            if cls is None:
                raise BridgeError(f"unknown builtin exception {cls_raw[1]!r}")
        else:
            cls = self.decode(cls_raw)
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise BridgeError("the peer raised something that is not an exception")
            if self.guarded and cls.__dict__.get("_bridge_conn") is not self:
                # A test-side class named by the solution: only one the tests handed over.
                if self._kinds.get(self._ids.get(id(cls))) != capabilities.EXC_CLASS:
                    raise BridgeError("the solution raised a test-side class it was never given")
        args = self.decode(args)
        if not isinstance(args, tuple):
            raise BridgeError("malformed exception arguments")
        if self.guarded and issubclass(cls, STOPPERS):
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
        exc.__dict__["_bridge_ref"] = token
        if isinstance(attrs, list):
            for item in attrs:
                if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and not item[0].startswith("_"):
                    try:
                        setattr(exc, item[0], self.decode(item[1]))
                    except AttributeError:
                        pass
        return exc

    def _mirror_exception_class(self, ref, desc, depth):
        name, qualname, module, bases_raw = text(desc[1]), text(desc[2]), text(desc[3]), desc[4]
        if not isinstance(bases_raw, list):
            raise BridgeError("malformed exception class")
        bases = []
        for b in bases_raw:
            if isinstance(b, list) and b[:1] == ["B"]:
                base = BUILTIN_EXCEPTIONS.get(text(b[1]))
                if base is None:
                    raise BridgeError(f"unknown builtin exception {b[1]!r}")
            else:
                base = self.decode(b, depth)
                if not (isinstance(base, type) and issubclass(base, BaseException)):
                    raise BridgeError("an exception class must derive from exceptions")
            if self.guarded and issubclass(base, STOPPERS):
                base = RuntimeError
            bases.append(base)
        ns = {"__module__": module, "__qualname__": qualname, "_bridge_conn": self, "_bridge_ref": ref,
              "__str__": _mirror_str, "__repr__": _mirror_repr}
        try:
            return type(name, tuple(dict.fromkeys(bases)) or (Exception,), ns)
        except TypeError:
            return type(name, (Exception,), ns)
