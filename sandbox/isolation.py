"""How one command is isolated: the bubblewrap command line and the rlimits.

Every command runs in ``bwrap`` with its own network (only ``lo``), pid, ipc, uts and
cgroup namespaces, a read-only view of the system (``/usr``, ``/lib*``, ``/bin``,
``/etc``) and of the Python it needs, the session workspace read-write at
``/workspace``, a fresh size-capped tmpfs ``/tmp``, a minimal ``/dev`` and ``/proc``,
and a scrubbed environment. Nothing else of the host is visible: not the repository,
not the task store (hidden tests), not the service's files.

Privileges. Run as root (as here), bwrap without a user namespace keeps *every*
capability for the sandboxed command (checked: CapEff is full), and the kernel never
applies RLIMIT_NPROC to uid 0 (also not inside a user namespace whose uid maps to 0:
a fork bomb under ``bwrap --unshare-user --uid 1000 ... prlimit --nproc=20`` still
reached 64 processes). So the command is started through ``setpriv``, which switches
to an unprivileged uid/gid (``uid_base`` + session slot), clears supplementary groups,
the bounding set and inheritable caps, and sets no-new-privs (setuid binaries cannot
regain root). bwrap keeps only CAP_SETUID/SETGID/SETPCAP for that hand-over. With a
non-root uid RLIMIT_NPROC holds (checked: the same bomb stops at the limit), and the
per-command cgroup (``pids.max``, memory limit), when available, bounds the tree too.

Run as an ordinary user, bwrap makes a user namespace instead; the command keeps the
service's uid, so RLIMIT_NPROC counts the service user's own processes too: give the
service a dedicated user, or cgroups.

Kernel attack surface. Every command runs under the seccomp filter of
:mod:`sandbox.seccomp` (bwrap ``--seccomp FD``): no namespaces (so no nested user
namespace where the code would be root), no mounts, no ptrace, no bpf, keyctl,
perf_event_open, userfaultfd or kexec. Run unprivileged, bwrap's ``--disable-userns``
closes nested user namespaces too.

Killing. The outer bwrap is a session leader (its process group is killed on timeout)
and ``--die-with-parent`` kills the sandbox's pid-1 when it dies; when pid 1 of a pid
namespace dies the kernel kills every process in it, so no descendant survives a
command, including daemonized ones.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import msgspec

WORKSPACE = "/workspace"
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


class Bind(msgspec.Struct, frozen=True):
    """A host path made visible inside the sandbox."""

    source: str
    target: str
    writable: bool = False


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    cpu_seconds: int
    memory_bytes: int
    max_processes: int
    max_file_bytes: int
    max_open_files: int
    tmp_bytes: int


def python_binds(venv: str = "") -> list[Bind]:
    """Read-only binds for a Python with pytest: the venv and the interpreter it points
    to, at the same absolute paths (a venv's ``bin/python`` and ``pyvenv.cfg`` hold
    absolute paths)."""
    prefix = Path(venv or sys.prefix).resolve()
    cfg = prefix / "pyvenv.cfg"
    paths = [prefix]
    if cfg.exists():
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home":
                # home = <base>/bin; bind the whole installation (stdlib, lib-dynload).
                paths.append(Path(value.strip()).resolve().parent)
        python = prefix / "bin" / "python"
        if python.exists():
            paths.append(python.resolve().parent.parent)
    elif venv == "":
        paths.append(Path(sys.base_prefix).resolve())
    out: list[Bind] = []
    for p in dict.fromkeys(paths):
        if not any(p.is_relative_to(q) for q in paths if q != p):
            out.append(Bind(str(p), str(p)))
    return out


def _ancestors(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc")

# The command is one argv string of bash -c: the kernel takes at most MAX_ARG_STRLEN
# (32 pages, 128 KiB) per argument, its terminating NUL included, and an argument cannot
# hold a NUL byte at all. Past either the exec fails (E2BIG, ValueError): checked first.
MAX_COMMAND_BYTES = 128 * 1024 - 1


def command_problem(command: str) -> str | None:
    """Why ``command`` cannot be run, in words for the caller; None when it can."""
    if "\x00" in command:
        return f"command contains a NUL byte (at character {command.index(chr(0))}); a shell command cannot carry one"
    size = len(command.encode("utf-8", "surrogatepass"))
    if size > MAX_COMMAND_BYTES:
        return (f"command is {size} bytes, over the {MAX_COMMAND_BYTES}-byte limit of one exec argument; "
                "write long content to a file first")
    return None


# Mounted by bwrap itself in every sandbox, never taken from an image.
_OWN_MOUNTS = frozenset({"proc", "dev", "tmp"})
# Where the host's setpriv (and the loader and libraries it needs) sit in an image root.
HOST_TOOLS = "/.rollway"


def _root_entries(rootfs: str) -> list[str]:
    """An image root as ``/``: each top-level entry of the unpacked root bound read-only
    (symlinks recreated as they are: a link resolves inside the sandbox, never on the
    host), so new mount points (/grader, a workdir the image lacks) can still be made in
    bwrap's own root, which is remounted read-only at the end."""
    argv: list[str] = []
    for name in sorted(os.listdir(rootfs)):
        if name in _OWN_MOUNTS:
            continue
        path = os.path.join(rootfs, name)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            argv += ["--symlink", os.readlink(path), "/" + name]
        elif stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
            argv += ["--ro-bind", path, "/" + name]
    return argv


@functools.cache
def host_setpriv() -> tuple[list[Bind], list[str]]:
    """The host's setpriv for an image root: its binary, dynamic loader and libraries bound
    under /.rollway, and the argv prefix that runs it through that loader. The uid switch
    runs before any code of the image, so an image's own (possibly hostile) setpriv is
    never trusted with the sandbox's root privileges."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("setpriv (util-linux) is not installed; it drops root inside the sandbox")
    out = subprocess.run(["ldd", setpriv], capture_output=True, text=True, check=True).stdout
    binds = [Bind(os.path.realpath(setpriv), f"{HOST_TOOLS}/setpriv")]
    loader = ""
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            binds.append(Bind(os.path.realpath(parts[2]), f"{HOST_TOOLS}/lib/{parts[0]}"))
        elif parts and parts[0].startswith("/") and "ld-" in parts[0]:
            loader = parts[0]
    if not loader:
        raise RuntimeError(f"cannot find the dynamic loader of {setpriv} in ldd's answer: {out!r}")
    binds.append(Bind(os.path.realpath(loader), f"{HOST_TOOLS}/ld.so"))
    prefix = [f"{HOST_TOOLS}/ld.so", "--library-path", f"{HOST_TOOLS}/lib", f"{HOST_TOOLS}/setpriv"]
    return binds, prefix


def bwrap_argv(
    command: str,
    *,
    workspace: str,
    uid: int,
    limits: Limits,
    binds: list[Bind],
    privileged: bool,
    env: dict[str, str],
    hostname: str = "sandbox",
    seccomp_fd: int | None = None,
    tmp_source: str | None = None,
    rootfs: str | None = None,
    workdir: str = WORKSPACE,
    shell: str = "/bin/bash",
    command_fd: int | None = None,
) -> list[str]:
    """The full argv: ``bwrap <namespaces, mounts, env> -- [setpriv ...] bash -c command``.

    ``rootfs``: an unpacked image (sandbox/images.py) is ``/`` instead of the host's
    system folders; the caller's ``binds`` then hold no host Python. ``workspace`` is
    bound read-write at ``workdir``.

    ``command_fd`` (``command`` empty): the sandbox is started before its command is
    known, and its shell waits for the command on that inherited pipe (see
    :func:`command_reader`)."""
    if command_fd is not None:
        if command:
            raise ValueError("bwrap_argv: give either a command or a command_fd, not both")
        command, env = command_reader(shell, command_fd, env)
    else:
        problem = command_problem(command)
        if problem:
            raise ValueError(problem)
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise RuntimeError("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    argv = [bwrap]
    setpriv_prefix: list[str] = []
    after_drop: list[str] = []
    if rootfs is not None:
        argv += _root_entries(rootfs)
        top = {"/" + n for n in os.listdir(rootfs)}
        if privileged:
            tool_binds, setpriv_prefix = host_setpriv()
            binds = [*tool_binds, *binds]
            env, after_drop = _split_loader_env(env, rootfs)
    else:
        top = set(SYSTEM_DIRS)
        for d in SYSTEM_DIRS:
            if os.path.lexists(d):
                if os.path.islink(d):
                    argv += ["--symlink", os.readlink(d), d]
                else:
                    argv += ["--ro-bind", d, d]
    # /tmp first: binds below may live under it (a checkout in /tmp has its .venv there),
    # and a tmpfs mounted after them would hide them.
    argv += ["--proc", "/proc", "--dev", "/dev"]
    # bwrap's /dev/shm is a root-owned 0755 folder: POSIX semaphores and shared memory
    # (multiprocessing.Pool, Lock, Queue) need a writable one, capped like /tmp.
    argv += ["--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/dev/shm"]
    if tmp_source is not None:
        # A size-limited tmpfs the service mounted (sandbox/quota.py): it can tell
        # afterwards whether the command filled it.
        argv += ["--bind", tmp_source, "/tmp"]
    else:
        argv += ["--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
    # Create parent dirs 0755 (bwrap would make them 0700, unreadable to the sandbox uid).
    made: set[str] = top | {"/", "/tmp", "/proc", "/dev"}
    for target in [workdir, *(b.target for b in binds)]:
        for parent in _ancestors(target):
            if parent not in made:
                made.add(parent)
                argv += ["--perms", "0755", "--dir", parent]
    argv += ["--bind", workspace, workdir]
    for bind in binds:
        argv += ["--bind" if bind.writable else "--ro-bind", bind.source, bind.target]
    if rootfs is not None:
        # bwrap's own root (where new mount points were made) becomes read-only too.
        argv += ["--remount-ro", "/"]
    argv += [
        "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", hostname,
        "--die-with-parent",
        "--new-session",
        "--chdir", workdir,
        "--clearenv",
    ]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if privileged:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP", "--"]
        if not setpriv_prefix:
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                raise RuntimeError("setpriv (util-linux) is not installed; it drops root inside the sandbox")
            setpriv_prefix = [setpriv]
        argv += [
            *setpriv_prefix, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs",
        ]
    else:
        argv += ["--unshare-user", "--disable-userns", "--"]
    argv += [*after_drop, shell, "-c", command]
    return argv


def reads_commands(shell: str) -> bool:
    """Whether :func:`command_reader` works with this shell (it needs bash's ``$(<file)``)."""
    return os.path.basename(shell) == "bash"


def command_reader(shell: str, fd: int, env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The ``bash -c`` script of a sandbox started ahead of its command, and the env to
    start it with. It reads the whole command from pipe ``fd`` (the service writes it,
    then a ``.`` so that ``$(...)`` strips none of the command's trailing newlines, then
    closes the pipe), closes the pipe and ``exec``s ``shell -c COMMAND``: the command runs
    exactly as ``bash -c COMMAND`` does in a sandbox started for it (same argv, same env:
    bash's ``exec`` puts SHLVL back). No sandbox setting depends on the command, so
    starting early changes nothing of its isolation. ``BASH_ENV`` (an image may set it)
    is kept for the command's shell only, so its file is read once, as before."""
    if not reads_commands(shell):
        raise ValueError(f"{shell} cannot read its command from a pipe; only bash can")
    env = dict(env)
    bash_env = env.pop("BASH_ENV", None)
    prefix = f"export BASH_ENV={shlex.quote(bash_env)}; " if bash_env is not None else ""
    script = f'c=$(</dev/fd/{fd}) && {prefix}exec {shlex.quote(shell)} -c "${{c%.}}" {fd}<&-'
    return script, env


# Variables the dynamic loader (or glibc at start-up) acts on. An image's Env may set them
# for its own programs, but the host's setpriv runs privileged before the uid drop: there
# they would load the image's code as root (LD_PRELOAD, LD_AUDIT) or reach glibc's parsers
# (GLIBC_TUNABLES). They are set after the drop instead, through the image's env(1).
_LOADER_VARS = frozenset({"GCONV_PATH", "GLIBC_TUNABLES", "LOCPATH", "NLSPATH", "MALLOC_TRACE", "HOSTALIASES",
                          "RESOLV_HOST_CONF", "GETCONF_DIR"})


def _split_loader_env(env: dict[str, str], rootfs: str) -> tuple[dict[str, str], list[str]]:
    """(what bwrap may set, an argv prefix setting the rest after the uid drop)."""
    loader = {k: v for k, v in env.items() if k.startswith("LD_") or k in _LOADER_VARS}
    if not loader:
        return env, []
    from sandbox.image_unpack import resolve_in_root

    safe = {k: v for k, v in env.items() if k not in loader}
    found = resolve_in_root(Path(rootfs), "/usr/bin/env")
    if found is None or not found.is_file():
        return safe, []  # no env(1) in the image: the loader variables are left out
    return safe, ["/usr/bin/env", *(f"{k}={v}" for k, v in loader.items())]


# glibc gives each thread that mallocs an arena of its own, each reserving 64 MiB of
# address space (up to 8 per CPU), and RLIMIT_AS (Limits.memory_bytes) counts the
# reservation: 8 busy threads used up 512 MiB with almost nothing allocated ("can't start
# new thread", MemoryError in pytest formatting a failure). Two arenas: threads share.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "2"}


def sandbox_env(venv: str = "", extra: dict[str, str] | None = None) -> dict[str, str]:
    venv_bin = str(Path(venv or sys.prefix).resolve() / "bin")
    env = {
        "PATH": f"{venv_bin}:{SANDBOX_PATH}",
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONNOUSERSITE": "1",
        # Installed pytest plugins stay off (faster, and entry points in the workspace
        # cannot load a plugin); the grader passes the plugins it wants with -p.
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PIP_NO_INDEX": "1",
        **MALLOC_ENV,
    }
    if extra:
        env.update(extra)
    return env


IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def image_env(image_env: dict[str, str], extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a command in an image root: the image config's Env (its PATH,
    its interpreter's variables) under the same scrubbed basics as a host sandbox. Installed
    pytest plugins stay on: the image's test setup is the repository's own (the grader sets
    what it needs for its run)."""
    env = {"PATH": IMAGE_PATH, "LANG": "C.UTF-8", **image_env}
    env.update({
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "TERM": "dumb",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONNOUSERSITE": "1",
        "PIP_NO_INDEX": "1",
        **MALLOC_ENV,
    })
    if extra:
        env.update(extra)
    return env


def rlimit_argv(limits: Limits) -> list[str]:
    """``prlimit`` (util-linux) setting the command's rlimits on itself before it execs
    the rest of the argv (inherited by bwrap and everything below it). An exec prefix, not
    a ``preexec_fn``: a preexec function makes Python fork the whole service process
    (27 ms for a 500 MB one, against 0.7 ms with vfork) on every command."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise RuntimeError("prlimit (util-linux) is not installed; it sets the sandbox's resource limits")
    return [
        prlimit,
        f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
        f"--as={limits.memory_bytes}:{limits.memory_bytes}",
        f"--nproc={limits.max_processes}:{limits.max_processes}",
        f"--fsize={limits.max_file_bytes}:{limits.max_file_bytes}",
        f"--nofile={limits.max_open_files}:{limits.max_open_files}",
        "--core=0:0",
        "--",
    ]