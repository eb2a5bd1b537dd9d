"""Entry point of the solution's sandbox in a grading run (copied to /grader there).

Serves the workspace's modules to the hidden tests over the bridge (its two pipe ends
in the config file) until the tests hang up. This process holds no test file, no pytest and no
view of the tests' process: whatever it does, only plain data leaves it.

Everything runs under the ``__main__`` guard: a solution's ``multiprocessing`` pool with
the ``spawn`` or ``forkserver`` start method re-imports this script in each worker (as
``__mp_main__``), and without the guard every worker ran the bridge's serving code
instead of the pool's: the pool never got a worker and the grading hung to its timeout.
"""

import os
import sys


def _workspace_on_path(config: dict) -> None:
    # Last on sys.path, as in a plain run: the workspace cannot shadow the standard library.
    sys.path.append(config["workspace"])
    os.chdir(config["workspace"])


def _serve(config: dict, connection) -> int:
    """Until the tests hang up: then nothing the grading waits for is left."""
    connection.serve_forever()
    return 0


def main() -> None:
    # The bridge package lies next to this script; run_entry takes this folder off the
    # path again at once, reads bridge.json, runs site, connects, and ends the process
    # with os._exit (no interpreter shutdown: module teardown, the solution's threads and
    # atexit handlers; the verdict waits for this sandbox to end).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from _rollway_bridge.entry import run_entry

    run_entry(here, "solution", _serve, prepare=_workspace_on_path)


if __name__ == "__main__":
    main()
