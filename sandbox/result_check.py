"""Is a hidden test run's report the run of the hidden tests? (both grading modes)

Three records meet here: what the grader knows before the run (the tests the command
selects, :mod:`sandbox.test_selection`, and this grading's canaries,
:mod:`sandbox.canaries`), what pytest collected (written by :mod:`sandbox.grading_plugin`)
and the JUnit report. Any of these is tampering (the cheat floor, with the reason):

- a case without a name, a case nobody collected, a collected test or collection error
  missing from the report (unless the run was cut short by a collection error or ``-x``),
  a test reported twice with a passing outcome;
- a selected hidden test that was never collected (and whose module did not fail or
  skip at collection);
- counts that do not match the cases (``tests``/``failures``/``errors``/``skipped``), a
  case without a duration, durations that add up to more than the suite's time, or a
  suite longer than the run itself;
- a canary missing, a must-fail canary passing (or running to its last line) or a
  must-pass canary failing while the test it copies passed;
- a test reported passed whose body never reached its completion witness
  (:mod:`sandbox.witnesses`), or a missing witness record.

Canaries never count in the score.
"""

from __future__ import annotations

import msgspec

from sandbox.canaries import Canary
from sandbox.junit import Case, Report, TestOutcomes, outcomes_of
from sandbox.test_selection import Selection, matches, path_matches
from sandbox.witnesses import Site, site_of, unwitnessed_passes

_MAX_LISTED = 3
# pytest writes durations with 3 decimals.
_ROUNDING_S = 0.0011
_SLACK_S = 0.05
_WALL_SLACK_S = 1.0
# The case pytest's junitxml adds for an internal error (classname "pytest", name "internal").
INTERNAL_ERROR_CASE = "pytest::internal"


class _Collected(msgspec.Struct, forbid_unknown_fields=True):
    items: list[tuple[str, str, str]]  # node id, JUnit classname, JUnit name
    collectors: list[tuple[str, str, str, str]]  # ... + outcome (failed | skipped)
    witnessed: list[str] | None = None  # the witnesses' nonces, in call order (None: never written)


class Checked(msgspec.Struct, kw_only=True):
    outcomes: TestOutcomes  # the real hidden tests only (canaries left out)
    tampering: list[str]
    canaries_run: int = 0
    # The findings of ``tampering`` that say what is missing (a test, a record, a canary),
    # none that says what is forged: all a run that pytest itself aborted leaves.
    absent: list[str] = []


def _listed(names: list[str]) -> str:
    return ", ".join(names[:_MAX_LISTED]) + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def _base(name: str) -> str:
    return name.split("[", 1)[0]


def check(report: Report, collected: bytes | None, selection: Selection, canaries: list[Canary], *,
          wall_s: float | None = None, sites: list[Site] = ()) -> Checked:
    tampering: list[str] = []
    absent: list[str] = []

    def missing(finding: str) -> None:
        tampering.append(finding)
        absent.append(finding)

    try:
        record = msgspec.json.decode(collected, type=_Collected) if collected is not None else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        record = None
    if record is None:
        missing("the run's collection record is missing or malformed")
        record = _Collected(items=[], collectors=[])
    cases = report.cases
    tampering += _structure(report, wall_s)

    items = {(cls, name): nodeid for nodeid, cls, name in record.items}
    collectors = {(cls, name): (nodeid, outcome) for nodeid, cls, name, outcome in record.collectors}
    interrupted = any(outcome == "failed" for _, outcome in collectors.values())
    by_key: dict[tuple[str, str], list[Case]] = {}
    for case in cases:
        by_key.setdefault(case.key, []).append(case)

    unknown = [c.label for c in cases if c.name and c.key not in items and c.key not in collectors]
    if unknown:
        # pytest's own case for an internal error (junitxml's pytest_internalerror) alone:
        # pytest aborted the run, nothing was forged.
        (missing if set(unknown) == {INTERNAL_ERROR_CASE} else tampering.append)(
            f"the report holds tests that were never collected: {_listed(unknown)}")
    twice = [cs[0].label for cs in by_key.values() if len(cs) > 1 and any(c.outcome == "passed" for c in cs)]
    if twice:
        tampering.append(f"tests reported more than once: {_listed(twice)}")
    any_failed = any(c.outcome == "failed" for c in cases)
    cut_short = interrupted or (selection.stops_early and any_failed)
    missing_items = [nodeid for key, nodeid in items.items() if key not in by_key]
    if missing_items and not cut_short:
        missing(f"collected tests missing from the report: {_listed(missing_items)}")
    missing_collectors = [nodeid for key, (nodeid, _) in collectors.items() if key not in by_key]
    if missing_collectors:
        missing(f"collection errors missing from the report: {_listed(missing_collectors)}")

    # Paths whose module (or class) failed or skipped as a whole at collection.
    dead = [nodeid for nodeid, _ in collectors.values()]
    collected_ids = list(items.values())

    def covered(path: str, cls: str = "") -> bool:
        for nodeid in dead:
            p, _, rest = nodeid.partition("::")
            if path_matches(path, p) and (not rest or rest == cls or rest.split("::")[0] == cls):
                return True
        return False

    never = [e.nodeid for e in selection.expected
             if not any(matches(e, n) for n in collected_ids) and not covered(e.path, e.cls)]
    if never:
        missing(f"hidden tests that were never collected: {_listed(never)}")

    verdict = {key: (cs[0].outcome if len(cs) == 1 else "failed") for key, cs in by_key.items()}
    # Completion witnesses: a passed test ran to its last line.
    witnessed = record.witnessed or []
    if sites and record.witnessed is None and collected is not None and any(v == "passed" for v in verdict.values()):
        missing("the run's completion record is missing")
    passed = [items[key] for key, outcome in verdict.items() if outcome == "passed" and key in items]
    never_ended = unwitnessed_passes(passed, list(sites), witnessed)
    if never_ended and record.witnessed is not None:
        tampering.append(f"tests reported passed that never reached their last line: {_listed(never_ended)}")
    by_site: dict[tuple[str, str], list[Site]] = {}
    for site in sites:
        by_site.setdefault((site.cls, site.name), []).append(site)
    nonces = set(witnessed)

    # Canaries: present, and right whenever the test they copy passed.
    canary_of = {c.name: c for c in canaries}
    # pytest's own case for an internal error is no hidden test: it counts in no outcome.
    # When pytest aborted, the collected hidden tests it never reported count as not
    # passed, as in a run cut short: tests_total is the hidden tests collected (0 when
    # collection itself failed), whatever point the abort came at.
    aborted = any(c.label == INTERNAL_ERROR_CASE for c in cases)
    real = [c for c in cases if _base(c.name) not in canary_of and c.label != INTERNAL_ERROR_CASE]
    canaries_run = 0
    for canary in canaries:
        keys = [key for key in items if _base(key[1]) == canary.name]
        if not keys:
            if not covered(canary.path, canary.cls) and not cut_short:
                missing(f"a check test of this grading is missing: {canary.name}")
            continue
        for key in keys:
            outcome = verdict.get(key)
            if outcome is None:
                continue  # cut short (missing items are reported above otherwise)
            canaries_run += 1
            if canary.original:
                original = verdict.get((key[0], canary.original + key[1][len(canary.name):]))
                if original != "passed":
                    continue
            site = site_of(items[key], by_site)
            ran_to_end = site is not None and site.nonce in nonces
            if canary.must == "fail" and (outcome == "passed" or ran_to_end):
                what = f"a copy of {canary.original} made to fail" if canary.original else "a test made to fail"
                how = "passed" if outcome == "passed" else "ran to its last line"
                tampering.append(f"{what} {how} ({key[0]}::{key[1]}, {canary.kind or 'framework'} check)")
            elif canary.must == "pass" and outcome != "passed":
                what = f"an exact copy of {canary.original}" if canary.original else "a test made to pass"
                tampering.append(f"{what} did not pass while it did ({key[0]}::{key[1]})")
    outcomes = outcomes_of(_merged(real))
    if missing_items and (cut_short or aborted):
        real_missing = [n for key, n in items.items() if key not in by_key and _base(key[1]) not in canary_of]
        outcomes = TestOutcomes(total=outcomes.total + len(real_missing), passed=outcomes.passed,
                                failed=outcomes.failed + real_missing, skipped=outcomes.skipped)
    return Checked(outcomes=outcomes, tampering=tampering, canaries_run=canaries_run, absent=absent)


def _merged(cases: list[Case]) -> list[Case]:
    """One case per test: a test reported twice (call failure and teardown error) failed."""
    out: dict[tuple[str, str], Case] = {}
    for case in cases:
        if case.key in out:
            out[case.key] = msgspec.structs.replace(case, outcome="failed")
        else:
            out[case.key] = case
    return list(out.values())


def _structure(report: Report, wall_s: float | None) -> list[str]:
    found: list[str] = []
    for suite in report.suites:
        cases = suite.cases
        if any(not c.name for c in cases):
            found.append("the report holds a test case without a name")
        skipped = sum(c.outcome == "skipped" for c in cases)
        counts = (suite.tests, suite.failures, suite.errors, suite.skipped)
        if counts != (len(cases), suite.failed_elements, suite.error_elements, skipped):
            found.append(f"the report's counts (tests, failures, errors, skipped = {counts}) do not match its "
                         f"{len(cases)} cases")
        times = [c.time for c in cases]
        if any(t is None for t in times) or suite.time is None:
            found.append("the report holds a test or suite without a valid duration")
            continue
        if sum(times) > suite.time + _ROUNDING_S * len(cases) + _SLACK_S:
            found.append(f"the report's tests took {sum(times):.3f} s in a suite of {suite.time:.3f} s")
        if wall_s is not None and suite.time > wall_s + _WALL_SLACK_S:
            found.append(f"the report's suite took {suite.time:.3f} s in a run of {wall_s:.3f} s")
    return list(dict.fromkeys(found))
