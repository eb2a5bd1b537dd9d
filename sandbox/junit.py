"""Read pytest's JUnit XML report: per-test outcomes, not the exit code."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import msgspec


class TestOutcomes(msgspec.Struct, kw_only=True):
    total: int
    passed: int
    failed: list[str] = []  # failures and errors (collection errors included)
    skipped: list[str] = []


class ReportError(ValueError):
    """The report is missing or is not a JUnit XML document."""


class Case(msgspec.Struct, frozen=True, kw_only=True):
    classname: str
    name: str
    outcome: str  # passed | failed | skipped
    time: float | None  # None: missing or not a finite number >= 0

    @property
    def key(self) -> tuple[str, str]:
        return (self.classname, self.name)

    @property
    def label(self) -> str:
        return f"{self.classname}::{self.name}".strip(":")


class Suite(msgspec.Struct, kw_only=True):
    tests: int | None
    failures: int | None
    errors: int | None
    skipped: int | None
    time: float | None
    cases: list[Case]
    failed_elements: int  # cases with a <failure> child
    error_elements: int  # cases with an <error> child


class Report(msgspec.Struct, kw_only=True):
    suites: list[Suite]

    @property
    def cases(self) -> list[Case]:
        return [c for s in self.suites for c in s.cases]


def parse_report(data: bytes) -> Report:
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        raise ReportError(f"test report is not valid XML: {exc}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ReportError(f"test report root is <{root.tag}>, not <testsuites>/<testsuite>")
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = []
    for suite in suites:
        cases, failed, errors = [], 0, 0
        for case in suite.iter("testcase"):
            kinds = {child.tag for child in case}
            failed += "failure" in kinds
            errors += "error" in kinds
            outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
            cases.append(Case(classname=case.get("classname", ""), name=case.get("name", ""), outcome=outcome,
                              time=_number(case.get("time"), float)))
        out.append(Suite(
            tests=_number(suite.get("tests"), int), failures=_number(suite.get("failures"), int),
            errors=_number(suite.get("errors"), int), skipped=_number(suite.get("skipped"), int),
            time=_number(suite.get("time"), float), cases=cases, failed_elements=failed, error_elements=errors,
        ))
    return Report(suites=out)


def _number(text: str | None, kind: type) -> float | int | None:
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        return None
    if value < 0 or (kind is float and not math.isfinite(value)):
        return None
    return value


def outcomes_of(cases: list[Case]) -> TestOutcomes:
    passed = sum(c.outcome == "passed" for c in cases)
    return TestOutcomes(total=len(cases), passed=passed,
                        failed=[c.label for c in cases if c.outcome == "failed"],
                        skipped=[c.label for c in cases if c.outcome == "skipped"])


def parse_junit(data: bytes) -> TestOutcomes:
    return outcomes_of(parse_report(data).cases)
