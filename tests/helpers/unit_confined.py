"""unit_confined.py UNIT -- CMD...: runs CMD under the system-call
confinement that systemd (252, Debian 12) gives the service of UNIT, for
tests/python/test_unit_confined.py on a machine whose PID 1 is not systemd.

Emulated, from the unit's own lines: NoNewPrivileges=, SystemCallFilter=
(in order: an allow list, then ~deny lists and further allow lists; named
sets resolved by `systemd-analyze syscall-filter`; @default always allowed,
as systemd does), SystemCallErrorNumber= (what a refused call returns),
SystemCallArchitectures=native and RestrictAddressFamilies= (socket()'s
family).  A classic-BPF seccomp filter is built here, installed with prctl
and checked (a refused call and a refused family must fail as the unit says)
before exec; it is inherited by everything CMD starts.  Not emulated (the
test says so): the mount namespace (ProtectSystem=, PrivateTmp=,
ProtectHome=), PrivateUsers=, PrivateNetwork=, capabilities and
LockPersonality=.  Prints one line to stderr saying what it installed."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import socket
import subprocess
import sys

AUDIT_ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
UNISTD = "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"


def syscall_numbers() -> dict[str, int]:
    with open(UNISTD) as f:
        return {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", f.read())}


def resolve(item: str, seen: set[str] | None = None) -> set[str]:
    """The system calls a name or @set stands for (sets through systemd-analyze)."""
    if not item.startswith("@"):
        return {item}
    seen = seen if seen is not None else set()
    if item in seen:
        return set()
    seen.add(item)
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager", item],
                         check=True, capture_output=True, text=True).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        word = line.strip()
        if word and not word.startswith("#"):
            names |= resolve(word, seen)
    return names


def unit_settings(path: str) -> dict[str, list[str]]:
    """Every Key=value of the [Service] section, values in order."""
    settings: dict[str, list[str]] = {}
    section = ""
    with open(path) as f:
        for raw in f:
            line = raw.strip()
            if line.startswith("["):
                section = line
            elif section == "[Service]" and "=" in line and not line.startswith("#"):
                key, value = line.split("=", 1)
                settings.setdefault(key, []).append(value)
    return settings


def allowed_calls(filters: list[str]) -> set[str]:
    """SystemCallFilter= lines as systemd applies them (allow-list mode)."""
    allowed = resolve("@default")
    for line in filters:
        deny = line.startswith("~")
        names: set[str] = set()
        for item in line.lstrip("~").split():
            names |= resolve(item)
        allowed = allowed - names if deny else allowed | names
    return allowed


def program(allowed: list[int], refused: int, families: list[int]) -> list[tuple[int, int, int, int]]:
    """arch check, x32 refused, socket()'s family, then one jeq per allowed call."""
    deny = (RET_K, 0, 0, RET_ERRNO | refused)
    prog = [(LD_W_ABS, 0, 0, 4), (JEQ_K, 1, 0, AUDIT_ARCH_X86_64), deny,
            (LD_W_ABS, 0, 0, 0), (JGE_K, 0, 1, X32_BIT), deny]
    if families:
        # socket(): its family must be listed (EAFNOSUPPORT, as systemd)
        n = len(families)
        prog += [(JEQ_K, 0, n + 3, socket_nr()), (LD_W_ABS, 0, 0, 16)]
        prog += [(JEQ_K, n - i, 0, fam) for i, fam in enumerate(families)]
        prog += [(RET_K, 0, 0, RET_ERRNO | errno.EAFNOSUPPORT), (RET_K, 0, 0, RET_ALLOW)]
        prog += [(LD_W_ABS, 0, 0, 0)]
    for nr in allowed:
        prog += [(JEQ_K, 0, 1, nr), (RET_K, 0, 0, RET_ALLOW)]
    return prog + [deny]


def socket_nr() -> int:
    return syscall_numbers()["socket"]


def install(prog: list[tuple[int, int, int, int]]) -> None:
    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    libc = ctypes.CDLL(None, use_errno=True)
    table = (Filter * len(prog))(*[Filter(*ins) for ins in prog])
    fprog = Prog(len(prog), table)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def check(refused: int) -> str:
    """The filter is on: a call the unit refuses and a family it does not list."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(syscall_numbers()["swapoff"], b"/nonexistent") != -1 or \
            ctypes.get_errno() != refused:
        raise SystemExit(f"unit_confined: swapoff was not refused with errno {refused}")
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    except OSError as exc:
        if exc.errno != errno.EAFNOSUPPORT:
            raise
    else:
        raise SystemExit("unit_confined: socket(AF_INET) was not refused")
    return f"swapoff -> {errno.errorcode[refused]}, socket(AF_INET) -> EAFNOSUPPORT"


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        raise SystemExit(__doc__.splitlines()[0])
    s = unit_settings(argv[1])
    if s.get("NoNewPrivileges") != ["yes"] or s.get("SystemCallArchitectures") != ["native"]:
        raise SystemExit("unit_confined: the unit does not set what this emulates")
    numbers = syscall_numbers()
    names = allowed_calls(s.get("SystemCallFilter", []))
    allowed = sorted({numbers[n] for n in names if n in numbers})
    refused = getattr(errno, s.get("SystemCallErrorNumber", ["EPERM"])[-1])
    families = [getattr(socket, f) for line in s.get("RestrictAddressFamilies", [])
                for f in line.split()]
    install(program(allowed, refused, families))
    print(f"unit_confined: {argv[1]}: {len(allowed)} system calls allowed, the rest "
          f"{errno.errorcode[refused]}; {check(refused)}", file=sys.stderr, flush=True)
    os.execv(argv[3], argv[3:])


if __name__ == "__main__":
    main(sys.argv)
