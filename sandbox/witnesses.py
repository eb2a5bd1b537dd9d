"""Completion witnesses: proof, made by a test's own code, that its body ran to the end.

Before the run, the grader appends one statement to every test function of the hidden
test files (canaries included) whose body it can end safely: a call of a per-grading
builtin with a random per-test nonce, ``<witness>('<nonce>')``. The grader's plugin
(:mod:`sandbox.grading_plugin`) defines that builtin and records every nonce it is called
with; :mod:`sandbox.result_check` then requires, for each test the report says passed,
as many records of its nonce as passed cases. A report forged from inside the run
(``TestReport`` or a hook patched so that failures read "passed") carries no witness for
the tests that failed: the assertion that failed stopped the body before the last line.

Edits are textual (a line or a ``; call`` after the body's last statement), so the rest
of the file keeps its text; a function whose body cannot be ended that way (a ``return``
or ``yield`` of its own, a body on the ``def`` line) gets no witness and needs none.
"""

from __future__ import annotations

import ast
import random

import msgspec

from sandbox import pyast
from sandbox.canaries import own_nodes
from sandbox.test_selection import path_matches


class Site(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # the test file, as laid out in the run
    cls: str  # "::"-joined enclosing classes ("" at module level)
    name: str  # the function's name
    nonce: str


class Instrumented(msgspec.Struct, kw_only=True):
    files: dict[str, str]
    sites: list[Site]


def instrument(files: dict[str, str], call: str, rng: random.Random) -> Instrumented:
    """``files``: {path in the run: source} of hidden test files; ``call``: the witness
    builtin's name. Files that do not parse are left as they are."""
    out: dict[str, str] = {}
    sites: list[Site] = []
    for path, source in files.items():
        try:
            tree = pyast.parse(source)
        except (SyntaxError, ValueError):
            out[path] = source
            continue
        lines = source.splitlines(keepends=True)
        edits: list[tuple[int, int, str]] = []  # (line index, column or -1 for a new line after it, text)
        found = [(cls, func, _end_edit(func, lines)) for cls, func in _tests(tree.body, ())]
        # A name defined twice is the last definition (as in Python): one site, and only
        # when that definition can be witnessed (every definition of it gets the nonce).
        last = {("::".join(cls), func.name): edit for cls, func, edit in found}
        nonces = {key: "%016x" % rng.getrandbits(64) for key, edit in last.items() if edit is not None}
        for cls, func, edit in found:
            key = ("::".join(cls), func.name)
            if edit is None or key not in nonces:
                continue
            line, col, indent = edit
            stmt = f"{call}({nonces[key]!r})"
            edits.append((line, col, f"; {stmt}" if col >= 0 else f"{indent}{stmt}\n"))
        sites += [Site(path=path, cls=cls, name=name, nonce=nonce) for (cls, name), nonce in nonces.items()]
        for line, col, text in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
            if col >= 0:
                raw = lines[line]
                body = raw.rstrip("\r\n")
                lines[line] = body[:col] + text + body[col:] + raw[len(body):]
            else:
                if not lines[line].endswith("\n"):
                    lines[line] += "\n"
                lines.insert(line + 1, text)
        out[path] = "".join(lines)
    return Instrumented(files=out, sites=sites)


def _tests(body: list[ast.stmt], classes: tuple[str, ...]):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield classes, node
        elif isinstance(node, ast.ClassDef):
            yield from _tests(node.body, (*classes, node.name))


def _end_edit(func: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> tuple[int, int, str] | None:
    """Where the witness goes: (0-based line, column to insert ``; call`` at, or -1 for a
    new line after it, the body's indentation); None when the body cannot be ended
    safely."""
    first, last = func.body[0], func.body[-1]
    if first.lineno == func.lineno or last.end_lineno is None or last.end_col_offset is None:
        return None
    for node in own_nodes(func):
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom)):
            return None
    indent_line = lines[first.lineno - 1]
    indent = indent_line[: len(indent_line) - len(indent_line.lstrip(" \t"))]
    if len(indent) != first.col_offset:
        return None  # a body after a `;` or a docstring on the def line: leave it
    end = last.end_lineno - 1
    if isinstance(last, _COMPOUND):
        return end, -1, indent
    tail = lines[end].rstrip("\r\n")[_char_col(lines[end], last.end_col_offset):]
    if tail.strip() and not tail.strip().startswith("#"):
        return None  # `a; b` on one line after the last statement: leave it
    return end, _char_col(lines[end], last.end_col_offset), indent


_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.FunctionDef,
             ast.AsyncFunctionDef, ast.ClassDef) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ()) + (
    (ast.Match,) if hasattr(ast, "Match") else ())


def _char_col(line: str, byte_col: int) -> int:
    """ast columns count UTF-8 bytes."""
    return len(line.encode()[:byte_col].decode(errors="ignore"))


def unwitnessed_passes(passed_nodeids: list[str], sites: list[Site], witnessed: list[str]) -> list[str]:
    """Node ids reported passed whose test has a witness and ran to its end fewer times
    than it was reported passed (the first ones of each such test)."""
    counts: dict[str, int] = {}
    for nonce in witnessed:
        counts[nonce] = counts.get(nonce, 0) + 1
    by_key = {(s.cls, s.name): [] for s in sites}
    for s in sites:
        by_key[(s.cls, s.name)].append(s)
    need: dict[str, list[str]] = {}
    for nodeid in passed_nodeids:
        site = site_of(nodeid, by_key)
        if site is not None:
            need.setdefault(site.nonce, []).append(nodeid)
    out: list[str] = []
    for nonce, nodeids in need.items():
        missing = len(nodeids) - counts.get(nonce, 0)
        if missing > 0:
            out += nodeids[:missing]
    return out


def site_of(nodeid: str, by_key: dict[tuple[str, str], list[Site]]) -> Site | None:
    path, _, rest = nodeid.partition("::")
    parts = rest.split("[", 1)[0].split("::")
    key = ("::".join(parts[:-1]), parts[-1])
    for site in by_key.get(key, ()):
        if path_matches(site.path, path):
            return site
    return None
