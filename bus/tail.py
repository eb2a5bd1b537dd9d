"""``rollway tail``: print a topic's records as JSON lines or a one-line view.

A plain Kafka reader: it assigns partitions itself and joins no consumer group
(unless ``group`` is given), so tailing never disturbs the components. Records that do
not decode are printed as hex with the decode error instead of stopping the tail.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import operator
import re
import time
from typing import Any, Callable, TextIO

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition

from bus import codec
from bus.config import KafkaConfig
from bus.topics import TOPICS
from schemas import TrajectoryChunk, arrays


class TailError(ValueError):
    """A bad tail option; the message names it."""


class TailOptions(msgspec.Struct, kw_only=True):
    topic: str
    format: str = "json"  # json | line
    from_beginning: bool = False
    offsets: list[str] = []  # "P:O"
    since: str | None = None  # "10m", "2h", ISO time or epoch milliseconds
    last: int = 10  # default start: the last N records of each partition
    follow: bool = False
    limit: int | None = None
    key: str | None = None
    where: list[str] = []  # "field=value", dotted paths, = != > < >= <=
    meta: bool = False  # partition, offset, timestamp, headers
    decode_arrays: bool = False  # expand packed per-token arrays into numbers
    group: str | None = None
    idle_timeout_s: float = 2.0  # without --follow: stop after this long with nothing new


# -- option parsing -------------------------------------------------------------------
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_since(value: str, now_ms: int | None = None) -> int:
    """Epoch milliseconds from '10m' (ago), an ISO-8601 time, or epoch ms/s."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = value.strip()
    match = _DURATION.match(value)
    if match:
        return now_ms - int(float(match.group(1)) * _UNIT_MS[match.group(2)])
    if value.isdigit():
        number = int(value)
        return number if number > 10**11 else number * 1000  # seconds or milliseconds
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise TailError(f"--since {value!r}: use 10m / 2h / 1d, an ISO time, or epoch ms") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1000)


def parse_offsets(specs: list[str]) -> dict[int, int]:
    out = {}
    for spec in specs:
        try:
            partition, offset = spec.split(":")
            out[int(partition)] = int(offset)
        except ValueError:
            raise TailError(f"--offset {spec!r}: expected PARTITION:OFFSET, e.g. 0:42") from None
    return out


_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, "<=": operator.le, "!=": operator.ne, "=": operator.eq, ">": operator.gt, "<": operator.lt,
}
_WHERE = re.compile(r"^([A-Za-z_][\w.]*)\s*(>=|<=|!=|=|>|<)\s*(.*)$")


class Condition(msgspec.Struct):
    path: list[str]
    op: str
    value: str

    def matches(self, data: Any) -> bool:
        for part in self.path:
            if not isinstance(data, dict) or part not in data:
                return False
            data = data[part]
        compare = _OPS[self.op]
        if isinstance(data, bool):
            return compare(str(data).lower(), self.value.lower())
        if isinstance(data, (int, float)):
            try:
                return compare(data, float(self.value))
            except ValueError:
                return False
        if self.op not in ("=", "!="):
            return False
        return compare(str(data), self.value)


def parse_where(specs: list[str]) -> list[Condition]:
    out = []
    for spec in specs:
        match = _WHERE.match(spec)
        if not match:
            raise TailError(f"--where {spec!r}: expected FIELD=VALUE (also != > < >= <=; dotted paths)")
        out.append(Condition(match.group(1).split("."), match.group(2), match.group(3)))
    return out


# -- rendering -------------------------------------------------------------------------
def event_to_builtins(event: Any, decode_arrays: bool) -> dict[str, Any]:
    data = msgspec.to_builtins(event)  # bytes become base64 strings
    if decode_arrays and isinstance(event, TrajectoryChunk):
        data["token_ids"] = event.token_array().tolist()
        data["logprobs"] = [round(float(x), 6) for x in event.logprob_array()]
        data["loss_mask"] = event.loss_mask_array().tolist()
        data["kept_sets"] = [s.tolist() for s in event.kept_sets()]
        data["kept_capped"] = event.kept_capped_array().tolist()
        data["token_versions"] = event.version_array().tolist()
        for packed in ("kept_offsets", "kept_ids", "version_starts", "versions"):
            data.pop(packed, None)
        if event.routed_experts:
            data["routed_experts"] = arrays.unpack(event.routed_experts, arrays.UINT8).tolist()
    return data


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    text = text.replace("\n", "\\n")
    return text if len(text) <= 40 else text[:37] + "..."


def render_line(record, type_name: str, data: dict[str, Any] | None, error: str | None, meta: bool) -> str:
    when = dt.datetime.fromtimestamp(record.timestamp / 1000, dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    head = f"{when} {record.topic}:{record.partition}@{record.offset}"
    if meta and record.headers:
        head += " [" + ",".join(f"{k}={v.decode(errors='replace')}" for k, v in record.headers) + "]"
    if error is not None:
        return f"{head} UNDECODABLE {error} value={(record.value or b'').hex()}"
    fields = " ".join(
        f"{k}={_short(v)}" for k, v in (data or {}).items()
        if v not in ("", None, [], {}) and not (isinstance(v, str) and len(v) > 200)
    )
    key = (record.key or b"").decode(errors="replace")
    return f"{head} {type_name} key={key} {fields}"


def render_json(record, type_name: str | None, data: dict[str, Any] | None, error: str | None, meta: bool) -> str:
    if error is not None:
        out = {"undecodable": True, "error": error, "value_hex": (record.value or b"").hex(),
               "topic": record.topic, "partition": record.partition, "offset": record.offset,
               "key": (record.key or b"").decode(errors="replace")}
        return msgspec.json.encode(out).decode()
    out = {"type": type_name, **(data or {})}
    if meta:
        out["_meta"] = {
            "topic": record.topic, "partition": record.partition, "offset": record.offset,
            "timestamp_ms": record.timestamp, "key": (record.key or b"").decode(errors="replace"),
            "headers": {k: v.decode(errors="replace") for k, v in (record.headers or ())},
        }
    return msgspec.json.encode(out).decode()


# -- the tail loop -------------------------------------------------------------------------
def full_topic_name(cfg: KafkaConfig, topic: str) -> str:
    if topic.startswith(cfg.topic_prefix):
        return topic
    if topic in TOPICS:
        return cfg.topic_prefix + topic
    return topic  # any other topic name, printed raw if its records are not events


async def tail(cfg: KafkaConfig, opts: TailOptions, out: TextIO) -> int:
    """Print matching records; returns how many were printed."""
    conditions = parse_where(opts.where)
    start_offsets = parse_offsets(opts.offsets)
    since_ms = parse_since(opts.since) if opts.since else None
    topic = full_topic_name(cfg, opts.topic)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=cfg.bootstrap_servers,
        client_id=f"{cfg.client_id}-tail",
        group_id=opts.group,
        enable_auto_commit=opts.group is not None,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    await consumer.start()
    printed = 0
    try:
        partitions = (await consumer._client.fetch_all_metadata()).partitions_for_topic(topic)
        if not partitions:
            raise TailError(f"topic {topic} does not exist")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        unknown = set(start_offsets) - set(partitions)
        if unknown:
            raise TailError(f"--offset names partitions {sorted(unknown)} that {topic} does not have")
        if opts.group is not None:
            consumer.subscribe([topic])
        else:
            consumer.assign(tps)
            await _position(consumer, tps, opts, start_offsets, since_ms)
        ends = await consumer.end_offsets(tps)
        render = render_json if opts.format == "json" else render_line
        idle_since = time.monotonic()
        while True:
            batch = await consumer.getmany(timeout_ms=200)
            if not batch:
                if not opts.follow:
                    positions_done = opts.group is None and await _caught_up(consumer, ends)
                    if positions_done or time.monotonic() - idle_since > opts.idle_timeout_s:
                        return printed
                continue
            idle_since = time.monotonic()
            for tp_records in batch.values():
                for record in tp_records:
                    if opts.key is not None and (record.key or b"").decode(errors="replace") != opts.key:
                        continue
                    line = _render_record(record, conditions, opts, render)
                    if line is None:
                        continue
                    out.write(line + "\n")
                    out.flush()
                    printed += 1
                    if opts.limit is not None and printed >= opts.limit:
                        return printed
    finally:
        await consumer.stop()


async def _caught_up(consumer, ends: dict) -> bool:
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return False
    return True


def _render_record(record, conditions: list[Condition], opts: TailOptions, render) -> str | None:
    headers = tuple(record.headers or ())
    try:
        event = codec.decode(record.value, headers)
    except codec.DecodeFailure as exc:
        if conditions:
            return None  # nothing to match a field against
        return render(record, None, None, str(exc), opts.meta)
    data = event_to_builtins(event, opts.decode_arrays)
    if not all(c.matches(data) for c in conditions):
        return None
    return render(record, type(event).__name__, data, None, opts.meta)


async def _position(consumer, tps, opts: TailOptions, start_offsets: dict[int, int], since_ms: int | None) -> None:
    begins = await consumer.beginning_offsets(tps)
    ends = await consumer.end_offsets(tps)
    if since_ms is not None:
        found = await consumer.offsets_for_times({tp: since_ms for tp in tps})
    for tp in tps:
        if tp.partition in start_offsets:
            target = start_offsets[tp.partition]
        elif start_offsets:
            target = ends[tp]  # only the named partitions are read
        elif since_ms is not None:
            hit = found.get(tp)
            target = hit.offset if hit is not None else ends[tp]
        elif opts.from_beginning:
            target = begins[tp]
        else:
            target = max(begins[tp], ends[tp] - opts.last)
        consumer.seek(tp, max(min(target, ends[tp]), begins[tp]))


def run_tail(cfg: KafkaConfig, opts: TailOptions, out: TextIO) -> int:
    return asyncio.run(tail(cfg, opts, out))
