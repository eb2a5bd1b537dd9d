"""``ast.parse`` behind one process-wide lock.

CPython 3.11 counts the C-to-Python AST conversion's recursion depth in state shared by
every thread, so two threads parsing at once can fail with "SystemError: AST constructor
recursion depth mismatch" (seen here: a grading in a worker thread beside another
thread's parse answered HTTP 500; CPython 3.12 keeps the depth per thread). The service
parses in worker threads (test selection, canaries, witnesses, cheat checks), so every
parse of ours goes through here."""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str | bytes, filename: str = "<unknown>", mode: str = "exec") -> ast.AST:
    with _LOCK:
        return ast.parse(source, filename=filename, mode=mode)
