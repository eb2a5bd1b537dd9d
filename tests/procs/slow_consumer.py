"""A consumer process for kill/terminate tests: handles `tasks` slowly, printing
"start <task_id>" and "done <task_id>" lines (flushed) around each handler."""

import asyncio
import os
import sys

from bus import EventConsumer
from bus.config import KafkaConfig
from rollway.logging import configure_logging


async def main() -> None:
    configure_logging("test-consumer", level="warning")  # logs to stderr, stdout is the protocol
    cfg = KafkaConfig(bootstrap_servers=os.environ["KAFKA_BOOTSTRAP_SERVERS"], topic_prefix=sys.argv[1])
    delay = float(sys.argv[3])

    async def handle(env):
        print(f"start {env.event.task_id}", flush=True)
        await asyncio.sleep(delay)
        print(f"done {env.event.task_id}", flush=True)

    async with EventConsumer(cfg, ["tasks"], group_id=sys.argv[2]) as consumer:
        await consumer.run(handle, handle_signals=True)
    print("exited cleanly", flush=True)


asyncio.run(main())
