"""The tests' side: importing solution modules (proxies of modules living in the solution).

Where a proxy module's source is (``inspect.getsource``) is decided here, from the
module's name and the grader's own copy of the workspace (``sources``): a module's
self-declared ``__file__`` is never asked for, so solution code cannot point the tests'
source inspection at a decoy.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os

from .proxies import RemoteModule
from .wire import BridgeError


class SolutionFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: a module the tests import that nothing local provides,
    whose top-level name the workspace defines, is the solution's module (a proxy)."""

    def __init__(self, conn, tops: set, workspace: str, sources: str) -> None:
        self.conn = conn
        self.tops = tops
        self.workspace = workspace.rstrip("/") + "/"
        self.sources = sources.rstrip("/") + "/"

    def source_of(self, fullname: str):
        """(path of the module's source in the grader's copy, is a package), or None."""
        parts = fullname.split(".")
        if not all(p.isidentifier() for p in parts):
            return None
        base = self.sources + "/".join(parts)
        if os.path.isfile(base + "/__init__.py"):
            return base + "/__init__.py", True
        if os.path.isfile(base + ".py"):
            return base + ".py", False
        return None

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.tops:
            return None
        try:
            module = self.conn.rpc("import", fullname)
        except ModuleNotFoundError:
            return None
        if not isinstance(module, RemoteModule):
            raise BridgeError(f"the solution answered the import of {fullname!r} with something that is not a module")
        found = self.source_of(fullname)
        origin, is_package = found if found is not None else (None, module.__dict__["_bridge_package"])
        spec = importlib.util.spec_from_loader(fullname, self, origin=origin, is_package=is_package)
        spec.has_location = origin is not None
        spec._bridge_module = module
        return spec

    def create_module(self, spec):
        return spec._bridge_module

    def exec_module(self, module):
        return None
