"""Live sessions: a bounded pool of workspaces, each with its own sandbox uid and tool-call log."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import structlog

from sandbox import image_workspace
from sandbox.images import ImageRoot, ImageStore
from sandbox.isolation import WORKSPACE
from sandbox.netwatch import ToolCall
from sandbox.quota import Quota
from sandbox.workspace import Workspace

log = structlog.get_logger(__name__)

# How much of each exec's output the tool-call log keeps for the grader's checks.
_LOGGED_OUTPUT_CHARS = 8192


class PoolFull(RuntimeError):
    """Every session slot is taken (HTTP 429)."""


class SessionBusy(RuntimeError):
    """The session is running a command already (HTTP 409): one at a time per session."""


class SessionClosed(KeyError):
    """No such live session (HTTP 404)."""


class Session:
    def __init__(self, session_id: str, task_id: str, slot: int, uid: int, workspace: Workspace,
                 root: ImageRoot | None = None, workdir: str = WORKSPACE) -> None:
        self.id = session_id
        self.task_id = task_id
        self.slot = slot
        self.uid = uid
        self.workspace = workspace
        # The image the session's commands run on (None: the host root), held while the
        # session lives, and where its tree is mounted inside the sandbox.
        self.root = root
        self.workdir = workdir
        self.created = self.last_used = time.monotonic()
        self.warm = False  # opened on a tree made ahead (SessionPool warm sessions)
        self.calls: list[ToolCall] = []
        self.closed = False
        # Commands, submit and close take it: one thing at a time per session, and the
        # uid and workspace are never reused while a command of this session runs.
        self.lock = asyncio.Lock()
        # Set once graded; a submit retried after a failed publish re-sends it.
        self.reward = None
        # The sandbox of the session's next command, started ahead (service.py
        # _prestart; a Task whose result is a runner.Prestarted or None).
        self.next_sandbox: asyncio.Task | None = None
        # File calls under way in worker threads (service.py _file_call): they take no
        # lock (they may run beside a command), so the release waits for them.
        self.file_calls: set[asyncio.Future] = set()

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def log_call(self, command: str, exit_code: int, stdout: str, stderr: str, killed: str, duration_s: float) -> None:
        self.calls.append(ToolCall(
            command=command, exit_code=exit_code, stdout=stdout[-_LOGGED_OUTPUT_CHARS:],
            stderr=stderr[-_LOGGED_OUTPUT_CHARS:], killed=killed, duration_s=duration_s,
        ))


class _Warm:
    """A session slot with its image tree made ahead (no task files yet)."""

    def __init__(self, slot: int, uid: int, workspace: Workspace, root: ImageRoot) -> None:
        self.slot, self.uid, self.workspace, self.root = slot, uid, workspace, root
        # Its first command's sandbox, started ahead by the service (a Task, or None).
        self.next_sandbox: asyncio.Task | None = None


class _Demand:
    """The largest group of one image's sessions open together lately, and when it was
    last that large."""

    __slots__ = ("peak", "at")

    def __init__(self) -> None:
        self.peak = 0
        self.at = 0.0


class SessionPool:
    """At most ``capacity`` sessions; session slot ``i`` runs as uid ``uid_base + i``.

    Warm sessions (``warm_per_image``): for an image in use, that many slots keep a tree
    over the image made ahead (:meth:`prepare_warm`, run by the service in the background
    while earlier sessions work), so the next session of the image only writes its task
    files. Warm slots give way to real sessions when the pool is otherwise full.

    Following demand (``follow_demand``): a GRPO group opens G sessions of one image at
    once, so the pool counts, at each open, the image's live sessions opened within
    ``group_window_s`` (the group so far) and keeps that many trees of the image ready
    (:meth:`warm_target`: never fewer than ``warm_per_image``, at most ``capacity``; free
    slots bound it further) until ``demand_ttl_s`` after the last group that large;
    :meth:`trim_warm` then drops the trees above the floor. Sessions opened one after
    another count as groups of one.

    Images whose groups ended (``idle_images``): an image none of whose sessions is open
    or opening is idle. Its trees are kept only while it is among the ``idle_images``
    images that went idle last (its next group may come soon: an LRU); an older idle
    image's trees are dropped at once, the floor too, giving back their slots and their
    hold on the image in the cache. Trees of idle images are also the first to give way:
    to a session when the pool is full, to a tree of an image in use when no slot is
    free (:meth:`make_warm`), and to an image that needs room in the cache
    (:meth:`drop_idle_warm`)."""

    def __init__(self, root: Path, *, capacity: int, uid_base: int, quota: Quota | None = None,
                 images: ImageStore | None = None, warm_per_image: int = 0, follow_demand: bool = False,
                 group_window_s: float = 2.0, demand_ttl_s: float = 120.0, idle_images: int = 2) -> None:
        self.root = root
        self.quota = quota
        self.images = images
        self.capacity = capacity
        self.uid_base = uid_base
        self.warm_per_image = warm_per_image
        self.follow_demand = follow_demand
        self.group_window_s = group_window_s
        self.demand_ttl_s = demand_ttl_s
        self._demand: dict[tuple[str, str], _Demand] = {}
        self.idle_images = idle_images
        # Per image key: its live sessions, and its opens under way (not yet live).
        self._live: collections.Counter[tuple[str, str]] = collections.Counter()
        self._opening: collections.Counter[tuple[str, str]] = collections.Counter()
        # Idle image keys whose trees are kept, the one that went idle last at the end.
        self._idle: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._free = list(range(capacity))
        self._sessions: dict[str, Session] = {}
        self._warm: dict[tuple[str, str], list[_Warm]] = {}
        # Ends a warm tree's prestarted sandbox (set by the service; called from worker
        # threads, returns once the sandbox and its uid's processes are gone).
        self.drop_sandbox: Callable[[asyncio.Task], None] | None = None
        # Slots and warm trees change in worker threads (open/prepare run off the loop).
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def warm(self) -> int:
        return sum(len(v) for v in self._warm.values())

    def warm_target(self, key: tuple[str, str], now: float | None = None) -> int:
        """How many trees of ``key`` (image digest, workdir) to keep ready now."""
        if self.warm_per_image <= 0:
            return 0
        target = self.warm_per_image
        demand = self._demand.get(key)
        if demand is not None and (time.monotonic() if now is None else now) - demand.at <= self.demand_ttl_s:
            target = max(target, demand.peak)
        return min(target, self.capacity)

    def _note_open(self, key: tuple[str, str], now: float) -> None:
        """Record the group an open of ``key`` belongs to (caller holds ``_lock``, the new
        session already in ``_sessions``)."""
        if not self.follow_demand:
            return
        # A copy first (one C call, atomic under the GIL): release pops in another pool thread.
        together = sum(1 for s in list(self._sessions.values())
                       if s.root is not None and (s.root.digest, s.workdir) == key
                       and now - s.created <= self.group_window_s)
        demand = self._demand.setdefault(key, _Demand())
        if now - demand.at > self.demand_ttl_s:
            demand.peak = 0  # the last large group is too old: start over from this one
        if together >= demand.peak:
            demand.peak, demand.at = together, now

    def trim_warm(self, now: float | None = None) -> int:
        """Drop the warm trees above each image's target (its groups stopped coming
        ``demand_ttl_s`` ago), oldest first; returns how many. The service calls it
        periodically (from a pool thread: dropping a tree ends its sandbox)."""
        now = time.monotonic() if now is None else now
        surplus: list[_Warm] = []
        with self._lock:
            for key, trees in self._warm.items():
                # An image neither in use nor among the idle ones kept (a refill that ended
                # after its group): none of its trees is wanted.
                extra = len(trees) - (self.warm_target(key, now) if self._wanted(key) else 0)
                if extra > 0:
                    surplus += trees[:extra]
                    del trees[:extra]
            for key in [k for k, d in self._demand.items() if now - d.at > self.demand_ttl_s]:
                del self._demand[key]
        for warm in surplus:
            self._drop_warm(warm)
        if surplus:
            log.info("warm_sessions_trimmed", dropped=len(surplus), warm=self.warm)
        return len(surplus)

    def _active(self, key: tuple[str, str]) -> bool:
        """A session of ``key`` is open or opening (caller holds ``_lock``)."""
        return self._live[key] > 0 or self._opening[key] > 0

    def _wanted(self, key: tuple[str, str]) -> bool:
        """Trees of ``key`` are kept: in use, or idle among the last ones (caller holds ``_lock``)."""
        return self._active(key) or key in self._idle

    def _spare_tree(self, exclude: tuple[str, str] | None = None, *, idle_only: bool = False) -> _Warm | None:
        """A warm tree to give way, taken out of the pool: an idle image's (the one idle
        longest), else (unless ``idle_only``) any other image's (caller holds ``_lock``)."""
        for k in [*self._idle] if idle_only else [*self._idle, *self._warm]:
            if k != exclude and self._warm.get(k):
                return self._warm[k].pop(0)  # the oldest: started, so ended without a wait
        return None

    def _began(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._opening[key] += 1
            self._idle.pop(key, None)

    def _ended(self, key: tuple[str, str], *, opening: bool) -> None:
        """An open (``opening``) or a session of ``key`` ended: if it was the image's last,
        the image is idle; the trees of the idle images beyond the newest
        ``idle_images`` are dropped now (in the caller's thread: a pool thread)."""
        counter = self._opening if opening else self._live
        dropped: list[_Warm] = []
        with self._lock:
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]
            if self._active(key):
                return
            self._idle[key] = None
            self._idle.move_to_end(key)
            while len(self._idle) > self.idle_images:
                old, _ = self._idle.popitem(last=False)
                dropped += self._warm.pop(old, [])
        for warm in dropped:
            self._drop_warm(warm)
        if dropped:
            log.info("warm_sessions_of_idle_images_dropped", dropped=len(dropped), warm=self.warm)

    def drop_idle_warm(self) -> int:
        """Drop every tree of the idle images (an image needs their room in the cache);
        returns how many. Blocking: from a pool thread."""
        with self._lock:
            dropped = [w for k in self._idle for w in self._warm.pop(k, [])]
        for warm in dropped:
            self._drop_warm(warm)
        if dropped:
            log.info("warm_sessions_of_idle_images_dropped", dropped=len(dropped), warm=self.warm,
                     reason="cache room")
        return len(dropped)

    def _take_slot(self, key: tuple[str, str] | None) -> tuple[int, _Warm | None]:
        """A warm tree for ``key`` with its slot, else a free slot (a warm one of another
        image is dropped when no slot is free, an idle image's first)."""
        with self._lock:
            if key is not None and self._warm.get(key):
                # The oldest: its sandbox has had the longest to start.
                warm = self._warm[key].pop(0)
                return warm.slot, warm
            if not self._free:
                dropped = self._spare_tree()
                if dropped is None:
                    raise PoolFull(f"all {self.capacity} sessions are in use; close one or retry later")
            else:
                return self._free.pop(0), None
        self._drop_warm(dropped)
        with self._lock:
            return self._free.pop(0), None

    def _drop_warm(self, warm: _Warm) -> None:
        if warm.next_sandbox is not None and self.drop_sandbox is not None:
            self.drop_sandbox(warm.next_sandbox)  # before the slot (its uid) is free again
        warm.workspace.remove()
        if self.images is not None:
            self.images.release(warm.root)
        with self._lock:
            self._free.append(warm.slot)

    def prepare_warm(self, root: ImageRoot, workdir: str) -> bool:
        """Make one more warm tree of ``root`` if below its target and a slot is
        free; returns whether it did (the service calls it until False)."""
        warm = self.make_warm(root, workdir)
        if warm is not None and not self.add_warm(warm, workdir):
            self.drop_warm(warm)
            return False
        return warm is not None

    def make_warm(self, root: ImageRoot, workdir: str) -> _Warm | None:
        """A warm tree of ``root`` (slot taken, image held), not yet offered to sessions
        (:meth:`add_warm`), or None when there are enough, the image's trees are not
        wanted (idle and not among the last ones), or no slot is free (for an image in
        use, an idle image's tree gives way)."""
        key = (root.digest, workdir)
        spare = None
        with self._lock:
            if len(self._warm.get(key, ())) >= self.warm_target(key) or self.images is None or not self._wanted(key):
                return None
            if not self._free:
                # An image in use may take the slot of an idle image's tree, never of
                # another image in use (their trees are as wanted as its own).
                spare = self._spare_tree(exclude=key, idle_only=True) if self._active(key) else None
                if spare is None:
                    return None
        if spare is not None:
            self._drop_warm(spare)
        with self._lock:
            if not self._free:
                return None  # taken meanwhile
            slot = self._free.pop(0)
        uid = self.uid_base + slot
        try:
            path = self.root / f"rollway-ws-{uuid.uuid4().hex}"
            workspace, _ = image_workspace.create(path, uid, {}, self.quota, root, workdir)
        except BaseException:
            with self._lock:
                self._free.append(slot)
            raise
        self.images.hold(root)
        return _Warm(slot, uid, workspace, root)

    def add_warm(self, warm: _Warm, workdir: str) -> bool:
        """Offer the tree to sessions; False (the caller drops it, :meth:`drop_warm`) when
        its image's trees are no longer wanted (its group ended meanwhile and the image
        is not among the idle ones kept)."""
        key = (warm.root.digest, workdir)
        with self._lock:
            if not self._wanted(key):
                return False
            self._warm.setdefault(key, []).append(warm)
            return True

    def drop_warm(self, warm: _Warm) -> None:
        """End a tree that :meth:`add_warm` refused. Blocking: from a pool thread."""
        self._drop_warm(warm)

    def drain_warm(self) -> None:
        with self._lock:
            warm = [w for v in self._warm.values() for w in v]
            self._warm.clear()
        for w in warm:
            self._drop_warm(w)

    def open(self, task_id: str, files: dict[str, str], *, root: ImageRoot | None = None,
             workdir: str = WORKSPACE) -> tuple[Session, list[str]]:
        """A new session. ``root`` (already held by the caller, see ImageStore.acquire):
        the session runs on that image, its tree a copy-on-write layer over the image's
        ``workdir`` with ``files`` written over it; the pool releases the hold on close."""
        key = (root.digest, workdir) if root is not None else None
        if key is None:
            return self._open(task_id, files, None, workdir, None)
        self._began(key)
        try:
            return self._open(task_id, files, root, workdir, key)
        finally:
            self._ended(key, opening=True)

    def _open(self, task_id: str, files: dict[str, str], root: ImageRoot | None, workdir: str,
              key: tuple[str, str] | None) -> tuple[Session, list[str]]:
        slot, warm = self._take_slot(key)
        uid = self.uid_base + slot
        session_id = uuid.uuid4().hex
        try:
            path = self.root / f"rollway-ws-{session_id}"
            if root is None:
                workspace, dropped = Workspace.create(path, uid, files, self.quota)
            elif warm is not None:
                workspace, dropped = warm.workspace, image_workspace.write_files(warm.workspace, files)
            else:
                workspace, dropped = image_workspace.create(path, uid, files, self.quota, root, workdir)
        except BaseException:
            if warm is not None:
                self._drop_warm(warm)
            else:
                with self._lock:
                    self._free.append(slot)
            raise
        if warm is not None and self.images is not None:
            self.images.release(warm.root)  # the caller's hold is the session's now
        session = Session(session_id, task_id, slot, uid, workspace, root, workdir)
        if warm is not None:
            session.next_sandbox = warm.next_sandbox
            session.warm = True
        with self._lock:
            self._sessions[session_id] = session
            if key is not None:
                self._live[key] += 1
                self._note_open(key, session.created)
        log.info("session_opened", session_id=session_id, task_id=task_id, uid=uid, files=len(files),
                 image=root.ref if root else "", warm=session.warm)
        return session, dropped

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.closed:
            raise SessionClosed(f"no live session {session_id!r}")
        return session

    def release(self, session: Session) -> None:
        """Forget the session and delete its workspace; the caller holds ``session.lock``.
        Blocking (unmounts, deletes a tree): the service runs it in a pool thread."""
        if self._sessions.pop(session.id, None) is None:
            return
        session.closed = True
        try:
            session.workspace.remove()
        finally:
            # A workspace that will not go (the error goes to the caller) must not keep the
            # image pinned or the slot taken: the next session of the slot gets a new folder.
            try:
                if session.root is not None and self.images is not None:
                    self.images.release(session.root)
            finally:
                with self._lock:
                    self._free.append(session.slot)
                if session.root is not None:
                    self._ended((session.root.digest, session.workdir), opening=False)
        log.info("session_closed", session_id=session.id, task_id=session.task_id, calls=len(session.calls))

    async def close(self, session: Session) -> None:
        session.closed = True  # no new command starts; a running one finishes (bounded by its timeout)
        async with session.lock:
            self.release(session)

    def idle(self, older_than_s: float) -> list[Session]:
        now = time.monotonic()
        # A copy first (one C call, atomic under the GIL): open adds sessions in worker
        # threads, and iterating the live dict then raised, which killed the idle reaper.
        return [s for s in list(self._sessions.values()) if now - s.last_used > older_than_s and not s.lock.locked()]

    def all(self) -> list[Session]:
        return list(self._sessions.values())
