"""The capability boundary: what a test-side object may become on the solution's side.

The tests' end of the bridge hands the solution an object in one of three forms only:

* a plain value, copied (codec: None, bool, int of any size, float, str, bytes, containers,
  Decimal, Fraction, complex, range, paths, numpy scalars and arrays);
* an exception, as a mirror by value (its class's name and builtin bases, no message, no
  arguments, no traceback; mirrors) plus a token that only raising it back can use;
* a handle of one of the KINDS below, decided by the object's TYPE (never by the name
  it was reached by). The solution can ask for a handle's operations in ``OPS[kind]`` and
  its attributes in ``ATTRIBUTES`` only, and every result goes through this same
  classification: no chain of public attributes leads out of it.

Never handed out, whatever the route (TypeError in the test that tried, refused before
anything crosses): frames, code objects, tracebacks, modules, cells, class namespaces
(mapping proxies) and descriptors, builtins that run or reach code (eval, exec, compile,
__import__, getattr, globals, vars, open, ...), ``type`` and other builtin classes outside
a small allowlist, anything (function, class, instance) of the test framework, of the
bridge itself or of the tests' entry script, functions and classes of process-level
modules (os, sys, subprocess, importlib, gc, inspect, ctypes, signal, io, pathlib, ...),
and bound methods of any of these.
"""

from __future__ import annotations

import builtins
import functools
import types

FUNCTION, CLASS, EXC_CLASS, GENERATOR, OBJECT = "function", "class", "exception class", "generator", "object"

# Operations (the serving loop's "op" table, plus "call" and "methods") per kind.
_EVERY = frozenset({"str", "repr", "hash", "bool", "eq", "ne", "format", "isinstance", "issubclass"})
_OBJECT_OPS = frozenset({
    "call", "len", "iter", "next", "reversed", "contains", "getitem", "setitem", "delitem", "lt", "le", "gt", "ge",
    "int", "float", "index", "round", "basevalue", "enter", "exit", "neg", "pos", "abs", "invert", "divmod",
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift",
}) | _EVERY
OPS = {
    FUNCTION: _EVERY | {"call"},
    CLASS: _EVERY | {"call", "getitem", "or", "methods", "lt", "le", "gt", "ge"},
    EXC_CLASS: _EVERY | {"methods"},
    GENERATOR: _EVERY | {"iter", "next"},
    OBJECT: _OBJECT_OPS,
}
# Attribute names per kind. Every kind: the four naming dunders, as strings only. Objects
# and classes: public names (no leading underscore). Generators, coroutines and async
# generators: their driving methods only (never gi_frame, gi_code, gi_yieldfrom, cr_*, ag_*).
NAMING = frozenset({"__name__", "__qualname__", "__module__", "__doc__"})
_DRIVERS = frozenset({"send", "throw", "close", "asend", "athrow", "aclose"})


def attribute_allowed(kind: str, name: str) -> bool:
    if name in NAMING:
        return True
    if kind in (OBJECT, CLASS):
        return not name.startswith("_")
    return kind == GENERATOR and name in _DRIVERS


class Refused(TypeError):
    """A test-side object the solution may not hold (or an operation it may not do).
    Sent to the solution with its message (the message names types, never values)."""


# Never a handle, by type.
_NEVER = (types.FrameType, types.CodeType, types.TracebackType, types.ModuleType, types.CellType,
          types.MappingProxyType, types.GetSetDescriptorType, types.MemberDescriptorType, super)
_GENERATORS = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)
# The test framework, the bridge and the tests' entry script: nothing of theirs crosses.
_FRAMEWORK = {"pytest", "_pytest", "pluggy", "py", "iniconfig", "__main__", __name__.partition(".")[0]}
# Process-level modules: their functions and classes never cross (instances of a few do:
# an io.StringIO or a lock a test hands the solution on purpose).
_SYSTEM = frozenset({
    "sys", "os", "posix", "nt", "subprocess", "_posixsubprocess", "shutil", "importlib", "_imp", "zipimport",
    "gc", "inspect", "ctypes", "_ctypes", "signal", "_signal", "runpy", "code", "codeop", "pdb", "bdb", "pickle",
    "_pickle", "marshal", "multiprocessing", "faulthandler", "tracemalloc", "sysconfig", "site", "io", "_io",
    "pathlib", "tempfile", "atexit", "resource", "pty", "fcntl", "mmap", "builtins", "types", "_thread",
    "threading", "asyncio", "socket", "_socket", "linecache", "traceback", "weakref", "_weakref", "copyreg",
})
_SYSTEM_INSTANCES = frozenset({"sys", "os", "posix", "gc", "inspect", "importlib", "ctypes", "_ctypes"})
# Builtins a test may hand the solution as callables (sorted(key=len), map(str, ...)).
SAFE_BUILTINS = frozenset({
    "abs", "all", "any", "ascii", "bin", "callable", "chr", "divmod", "format", "hash", "hex", "isinstance",
    "issubclass", "iter", "len", "max", "min", "next", "oct", "ord", "pow", "print", "repr", "round", "sorted",
    "sum", "id",
})
_SAFE_BUILTIN_CLASSES = frozenset({
    bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset, range, slice, object,
    enumerate, zip, map, filter, reversed,
})
_DESCRIPTORS = (types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType,
                types.ClassMethodDescriptorType)


def _top(module) -> str:
    return module.partition(".")[0] if isinstance(module, str) else ""


def _module_of(cls) -> str:
    """A class's module, read past any metaclass trickery."""
    try:
        return _top(type.__getattribute__(cls, "__module__"))
    except AttributeError:
        return ""


def _framework(cls, strict: bool) -> bool:
    """Whether ``cls`` or a base of it belongs to the test framework (or the bridge, or the
    tests' entry script). ``strict``: a class that claims to be a builtin and is not one
    counts too (pytest's outcome exceptions say ``__module__ = "builtins"``; so do the
    classes of frames, functions and generators, which are never lent as classes)."""
    for klass in getattr(cls, "__mro__", (cls,)):
        module = _module_of(klass)
        if module in _FRAMEWORK:
            return True
        if strict and module == "builtins" and getattr(builtins, klass.__name__, None) is not klass:
            return True
    return False


def _refuse(v, why: str = "") -> Refused:
    return Refused(f"a test-side {type(v).__name__} cannot cross to the solution{why}")


def kind_of(v) -> str:
    """The kind of handle ``v`` (a test-side object that is not a plain value) crosses
    as, or Refused."""
    t = type(v)
    if isinstance(v, _NEVER) or isinstance(v, BaseException):
        raise _refuse(v)
    if isinstance(v, type):
        module = _module_of(v)
        if _framework(v, strict=True) or _framework(t, strict=False):
            raise _refuse(v, f" ({v.__name__} belongs to the test framework or is not a real builtin)")
        if issubclass(v, BaseException):
            return EXC_CLASS
        if module in _SYSTEM and v not in _SAFE_BUILTIN_CLASSES:
            raise _refuse(v, f" (class {v.__name__} of {module})")
        return CLASS
    if t in _GENERATORS:
        return GENERATOR
    if t is types.FunctionType:
        module = _top(v.__module__)
        if module in _FRAMEWORK or module in _SYSTEM:
            raise _refuse(v, f" ({v.__module__}.{v.__name__})")
        return FUNCTION
    if t is types.MethodType:
        kind_of(v.__func__)
        kind_of(v.__self__)
        return FUNCTION
    if t is types.BuiltinFunctionType or t in _DESCRIPTORS:
        return _callable(v)
    if t is functools.partial:
        kind_of(v.func)
        return OBJECT
    module = _module_of(t)
    if module in _SYSTEM_INSTANCES or _framework(t, strict=False):
        raise _refuse(v, f" ({module} object)")
    return OBJECT


def _callable(v) -> str:
    """A builtin function or method, or a slot wrapper."""
    name = getattr(v, "__name__", "")
    if type(v) is types.MethodWrapperType:  # obj.__eq__ of an object a test handed over
        kind_of(v.__self__)
        return FUNCTION
    if type(v) in _DESCRIPTORS:  # str.lower, dict.get: unbound methods of a class
        owner = getattr(v, "__objclass__", None)
        if name.startswith("_") or owner in (type, object) or not isinstance(owner, type):
            raise _refuse(v, f" ({name})")
        kind_of(owner)
        return FUNCTION
    owner = getattr(v, "__self__", None)
    if owner is None or isinstance(owner, types.ModuleType):  # len, math.sqrt, os.system
        module = getattr(owner, "__name__", None) or getattr(v, "__module__", None) or "builtins"
        if module == "builtins" and name in SAFE_BUILTINS:
            return FUNCTION
        if _top(module) in _FRAMEWORK or _top(module) in _SYSTEM:
            raise _refuse(v, f" ({module}.{name})")
        return FUNCTION
    if isinstance(owner, type) and (name.startswith("_") or name == "mro"):  # cls.mro, type navigation
        raise _refuse(v, f" ({owner.__name__}.{name})")
    kind_of(owner)  # received.append, dict.fromkeys: as the object (class) they belong to
    return FUNCTION
