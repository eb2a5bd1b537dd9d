"""EventConsumer.close when aiokafka's stop() raises the CancelledError of its own fetch
task (cancelled in a retry backoff after fetches timed out: a process that was
SIGSTOPped, the chaos run's frozen trainer). The error being handled must come out, not
that CancelledError: a fenced trainer's WriterFenced turned into an exit 1. The client is
a stand-in so the failure is exact; the consumer against a real broker is tested in
tests/test_bus.py and tests/test_bus_retry.py."""

from __future__ import annotations

import asyncio

import pytest

from bus import EventConsumer, WriterFenced
from bus.config import KafkaConfig


class _StopsCancelled:
    """aiokafka's consumer as stop() leaves it here."""

    def __init__(self) -> None:
        self.stopped = 0

    async def stop(self) -> None:
        self.stopped += 1
        raise asyncio.CancelledError()


def _started_consumer(commit_error: BaseException | None) -> EventConsumer:
    consumer = EventConsumer(KafkaConfig(bootstrap_servers="127.0.0.1:1"), ["trajectories"], group_id="g")
    consumer._client = _StopsCancelled()
    consumer._started = True

    async def commit(partitions=None) -> None:
        if commit_error is not None:
            raise commit_error

    consumer.commit = commit
    return consumer


async def test_the_commits_error_comes_out_not_the_fetch_tasks_cancellation():
    consumer = _started_consumer(WriterFenced("fenced: another producer started"))
    with pytest.raises(WriterFenced, match="another producer"):
        await consumer.close()
    assert consumer._consumer.stopped == 1


async def test_a_clean_close_ends_normally():
    consumer = _started_consumer(None)
    await consumer.close()
    assert consumer._consumer.stopped == 1


async def test_cancelling_the_closing_task_still_cancels_it():
    consumer = _started_consumer(None)
    stop_entered = asyncio.Event()

    async def stop() -> None:
        stop_entered.set()
        await asyncio.Event().wait()  # a stop that hangs until cancelled

    consumer._consumer.stop = stop
    task = asyncio.create_task(consumer.close())
    await stop_entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
