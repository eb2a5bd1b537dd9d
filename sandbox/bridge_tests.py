"""Entry point of the tests' sandbox in a grading run (copied to /grader there).

Runs pytest on the hidden tests. The workspace's modules are not on this process's
path: imports of the top-level names the workspace defines (listed in the config file)
resolve to proxies of the modules living in the solution's process, across the bridge.
"""

import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "bridge.json")) as f:
    config = json.load(f)
sys.path.insert(0, here)
import _rollway_bridge as bridge  # noqa: E402

sys.path.remove(here)
connection = bridge.connect(config["fd"], "tests", cpu=config.get("cpu"), pin_after=config.get("pin_after", 0))
sys.meta_path.append(
    bridge.SolutionFinder(connection, set(config["modules"]), config["workspace"], config["sources"])
)
import pytest  # noqa: E402

sys.exit(int(pytest.main(sys.argv[1:])))
