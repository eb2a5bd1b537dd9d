"""Build the example task set's images here, from Debian and PyPI only (no registry).

    python -m tasks.images.build [--out DIR] [--import CACHE_DIR] [--jsonl PATH]

1. one shared base root: ``mmdebstrap --variant=extract`` of bookworm's python3.11, bash
   and coreutils (packages and their dependencies unpacked, no maintainer scripts: about
   4 s and 90 MB here), plus pytest from PyPI (``pip install --target``) and without docs;
2. an OCI layout (umoci) whose ``base`` tag is that root as one layer;
3. per example (:mod:`tasks.images.examples`) a tag on top of ``base`` with two thin
   layers: its PyPI package (not on the host) and the repository at ``/testbed``
   (WorkingDir /testbed);
4. ``--import``: each image into the image store at CACHE_DIR under its task name
   (``rollway.local/examples/<name>:1``), as ``rollway images pull NAME --from
   oci:OUT/oci:<name>`` would; ``--jsonl``: the task set's rows.

Prints the time of each phase. Needs root (mmdebstrap in root mode), mmdebstrap, umoci,
and pip reaching PyPI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tasks.images.examples import BASE_PACKAGES, DEBIAN_PACKAGES, EXAMPLES, rows

SUITE = "bookworm"
SITE_PACKAGES = "usr/lib/python3/dist-packages"
ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")
JSONL = Path(__file__).with_name("examples.jsonl")
_TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "var/cache/apt", "var/lib/apt/lists")


def _run(*argv: str | Path) -> None:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))[:300]} failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout)[-1500:]}")


def _pip_into(root: Path, packages: tuple[str, ...]) -> None:
    target = root / SITE_PACKAGES
    target.mkdir(parents=True, exist_ok=True)
    _run(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--only-binary=:all:",
         "--disable-pip-version-check", "--target", target, *packages)
    for extra in target.glob("bin"):  # console scripts point at the host's Python
        shutil.rmtree(extra)


def build_base(root: Path) -> None:
    _run("mmdebstrap", "--quiet", "--variant=extract", "--include=" + ",".join(DEBIAN_PACKAGES), SUITE, root)
    for sub in _TRIM:
        shutil.rmtree(root / sub, ignore_errors=True)
    _pip_into(root, BASE_PACKAGES)
    (root / "testbed").mkdir(mode=0o755, exist_ok=True)


def build(out: Path, *, log=print) -> Path:
    """Build the layout ``out/oci`` with tags ``base`` and one per example; returns it."""
    times: dict[str, float] = {}
    out.mkdir(parents=True, exist_ok=True)
    layout = out / "oci"
    if layout.exists():
        shutil.rmtree(layout)
    with tempfile.TemporaryDirectory(dir=out, prefix="build-") as tmp:
        work = Path(tmp)
        t = time.monotonic()
        build_base(work / "base")
        times["base root (mmdebstrap extract + pip)"] = time.monotonic() - t
        t = time.monotonic()
        _run("umoci", "init", "--layout", layout)
        _run("umoci", "new", "--image", f"{layout}:base")
        _run("umoci", "insert", "--image", f"{layout}:base", work / "base", "/")
        config = ["umoci", "config", "--image", f"{layout}:base", "--config.workingdir", "/testbed"]
        for item in ENV:
            config += ["--config.env", item]
        _run(*config)
        times["base layer (umoci insert)"] = time.monotonic() - t
        for ex in EXAMPLES:
            t = time.monotonic()
            _run("umoci", "tag", "--image", f"{layout}:base", ex.name)
            packages = work / f"{ex.name}-packages"
            _pip_into(packages, ex.packages)
            _run("umoci", "insert", "--image", f"{layout}:{ex.name}", packages / "usr", "/usr")
            repo = work / f"{ex.name}-repo"
            for rel, text in ex.files.items():
                path = repo / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            _run("umoci", "insert", "--image", f"{layout}:{ex.name}", repo, "/testbed")
            times[f"{ex.name} layers"] = time.monotonic() - t
    _run("umoci", "gc", "--layout", layout)
    for name, seconds in times.items():
        log(f"  {name}: {seconds:.1f} s")
    return layout


def import_into(layout: Path, cache_dir: Path, *, log=print) -> None:
    from sandbox.config import ImageConfig
    from sandbox.images import ImageStore

    store = ImageStore(ImageConfig(cache_dir=str(cache_dir)))

    async def main() -> None:
        for ex in EXAMPLES:
            t = time.monotonic()
            root = await store.ensure(ex.image, source=f"oci:{layout}:{ex.name}")
            log(f"  imported {ex.image} -> {root.digest[:19]} in {time.monotonic() - t:.1f} s")

    asyncio.run(main())


def write_jsonl(path: Path) -> None:
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("ROLLWAY_EXAMPLE_IMAGES", "/var/tmp/rollway-example-images"),
                        help="build folder (the OCI layout goes to OUT/oci)")
    parser.add_argument("--import", dest="import_to", metavar="CACHE_DIR",
                        help="also import the images into the image store at CACHE_DIR")
    parser.add_argument("--jsonl", metavar="PATH", help=f"write the task set's rows (e.g. {JSONL})")
    args = parser.parse_args(argv)
    started = time.monotonic()
    layout = build(Path(args.out))
    print(f"built {layout} ({', '.join(ex.name for ex in EXAMPLES)}) in {time.monotonic() - started:.1f} s")
    if args.import_to:
        import_into(layout, Path(args.import_to))
    if args.jsonl:
        write_jsonl(Path(args.jsonl))
        print(f"wrote {args.jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
