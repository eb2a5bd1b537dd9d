"""Turn a rollout's tokens into ``TrajectoryChunk``s, streamed while it runs.

The recorder holds the current segment's tokens (the context the engine continues)
and a buffer of tokens not yet published. The buffer is flushed as a chunk when it
reaches ``chunk_tokens`` tokens or when the next token would push its packed arrays
past ``max_chunk_bytes``, so every record stays under the bus limit by construction.
A new segment (after self-compaction) flushes first. ``finish`` publishes the last
chunk with ``final=True``, the finish reason and the cost.

Per token: id, behaviour log-prob (0 for environment tokens), loss mask (1 = sampled
by the policy), kept set (empty for environment tokens), capped flag and the weight
version, and for MoE models the routed experts (docs/contracts.md, "Routing": row i holds
the experts of the position before token i; prompt tokens get theirs when the engine
reports the prefill). Environment tokens wait, unpublished, until the next sampled token
(or a flush, a new segment, the end): the engine reports their routes with that token's
prefill, so a prompt longer than ``chunk_tokens`` keeps the routes of its head; the
chunks are the same, only published a prefill later. Environment tokens carry the engine's loaded version when they were
appended, so version spans change exactly where weights changed; only loss-masked
tokens' versions say which weights *produced* a token.

The buffers are arrays, not a Python object per token (issue #29): each token is one
18-byte ``TOKEN_RECORD`` (id, log-prob, kept size, kept count, mask, capped) appended
to a ``bytearray``, its kept ids (int32 little-endian) to another, version spans and
route rows only where they occur; a chunk is the buffer split into its columns by one
numpy view. Engines hand sampled tokens over as rows of one step's arrays
(``sampler.engine.StepTokens`` / ``StepRow``: ids, log-probs, kept-set CSR, sizes,
capped flags, versions, routes), or as ``SampledToken``s (a one-row step). Environment
tokens of one version are moved into the buffer in bulk. ``benchmarks/recording_cost.py``
measures the path; ``tests/test_recorder_arrays.py`` checks that its chunks are byte for
byte those of the per-token recorder before it.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Awaitable, Callable

import msgspec
import numpy as np

from sampler.engine import TOKEN_RECORD, SampledToken, StepRow
from schemas import Cost, RecordRef, TrajectoryChunk, TrajectoryKey, arrays, now

Publish = Callable[[TrajectoryChunk], Awaitable[RecordRef | None]]

# Fixed bytes per token: id, logprob, kept offset, kept size (int32 each), mask and capped (uint8).
_BYTES_PER_TOKEN = 4 + 4 + 4 + 4 + 1 + 1
_BYTES_PER_SPAN = 4 + 8
_HEADER_ALLOWANCE = 2048  # ids, strings and msgpack framing of one chunk
_LITTLE = sys.byteorder == "little"
_RECORD = TOKEN_RECORD.itemsize
_ENV_RECORD = struct.Struct("<ifiiBB")  # TOKEN_RECORD's layout
assert _ENV_RECORD.size == _RECORD


def _le(buf: array) -> bytes:
    """An ``array``'s bytes, little-endian (the wire order) whatever the host."""
    if _LITTLE:
        return buf.tobytes()
    swapped = array(buf.typecode, buf)
    swapped.byteswap()
    return swapped.tobytes()


class ChunkTooLarge(ValueError):
    """A single token's record alone exceeds the chunk byte limit (cap the kept set)."""


class TrajectoryIdentity(TrajectoryKey, kw_only=True, frozen=True):
    """What every chunk of one trajectory repeats: its key (``schemas.TrajectoryKey``)
    and how it was sampled; each field is the ``TrajectoryChunk`` field of the same name
    (the recorder passes them on by name)."""

    replica_id: str = ""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


class TrajectoryRecorder:
    """Records one trajectory. Tokens are appended to per-chunk buffers (``array`` /
    ``bytearray``: no Python object per token); a chunk is the buffer, packed as it is.

    ``listener`` (optional): called with each sampled token's id as it is appended,
    on every path (a server streaming tokens to its client sets it)."""

    listener: Callable[[int], None] | None = None

    def __init__(
        self,
        identity: TrajectoryIdentity,
        publish: Publish,
        *,
        chunk_tokens: int = 256,
        max_chunk_bytes: int = 512 * 1024,
    ) -> None:
        self.identity = identity
        self._publish = publish
        self.chunk_tokens = chunk_tokens
        self.max_chunk_bytes = max_chunk_bytes
        self.segment_index = 0
        self.segment_tokens: list[int] = []  # the whole current segment (the context)
        self.chunks_published = 0
        self.refs: list[RecordRef] = []
        self.generated_tokens = 0
        self.env_tokens = 0
        self.generated_versions: set[int] = set()
        self._generated_version: int | None = None  # the last one added to generated_versions
        # Prompt positions whose routes came after their chunk was published (a re-prefill
        # after a flush) or did not fit the byte limit: recorded as unknown (-1),
        # recomputed by the trainer.
        self.routes_unrecorded = 0
        # Environment tokens not yet in the buffer (ids, versions, routes by index), appended
        # when the next sampled token brings their routes (_take_pending).
        self._pending: list[int] = []
        self._pending_versions: list[int] = []
        self._pending_routes: dict[int, np.ndarray] = {}
        self.finished = False
        self._reset_buffer()

    def _reset_buffer(self) -> None:
        self._n = 0  # tokens buffered
        self._records = bytearray()  # one TOKEN_RECORD (18 bytes) per token
        self._kept = bytearray()  # kept ids, int32 little-endian
        self._span_starts = array("i")
        self._span_versions = array("q")
        self._last_version: int | None = None
        self._routed: dict[int, np.ndarray] = {}  # buffer index -> its route row
        self._bytes = _HEADER_ALLOWANCE

    @property
    def buffered(self) -> int:
        return self._n

    # -- adding tokens ---------------------------------------------------------------------
    def _fits(self, size: int, version: int) -> bool:
        """Whether a token of ``size`` bytes and weight ``version`` fits the buffered chunk."""
        cost = size if version == self._last_version else size + _BYTES_PER_SPAN
        return self._n < self.chunk_tokens and self._bytes + cost <= self.max_chunk_bytes

    async def _make_room(self, size: int, version: int) -> None:
        if self._fits(size, version):
            return
        if self._n:
            await self.flush()
        if size + _BYTES_PER_SPAN + _HEADER_ALLOWANCE > self.max_chunk_bytes:
            raise ChunkTooLarge(f"one token needs {size} bytes; max_chunk_bytes is {self.max_chunk_bytes}")

    async def add_env(self, token_ids: list[int], version: int) -> None:
        """Environment tokens (prompt, tool output, markup): loss mask 0. Held until the
        next sampled token, flush, new segment or finish (module docstring)."""
        ids = list(map(int, token_ids))
        version = int(version)
        self._pending += ids
        self._pending_versions += [version] * len(ids)
        self.segment_tokens += ids
        self.env_tokens += len(ids)

    async def _take_pending(self) -> None:
        """Move the held environment tokens into the buffer, chunking as usual: runs of
        one version without routes in bulk (array extends), the others one by one."""
        ids, versions, routes = self._pending, self._pending_versions, self._pending_routes
        self._pending, self._pending_versions, self._pending_routes = [], [], {}
        i, total = 0, len(ids)
        try:
            while i < total:
                version = versions[i]
                routed = routes.get(i)
                if routed is None:
                    if not routes and versions[-1] == version and versions.count(version) >= total - i:
                        j = total  # the usual case: the rest is one run (counted in C)
                    else:
                        j = i + 1
                        while j < total and versions[j] == version and j not in routes:
                            j += 1
                    taken = self._append_env_run(ids[i:j], version)
                    if taken:
                        i += taken
                        continue
                size = _BYTES_PER_TOKEN + (0 if routed is None else 2 * routed.size)
                if not self._fits(size, version):
                    await self._make_room(size, version)
                self._append(_ENV_RECORD.pack(ids[i], 0.0, 0, 0, 0, 0), b"", version, routed, size)
                i += 1
        except BaseException:
            # A failed publish keeps its buffer; the tokens not moved yet stay held, in order.
            later = len(ids) - i
            self._pending_routes = {**{k - i: r for k, r in routes.items() if k >= i},
                                    **{k + later: r for k, r in self._pending_routes.items()}}
            self._pending = ids[i:] + self._pending
            self._pending_versions = versions[i:] + self._pending_versions
            raise

    def _append_env_run(self, ids: list[int], version: int) -> int:
        """Append as many of ``ids`` (environment tokens of one ``version``, no routes)
        as fit the buffered chunk, in bulk; how many."""
        n = self._n
        span = 0 if version == self._last_version else _BYTES_PER_SPAN
        room = min(len(ids), self.chunk_tokens - n, (self.max_chunk_bytes - self._bytes - span) // _BYTES_PER_TOKEN)
        if room <= 0:
            return 0
        if span:
            self._span_starts.append(n)
            self._span_versions.append(version)
            self._last_version = version
        records = np.zeros(room, dtype=TOKEN_RECORD)
        records["id"] = ids[:room]
        self._records += records.tobytes()
        self._n = n + room
        self._bytes += span + _BYTES_PER_TOKEN * room
        return room

    @staticmethod
    def _parts(token: SampledToken | StepRow) -> tuple[int, bytes, bytes, int, np.ndarray | None, np.ndarray | None]:
        """(id, TOKEN_RECORD bytes, kept ids bytes, version, routes, prompt routes) of a
        sampled token, from either form."""
        if type(token) is StepRow:
            step, row = token.step, token.row
            ids, records, starts, ends, versions, kept, _ = step._columns or step.columns
            return (ids[row], records[row], kept[starts[row]:ends[row]], versions[row],
                    None if step.routed_experts is None else step.routed_experts[row],
                    None if step.prompt_routed_experts is None else step.prompt_routed_experts[row])
        kept = np.ascontiguousarray(token.kept_ids, dtype=arrays.INT32).reshape(-1).tobytes()
        record = _ENV_RECORD.pack(token.token_id, token.logprob, token.recorded_kept_size, len(kept) >> 2, 1,
                                  1 if token.kept_capped else 0)
        return (int(token.token_id), record, kept, int(token.weight_version), token.routed_experts,
                token.prompt_routed_experts)

    async def add_sampled(self, token: SampledToken | StepRow) -> None:
        """A token sampled by the policy: loss mask 1, its kept set and log-prob; a
        ``SampledToken`` or a row of an engine step's arrays (``StepRow``)."""
        if self.finished:
            raise RuntimeError(f"trajectory {self.identity.trajectory_id} is already final")
        tok, record, kept, version, routed, prompt_routes = self._parts(token)
        if prompt_routes is not None:
            self._attach_prompt_routes(prompt_routes)
        if self._pending:
            await self._take_pending()
        size = _BYTES_PER_TOKEN + len(kept) + (0 if routed is None else 2 * routed.size)
        await self._make_room(size, version)
        self._push_sampled(tok, record, kept, version, routed, size)

    def add_sampled_now(self, token: SampledToken | StepRow) -> bool:
        """``add_sampled`` without waiting, for engines that record from their per-step
        delivery: True when the token was appended; False, with nothing changed, when it
        needs the awaited path (held environment tokens or prompt routes to take first, a
        full chunk to publish, a final trajectory). All or nothing: it appends only after
        every check passed."""
        if self._pending or self.finished:
            return False
        if type(token) is not StepRow:
            tok, record, kept, version, routed, prompt_routes = self._parts(token)
            size = _BYTES_PER_TOKEN + len(kept) + (0 if routed is None else 2 * routed.size)
            if prompt_routes is not None or not self._fits(size, version):
                return False
            self._push_sampled(tok, record, kept, version, routed, size)
            return True
        # The hot path (one row per step per rollout; issue #29): _push_sampled, inlined,
        # in as few bytecodes as the checks allow (every one is paid per generated token);
        # a step without routes (``plain``) skips their lookups.
        step = token.step
        row = token.row
        ids, records, starts, ends, versions, kept, plain = step._columns or step.columns
        if not plain:
            return self._add_routed_row_now(step, row)
        a = starts[row]
        b = ends[row]  # byte offsets of its kept ids
        version = versions[row]
        n = self._n
        if n >= self.chunk_tokens:
            return False
        if version == self._last_version:
            cost = _BYTES_PER_TOKEN + b - a
            if self._bytes + cost > self.max_chunk_bytes:
                return False
        else:
            cost = _BYTES_PER_TOKEN + _BYTES_PER_SPAN + b - a
            if self._bytes + cost > self.max_chunk_bytes:
                return False
            self._span_starts.append(n)
            self._span_versions.append(version)
            self._last_version = version
        if version != self._generated_version:
            self.generated_versions.add(version)
            self._generated_version = version
        self._records += records[row]
        if b > a:
            self._kept += kept[a:b]
        self._n = n + 1
        self._bytes += cost
        tok = ids[row]
        self.segment_tokens.append(tok)
        self.generated_tokens += 1
        if self.listener is not None:
            self.listener(tok)
        return True

    def _add_routed_row_now(self, step, row: int) -> bool:
        """``add_sampled_now`` of a row of a step with routes (MoE)."""
        if step.prompt_routed_experts is not None and step.prompt_routed_experts[row] is not None:
            return False
        ids, records, starts, ends, versions, kept, _ = step._columns or step.columns
        a, b = starts[row], ends[row]
        version = versions[row]
        cost = _BYTES_PER_TOKEN + (b - a)
        routed = step.routed_experts
        if routed is not None:
            routed = routed[row]
            cost += 2 * routed.size
        if not self._fits(cost, version):
            return False
        self._push_sampled(ids[row], records[row], kept[a:b], version, routed, cost)
        return True

    def _push_sampled(self, tok: int, record: bytes, kept: bytes, version: int, routed: np.ndarray | None,
                        size: int) -> None:
        self._append(record, kept, version, routed, size)
        self.segment_tokens.append(tok)
        self.generated_tokens += 1
        if version != self._generated_version:
            self.generated_versions.add(version)
            self._generated_version = version
        if self.listener is not None:
            self.listener(tok)

    def _append(self, record: bytes, kept: bytes, version: int, routed: np.ndarray | None, size: int) -> None:
        """Append one token (``record``: its TOKEN_RECORD bytes; ``kept``: its kept ids as
        int32 little-endian bytes; ``size``: its bytes as checked for room) to the
        buffer. Environment tokens joined the segment when they were added; the caller
        adds sampled ones."""
        n = self._n
        if version != self._last_version:
            self._span_starts.append(n)
            self._span_versions.append(version)
            self._last_version = version
            size += _BYTES_PER_SPAN
        self._records += record
        self._kept += kept
        if routed is not None:
            self._routed[n] = np.asarray(routed)
        self._n = n + 1
        self._bytes += size

    def _attach_prompt_routes(self, routes: np.ndarray) -> None:
        """Routes of prompt positions 0..P-2 become the rows of segment tokens 1..P-1
        (first report wins: a later re-prefill of the same positions is not what produced
        the tokens after them)."""
        prompt_len = len(self.segment_tokens)
        if routes.shape[0] != prompt_len - 1:
            raise ValueError(f"prompt routes have {routes.shape[0]} rows for a prompt of {prompt_len} tokens")
        self._attach_positions(routes)

    def _attach_positions(self, routes: np.ndarray) -> None:
        """Row q of ``routes`` (position q of the segment) to token q + 1, if buffered or
        held (a held token's route counts against the byte limit when it is appended)."""
        end = routes.shape[0] + 1  # one past the last token that gets a row
        buffered = self._n
        # segment position of the first buffered token (held ones follow the buffer)
        start = len(self.segment_tokens) - buffered - len(self._pending)
        self.routes_unrecorded += max(0, min(start, end) - 1)
        for pos in range(max(1, start), end):
            i = pos - start
            row = np.asarray(routes[pos - 1])
            if i >= buffered:
                if i - buffered not in self._pending_routes:
                    self._pending_routes[i - buffered] = row
                continue
            if i in self._routed:
                continue
            if self._bytes + 2 * row.size > self.max_chunk_bytes:
                self.routes_unrecorded += 1
                continue
            self._routed[i] = row
            self._bytes += 2 * row.size

    def attach_routed_experts(self, routed: np.ndarray) -> None:
        """Routes an engine reports when a sample ends. A table covering the whole
        segment (vLLM's ``[seq_len, layers, top_k]``, row q = position q; at least
        ``len(segment) - 1`` rows) gives row q to token q + 1 for every token still
        buffered without one; a shorter table is the last ``len(routed)`` sampled
        tokens' own rows."""
        if routed.shape[0] >= len(self.segment_tokens) - 1 > 0:
            self._attach_positions(np.asarray(routed)[: len(self.segment_tokens) - 1])
            return
        mask = np.frombuffer(bytes(self._records), dtype=TOKEN_RECORD)["mask"]
        idx = np.flatnonzero(mask == 1).tolist()[-len(routed):]
        for i, row in zip(idx, routed[-len(idx):] if idx else []):
            self._routed[i] = np.asarray(row)

    # -- publishing ------------------------------------------------------------------------
    def _chunk(self, final: bool, finish_reason: str = "", cost: Cost | None = None) -> TrajectoryChunk:
        n = self._n
        records = np.frombuffer(bytes(self._records), dtype=TOKEN_RECORD)
        offsets = np.zeros(n + 1, dtype=arrays.INT32)
        np.cumsum(records["kept_len"], out=offsets[1:])
        routed, shape = b"", []
        if self._routed:
            row_shape = next(iter(self._routed.values())).shape
            table = np.full((n, *row_shape), -1, dtype=np.int16)
            for i, r in self._routed.items():
                if r.shape == row_shape:
                    table[i] = r
            routed, shape = arrays.pack(table, arrays.INT16), list(table.shape)
        chunk = TrajectoryChunk(
            **msgspec.structs.asdict(self.identity),
            chunk_index=self.chunks_published,
            segment_index=self.segment_index,
            token_ids=records["id"].tobytes(),
            logprobs=records["logprob"].tobytes(),
            loss_mask=records["mask"].tobytes(),
            kept_offsets=offsets.tobytes(),
            kept_ids=bytes(self._kept),
            kept_capped=records["capped"].tobytes(),
            kept_sizes=records["kept_size"].tobytes(),
            version_starts=_le(self._span_starts),
            versions=_le(self._span_versions),
            routed_experts=routed,
            routed_experts_shape=shape,
            final=final,
            finish_reason=finish_reason,
            cost=cost,
            created_at=now(),
        )
        # No chunk.validate() here (~30 us a chunk): the buffers are consistent by
        # construction (tests/test_recorder_arrays.py checks them against the validator
        # and the recorder before #29); the trainer validates every chunk it decodes.
        return chunk

    async def _send(self, chunk: TrajectoryChunk) -> None:
        ref = await self._publish(chunk)
        self.chunks_published += 1
        if ref is not None:
            self.refs.append(ref)
        self._reset_buffer()

    async def flush(self) -> None:
        """Publish the buffered and held tokens as non-final chunks (nothing when empty)."""
        if self.finished:
            raise RuntimeError(f"trajectory {self.identity.trajectory_id} is already final")
        await self._take_pending()
        if self._n:
            await self._send(self._chunk(final=False))

    async def new_segment(self) -> None:
        """Close the current segment (flush) and start an empty one."""
        await self.flush()
        self.segment_index += 1
        self.segment_tokens = []

    async def finish(self, finish_reason: str, cost: Cost) -> None:
        """Publish the final chunk: the remaining tokens (possibly none), reason, cost."""
        if self.finished:
            raise RuntimeError(f"trajectory {self.identity.trajectory_id} is already final")
        await self._take_pending()
        await self._send(self._chunk(final=True, finish_reason=finish_reason, cost=cost))
        self.finished = True

    @property
    def newest_generated_version(self) -> int:
        return max(self.generated_versions) if self.generated_versions else -1
