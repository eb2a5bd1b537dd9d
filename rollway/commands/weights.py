"""``rollway weights``: what the weight store holds; verify, export and prune versions."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model name (default: the config's model_name)")
    parser.add_argument("--store", help="store URL (default: the config's syncer.store_url)")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("ls", help="list stored versions with their kinds and sizes")
    verify = sub.add_parser("verify", help="rebuild a version from its keyframe and deltas, checking every checksum")
    verify.add_argument("version", nargs="?", type=int, help="default: the newest")
    export = sub.add_parser("export", help="rebuild a version and write it as a safetensors file")
    export.add_argument("version", type=int)
    export.add_argument("output", help="path of the .safetensors file to write")
    prune = sub.add_parser("prune", help="delete versions older than the newest K keyframes, and orphaned objects")
    prune.add_argument("--keep", type=int, help="keyframes to keep (default: syncer.keep_keyframes)")
    prune.add_argument("--grace-s", type=float,
                       help="orphans younger than this may be a publish in flight (default: syncer.orphan_grace_s)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from rollway.commands import given, load_config_or_exit
    from rollway.logging import configure_logging

    configure_logging("weights", level="warning")
    cfg = load_config_or_exit(args, "weights", {"model_name": args.model, "syncer": given(
        store_url=args.store, keep_keyframes=getattr(args, "keep", None),
        orphan_grace_s=getattr(args, "grace_s", None))})
    try:
        return asyncio.run(_run(args, cfg))
    except (LookupError, ValueError, OSError) as exc:
        print(f"rollway weights: {exc}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace, cfg) -> int:
    from syncer import catalog as cat
    from syncer.store import open_store

    model = cfg.model_name
    async with open_store(cfg.syncer.store_url, cfg.syncer) as store:
        if args.action == "ls":
            return await _ls(store, model)
        if args.action == "prune":
            catalog = await cat.load_catalog(store, model)
            doomed = cat.versions_to_delete(catalog, cfg.syncer.keep_keyframes)
            objects = await cat.delete_versions(store, model, catalog, doomed)
            print(f"deleted {len(doomed)} versions ({objects} objects): {doomed}")
            grace = cfg.syncer.orphan_grace_s
            garbage = await cat.collect_garbage(store, model, grace)
            print(f"deleted {len(garbage.chunks)} unreferenced chunks and {len(garbage.leftovers)} "
                  f"incomplete writes older than {grace:g} s")
            return 0
        from syncer.fetch import load_version

        version = getattr(args, "version", None)
        recon = await load_version(store, model, version, cfg.syncer.zstd_threads, cfg.syncer.max_concurrency)
        from syncer.bits import dtype_name
        from syncer.hashing import weights_hash

        digest = weights_hash((n, dtype_name(t.dtype), list(t.shape), recon.checksums[n])
                              for n, t in recon.tensors.items())
        if args.action == "export":
            from safetensors.torch import save_file

            save_file({n: t.contiguous() for n, t in recon.tensors.items()}, args.output,
                      metadata={"format": "pt", "rollway_version": str(recon.version), "weights_hash": digest})
            print(f"wrote {model} v{recon.version} ({len(recon.tensors)} tensors) to {args.output}")
        else:
            print(f"{model} v{recon.version}: OK, {len(recon.tensors)} tensors, weights hash {digest}, "
                  f"{recon.downloaded_bytes / 1e6:.1f} MB read")
        return 0


async def _ls(store, model: str) -> int:
    from syncer import catalog as cat

    catalog = await cat.load_catalog(store, model)
    if not catalog.kinds:
        print(f"no versions of {model!r} in {store.url}")
        return 0
    reader = cat.ManifestReader(store, model)
    print(f"{model} in {store.url}")
    print(f"{'version':>8}  {'kind':<10} {'base':>6} {'keyframe':>8} {'step':>6} {'tensors':>7} "
          f"{'raw MB':>9} {'stored MB':>10} {'ratio':>7}  hash")
    for version in catalog.versions:
        for kind in sorted(catalog.kinds[version]):
            m = await reader.get(version, kind)
            ratio = m.stored_bytes / m.raw_bytes if m.raw_bytes else 0.0
            print(f"{version:>8}  {kind:<10} {m.base_version:>6} {m.keyframe_version:>8} {m.trainer_step:>6} "
                  f"{len(m.tensors):>7} {m.raw_bytes / 1e6:>9.2f} {m.stored_bytes / 1e6:>10.3f} "
                  f"{ratio:>7.2%}  {m.weights_hash}")
    return 0
