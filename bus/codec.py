"""Event <-> Kafka record: msgpack body, type and schema version in headers."""

from __future__ import annotations

from typing import Sequence

import msgspec

from schemas import EVENT_TYPES, Event

TYPE_HEADER = "rollway-type"
SCHEMA_HEADER = "rollway-schema"

Headers = Sequence[tuple[str, bytes]]

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


class DecodeFailure(Exception):
    """A record could not be turned into an event. ``kind`` says why, for the DLQ."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # decode | unknown_type | newer_schema


def encode(event: Event) -> tuple[bytes, list[tuple[str, bytes]]]:
    cls = type(event)
    headers = [
        (TYPE_HEADER, cls.__name__.encode()),
        (SCHEMA_HEADER, str(cls.SCHEMA_VERSION).encode()),
    ]
    return _encoder.encode(event), headers


def header_value(headers: Headers | None, name: str) -> bytes | None:
    for key, value in headers or ():
        if key == name:
            return value
    return None


def event_type_of(headers: Headers | None) -> type[Event]:
    raw = header_value(headers, TYPE_HEADER)
    if raw is None:
        raise DecodeFailure("unknown_type", f"record has no {TYPE_HEADER!r} header")
    name = raw.decode(errors="replace")
    cls = EVENT_TYPES.get(name)
    if cls is None:
        raise DecodeFailure("unknown_type", f"unknown event type {name!r}")
    version = header_value(headers, SCHEMA_HEADER)
    try:
        schema = int(version) if version is not None else 1
    except ValueError:
        raise DecodeFailure("decode", f"bad {SCHEMA_HEADER!r} header {version!r}") from None
    if schema > cls.SCHEMA_VERSION:
        raise DecodeFailure(
            "newer_schema",
            f"{name} schema {schema} is newer than this build understands ({cls.SCHEMA_VERSION})",
        )
    return cls


# Event type (and its decoder) by a record's whole headers tuple: every record of a type
# carries the same headers, so the header scan and version parse run once per kind, not
# once per record (the trainer decodes tens of thousands a second). Bounded: headers
# are the producers' to choose.
_by_headers: dict[tuple, tuple[type[Event], msgspec.msgpack.Decoder]] = {}
_BY_HEADERS_MAX = 256


def decode(value: bytes | None, headers: Headers | None, expect: type[Event] | None = None) -> Event:
    """Decode a record's value; raise :class:`DecodeFailure` naming what was wrong."""
    known = _by_headers.get(headers) if type(headers) is tuple else None
    if known is not None and expect is None and value is not None:
        cls, decoder = known
        try:
            return decoder.decode(value)
        except msgspec.DecodeError as exc:
            raise DecodeFailure("decode", f"cannot decode {cls.__name__}: {exc}") from None
    cls = event_type_of(headers)
    if expect is not None and cls is not expect:
        raise DecodeFailure("unknown_type", f"expected {expect.__name__}, record is {cls.__name__}")
    if value is None:
        raise DecodeFailure("decode", f"{cls.__name__} record has no value (tombstone)")
    decoder = _decoders.get(cls)
    if decoder is None:
        decoder = _decoders[cls] = msgspec.msgpack.Decoder(cls)
    if type(headers) is tuple:
        try:
            if len(_by_headers) >= _BY_HEADERS_MAX:
                _by_headers.clear()
            _by_headers[headers] = (cls, decoder)
        except TypeError:  # an unhashable header value: decoded the long way each time
            pass
    try:
        return decoder.decode(value)
    except msgspec.DecodeError as exc:
        raise DecodeFailure("decode", f"cannot decode {cls.__name__}: {exc}") from None
