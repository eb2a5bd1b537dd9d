"""``rollway tail``: answer questions about a topic from its records.

A plain Kafka reader (:mod:`bus.reader`): it assigns partitions itself and joins no
consumer group (unless ``group`` is given), so tailing never disturbs the components.

* ``--last N`` (the default start, N=10) is the newest N records *that match the
  filters*, counted across all partitions and printed merged by record time.
* ``--from-beginning`` / ``--since`` / ``--offset`` print every match from there to the
  end offsets seen at start, partition by partition.
* ``-f`` then keeps printing new records; ``-f`` alone starts from now.
* stdout carries matching events only. Records that do not decode go to stderr (JSON or
  a line, as ``--format`` says), or with ``skip_undecodable`` only their count does.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import difflib
import operator
import re
import sys
import time
import types
import typing
from typing import Any, Callable, TextIO

import msgspec
from aiokafka import TopicPartition

from bus import codec
from bus.config import KafkaConfig
from bus.connect import start_client, stop_consumer
from bus.clients import new_consumer
from bus.reader import plain_reader, read_ranges, topic_partitions
from bus.topics import TOPICS, topic_spec
from schemas import TrajectoryChunk

DEFAULT_LAST = 10


class TailError(ValueError):
    """A bad tail option; the message names it."""


class TailOptions(msgspec.Struct, kw_only=True):
    topic: str
    format: str = "json"  # json | line
    from_beginning: bool = False
    offsets: list[str] = []  # "P:O"
    since: str | None = None  # "10m", "2h", ISO time or epoch milliseconds
    last: int | None = None  # the newest N matches; default 10, or 0 with follow
    follow: bool = False
    limit: int | None = None
    key: str | None = None
    where: list[str] = []  # "field=value", dotted paths, = != > < >= <=
    meta: bool = False  # partition, offset, timestamp, headers
    decode_arrays: bool = False  # expand packed per-token arrays into numbers
    group: str | None = None
    skip_undecodable: bool = False  # count undecodable records instead of printing them
    max_width: int | None = None  # line format: cut each field value to this many characters
    idle_timeout_s: float = 2.0  # with a group and without --follow: stop after this long idle


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


# Keys a printed event has beyond its struct fields: its type, and what --decode-arrays adds.
_EXTRA_KEYS = {"type"}
_DECODED_KEYS = {"kept_sets", "token_versions"}


def _struct_of(annotation: Any) -> type[msgspec.Struct] | None:
    """The Struct an annotation names (also inside ``X | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _struct_of(arg)
            if found is not None:
                return found
    return None


def _path_problem(cls: type[msgspec.Struct], path: list[str], decode_arrays: bool) -> str | None:
    """Why ``path`` is not a field of ``cls`` (None when it is)."""
    extra = _EXTRA_KEYS | (_DECODED_KEYS if decode_arrays else set())
    for depth, part in enumerate(path):
        fields = {f.name: f.type for f in msgspec.structs.fields(cls)}
        if part not in fields and not (depth == 0 and part in extra):
            names = sorted(fields)
            near = difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            return f"{cls.__name__} has no field {part!r}{hint}; fields: {', '.join(names)}"
        inner = _struct_of(fields.get(part))
        if inner is None:
            return None  # a scalar, list or dict: deeper keys are the data's business
        cls = inner
    return None


def check_where(conditions: list[Condition], event_types: list[type], decode_arrays: bool = False) -> None:
    """Refuse a condition naming a field that none of ``event_types`` has (a typo would
    otherwise match nothing and look like "no such records")."""
    for cond in conditions:
        problems = [_path_problem(cls, cond.path, decode_arrays) for cls in event_types]
        if event_types and all(problems):
            raise TailError(f"--where {'.'.join(cond.path)}{cond.op}{cond.value}: {problems[0]}")


# -- rendering -------------------------------------------------------------------------
def event_to_builtins(event: Any, decode_arrays: bool, keep_bytes: bool = False) -> dict[str, Any]:
    """The event as plain data; bytes become base64 strings unless ``keep_bytes``."""
    data = msgspec.to_builtins(event, builtin_types=(bytes,) if keep_bytes else ())
    if decode_arrays and isinstance(event, TrajectoryChunk):
        data["token_ids"] = event.token_array().tolist()
        data["logprobs"] = [round(float(x), 6) for x in event.logprob_array()]
        data["loss_mask"] = event.loss_mask_array().tolist()
        data["kept_sets"] = [s.tolist() for s in event.kept_sets()]
        data["kept_capped"] = event.kept_capped_array().tolist()
        data["kept_sizes"] = event.kept_size_array().tolist()
        data["token_versions"] = event.version_array().tolist()
        for packed in ("kept_offsets", "kept_ids", "version_starts", "versions"):
            data.pop(packed, None)
        if event.routed_experts:
            data["routed_experts"] = event.routed_experts_array().tolist()
    return data


def iso_time(timestamp_ms: int) -> str:
    when = dt.datetime.fromtimestamp(timestamp_ms / 1000, dt.timezone.utc)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _field_text(value: Any, max_width: int | None) -> str:
    if isinstance(value, bytes):
        text = f"<{len(value)} bytes>"  # packed arrays: --decode-arrays shows the numbers
    elif isinstance(value, str):
        text = value
    else:
        text = msgspec.json.encode(value, enc_hook=lambda b: f"<{len(b)} bytes>").decode()
    text = text.replace("\n", "\\n")
    if max_width is not None and len(text) > max_width:
        text = text[:max(max_width - 3, 0)] + "..."
    return text


def render_line(record, type_name: str | None, data: dict[str, Any] | None, error: str | None, meta: bool,
                max_width: int | None = None) -> str:
    head = f"{iso_time(record.timestamp)} {record.topic}:{record.partition}@{record.offset}"
    if meta and record.headers:
        head += " [" + ",".join(f"{k}={v.decode(errors='replace')}" for k, v in record.headers) + "]"
    if error is not None:
        return f"{head} UNDECODABLE {error} value={(record.value or b'').hex()}"
    fields = " ".join(
        f"{k}={_field_text(v, max_width)}" for k, v in (data or {}).items() if v not in ("", None, [], {}, b"")
    )
    key = (record.key or b"").decode(errors="replace")
    return f"{head} {type_name} key={key} {fields}"


def render_json(record, type_name: str | None, data: dict[str, Any] | None, error: str | None, meta: bool,
                max_width: int | None = None) -> str:
    if error is not None:
        out = {"undecodable": True, "error": error, "value_hex": (record.value or b"").hex(),
               "topic": record.topic, "partition": record.partition, "offset": record.offset,
               "timestamp_ms": record.timestamp, "time": iso_time(record.timestamp),
               "key": (record.key or b"").decode(errors="replace")}
        return msgspec.json.encode(out).decode()
    out = {"type": type_name, **(data or {})}
    if meta:
        out["_meta"] = {
            "topic": record.topic, "partition": record.partition, "offset": record.offset,
            "timestamp_ms": record.timestamp, "time": iso_time(record.timestamp),
            "key": (record.key or b"").decode(errors="replace"),
            "headers": {k: v.decode(errors="replace") for k, v in (record.headers or ())},
        }
    return msgspec.json.encode(out).decode()


# -- matching and printing -------------------------------------------------------------------
class _LimitReached(Exception):
    pass


class _Item(msgspec.Struct):
    """A record that matched (``event`` set) or did not decode (``error`` set)."""

    record: Any
    type_name: str | None
    data: dict[str, Any] | None
    error: str | None

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.record.timestamp, self.record.partition, self.record.offset)


class _Printer:
    """Filters records and writes matches to ``out``, undecodable ones to ``err``."""

    def __init__(self, opts: TailOptions, conditions: list[Condition], out: TextIO, err: TextIO) -> None:
        self.opts = opts
        self.conditions = conditions
        self.out = out
        self.err = err
        self.render = render_json if opts.format == "json" else render_line
        self.printed = 0
        self.undecodable = 0

    def classify(self, record) -> _Item | None:
        """The record as a match or an undecodable item; None when filtered out."""
        if self.opts.key is not None and (record.key or b"").decode(errors="replace") != self.opts.key:
            return None
        try:
            event = codec.decode(record.value, tuple(record.headers or ()))
        except codec.DecodeFailure as exc:
            return _Item(record, None, None, str(exc))
        data = event_to_builtins(event, self.opts.decode_arrays, keep_bytes=self.opts.format == "line")
        type_name = type(event).__name__
        if self.conditions and not all(c.matches({"type": type_name, **data}) for c in self.conditions):
            return None
        return _Item(record, type_name, data, None)

    def emit(self, item: _Item) -> None:
        if item.error is not None:
            self.undecodable += 1
            if not self.opts.skip_undecodable:
                self.err.write(self.render(item.record, None, None, item.error, self.opts.meta) + "\n")
                self.err.flush()
            return
        self.out.write(self.render(item.record, item.type_name, item.data, None, self.opts.meta,
                                   self.opts.max_width) + "\n")
        self.out.flush()
        self.printed += 1
        if self.opts.limit is not None and self.printed >= self.opts.limit:
            raise _LimitReached

    def feed(self, record) -> None:
        item = self.classify(record)
        if item is not None:
            self.emit(item)


# -- the tail --------------------------------------------------------------------------------
def full_topic_name(cfg: KafkaConfig, topic: str) -> str:
    if topic.startswith(cfg.topic_prefix):
        return topic
    if topic in TOPICS:
        return cfg.topic_prefix + topic
    return topic  # any other topic name, printed raw if its records are not events


def _event_types(cfg: KafkaConfig, topic: str) -> list[type]:
    """The event types a topic carries ([] for a topic outside the registry)."""
    try:
        return [topic_spec(topic, cfg.topic_prefix).event_type] if topic.startswith(cfg.topic_prefix) else []
    except KeyError:
        return []


async def tail(cfg: KafkaConfig, opts: TailOptions, out: TextIO, err: TextIO | None = None,
               live: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> int:
    """Print matching records; returns how many were printed. ``live`` is set once the
    bounded part is printed and, with ``follow``, the positions for new records are fixed
    (anything published after that is printed). Following ends when ``stop`` is set."""
    stop = stop if stop is not None else asyncio.Event()
    err = err if err is not None else sys.stderr
    conditions = parse_where(opts.where)
    start_offsets = parse_offsets(opts.offsets)
    since_ms = parse_since(opts.since) if opts.since else None
    if opts.last is not None and opts.last < 0:
        raise TailError(f"--last {opts.last}: must be 0 or more")
    topic = full_topic_name(cfg, opts.topic)
    check_where(conditions, _event_types(cfg, topic), opts.decode_arrays)
    printer = _Printer(opts, conditions, out, err)
    consumer = plain_reader(cfg, "tail") if opts.group is None else None
    try:
        if opts.group is not None:
            await _tail_as_group(cfg, topic, opts, printer, stop)
        else:
            await start_client(consumer, cfg.bootstrap_servers, "tail")
            await _tail(consumer, topic, opts, printer, start_offsets, since_ms, live, stop)
    except _LimitReached:
        pass
    finally:
        if consumer is not None:
            await stop_consumer(consumer)
        if opts.skip_undecodable and printer.undecodable:
            print(f"rollway tail: skipped {printer.undecodable} undecodable record(s)", file=err)
    return printer.printed


async def _tail(consumer, topic: str, opts: TailOptions, printer: _Printer, start_offsets: dict[int, int],
                since_ms: int | None, live: asyncio.Event | None, stop: asyncio.Event) -> None:
    tps = await topic_partitions(consumer, topic)
    if not tps:
        raise TailError(f"topic {topic} does not exist")
    unknown = set(start_offsets) - {tp.partition for tp in tps}
    if unknown:
        raise TailError(f"--offset names partitions {sorted(unknown)} that {topic} does not have")
    begins = await consumer.beginning_offsets(tps)
    ends = await consumer.end_offsets(tps)
    explicit_start = bool(start_offsets) or since_ms is not None or opts.from_beginning
    if explicit_start:
        starts = await _starts(consumer, tps, opts, begins, ends, start_offsets, since_ms)
        async for records in read_ranges(consumer, {tp: (starts[tp], ends[tp]) for tp in tps}):
            for record in records:
                printer.feed(record)
    else:
        last = opts.last if opts.last is not None else (0 if opts.follow else DEFAULT_LAST)
        for item in await _last_matching(consumer, tps, begins, ends, last, printer):
            printer.emit(item)
    if opts.follow:
        await _follow(consumer, tps, ends, printer, live, stop)
    elif live is not None:
        live.set()


async def _starts(consumer, tps, opts: TailOptions, begins, ends, start_offsets: dict[int, int],
                  since_ms: int | None) -> dict[TopicPartition, int]:
    if since_ms is not None:
        found = await consumer.offsets_for_times({tp: since_ms for tp in tps})
    out = {}
    for tp in tps:
        if tp.partition in start_offsets:
            target = start_offsets[tp.partition]
        elif start_offsets:
            target = ends[tp]  # only the named partitions are read
        elif since_ms is not None:
            hit = found.get(tp)
            target = hit.offset if hit is not None else ends[tp]
        else:
            target = begins[tp]
        out[tp] = max(min(target, ends[tp]), begins[tp])
    return out


async def _last_matching(consumer, tps, begins, ends, n: int, printer: _Printer) -> list[_Item]:
    """The newest ``n`` matches across all partitions merged by record time, with the
    undecodable records among them. Each partition is read backwards in growing windows
    until it holds ``n`` matches (no partition can contribute more than that)."""
    if n == 0:
        return []
    items: list[_Item] = []
    for tp in tps:
        high, window, found = ends[tp], max(2 * n, 100), 0
        while high > begins[tp] and found < n:
            low = max(begins[tp], high - window)
            async for records in read_ranges(consumer, {tp: (low, high)}):
                for record in records:
                    item = printer.classify(record)
                    if item is not None:
                        items.append(item)
                        found += item.error is None
            high, window = low, window * 2
    items.sort(key=lambda item: item.order)
    matches = 0
    for cut in range(len(items) - 1, -1, -1):
        matches += items[cut].error is None
        if matches == n:
            return items[cut:]
    return items


async def _follow(consumer, tps, ends, printer: _Printer, live: asyncio.Event | None, stop: asyncio.Event) -> None:
    """Print records written after ``ends`` until ``stop`` (Ctrl-C), cancelled, or the limit."""
    consumer.assign(tps)
    for tp in tps:
        consumer.seek(tp, ends[tp])
    if live is not None:
        live.set()
    while not stop.is_set():
        batch = await consumer.getmany(timeout_ms=500)
        for records in batch.values():
            for record in records:
                printer.feed(record)


async def _tail_as_group(cfg: KafkaConfig, topic: str, opts: TailOptions, printer: _Printer,
                         stop: asyncio.Event) -> None:
    """Consume as a consumer group (offsets auto-committed); stops when idle unless following."""
    consumer = new_consumer(
        cfg, f"{cfg.client_id}-tail", group_id=opts.group,
        enable_auto_commit=True, auto_offset_reset="earliest", isolation_level="read_committed",
    )
    await start_client(consumer, cfg.bootstrap_servers, "tail")
    try:
        if not await topic_partitions(consumer, topic):
            raise TailError(f"topic {topic} does not exist")
        consumer.subscribe([topic])
        idle_since = time.monotonic()
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=200)
            if not batch:
                if not opts.follow and time.monotonic() - idle_since > opts.idle_timeout_s:
                    return
                continue
            idle_since = time.monotonic()
            for records in batch.values():
                for record in records:
                    printer.feed(record)
    finally:
        await stop_consumer(consumer)


def run_tail(cfg: KafkaConfig, opts: TailOptions, out: TextIO, err: TextIO | None = None) -> int:
    """``tail`` in its own event loop; Ctrl-C ends it with ``KeyboardInterrupt`` (exit 130
    in ``rollway.cli``) after the consumer is closed. The first SIGINT both cancels and sets
    ``stop``, because aiokafka's ``getmany`` can swallow a cancellation
    (aio-libs/aiokafka#983): the follow loop then ends at its next poll instead of never."""
    import signal

    async def main() -> int:
        stop = asyncio.Event()
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()

        def interrupt() -> None:
            if stop.is_set():
                raise KeyboardInterrupt  # a second Ctrl-C: stop waiting for a clean close
            stop.set()
            task.cancel()

        loop.add_signal_handler(signal.SIGINT, interrupt)
        try:
            printed = await tail(cfg, opts, out, err, stop=stop)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
        if stop.is_set():
            raise KeyboardInterrupt
        return printed

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None
