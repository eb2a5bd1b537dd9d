"""What both entry scripts of a grading run do around their own work (the grader's
``bridge_tests.py`` and ``bridge_solution.py``, copied to /grader next to this package).

One job: :func:`run_entry`: read the grader's ``bridge.json`` next to the script, finish
the interpreter's site setup, connect this side of the bridge, run the side's work, and
end the process with its status without the interpreter's shutdown. The scripts keep
their ``if __name__ == "__main__":`` guard: a ``spawn``/``forkserver`` process pool (the
solution's or a hidden test's) re-imports the script in each worker as ``__mp_main__``,
which must not connect to the bridge again.
"""

from __future__ import annotations

import json
import os
import sys

from .serving import connect
from .sitepath import run_site


def run_entry(here: str, role: str, work, *, prepare=None) -> None:
    """Never returns. ``here``: the script's folder, which the script put first on
    ``sys.path`` to import this package; taken off again before anything else is imported
    (nothing there may shadow a module of the side's work). ``prepare(config)``: run after
    site, before connecting (the solution's side puts its workspace on the path). ``work(
    config, connection)``: the side's job; its int is the exit status."""
    sys.path.remove(here)
    with open(os.path.join(here, "bridge.json")) as f:
        config = json.load(f)
    # Site-packages, where pytest is (the grader starts this interpreter with -S, less its
    # own editable install: sitepath.py; docs/sandbox.md).
    run_site(config.get("site_skip", ()))
    if prepare is not None:
        prepare(config)
    connection = connect(config["fd"], role, cpu=config.get("cpu"), pin_after=config.get("pin_after", 0))
    status = work(config, connection)
    # Nothing the grading waits for is left (the tests' report and collection record are
    # written and closed; the solution's side saw the tests hang up). End without the
    # interpreter's shutdown: module teardown (~10-20 ms of pytest's the verdict waits
    # for), the solution's threads and atexit handlers (of the tests' or the solution's
    # making) never run after the run. What the process printed is flushed first (it is
    # scanned).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or replaced stream
            pass
    os._exit(status)
