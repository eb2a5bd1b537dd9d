"""Read pytest's JUnit XML report: per-test outcomes, not the exit code."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import msgspec


class TestOutcomes(msgspec.Struct, kw_only=True):
    total: int
    passed: int
    failed: list[str] = []  # failures and errors (collection errors included)
    skipped: list[str] = []


class ReportError(ValueError):
    """The report is missing or is not a JUnit XML document."""


def parse_junit(data: bytes) -> TestOutcomes:
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        raise ReportError(f"test report is not valid XML: {exc}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ReportError(f"test report root is <{root.tag}>, not <testsuites>/<testsuite>")
    total = passed = 0
    failed: list[str] = []
    skipped: list[str] = []
    for case in root.iter("testcase"):
        total += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            failed.append(name)
        elif "skipped" in kinds:
            skipped.append(name)
        else:
            passed += 1
    return TestOutcomes(total=total, passed=passed, failed=failed, skipped=skipped)
