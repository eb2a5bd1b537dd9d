"""The broker is real Apache Kafka: partitions, idempotent and transactional producers,
read_committed, and no acknowledged record lost when a node of 3 is SIGKILLed."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from rollway.broker import pid_alive
from tests.conftest import unique

pytestmark = pytest.mark.kafka


async def create_topic(bootstrap: str, name: str, partitions: int, rf: int = 1) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, rf)])
    finally:
        await admin.close()


async def read_all(bootstrap: str, topic: str, isolation: str, expected_min: int = 0, timeout: float = 20.0):
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
        isolation_level=isolation, enable_auto_commit=False,
    )
    await consumer.start()
    out = []
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                out += records
            if not batch and len(out) >= expected_min:
                break
    finally:
        await consumer.stop()
    return out


async def test_topic_idempotent_and_transactional_producers_read_committed(kafka_bootstrap):
    topic = unique("real-")
    await create_topic(kafka_bootstrap, topic, 3)

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    assert len(described[0]["partitions"]) == 3

    idem = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True)
    await idem.start()
    try:
        for i in range(30):
            await idem.send_and_wait(topic, f"idem-{i}".encode(), partition=i % 3)
    finally:
        await idem.stop()

    tx = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=unique("tx-"))
    await tx.start()
    try:
        async with tx.transaction():
            for i in range(5):
                await tx.send(topic, f"committed-{i}".encode(), partition=i % 3)
        await tx.begin_transaction()
        for i in range(5):
            await tx.send(topic, f"aborted-{i}".encode(), partition=i % 3)
        await tx.abort_transaction()
    finally:
        await tx.stop()

    committed = {r.value.decode() for r in await read_all(kafka_bootstrap, topic, "read_committed", 35)}
    assert committed == {f"idem-{i}" for i in range(30)} | {f"committed-{i}" for i in range(5)}
    uncommitted = {r.value.decode() for r in await read_all(kafka_bootstrap, topic, "read_uncommitted", 40)}
    # read_uncommitted sees the aborted records too: the transaction really happened.
    assert {f"aborted-{i}" for i in range(5)} <= uncommitted


@pytest.mark.kafka3
@pytest.mark.slow
async def test_sigkill_one_of_three_brokers_loses_no_acknowledged_record(kafka_cluster3):
    bootstrap = kafka_cluster3.state.bootstrap
    topic = unique("chaos-")
    await create_topic(bootstrap, topic, 3, rf=3)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True,
                                request_timeout_ms=30_000, retry_backoff_ms=200)
    await producer.start()
    acked: set[str] = set()
    victim = kafka_cluster3.state.nodes[1]
    try:
        for i in range(400):
            if i == 150:
                os.kill(victim.pid, signal.SIGKILL)
            try:
                await producer.send_and_wait(topic, f"r{i}".encode(), partition=i % 3)
                acked.add(f"r{i}")
            except Exception:
                pass  # not acknowledged: no promise to keep
    finally:
        await producer.stop()
    assert not pid_alive(victim.pid)
    # With min.insync.replicas=2, two live replicas keep accepting acks=all writes.
    assert len(acked) >= 390
    seen = {r.value.decode() for r in await read_all(bootstrap, topic, "read_committed", len(acked), 60)}
    assert acked <= seen
    kafka_cluster3.restart_node(victim.node_id)
