"""Run by tests/test_images_rootless.py as an unprivileged uid: the image store and an
image session without root (umoci --rootless, the copy fallback, bwrap with a user
namespace). Prints one JSON line of what it saw."""

import asyncio
import json
import os
import sys
from pathlib import Path

from sandbox import image_workspace
from sandbox.config import ImageConfig, SandboxConfig
from sandbox.images import ImageStore
from sandbox.runner import Jail

folder, layout, tag = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
store = ImageStore(ImageConfig(cache_dir=str(folder / "cache")))
root = asyncio.run(store.ensure(f"rollway.local/examples/{tag}:1", source=f"oci:{layout}:{tag}"))
ws, _ = image_workspace.create(folder / "session", os.getuid(), {"added.py": "VALUE = 7\n"}, None, root, "/testbed")
jail = Jail(SandboxConfig(workspace_root=str(folder)))
probe = ("python3 -c 'import os, inflection, namekit, added; print(namekit.table_name(\"BlogPost\"), added.VALUE, os.getuid())'"
         " && echo changed > namekit/__init__.py && cat namekit/__init__.py; touch /usr/lib/escape 2>&1; echo write=$?")
result = asyncio.run(jail.run(probe, workspace=ws.root, uid=os.getuid(), timeout_s=120, root=root, workdir="/testbed"))
image_file = Path(root.rootfs, "testbed/namekit/__init__.py").read_text()
ws.remove()
pruned = len(store.prune())
print(json.dumps({
    "uid": os.getuid(), "mode": ws.mode, "exit": result.exit_code, "stdout": result.stdout, "stderr": result.stderr[-500:],
    "image_untouched": image_file.startswith('"""Names'), "pruned": pruned,
    "left": sorted(os.listdir(folder / "cache" / "roots")), "session_left": (folder / "session").exists(),
}))
