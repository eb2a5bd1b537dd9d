"""Apply a unified diff (``git diff`` / SWE-bench ``patch`` and ``test_patch``) to files in memory.

Strict: every hunk's context and removed lines must match the file exactly at the line
the hunk names (no fuzz, no offset search), because a test patch that does not apply
cleanly means the data set row is wrong. Pure Python: the runtime image has neither
``git`` nor ``patch``.
"""

from __future__ import annotations

import re

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """The diff is malformed or does not apply; the message names the file and hunk."""


def _strip_prefix(path: str) -> str | None:
    path = path.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def _split_lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def patched_paths(diff: str) -> list[str]:
    """Paths a diff creates, changes or deletes (new path for renames)."""
    out = []
    old = None
    for line in diff.splitlines():
        if line.startswith("--- "):
            old = _strip_prefix(line[4:])
        elif line.startswith("+++ "):
            new = _strip_prefix(line[4:])
            out.append(new if new is not None else old)
    return [p for p in out if p]


def apply_patch(files: dict[str, str], diff: str) -> dict[str, str]:
    """A new ``{path: text}`` with ``diff`` applied; deleted files are dropped."""
    result = dict(files)
    lines = diff.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"line {i + 1}: '---' header without a '+++' line")
        old_path = _strip_prefix(lines[i][4:])
        new_path = _strip_prefix(lines[i + 1][4:])
        label = new_path or old_path
        i += 2
        if old_path is None:
            source: list[str] = []
        elif old_path in result:
            source = _split_lines(result[old_path])
        else:
            raise PatchError(f"{old_path}: the patch changes a file that is not in the repository")
        text, i = _patch_file(source, lines, i, label, needs_hunks=old_path is not None and new_path is not None)
        if old_path is not None and old_path != new_path:
            result.pop(old_path, None)
        if new_path is not None:
            result[new_path] = text
    return result


def _patch_file(source: list[str], lines: list[str], i: int, label: str, *, needs_hunks: bool) -> tuple[str, int]:
    """Apply the hunks starting at ``lines[i]`` to one file: (the new text, the next line)."""
    out: list[str] = []
    cursor = 0  # next source line not yet copied
    hunks = 0
    while i < len(lines) and lines[i].startswith("@@"):
        hunks += 1
        i, cursor = _apply_hunk(source, lines, i, label, hunks, out, cursor)
    if hunks == 0 and needs_hunks:
        raise PatchError(f"{label}: no hunks")
    out.extend(source[cursor:])
    return "".join(out), i


def _apply_hunk(source: list[str], lines: list[str], i: int, label: str, number: int, out: list[str],
                cursor: int) -> tuple[int, int]:
    """Apply hunk ``number`` (its header at ``lines[i]``): copy the source lines before
    it and the hunk's result onto ``out``. Returns (the next line, the next source line)."""
    match = _HUNK.match(lines[i])
    if match is None:
        raise PatchError(f"{label}: malformed hunk header {lines[i].strip()!r}")
    old_start, old_len = int(match.group(1)), int(match.group(2) or 1)
    new_len = int(match.group(4) or 1)
    i += 1
    start = old_start - 1 if old_len else old_start  # "-0,0" inserts at the top
    if start < cursor:
        raise PatchError(f"{label}: hunk {number} overlaps the previous one")
    out.extend(source[cursor:start])
    pos = start
    seen_old = seen_new = 0
    while (seen_old < old_len or seen_new < new_len) and i < len(lines):
        line = lines[i]
        if line.startswith("\\"):  # "\ No newline at end of file"
            i += 1
            _drop_final_newline(out)
            continue
        tag, body = line[:1], line[1:]
        if tag in (" ", "-"):
            if pos >= len(source) or source[pos].rstrip("\n") != body.rstrip("\n"):
                found = source[pos].rstrip("\n") if pos < len(source) else "<end of file>"
                raise PatchError(
                    f"{label}: hunk {number} does not apply at line {pos + 1}: "
                    f"expected {body.rstrip(chr(10))!r}, found {found!r}"
                )
            if tag == " ":
                out.append(source[pos])
                seen_new += 1
            pos += 1
            seen_old += 1
        elif tag == "+":
            out.append(body if body.endswith("\n") else body + "\n")
            seen_new += 1
        elif line.strip() == "":  # an empty context line whose space was stripped
            if pos >= len(source) or source[pos].strip() != "":
                raise PatchError(f"{label}: hunk {number} does not apply at line {pos + 1}")
            out.append(source[pos])
            pos += 1
            seen_old += 1
            seen_new += 1
        else:
            raise PatchError(f"{label}: hunk {number}: unexpected line {line.rstrip()!r}")
        i += 1
    if seen_old != old_len or seen_new != new_len:
        raise PatchError(f"{label}: hunk {number} is truncated")
    # a trailing "\ No newline at end of file" right after the hunk
    if i < len(lines) and lines[i].startswith("\\"):
        _drop_final_newline(out)
        i += 1
    return i, pos


def _drop_final_newline(out: list[str]) -> None:
    if out and out[-1].endswith("\n"):
        out[-1] = out[-1][:-1]
