"""Every event that travels on a Rollway topic.

Rules of evolution (msgspec's): a new field always has a default and goes at the end;
a field never changes its type; removing a field means leaving it in place, unused.
Bump ``SCHEMA_VERSION`` when a field is added so consumers can tell old from new.

Per-token arrays are packed little-endian bytes (see :mod:`schemas.arrays`).
"""

from __future__ import annotations

import sys
import time
from typing import ClassVar

import msgspec
import numpy as np

from schemas import arrays


def now() -> float:
    return time.time()


class Event(msgspec.Struct, kw_only=True):
    """Base of every event. ``SCHEMA_VERSION`` travels in the record headers."""

    SCHEMA_VERSION: ClassVar[int] = 1


class Cost(msgspec.Struct, kw_only=True):
    """What a rollout spent."""

    generated_tokens: int = 0
    env_tokens: int = 0
    turns: int = 0
    tool_seconds: float = 0.0
    segments: int = 1
    # New segments started because the model's chat template rewrote the conversation's
    # history (Qwen3 thinking removal, a call not in the template's spelling): the turn
    # could not be bridged token-exactly (sampler/formats). Added at the end with a default.
    template_rerenders: int = 0


class Task(Event, kw_only=True):
    """One group of ``group_size`` samples of a task. Hidden tests are never here:
    the grader loads them from its own task store by ``task_id``."""

    task_id: str
    group_id: str
    group_size: int
    instruction: str
    files: dict[str, str] = {}
    language: str = "python"
    difficulty: str = ""
    task_set: str = "demo"
    metadata: dict[str, str] = {}
    created_at: float = 0.0
    # The task's environment (tasks/spec.py): an OCI image reference ("" = host root) and
    # where the repository lives inside the sandbox. Defaults keep old records decodable.
    image: str = ""
    workdir: str = "/workspace"


class TrajectoryKey(msgspec.Struct):
    """Who a trajectory is: the identity every one of its chunks repeats (and the
    trainer's ``Trajectory`` carries). Declared once; ``key_of`` reads it off either."""

    trajectory_id: str
    task_id: str
    group_id: str
    sample_index: int
    group_size: int
    attempt: str


def key_of(obj: TrajectoryKey) -> TrajectoryKey:
    """The bare identity of a chunk, a trajectory or a key (equal when they agree)."""
    return TrajectoryKey(*(getattr(obj, name) for name in TrajectoryKey.__struct_fields__))


class TrajectoryChunk(Event, TrajectoryKey, kw_only=True):
    """A contiguous run of a trajectory's tokens, streamed while the rollout runs.

    Chunks of one segment concatenate (by ``chunk_index``) to the segment's full
    token sequence: prompt and tool output (``loss_mask`` 0) and generated tokens
    (``loss_mask`` 1). A new segment starts after self-compaction. The last chunk of
    the trajectory has ``final=True``, the finish reason and the cost.

    Schema 2 added ``kept_sizes``: the size of each token's kept set as the sampler drew
    from it, also where ``kept_ids`` holds only part of it (``kept_capped``: the ids did
    not fit the engine's cap), so the trainer can rebuild a capped set as its own top-k
    of that size; -1 = not known (an engine that cannot count past its cap). A chunk
    without it (schema 1) decodes with ``kept_sizes == b""``: every uncapped set is
    complete, every capped one of unknown size.
    """

    SCHEMA_VERSION: ClassVar[int] = 2

    # The identity fields come first, from TrajectoryKey (same names, types and order
    # as before it was shared: the wire format is unchanged).
    replica_id: str = ""
    chunk_index: int
    segment_index: int = 0
    # Packed per-token arrays, n tokens each.
    token_ids: bytes = b""  # int32
    logprobs: bytes = b""  # float32; behaviour log-prob over the kept set (0 where masked)
    loss_mask: bytes = b""  # uint8; 1 = sampled by the policy
    kept_offsets: bytes = b""  # int32, n+1 (CSR); empty set for masked tokens
    kept_ids: bytes = b""  # int32
    kept_capped: bytes = b""  # uint8 per token; 1 = kept set cut by the engine's cap
    version_starts: bytes = b""  # int32 span starts (token index in this chunk)
    versions: bytes = b""  # int64 weight version of each span
    # int16 [n, moe_layers, top_k] (shape in routed_experts_shape): row i = the experts the
    # position before token i was routed to, -1 = not recorded (docs/contracts.md, "Routing").
    routed_experts: bytes = b""
    routed_experts_shape: list[int] = []
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    final: bool = False
    finish_reason: str = ""
    cost: Cost | None = None
    created_at: float = 0.0
    kept_sizes: bytes = b""  # int32 per token (schema 2); 0 for masked tokens, -1 unknown

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // 4

    def token_array(self):
        return arrays.unpack(self.token_ids, arrays.INT32)

    def logprob_array(self):
        return arrays.unpack(self.logprobs, arrays.FLOAT32)

    def loss_mask_array(self):
        return arrays.unpack(self.loss_mask, arrays.UINT8)

    def kept_sets(self):
        return arrays.csr_rows(self.kept_offsets, self.kept_ids)

    def kept_capped_array(self):
        import numpy as np

        if not self.kept_capped:
            return np.zeros(self.num_tokens, dtype=np.uint8)
        return arrays.unpack(self.kept_capped, arrays.UINT8)

    def kept_size_array(self):
        """Each token's kept-set size: recorded (schema 2), else derived: the recorded
        ids' count where the set is complete, -1 (unknown) where it was capped."""
        import numpy as np

        if self.kept_sizes:
            return arrays.unpack(self.kept_sizes, arrays.INT32)
        off, _ = arrays.unpack_csr(self.kept_offsets, self.kept_ids)
        sizes = np.diff(off).astype(np.int32)
        return np.where(self.kept_capped_array() == 1, np.int32(-1), sizes)

    def routed_experts_array(self):
        """The route table [n, moe_layers, top_k] (int16, -1 = not recorded), or None."""
        if not self.routed_experts:
            return None
        return arrays.unpack(self.routed_experts, arrays.INT16).reshape(self.routed_experts_shape)

    def version_array(self):
        return arrays.unpack_spans(self.version_starts, self.versions, self.num_tokens)

    def validate(self) -> None:
        """Raise ValueError when the packed arrays disagree in length (see :meth:`arrays`)."""
        self.arrays()

    def arrays(self) -> "ChunkArrays":
        """Every per-token array, decoded once and checked: raise ValueError when they
        disagree in length or layout. The arrays are views over this chunk's bytes.

        The trainer calls this for every chunk it reads, so the usual chunk (schema 2,
        at least one token, little-endian host) is checked by :func:`_fast_arrays` with
        a handful of numpy calls; whatever it does not accept as certainly valid goes
        through :meth:`_checked_arrays`, the reference check, which returns the same
        arrays or raises the error naming what is wrong."""
        out = _fast_arrays(self)
        return out if out is not None else self._checked_arrays()

    def _checked_arrays(self) -> "ChunkArrays":
        """:meth:`arrays`, check by check in the order their errors are reported."""
        n = self.num_tokens
        if len(self.token_ids) % 4:
            raise ValueError("token_ids is not a whole number of int32")
        if len(self.logprobs) != 4 * n:
            raise ValueError(f"logprobs has {len(self.logprobs) // 4} entries for {n} tokens")
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {n} tokens")
        off, ids = arrays.unpack_csr(self.kept_offsets, self.kept_ids)
        if off.size != n + 1:
            raise ValueError(f"kept_offsets has {off.size} entries for {n} tokens (want n+1)")
        if self.kept_capped and len(self.kept_capped) != n:
            raise ValueError("kept_capped length differs from the token count")
        capped = self.kept_capped_array()
        if self.kept_sizes and len(self.kept_sizes) != 4 * n:
            raise ValueError(f"kept_sizes has {len(self.kept_sizes) // 4} entries for {n} tokens")
        sizes = self.kept_size_array()
        if self.kept_sizes:
            recorded = off[1:] - off[:-1]
            is_capped = capped == 1
            # A complete set has exactly its recorded ids; a capped one at least as many.
            if (sizes[~is_capped] != recorded[~is_capped]).any():
                raise ValueError("kept_sizes differs from the recorded ids of an uncapped kept set")
            if ((sizes[is_capped] != -1) & (sizes[is_capped] < recorded[is_capped])).any():
                raise ValueError("kept_sizes is smaller than the recorded ids of a capped kept set")
        routes = None
        if self.routed_experts or self.routed_experts_shape:
            shape = list(self.routed_experts_shape)
            if len(shape) != 3 or shape[0] != n or min(shape) < 1:
                raise ValueError(f"routed_experts_shape {shape} is not [{n} tokens, layers, top_k]")
            if len(self.routed_experts) != 2 * shape[0] * shape[1] * shape[2]:
                raise ValueError(f"routed_experts has {len(self.routed_experts)} bytes for shape {shape} (int16)")
            routes = self.routed_experts_array()
            if (routes < -1).any():
                raise ValueError("routed_experts holds an expert id below -1")
        return ChunkArrays(
            token_ids=self.token_array(), logprobs=self.logprob_array(), loss_mask=self.loss_mask_array(),
            kept_offsets=off, kept_ids=ids, kept_capped=capped, kept_sizes=sizes,
            versions=self.version_array(), routed_experts=routes,
        )


_LITTLE_ENDIAN = sys.byteorder == "little"


def _fast_arrays(c: TrajectoryChunk) -> "ChunkArrays | None":
    """:meth:`TrajectoryChunk.arrays` for a chunk that passes every check, or None when
    it does not (or is not the usual layout): the caller then runs the reference check,
    which raises the exact error. Lengths are compared on the bytes (no numpy); the CSR
    layout, the kept sizes and the routes with one reduction each."""
    token_ids, kept_offsets, kept_ids = c.token_ids, c.kept_offsets, c.kept_ids
    kept_capped, kept_sizes, version_starts = c.kept_capped, c.kept_sizes, c.version_starts
    n4 = len(token_ids)
    n = n4 >> 2
    if (not _LITTLE_ENDIAN or n == 0 or n4 & 3 or len(c.logprobs) != n4 or len(c.loss_mask) != n
            or len(kept_offsets) != n4 + 4 or len(kept_ids) & 3 or not kept_sizes or len(kept_sizes) != n4
            or (kept_capped and len(kept_capped) != n)):
        return None
    off = np.frombuffer(kept_offsets, arrays.INT32)
    # CSR: starts at 0, ends at len(ids), non-decreasing (every row length >= 0). Row
    # lengths in int64: in int32, offsets 0, 2**31 - 1, -2 (a descent) differ by a
    # positive wrapped-around 2**31 - 1, and the malformed chunk was taken for valid.
    recorded = np.subtract(off[1:], off[:-1], dtype=np.int64)
    if off[0] != 0 or off[n] != len(kept_ids) >> 2 or _min(recorded) < 0:
        return None
    sizes = np.frombuffer(kept_sizes, arrays.INT32)
    capped = np.frombuffer(kept_capped, arrays.UINT8) if kept_capped else np.zeros(n, dtype=np.uint8)
    differ = sizes != recorded
    # A complete set has exactly its recorded ids; a capped one (-1: size unknown) at least as many.
    if _count(differ) and _count(differ & ((capped != 1) | ((sizes < recorded) & (sizes != -1)))):
        return None
    routes = None
    if c.routed_experts or c.routed_experts_shape:
        shape = c.routed_experts_shape
        if (len(shape) != 3 or shape[0] != n or min(shape) < 1
                or len(c.routed_experts) != 2 * shape[0] * shape[1] * shape[2]):
            return None
        routes = np.frombuffer(c.routed_experts, arrays.INT16).reshape(shape)
        if _min(routes.reshape(-1)) < -1:
            return None
    if len(version_starts) == 4 and len(c.versions) == 8:  # one span (the usual chunk)
        if version_starts != b"\0\0\0\0":
            return None
        versions = np.empty(n, dtype=np.int64)
        versions.fill(int.from_bytes(c.versions, "little", signed=True))
    else:
        versions = arrays.unpack_spans(version_starts, c.versions, n)  # raises on bad spans (checked last)
    return ChunkArrays(
        token_ids=np.frombuffer(token_ids, arrays.INT32), logprobs=np.frombuffer(c.logprobs, arrays.FLOAT32),
        loss_mask=np.frombuffer(c.loss_mask, arrays.UINT8), kept_offsets=off,
        kept_ids=np.frombuffer(kept_ids, arrays.INT32), kept_capped=capped, kept_sizes=sizes,
        versions=versions, routed_experts=routes,
    )


_min = np.minimum.reduce  # (the ufunc itself: ndarray.min/any add a Python wrapper per call)
_count = np.count_nonzero


class ChunkArrays(msgspec.Struct, frozen=True, gc=False):
    """A chunk's per-token arrays, decoded and checked (:meth:`TrajectoryChunk.arrays`):
    n tokens each, kept sets in CSR (token i's set is ``kept_ids[kept_offsets[i]:kept_offsets[i+1]]``).

    A frozen Struct, not a dataclass: one is built for every chunk the trainer reads, and
    a frozen dataclass's ``__init__`` (an ``object.__setattr__`` per field) cost several
    times more. ``gc=False``: it holds arrays only, no cycles."""

    token_ids: "np.ndarray"  # int32 [n]
    logprobs: "np.ndarray"  # float32 [n]
    loss_mask: "np.ndarray"  # uint8 [n]
    kept_offsets: "np.ndarray"  # int32 [n+1]
    kept_ids: "np.ndarray"  # int32
    kept_capped: "np.ndarray"  # uint8 [n]
    kept_sizes: "np.ndarray"  # int32 [n]; recorded, or derived (schema 1): -1 unknown
    versions: "np.ndarray"  # int64 [n]
    routed_experts: "np.ndarray | None"  # int16 [n, moe_layers, top_k], None: not recorded


class Reward(Event, kw_only=True):
    """The grader's verdict on one trajectory, with every component of the reward."""

    trajectory_id: str
    task_id: str
    group_id: str
    sample_index: int
    attempt: str
    score: float  # verified solve score in [0, 1]
    tests_passed: int = 0
    tests_total: int = 0
    cheated: bool = False
    reason: str = ""
    cost: Cost = msgspec.field(default_factory=Cost)
    phase: str = "unconstrained"
    length_penalty: float = 0.0
    budget_penalty: float = 0.0
    reward: float = 0.0  # final: score - penalties; a detected cheat gets the cheat floor (sandbox/reward.py)
    weight_version: int = -1  # newest version that produced a token of it
    grading_seconds: float = 0.0
    created_at: float = 0.0


class WeightVersion(Event, kw_only=True):
    """Announced only after every object of the version is durable in the store."""

    model: str
    version: int
    kind: str  # "full" | "delta"
    base_version: int = -1  # the version a delta applies to
    keyframe_version: int = -1  # newest keyframe at or before this version
    manifest_url: str = ""
    weights_hash: str = ""
    num_tensors: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    trainer_step: int = -1
    created_at: float = 0.0


class Heartbeat(Event, kw_only=True):
    replica_id: str
    role: str
    status: str  # starting | serving | paused | draining | stopped
    weight_version: int = -1
    in_flight: int = 0
    tokens_per_s: float = 0.0
    last_pause_ms: float = 0.0
    updates_applied: int = 0
    host: str = ""
    pid: int = 0
    details: dict[str, str] = {}
    created_at: float = 0.0


class RecordRef(msgspec.Struct, array_like=True):
    """Where a record lives in the log (compact on the wire: [topic, partition, offset])."""

    topic: str
    partition: int
    offset: int


class TrainedTrajectory(msgspec.Struct, kw_only=True):
    trajectory_id: str
    chunks: list[RecordRef]
    reward: RecordRef


class GroupRef(msgspec.Struct, array_like=True):
    """A group's key (compact on the wire: [task_id, group_id])."""

    task_id: str
    group_id: str


class GroupDrop(msgspec.Struct, array_like=True):
    """A group that ended without being trained, and why (compact on the wire:
    [task_id, group_id, reason]). Reasons: ``zero_variance``, ``stale``, ``invalid``,
    ``abandoned`` (see docs/contracts.md, "Failure modes: group accounting")."""

    task_id: str
    group_id: str
    reason: str


class TrainStep(Event, kw_only=True):
    """What step ``step`` trained on, exactly, and the weights it produced.

    Schema 2 added ``groups``: the keys of the groups trained, in batch order, so a
    restarted trainer refuses a group sampled again under a new attempt id (a schema-1
    entry decodes with ``groups == []``; the trainer and ``rollway audit`` derive its
    keys from its trajectories' reward records, see ``trainer.steplog.group_ends``).
    Schema 3 added ``dropped``: the groups that ended untrained since the previous step,
    each once, so the log alone accounts for every group (older entries decode with
    ``dropped == []``).
    Schema 4 added ``config_hash``: the hash of the trainer's training-relevant settings
    (``trainer.training_config``), so a replay under other settings fails saying the
    config differs (older entries decode with ``""``, which is not checked)."""

    SCHEMA_VERSION: ClassVar[int] = 4

    step: int
    weight_version: int
    weights_hash: str
    trajectories: list[TrainedTrajectory] = []
    metrics: dict[str, float] = {}
    seed: int = 0
    created_at: float = 0.0
    groups: list[GroupRef] = []
    dropped: list[GroupDrop] = []
    config_hash: str = ""


class GroupsDropped(Event, kw_only=True):
    """Groups that ended untrained and did not wait for the next ``TrainStep.dropped``:
    the trainer stops (a clean stop logs what it dropped), or it held more drops, or
    for longer, than ``trainer.held_drops_max`` / ``held_drops_max_s`` allow (a trainer
    that cannot step, e.g. every group without reward variance). Written on
    ``rollway.train-steps`` in a transaction with its records' offsets, like a step's
    ``dropped``; ``after_step`` is the last step logged before it."""

    after_step: int
    dropped: list[GroupDrop]
    created_at: float = 0.0


class Metrics(Event, kw_only=True):
    source: str
    step: int = -1
    weight_version: int = -1
    values: dict[str, float] = {}
    histograms: dict[str, list[float]] = {}
    created_at: float = 0.0


class DeadLetter(Event, kw_only=True):
    """A record a consumer could not handle, with where it came from and why."""

    topic: str
    partition: int
    offset: int
    key: bytes | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes]] = []
    error: str
    error_kind: str  # decode | unknown_type | newer_schema | handler | invalid
    consumer_group: str = ""
    attempts: int = 0
    created_at: float = 0.0


class EvalResult(Event, kw_only=True):
    """Held-out evaluation of one weight version on one split: pass@1 over
    ``tasks`` tasks with ``samples`` samples each. Eval rollouts are never trained on."""

    split: str  # e.g. "family:heldout", or "dir:<path>" for a user's task folder
    weight_version: int
    model: str = ""
    tasks: int = 0
    samples: int = 0  # samples per task
    pass_at_1: float = 0.0  # mean over tasks of the fraction of samples solved
    mean_reward: float = 0.0
    mean_generated_tokens: float = 0.0
    cheated: int = 0  # samples flagged as cheating
    per_kind: dict[str, float] = {}  # pass@1 per task kind (family tasks' metadata "kind")
    evaluator: str = ""  # replica id of the evaluator (or "cli")
    seconds: float = 0.0
    created_at: float = 0.0
    errors: int = 0  # samples whose rollout or grading failed (counted as not solved)
    temperature: float = 1.0  # sampling temperature of the rollouts
    seed: int = 0  # seed of the split's instances and of sampling


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (Task, TrajectoryChunk, Reward, WeightVersion, Heartbeat, TrainStep, GroupsDropped, Metrics, EvalResult,
                DeadLetter)
}
