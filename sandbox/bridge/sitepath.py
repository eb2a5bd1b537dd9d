"""The interpreter's site setup, run by the entry scripts themselves (``python -S``), less
the grader's own install.

One job: ``site.main()`` with the ``.pth`` files whose names start with one of the given
prefixes left out. The grader's interpreter has rollway installed in editable mode, and
its ``.pth`` imports a finder (pathlib, importlib.util, re: ~15-20 ms of CPU at every
start of a sandboxed Python) for packages the sandboxes cannot see anyway. Every other
``.pth`` file, site-packages folder and sitecustomize is processed as ``site`` does.
"""

from __future__ import annotations

import sys


def run_site(skip_prefixes) -> None:
    """``site.main()`` for an interpreter started with ``-S``; nothing otherwise (site
    already ran)."""
    if not sys.flags.no_site:
        return
    import site

    skip = tuple(p for p in skip_prefixes if isinstance(p, str) and p)
    original = site.addpackage

    def addpackage(sitedir, name, known_paths):
        if skip and name.startswith(skip):
            return known_paths
        return original(sitedir, name, known_paths)

    site.addpackage = addpackage
    try:
        site.main()
    finally:
        site.addpackage = original
