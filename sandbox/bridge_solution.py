"""Entry point of the solution's sandbox in a grading run (copied to /grader there).

Serves the workspace's modules to the hidden tests over the bridge (its two pipe ends
in the config file) until the tests hang up. This process holds no test file, no pytest and no
view of the tests' process: whatever it does, only plain data leaves it.
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
# Last on sys.path, as in a plain run: the workspace cannot shadow the standard library.
sys.path.append(config["workspace"])
os.chdir(config["workspace"])
connection = bridge.connect(config["fd"], "solution", cpu=config.get("cpu"), pin_after=config.get("pin_after", 0))
connection.serve_forever()
