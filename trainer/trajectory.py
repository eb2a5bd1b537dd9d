"""A trajectory put back together from its chunks and reward, and groups of them.

A chunk is checked and decoded once, where it enters the trainer (:func:`check_chunk`:
the live assembler, which dead-letters a bad one, and the replay's record fetch); the
:class:`CheckedChunk` keeps its arrays, so nothing decodes the bytes again.

Chunks are ordered by ``(segment_index, chunk_index)``; a segment's chunks concatenate
to its token sequence. ``chunk_index`` may count within the segment (0, 1, ... per
segment) or across the whole trajectory (0..n-1): both layouts are accepted, anything
else (a gap, a repeat) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter, itemgetter
from typing import Sequence

import msgspec
import numpy as np

from schemas import ChunkArrays, RecordRef, Reward, TrajectoryChunk, TrajectoryKey, key_of
from trainer.intake_kernels import first_bad_kept_set, join_offsets


GREEDY_TEMPERATURE = 1e-5  # below this a sampler decodes greedily (vLLM's convention)
_INT32 = np.dtype("<i4")  # the wire's int32 (schemas.arrays)

# A chunk's identity fields as one tuple (C attribute reads: assemble compares every chunk's).
_identity = attrgetter(*TrajectoryKey.__struct_fields__)


class InvalidTrajectory(ValueError):
    """The chunks and reward of a trajectory cannot be trained on (the message says why)."""


class CheckedChunk(msgspec.Struct, frozen=True, gc=False):
    """A chunk whose arrays agree (:meth:`TrajectoryChunk.arrays`), decoded once, with
    the weight versions the assembler's staleness rules read. (A frozen Struct: one per
    chunk read, cheaper to build than a frozen dataclass; it holds no cycles.)

    ``arrays`` is None for a chunk of the usual layout checked in a batch
    (``trainer.batch_check``: one version span, no routes, every field present): its
    bytes are checked and the assembly reads them joined per segment, without
    per-chunk views (:func:`chunk_arrays` makes them when something wants them)."""

    chunk: TrajectoryChunk
    arrays: ChunkArrays | None
    # Versions of the generated tokens (None: none generated here) and the newest
    # version loaded while any token of it was recorded (None: no tokens).
    oldest_generated: int | None
    newest_generated: int | None
    newest_loaded: int | None


def chunk_arrays(checked: CheckedChunk) -> ChunkArrays:
    """A checked chunk's arrays (views over its bytes), made now where the batch check
    left them out."""
    return checked.arrays if checked.arrays is not None else checked.chunk.arrays()


def check_chunk(chunk: TrajectoryChunk) -> CheckedChunk:
    """The trainer's one check of a chunk; raises ValueError naming what disagrees."""
    a = chunk.arrays()
    if not a.versions.size:
        return CheckedChunk(chunk, a, None, None, None)
    if len(chunk.versions) == 8:  # one version span (the usual chunk): no per-token pass
        v = int(a.versions[0])
        return CheckedChunk(chunk, a, *((v, v) if np.count_nonzero(a.loss_mask) else (None, None)), v)
    generated = a.versions[a.loss_mask.astype(bool)]
    return CheckedChunk(
        chunk, a,
        oldest_generated=int(generated.min()) if generated.size else None,
        newest_generated=int(generated.max()) if generated.size else None,
        newest_loaded=int(a.versions.max()),
    )


@dataclass
class Segment:
    """One model context: prompt, generated and environment tokens, per-token data."""

    token_ids: np.ndarray  # int64 [n]
    loss_mask: np.ndarray  # bool [n]; True = sampled by the policy
    behaviour: np.ndarray  # float32 [n]; behaviour log-prob (over the kept set)
    # Kept sets in CSR form, as on the wire: token t's set is
    # kept_ids[kept_offsets[t]:kept_offsets[t + 1]] (empty for masked tokens).
    kept_offsets: np.ndarray  # int64 [n + 1]
    kept_ids: np.ndarray  # int32
    capped: np.ndarray  # bool [n]
    versions: np.ndarray  # int64 [n]
    temperature: np.ndarray  # float32 [n]
    # int64 [n]: the sampler's kept-set size, also where ``kept`` holds only part of it
    # (capped); -1 unknown (a capped set from an engine that cannot count past its cap).
    kept_size: np.ndarray | None = None
    # int16 [n, moe_layers, top_k]: the sampler's routed experts, row i for the position
    # before token i (docs/contracts.md, "Routing"); -1 = not recorded. None: no routes.
    routes: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.kept_size is None:
            self.kept_size = np.where(self.capped, -1, np.diff(self.kept_offsets))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)


class Trajectory(TrajectoryKey, dict=True):
    """A trajectory put together: its identity (the chunks'), segments and reward.

    Its segments are not changed after assembly: the generated tokens' count and
    version range are computed once (``dict=True`` lets ``cached_property`` keep them;
    the assembler reads them for every held trajectory at every batch)."""

    segments: list[Segment]
    reward: Reward
    chunk_refs: list[RecordRef]
    reward_ref: RecordRef
    finish_reason: str = ""

    @cached_property
    def generated_tokens(self) -> int:
        return int(sum(s.loss_mask.sum() for s in self.segments))

    def generated_versions(self) -> np.ndarray:
        parts = [s.versions[s.loss_mask] for s in self.segments]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    @cached_property
    def _version_range(self) -> tuple[int, int]:
        v = self.generated_versions()
        if not v.size:
            return self.reward.weight_version, self.reward.weight_version
        return int(v.min()), int(v.max())

    @property
    def oldest_version(self) -> int:
        return self._version_range[0]

    @property
    def newest_version(self) -> int:
        return self._version_range[1]


@dataclass
class Group:
    """The G samples of one (task, group): the unit of advantage normalisation."""

    task_id: str
    group_id: str
    members: list[Trajectory]  # ordered by sample_index

    @property
    def key(self) -> tuple[str, str]:
        return (self.task_id, self.group_id)

    def rewards(self) -> list[float]:
        return [t.reward.reward for t in self.members]

    @property
    def oldest_version(self) -> int:
        return min(t.oldest_version for t in self.members)

    @property
    def newest_version(self) -> int:
        """The version a group is filed under for the buffer policy."""
        return max(t.newest_version for t in self.members)


def order_chunks(chunks: Sequence[TrajectoryChunk]) -> list[int]:
    """Indices of ``chunks`` in trajectory order; raises on gaps or repeats.

    (Called twice for every trajectory the trainer reads: the positions are read once
    as C attribute-getter tuples, and the per-segment layout is walked only where the
    index does not count across the trajectory.)"""
    positions = list(map(_position, chunks))
    order = sorted(range(len(positions)), key=positions.__getitem__)
    keys = list(map(positions.__getitem__, order))
    if len(set(keys)) != len(keys):
        raise InvalidTrajectory(f"repeated (segment, chunk) index among {keys}")
    segments = sorted(set(map(_first, keys)))
    if segments != list(range(len(segments))):
        raise InvalidTrajectory(f"segment indices {segments} are not 0..{len(segments) - 1}")
    if list(map(_second, keys)) != list(range(len(keys))) and not _counts_per_segment(keys):
        raise InvalidTrajectory(f"chunk indices have a gap: {keys}")
    return order


_position = attrgetter("segment_index", "chunk_index")
_first, _second = itemgetter(0), itemgetter(1)


def _counts_per_segment(keys: list[tuple[int, int]]) -> bool:
    """Whether the sorted ``keys`` count 0, 1, ... within each segment."""
    expected: dict[int, int] = {}
    for seg, idx in keys:
        if idx != expected.get(seg, 0):
            return False
        expected[seg] = idx + 1
    return True


def chunks_complete(chunks: Sequence[TrajectoryChunk]) -> bool:
    """True when the final chunk is here and no chunk before it is missing."""
    if not any(c.final for c in chunks):
        return False
    try:
        order = order_chunks(chunks)
    except InvalidTrajectory:
        return False
    return chunks[order[-1]].final  # (positions are distinct here: the last in order is the max)


def assemble(
    chunks: Sequence[CheckedChunk],
    chunk_refs: Sequence[RecordRef],
    reward: Reward,
    reward_ref: RecordRef,
) -> Trajectory:
    """Concatenate a trajectory's checked chunks; raise :class:`InvalidTrajectory` when
    they do not make one trajectory (identity, order, kept sets, reward)."""
    if not chunks:
        raise InvalidTrajectory(f"trajectory {reward.trajectory_id}: reward without chunks")
    events = [c.chunk for c in chunks]
    first = events[0]
    tid = first.trajectory_id
    key = key_of(first)
    ident = _identity(first)
    if any(_identity(c) != ident for c in events):
        raise InvalidTrajectory(f"trajectory {tid}: chunks disagree on identity fields")
    if (reward.trajectory_id, reward.task_id, reward.group_id, reward.sample_index) != (
        tid, first.task_id, first.group_id, first.sample_index,
    ):
        raise InvalidTrajectory(f"trajectory {tid}: reward identity differs from the chunks'")
    if not 0 <= first.sample_index < first.group_size:
        raise InvalidTrajectory(f"trajectory {tid}: sample_index {first.sample_index} outside group of {first.group_size}")
    order = order_chunks(events)
    if not events[order[-1]].final:
        raise InvalidTrajectory(f"trajectory {tid}: last chunk is not final")

    by_segment: dict[int, list[int]] = {}
    for i in order:
        by_segment.setdefault(events[i].segment_index, []).append(i)
    segments = [_segment([chunks[i] for i in idx], tid) for _, idx in sorted(by_segment.items())]
    return Trajectory(
        *msgspec.structs.astuple(key),
        segments=segments,
        reward=reward,
        chunk_refs=[chunk_refs[i] for i in order],
        reward_ref=reward_ref,
        finish_reason=events[order[-1]].finish_reason,
    )


def _segment(chunks: list[CheckedChunk], tid: str) -> Segment:
    """The segment of ``chunks`` (in order): one concatenation per array, the CSR
    offsets shifted while they are joined (one compiled pass,
    ``trainer.intake_kernels.join_offsets``), one temperature filled where the chunks share it (else expanded by one
    ``np.repeat``). Chunks checked in a batch (no array views, ``CheckedChunk.arrays``
    None) are joined from their bytes (:func:`_segment_of_bytes`): the same arrays."""
    if all(c.arrays is None for c in chunks):
        return _segment_of_bytes(chunks, tid)
    parts = [chunk_arrays(c) for c in chunks]
    tokens = np.concatenate([a.token_ids for a in parts], dtype=np.int64)
    mask = np.concatenate([a.loss_mask for a in parts]).astype(bool)
    behaviour = np.concatenate([a.logprobs for a in parts], dtype=np.float32)
    kept_offsets = join_offsets(np.concatenate([a.kept_offsets for a in parts], dtype=_INT32),
                                np.array([a.token_ids.size for a in parts], dtype=np.int64),
                                np.array([a.kept_ids.size for a in parts], dtype=np.int64))
    kept_ids = np.concatenate([a.kept_ids for a in parts])
    capped = np.concatenate([a.kept_capped for a in parts]).astype(bool)
    kept_size = np.concatenate([a.kept_sizes for a in parts], dtype=np.int64)
    versions = np.concatenate([a.versions for a in parts], dtype=np.int64)
    return _checked_segment(chunks, tid, tokens, mask, behaviour, kept_offsets, kept_ids, capped, versions, kept_size,
                            [a.token_ids.size for a in parts], parts)


def _segment_of_bytes(chunks: list[CheckedChunk], tid: str) -> Segment:
    """:func:`_segment` of chunks of the usual layout checked in a batch: each array is
    one join of the chunks' bytes (writable copies, the dtypes of the concatenations),
    the versions one value per chunk repeated; no routes."""
    events = list(map(_chunk_of, chunks))
    ids = list(map(_token_ids, events))
    counts = [len(b) >> 2 for b in ids]
    kept = list(map(_kept_ids, events))
    tokens = np.frombuffer(b"".join(ids), _INT32).astype(np.int64)
    mask = np.frombuffer(b"".join(map(_loss_mask, events)), np.uint8).astype(bool)
    behaviour = np.frombuffer(bytearray().join(map(_logprobs, events)), np.float32)
    kept_ids = np.frombuffer(bytearray().join(kept), _INT32)
    kept_offsets = join_offsets(np.frombuffer(bytearray().join(map(_kept_offsets, events)), _INT32),
                                np.array(counts, dtype=np.int64), np.array([len(b) >> 2 for b in kept], dtype=np.int64))
    capped = np.frombuffer(b"".join(map(_kept_capped, events)), np.uint8).astype(bool)
    kept_size = np.frombuffer(b"".join(map(_kept_sizes, events)), _INT32).astype(np.int64)
    versions = np.repeat(np.array([c.newest_loaded for c in chunks], dtype=np.int64), counts)
    return _checked_segment(chunks, tid, tokens, mask, behaviour, kept_offsets, kept_ids, capped, versions, kept_size,
                            counts, None)


# (C attribute reads for the joins of _segment_of_bytes)
_chunk_of = attrgetter("chunk")
_token_ids, _loss_mask, _logprobs, _kept_ids, _kept_offsets, _kept_capped, _kept_sizes = (
    attrgetter(name) for name in ("token_ids", "loss_mask", "logprobs", "kept_ids", "kept_offsets", "kept_capped",
                                  "kept_sizes"))


def _checked_segment(chunks: list[CheckedChunk], tid: str, tokens: np.ndarray, mask: np.ndarray,
                     behaviour: np.ndarray, kept_offsets: np.ndarray, kept_ids: np.ndarray, capped: np.ndarray,
                     versions: np.ndarray, kept_size: np.ndarray, counts: list[int],
                     parts: list[ChunkArrays] | None) -> Segment:
    """The segment's temperatures and checks, in the order their errors are reported
    (routes last, from ``parts``; None: the chunks have none)."""
    first_temperature = chunks[0].chunk.temperature
    if all(c.chunk.temperature == first_temperature for c in chunks):  # (the usual segment: one fill)
        temperature = np.empty(tokens.size, dtype=np.float32)
        temperature.fill(first_temperature)
        any_greedy = np.float32(first_temperature) < GREEDY_TEMPERATURE
    else:
        temperatures = np.array([c.chunk.temperature for c in chunks], dtype=np.float32)
        temperature = np.repeat(temperatures, counts)
        any_greedy = (temperatures < GREEDY_TEMPERATURE).any()
    if tokens.size == 0:
        raise InvalidTrajectory(f"trajectory {tid}: empty segment")
    if mask[0]:
        raise InvalidTrajectory(f"trajectory {tid}: a segment starts with a generated token (no context)")
    greedy = None
    if any_greedy:
        greedy = mask & (temperature < GREEDY_TEMPERATURE)
        if greedy.any():
            # Greedy decoding (temperature 0): the kept set is the argmax alone, so the
            # token's log-prob is 0 at any temperature; 1.0 keeps the arithmetic finite.
            temperature = np.where(greedy, np.float32(1.0), temperature)
    _check_kept_sets(tokens, mask, greedy, kept_offsets, kept_ids, tid)
    if not np.isfinite(behaviour[mask]).all():
        raise InvalidTrajectory(f"trajectory {tid}: non-finite behaviour log-prob")
    return Segment(tokens, mask, behaviour, kept_offsets, kept_ids, capped, versions, temperature, kept_size,
                   None if parts is None else _routes(parts, tid))


def _check_kept_sets(tokens: np.ndarray, mask: np.ndarray, greedy: np.ndarray | None, offsets: np.ndarray,
                     kept_ids: np.ndarray, tid: str) -> None:
    """Every generated token has a non-empty kept set holding it (one id when greedy;
    ``greedy`` None: no greedy token); the first token that breaks a rule is named.

    One compiled pass over the generated tokens (``trainer.intake_kernels``): each set is
    searched from its first id (sets are recorded most likely first, so the token is most
    often there) and the search stops at the match."""
    t = first_bad_kept_set(tokens, mask, _NO_GREEDY if greedy is None else greedy, offsets, kept_ids)
    if t == -1:
        return
    if t == -2:  # (the chunk checks make this unreachable: each chunk's CSR was checked)
        raise InvalidTrajectory(f"trajectory {tid}: kept-set offsets do not index its kept ids")
    size = int(offsets[t + 1] - offsets[t])
    if size == 0:
        raise InvalidTrajectory(f"trajectory {tid}: generated token {t} has an empty kept set")
    if greedy is not None and greedy[t] and size != 1:
        raise InvalidTrajectory(f"trajectory {tid}: greedy token {t} has a kept set of {size}, not 1")
    raise InvalidTrajectory(f"trajectory {tid}: generated token {t} ({tokens[t]}) is not in its kept set")


_NO_GREEDY = np.zeros(0, dtype=bool)  # (first_bad_kept_set's "no greedy token")


def _routes(parts: list[ChunkArrays], tid: str) -> np.ndarray | None:
    """The segment's route table; chunks without routes give rows of -1."""
    tables = [a.routed_experts for a in parts]
    shapes = {t.shape[1:] for t in tables if t is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise InvalidTrajectory(f"trajectory {tid}: chunks' routed experts differ in [layers, top_k]: {sorted(shapes)}")
    row = shapes.pop()
    return np.concatenate([t if t is not None else np.full((a.token_ids.size, *row), -1, dtype=np.int16)
                           for a, t in zip(parts, tables)]).astype(np.int16)


def groups_from_trajectories(trajectories: Sequence[Trajectory]) -> list[Group]:
    """Groups in order of first appearance, members ordered by sample index (replay)."""
    groups: dict[tuple[str, str], list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault((t.task_id, t.group_id), []).append(t)
    return [
        Group(task_id=k[0], group_id=k[1], members=sorted(m, key=lambda t: t.sample_index))
        for k, m in groups.items()
    ]
