"""Values on the bridge: encoding and decoding, one job.

A value crosses as a JSON scalar, or as ``["V", ops]``: the value in postfix form (scalars
push themselves, lists are instructions), flat, so nesting costs no recursion on either
side. What crosses by value (a fresh copy on the receiving side):

  None, bool, int (any size: ``["I", hex]`` past the str() limit), float, str, bytes,
  bytearray, list, tuple, dict, set, frozenset, Decimal, Fraction, complex, range;
  ``Counter``/``OrderedDict``/``defaultdict`` as plain dicts; numpy scalars as the Python
  scalar they hold (``numpy.int64(3)`` is ``3``); numpy arrays of bool/int/float/complex/
  str/bytes as an ndarray of the same dtype and shape where the receiver can import numpy,
  else as nested lists (other dtypes: nested lists always); paths (``pathlib`` paths and
  any ``os.PathLike``) as a ``pathlib`` path naming the same path; exceptions as mirrors
  (mirrors.py).

A value that contains itself (a cycle) or nests deeper than MAX_VALUE_DEPTH is refused
with a BridgeError in the test that sent or received it; nothing grows without bound.
Anything else is a handle (handles.py), which the tests' side hands out only within the
capability table (capabilities.py).
"""

from __future__ import annotations

import base64
import collections
import importlib
import os
import sys

from .proxies import Proxy
from .wire import BridgeError, wide_int

MAX_ITEMS = 5_000_000
MAX_VALUE_DEPTH = 20_000
# Handle descriptions nest (an exception class's bases); values do not (postfix form).
MAX_DEPTH = 50

# Values that are their own encoding (JSON scalars, exact types): the hot paths test this
# set inline instead of calling encode/decode once per argument.
SCALARS = frozenset({type(None), bool, int, float, str})
VALUE_BASES = (bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset)
# Standard-library subclasses of builtin containers that honest code returns all the time.
_STDLIB_CONTAINERS = frozenset({collections.Counter, collections.OrderedDict, collections.defaultdict})
_CONTAINER_TAGS = {list: "l", tuple: "t", set: "s", frozenset: "f"}
_PLAIN_ITEMS = (bool, int, float, complex, str, bytes)
# Path classes that cross as themselves (others as pathlib.Path).
_PATH_KINDS = ("PurePosixPath", "PureWindowsPath", "PurePath")
_ARRAY_KINDS = frozenset("biufcSU")
_numpy = None


class Emit:
    """Encoder stack marker: emit ``op`` once the children are out, and close ``key``
    (the id of the container being encoded: cycle detection)."""

    __slots__ = ("op", "key")

    def __init__(self, op, key=None) -> None:
        self.op = op
        self.key = key


def base_value(v):
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
        return bytes(memoryview(v))
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


def _numpy_module():
    """numpy on the receiving side, imported on first need; False where there is none."""
    global _numpy
    if _numpy is None:
        try:
            _numpy = importlib.import_module("numpy")
        except Exception:  # noqa: BLE001 - not installed, or broken: arrays arrive as lists
            _numpy = False
    return _numpy


def text(v) -> str:
    if type(v) is not str:
        raise BridgeError(f"expected a string on the grading bridge, got {type(v).__name__}")
    return v


def integer(v) -> int:
    if type(v) is int:
        return v
    if type(v) is list and v[:1] == ["I"]:
        return wide_int(v)
    raise BridgeError("expected an integer on the grading bridge")


def number(v) -> float:
    if type(v) not in (int, float):
        raise BridgeError("expected a number on the grading bridge")
    return float(v)


class Codec:
    """Mixed into the connection: ``encode``/``decode``. Handles, exception mirrors and
    write-back slots come from the other mixins (``_handle``, ``_own_ref``, ``_restore``,
    ``encode_exception``, ``decode_exception``, ``_sent``, ``_pending``)."""

    def encode(self, v, depth: int = 0):
        t = type(v)
        if v is None or t is bool or t is str or t is float or (t is int and -(1 << 62) < v < (1 << 62)):
            return v
        if depth > MAX_DEPTH:
            raise BridgeError("value nested too deeply to send")
        out: list = []
        stack: list = [v]
        open_: set = set()
        top = True
        while stack:
            x = stack.pop()
            t = type(x)
            if x is None or t is bool or t is str or t is float:
                out.append(x)
            elif t is int:
                out.append(x if -(1 << 62) < x < (1 << 62) else ["I", format(x, "x")])
            elif t is Emit:
                if x.op is not None:
                    out.append(x.op)
                open_.discard(x.key)
            else:
                self._encode_node(x, t, out, stack, top, depth, open_)
            top = False
            if len(out) > MAX_ITEMS:
                raise BridgeError(f"value too large to send (over {MAX_ITEMS} items)")
        return ["V", out]

    def _open(self, v, open_: set) -> int:
        key = id(v)
        if key in open_:
            raise BridgeError(f"the {type(v).__name__} contains itself (a cycle): it cannot cross the grading bridge")
        if len(open_) >= MAX_VALUE_DEPTH:
            raise BridgeError(f"value nested deeper than {MAX_VALUE_DEPTH} levels: it cannot cross the grading bridge")
        open_.add(key)
        return key

    def _encode_node(self, v, t, out, stack, top, depth, open_) -> None:
        slot = None
        if top and self._sent is not None and (t is list or t is bytearray or t is dict or t is set):
            slot = len(self._sent) + 1
            self._sent[slot] = v
        if t is list or t is tuple or t is set or t is frozenset:
            items = list(v)
            stack.append(Emit([_CONTAINER_TAGS[t], len(items), slot], self._open(v, open_)))
            stack.extend(reversed(items))
        elif t is dict:
            stack.append(Emit(["d", len(v), slot], self._open(v, open_)))
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
        elif t is _loaded("decimal", "Decimal"):
            out.append(["D", str(v)])
        elif t is _loaded("fractions", "Fraction"):
            out.append(["Q", integer_op(v.numerator), integer_op(v.denominator)])
        elif t is range:
            out.append(["R", integer_op(v.start), integer_op(v.stop), integer_op(v.step)])
        elif t in _STDLIB_CONTAINERS:
            stack.append(Emit(None, self._open(v, open_)))
            stack.append(base_value(v))
        elif t.__module__ == "numpy" and self._encode_numpy(v, stack, open_):
            pass
        elif isinstance(v, _loaded("pathlib", "PurePath") or ()) or (isinstance(v, os.PathLike) and not isinstance(v, Proxy)):
            out.append(["P", os.fsdecode(os.fspath(v)), _path_kind(v)])
        else:
            own = self._own_ref(v)
            if own is not None:
                out.append(own)
            elif isinstance(v, BaseException):
                out.append(["X", self.encode_exception(v)])
            else:
                out.append(self._handle(v, depth + 1))

    def _encode_numpy(self, v, stack, open_) -> bool:
        np = sys.modules.get("numpy")
        if np is None:
            return False
        if isinstance(v, np.generic):
            item = v.item()
            if type(item) not in _PLAIN_ITEMS:
                return False  # datetime64 and friends: a handle
            stack.append(item)
            return True
        if type(v) is np.ndarray:
            kind = v.dtype.kind
            stack.append(Emit(["A", v.dtype.str if kind in _ARRAY_KINDS else None, list(v.shape)],
                              self._open(v, open_)))
            stack.append(v.tolist())
            return True
        return False

    def decode(self, raw, depth: int = 0, *, track: bool = False):
        if raw is None or isinstance(raw, (bool, int, float, str)):
            return raw
        if isinstance(raw, list) and raw[:1] == ["I"]:
            return wide_int(raw)
        if depth > MAX_DEPTH or not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[1], list)):
            raise BridgeError("malformed value on the grading bridge")
        if raw[0] != "V" or not raw[1]:
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
            n = integer(op[1])
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
        if tag == "I":
            return wide_int(op)
        if tag == "b":
            return base64.b64decode(text(op[1]), validate=True)
        if tag == "y":
            return bytearray(base64.b64decode(text(op[1]), validate=True))
        if tag == "c":
            return complex(number(op[1]), number(op[2]))
        if tag == "D":
            from decimal import Decimal

            return Decimal(text(op[1]))
        if tag == "Q":
            from fractions import Fraction

            return Fraction(integer(op[1]), integer(op[2]))
        if tag == "R":
            return range(integer(op[1]), integer(op[2]), integer(op[3]))
        if tag == "P":
            import pathlib

            kind = text(op[2])
            return getattr(pathlib, kind if kind in _PATH_KINDS else "Path")(text(op[1]))
        if tag == "A":
            if not stack:
                raise BridgeError("malformed array on the grading bridge")
            return _array(stack.pop(), op)
        if tag == "X":
            return self.decode_exception(op[1])
        return self._restore(op, depth)

    def encode_plain(self, v):
        """Encoding used to notice changes to a mutable argument (no slot tracking)."""
        saved = self._sent
        self._sent = None
        try:
            return self.encode(v)
        finally:
            self._sent = saved


def integer_op(n: int):
    return n if -(1 << 62) < n < (1 << 62) else ["I", format(n, "x")]


def _path_kind(v) -> str:
    name = type(v).__name__
    return name if name in _PATH_KINDS and type(v) is _loaded("pathlib", name) else "Path"


def _loaded(module: str, name: str):
    """``module.name`` if that module is imported, else None: no instance of a class of a
    module nobody imported can exist, so the codec need not import decimal, fractions or
    pathlib (~15 ms at the solution's start) to recognise their values."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def _array(items, op):
    """An ndarray rebuilt from its nested lists, where numpy is importable and the dtype
    is a plain one; else the nested lists."""
    if len(op) != 3 or not (op[1] is None or type(op[1]) is str) or type(op[2]) is not list:
        raise BridgeError("malformed array on the grading bridge")
    dtype, shape = op[1], [integer(n) for n in op[2]]
    np = _numpy_module() if dtype is not None else False
    if not np:
        return items
    kind = dtype.lstrip("<>|=")[:1]
    if kind not in _ARRAY_KINDS or len(dtype) > 12 or not dtype[-1:].isdigit():
        raise BridgeError(f"unsupported array dtype {dtype!r} on the grading bridge")
    return np.array(items, dtype=np.dtype(dtype)).reshape(shape)
