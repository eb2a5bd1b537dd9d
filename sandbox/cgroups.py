"""Per-command cgroups: one limit on processes and memory for a command's whole tree.

Rlimits are per process (RLIMIT_AS) or per uid (RLIMIT_NPROC); a cgroup bounds the
tree as a whole, so 64 processes of 500 MB each cannot add up to 32 GB. Used when this
process may create cgroups (root with cgroup v1 ``pids``/``memory`` hierarchies, or a
delegated cgroup v2 subtree); otherwise the rlimits alone apply.

Layout: ``<controller mount>/<our own cgroup>/rollway-sandbox-<pid>-<n>/<command name>``
(``n`` numbers the managers of one process: two sandbox services in one process, as in
tests, must not share a parent that the first to close would remove).
The command's first process joins the group itself (``join`` in the child before exec),
so nothing it forks can start outside the group.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


class CgroupUnavailable(RuntimeError):
    """This process cannot create cgroups with the controllers we need."""


class CgroupJoinFailed(RuntimeError):
    """A command's first process could not join its cgroup, so nothing of the command ran:
    the infrastructure's failure (HTTP 503), never the command's exit status (a grading
    would score it 0)."""


def _own_cgroups() -> dict[str, str]:
    """controller -> path of this process's cgroup ('' key: the v2 unified path)."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out


def _mounts() -> dict[str, tuple[str, str]]:
    """controller -> (mount point, root inside the hierarchy) of its cgroup mount ('' key:
    the v2 unified mount)."""
    out: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, _, tail = line.partition(" - ")
        fstype, _source, options = (tail.split(" ") + ["", ""])[:3]
        fields = head.split(" ")
        mount = (fields[4], fields[3])
        if fstype == "cgroup2":
            out.setdefault("", mount)
        elif fstype == "cgroup":
            for opt in options.split(","):
                if opt in ("pids", "memory"):
                    out[opt] = mount
    return out


def _cgroup_dir(mount: tuple[str, str], own: str) -> Path:
    """This process's cgroup directory in a mounted hierarchy. A container's cgroup mount
    may show only a subtree (Docker without a cgroup namespace: root ``/docker/<id>``,
    the very path /proc/self/cgroup names), so the mount's root is stripped first."""
    mount_point, root = mount
    if root != "/" and (own == root or own.startswith(root + "/")):
        own = own[len(root):]
    return Path(mount_point) / own.lstrip("/")


class CommandCgroup:
    """The cgroup directories of one running command (one per controller on v1)."""

    def __init__(self, dirs: dict[str, Path], version: int) -> None:
        self.dirs = dirs
        self.version = version

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    def never_entered(self) -> list[str]:
        """The group's directories that no process ever ran in, by the kernel's own
        accounting (v2: ``cpu.stat`` usage_usec; v1: the memory group's peak usage; the
        v1 pids group keeps no history): after a join failed, at least one. A command
        cannot fake this: once joined, its own run is accounted. A directory gone counts
        as never entered."""
        if self.version == 2:
            d = self.dirs["pids"]
            return [] if _event_count(d / "cpu.stat", "usage_usec") > 0 else [str(d)]
        mem = self.dirs["memory"]
        try:
            peak = int((mem / "memory.max_usage_in_bytes").read_text())
        except (OSError, ValueError):
            peak = 0
        return [] if peak > 0 else [str(mem)]

    def limits_hit(self) -> list[str]:
        """Which limits the tree ran into: 'processes', 'memory'."""
        hit = []
        pids = self.dirs.get("pids")
        if pids is not None and _event_count(pids / "pids.events", "max") > 0:
            hit.append("processes")
        mem = self.dirs.get("memory")
        if mem is not None:
            if self.version == 1:
                # failcnt also counts page-cache reclaim at the limit; only an OOM kill
                # means the command did not fit.
                if _event_count(mem / "memory.oom_control", "oom_kill") > 0:
                    hit.append("memory")
            elif _event_count(mem / "memory.events", "oom_kill") > 0:
                hit.append("memory")
        return hit

    def kill_all(self) -> None:
        """SIGKILL whatever is still in the group (the pid namespace normally did already)."""
        for procs in self.procs_files():
            for pid in _read_pids(procs):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass

    def remove(self, wait_s: float = 2.0) -> None:
        deadline = time.monotonic() + wait_s
        for d in dict.fromkeys(self.dirs.values()):
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    # Busy: the last processes are still exiting.
                    if time.monotonic() > deadline:
                        log.warning("cgroup_not_removed", path=str(d))
                        break
                    self.kill_all()
                    time.sleep(0.02)


_manager_numbers = itertools.count()


class CgroupManager:
    """Creates a cgroup per command below this process's own cgroup."""

    def __init__(self, *, max_processes: int, memory_bytes: int) -> None:
        self.max_processes = max_processes
        self.memory_bytes = memory_bytes
        own, mounts = _own_cgroups(), _mounts()
        name = f"rollway-sandbox-{os.getpid()}-{next(_manager_numbers)}"
        self.parents: dict[str, Path] = {}
        if "pids" in mounts and "memory" in mounts and "pids" in own and "memory" in own:
            self.version = 1
            for ctl in ("pids", "memory"):
                self.parents[ctl] = _cgroup_dir(mounts[ctl], own[ctl]) / name
        elif "" in mounts and "" in own:
            self.version = 2
            base = _cgroup_dir(mounts[""], own[""])
            available = (base / "cgroup.controllers").read_text().split() if (base / "cgroup.controllers").exists() else []
            if not {"pids", "memory"} <= set(available):
                raise CgroupUnavailable(f"cgroup v2 at {base} lacks pids/memory controllers (has {available})")
            self.parents = {"pids": base / name, "memory": base / name}
        else:
            raise CgroupUnavailable("no cgroup v1 pids+memory hierarchies and no cgroup v2 mount")
        for parent in dict.fromkeys(self.parents.values()):
            _remove_stale_siblings(parent.parent)
        try:
            for parent in dict.fromkeys(self.parents.values()):
                parent.mkdir(exist_ok=True)
            if self.version == 2:
                (self.parents["pids"] / "cgroup.subtree_control").write_text("+pids +memory")
        except OSError as exc:
            self.close()
            raise CgroupUnavailable(f"cannot create cgroups under {list(self.parents.values())}: {exc}") from exc
        self._counter = 0
        log.info("cgroups_enabled", version=self.version, parents=[str(p) for p in self.parents.values()])

    def create(self, label: str, *, max_processes: int | None = None, memory_bytes: int | None = None) -> CommandCgroup:
        self._counter += 1
        leaf = f"{label}-{self._counter}"
        dirs = {ctl: parent / leaf for ctl, parent in self.parents.items()}
        for d in dict.fromkeys(dirs.values()):
            d.mkdir()
        group = CommandCgroup(dirs, self.version)
        try:
            (dirs["pids"] / "pids.max").write_text(str(max_processes or self.max_processes))
            mem = str(memory_bytes or self.memory_bytes)
            if self.version == 1:
                (dirs["memory"] / "memory.limit_in_bytes").write_text(mem)
                swap = dirs["memory"] / "memory.memsw.limit_in_bytes"
                if swap.exists():
                    swap.write_text(mem)
            else:
                (dirs["memory"] / "memory.max").write_text(mem)
                swap = dirs["memory"] / "memory.swap.max"
                if swap.exists():
                    swap.write_text("0")
        except OSError:
            group.remove()
            raise
        return group

    def close(self) -> None:
        for parent in dict.fromkeys(self.parents.values()):
            try:
                parent.rmdir()
            except OSError:
                pass


def make_cgroup_manager(mode: str, *, max_processes: int, memory_bytes: int) -> CgroupManager | None:
    if mode == "off":
        return None
    try:
        return CgroupManager(max_processes=max_processes, memory_bytes=memory_bytes)
    except (CgroupUnavailable, OSError) as exc:
        if mode == "required":
            raise CgroupUnavailable(f"sandbox.cgroups = required but: {exc}") from exc
        log.warning("cgroups_unavailable", error=str(exc), fallback="rlimits and per-session uid only")
        return None


def _event_count(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _read_pids(path: str) -> list[int]:
    try:
        return [int(x) for x in Path(path).read_text().split()]
    except (OSError, ValueError):
        return []


def _remove_stale_siblings(base: Path) -> None:
    """Remove the (empty) groups a crashed earlier service left: rollway-sandbox-<dead pid>[-<n>]."""
    for stale in base.glob("rollway-sandbox-*"):
        try:
            pid = int(stale.name.split("-")[2])
            os.kill(pid, 0)
            continue  # that service still runs
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        for leaf in [d for d in stale.iterdir() if d.is_dir()] + [stale]:
            try:
                leaf.rmdir()
            except OSError:
                pass
