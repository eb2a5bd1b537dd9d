"""Run one command in a sandbox: limits, wall-clock timeout, capped output, a clear result.

:class:`Jail` owns the isolation settings (:mod:`sandbox.isolation`), the optional
per-command cgroups (:mod:`sandbox.cgroups`) and the bound on commands running at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
import structlog

from sandbox import quota as disk
from sandbox.cgroups import CgroupJoinFailed, CgroupManager, CommandCgroup
from sandbox.config import SandboxConfig
from sandbox.image_unpack import shell_of
from sandbox.images import ImageRoot
from sandbox.isolation import (
    WORKSPACE, Bind, Limits, bwrap_argv, command_problem, image_env, python_binds, reads_commands, rlimit_argv,
    sandbox_env,
)
from sandbox.seccomp import filter_fd
from sandbox.workspace import Workspace

log = structlog.get_logger(__name__)

# Exit statuses of a process killed by these signals (bwrap reports 128 + signal).
_SIGNAL_LIMITS = {
    128 + signal.SIGXCPU: "cpu",
    128 + signal.SIGXFSZ: "file_size",
}
_READ_CHUNK = 64 * 1024
_ENOSPC = b"No space left on device"
# After a kill, how long to wait for the process and its pipes to close.
_REAP_GRACE_S = 5.0


class CommandResult(msgspec.Struct, kw_only=True):
    """The answer of ``POST /sessions/{id}/exec``.

    ``killed``: why the service killed the command ('' = it ended by itself):
    'timeout' (wall clock), 'output' (wrote more than max_output_total_bytes).
    ``limits``: every limit the command ran into, including ones enforced by the
    kernel: 'cpu' (RLIMIT_CPU), 'file_size' (RLIMIT_FSIZE), 'memory' (the cgroup's
    memory limit; RLIMIT_AS shows as MemoryError / ENOMEM in the output),
    'processes' (the cgroup's pids.max), 'timeout', 'output', 'disk' (the workspace's
    size quota is full, or a write failed with ENOSPC: workspace or /tmp).
    """

    exit_code: int
    stdout: str
    stderr: str
    truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    killed: str = ""
    limits: list[str] = []


class Busy(RuntimeError):
    """Every command slot stayed taken for command_queue_timeout_s (HTTP 429)."""


class _Capture:
    """Keeps the first ``keep`` bytes of a stream; counts everything."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.buf = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self.buf)
        if room > 0:
            self.buf += data[:room]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.buf)

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


class Jail:
    """Runs commands isolated. One per service; ``max_concurrent_commands`` at once."""

    def __init__(self, cfg: SandboxConfig, cgroups: CgroupManager | None = None) -> None:
        self.cfg = cfg
        self.cgroups = cgroups
        self.privileged = os.geteuid() == 0
        self.binds = python_binds(cfg.python_venv) + [Bind(p, p) for p in cfg.extra_ro_binds]
        self.env = sandbox_env(cfg.python_venv)
        self.limits = Limits(
            cpu_seconds=cfg.cpu_seconds,
            memory_bytes=cfg.memory_bytes,
            max_processes=cfg.max_processes,
            max_file_bytes=cfg.max_file_bytes,
            max_open_files=cfg.max_open_files,
            tmp_bytes=cfg.tmp_bytes,
        )
        self._slots = asyncio.Semaphore(cfg.max_concurrent_commands)
        self.running = 0

    async def run(self, command: str, **kwargs) -> CommandResult:
        """Run one command in one slot (the arguments of :meth:`run_held`)."""
        async with self.slot():
            return await self.run_held(command, **kwargs)

    @contextlib.asynccontextmanager
    async def slot(self):
        """One command slot. The grader holds one for its two cooperating sandboxes (tests
        and solution), so two gradings can never deadlock each holding half of theirs."""
        try:
            # Not wait_for: on 3.11 it returns a slot that came free as it was cancelled and
            # drops the cancel, so a cancelled command (closed session, shutdown) ran anyway.
            async with asyncio.timeout(self.cfg.command_queue_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise Busy(
                f"all {self.cfg.max_concurrent_commands} command slots stayed busy for "
                f"{self.cfg.command_queue_timeout_s}s"
            ) from None
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()

    async def run_held(
        self,
        command: str,
        *,
        workspace: Path,
        uid: int,
        timeout_s: float,
        binds: list[Bind] = (),
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        label: str = "cmd",
        give_fds: tuple[int, ...] = (),
        root: ImageRoot | None = None,
        workdir: str = WORKSPACE,
        output_limit: int | None = None,
    ) -> CommandResult:
        """Run one command, for a caller already holding a :meth:`slot`. ``give_fds`` are
        handed to the command (same numbers inside) and closed here once it has started.
        ``root``: an image (sandbox/images.py) is the command's ``/``, read-only, with its
        own interpreter and Env (no host Python, no ``extra_ro_binds``); ``workspace`` is
        bound at ``workdir``. ``output_limit``: the command is killed once it has written
        more than this many bytes of output (None: ``max_output_total_bytes``).

        Phases: prepare (argv, seccomp filter, private /tmp) -> cgroup -> spawn ->
        supervise (output caps, timeout, kill) -> which limits were hit -> clean up."""
        limits = limits or self.limits
        binds, env = self._binds_env(binds, env, root)
        argv, seccomp, tmp = await self._prepare(
            command, workspace=workspace, uid=uid, limits=limits, binds=binds, env=env, give_fds=give_fds,
            root=root, workdir=workdir,
        )
        pass_fds = tuple(fd for fd in (seccomp, *give_fds) if fd is not None)
        group = await self._cgroup(label, limits, uid, tmp, pass_fds)
        started = time.monotonic()
        try:
            proc = await _spawn(argv, pass_fds, group.procs_files() if group else [], limits)
        except BaseException:
            await self._clean_up(uid, group, tmp)
            raise
        return await self._complete(proc, group, tmp, uid=uid, workspace=workspace, timeout_s=timeout_s,
                                    label=label, started=started, output_limit=output_limit)

    async def _cgroup(self, label: str, limits: Limits, uid: int, tmp: Workspace | None,
                      pass_fds: tuple[int, ...]) -> CommandCgroup | None:
        """The command's cgroup (None without cgroups); on failure the prepared fds and
        /tmp are let go."""
        if self.cgroups is None:
            return None
        try:
            return await _made_or_undone(asyncio.to_thread(
                self.cgroups.create, label, max_processes=limits.max_processes, memory_bytes=limits.memory_bytes
            ), lambda group: group.remove())
        except BaseException:
            _close(*pass_fds)
            await self._clean_up(uid, None, tmp)
            raise

    def _binds_env(self, binds, env, root: ImageRoot | None) -> tuple[list[Bind], dict[str, str]]:
        if root is None:
            return [*self.binds, *binds], {**self.env, **(env or {})}
        return list(binds), image_env(root.env, env)

    async def _complete(self, proc: asyncio.subprocess.Process, group: CommandCgroup | None, tmp: Workspace | None,
                        *, uid: int, workspace: Path, timeout_s: float, label: str, started: float,
                        sending: asyncio.Future | None = None, output_limit: int | None = None) -> CommandResult:
        """Supervise a started command to its end, tell which limits it hit, clean up."""
        out, err = _Capture(self.cfg.max_output_bytes), _Capture(self.cfg.max_output_bytes)
        try:
            killed = await self._supervise(proc, group, out, err, timeout_s, label,
                                           self.cfg.max_output_total_bytes if output_limit is None else output_limit)
            if sending is not None:
                await sending  # done once the shell read it (or the sandbox is gone)
            exit_code = proc.returncode if proc.returncode is not None else -1
            lost = await asyncio.to_thread(group.never_entered) if group and exit_code == _JOIN_FAILED else []
            if lost:
                raise CgroupJoinFailed(f"command {label!r} did not start: joining its cgroup {', '.join(lost)} failed "
                                       f"({err.text().strip()[-300:] or 'no error text'})")
            if exit_code < 0:  # bwrap itself died by a signal (our kill)
                exit_code = 128 - exit_code
            limits_hit = await _limits_hit(killed, exit_code, group, workspace, tmp, out, err)
            result = CommandResult(
                exit_code=exit_code,
                stdout=out.text(),
                stderr=err.text(),
                truncated=out.truncated or err.truncated,
                timed_out=killed == "timeout",
                duration_s=round(time.monotonic() - started, 4),
                killed=killed,
                limits=limits_hit,
            )
            log.info(
                "sandbox_command", label=label, uid=uid, exit_code=exit_code, killed=killed,
                limits=limits_hit, duration_s=result.duration_s, output_bytes=out.total + err.total,
                prestarted=sending is not None,
            )
            return result
        finally:
            if sending is not None and not sending.done():
                sending.cancel()
            await self._clean_up(uid, group, tmp)

    # --- a command's sandbox started before its command ------------------------------

    async def prestart(self, *, workspace: Path, uid: int, label: str, root: ImageRoot | None = None,
                       workdir: str = WORKSPACE) -> "Prestarted | None":
        """Start the sandbox of a session's next command now, before the command is known:
        cgroup joined, rlimits set, namespaces and mounts made, uid dropped, and its shell
        waiting for the command on a pipe (:func:`sandbox.isolation.command_reader`).
        :meth:`run_prestarted` hands it the command; :meth:`discard` ends it unused. The
        sandbox is the one :meth:`run_held` would make for this session (nothing in it
        depends on the command), so every isolation property is the same; only the start
        moves off the command's path. None where the shell cannot read its command (an
        image without bash)."""
        shell = shell_of(Path(root.rootfs)) if root is not None else "/bin/bash"
        if not reads_commands(shell):
            return None
        limits = self.limits
        binds, env = self._binds_env((), None, root)
        read_fd, write_fd = os.pipe()
        if self.privileged:
            # The shell reopens the pipe as /dev/fd/N (bash's $(<file)), which checks the
            # pipe's owner: the session uid's, like everything else of its command.
            os.fchown(read_fd, uid, uid)
        try:
            argv, seccomp, tmp = await self._prepare(
                "", workspace=workspace, uid=uid, limits=limits, binds=binds, env=env, give_fds=(read_fd,),
                root=root, workdir=workdir, command_fd=read_fd,
            )
        except BaseException:
            _close(write_fd)
            raise
        pass_fds = tuple(fd for fd in (seccomp, read_fd) if fd is not None)
        try:
            group = await self._cgroup(label, limits, uid, tmp, pass_fds)
        except BaseException:
            _close(write_fd)
            raise
        try:
            proc = await _spawn(argv, pass_fds, group.procs_files() if group else [], limits)
        except BaseException:
            _close(write_fd)
            await self._clean_up(uid, group, tmp)
            raise
        return Prestarted(proc, group, tmp, write_fd, uid=uid, workspace=workspace, label=label)

    async def run_prestarted(self, pre: "Prestarted", command: str, *, timeout_s: float) -> CommandResult:
        """Run ``command`` in a sandbox from :meth:`prestart`, in one command slot (the
        timeout and the duration count from the hand-over)."""
        problem = command_problem(command)
        if problem:
            await self.discard(pre)
            raise ValueError(problem)
        handed = False
        try:
            async with self.slot():
                handed = True
                started = time.monotonic()
                sending = asyncio.ensure_future(
                    _send_command(pre.take_fd(), command.encode("utf-8", "surrogatepass")))
                return await self._complete(pre.proc, pre.group, pre.tmp, uid=pre.uid, workspace=pre.workspace,
                                            timeout_s=timeout_s, label=pre.label, started=started, sending=sending)
        finally:
            if not handed:  # no slot came free (429) or the caller went away: it runs nothing
                await self.discard(pre)

    async def discard(self, pre: "Prestarted") -> None:
        """End a prestarted sandbox that will not run a command (session closed)."""
        _close(pre.take_fd())  # its shell reads EOF and runs nothing; the kill ends it anyway
        self._kill(pre.proc, pre.group)
        try:
            with contextlib.suppress(ProcessLookupError):
                await asyncio.wait_for(pre.proc.wait(), _REAP_GRACE_S)
        finally:
            await self._clean_up(pre.uid, pre.group, pre.tmp)

    async def _prepare(
        self, command: str, *, workspace: Path, uid: int, limits: Limits, binds: list[Bind],
        env: dict[str, str], give_fds: tuple[int, ...], root: ImageRoot | None = None, workdir: str = WORKSPACE,
        command_fd: int | None = None,
    ) -> tuple[list[str], int | None, Workspace | None]:
        """The bwrap argv, the seccomp filter's fd and the command's private /tmp; on
        failure nothing is left open (``give_fds`` closed too)."""
        seccomp = filter_fd() if self.cfg.seccomp else None
        tmp = None
        try:
            if self.privileged and self.cfg.disk_quota != "off":
                tmp = await _made_or_undone(asyncio.to_thread(self._private_tmp, limits, uid),
                                            lambda made: made.remove())
            argv = bwrap_argv(
                command, workspace=str(workspace), uid=uid, limits=limits, binds=binds,
                privileged=self.privileged, env=env, seccomp_fd=seccomp,
                tmp_source=str(tmp.root) if tmp is not None else None,
                rootfs=root.rootfs if root is not None else None, workdir=workdir,
                shell=shell_of(Path(root.rootfs)) if root is not None else "/bin/bash",
                command_fd=command_fd,
            )
        except BaseException:
            _close(seccomp, *give_fds)
            if tmp is not None:
                tmp.remove()
            raise
        return argv, seccomp, tmp

    async def _supervise(
        self, proc: asyncio.subprocess.Process, group: CommandCgroup | None, out: "_Capture", err: "_Capture",
        timeout_s: float, label: str, output_limit: int,
    ) -> str:
        """Capture the output until the command ends; kill it on timeout or too much
        output (returns why: 'timeout', 'output', '' = it ended by itself) or when the
        caller is cancelled."""
        too_much = asyncio.Event()

        async def pump(stream: asyncio.StreamReader, capture: _Capture) -> None:
            # Read to EOF even past the limit (the kill brings EOF soon), so the
            # pipes close and the child never blocks on a full pipe meanwhile.
            while chunk := await stream.read(_READ_CHUNK):
                capture.add(chunk)
                if out.total + err.total > output_limit:
                    too_much.set()

        pumps = asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err))
        finished = asyncio.ensure_future(_wait_all(pumps, proc))
        flooded = asyncio.ensure_future(too_much.wait())
        killed = ""
        try:
            done, _ = await asyncio.wait(
                {finished, flooded}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            # The caller went away (client disconnect, shutdown): the command goes too.
            self._kill(proc, group)
            flooded.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(finished), _REAP_GRACE_S)
            raise
        if finished not in done:
            killed = "output" if flooded in done else "timeout"
            self._kill(proc, group)
            try:
                await asyncio.wait_for(asyncio.shield(finished), _REAP_GRACE_S)
            except TimeoutError:
                # Something still holds the pipes; stop reading them.
                log.error("sandbox_pipes_stuck", label=label, pid=proc.pid)
                pumps.cancel()
                for stream in (proc.stdout, proc.stderr):
                    stream.feed_eof()
                await asyncio.wait_for(proc.wait(), _REAP_GRACE_S)
        flooded.cancel()
        return killed

    async def _clean_up(self, uid: int, group: CommandCgroup | None, tmp: Workspace | None) -> None:
        def clean() -> None:
            if group is not None and "pids" in group.dirs:
                # Every process of the command is in its cgroup (joined before anything
                # of it ran; the sandbox cannot leave it): wait until the group's process
                # count (charged until each process is released, zombies included) is 0.
                # One small read per poll, where scanning /proc for the uid took ~4 ms.
                _reap_group(group, _REAP_GRACE_S)
            elif self.privileged:
                # The uid belongs to this session alone, and its commands run one at a
                # time: whatever still runs as it is left of this command (the pid
                # namespace's teardown is asynchronous to bwrap's exit). Wait until it is
                # all gone, so the next command starts with a clean process count.
                reap_uid(uid, _REAP_GRACE_S)
            if group is not None:
                group.remove()
            if tmp is not None:
                tmp.remove()

        # One thread hop for the whole clean-up (each hop costs a wake-up on a busy host),
        # done even when the caller is cancelled meanwhile (a cancelled wait for a thread
        # that has not started yet would drop it, leaving the cgroup and /tmp behind).
        await _made_or_undone(asyncio.to_thread(clean), lambda _: None)

    def _private_tmp(self, limits: Limits, uid: int) -> Workspace:
        """The command's /tmp: a fresh tmpfs of ``tmp_bytes`` (mode 1777 inside)."""
        root = Path(self.cfg.workspace_root or tempfile.gettempdir())
        tmp, _ = Workspace.create(root / f"rollway-tmp-{uuid.uuid4().hex[:12]}", uid, {},
                                  disk.Quota(size_bytes=limits.tmp_bytes, inodes=self.cfg.workspace_inodes))
        os.chmod(tmp.root, 0o1777)
        return tmp

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process, group: CommandCgroup | None) -> None:
        # bwrap leads its own session: its process group is bwrap and the pid-1 of the
        # sandbox; --die-with-parent and the pid namespace take every descendant along.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if group is not None:
            group.kill_all()


# Joins the cgroups named before ``--`` (``$$``: this shell, whose pid the exec below
# keeps), then execs the rest; a join that fails runs nothing (exit 125).
_JOIN_CGROUPS = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
_JOIN_FAILED = 125  # with a group that shows no run: cgroups.CgroupJoinFailed, not a result


def spawn_argv(argv: list[str], procs_files: list[str], limits: Limits) -> list[str]:
    """``argv`` behind the cgroup join and the rlimits: ``sh -c JOIN sh PROCS... --
    prlimit ... -- argv``. Exec prefixes rather than a ``preexec_fn``, which would make
    Python fork the whole service process on every command instead of vfork."""
    join = ["/bin/sh", "-c", _JOIN_CGROUPS, "sh", *procs_files, "--"] if procs_files else []
    return [*join, *rlimit_argv(limits), *argv]


async def _spawn(argv: list[str], pass_fds: tuple[int, ...], procs_files: list[str],
                 limits: Limits) -> asyncio.subprocess.Process:
    """Start bwrap in its own session, inside the cgroup (joined before anything of the
    command runs, so nothing it forks starts outside), under the rlimits; our copies of
    ``pass_fds`` are closed once the child has its own."""
    try:
        # Cancelled mid-start (a session closed while its next sandbox started): asyncio's
        # own undo of a half-made subprocess kills only its direct child and then waits for
        # both pipes to close, which the sandbox's processes hold open, so it would wait
        # forever (the 2026-12-02 CI hang). So the start always finishes; a cancelled one
        # kills what it started (its own session), and the caller's clean-up ends the rest
        # of its cgroup.
        return await _made_or_undone(asyncio.create_subprocess_exec(
            *spawn_argv(argv, procs_files, limits),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
        ), _kill_session)
    finally:
        # The child has its copies now (or never will): ours would keep a socket
        # peer from seeing EOF when the other end exits.
        _close(*pass_fds)


async def _made_or_undone(making, undo):
    """Await ``making`` (a start: a subprocess, a cgroup or /tmp made in a thread) to its
    end even when the caller is cancelled meanwhile, any number of times: cancelling the
    await itself would leave what the start makes with no one to end it (a thread's
    cgroup or tmpfs) or hang (a subprocess, see _spawn). If the caller was cancelled,
    ``undo`` ends what was made and the cancel goes on."""
    made = asyncio.ensure_future(making)
    cancelled = False
    while not made.done():
        try:
            await asyncio.wait({made})
        except asyncio.CancelledError:
            cancelled = True
    if not cancelled:
        return made.result()
    if not made.cancelled() and made.exception() is None:
        undo(made.result())
    raise asyncio.CancelledError


def _kill_session(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap leads its own session (start_new_session)


async def _limits_hit(killed: str, exit_code: int, group: CommandCgroup | None, workspace: Path,
                      tmp: Workspace | None, out: _Capture, err: _Capture) -> list[str]:
    """Every limit the command ran into (see :class:`CommandResult`)."""
    hit: list[str] = []
    if killed:
        hit.append(killed)
    if exit_code in _SIGNAL_LIMITS:
        hit.append(_SIGNAL_LIMITS[exit_code])
    if group is not None:
        hit += [h for h in await asyncio.to_thread(group.limits_hit) if h not in hit]
    # The workspace's tmpfs is full (its quota), or a write failed with ENOSPC
    # (the workspace, or the command's private /tmp, which is gone by now).
    if (disk.is_full(workspace) or (tmp is not None and disk.is_full(tmp.root))
            or any(_ENOSPC in c.buf for c in (out, err))):
        hit.append("disk")
    return hit


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


async def _wait_all(pumps: asyncio.Future, proc: asyncio.subprocess.Process) -> None:
    await pumps
    await proc.wait()


def uid_pids(uid: int) -> list[int]:
    """Host pids whose real uid is ``uid`` (from /proc/PID/status: the owner of /proc/PID
    is root for a process that made itself non-dumpable)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(name))
                        break
        except (OSError, ValueError):
            pass
    return pids


def reap_uid(uid: int, timeout_s: float) -> None:
    """SIGKILL every process of ``uid`` until none is left (zombies vanish once reaped)."""
    deadline = time.monotonic() + timeout_s
    while pids := uid_pids(uid):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > deadline:
            log.error("sandbox_processes_survive", uid=uid, pids=pids[:20])
            return
        time.sleep(0.01)


def _reap_group(group: CommandCgroup, timeout_s: float) -> None:
    """SIGKILL what is left in the command's cgroup until none of its processes can run
    or still counts against the session uid.

    The group's process count (pids.current: charged until a process is released, zombies
    included) may end at 1, not 0: bwrap's pid-1 in the sandbox is root's (it drops to the
    session uid only for the command) and, once bwrap reported the exit status, an orphan
    that the host's init reaps when it gets to it (seconds here). That 1 is harmless, and
    it also proves the rest is gone: pid 1 of a pid namespace becomes a zombie only after
    the kernel killed and released every other process in it. So: no live process in the
    group, and at most that one zombie."""
    pids = group.dirs["pids"]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            live = (pids / "cgroup.procs").read_text().split()
            charged = int((pids / "pids.current").read_text())
        except (OSError, ValueError):
            return  # the group is gone
        if not live and charged <= 1:
            return
        group.kill_all()
        if time.monotonic() > deadline:
            log.error("sandbox_processes_survive", cgroup=str(pids), pids=live[:20], charged=charged)
            return
        time.sleep(0.002)


class Prestarted:
    """A session's next sandbox, started and waiting for its command (Jail.prestart)."""

    def __init__(self, proc: asyncio.subprocess.Process, group: CommandCgroup | None, tmp: Workspace | None,
                 command_fd: int, *, uid: int, workspace: Path, label: str) -> None:
        self.proc, self.group, self.tmp = proc, group, tmp
        self._fd: int | None = command_fd
        self.uid, self.workspace, self.label = uid, workspace, label

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and self._fd is not None

    def take_fd(self) -> int | None:
        fd, self._fd = self._fd, None
        return fd


async def _send_command(fd: int | None, data: bytes) -> None:
    """Write the command, then the ``.`` the reader strips, and close the pipe. Most
    commands fit the pipe at once; a longer one is finished in a thread (the shell reads
    while we write). A sandbox gone meanwhile (EPIPE) is its command's result."""
    if fd is None:
        return
    data += b"."
    try:
        os.set_blocking(fd, False)
        try:
            done = os.write(fd, data)
        except BlockingIOError:
            done = 0
        if done < len(data):
            os.set_blocking(fd, True)
    except BrokenPipeError:  # the sandbox is gone: its command's result says so
        _close(fd)
        return
    except BaseException:
        _close(fd)
        raise
    if done == len(data):
        _close(fd)
        return
    # From here the thread owns the fd and closes it: a cancel of this coroutine does not
    # stop a thread, and closing the fd under its blocking write would let the fd number
    # be reused and the rest of the command be written into whatever file gets it.
    await asyncio.to_thread(_write_all_and_close, fd, data[done:])


def _write_all_and_close(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except BrokenPipeError:
        pass
    finally:
        _close(fd)
