"""``rollway tail`` and ``rollway topics`` against real Kafka."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest

from bus import EventConsumer, EventProducer
from bus.tail import TailError, TailOptions, parse_since, tail
from schemas import Cost, Reward
from tests.samples import sample_chunk

pytestmark = pytest.mark.kafka


def reward(i: int, score: float, turns: int = 1) -> Reward:
    return Reward(trajectory_id=f"traj-{i}", task_id=f"task-{i % 3}", group_id="g", sample_index=i,
                  attempt="a", score=score, reward=score, cost=Cost(generated_tokens=10 * i, turns=turns))


async def run_tail(cfg, **opts) -> list[str]:
    out = io.StringIO()
    await tail(cfg, TailOptions(**opts), out)
    return out.getvalue().splitlines()


@pytest.fixture
async def rewards_topic(kafka_config):
    topic = kafka_config.topic_prefix + "rewards"
    async with EventProducer(kafka_config) as producer:
        for i in range(12):
            await producer.publish(reward(i, score=1.0 if i % 2 else 0.0, turns=i), key=f"k{i % 2}")
        # A garbage record in partition 0 right after the good ones.
        await producer.publish_raw(topic, b"\xde\xad\xbe\xef", key=b"junk",
                                   headers=[("rollway-type", b"Reward")], partition=0)
    return kafka_config


async def test_tail_from_beginning_json_lines_and_garbage_as_hex(rewards_topic):
    lines = await run_tail(rewards_topic, topic="rewards", from_beginning=True)
    assert len(lines) == 13
    parsed = [json.loads(line) for line in lines]
    good = [p for p in parsed if not p.get("undecodable")]
    assert sorted(p["trajectory_id"] for p in good) == sorted(f"traj-{i}" for i in range(12))
    assert all(p["type"] == "Reward" for p in good)
    (bad,) = [p for p in parsed if p.get("undecodable")]
    assert bad["value_hex"] == "deadbeef" and "cannot decode Reward" in bad["error"]
    assert bad["partition"] == 0 and bad["key"] == "junk"


async def test_tail_filters_key_where_limit_and_meta(rewards_topic):
    lines = await run_tail(rewards_topic, topic="rewards", from_beginning=True, key="k1")
    assert sorted(json.loads(x)["sample_index"] for x in lines) == [1, 3, 5, 7, 9, 11]
    lines = await run_tail(rewards_topic, topic="rewards", from_beginning=True,
                           where=["score=1", "cost.turns>=7"])
    assert sorted(json.loads(x)["sample_index"] for x in lines) == [7, 9, 11]
    lines = await run_tail(rewards_topic, topic="rewards", from_beginning=True, where=["task_id!=task-0"])
    assert sorted(json.loads(x)["sample_index"] for x in lines) == [1, 2, 4, 5, 7, 8, 10, 11]
    lines = await run_tail(rewards_topic, topic="rewards", from_beginning=True, limit=4)
    assert len(lines) == 4
    lines = await run_tail(rewards_topic, topic="rewards", from_beginning=True, meta=True, where=["sample_index=3"])
    meta = json.loads(lines[0])["_meta"]
    assert meta["key"] == "k1" and meta["headers"] == {"rollway-type": "Reward", "rollway-schema": "1"}
    assert meta["topic"] == rewards_topic.topic_prefix + "rewards" and meta["offset"] >= 0


async def test_tail_offset_and_last(rewards_topic):
    all_lines = [json.loads(x) for x in await run_tail(rewards_topic, topic="rewards", from_beginning=True, meta=True)]
    p0 = [x for x in all_lines if not x.get("undecodable") and x["_meta"]["partition"] == 0]
    lines = await run_tail(rewards_topic, topic="rewards", offsets=["0:2"], meta=True)
    offsets = [json.loads(x).get("_meta", json.loads(x)).get("offset") for x in lines]
    assert offsets == list(range(2, len(p0) + 1))  # partition 0 only, from offset 2, garbage last
    lines = await run_tail(rewards_topic, topic="rewards", last=1)
    assert len(lines) == 2  # the newest record of each of the two partitions


async def test_tail_since(rewards_topic):
    assert len(await run_tail(rewards_topic, topic="rewards", since="1h")) == 13
    future = str(int(time.time() * 1000) + 3_600_000)
    assert await run_tail(rewards_topic, topic="rewards", since=future) == []


async def test_tail_follow_sees_new_records(kafka_config):
    import asyncio

    out = io.StringIO()
    task = asyncio.create_task(tail(kafka_config, TailOptions(topic="rewards", follow=True, limit=2), out))
    await asyncio.sleep(1.0)
    async with EventProducer(kafka_config) as producer:
        await producer.publish(reward(100, 1.0))
        await producer.publish(reward(101, 0.0))
    assert await asyncio.wait_for(task, 20) == 2
    # Different keys may land on different partitions: no order across them.
    assert sorted(json.loads(x)["sample_index"] for x in out.getvalue().splitlines()) == [100, 101]


async def test_tail_line_format_and_decoded_arrays(kafka_config):
    async with EventProducer(kafka_config) as producer:
        await producer.publish(sample_chunk(n=4))
    (line,) = await run_tail(kafka_config, topic="trajectories", format="line", from_beginning=True)
    assert "TrajectoryChunk key=task-1/g0/s0/a1" in line and "finish_reason=submitted" in line
    (js,) = await run_tail(kafka_config, topic="trajectories", from_beginning=True, decode_arrays=True)
    data = json.loads(js)
    assert data["token_ids"] == [10, 11, 12, 13]
    assert data["kept_sets"] == [[10, 99], [11], [12, 99], [13]]
    assert data["token_versions"] == [3, 3, 4, 4]


async def test_tail_joins_no_group(kafka_config):
    from bus.admin import admin_client

    await run_tail(kafka_config, topic="rewards", from_beginning=True)
    admin = admin_client(kafka_config)
    await admin.start()
    try:
        groups = [g[0] for g in await admin.list_consumer_groups()]
    finally:
        await admin.close()
    assert not any("tail" in g for g in groups)


async def test_tail_bad_options_are_named(kafka_config):
    with pytest.raises(TailError, match="--offset"):
        await run_tail(kafka_config, topic="rewards", offsets=["zero"])
    with pytest.raises(TailError, match="--where"):
        await run_tail(kafka_config, topic="rewards", where=["no operator"])
    with pytest.raises(TailError, match="does not exist"):
        await run_tail(kafka_config, topic="no-such-topic")
    with pytest.raises(TailError, match="--since"):
        parse_since("yesterday-ish")
    assert parse_since("10m", now_ms=1_000_000) == 400_000
    assert parse_since("1700000000") == 1_700_000_000_000


def cli_env(cfg) -> dict[str, str]:
    return {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": cfg.bootstrap_servers,
            "ROLLWAY_KAFKA__TOPIC_PREFIX": cfg.topic_prefix}


async def test_rollway_tail_and_topics_commands(rewards_topic):
    env = cli_env(rewards_topic)
    proc = subprocess.run([sys.executable, "-m", "rollway.cli", "tail", "rewards", "--from-beginning",
                           "--format", "line", "--where", "sample_index=5"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 1 and "traj-5" in proc.stdout
    async with EventConsumer(rewards_topic, ["rewards"], group_id="lag-check") as consumer:
        got = 0
        async for env_ in consumer:
            await consumer.ack(env_)
            got += 1
            if got == 5:
                break
    proc = subprocess.run([sys.executable, "-m", "rollway.cli", "topics", "--group", "lag-check"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = {int(r.split()[1]): r.split() for r in proc.stdout.splitlines()
            if r.startswith(rewards_topic.topic_prefix + "rewards")}
    # Keys k0/k1 both hash to partition 1 (12 rewards); partition 0 holds only the
    # garbage record: if the group happened to read it, it was dead-lettered and
    # committed (lag 0), otherwise the partition has no committed offset and no lag.
    assert rows[1][2:] == ["0", "12", "lag-check=7(at", "5)"]
    assert rows[0][2:] in (["0", "1", "-"], ["0", "1", "lag-check=0(at", "1)"])
