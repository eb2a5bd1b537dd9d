"""Starts an in-env hidden run whose task says ``python -m pytest``, run by path instead.

``python -m pytest`` puts the working folder, the agent's tree, first on sys.path before
pytest starts, so a module of the tree named like a standard module pytest imports on
its way up (``argparse.py``, ``shlex.py``, ``dataclasses.py``) ran before the grader's
plugin, and could read the hidden test sources the plugin reads and deletes when it is
imported (canaries and witness nonces in them). Run by path, sys.path starts with this
folder (the grader's own), so: the plugin (named after this file, ``<plugin>_boot.py``)
is imported first, with pytest and what it imports from the interpreter's own paths;
then the working folder goes first on sys.path, where ``python -m`` puts it, and pytest
runs as ``python -m pytest`` would run it. sys.path entries inside the working folder
(an image's editable install puts them there from a ``.pth``) are left out while the
plugin is imported. The plugin's docstring says
PYTEST_DONT_REWRITE, so pytest does not warn that the ``-p`` plugin was imported early.
Standard library only; Python 3.9+.
"""

import os
import runpy
import sys

_plugin = os.path.basename(__file__)[: -len("_boot.py")]
# sys.path[0] once the plugin is in: None for ``python -m pytest`` (the working folder);
# a console script's own folder where the task's command is one (written in by the grader:
# sandbox/grading_inenv.py boot_prefix).
_PATH0 = None
_cwd = os.path.realpath(os.getcwd())


def _outside_tree(entry):
    path = os.path.realpath(entry or ".")
    return _cwd == "/" or (path != _cwd and not path.startswith(_cwd + os.sep))


# An image's editable install may put the tree on sys.path at start-up (a path line in a
# .pth, ``/testbed`` or ``/testbed/src``): a module of the tree that pytest's imports look
# for and the interpreter lacks (``org.python.core``, tried by ``copy``) ran before the
# plugin and read the hidden sources. The tree's entries are left out while the plugin loads.
_path = sys.path[:]
sys.path[:] = [entry for entry in _path if _outside_tree(entry)]
__import__(_plugin)
sys.path[:] = _path
sys.path[0] = _PATH0 or os.getcwd()
runpy.run_module("pytest", run_name="__main__", alter_sys=True)
