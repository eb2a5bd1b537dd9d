"""Entry point of the solution's sandbox in a grading run (copied to /grader there).

Serves the workspace's modules to the hidden tests over the bridge (its two pipe ends
in the config file) until the tests hang up. This process holds no test file, no pytest and no
view of the tests' process: whatever it does, only plain data leaves it.

Everything runs under the ``__main__`` guard: a solution's ``multiprocessing`` pool with
the ``spawn`` or ``forkserver`` start method re-imports this script in each worker (as
``__mp_main__``), and without the guard every worker ran the bridge's serving code
instead of the pool's: the pool never got a worker and the grading hung to its timeout.
"""

import json
import os
import sys


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "bridge.json")) as f:
        config = json.load(f)
    sys.path.insert(0, here)
    import _rollway_bridge as bridge
    from _rollway_bridge.sitepath import run_site

    sys.path.remove(here)
    # Site-packages (the grader starts this interpreter with -S; docs/sandbox.md).
    run_site(config.get("site_skip", ()))
    # Last on sys.path, as in a plain run: the workspace cannot shadow the standard library.
    sys.path.append(config["workspace"])
    os.chdir(config["workspace"])
    connection = bridge.connect(config["fd"], "solution", cpu=config.get("cpu"), pin_after=config.get("pin_after", 0))
    connection.serve_forever()
    # The tests hung up: nothing the grading waits for is left. End without the interpreter's
    # shutdown (module teardown, the solution's threads and atexit handlers): the verdict
    # waits for this sandbox to end. What the process printed is flushed first (it is scanned).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or replaced stream
            pass
    os._exit(0)


if __name__ == "__main__":
    main()
