"""The grader's pytest plugin, loaded into every hidden test run with ``-p`` (both modes).

Copied into the sandbox under a random module name per grading (``_rw_<hex>.py``, with
``<same name>.json`` beside it), so workspace code cannot shadow it by name. Standard
library and pytest only; Python 3.9+ and any pytest of the last years (image tasks run
it on the image's interpreter).

It does two things, read by :mod:`sandbox.result_check`:

- moves the per-grading canary tests (:mod:`sandbox.canaries`, named in the config) after
  every real test, so the real tests run exactly as they would without them;
- writes what was collected (each item's node id and its JUnit classname/name, and every
  collector that failed or was skipped) to the config's ``out`` file, so the report can
  be checked against it case by case.
"""

import json
import os
import re

_here = os.path.dirname(os.path.abspath(__file__))
_name = os.path.splitext(os.path.basename(__file__))[0]
with open(os.path.join(_here, _name + ".json")) as _f:
    _config = json.load(_f)
_CANARIES = frozenset(_config.get("canaries", ()))
_collect_reports = []


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


def _is_canary(item):
    name = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
    return name in _CANARIES


def pytest_collection_modifyitems(session, config, items):
    real = [i for i in items if not _is_canary(i)]
    items[:] = real + [i for i in items if _is_canary(i)]


def pytest_collectreport(report):
    if not report.passed:
        _collect_reports.append([report.nodeid, "failed" if report.failed else "skipped"])


def pytest_collection_finish(session):
    items = []
    for item in session.items:
        classname, name = _mangle(item.nodeid)
        items.append([item.nodeid, classname, name])
    collectors = []
    for nodeid, outcome in _collect_reports:
        classname, name = _mangle(nodeid)
        collectors.append([nodeid, classname, name, outcome])
    with open(_config["out"], "w") as f:
        json.dump({"items": items, "collectors": collectors}, f)
