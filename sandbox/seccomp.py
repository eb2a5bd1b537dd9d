"""The seccomp filter of every sandboxed command: syscalls sandboxed code has no business with.

bubblewrap loads it (``--seccomp FD``: a compiled classic-BPF program read from a file
descriptor) just before it executes the command, after its own setup, so the filter
binds the command and everything it starts, and cannot be removed (seccomp filters are
inherited and only ever added to). Built here in plain Python (the program is a few
dozen instructions), so no libseccomp binding is needed.

Refused with EPERM (as Flatpak does):

- namespaces: ``unshare`` and ``setns`` (any flags), ``clone`` with any CLONE_NEW* flag
  (a nested user namespace is the entry point of many kernel exploits; plain fork and
  threads still work); ``clone3`` answers ENOSYS, because its flags sit in a struct a
  filter cannot read, and glibc then falls back to ``clone``;
- mounts: ``mount``, ``umount2``, ``pivot_root`` and the new mount API (``fsopen``,
  ``fsconfig``, ``fsmount``, ``move_mount``, ``open_tree``, ``mount_setattr``);
- tracing and other processes' memory: ``ptrace``, ``process_vm_readv``, ``process_vm_writev``;
- kernel interfaces: ``bpf``, ``perf_event_open``, ``userfaultfd``, ``keyctl``, ``add_key``,
  ``request_key``, ``kexec_load``, ``kexec_file_load``, module loading, ``open_by_handle_at``,
  ``swapon``/``swapoff``, ``reboot``, ``acct``, ``quotactl``, ``syslog``, ``iopl``/``ioperm``;
- any other ABI than the host's (i386 ``int 0x80`` or x32 calls on x86_64).
"""

from __future__ import annotations

import errno
import os
import platform
import struct

# struct sock_filter and seccomp_data (linux/filter.h, linux/seccomp.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16
_X32_BIT = 0x40000000

CLONE_NEW_FLAGS = {
    "CLONE_NEWTIME": 0x00000080, "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000,
}
_NS_MASK = sum(CLONE_NEW_FLAGS.values())

# From the kernel's uapi headers (asm/unistd_64.h, asm-generic/unistd.h): one row a
# syscall, its number on (x86_64, aarch64); None where the architecture has no such call.
ARCHES = ("x86_64", "aarch64")
_AUDIT_ARCH = (0xC000003E, 0xC00000B7)
_NUMBERS: dict[str, tuple[int, int | None]] = {
    "clone": (56, 220), "clone3": (435, 435), "unshare": (272, 97), "setns": (308, 268),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "move_mount": (429, 429),
    "open_tree": (428, 428), "mount_setattr": (442, 442), "ptrace": (101, 117),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "keyctl": (250, 219),
    "add_key": (248, 217), "request_key": (249, 218), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "open_by_handle_at": (304, 265), "swapon": (167, 224),
    "swapoff": (168, 225), "reboot": (169, 142), "acct": (163, 89), "quotactl": (179, 60),
    "syslog": (103, 116), "iopl": (172, None), "ioperm": (173, None),
}
SYSCALLS = {
    arch: {"audit_arch": _AUDIT_ARCH[i], **{n: nums[i] for n, nums in _NUMBERS.items() if nums[i] is not None}}
    for i, arch in enumerate(ARCHES)
}

# Refused whatever their arguments (clone is refused by flags, clone3 with ENOSYS).
DENIED = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "move_mount",
    "open_tree", "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev", "bpf",
    "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "open_by_handle_at", "swapon", "swapoff", "reboot",
    "acct", "quotactl", "syslog", "iopl", "ioperm",
)


def _insn(code: int, jt: int = 0, jf: int = 0, k: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def build_filter(machine: str | None = None, deny_errno: int = errno.EPERM) -> bytes:
    """The compiled program for ``machine`` (default: this host), as bwrap reads it."""
    machine = machine or platform.machine()
    table = SYSCALLS.get(machine)
    if table is None:
        raise RuntimeError(f"no seccomp syscall table for {machine!r}; known: {', '.join(SYSCALLS)}")
    deny = _RET_ERRNO | deny_errno
    prog = [
        _insn(_LD_W_ABS, k=_OFF_ARCH),
        _insn(_JEQ_K, 1, 0, table["audit_arch"]),
        _insn(_RET_K, k=deny),  # a foreign ABI (i386 on x86_64): nothing legitimate here uses it
        _insn(_LD_W_ABS, k=_OFF_NR),
    ]
    if machine == "x86_64":
        prog += [_insn(_JGE_K, 0, 1, _X32_BIT), _insn(_RET_K, k=deny)]
    for name in DENIED:
        if name in table:
            prog += [_insn(_JEQ_K, 0, 1, table[name]), _insn(_RET_K, k=deny)]
    prog += [_insn(_JEQ_K, 0, 1, table["clone3"]), _insn(_RET_K, k=_RET_ERRNO | errno.ENOSYS)]
    # clone: look at the flags (first argument, low 32 bits); the last check, as it
    # replaces the loaded syscall number.
    prog += [
        _insn(_JEQ_K, 0, 3, table["clone"]),
        _insn(_LD_W_ABS, k=_OFF_ARG0),
        _insn(_JSET_K, 0, 1, _NS_MASK),
        _insn(_RET_K, k=deny),
        _insn(_RET_K, k=_RET_ALLOW),
    ]
    return b"".join(prog)


_PROGRAM: bytes | None = None


def filter_fd() -> int:
    """A pipe's read end holding the program (bwrap reads it to EOF); the caller passes
    it to bwrap and closes it after the spawn."""
    global _PROGRAM
    if _PROGRAM is None:
        _PROGRAM = build_filter()
    r, w = os.pipe()
    try:
        # A few hundred bytes: far below the pipe buffer, so this never blocks.
        os.write(w, _PROGRAM)
    finally:
        os.close(w)
    return r
