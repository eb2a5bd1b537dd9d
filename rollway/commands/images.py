"""``rollway images``: the sandbox host's image store (OCI images as task environments).

    rollway images pull REF [REF ...] [--from SOURCE]   fetch, verify and unpack
    rollway images pull --tasks TASKS                   every image a task set names
    rollway images list [--json]
    rollway images prune [REF ...]                      remove unused images (all when none named)

``--from``: fetch from SOURCE (``oci:DIR:TAG``, ``docker-archive:FILE``, ...) and keep the
image under REF, the name tasks use. The store is the one ``rollway sandbox`` uses
(``sandbox.images.cache_dir``): pull a task set's images there before training starts,
so no rollout waits for a download.
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", help="image store folder (default: sandbox.images.cache_dir)")
    sub = parser.add_subparsers(dest="action", required=True)
    pull = sub.add_parser("pull", help="fetch, verify and unpack images (by reference, or a task set's)")
    pull.add_argument("refs", nargs="*", help="image references (docker://..., oci:DIR:TAG, registry/name:tag)")
    pull.add_argument("--from", dest="source", help="fetch the one REF from this source and keep it under REF")
    pull.add_argument("--tasks", help="a task set (folder, .jsonl or family:<split>): pull every image it names")
    listing = sub.add_parser("list", help="images in the store, most recently used first")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    prune = sub.add_parser("prune", help="remove images no session holds (all of them, or the ones named)")
    prune.add_argument("refs", nargs="*")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from rollway.commands import load_config_or_exit
    from rollway.logging import configure_logging
    from sandbox.images import ImageError, ImageStore

    configure_logging("images", level="warning")
    overrides = {"sandbox": {"images": {"cache_dir": args.cache_dir}}} if args.cache_dir else None
    cfg = load_config_or_exit(args, "images", overrides)
    store = ImageStore(cfg.sandbox.images)
    try:
        if args.action == "pull":
            return asyncio.run(_pull(store, args))
        if args.action == "list":
            return _list(store, args.json)
        removed = store.prune(args.refs or None)
        for image in removed:
            print(f"removed {image.digest[:19]} {_mib(image.size_bytes)} {' '.join(image.refs)}")
        print(f"{len(removed)} image(s) removed; {len(store.list())} left")
        return 0
    except ImageError as exc:
        print(f"rollway images: {exc}", file=sys.stderr)
        return 1


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def task_images(tasks: str) -> list[str]:
    """Every distinct image a task set names, in first-seen order."""
    from tasks.store import TaskStore

    return list(dict.fromkeys(spec.image for spec in TaskStore(tasks) if spec.image))


async def _pull(store, args: argparse.Namespace) -> int:
    import asyncio
    import sys
    import time

    from sandbox.images import ImageError

    refs = list(args.refs)
    if args.tasks:
        refs += task_images(args.tasks)
        if not refs:
            print(f"rollway images: no task in {args.tasks} names an image")
            return 0
    if not refs:
        print("rollway images pull: name images or --tasks", file=sys.stderr)
        return 2
    if args.source and len(refs) != 1:
        print("rollway images pull: --from takes exactly one REF", file=sys.stderr)
        return 2

    async def one(ref: str) -> bool:
        started = time.monotonic()
        try:
            root = await store.ensure(ref, source=args.source or "")
        except ImageError as exc:
            print(f"FAILED {exc}", flush=True)
            return False
        size = next((i.size_bytes for i in store.list() if i.digest == root.digest), 0)
        print(f"ok {ref} {root.digest[:19]} {_mib(size)} {time.monotonic() - started:.1f}s", flush=True)
        return True

    # The store bounds concurrent pulls (sandbox.images.max_concurrent_unpacks).
    results = await asyncio.gather(*(one(ref) for ref in dict.fromkeys(refs)))
    failed = results.count(False)
    print(f"{len(results) - failed} of {len(results)} image(s) ready in {store.dir}")
    return 1 if failed else 0


def _list(store, as_json: bool) -> int:
    import time

    import msgspec

    images = store.list()
    if as_json:
        for image in images:
            print(msgspec.json.encode(image).decode())
        return 0
    print(f"{'DIGEST':<19}  {'SIZE':>10}  {'LAYERS':>6}  {'UNPACK':>7}  {'LAST USED':>10}  REFERENCES")
    now = time.time()
    for image in images:
        print(f"{image.digest[:19]:<19}  {_mib(image.size_bytes):>10}  {image.layers:>6}  {image.unpack_s:>6.1f}s  "
              f"{(now - image.last_used) / 60:>7.0f} min  {' '.join(image.refs)}")
    total = sum(i.size_bytes for i in images)
    print(f"{len(images)} image(s), {_mib(total)} of {_mib(store.cfg.max_cache_bytes)} in {store.dir}")
    return 0
