"""The bridge between the hidden tests and the solution: two processes, plain data between.

The grader runs the hidden tests and the agent's code in two separate sandboxes joined by
two pipes (:mod:`sandbox.grader`). This package is the protocol both ends speak; the
grader copies its files (``FILES``) into each sandbox as the package ``/grader/_rollway_bridge``.
Standard library only, Python 3.9+ (it runs on task images' own interpreters).

One job per module:

- ``wire``: frames of strict ASCII JSON on the pipes (ints of any size);
- ``codec``: what crosses by value and how (a fresh copy on the receiving side);
- ``capabilities``: **the capability boundary**: which test-side objects may be lent to
  the solution as handles, as which kind, and what the solution may do with each kind;
- ``handles``: the table of lent objects (checked against capabilities on the tests'
  side) and the proxies of the peer's objects;
- ``mirrors``: exceptions by value (never handles);
- ``proxies``: the receiving side's stand-ins for the peer's objects;
- ``deferral``: calls whose result a test does not use go without a round trip;
- ``sites``: which call sites those are, read from the tests' bytecode;
- ``serving``: the connection: requests, answers, dispatch of the peer's requests;
- ``importer``: the tests' side's import of solution modules (sources from the grader);
- ``sitepath``: the sandboxed interpreter's site setup, less the grader's own install;
- ``entry``: what both entry scripts do around their side's work (config, site, connect,
  the ``os._exit`` at the end).

docs/sandbox.md describes what crosses and what never does.
"""

from __future__ import annotations

from .capabilities import Refused, kind_of
from .codec import MAX_DEPTH, MAX_ITEMS, MAX_VALUE_DEPTH
from .deferral import DEFER_SETTLE_CALLS, DEFER_WRITE_BYTES, DeferredCallError
from .serving import Connection, connect
from .wire import HEADER, MAX_MESSAGE_BYTES, BridgeError, dumps, loads

FILES = ("__init__.py", "wire.py", "codec.py", "capabilities.py", "handles.py", "mirrors.py", "proxies.py",
         "deferral.py", "sites.py", "serving.py", "importer.py", "sitepath.py", "entry.py")

PACKAGE = "_rollway_bridge"


def __getattr__(name):
    # The tests' side only: importlib.abc pulls in importlib.resources, tempfile, shutil
    # and typing (~20 ms), which the solution's process has no use for.
    if name == "SolutionFinder":
        from .importer import SolutionFinder

        return SolutionFinder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(folder) -> None:
    """Write this package into ``folder/_rollway_bridge`` (the grader's /grader), files
    read-only to everyone else."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    target = os.path.join(os.fspath(folder), PACKAGE)
    os.makedirs(target, mode=0o755, exist_ok=True)
    os.chmod(target, 0o755)
    for name in FILES:
        with open(os.path.join(here, name), "rb") as src, open(os.path.join(target, name), "wb") as dst:
            dst.write(src.read())
        os.chmod(os.path.join(target, name), 0o644)


__all__ = [
    "DEFER_SETTLE_CALLS", "DEFER_WRITE_BYTES", "FILES", "HEADER", "MAX_DEPTH", "MAX_ITEMS", "MAX_MESSAGE_BYTES",
    "MAX_VALUE_DEPTH", "BridgeError", "Connection", "DeferredCallError", "Refused", "SolutionFinder", "connect",
    "dumps", "install", "kind_of", "loads",
]
