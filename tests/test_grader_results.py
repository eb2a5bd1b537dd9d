"""The result check and the canaries, without a sandbox (milliseconds each), plus one
host pytest run of the grader's plugin (about a second).

sandbox/result_check.py: an honest report passes; every way a report can disagree with
what was selected and collected is tampering, named. sandbox/canaries.py: canaries copy
the task's own tests under fresh names, leave the real tests untouched, and their
mutants fail where the original passes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.canaries import Canary, plan
from sandbox.grading_common import REPORT_FILE, make_plan, plugin_dir
from sandbox.junit import parse_report
from sandbox.result_check import check
from sandbox.test_selection import ExpectedTest, select
from sandbox.witnesses import Site, instrument

TESTS = {
    "hidden_tests/test_calc.py": (
        "import pytest\nfrom calc import add, Box\n\n"
        "def test_ints():\n    assert add(2, 3) == 5\n\n"
        "def test_order():\n    assert Box(1) < Box(2)\n\n"
        "@pytest.mark.parametrize('a,b', [(1, 2), (3, 4)])\ndef test_pairs(a, b):\n    assert add(a, b) == a + b\n\n"
        "class TestMore:\n    def test_zero(self):\n        assert add(0, 0) == 0\n"
    ),
}
SELECTION = select(["-q", "hidden_tests"], TESTS, {})
CLS = "hidden_tests.test_calc"
IDS = [("test_ints", CLS), ("test_order", CLS), ("test_pairs[1-2]", CLS), ("test_pairs[3-4]", CLS),
       ("test_zero", CLS + ".TestMore")]


def node(name: str, cls: str) -> str:
    return "hidden_tests/test_calc.py::" + ("TestMore::" if cls.endswith("TestMore") else "") + name


def junit(cases: list[tuple[str, str, str]], *, tests: int | None = None, time: float = 1.0,
          case_time: float = 0.01) -> bytes:
    body = ""
    for name, cls, outcome in cases:
        child = {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped/>"}[outcome]
        body += f'<testcase classname="{cls}" name="{name}" time="{case_time}">{child}</testcase>'
    failures = sum(o == "failed" for *_, o in cases)
    skipped = sum(o == "skipped" for *_, o in cases)
    n = len(cases) if tests is None else tests
    return (f'<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="0" failures="{failures}" '
            f'skipped="{skipped}" tests="{n}" time="{time}">{body}</testsuite></testsuites>').encode()


def collected(ids: list[tuple[str, str]], collectors: list[list[str]] = ()) -> bytes:
    return json.dumps({"items": [[node(n, c), c, n] for n, c in ids], "collectors": list(collectors)}).encode()


CANARIES = [
    Canary(name="test_ints_again", original="test_ints", cls="", path="hidden_tests/test_calc.py", must="fail",
           kind="literal"),
    Canary(name="test_order_more", original="test_order", cls="", path="hidden_tests/test_calc.py", must="pass"),
]
WITH_CANARIES = IDS + [("test_ints_again", CLS), ("test_order_more", CLS)]


def run_check(cases, ids=WITH_CANARIES, canaries=CANARIES, **kwargs):
    return check(parse_report(junit(cases, **kwargs)), collected(ids), SELECTION, canaries, wall_s=5.0)


def honest(outcomes: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    outcomes = {"test_ints_again": "failed", **(outcomes or {})}
    return [(n, c, outcomes.get(n, "passed")) for n, c in WITH_CANARIES]


def test_selection_lists_functions_params_and_class_methods():
    assert [e.nodeid for e in SELECTION.expected] == [
        "hidden_tests/test_calc.py::test_ints", "hidden_tests/test_calc.py::test_order",
        "hidden_tests/test_calc.py::test_pairs", "hidden_tests/test_calc.py::TestMore::test_zero"]
    by_id = select(["hidden_tests/test_calc.py::test_pairs[1-2]", "-x"], TESTS, {})
    assert by_id.by_node_id and by_id.stops_early
    assert by_id.expected == [ExpectedTest(path="hidden_tests/test_calc.py", cls="", name="test_pairs",
                                           params="[1-2]")]
    # A config that changes the collection rules, or a filter: nothing is expected statically.
    assert select(["hidden_tests"], TESTS, {"pytest.ini": "[pytest]\npython_functions = check_*\n"}).expected == []
    assert select(["-k", "ints", "hidden_tests"], TESTS, {}).expected == []


def test_honest_report_passes_and_canaries_are_not_scored():
    result = run_check(honest({"test_order": "failed", "test_order_more": "failed"}))
    assert result.tampering == []
    assert (result.outcomes.total, result.outcomes.passed) == (5, 4)
    assert result.outcomes.failed == ["hidden_tests.test_calc::test_order"]
    assert result.canaries_run == 2


@pytest.mark.parametrize("cases,ids,kwargs,reason", [
    ([c for c in honest() if c[0] != "test_zero"], WITH_CANARIES, {}, "collected tests missing from the report"),
    (honest() + [("test_extra", CLS, "passed")], WITH_CANARIES, {}, "never collected: hidden_tests.test_calc::test_extra"),
    (honest() + [("", CLS, "passed")], WITH_CANARIES, {}, "a test case without a name"),
    (honest() + [("test_ints", CLS, "passed")], WITH_CANARIES, {}, "reported more than once"),
    (honest(), WITH_CANARIES, {"tests": 3}, "the report's counts"),
    (honest(), WITH_CANARIES, {"time": 0.01, "case_time": 0.5}, "took 3.500 s in a suite of 0.010 s"),
    (honest(), WITH_CANARIES, {"time": 60.0}, "suite took 60.000 s in a run of 5.000 s"),
    # A report and record that agree, but a selected hidden test was never collected.
    ([c for c in honest() if c[0] != "test_zero"], [i for i in WITH_CANARIES if i[0] != "test_zero"], {},
     "hidden tests that were never collected: hidden_tests/test_calc.py::TestMore::test_zero"),
    (honest({"test_ints_again": "passed"}), WITH_CANARIES, {}, "a copy of test_ints made to fail passed"),
    (honest({"test_order_more": "failed"}), WITH_CANARIES, {}, "an exact copy of test_order did not pass"),
    ([c for c in honest() if c[0] != "test_order_more"], [i for i in WITH_CANARIES if i[0] != "test_order_more"],
     {}, "a check test of this grading is missing: test_order_more"),
])
def test_tampering_is_named(cases, ids, kwargs, reason):
    result = run_check(cases, ids, **kwargs)
    assert any(reason in t for t in result.tampering), result.tampering


def test_an_aborted_run_explains_what_is_missing_never_what_is_forged():
    """pytest's internal error (junitxml's own ``pytest::internal`` case) cuts the run short:
    the tests after it are missing, findings in ``absent`` too (the grader judges such a
    bridged run score 0 unflagged); a case nobody collected besides it, or a must-fail
    canary that passed, is forged: tampering only."""
    internal = ("internal", "pytest", "failed")
    cut = [c for c in honest() if c[0] in ("test_ints", "test_order")] + [internal]
    aborted = run_check(cut)
    # Counted: the 5 hidden tests collected (those never reported as not passed), never
    # pytest's own case; none when the abort came before any collection record.
    assert (aborted.outcomes.passed, aborted.outcomes.total) == (2, 5)
    assert aborted.outcomes.failed == [
        "hidden_tests/test_calc.py::test_pairs[1-2]", "hidden_tests/test_calc.py::test_pairs[3-4]",
        "hidden_tests/test_calc.py::TestMore::test_zero"]
    unrecorded = check(parse_report(junit([internal])), None, SELECTION, CANARIES, wall_s=5.0)
    assert (unrecorded.outcomes.passed, unrecorded.outcomes.total) == (0, 0)
    assert aborted.tampering == aborted.absent == [
        "the report holds tests that were never collected: pytest::internal",
        "collected tests missing from the report: hidden_tests/test_calc.py::test_pairs[1-2], "
        "hidden_tests/test_calc.py::test_pairs[3-4], hidden_tests/test_calc.py::TestMore::test_zero and 2 more"]
    forged = run_check(cut + [("test_extra", CLS, "passed")])
    assert forged.tampering[0] == ("the report holds tests that were never collected: pytest::internal, "
                                   "hidden_tests.test_calc::test_extra")
    assert forged.tampering[0] not in forged.absent
    canary = run_check(cut + [("test_ints_again", CLS, "passed")])
    assert canary.tampering[-1] == ("a copy of test_ints made to fail passed "
                                    "(hidden_tests.test_calc::test_ints_again, literal check)")
    assert canary.tampering[-1] not in canary.absent


def test_canaries_say_nothing_when_their_original_failed():
    # A wrong solution: the original fails, so its mutant passing or its twin failing is no evidence.
    result = run_check(honest({"test_ints": "failed", "test_ints_again": "passed",
                               "test_order": "failed", "test_order_more": "failed"}))
    assert result.tampering == []


def test_missing_collection_record_is_tampering():
    result = check(parse_report(junit(honest())), None, SELECTION, CANARIES, wall_s=5.0)
    assert result.tampering[0] == "the run's collection record is missing or malformed"


def test_collection_error_covers_its_module():
    cases = [("hidden_tests.test_calc", "", "failed")]
    record = json.dumps({"items": [], "collectors": [["hidden_tests/test_calc.py", "", "hidden_tests.test_calc",
                                                      "failed"]]}).encode()
    result = check(parse_report(junit(cases)), record, SELECTION, CANARIES, wall_s=5.0)
    assert result.tampering == []
    assert (result.outcomes.total, result.outcomes.passed) == (1, 0)


def _subsequence(small: list[str], big: list[str]) -> bool:
    it = iter(big)
    return all(line in it for line in small)


def test_canaries_copy_real_tests_under_fresh_names():
    plans = [plan(TESTS, SELECTION.expected, random.Random(seed)) for seed in range(2)]
    for p in plans:
        source = p.files["hidden_tests/test_calc.py"]
        # Real tests untouched: every line of the file is there, in order.
        assert _subsequence(TESTS["hidden_tests/test_calc.py"].splitlines(), source.splitlines())
        assert {c.kind for c in p.canaries if c.must == "fail"} == {"literal", "ordering", "input"}
        assert {c.kind for c in p.canaries if c.must == "pass"} == {"", "probe"}
        for c in p.canaries:
            assert c.name.startswith("test_") and c.name not in TESTS["hidden_tests/test_calc.py"]
            assert f"def {c.name}(" in source
            assert source.index(f"def {c.name}(") > source.index(f"def {c.original}(")  # after its original
    assert {c.name for c in plans[0].canaries} != {c.name for c in plans[1].canaries}
    ordering = next(c for c in plans[0].canaries if c.kind == "ordering")
    assert f"def {ordering.name}():\n    assert Box(1) >= Box(2)" in plans[0].files["hidden_tests/test_calc.py"]


def test_canaries_are_interleaved_not_appended():
    # Over a few gradings, a canary lands before a real test at least once.
    last_real = []
    for seed in range(8):
        p = plan(TESTS, SELECTION.expected, random.Random(seed))
        source = p.files["hidden_tests/test_calc.py"]
        first_canary = min(source.index(f"def {c.name}(") for c in p.canaries)
        last_real.append(first_canary < source.index("def test_zero("))
    assert any(last_real)


def test_input_mutant_and_probe_bodies():
    tests = {"hidden_tests/test_s.py": "from s import f\n\n\ndef test_ten():\n    assert f(10) == 55\n"}
    p = plan(tests, select(["hidden_tests"], tests, {}).expected, random.Random(3))
    source = p.files["hidden_tests/test_s.py"]
    [inp] = [c for c in p.canaries if c.kind == "input"]
    [probe] = [c for c in p.canaries if c.kind == "probe"]
    body = source[source.index(f"def {inp.name}():"):].splitlines()[1].strip()
    arg, expected = (int(x) for x in body.removeprefix("assert f(").split(") == "))
    assert arg in (2, 4, 6, 8) and expected != 55  # cheaper, same parity, never 0
    body = source[source.index(f"def {probe.name}():"):].splitlines()[1:4]
    local = body[0].strip().split(" = ")[0]
    assert body[0].strip() == f"{local} = f(10)"
    assert body[1].strip().startswith(f"assert not {local} == ") and body[1].strip() != f"assert not {local} == 55"
    assert body[2].strip() == f"assert {local} == 55"


def test_a_task_without_usable_asserts_gets_framework_canaries():
    tests = {"hidden_tests/test_x.py": "import pytest\nfrom x import f\n\ndef test_raises():\n"
                                       "    with pytest.raises(ValueError):\n        f()\n"}
    p = plan(tests, select(["hidden_tests"], tests, {}).expected, random.Random(1))
    assert sorted((c.must, c.kind) for c in p.canaries) == [("fail", "framework"), ("pass", ""),
                                                            ("pass", "framework")]


def test_plugin_records_collection_and_witnesses_without_knowing_canaries(tmp_path):
    """The real plugin in a real pytest run (host, no sandbox)."""
    root = tmp_path / "ws"
    out = tmp_path / "out"
    out.mkdir()
    run = make_plan(["-q", "hidden_tests"], TESTS, {}, report_dir=str(out))
    files = {**run.tests, "calc.py": (b"class Box:\n    def __init__(self, v):\n        self.v = v\n"
                                      b"    def __lt__(self, o):\n        return self.v < o.v\n"
                                      b"    def __ge__(self, o):\n        return self.v >= o.v\n\n"
                                      b"def add(a, b):\n    return a + b\n")}
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    plugin = plugin_dir(tmp_path, run)
    for name in ("".join(c.name for c in run.canaries), *(c.name for c in run.canaries)):
        assert name not in (plugin / f"{run.plugin}.json").read_text()  # the run is not told
    env = {**os.environ, "PYTHONPATH": str(plugin), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", *run.args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the mutants fail
    record = (out / run.collected_file).read_bytes()
    report = parse_report((out / REPORT_FILE).read_bytes())
    result = check(report, record, run.selection, run.canaries, wall_s=120.0, sites=run.sites)
    assert result.tampering == []
    assert (result.outcomes.total, result.outcomes.passed) == (5, 5)
    real = [i[0] for i in json.loads(record)["items"] if i[0].split("::")[-1].split("[")[0]
            not in {c.name for c in run.canaries}]
    assert real == ["hidden_tests/test_calc.py::test_ints", "hidden_tests/test_calc.py::test_order",
                    "hidden_tests/test_calc.py::test_pairs[1-2]", "hidden_tests/test_calc.py::test_pairs[3-4]",
                    "hidden_tests/test_calc.py::TestMore::test_zero"]
    # Every test that passed ran its witness (parametrized: once per case); mutants never did.
    witnessed = json.loads(record)["witnessed"]
    by_name = {s.name: s.nonce for s in run.sites}
    assert witnessed.count(by_name["test_pairs"]) == 2 and by_name["test_ints"] in witnessed
    assert not {by_name[c.name] for c in run.canaries if c.must == "fail"} & set(witnessed)
    assert Path(run.args[run.args.index("-p", 3) + 1]).name.startswith("_rw_")


def test_a_pass_without_its_witness_is_tampering():
    sites = [Site(path="hidden_tests/test_calc.py", cls="", name="test_ints", nonce="aa"),
             Site(path="hidden_tests/test_calc.py", cls="TestMore", name="test_zero", nonce="bb")]
    cases = [(n, c, "passed") for n, c in IDS]
    record = json.loads(collected(IDS))
    honest = check(parse_report(junit(cases)), json.dumps({**record, "witnessed": ["bb", "aa"]}).encode(),
                   SELECTION, [], wall_s=5.0, sites=sites)
    assert honest.tampering == []
    forged = check(parse_report(junit(cases)), json.dumps({**record, "witnessed": ["aa"]}).encode(),
                   SELECTION, [], wall_s=5.0, sites=sites)
    assert forged.tampering == ["tests reported passed that never reached their last line: "
                                "hidden_tests/test_calc.py::TestMore::test_zero"]
    lost = check(parse_report(junit(cases)), collected(IDS), SELECTION, [], wall_s=5.0, sites=sites)
    assert lost.tampering == ["the run's completion record is missing"]


def test_a_mutant_that_ran_to_its_end_is_tampering_even_if_reported_failed():
    canary = Canary(name="test_ints_more", original="test_ints", cls="", path="hidden_tests/test_calc.py",
                    must="fail", kind="input")
    sites = [Site(path="hidden_tests/test_calc.py", cls="", name="test_ints_more", nonce="cc")]
    ids = [*IDS, ("test_ints_more", CLS)]
    cases = [(n, c, "passed") for n, c in IDS] + [("test_ints_more", CLS, "failed")]
    record = {**json.loads(collected(ids)), "witnessed": ["cc"]}
    result = check(parse_report(junit(cases)), json.dumps(record).encode(), SELECTION, [canary], wall_s=5.0,
                   sites=sites)
    assert result.tampering == ["a copy of test_ints made to fail ran to its last line "
                                "(hidden_tests.test_calc::test_ints_more, input check)"]


def test_witnesses_end_each_test_body_and_skip_what_cannot_be_ended():
    source = ("def test_simple():\n    x = 1  # note\n    assert x\n\n"
              "def test_block():\n    for i in range(2):\n        assert i < 2\n\n"
              "def test_returns():\n    return\n\n"
              "def test_one_line(): assert True\n\n"
              "class TestC:\n    def test_m(self):\n        assert 1\n\n"
              "def helper():\n    pass\n")
    out = instrument({"t.py": source}, "_w", random.Random(0))
    text = out.files["t.py"]
    sites = {s.name: s for s in out.sites}
    assert sorted(sites) == ["test_block", "test_m", "test_simple"]
    assert f"    assert x; _w({sites['test_simple'].nonce!r})\n" in text
    assert f"        assert i < 2\n    _w({sites['test_block'].nonce!r})\n" in text
    assert f"        assert 1; _w({sites['test_m'].nonce!r})\n" in text and sites["test_m"].cls == "TestC"
    calls = []
    namespace = {"_w": calls.append}
    exec(compile(text, "t.py", "exec"), namespace)
    namespace["test_simple"](), namespace["test_block"](), namespace["TestC"]().test_m()
    assert calls == [sites["test_simple"].nonce, sites["test_block"].nonce, sites["test_m"].nonce]


def test_a_test_defined_twice_has_one_witness_site():
    source = "def test_a():\n    assert 1\n\ndef test_a():\n    assert 2\n\ndef test_b():\n    return\n"
    out = instrument({"t.py": source}, "_w", random.Random(0))
    [site] = out.sites
    assert (site.name, out.files["t.py"].count(f"_w({site.nonce!r})")) == ("test_a", 2)


def test_every_canary_is_defined_where_it_belongs_whatever_the_draw(monkeypatch):
    # A class that ends the module: a class canary and a module-level one can both go
    # after its last line; the class's must stay in the class.
    calc = type(sys)("calc")
    calc.add, calc.Box = (lambda a, b: a + b), int
    monkeypatch.setitem(sys.modules, "calc", calc)
    for seed in range(100):
        p = plan(TESTS, SELECTION.expected, random.Random(seed))
        source = instrument(p.files, "_w", random.Random(seed)).files["hidden_tests/test_calc.py"]
        namespace: dict = {"_w": lambda nonce: None}
        exec(compile(source, "test_calc.py", "exec"), namespace)
        for c in p.canaries:
            assert c.name in (vars(namespace[c.cls]) if c.cls else namespace), (seed, c)


@pytest.mark.parametrize("assert_mode", ["rewrite", "plain"])
def test_plugin_serves_hidden_tests_from_memory(tmp_path, assert_mode):
    """In-env: placeholders at the hidden tests' paths, sources in a file the plugin
    deletes on import; pytest still runs the real tests (and a helper beside them), with
    assertion rewriting or without, and writes no compiled copy."""
    root, out, secret = tmp_path / "ws", tmp_path / "out", tmp_path / "secrets" / "s.json"
    out.mkdir()
    secret.parent.mkdir()
    tests = {"hidden_tests/test_s.py": "from mathutil import sum_to\nfrom helper_k import K\n\n"
                                       "def test_ten():\n    assert sum_to(10) == 55\n\n"
                                       "def test_k():\n    assert K == 3\n",
             "hidden_tests/helper_k.py": "K = 3\n"}
    run = make_plan(["-q", "hidden_tests", f"--assert={assert_mode}"], tests, {}, report_dir=str(out))
    run.hidden_sources = str(secret)
    secret.write_text(json.dumps({str(root / p): d.decode() for p, d in run.tests.items()}))
    files = {**{p: b"# placeholder\n" for p in run.tests},
             "mathutil.py": b"SEEN = open('hidden_tests/test_s.py').read()\n\n"
                            b"def sum_to(n):\n    assert SEEN == '# placeholder\\n', SEEN\n    return n * (n + 1) // 2\n"}
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    env = {**os.environ, "PYTHONPATH": str(plugin_dir(tmp_path, run)), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", *run.args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the mutants fail
    assert not secret.exists() and not list(root.rglob("*.pyc"))
    report = parse_report((out / REPORT_FILE).read_bytes())
    result = check(report, (out / run.collected_file).read_bytes(), run.selection, run.canaries, wall_s=120.0,
                   sites=run.sites)
    assert result.tampering == [] and (result.outcomes.total, result.outcomes.passed) == (2, 2)


def test_in_env_pins_an_empty_inifile_when_the_task_has_none():
    from sandbox.grading_inenv import inifile_pin
    from sandbox.grading_common import PLUGIN_DIR
    from tasks.spec import TaskSpec

    def spec(files):
        return TaskSpec(task_id="t", instruction="", files=files, hidden_tests=TESTS, solution={},
                        test_command="pytest -q hidden_tests", grading="in-env")

    run = make_plan(["-q", "hidden_tests"], TESTS, {})
    assert inifile_pin(spec({"calc.py": ""}), run, "/workspace") == [
        "-c", f"{PLUGIN_DIR}/{run.plugin}.ini", "--rootdir", "/workspace"]
    assert inifile_pin(spec({"calc.py": "", "pytest.ini": "[pytest]\n"}), run, "/workspace") == ["-c", "pytest.ini"]
