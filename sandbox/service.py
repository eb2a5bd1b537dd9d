"""The sandbox service: HTTP API of docs/contracts.md over sessions, the jail and the grader.

JSON in and out; errors are ``{"error": "..."}`` with a 4xx/5xx status: 400 bad input,
404 unknown session/file/task, 409 the session is busy with another command, 413 too
large, 429 no session slot / no command slot, 502 the reward could not be published,
503 an image that cannot be provided, or a session asked for while the service shuts down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import tempfile
from pathlib import Path

import msgspec
import structlog
from aiohttp import web

from sandbox import stale_trees
from sandbox.auth import bearer_auth
from sandbox.cgroups import CgroupJoinFailed, CgroupManager, make_cgroup_manager
from sandbox.config import RewardConfig, SandboxConfig
from sandbox.grader import Grader, Publisher, SubmitRequest
from sandbox.images import ImageError, ImageStore
from sandbox.isolation import WORKSPACE, command_problem
from sandbox.quota import Quota, QuotaError
from sandbox.quota import available as quota_available
from sandbox.runner import Busy, Jail
from sandbox.sessions import PoolFull, Session, SessionBusy, SessionClosed, SessionPool
from sandbox.uid_claim import claim_uid_range
from sandbox.workspace import FileMissing, Workspace, WorkspaceError
from tasks.spec import TaskSpec
from tasks.store import TaskStore

log = structlog.get_logger(__name__)

# How long after a command its session's next sandbox is started (see SandboxService._prestart).
_PRESTART_PAUSE_S = 0.1
# Warm trees are made this long after the open that asks for them: a GRPO group's G
# opens come together, and trees (and their sandboxes) made at once competed for the
# CPU with the group's own first commands; the pause lets the group start first.
_REFILL_PAUSE_S = 0.1


class CreateSession(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    task_id: str
    # Omitted: the task's repository files from the service's task store.
    files: dict[str, str] | None = None


class ExecRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    command: str
    timeout_s: float | None = None


class WriteFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    path: str
    content: str


class ServiceStopping(RuntimeError):
    """The service is shutting down: no new session (HTTP 503)."""


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


async def _body(request: web.Request, kind: type):
    raw = await request.read()
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise HttpError(400, f"invalid {kind.__name__} body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise HttpError(400, f"body is not JSON: {exc}") from None


def _still_open(session: Session) -> None:
    """A session closed (or being closed) since the request took it is gone: 404."""
    if session.closed:
        raise SessionClosed(f"no live session {session.id!r}")


_STATUS_OF = [
    (HttpError, None),
    (SessionClosed, 404),
    (FileMissing, 404),
    (WorkspaceError, 400),
    (PoolFull, 429),
    (Busy, 429),
    (SessionBusy, 409),
    # An image that cannot be provided is the infrastructure's failure, not the task's.
    (ImageError, 503),
    (CgroupJoinFailed, 503),  # a command that never started: the host's failure
    (ServiceStopping, 503),
]


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status == 413:
            return _json({"error": f"request body too large: {exc.text}"}, 413)
        if exc.status >= 400:
            return _json({"error": exc.reason}, exc.status)
        raise
    except Exception as exc:
        for kind, status in _STATUS_OF:
            if isinstance(exc, kind):
                message = exc.args[0] if exc.args else str(exc)
                return _json({"error": message}, status or exc.status)
        log.exception("sandbox_request_failed", path=request.path)
        return _json({"error": f"internal error: {type(exc).__name__}: {exc}"}, 500)


def quota_from_config(cfg: SandboxConfig) -> Quota | None:
    """The workspace quota to mount, or None (off, or auto without root)."""
    if cfg.disk_quota == "off":
        return None
    if not quota_available():
        if cfg.disk_quota == "required":
            raise QuotaError("sandbox.disk_quota = required, but mounting a workspace tmpfs needs root")
        log.warning("workspace_quota_off", reason="not root: cannot mount a size-limited tmpfs per workspace")
        return None
    return Quota(size_bytes=cfg.workspace_bytes, inodes=cfg.workspace_inodes)


class SandboxService:
    """Owns the pool, the jail and the grader; ``app`` is the aiohttp application."""

    def __init__(
        self,
        cfg: SandboxConfig,
        reward_cfg: RewardConfig,
        store: TaskStore,
        publisher: Publisher | None = None,
        cgroups: CgroupManager | None = None,
    ) -> None:
        # A uid range no other sandbox service on this host uses (sandbox/uid_claim.py):
        # cleaning up a command kills every process of its uid.
        self.uid_claim = claim_uid_range(cfg.uid_base, cfg.max_sessions,
                                         solution_uid_offset=cfg.grading_solution_uid_offset)
        ranges_from = cfg.uid_base
        cfg = msgspec.structs.replace(cfg, uid_base=self.uid_claim.base)
        self.cfg = cfg
        self.store = store
        root = Path(cfg.workspace_root or tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        # Before this service makes any tree: those of a service killed without releasing
        # them (SIGKILL), told by their uid ranges' claims (sandbox/stale_trees.py).
        stale_trees.sweep(root, own=self.uid_claim, uid_base=ranges_from,
                          solution_uid_offset=cfg.grading_solution_uid_offset)
        self.cgroups = cgroups if cgroups is not None else make_cgroup_manager(
            cfg.cgroups, max_processes=cfg.max_processes, memory_bytes=cfg.memory_bytes
        )
        self.jail = Jail(cfg, self.cgroups)
        self.quota = quota_from_config(cfg)
        self.images = ImageStore(cfg.images)
        self.pool = SessionPool(root, capacity=cfg.max_sessions, uid_base=cfg.uid_base, quota=self.quota,
                                images=self.images, warm_per_image=cfg.images.warm_sessions_per_image,
                                follow_demand=cfg.images.warm_follow_demand,
                                group_window_s=cfg.images.warm_group_window_s,
                                demand_ttl_s=cfg.images.warm_demand_ttl_s,
                                idle_images=cfg.images.warm_idle_images)
        self._refilling: dict[tuple[str, str], asyncio.Task] = {}
        # Next-sandbox starts still in their pause (_prestart's delay_s).
        self._pausing: set[asyncio.Task] = set()
        self.pool.drop_sandbox = self._drop_from_thread
        # Pool calls that may drop a warm tree wait in their thread for the loop to end its
        # sandbox, whose clean-up needs a thread of the default executor: in threads of
        # their own, so as many opens at once as that executor has threads cannot take
        # every thread and wait for one (the whole service hung).
        self._pool_threads = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="rollway-pool")
        # Session releases under way in pool threads (_release): shutdown waits for them.
        self._releasing: set[asyncio.Future] = set()
        # Session opens under way (_open), owned by the service, not by their requests:
        # shutdown waits for them, and each ends closing what it made.
        self._opening: set[asyncio.Future] = set()
        # Closes of sessions opened for a request that was cancelled meanwhile (_orphaned).
        self._orphans: set[asyncio.Future] = set()
        # Set as the runner begins to stop (on_shutdown, before it waits for the requests
        # under way): from then on no session is handed out (503).
        self._shutting_down = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.grader = Grader(cfg, reward_cfg, store, self.jail, publisher, quota=self.quota, images=self.images)
        self._reaper: asyncio.Task | None = None
        self._trimmer: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        request_limit = max(cfg.max_snapshot_bytes, 2 * cfg.max_file_bytes_api) + 1024 * 1024
        self.app = web.Application(middlewares=[*bearer_auth(cfg), _errors], client_max_size=request_limit)
        self.app.add_routes([
            web.post("/sessions", self.create_session),
            web.post("/sessions/{id}/exec", self.exec),
            web.get("/sessions/{id}/files", self.read_file),
            web.put("/sessions/{id}/files", self.write_file),
            web.post("/sessions/{id}/submit", self.submit),
            web.delete("/sessions/{id}", self.close_session),
            web.post("/tasks", self.register_task),
            web.get("/health", self.health),
        ])
        self.app.on_startup.append(self._on_startup)
        self.app.on_shutdown.append(self._on_shutdown)
        self.app.on_cleanup.append(self._on_cleanup)

    async def self_check(self) -> None:
        """Run one command through the whole isolation (bwrap, uid switch, Python with
        pytest); raise RuntimeError naming what is broken. ``rollway sandbox`` calls it
        before serving, so a broken host fails at start, not on the first rollout."""
        expected = self.cfg.uid_base if self.jail.privileged else os.geteuid()
        with tempfile.TemporaryDirectory(dir=self.pool.root, prefix="rollway-selfcheck-") as tmp:
            ws, _ = await asyncio.to_thread(Workspace.create, Path(tmp) / "ws", expected, {})
            result = await self.jail.run(
                "id -u && python -c 'import pytest'", workspace=ws.root, uid=expected, timeout_s=30.0,
                label="selfcheck",
            )
        if result.exit_code != 0 or result.stdout.split()[:1] != [str(expected)]:
            raise RuntimeError(
                f"sandbox self-check failed (exit {result.exit_code}): expected uid {expected} and a Python "
                f"with pytest; stdout={result.stdout[-300:]!r} stderr={result.stderr[-600:]!r}"
            )
        log.info("sandbox_self_check_ok", uid=expected, cgroups=self.cgroups is not None,
                 privileged=self.jail.privileged, seconds=result.duration_s)

    async def _on_startup(self, app: web.Application) -> None:
        self._loop = asyncio.get_running_loop()
        self._reaper = asyncio.create_task(self._reap_idle())
        if self.pool.warm_per_image > 0:
            self._trimmer = asyncio.create_task(self._trim_warm())

    async def _on_shutdown(self, app: web.Application) -> None:
        """The runner begins to stop (``rollway sandbox``'s SIGTERM), before it waits for
        the requests under way: a create from now on is refused (503), also one whose
        tree is being made (_open releases it), so no client is handed a session of a
        service about to end."""
        self._shutting_down = True

    async def _on_cleanup(self, app: web.Application) -> None:
        """After the requests (answered, or cancelled when the runner's grace ran out):
        end everything the service made, so nothing is left after it: sessions, opens
        still under way in their threads, warm trees, releases, cgroups, the uid claim.
        One part that fails does not keep the rest (the uid range above all) from going."""
        self._shutting_down = True
        try:
            if self._reaper is not None:
                self._reaper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._reaper
            self._stopping.set()
            if self._trimmer is not None:
                await self._trimmer  # ends between trims: a trim in its thread is never left running
            # Opens under way: a request the runner cancelled left its open going on in its
            # thread, which made its session after the closes below had run (the tree, an
            # image's overlay mount, stayed). Each ends closing what it made.
            await asyncio.gather(*self._opening, return_exceptions=True)
            # Refills stop at their next tree (_shutting_down): let them, then drop what they made.
            await asyncio.gather(*self._refilling.values(), return_exceptions=True)
            await asyncio.gather(*self._orphans, return_exceptions=True)
            for session in self.pool.all():
                try:
                    await self._close(session)
                except Exception:
                    log.exception("session_close_at_shutdown_failed", session_id=session.id)
            await self._in_pool_thread(self.pool.drain_warm)
            # A release whose close was cancelled (the reaper's, above) goes on in its thread
            # and its session is no longer listed: wait for it, so nothing is left behind.
            await asyncio.gather(*self._releasing, return_exceptions=True)
        finally:
            self._pool_threads.shutdown(wait=False)
            if self.cgroups is not None:
                self.cgroups.close()
            self.uid_claim.release()

    async def _trim_warm(self) -> None:
        """Drop the warm trees an image's groups no longer need (SessionPool.trim_warm),
        a few times per sandbox.images.warm_demand_ttl_s (at least once a second: a trim
        is a scan of a few lists when there is nothing to drop)."""
        while not self._stopping.is_set():
            period = max(0.05, min(1.0, self.pool.demand_ttl_s / 4))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), period)
                return
            try:
                await self._in_pool_thread(self.pool.trim_warm)
            except Exception as exc:  # one failed drop must not end trimming
                log.warning("warm_trim_failed", error=repr(exc))

    async def _reap_idle(self) -> None:
        period = max(1.0, min(60.0, self.cfg.session_idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            for session in self.pool.idle(self.cfg.session_idle_timeout_s):
                log.warning("session_idle_closed", session_id=session.id, task_id=session.task_id)
                # One close that fails (a workspace that will not go, an image release that
                # raises) must not end the reaper: every later idle session would be kept.
                try:
                    await self._close(session)
                except Exception:
                    log.exception("session_idle_close_failed", session_id=session.id, task_id=session.task_id)

    # --- handlers ---------------------------------------------------------------

    def _refuse_if_stopping(self) -> None:
        if self._shutting_down:
            raise ServiceStopping("the sandbox service is shutting down: no new session; "
                                  "open it on another sandbox service or once this one is back")

    async def create_session(self, request: web.Request) -> web.Response:
        body = await _body(request, CreateSession)
        self._refuse_if_stopping()
        files = body.files
        try:
            spec = self.store.get(body.task_id)
        except KeyError as exc:
            if files is None:
                raise HttpError(404, f"{exc.args[0]}; send the task's files") from None
            spec = None
        if files is None:
            files = spec.files
        if spec is None or not spec.image:
            session, dropped = await self._open(body.task_id, files)
            return _json({"session_id": session.id, "dropped": dropped})
        # An image task: its root (pulled and unpacked on first use; an ImageError is a
        # 503 naming the image), held until the session closes.
        root = await self._acquire(spec.image)
        try:
            self._refuse_if_stopping()  # the pull may have taken minutes
        except ServiceStopping:
            self.images.release(root)
            raise
        session, dropped = await self._open(body.task_id, files, root=root, workdir=spec.workdir)
        return _json({"session_id": session.id, "dropped": dropped, "image": root.ref, "digest": root.digest})

    async def _acquire(self, ref: str):
        """ImageStore.acquire; when the cache is full, the trees kept for idle images (whose
        groups ended: SessionPool.drop_idle_warm) give up their hold on their images, and
        the image is acquired again (the least recently used unheld images make room)."""
        try:
            return await self.images.acquire(ref)
        except ImageError as exc:
            if exc.kind != "cache_full" or not await self._in_pool_thread(self.pool.drop_idle_warm):
                raise
        log.info("image_cache_room_from_idle_trees", image=ref)
        return await self.images.acquire(ref)

    async def _open(self, task_id: str, files: dict[str, str], *, root=None,
                    workdir: str = WORKSPACE) -> tuple[Session, list[str]]:
        """SessionPool.open in a pool thread, as a task of the service's own (shutdown
        waits for it), shielded from its request: a thread cannot be stopped, so a
        cancelled request (the runner's shutdown grace ran out) used to leave the open
        going on unseen. ``root`` (held by the caller) is the open's from here on: released
        if the open fails, the session's otherwise (it was released on the request's
        cancel while the session went on to hold it, one release too many). An open that
        ends while the service shuts down closes its session and answers 503."""

        async def opening() -> tuple[Session, list[str]]:
            try:
                session, dropped = await self._in_pool_thread(self.pool.open, task_id, files, root=root,
                                                              workdir=workdir)
            except BaseException:
                if root is not None:
                    self.images.release(root)
                raise
            if self._shutting_down:
                await self._close(session)
                self._refuse_if_stopping()
            self._prestart(session)
            if root is not None:
                self._refill(root, workdir)
            return session, dropped

        opened = asyncio.ensure_future(opening())
        self._opening.add(opened)
        opened.add_done_callback(self._opening.discard)
        try:
            return await asyncio.shield(opened)
        except asyncio.CancelledError:
            # Nobody will learn the session's id: it is closed once open.
            opened.add_done_callback(self._orphaned)
            raise

    def _orphaned(self, opened: asyncio.Future) -> None:
        if opened.cancelled() or opened.exception() is not None:
            return
        session, _ = opened.result()
        log.warning("session_orphaned_closed", session_id=session.id, task_id=session.task_id,
                    reason="its create request was cancelled while it opened")
        closing = asyncio.ensure_future(self._close(session))
        self._orphans.add(closing)
        closing.add_done_callback(self._orphan_closed)

    def _orphan_closed(self, closing: asyncio.Future) -> None:
        self._orphans.discard(closing)
        if not closing.cancelled() and closing.exception() is not None:
            log.warning("session_orphan_close_failed", error=repr(closing.exception()))

    def _refill(self, root, workdir: str) -> None:
        """Make the image's warm trees in the background (sandbox.images.warm_sessions_per_image)."""
        key = (root.digest, workdir)
        if self.pool.warm_per_image <= 0 or key in self._refilling:
            return

        async def refill() -> None:
            try:
                if _REFILL_PAUSE_S:
                    await asyncio.sleep(_REFILL_PAUSE_S)
                # Not while shutting down: each tree made would only be dropped again.
                while not self._shutting_down and \
                        (warm := await asyncio.to_thread(self.pool.make_warm, root, workdir)) is not None:
                    # Its first command's sandbox too, offered with the tree (set before
                    # add_warm: a session may take the tree at once).
                    if self.cfg.prestart_sandboxes:
                        warm.next_sandbox = asyncio.create_task(self.jail.prestart(
                            workspace=warm.workspace.root, uid=warm.uid, label=f"s{warm.slot}", root=root,
                            workdir=workdir))
                    if not self.pool.add_warm(warm, workdir):
                        # The image's group ended meanwhile and its trees are not kept.
                        await self._in_pool_thread(self.pool.drop_warm, warm)
                        break
            except Exception as exc:
                log.warning("warm_session_failed", image=root.ref, error=repr(exc))
            finally:
                self._refilling.pop(key, None)

        self._refilling[key] = asyncio.create_task(refill())

    def _session(self, request: web.Request) -> Session:
        session = self.pool.get(request.match_info["id"])
        session.touch()
        return session

    async def exec(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await _body(request, ExecRequest)
        timeout = self.cfg.command_timeout_s if body.timeout_s is None else body.timeout_s
        if not 0 < timeout <= self.cfg.max_command_timeout_s:
            raise HttpError(400, f"timeout_s must be in (0, {self.cfg.max_command_timeout_s}], got {timeout}")
        problem = command_problem(body.command)
        if problem:
            raise HttpError(400, problem)
        _still_open(session)  # closed while its body came: gone (404), not busy (409)
        if session.lock.locked():
            raise SessionBusy(f"session {session.id} is running another command")
        async with session.lock:
            if session.closed:
                raise SessionClosed(f"no live session {session.id!r}")
            try:
                pre = await self._take_prestarted(session)
                if pre is not None:
                    result = await self.jail.run_prestarted(pre, body.command, timeout_s=timeout)
                else:
                    result = await self.jail.run(
                        body.command, workspace=session.workspace.root, uid=session.uid, timeout_s=timeout,
                        label=f"s{session.slot}", root=session.root, workdir=session.workdir,
                    )
            finally:
                # The next command's sandbox, after a short pause: a close that follows
                # at once (create, one command, close) does not pay for starting one.
                self._prestart(session, delay_s=_PRESTART_PAUSE_S)
            session.log_call(body.command, result.exit_code, result.stdout, result.stderr, result.killed,
                             result.duration_s)
        session.touch()
        return _json(result)

    # --- a session's next sandbox, started ahead ---------------------------------

    def _prestart(self, session: Session, delay_s: float = 0.0) -> None:
        """Start the sandbox of the session's next command in the background
        (runner.Jail.prestart): the next exec only hands it its command. Commands of a
        session run one at a time, and this runs only after one ended (its uid's
        processes reaped), so it never overlaps a command of the same uid."""
        if not self.cfg.prestart_sandboxes or session.closed or session.next_sandbox is not None:
            return

        async def start():
            if delay_s:
                me = asyncio.current_task()
                self._pausing.add(me)
                try:
                    await asyncio.sleep(delay_s)
                finally:
                    self._pausing.discard(me)
            if session.closed:
                return None
            return await self.jail.prestart(workspace=session.workspace.root, uid=session.uid,
                                            label=f"s{session.slot}", root=session.root, workdir=session.workdir)

        session.next_sandbox = asyncio.create_task(start())

    async def _take_prestarted(self, session: Session):
        """The session's prestarted sandbox if there is a live one (waiting for one still
        starting), else None; either way the session has none afterwards."""
        task, session.next_sandbox = session.next_sandbox, None
        if task is None:
            return None
        if task in self._pausing:
            # Still in its pause: the command starts a sandbox of its own at once instead
            # of waiting the pause out and then the start (back-to-back execs paid both).
            task.cancel()
        try:
            pre = await task
        except asyncio.CancelledError:
            # The start was cancelled (by _drop_prestarted): no sandbox. Unless the caller
            # was cancelled too (awaiting a task forwards the cancel to it): then the cancel
            # goes on; swallowed, the shutdown's cancel of the idle reaper was lost and the
            # shutdown waited for the reaper for good.
            if task.cancelled() and not asyncio.current_task().cancelling():
                return None
            raise
        except Exception as exc:
            log.warning("sandbox_prestart_failed", session_id=session.id, error=repr(exc))
            return None
        if pre is not None and not pre.alive:
            await self.jail.discard(pre)
            return None
        return pre

    async def _drop_prestarted(self, session: Session) -> None:
        """End the session's prestarted sandbox unused (before close or grading, which may
        reap the session's uid)."""
        task = session.next_sandbox
        if task is not None and not task.done():
            task.cancel()  # still pausing: nothing started; starting: the start ends what it made (runner._spawn)
        pre = await self._take_prestarted(session)
        if pre is not None:
            await self.jail.discard(pre)

    async def _in_pool_thread(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._pool_threads,
                                                                functools.partial(fn, *args, **kwargs))

    def _drop_from_thread(self, task: asyncio.Task) -> None:
        """A warm tree's prestarted sandbox ended from a worker thread (the pool drops a
        warm tree there); waits until it is gone."""
        async def drop() -> None:
            try:
                pre = await task
            except BaseException:
                return
            if pre is not None:
                await self.jail.discard(pre)

        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(drop(), self._loop).result()

    async def _close(self, session: Session) -> None:
        session.closed = True  # no new command starts; a running one finishes (bounded by its timeout)
        async with session.lock:
            await self._drop_prestarted(session)
            await self._release(session)

    async def _release(self, session: Session) -> None:
        """SessionPool.release in a pool thread. It unmounts the session's tree and deletes
        it: blocking filesystem work (a repository-sized tree, a group's eight trees at
        once) that, run on the loop, stalled every other session's commands, opens and
        file calls meanwhile. Safe off the loop: the caller holds ``session.lock`` and has
        marked the session closed, so no command, next-sandbox start or second release of
        it runs meanwhile (its prestarted sandbox was ended before); its slot, and so its
        uid, is freed only after the tree is gone (release frees it last), so no new
        session or warm tree of that uid starts before. Shielded: a caller cancelled
        meanwhile (the idle reaper at shutdown) leaves a release that began to finish,
        and shutdown waits for it (_releasing)."""
        release = asyncio.ensure_future(self._release_after_file_calls(session))
        self._releasing.add(release)
        release.add_done_callback(self._release_done)
        await asyncio.shield(release)

    async def _release_after_file_calls(self, session: Session) -> None:
        """The release, once the session's file calls under way have ended: they take no
        lock, and one in its thread as the tree went read or wrote into a half-deleted
        tree (a 500 naming the missing folder; a write could leave a file rmtree missed).
        The session is closed, so no new one starts (_file_call)."""
        while session.file_calls:
            await asyncio.gather(*session.file_calls, return_exceptions=True)
        await self._in_pool_thread(self.pool.release, session)

    async def _file_call(self, session: Session, fn, *args):
        """``fn(*args)`` on the session's tree in a worker thread, if the session is still
        open at its start (checked after the request's body came: a call closed meanwhile
        is 404, never run on a tree being released). Shielded: a cancelled caller (a client
        gone) leaves a thread that goes on, and the release waits for it all the same."""
        _still_open(session)
        call = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        session.file_calls.add(call)
        call.add_done_callback(session.file_calls.discard)
        return await asyncio.shield(call)

    def _release_done(self, release: asyncio.Future) -> None:
        self._releasing.discard(release)
        if not release.cancelled() and release.exception() is not None:
            # Its caller gets it too, unless it was cancelled meanwhile: then only here.
            log.warning("session_release_failed", error=repr(release.exception()))

    async def read_file(self, request: web.Request) -> web.Response:
        session = self._session(request)
        path = request.query.get("path")
        if not path:
            raise HttpError(400, "query parameter 'path' is required")
        data = await self._file_call(session, session.workspace.read, path, self.cfg.max_file_bytes_api)
        try:
            content = data.decode()
        except UnicodeDecodeError:
            raise HttpError(415, f"{path!r} is not UTF-8 text") from None
        return _json({"path": path, "content": content})

    async def write_file(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await _body(request, WriteFile)
        size = len(body.content.encode())
        if size > self.cfg.max_file_bytes_api:
            raise HttpError(413, f"{body.path!r} is {size} bytes, over the {self.cfg.max_file_bytes_api}-byte limit")
        written = await self._file_call(session, session.workspace.write, body.path, body.content)
        return _json({"path": body.path, "bytes": written})

    async def submit(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await _body(request, SubmitRequest)
        if body.task_id and body.task_id != session.task_id:
            raise HttpError(400, f"task_id {body.task_id!r} differs from the session's task {session.task_id!r}")
        body.task_id = session.task_id
        try:
            self.store.get(body.task_id)
        except KeyError as exc:
            raise HttpError(404, f"cannot grade: {exc.args[0]}") from None
        _still_open(session)
        if session.lock.locked():
            raise SessionBusy(f"session {session.id} is running a command; submit after it returns")
        async with session.lock:
            if session.closed:
                raise SessionClosed(f"no live session {session.id!r}")
            # Grading runs commands as the session's uid (and reaps it): no sandbox of the
            # session may be waiting meanwhile.
            await self._drop_prestarted(session)
            if session.reward is None or session.reward.trajectory_id != body.trajectory_id:
                snapshot, error = None, ""
                try:
                    snapshot = await asyncio.to_thread(
                        session.workspace.snapshot,
                        max_bytes=self.cfg.max_snapshot_bytes, max_files=self.cfg.max_snapshot_files,
                    )
                except WorkspaceError as exc:
                    error = str(exc)
                session.reward = await self.grader.grade(
                    body, snapshot=snapshot, calls=session.calls, uid=session.uid, snapshot_error=error,
                )
            try:
                # ?publish=false (evaluation): grade and answer, but the reward goes to no
                # topic, so nothing downstream (trainer, feeder) ever sees it.
                if request.query.get("publish", "true").lower() != "false":
                    await self.grader.publish(session.reward)
            except Exception as exc:
                # Keep the session and its verdict: a retried submit publishes it again.
                log.error("reward_publish_failed", trajectory_id=body.trajectory_id, error=repr(exc))
                return _json({"error": f"grading done but publishing the reward failed: {exc!r}; retry submit",
                              "reward": session.reward}, 502)
            # Closed before the release's await: a call meanwhile is 404 (gone), not 409.
            session.closed = True
            await self._release(session)
        return _json(session.reward)

    async def register_task(self, request: web.Request) -> web.Response:
        """Add a task (hidden tests included) to the grader's store, for tasks the service
        was not started with (an evaluation's held-out split or folder). Registering the
        same task again is a no-op; other content under a known id is refused (409), so a
        registration can never change how an existing task is graded."""
        spec = await _body(request, TaskSpec)
        try:
            known = self.store.get(spec.task_id)
        except KeyError:
            self.store.add(spec)
            return _json({"task_id": spec.task_id, "added": True})
        if (known.files, known.hidden_tests, known.test_command) != (spec.files, spec.hidden_tests, spec.test_command):
            raise HttpError(409, f"task {spec.task_id!r} is already known with other files or hidden tests")
        return _json({"task_id": spec.task_id, "added": False})

    async def close_session(self, request: web.Request) -> web.Response:
        session = self.pool.get(request.match_info["id"])
        await self._close(session)
        return _json({"closed": True})

    async def health(self, request: web.Request) -> web.Response:
        return _json({
            "sessions": len(self.pool),
            "capacity": self.pool.capacity,
            "commands_running": self.jail.running,
            "command_slots": self.cfg.max_concurrent_commands,
            "cgroups": self.cgroups is not None,
            "privileged": self.jail.privileged,
            "disk_quota": self.quota is not None,
            "warm_sessions": self.pool.warm,
            "seccomp": self.cfg.seccomp,
        })


async def serve(service: SandboxService, host: str, port: int) -> web.AppRunner:
    """Start listening; returns the runner (``await runner.cleanup()`` to stop)."""
    runner = web.AppRunner(service.app)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("sandbox_service_listening", host=host, port=port)
    return runner
