"""``rollway tail`` and ``rollway topics`` against real Kafka."""

from __future__ import annotations

import io
import json
import subprocess
import time

import pytest

from bus import EventConsumer, EventProducer, encode
from bus.tail import TailError, TailOptions, parse_since, tail
from schemas import Cost, Reward
from tests.cli import ROLLWAY, kafka_env, run_cli
from tests.samples import sample_chunk

pytestmark = pytest.mark.kafka


def reward(i: int, score: float, turns: int = 1) -> Reward:
    return Reward(trajectory_id=f"traj-{i}", task_id=f"task-{i % 3}", group_id="g", sample_index=i,
                  attempt="a", score=score, reward=score, cost=Cost(generated_tokens=10 * i, turns=turns))


async def run_tail(cfg, **opts) -> list[str]:
    return (await run_tail_both(cfg, **opts))[0]


async def run_tail_both(cfg, **opts) -> tuple[list[str], list[str]]:
    """(stdout lines, stderr lines) of a tail."""
    out, err = io.StringIO(), io.StringIO()
    await tail(cfg, TailOptions(**opts), out, err)
    return out.getvalue().splitlines(), err.getvalue().splitlines()


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


async def test_tail_from_beginning_json_lines_and_garbage_on_stderr(rewards_topic):
    lines, errors = await run_tail_both(rewards_topic, topic="rewards", from_beginning=True)
    # Regression: stdout is events only (jq used to get rows of nulls); garbage goes to stderr.
    parsed = [json.loads(line) for line in lines]
    assert sorted(p["trajectory_id"] for p in parsed) == sorted(f"traj-{i}" for i in range(12))
    assert all(p["type"] == "Reward" for p in parsed)
    (bad,) = [json.loads(line) for line in errors]
    assert bad["undecodable"] is True and bad["value_hex"] == "deadbeef" and "cannot decode Reward" in bad["error"]
    assert bad["partition"] == 0 and bad["key"] == "junk" and bad["time"].endswith("Z")
    # Regression: with --where, undecodable records used to vanish without notice.
    lines, errors = await run_tail_both(rewards_topic, topic="rewards", from_beginning=True, where=["score=1"])
    assert len(lines) == 6 and len(errors) == 1 and json.loads(errors[0])["value_hex"] == "deadbeef"
    # Or skipped, with their count.
    lines, errors = await run_tail_both(rewards_topic, topic="rewards", from_beginning=True, skip_undecodable=True)
    assert len(lines) == 12 and errors == ["rollway tail: skipped 1 undecodable record(s)"]


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


async def test_tail_offset(rewards_topic):
    lines, errors = await run_tail_both(rewards_topic, topic="rewards", offsets=["0:0"], meta=True)
    # Partition 0 only (keys k0/k1 both land on partition 1): just the garbage record.
    assert lines == [] and [json.loads(e)["offset"] for e in errors] == [0]
    lines = await run_tail(rewards_topic, topic="rewards", offsets=["1:10"], meta=True)
    assert [json.loads(x)["_meta"]["offset"] for x in lines] == [10, 11]


async def test_tail_since(rewards_topic):
    lines, errors = await run_tail_both(rewards_topic, topic="rewards", since="1h")
    assert len(lines) == 12 and len(errors) == 1
    future = str(int(time.time() * 1000) + 3_600_000)
    assert await run_tail_both(rewards_topic, topic="rewards", since=future) == ([], [])


BASE_MS = 1_780_000_000_000


@pytest.fixture
async def timed_rewards(kafka_config):
    """20 rewards one second apart, alternating between the 2 partitions, written
    partition 0 first: fetch order is not time order. Then a garbage record, newest."""
    topic = kafka_config.topic_prefix + "rewards"
    async with EventProducer(kafka_config) as producer:
        for partition in (0, 1):
            for i in range(partition, 20, 2):
                value, headers = encode(reward(i, score=1.0 if i % 2 else 0.0, turns=i))
                await producer.raw.send_and_wait(topic, value, key=f"k{i}".encode(), headers=headers,
                                                 partition=partition, timestamp_ms=BASE_MS + i * 1000)
        await producer.raw.send_and_wait(topic, b"\x01", key=b"junk", headers=[("rollway-type", b"Reward")],
                                         partition=1, timestamp_ms=BASE_MS + 60_000)
    return kafka_config


async def test_tail_last_counts_across_partitions_after_filtering_merged_by_time(timed_rewards):
    # Regression: --last counted per partition before --where (4 records, out of order).
    lines, errors = await run_tail_both(timed_rewards, topic="rewards", last=5, where=["task_id=task-0"])
    assert [json.loads(x)["sample_index"] for x in lines] == [6, 9, 12, 15, 18]
    assert len(errors) == 1  # the garbage record is newer than the oldest match printed
    # Regression: no flags printed 10 per partition; now the newest 10 overall, in time order.
    lines = await run_tail(timed_rewards, topic="rewards", skip_undecodable=True)
    assert [json.loads(x)["sample_index"] for x in lines] == list(range(10, 20))
    lines = await run_tail(timed_rewards, topic="rewards", last=3, where=["score=1", "cost.turns<=9"])
    assert [json.loads(x)["sample_index"] for x in lines] == [5, 7, 9]
    lines = await run_tail(timed_rewards, topic="rewards", last=100)
    assert [json.loads(x)["sample_index"] for x in lines] == list(range(20))
    assert await run_tail(timed_rewards, topic="rewards", last=0) == []
    with pytest.raises(TailError, match="--last -1"):
        await run_tail(timed_rewards, topic="rewards", last=-1)


async def test_tail_line_format_has_full_timestamps_and_whole_nested_fields(timed_rewards):
    (line,) = await run_tail(timed_rewards, topic="rewards", last=1, format="line")
    assert line.startswith("2026-05-28T20:26:59.000Z ")  # BASE_MS + 19 s, with the date, in UTC
    cost = '{"generated_tokens":190,"env_tokens":0,"turns":19,"tool_seconds":0.0,"segments":1,"template_rerenders":0}'
    assert f" cost={cost} " in line  # regression: nested fields were cut at 40 characters
    (short,) = await run_tail(timed_rewards, topic="rewards", last=1, format="line", max_width=12)
    assert ' cost={"generat... ' in short and " trajectory_id=traj-19 " in short


async def test_tail_where_field_names_are_checked_against_the_event_type(timed_rewards):
    # Regression: a typo printed nothing and looked like "no such records".
    with pytest.raises(TailError, match=r"--where scor=1: Reward has no field 'scor' \(did you mean 'score'\?\)"):
        await run_tail(timed_rewards, topic="rewards", where=["scor=1"])
    with pytest.raises(TailError, match="Cost has no field 'turnz'"):
        await run_tail(timed_rewards, topic="rewards", where=["cost.turnz>1"])
    with pytest.raises(TailError, match="EvalResult has no field 'pass_at1'"):
        await run_tail(timed_rewards, topic="evals", where=["pass_at1>0"])
    assert await run_tail(timed_rewards, topic="evals", where=["pass_at_1>0", "per_kind.arith>0"]) == []
    assert len(await run_tail(timed_rewards, topic="rewards", where=["type=Reward"], last=2)) == 2


async def test_tail_follow_alone_prints_only_new_records(rewards_topic):
    import asyncio

    out, live = io.StringIO(), asyncio.Event()
    task = asyncio.create_task(tail(rewards_topic, TailOptions(topic="rewards", follow=True, limit=2), out,
                                    io.StringIO(), live))
    await asyncio.wait_for(live.wait(), 20)
    assert out.getvalue() == ""  # regression: -f used to replay old records first
    async with EventProducer(rewards_topic) as producer:
        await producer.publish(reward(100, 1.0))
        await producer.publish(reward(101, 0.0))
    assert await asyncio.wait_for(task, 20) == 2
    # Different keys may land on different partitions: no order across them.
    assert sorted(json.loads(x)["sample_index"] for x in out.getvalue().splitlines()) == [100, 101]


async def test_tail_last_then_follow(rewards_topic):
    import asyncio

    out, live = io.StringIO(), asyncio.Event()
    opts = TailOptions(topic="rewards", follow=True, last=2, limit=3, skip_undecodable=True)
    task = asyncio.create_task(tail(rewards_topic, opts, out, io.StringIO(), live))
    await asyncio.wait_for(live.wait(), 20)
    async with EventProducer(rewards_topic) as producer:
        await producer.publish(reward(102, 1.0))
    assert await asyncio.wait_for(task, 20) == 3
    assert [json.loads(x)["sample_index"] for x in out.getvalue().splitlines()] == [10, 11, 102]


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


async def test_rollway_tail_and_topics_commands(rewards_topic):
    env = kafka_env(rewards_topic)
    proc = run_cli("tail", "rewards", "--from-beginning", "--format", "line", "--where", "sample_index=5", env=env)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 1 and "traj-5" in proc.stdout
    async with EventConsumer(rewards_topic, ["rewards"], group_id="lag-check") as consumer:
        got = 0
        async for env_ in consumer:
            await consumer.ack(env_)
            got += 1
            if got == 5:
                break
    proc = run_cli("topics", "--group", "lag-check", env=env)
    assert proc.returncode == 0, proc.stderr
    rows = {int(r.split()[1]): r.split() for r in proc.stdout.splitlines()
            if r.startswith(rewards_topic.topic_prefix + "rewards")}
    # Keys k0/k1 both hash to partition 1 (12 rewards); partition 0 holds only the
    # garbage record: if the group happened to read it, it was dead-lettered and
    # committed (lag 0), otherwise the partition has no committed offset and no lag.
    assert rows[1][2:] == ["0", "12", "lag-check=7(at", "5)"]
    assert rows[0][2:] in (["0", "1", "-"], ["0", "1", "lag-check=0(at", "1)"])


def test_rollway_tail_where_typo_exits_2_and_help_lists_the_questions():
    proc = run_cli("tail", "rewards", "--where", "scor=1", env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("rollway tail: --where scor=1: Reward has no field 'scor'")
    proc = run_cli("tail", "--help")
    assert "rollway tail rewards --last 5 --where task_id=task-3" in proc.stdout
    assert "rollway tail rewards -f" in proc.stdout


async def test_rollway_tail_exits_cleanly_on_ctrl_c_and_closed_pipe(rewards_topic):
    import asyncio
    import signal

    argv = [*ROLLWAY, "tail", "rewards", "--from-beginning", "-f", "--skip-undecodable"]
    interrupted = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=kafka_env(rewards_topic))
    piped = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=kafka_env(rewards_topic))
    try:
        for proc in (interrupted, piped):  # each is following once its first record is out
            assert "traj-" in await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        interrupted.send_signal(signal.SIGINT)
        _, err = await asyncio.to_thread(interrupted.communicate, timeout=30)
        assert interrupted.returncode == 130 and "Traceback" not in err, err
        piped.stdout.close()  # `| head` has what it wanted; the next write hits a closed pipe
        async with EventProducer(rewards_topic) as producer:
            await producer.publish(reward(200, 1.0))
        err = await asyncio.wait_for(asyncio.to_thread(piped.stderr.read), 60)
        assert await asyncio.to_thread(piped.wait, 30) == 0 and "Traceback" not in err, err
        assert "Exception ignored" not in err, err
    finally:
        interrupted.kill()
        piped.kill()
