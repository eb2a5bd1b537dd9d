"""Which files of a task's repository grading runs from the task's bytes as test support
(sandbox/test_support.py; TaskSpec.test_support): the rule table, what it leaves to the
agent (code under test), and the declared field as task.toml and SWE rows give it. No
sandbox: the grading of these files, both modes, is tests/test_grader_hostile.py's
HELPER_TASKS and tests/test_image_repo.py's image-only helper."""

from __future__ import annotations

import json

import msgspec
import pytest

from sandbox.test_support import marked, support_files
from tasks.spec import TaskSpec
from tasks.store import load_task
from tasks.swe import SWEFormatError, parse_row, with_image_repo

CHECK = b"def check(got, want):\n    assert got == want\n"


def _spec(**kw) -> TaskSpec:
    return TaskSpec(task_id="t", instruction="i", files={}, hidden_tests={}, **kw)


@pytest.mark.parametrize("path, is_marked", [
    ("testing_support.py", True), ("test_utils.py", True), ("testutils.py", True), ("TestHelpers.py", True),
    ("helpers_test.py", True), ("unit_tests.py", True), ("mylib/_test_utils.py", True),
    ("tests_common/asserts.py", True), ("testing_support/__init__.py", True),
    # Code under test in real repositories: never marked by name.
    ("click/testing.py", False), ("numpy/testing/_private/utils.py", False), ("django/test/utils.py", False),
    ("pandas/_testing/asserters.py", False), ("testing.py", False), ("test.py", False),
    ("testtools/matchers.py", False), ("pytest_plugin.py", False), ("contest_utils.py", False),
    ("mylib/__init__.py", False),
])
def test_which_module_names_mark_test_support(path, is_marked):
    assert marked(path) is is_marked


FILES = {
    "mathutil.py": b"def sum_to(n):\n    return 0\n",
    "testing_support.py": CHECK,                       # imported by the hidden tests
    "testing_unused.py": CHECK,                        # marked, imported by nothing
    "pkg/__init__.py": b"",
    "pkg/testing_utils.py": b"from testing_extra import more\n",  # imported, imports another
    "testing_extra.py": b"def more():\n    pass\n",
    "conftest.py": b"import importlib\nPLUGIN = importlib.import_module('testing_plugin_support')\n",
    "testing_plugin_support.py": b"",
    "tests/helpers.py": CHECK,                         # tests by their place (7cabf75)
    "tests/rel/__init__.py": b"",
    "tests/rel/test_here.py": b"from .testing_local import x\n",
    "tests/rel/testing_local.py": b"x = 1\n",
    "checks.py": CHECK,                                # no rule marks this name
    "click/testing.py": b"class CliRunner: ...\n",     # code under test, though imported
}
TESTS = {"hidden_tests/test_x.py": (b"from testing_support import check\nimport pkg.testing_utils\n"
                                    b"from click.testing import CliRunner\nimport tests.rel.test_here\n"
                                    b"def test_a():\n    import checks\n")}


def test_the_default_rule_follows_what_the_hidden_tests_and_conftests_import():
    found = support_files(_spec(), FILES, TESTS)
    assert sorted(found) == ["pkg/testing_utils.py", "testing_extra.py", "testing_plugin_support.py",
                             "testing_support.py", "tests/helpers.py", "tests/rel/__init__.py",
                             "tests/rel/test_here.py", "tests/rel/testing_local.py"]
    assert found["testing_support.py"] == CHECK


def test_what_the_reference_solution_changes_is_never_support():
    """A marked module the gold patch changes (or a file in the marked package it changes)
    is code under test: an honest fix of it must run."""
    spec = _spec(solution={"pkg/testing_utils.py": "", "tests/helpers.py": ""}, solution_deletes=["testing_support.py"])
    found = support_files(spec, FILES, TESTS)
    assert not {"pkg/testing_utils.py", "testing_extra.py", "tests/helpers.py", "testing_support.py"} & set(found)
    files = {**FILES, "testing_support/__init__.py": b"", "testing_support/asserts.py": CHECK}
    tests = {"hidden_tests/test_y.py": b"from testing_support.asserts import check\n"}
    assert {"testing_support/__init__.py", "testing_support/asserts.py"} <= set(support_files(_spec(), files, tests))
    gold = _spec(solution={"testing_support/core.py": ""})
    assert not {"testing_support/__init__.py", "testing_support/asserts.py"} & set(support_files(gold, files, tests))


def test_a_declaration_replaces_the_guess_by_name():
    found = support_files(_spec(test_support=["checks.py", "data/**"]), {**FILES, "data/x.json": b"{}"}, TESTS)
    # The declared files and the tests folder's; no module guessed by its name.
    assert sorted(found) == ["checks.py", "data/x.json", "tests/helpers.py", "tests/rel/__init__.py",
                             "tests/rel/test_here.py", "tests/rel/testing_local.py"]
    assert sorted(support_files(_spec(test_support=[]), FILES, TESTS)) == [
        "tests/helpers.py", "tests/rel/__init__.py", "tests/rel/test_here.py", "tests/rel/testing_local.py"]


def test_an_images_files_are_read_only_where_they_could_be_support():
    asked = []

    def read(path):
        asked.append(path)
        return b"# latin-1 \xe9\n" + CHECK

    found = support_files(_spec(), {"mathutil.py": b""}, TESTS, more=["mathutil.py", "testing_support.py", "README.md",
                                                                       "vendor/big.bin"], read=read)
    assert asked == ["testing_support.py"] and found == {"testing_support.py": b"# latin-1 \xe9\n" + CHECK}


@pytest.mark.parametrize("entries, message", [
    ("checks.py", "must be a list"), (["/abs.py"], "relative"), (["../up.py"], "relative"), ([""], "relative"),
    (["*.py"], "covers mathutil.py, which the reference solution changes"),
])
def test_a_bad_declaration_is_refused(entries, message):
    with pytest.raises(ValueError, match=message):
        _spec(solution={"mathutil.py": ""}, test_support=entries)


@pytest.mark.parametrize("path, declared", [
    ("checks.py", True), ("sub/checks.py", False), ("support/a.py", True), ("support/deep/b.py", True),
    ("support/a.txt", False), ("fixtures/x/y.json", True), ("fixturesx", False),
])
def test_declared_entries_are_paths_globs_or_folders(path, declared):
    spec = _spec(test_support=["checks.py", "support/**/*.py", "fixtures"])
    assert spec.declares_test_support(path) is declared


def test_task_toml_declares_it_and_samplers_never_see_it(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo/checks.py").write_text(CHECK.decode())
    (tmp_path / "hidden_tests").mkdir()
    (tmp_path / "hidden_tests/test_a.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "task.toml").write_text('instruction = "x"\ntest_support = ["checks.py"]\n')
    spec = load_task(tmp_path)
    assert spec.test_support == ["checks.py"]
    event = msgspec.json.decode(msgspec.json.encode(spec.to_event("g", 2)))
    assert "test_support" not in event and "checks.py" in event["files"]
    (tmp_path / "task.toml").write_text('instruction = "x"\n')
    assert load_task(tmp_path).test_support is None


ROW = {
    "instance_id": "r-1", "problem_statement": "fix", "FAIL_TO_PASS": ["tests/test_a.py::test_a"],
    "files": {"lib.py": "X = 1\n", "checks.py": CHECK.decode(), "tests/test_a.py": "def test_a():\n    pass\n"},
    "patch": "--- a/lib.py\n+++ b/lib.py\n@@ -1 +1 @@\n-X = 1\n+X = 2\n",
}


def test_a_swe_row_declares_it_checked_against_its_gold_patch():
    assert parse_row({**ROW, "test_support": ["checks.py"]}).test_support == ["checks.py"]
    assert parse_row(ROW).test_support is None
    with pytest.raises(SWEFormatError, match="field 'test_support': entry '\\*.py' covers lib.py"):
        parse_row({**ROW, "test_support": ["*.py"]})
    with pytest.raises(SWEFormatError, match="field 'test_support': must be a list"):
        parse_row({**ROW, "test_support": "checks.py"})
    # An image-only row keeps it, and is checked against its gold patch where it is made whole.
    image_only = {k: v for k, v in ROW.items() if k != "files"} | {"image": "x/y:1", "test_support": ["*.py"]}
    deferred = parse_row(image_only)
    assert deferred.test_support == ["*.py"] and json.loads(deferred.image_repo_row)["test_support"] == ["*.py"]
    with pytest.raises(SWEFormatError, match="covers lib.py"):
        with_image_repo(deferred, ROW["files"])
    whole = with_image_repo(parse_row({**image_only, "test_support": ["checks.py"]}), ROW["files"])
    assert whole.test_support == ["checks.py"]


def test_both_modes_take_the_tasks_bytes_for_declared_modules_and_data():
    """In-env: restored in the run's tree, each change named; bridged: modules load in the
    tests' process (plugins), data lies in the tests' workspace (own)."""
    from sandbox import grading_bridged, grading_inenv
    from sandbox.grading_common import make_plan

    spec = TaskSpec(task_id="t", instruction="i", hidden_tests={}, test_support=["checks.py", "data/**"],
                    files={"mathutil.py": "X = 1\n", "checks.py": CHECK.decode(), "data/want.json": "[55]\n"})
    plan = make_plan(["hidden_tests"], {"hidden_tests/test_x.py": "from checks import check\n"}, {})
    agent = {"mathutil.py": b"X = 2\n", "checks.py": b"def check(*a):\n    pass\n", "data/want.json": b"[-1]\n"}
    files, notes, _ = grading_inenv.tree(spec, agent, plan)
    assert (files["checks.py"], files["data/want.json"], files["mathutil.py"]) == (CHECK, b"[55]\n", b"X = 2\n")
    assert notes == ["checks.py (changed, restored)", "data/want.json (changed, restored)"]
    own, plugins = grading_bridged.tests_side(spec, plan, {}, {})
    assert (own, plugins) == ({"data/want.json": b"[55]\n"}, {"checks.py": CHECK})
