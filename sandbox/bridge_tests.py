"""Entry point of the tests' sandbox in a grading run (copied to /grader there).

Runs pytest on the hidden tests. The workspace's modules are not on this process's
path: imports of the top-level names the workspace defines (listed in the config file)
resolve to proxies of the modules living in the solution's process, across the bridge.
Where the grader gives both sandboxes a shared scratch folder (``scratch`` in the config),
pytest's temporary folders (``tmp_path``, ``tmp_path_factory``) are made there and opened
to the solution's uid, so a path a test hands the solution names the same file on both
sides.

Everything runs under the ``__main__`` guard, as in bridge_solution.py: a hidden test's
``multiprocessing`` pool with the ``spawn`` or ``forkserver`` start method re-imports this
script in each worker (as ``__mp_main__``), which would otherwise connect to the bridge
and run pytest again there.
"""

import os
import sys
import time

connection = None  # the bridge (main())


class _LocalModules:
    """First on ``sys.meta_path``: the repository's pytest plugin modules the grader laid
    in this sandbox from the task's own tree (``local_modules``: name -> file) load here,
    never from the solution (whose copy is the agent's), even inside a package of the
    workspace whose other modules are the solution's."""

    def __init__(self, files: dict) -> None:
        self.files = files

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.files:
            return None
        import importlib.util

        return importlib.util.spec_from_file_location(fullname, self.files[fullname])


def _share_temporary_folders(scratch: str, args: list) -> list:
    """pytest's temporary folders under the shared scratch folder, readable and writable
    by the solution's uid (another uid: pytest makes them 0700), files the tests write
    there too (umask 0). Returns pytest's arguments with ``--basetemp`` added."""
    if any(a == "--basetemp" or a.startswith("--basetemp=") for a in args):
        return args
    os.umask(0)
    try:
        from _pytest.tmpdir import TempPathFactory

        def opened(method, mode):
            def wrapper(self, *a, **kw):
                path = method(self, *a, **kw)
                try:
                    os.chmod(path, mode)
                except OSError:
                    pass
                return path
            wrapper.__name__ = method.__name__
            return wrapper

        TempPathFactory.getbasetemp = opened(TempPathFactory.getbasetemp, 0o755)
        TempPathFactory.mktemp = opened(TempPathFactory.mktemp, 0o777)
    except (ImportError, AttributeError):  # an old pytest: tmp_path stays private to the tests
        pass
    return [*args, f"--basetemp={scratch.rstrip('/')}/pytest"]


def _settle_deferred_calls(pytest):
    """A plugin that lets a test function's solution calls whose results it does not use
    go without a round trip each (sandbox.bridge, Connection.try_defer), and settles them
    when the test function ends, inside its call phase: a failed one fails that test.
    None, and every call waits for its answer, on a pytest without new-style wrappers."""
    try:
        from _pytest.python import pytest_pyfunc_call as run_test_function

        class SettleDeferredCalls:
            @pytest.hookimpl(wrapper=True)
            def pytest_pyfunc_call(self, pyfuncitem):
                connection.begin_call()
                try:
                    return (yield)
                finally:
                    connection.end_call()

    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    connection.defer_calls_from(run_test_function.__code__)
    # A deferred call runs before the tests look at the clock: "call, sleep, call" or
    # "read the time, call, read the time" see it where it was written. Patched after
    # pytest's own import (pytest's timing keeps the originals), before the tests import.
    for name in _CLOCKS:
        if hasattr(time, name):
            setattr(time, name, _settling(getattr(time, name)))
    return SettleDeferredCalls()


_CLOCKS = ("sleep", "time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns")


def _settling(clock):
    def settled_first(*args):
        connection.settle()
        return clock(*args)

    settled_first.__name__ = settled_first.__qualname__ = clock.__name__
    settled_first.__doc__ = clock.__doc__
    return settled_first


def _run_pytest(config: dict, bridge_connection) -> int:
    """The tests' side's work (``_rollway_bridge.entry.run_entry``): pytest on the hidden
    tests, the workspace's modules imported across the bridge."""
    global connection
    connection = bridge_connection
    from _rollway_bridge import SolutionFinder

    sys.meta_path.append(SolutionFinder(connection, set(config["modules"]), config["workspace"], config["sources"]))
    if config.get("local_modules"):
        sys.meta_path.insert(0, _LocalModules(config["local_modules"]))
    import pytest

    plugin = _settle_deferred_calls(pytest)
    arguments = sys.argv[1:]
    if config.get("scratch"):
        arguments = _share_temporary_folders(config["scratch"], arguments)
    return int(pytest.main(arguments, plugins=[plugin] if plugin is not None else []))


def main() -> None:
    # The bridge package lies next to this script; run_entry takes this folder off the
    # path again at once, reads bridge.json, connects, and ends the process (os._exit).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from _rollway_bridge.entry import run_entry

    run_entry(here, "tests", _run_pytest)


if __name__ == "__main__":
    main()
