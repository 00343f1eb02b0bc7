"""The sandbox's seccomp filter: a small classic-BPF program, assembled here, that denies the
kernel calls a test program never needs (envs/sandbox.py loads it through bubblewrap's
`--seccomp FD`, or with prctl in an unisolated run).

    program = deny_filter()          # bytes: struct sock_filter[] for this machine's architecture
    DENIED                           # the names it refuses with EPERM

What it refuses, with EPERM (so a program sees an ordinary OSError):

- new namespaces and entering others: `unshare`, `setns`, and `clone` with any CLONE_NEW* flag
  (`clone3`, whose flags the filter cannot read, gets ENOSYS, and the C library falls back to
  `clone`);
- memory the address-space limit does not count: `memfd_create`, `memfd_secret`, System V
  shared memory, semaphores and message queues, POSIX message queues, `userfaultfd`;
- mounting and the new mount API, `chroot`, `pivot_root`;
- looking into or changing other processes and the kernel: `ptrace`, `process_vm_readv/writev`,
  `pidfd_getfd`, `kcmp`, `bpf`, `perf_event_open`, `io_uring_*`, the key-ring calls, `syslog`,
  `fanotify_init`, file handles (`open_by_handle_at`), modules, `kexec`, `reboot`, swap, `acct`,
  clock setting, `quotactl`, `vhangup`, and on x86-64 `iopl`, `ioperm`, `modify_ldt`, `uselib`
  and every x32 call.

A call from another architecture than the filter's kills the process. Architectures: x86-64 and
aarch64; elsewhere `deny_filter` raises `SeccompUnsupported` (the sandbox then refuses to run,
saying so, unless unisolated runs are allowed).
"""

from __future__ import annotations

import errno
import platform
import struct

# Classic BPF opcodes (linux/filter.h) and seccomp's return values (linux/seccomp.h).
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6];
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # args[0]'s low 32 bits on a little-endian machine

# CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

# Syscall numbers: x86-64's (asm/unistd_64.h), and aarch64's (asm-generic/unistd.h).
_CALLS: dict[str, tuple[int | None, int]] = {
    "unshare": (272, 97), "setns": (308, 268),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "memfd_create": (319, 279), "memfd_secret": (447, 447), "userfaultfd": (323, 282),
    "shmget": (29, 194), "shmat": (30, 196), "semget": (64, 190), "msgget": (68, 186), "mq_open": (240, 180),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438), "kcmp": (312, 272),
    "bpf": (321, 280), "perf_event_open": (298, 241),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "syslog": (103, 116), "fanotify_init": (300, 262),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264), "lookup_dcookie": (212, 18),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "reboot": (169, 142),
    "swapon": (167, 224), "swapoff": (168, 225), "acct": (163, 89),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "adjtimex": (159, 171), "clock_adjtime": (305, 266),
    "quotactl": (179, 60), "vhangup": (153, 58),
    "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None), "uselib": (134, None),
}
_CLONE = (56, 220)
_CLONE3 = (435, 435)
_X32_BIT = 0x40000000

# AUDIT_ARCH_* (linux/audit.h) and the column of _CALLS for each machine.
_ARCHES = {"x86_64": (0xC000003E, 0), "amd64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1), "arm64": (0xC00000B7, 1)}

DENIED = (*sorted(_CALLS), "clone with CLONE_NEW*", "clone3 (ENOSYS)")


class SeccompUnsupported(RuntimeError):
    """No filter for this machine's architecture."""


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def deny_filter(machine: str | None = None) -> bytes:
    """The filter's BPF program (struct sock_filter[], native byte order: little-endian on both
    supported machines) for `machine` (platform.machine() by default)."""
    machine = (machine or platform.machine()).lower()
    if machine not in _ARCHES:
        raise SeccompUnsupported(f"no seccomp filter for the {machine} architecture (x86-64 and aarch64 only)")
    arch, column = _ARCHES[machine]
    denied = sorted({numbers[column] for numbers in _CALLS.values() if numbers[column] is not None})
    x32 = column == 0
    # [0] load arch, [1] arch matches: skip the kill, [2] kill, [3] load the call's number,
    # then one jump per check, then allow, EPERM, ENOSYS, and clone's flag test. A jump's
    # offset counts from the instruction after it.
    first_check = 4
    allow_at = first_check + int(x32) + len(denied) + 2
    eperm_at, enosys_at, flags_at = allow_at + 1, allow_at + 2, allow_at + 3
    program = [_op(_LD_W_ABS, _ARCH), _op(_JEQ, arch, 1, 0), _op(_RET, _KILL_PROCESS), _op(_LD_W_ABS, _NR)]

    def jump_if(code: int, k: int, target: int) -> None:
        program.append(_op(code, k, target - len(program) - 1, 0))

    if x32:
        jump_if(_JGE, _X32_BIT, eperm_at)
    for number in denied:
        jump_if(_JEQ, number, eperm_at)
    jump_if(_JEQ, _CLONE[column], flags_at)
    jump_if(_JEQ, _CLONE3[column], enosys_at)
    assert len(program) == allow_at
    program += [_op(_RET, _ALLOW), _op(_RET, _ERRNO | errno.EPERM), _op(_RET, _ERRNO | errno.ENOSYS)]
    # clone: args[0] holds the flags on both machines
    program += [_op(_LD_W_ABS, _ARG0_LOW), _op(_JSET, CLONE_NEW_FLAGS, 1, 0), _op(_RET, _ALLOW),
                _op(_RET, _ERRNO | errno.EPERM)]
    if eperm_at - first_check - 1 > 255:  # a jump's offset is one byte
        raise AssertionError("seccomp filter too long for one-byte jumps")
    return b"".join(program)
