"""The recorder as it was before issue #29 (per-token path), frozen for
``benchmarks/recording_cost.py``'s side-by-side baseline. Not used by Rollway itself."""

from __future__ import annotations

from typing import Awaitable, Callable

import msgspec
import numpy as np

from sampler.engine import SampledToken
from schemas import Cost, RecordRef, TrajectoryChunk, TrajectoryKey, arrays, now

Publish = Callable[[TrajectoryChunk], Awaitable[RecordRef | None]]

# Fixed bytes per token: id, logprob, kept offset, kept size (int32 each), mask and capped (uint8).
_BYTES_PER_TOKEN = 4 + 4 + 4 + 4 + 1 + 1
_BYTES_PER_SPAN = 4 + 8
_HEADER_ALLOWANCE = 2048  # ids, strings and msgpack framing of one chunk


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
        # Prompt positions whose routes came after their chunk was published (a re-prefill
        # after a flush) or did not fit the byte limit: recorded as unknown (-1),
        # recomputed by the trainer.
        self.routes_unrecorded = 0
        # Environment tokens not yet in the buffer: (id, version, routes), appended when
        # the next sampled token brings their routes (_take_pending).
        self._pending: list[tuple[int, int, np.ndarray | None]] = []
        self.finished = False
        self._reset_buffer()

    def _reset_buffer(self) -> None:
        self._ids: list[int] = []
        self._logprobs: list[float] = []
        self._mask: list[int] = []
        self._kept: list[np.ndarray] = []
        self._capped: list[int] = []
        self._sizes: list[int] = []
        self._versions: list[int] = []
        self._routed: list[np.ndarray | None] = []
        self._bytes = _HEADER_ALLOWANCE

    @property
    def buffered(self) -> int:
        return len(self._ids)

    # -- adding tokens ---------------------------------------------------------------------
    def _fits(self, size: int, version: int) -> bool:
        """Whether a token of ``size`` bytes and weight ``version`` fits the buffered chunk."""
        new_span = not self._versions or self._versions[-1] != version
        cost = size + (_BYTES_PER_SPAN if new_span else 0)
        return len(self._ids) < self.chunk_tokens and self._bytes + cost <= self.max_chunk_bytes

    def _token_bytes(self, kept_size: int, routed: np.ndarray | None) -> int:
        return _BYTES_PER_TOKEN + 4 * kept_size + (0 if routed is None else 2 * routed.size)

    async def _make_room(self, size: int, version: int) -> None:
        if self._fits(size, version):
            return
        if self._ids:
            await self.flush()
        if size + _BYTES_PER_SPAN + _HEADER_ALLOWANCE > self.max_chunk_bytes:
            raise ChunkTooLarge(f"one token needs {size} bytes; max_chunk_bytes is {self.max_chunk_bytes}")

    async def add_env(self, token_ids: list[int], version: int) -> None:
        """Environment tokens (prompt, tool output, markup): loss mask 0. Held until the
        next sampled token, flush, new segment or finish (module docstring)."""
        for tok in token_ids:
            self._pending.append((int(tok), version, None))
            self.segment_tokens.append(int(tok))
        self.env_tokens += len(token_ids)

    async def _take_pending(self) -> None:
        """Move the held environment tokens into the buffer, chunking as usual."""
        empty = np.zeros(0, dtype=np.int32)
        pending, self._pending = self._pending, []
        for i, (tok, version, routed) in enumerate(pending):
            size = self._token_bytes(0, routed)
            try:
                await self._make_room(size, version)
            except BaseException:
                # A failed publish keeps its buffer; the tokens not moved yet stay held, in order.
                self._pending = pending[i:] + self._pending
                raise
            self._append(tok, 0.0, 0, empty, 0, 0, version, routed, size, in_segment=True)

    async def add_sampled(self, token: SampledToken) -> None:
        """A token sampled by the policy: loss mask 1, its kept set and log-prob."""
        if self.finished:
            raise RuntimeError(f"trajectory {self.identity.trajectory_id} is already final")
        if token.prompt_routed_experts is not None:
            self._attach_prompt_routes(token.prompt_routed_experts)
        if self._pending:
            await self._take_pending()
        size = self._token_bytes(token.kept_ids.size, token.routed_experts)
        await self._make_room(size, token.weight_version)
        self._append_sampled(token, size)

    def add_sampled_now(self, token: SampledToken) -> bool:
        """``add_sampled`` without waiting, for engines that record from their per-step
        delivery: True when the token was appended; False, with nothing changed, when it
        needs the awaited path (held environment tokens or prompt routes to take first, a
        full chunk to publish, a final trajectory). All or nothing: it appends only after
        every check passed."""
        if self._pending or token.prompt_routed_experts is not None or self.finished:
            return False
        size = self._token_bytes(token.kept_ids.size, token.routed_experts)
        if not self._fits(size, token.weight_version):
            return False
        self._append_sampled(token, size)
        return True

    def _append_sampled(self, token: SampledToken, size: int) -> None:
        self._append(token.token_id, token.logprob, 1, token.kept_ids, int(token.kept_capped),
                     token.recorded_kept_size, token.weight_version, token.routed_experts, size)
        self.generated_tokens += 1
        self.generated_versions.add(token.weight_version)

    def _append(self, tok, logprob, mask, kept, capped, kept_size, version, routed, size: int,
                in_segment: bool = False) -> None:
        """Append one token (``size``: its bytes, ``_token_bytes``, as checked for room)."""
        new_span = not self._versions or self._versions[-1] != version
        self._ids.append(tok)
        self._logprobs.append(logprob)
        self._mask.append(mask)
        self._kept.append(kept)
        self._capped.append(capped)
        self._sizes.append(kept_size)
        self._versions.append(version)
        self._routed.append(routed)
        self._bytes += size + (_BYTES_PER_SPAN if new_span else 0)
        if not in_segment:  # held environment tokens joined the segment when added
            self.segment_tokens.append(tok)

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
        # segment position of the first buffered token (held ones follow the buffer)
        start = len(self.segment_tokens) - len(self._ids) - len(self._pending)
        self.routes_unrecorded += max(0, min(start, end) - 1)
        for pos in range(max(1, start), end):
            i = pos - start
            row = np.asarray(routes[pos - 1])
            if i >= len(self._ids):
                tok, version, held = self._pending[i - len(self._ids)]
                if held is None:
                    self._pending[i - len(self._ids)] = (tok, version, row)
                continue
            if self._routed[i] is not None:
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
        idx = [i for i, m in enumerate(self._mask) if m == 1][-len(routed):]
        for i, row in zip(idx, routed[-len(idx):] if idx else []):
            self._routed[i] = np.asarray(row)

    # -- publishing ------------------------------------------------------------------------
    def _chunk(self, final: bool, finish_reason: str = "", cost: Cost | None = None) -> TrajectoryChunk:
        offsets, ids = arrays.pack_csr(self._kept)
        starts, versions = arrays.pack_spans(self._versions)
        routed, shape = b"", []
        present = [r for r in self._routed if r is not None]
        if present:
            row_shape = present[0].shape
            table = np.full((len(self._routed), *row_shape), -1, dtype=np.int16)
            for i, r in enumerate(self._routed):
                if r is not None and r.shape == row_shape:
                    table[i] = r
            routed, shape = arrays.pack(table, arrays.INT16), list(table.shape)
        chunk = TrajectoryChunk(
            **msgspec.structs.asdict(self.identity),
            chunk_index=self.chunks_published,
            segment_index=self.segment_index,
            token_ids=arrays.pack(self._ids, arrays.INT32),
            logprobs=arrays.pack(self._logprobs, arrays.FLOAT32),
            loss_mask=arrays.pack(self._mask, arrays.UINT8),
            kept_offsets=offsets,
            kept_ids=ids,
            kept_capped=arrays.pack(self._capped, arrays.UINT8),
            kept_sizes=arrays.pack(self._sizes, arrays.INT32),
            version_starts=starts,
            versions=versions,
            routed_experts=routed,
            routed_experts_shape=shape,
            final=final,
            finish_reason=finish_reason,
            cost=cost,
            created_at=now(),
        )
        chunk.validate()
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
        if self._ids:
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
