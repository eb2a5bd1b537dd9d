"""``rollway sandbox``: run the sandbox service (sessions, isolated commands, grading)."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="listen address (default: sandbox.host)")
    parser.add_argument("--port", type=int, help="listen port (default: sandbox.port)")
    parser.add_argument("--tasks-dir", help="task store with the hidden tests (default: sandbox.tasks_dir)")
    parser.add_argument("--no-publish", action="store_true",
                        help="grade without publishing rewards to Kafka (local debugging only)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    import sys

    from rollway.commands import given, load_config_or_exit
    from rollway.logging import configure_logging

    cfg = load_config_or_exit(args, "sandbox", {"sandbox": given(
        host=args.host, port=args.port, tasks_dir=args.tasks_dir)})
    configure_logging("sandbox", level=cfg.logging.level)
    sandbox_cfg = cfg.sandbox
    publish = sandbox_cfg.publish_rewards and not args.no_publish

    async def main() -> int:
        from bus import EventProducer
        from sandbox.cgroups import CgroupUnavailable
        from sandbox.service import SandboxService, serve
        from tasks.store import TaskFormatError, TaskStore

        try:
            store = TaskStore(sandbox_cfg.tasks_dir)
        except TaskFormatError as exc:
            print(f"rollway sandbox: {exc}", file=sys.stderr)
            return 2
        producer = EventProducer(cfg.kafka, client_id="rollway-sandbox") if publish else None
        if producer is not None:
            await producer.start()
        try:
            try:
                service = SandboxService(sandbox_cfg, cfg.reward, store, publisher=producer)
                await service.self_check()
            except (CgroupUnavailable, RuntimeError) as exc:
                print(f"rollway sandbox: {exc}", file=sys.stderr)
                return 2
            runner = await serve(service, sandbox_cfg.host, sandbox_cfg.port)
            print(f"sandbox service on http://{sandbox_cfg.host}:{sandbox_cfg.port} "
                  f"({len(store)} tasks, rewards {'published' if producer else 'not published'})", flush=True)
            stop = asyncio.Event()
            from bus.connect import add_stop_handler

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                add_stop_handler(loop, sig, stop.set)
            await stop.wait()
            await runner.cleanup()
            return 0
        finally:
            if producer is not None:
                await producer.stop()

    return asyncio.run(main())
