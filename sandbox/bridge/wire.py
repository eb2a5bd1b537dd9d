"""The bridge's wire: length-prefixed frames of compact ASCII JSON, read strictly.

One job: bytes on the connection's file descriptors <-> one message (a JSON list whose
first item is a string). The grader joins the two ends with two pipes, one each way
(a pipe's round trip between two processes on one CPU costs about half a Unix socket's);
one socket for both directions works the same (``rfd == wfd``). Reads and writes are
plain ``os.read``/``os.write`` on blocking descriptors: one system call per message each
way in a round trip, no poll.
Ints too long for ``str(int)`` (Python's 4,300-digit conversion limit, or a lower one set
by the interpreter) go as ``["I", hex]``: hexadecimal is not limited, so an int of any
size crosses and never kills the sending process. Both ends decode ``["I", hex]`` wherever
a value or an integer operand may stand (codec).
"""

from __future__ import annotations

import json
import os
import struct

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
HEADER = struct.Struct("<I")
READ_SIZE = 64 * 1024
# Ints wider than this many bits are sent in hexadecimal when the JSON encoder refuses
# them (2,000 bits is under the lowest limit Python allows, 640 decimal digits).
_WIDE_INT_BITS = 2000
_HEX = frozenset("0123456789abcdef")


class BridgeError(RuntimeError):
    """The other side broke the protocol, refused an operation, or went away."""


class TooLarge(BridgeError):
    """A message over MAX_MESSAGE_BYTES: refused before anything was written."""


class Stop(Exception):
    """The peer closed the connection."""


# The C encoder and scanner of the json module, built once (json.dumps/loads rebuild an
# encoder and wrap the C code in several Python calls per message: most of a bridge
# call's Python time before; docs/sandbox.md).
_c_encoder = getattr(json.encoder, "c_make_encoder", None)


def _unencodable(o):
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


if _c_encoder is not None:
    # (markers, default, encoder, indent, key_separator, item_separator, sort_keys,
    # skipkeys, allow_nan). No circular-reference markers: messages are built here and
    # never cyclic.
    _encode_chunks = _c_encoder(None, _unencodable, json.encoder.encode_basestring_ascii, None,
                                ":", ",", False, False, True)

    def _dump(msg) -> str:
        return "".join(_encode_chunks(msg, 0))
else:  # an interpreter without the _json accelerator
    _encoder = json.JSONEncoder(separators=(",", ":"), allow_nan=True, check_circular=False)
    _dump = _encoder.encode

_scan_once = json.decoder.JSONDecoder().scan_once


def dumps(msg) -> bytes:
    try:
        return _dump(msg).encode("ascii")
    except ValueError:
        # An int over the str() conversion limit: resend with every wide int in hex.
        return _dump(_hex_ints(msg)).encode("ascii")


def _hex_ints(msg):
    """A copy of ``msg`` (nested lists and scalars) with wide ints as ``["I", hex]``."""
    def conv(x):
        t = type(x)
        if t is int and x.bit_length() > _WIDE_INT_BITS:
            return ["I", format(x, "x")]
        if t is list:
            return [conv(y) for y in x]
        return x
    # Messages are shallow (values travel in flat postfix form), so recursion is bounded.
    return conv(msg)


def wide_int(raw) -> int:
    """The int of an ``["I", hex]`` marker, read strictly."""
    if not (len(raw) == 2 and type(raw[1]) is str and raw[1]):
        raise BridgeError("malformed wide int on the grading bridge")
    digits = raw[1][1:] if raw[1][0] == "-" else raw[1]
    if not digits or not _HEX.issuperset(digits):
        raise BridgeError("malformed wide int on the grading bridge")
    return int(raw[1], 16)


def loads(payload: bytes):
    """One message, decoded strictly: UTF-8, one JSON value and nothing after it, a list
    whose first item is a string."""
    try:
        text = payload.decode("utf-8")
        msg, end = _scan_once(text, 0)
    except StopIteration:
        raise BridgeError("undecodable message on the grading bridge") from None
    except (ValueError, RecursionError) as exc:
        raise BridgeError(f"undecodable message on the grading bridge: {exc}") from None
    if end != len(text):
        raise BridgeError("undecodable message on the grading bridge: data after the message")
    if type(msg) is not list or not msg or type(msg[0]) is not str:
        raise BridgeError("malformed message on the grading bridge")
    return msg


class Wire:
    """Framing over ``self._rfd``/``self._wfd``: one header + body per message, in one write; a busy
    end pins itself to one CPU after ``_pin_at`` messages (a ping-pong is cheapest on one
    CPU). Deferred calls waiting in ``self._outbox`` go out ahead of the next message."""

    def _send(self, msg) -> None:
        data = dumps(msg)
        if len(data) > MAX_MESSAGE_BYTES:
            raise TooLarge(f"message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
        self._sends += 1
        if self._sends == self._pin_at:
            self._pin()
        frame = HEADER.pack(len(data)) + data
        if self._batch:
            self._flush_batch()
        if self._outbox:
            frame = bytes(self._outbox) + frame
            self._outbox.clear()
        self._write(frame)

    def _write(self, data) -> None:
        try:
            n = os.write(self._wfd, data)
            if n < len(data):  # a write larger than the pipe's free space can return early
                view = memoryview(data)
                while n < len(view):
                    n += os.write(self._wfd, view[n:])
        except OSError as exc:
            self.closed = True
            raise BridgeError(f"the other side of the grading bridge went away ({exc})") from None

    def _pin(self) -> None:
        try:
            os.sched_setaffinity(0, {self._cpu})
        except (AttributeError, OSError, TypeError, ValueError, OverflowError):
            pass  # a CPU outside this sandbox's set, say: calls stay correct, only slower

    def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            self._buf += self._read(max(READ_SIZE, n - len(self._buf)))

    def _read(self, size: int) -> bytes:
        """One recv: the bytes, ``Stop`` when the peer closed, BridgeError when it broke."""
        try:
            data = os.read(self._rfd, size)
        except OSError as exc:
            self.closed = True
            raise BridgeError(f"the other side of the grading bridge went away ({exc})") from None
        if not data:
            self.closed = True
            raise Stop()
        return data

    def _oversized(self, size: int) -> BridgeError:
        self.closed = True  # the stream cannot be resynchronised
        return BridgeError(f"message of {size} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")

    def _recv(self):
        if not self._buf:
            # The usual case in a round trip: one recv brings exactly one whole message,
            # parsed straight from the received bytes.
            data = self._read(READ_SIZE)
            if len(data) >= HEADER.size:
                (size,) = HEADER.unpack_from(data, 0)
                if size > MAX_MESSAGE_BYTES:
                    raise self._oversized(size)
                if size + HEADER.size == len(data):
                    return loads(data[HEADER.size:])
            self._buf += data
        self._fill(HEADER.size)
        (size,) = HEADER.unpack_from(self._buf, 0)
        if size > MAX_MESSAGE_BYTES:
            raise self._oversized(size)
        end = HEADER.size + size
        self._fill(end)
        payload = bytes(self._buf[HEADER.size:end])
        del self._buf[:end]
        return loads(payload)
