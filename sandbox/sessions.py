"""Live sessions: a bounded pool of workspaces, each with its own sandbox uid and tool-call log."""

from __future__ import annotations

import asyncio
import time
import uuid
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
        self.calls: list[ToolCall] = []
        self.closed = False
        # Commands, submit and close take it: one thing at a time per session, and the
        # uid and workspace are never reused while a command of this session runs.
        self.lock = asyncio.Lock()
        # Set once graded; a submit retried after a failed publish re-sends it.
        self.reward = None

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def log_call(self, command: str, exit_code: int, stdout: str, stderr: str, killed: str, duration_s: float) -> None:
        self.calls.append(ToolCall(
            command=command, exit_code=exit_code, stdout=stdout[-_LOGGED_OUTPUT_CHARS:],
            stderr=stderr[-_LOGGED_OUTPUT_CHARS:], killed=killed, duration_s=duration_s,
        ))


class SessionPool:
    """At most ``capacity`` sessions; session slot ``i`` runs as uid ``uid_base + i``."""

    def __init__(self, root: Path, *, capacity: int, uid_base: int, quota: Quota | None = None,
                 images: ImageStore | None = None) -> None:
        self.root = root
        self.quota = quota
        self.images = images
        self.capacity = capacity
        self.uid_base = uid_base
        self._free = list(range(capacity))
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, task_id: str, files: dict[str, str], *, root: ImageRoot | None = None,
             workdir: str = WORKSPACE) -> tuple[Session, list[str]]:
        """A new session. ``root`` (already held by the caller, see ImageStore.acquire):
        the session runs on that image, its tree a copy-on-write layer over the image's
        ``workdir`` with ``files`` written over it; the pool releases the hold on close."""
        if not self._free:
            raise PoolFull(f"all {self.capacity} sessions are in use; close one or retry later")
        slot = self._free.pop(0)
        uid = self.uid_base + slot
        session_id = uuid.uuid4().hex
        try:
            path = self.root / f"rollway-ws-{session_id}"
            if root is None:
                workspace, dropped = Workspace.create(path, uid, files, self.quota)
            else:
                workspace, dropped = image_workspace.create(path, uid, files, self.quota, root, workdir)
        except BaseException:
            self._free.append(slot)
            raise
        session = Session(session_id, task_id, slot, uid, workspace, root, workdir)
        self._sessions[session_id] = session
        log.info("session_opened", session_id=session_id, task_id=task_id, uid=uid, files=len(files),
                 image=root.ref if root else "")
        return session, dropped

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.closed:
            raise SessionClosed(f"no live session {session_id!r}")
        return session

    def release(self, session: Session) -> None:
        """Forget the session and delete its workspace; the caller holds ``session.lock``."""
        if self._sessions.pop(session.id, None) is None:
            return
        session.closed = True
        session.workspace.remove()
        if session.root is not None and self.images is not None:
            self.images.release(session.root)
        self._free.append(session.slot)
        log.info("session_closed", session_id=session.id, task_id=session.task_id, calls=len(session.calls))

    async def close(self, session: Session) -> None:
        session.closed = True  # no new command starts; a running one finishes (bounded by its timeout)
        async with session.lock:
            self.release(session)

    def idle(self, older_than_s: float) -> list[Session]:
        now = time.monotonic()
        return [s for s in self._sessions.values() if now - s.last_used > older_than_s and not s.lock.locked()]

    def all(self) -> list[Session]:
        return list(self._sessions.values())
