"""The grader's pytest plugin, loaded into every hidden test run with ``-p`` (both modes).

Copied into the sandbox under a random module name per grading (``_rw_<hex>.py``, with
``<same name>.json`` beside it), so workspace code cannot shadow it by name. Standard
library and pytest only; Python 3.9+ and any pytest of the last years (image tasks run
it on the image's interpreter). It is not told which tests are canaries: nothing in the
run's process names them.

It does three things, read by :mod:`sandbox.result_check`:

- writes what was collected (each item's node id and its JUnit classname/name, and every
  collector that failed or was skipped) to the config's ``out`` file, so the report can
  be checked against it case by case;
- defines the completion witness (:mod:`sandbox.witnesses`), a builtin under this
  grading's random name, and adds the nonces it was called with to that file at the end;
- in-env, serves the hidden test modules from memory: the grader leaves a placeholder
  at each hidden test file's path and the sources in a file the plugin reads and deletes
  when it is imported (before any conftest, collection or solution code), so solution
  code finds no hidden test file to read. pytest's assertion rewriting compiles them from
  memory (its ``_rewrite_test``/``_read_pyc`` are wrapped for those paths only; nothing
  is written to ``__pycache__``), and other imports of them go through a finder placed
  before the standard path finder.

PYTEST_DONT_REWRITE: nothing here needs assertion rewriting, and a run started by
sandbox/grading_boot.py imports this module before pytest marks it for rewriting.
"""

import builtins
import importlib.machinery
import importlib.util
import json
import os
import re
import sys

import pytest

_here = os.path.dirname(os.path.abspath(__file__))
_name = os.path.splitext(os.path.basename(__file__))[0]
with open(os.path.join(_here, _name + ".json")) as _f:
    _config = json.load(_f)
_collect_reports = []
_record = {"items": [], "collectors": []}
_witnessed = []


def _witness(nonce):
    _witnessed.append(nonce)


if _config.get("witness"):
    setattr(builtins, _config["witness"], _witness)


def _load_hidden(path):
    with open(path) as f:
        sources = json.load(f)
    os.unlink(path)
    return {os.path.realpath(p): s.encode() for p, s in sources.items()}


_hidden = _load_hidden(_config["hidden"]) if _config.get("hidden") else {}


def _is_hidden(fn):
    return bool(_hidden) and os.path.realpath(str(fn)) in _hidden


if _hidden:
    sys.dont_write_bytecode = True  # no compiled copy of a hidden test on disk
    try:
        from _pytest.assertion import rewrite as _rewrite
    except ImportError:  # pragma: no cover - every pytest in use has it
        _rewrite = None
    if _rewrite is not None:
        _orig_rewrite_test, _orig_read_pyc = _rewrite._rewrite_test, _rewrite._read_pyc

        def _rewrite_test(fn, config, *args, **kwargs):
            if not _is_hidden(fn):
                return _orig_rewrite_test(fn, config, *args, **kwargs)
            import ast

            source, strfn = _hidden[os.path.realpath(str(fn))], str(fn)
            tree = ast.parse(source, filename=strfn)
            _rewrite.rewrite_asserts(tree, source, strfn, config)
            # The first value only feeds the .pyc writer, off while sources are hidden.
            return b"", compile(tree, strfn, "exec", dont_inherit=True)

        def _read_pyc(source, pyc, *args, **kwargs):
            if _is_hidden(source):
                return None
            return _orig_read_pyc(source, pyc, *args, **kwargs)

        _rewrite._rewrite_test, _rewrite._read_pyc = _rewrite_test, _read_pyc

    class _HiddenLoader(importlib.machinery.SourceFileLoader):
        def get_data(self, path):
            if _is_hidden(path):
                return _hidden[os.path.realpath(path)]
            if path.endswith(".pyc"):
                raise OSError("no cached code for a hidden module")
            return super().get_data(path)

    class _HiddenFinder:
        """Hidden modules imported without assertion rewriting (helpers beside the tests,
        ``--assert=plain``): the standard path finder's spec, our loader."""

        @classmethod
        def find_spec(cls, name, path=None, target=None):
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or not spec.origin or not _is_hidden(spec.origin):
                return None
            return importlib.util.spec_from_file_location(
                name, spec.origin, loader=_HiddenLoader(name, spec.origin),
                submodule_search_locations=spec.submodule_search_locations)

    _at = next((i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder), len(sys.meta_path))
    sys.meta_path.insert(_at, _HiddenFinder)


def _mangle(nodeid):
    """pytest's own JUnit naming of a node id (classname, name)."""
    try:
        from _pytest.junitxml import mangle_test_address

        names = list(mangle_test_address(nodeid))
    except Exception:  # an old or changed pytest: the same rule, spelled out
        path, bracket, params = nodeid.partition("[")
        names = path.split("::")
        names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
        names[-1] += bracket + params
    try:
        from _pytest.junitxml import bin_xml_escape

        name = str(bin_xml_escape(names[-1]))
    except Exception:
        name = names[-1]
    return ".".join(names[:-1]), name


def _write():
    with open(_config["out"], "w") as f:
        json.dump(_record, f)


def pytest_collectreport(report):
    if not report.passed:
        _collect_reports.append([report.nodeid, "failed" if report.failed else "skipped"])


def pytest_collection_finish(session):
    for item in session.items:
        classname, name = _mangle(item.nodeid)
        _record["items"].append([item.nodeid, classname, name])
    for nodeid, outcome in _collect_reports:
        classname, name = _mangle(nodeid)
        _record["collectors"].append([nodeid, classname, name, outcome])
    _record["witnessed"] = []
    _write()


@pytest.hookimpl(tryfirst=True)  # before junitxml writes the report
def pytest_sessionfinish(session):
    if "witnessed" in _record:  # collection finished: its record exists
        _record["witnessed"] = list(_witnessed)
        _write()
