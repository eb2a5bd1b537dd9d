"""SWE-style JSONL loader and the unified-diff applier it uses."""

from __future__ import annotations

import copy
import difflib
import json
import random
from pathlib import Path

import pytest

from tasks.check import run_hidden_tests
from tasks.patch import PatchError, apply_patch, patched_paths
from tasks.store import TaskStore
from tasks.swe import SWEFormatError, load_swe_jsonl, parse_row

EXAMPLE = Path(__file__).resolve().parents[1] / "tasks" / "swe_example.jsonl"


def example_rows() -> list[dict]:
    return [json.loads(line) for line in EXAMPLE.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_example_file_loads_into_task_specs():
    specs = {s.task_id: s for s in load_swe_jsonl(EXAMPLE)}
    assert list(specs) == ["rollway-examples__textkit-1", "rollway-examples__minicsv-7", "rollway-examples__units-3"]
    textkit = specs["rollway-examples__textkit-1"]
    assert textkit.task_set == "swe_example"
    assert textkit.difficulty == "easy"  # "<15 min fix"
    assert textkit.instruction.startswith("truncate() returns text longer")
    # hidden: the patched test file, its package __init__ and the helper module beside it
    assert sorted(textkit.hidden_tests) == ["tests/__init__.py", "tests/helpers.py", "tests/test_shorten.py"]
    assert "test_width_smaller_than_ellipsis" in textkit.hidden_tests["tests/test_shorten.py"]
    assert "test_width_smaller_than_ellipsis" not in textkit.files["tests/test_shorten.py"]  # agent sees pre-patch
    assert sorted(textkit.solution) == ["textkit/shorten.py"]
    assert textkit.test_command == (
        "python -m pytest -q -p no:cacheprovider"
        " hidden_tests/tests/test_shorten.py::test_width_smaller_than_ellipsis"
        " hidden_tests/tests/test_shorten.py::test_negative_width_rejected"
        " hidden_tests/tests/test_shorten.py::test_short_text_unchanged"
        " hidden_tests/tests/test_shorten.py::test_cut_with_ellipsis"
        " hidden_tests/tests/test_shorten.py::test_custom_ellipsis_fits_width"
    )
    assert textkit.metadata["repo"] == "rollway-examples/textkit"
    assert json.loads(textkit.metadata["FAIL_TO_PASS"]) == [
        "tests/test_shorten.py::test_width_smaller_than_ellipsis",
        "tests/test_shorten.py::test_negative_width_rejected",
    ]
    minicsv = specs["rollway-examples__minicsv-7"]
    assert sorted(minicsv.hidden_tests) == ["tests/test_basic.py", "tests/test_quotes.py"]
    assert "tests/test_quotes.py" not in minicsv.files  # created by the test patch
    units = specs["rollway-examples__units-3"]
    assert sorted(units.hidden_tests) == ["tests/test_convert.py"] and sorted(units.solution) == ["units/convert.py"]
    # the Task event samplers get carries no hidden test and no solution
    event = textkit.to_event("g1", 4)
    assert event.files == textkit.files and "hidden_tests" not in msgspec_fields(event)


def msgspec_fields(event) -> set[str]:
    return set(type(event).__struct_fields__)


def test_task_store_reads_a_jsonl_file():
    store = TaskStore(EXAMPLE)
    assert len(store) == 3
    assert store.get("rollway-examples__units-3").task_set == "swe_example"


@pytest.mark.slow
def test_gold_patch_passes_and_base_commit_fails():
    for spec in load_swe_jsonl(EXAMPLE):
        fixed = run_hidden_tests(spec, with_solution=True)
        assert fixed.all_passed, fixed.output
        base = run_hidden_tests(spec, with_solution=False)
        assert base.returncode == 1 and base.total == fixed.total, base.output
        # exactly the FAIL_TO_PASS tests fail on the base commit
        assert fixed.total - base.passed == len(json.loads(spec.metadata["FAIL_TO_PASS"]))


def _write(tmp_path: Path, rows: list, extra_lines: tuple[str, ...] = ()) -> Path:
    path = tmp_path / "bad.jsonl"
    lines = ["# comment line", ""] + [r if isinstance(r, str) else json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def _mutations():
    base = example_rows()[2]  # units: test_files / solution_files

    def m(fn):
        row = copy.deepcopy(base)
        fn(row)
        return row

    textkit = example_rows()[0]
    broken_patch = copy.deepcopy(textkit)
    broken_patch["test_patch"] = broken_patch["test_patch"].replace(" def test_cut_with_ellipsis", " def test_renamed")
    return [
        (m(lambda r: r.pop("instance_id")), "instance_id", "is required"),
        (m(lambda r: r.update(instance_id="a/b")), "instance_id", "may hold only"),
        (m(lambda r: r.update(problem_statement="  ")), "problem_statement", "must not be empty"),
        (m(lambda r: r.update(files=["x.py"])), "files", "must be an object"),
        (m(lambda r: r.update(files={"../evil.py": "x"})), "files", "bad path"),
        (m(lambda r: r.update(files={"a.py": 3})), "files", "content must be text"),
        (m(lambda r: r.update(FAIL_TO_PASS="[not json")), "FAIL_TO_PASS", "not a JSON list"),
        (m(lambda r: r.update(FAIL_TO_PASS=[])), "FAIL_TO_PASS", "at least one test"),
        (m(lambda r: r.update(FAIL_TO_PASS=["test_inches (tests.TestConvert)"])), "FAIL_TO_PASS", "not a pytest node id"),
        (m(lambda r: r.update(PASS_TO_PASS=["tests/test_missing.py::test_a"])), "PASS_TO_PASS", "neither in files"),
        (m(lambda r: r.update(test_patch="--- a/x\n")), "test_files", "either test_patch or test_files"),
        (m(lambda r: r.update(difficulty="1 week")), "difficulty", "is not one of"),
        (m(lambda r: r.update(stars=5)), "stars", "unknown field"),
        (m(lambda r: r.update(version=1.0)), "version", "must be a string"),
        (broken_patch, "test_patch", "does not apply"),
    ]


@pytest.mark.parametrize("row, field, message", _mutations())
def test_bad_rows_name_line_and_field(tmp_path, row, field, message):
    good = example_rows()[1]
    path = _write(tmp_path, [good, row])  # the bad row is on line 4
    with pytest.raises(SWEFormatError) as info:
        load_swe_jsonl(path)
    err = info.value
    assert (err.line, err.field) == (4, field), str(err)
    assert f"{path}:4: field {field!r}" in str(err) and message in str(err)


def test_invalid_json_and_duplicates_name_the_line(tmp_path):
    row = example_rows()[2]
    with pytest.raises(SWEFormatError, match=r"bad\.jsonl:4: not valid JSON"):
        load_swe_jsonl(_write(tmp_path, [row, "{not json"]))
    with pytest.raises(SWEFormatError, match=r":4: field 'instance_id': 'rollway-examples__units-3' already defined on line 3"):
        load_swe_jsonl(_write(tmp_path, [row, row]))
    with pytest.raises(SWEFormatError, match=r":3: a line must hold a JSON object"):
        load_swe_jsonl(_write(tmp_path, ["[1, 2]"]))


def test_unknown_fields_allowed_when_asked():
    row = dict(example_rows()[2], stars=5, image_name="x")
    spec = parse_row(row, allow_unknown_fields=True)
    assert spec.task_id == "rollway-examples__units-3"


def test_apply_patch_matches_difflib_on_random_edits():
    rng = random.Random(1)
    checked = 0
    for _ in range(300):
        a = [f"line {rng.randrange(20)}\n" for _ in range(rng.randrange(0, 30))]
        b = list(a)
        for _ in range(rng.randrange(1, 6)):
            op = rng.random()
            if op < 0.4 and b:
                del b[rng.randrange(len(b))]
            elif op < 0.8:
                b.insert(rng.randrange(len(b) + 1), f"new {rng.randrange(99)}\n")
            elif b:
                b[rng.randrange(len(b))] = "changed\n"
        diff = "".join(difflib.unified_diff(a, b, "a/f.py", "b/f.py", n=rng.choice([0, 1, 3])))
        if diff:
            assert apply_patch({"f.py": "".join(a), "other.py": "x"}, diff) == {"f.py": "".join(b), "other.py": "x"}
            checked += 1
    assert checked > 250


def test_apply_patch_new_deleted_and_no_newline_files():
    new = "".join(difflib.unified_diff([], ["x\n", "y"], "/dev/null", "b/pkg/new.py"))
    new += "\n\\ No newline at end of file\n"
    assert apply_patch({}, new) == {"pkg/new.py": "x\ny"}
    assert patched_paths(new) == ["pkg/new.py"]
    gone = "".join(difflib.unified_diff(["x\n"], [], "a/old.py", "/dev/null"))
    assert apply_patch({"old.py": "x\n", "keep.py": ""}, gone) == {"keep.py": ""}


def test_apply_patch_errors_name_file_and_hunk():
    diff = "".join(difflib.unified_diff(["a\n", "b\n"], ["a\n", "c\n"], "a/f.py", "b/f.py"))
    with pytest.raises(PatchError, match=r"f\.py: hunk 1 does not apply at line 2: expected 'b', found 'B'"):
        apply_patch({"f.py": "a\nB\n"}, diff)
    with pytest.raises(PatchError, match="not in the repository"):
        apply_patch({}, diff)
    with pytest.raises(PatchError, match="truncated"):
        apply_patch({"f.py": "a\nb\n"}, diff.rsplit("\n", 2)[0] + "\n")
