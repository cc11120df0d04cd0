"""Run a command in which the kernel's ``io_uring_setup`` fails with a given errno.

``python tests/_deny_io_uring.py ERRNO COMMAND...`` installs a seccomp filter on itself (it
is inherited across ``execve`` and by children, and by nothing else on the machine), then
execs COMMAND. Every other system call is allowed. Exit status 77: seccomp is unavailable.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

IO_URING_SETUP = 425  # the same number on every architecture since Linux 5.1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
BPF_LD_W_ABS = 0x20  # load the 32-bit word at an offset of struct seccomp_data (0: the call number)
BPF_JEQ_K = 0x15
BPF_RET_K = 0x06


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def deny(err: int) -> None:
    program = (
        _insn(BPF_LD_W_ABS, 0, 0, 0)
        + _insn(BPF_JEQ_K, 0, 1, IO_URING_SETUP)
        + _insn(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | err)
        + _insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW)
    )
    code = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(code, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or (
        libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0
    ):
        print(f"seccomp unavailable: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        sys.exit(77)


if __name__ == "__main__":
    deny(int(sys.argv[1]))
    os.execv(sys.argv[2], sys.argv[2:])
