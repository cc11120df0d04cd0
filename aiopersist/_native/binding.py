"""Thin binding over liburing: one function per C call, named after it.

Each function converts Python buffers to pointers, calls liburing, checks the return code
and raises [`CheckpointIOError`][aiopersist.CheckpointIOError] carrying the errno (liburing returns
``-errno``). Functions that hand a buffer to the kernel return a *keepalive* object: the
caller must hold it until the request's completion has been reaped, because the kernel
reads or writes that memory until then.

Import this module only when `aiopersist._native.has_liburing` is true.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._exceptions import BackendUnavailableError, io_error
from . import has_liburing, unavailable_reason

if not has_liburing:  # pragma: no cover - guarded by callers
    raise BackendUnavailableError(unavailable_reason or "liburing binding unavailable")

from ._liburing import ffi, lib

Buffer = Any  # anything exposing the buffer protocol (memoryview, mmap, bytearray, numpy, ...)

IORING_FSYNC_DATASYNC: int = lib.IORING_FSYNC_DATASYNC
AT_FDCWD: int = lib.AT_FDCWD
IOSQE_ASYNC: int = lib.IOSQE_ASYNC


def _check(ret: int, call: str, filename: str | None = None) -> int:
    if ret < 0:
        raise io_error(-ret, call, filename)
    return ret


@dataclass(eq=False)
class Ring:
    """An initialised ``struct io_uring`` plus the array ``io_uring_peek_batch_cqe`` fills."""

    ring: Any
    cqes: Any
    cqe_capacity: int
    entries: int
    closed: bool = False


def liburing_version() -> str:
    """The liburing version this module was compiled against."""
    return str(ffi.string(lib.AIOP_LIBURING_VERSION).decode())


def io_uring_queue_init(entries: int, flags: int = 0) -> Ring:
    ring = ffi.new("struct io_uring *")
    _check(lib.io_uring_queue_init(entries, ring, flags), "io_uring_queue_init")
    capacity = max(entries * 2, 16)
    return Ring(
        ring=ring, cqes=ffi.new("struct io_uring_cqe *[]", capacity), cqe_capacity=capacity, entries=entries
    )


def io_uring_queue_exit(ring: Ring) -> None:
    if not ring.closed:
        ring.closed = True
        lib.io_uring_queue_exit(ring.ring)


def io_uring_get_sqe(ring: Ring) -> Any | None:
    """The next free submission entry, or ``None`` when the submission queue is full."""
    sqe = lib.io_uring_get_sqe(ring.ring)
    return None if sqe == ffi.NULL else sqe


def io_uring_sqe_set_data64(sqe: Any, data: int) -> None:
    lib.io_uring_sqe_set_data64(sqe, data)


def io_uring_prep_nop(sqe: Any) -> None:
    lib.io_uring_prep_nop(sqe)


def io_uring_prep_write(sqe: Any, fd: int, buf: Buffer, offset: int) -> Any:
    ptr = ffi.from_buffer(buf)
    lib.io_uring_prep_write(sqe, fd, ptr, len(ptr), offset)
    return ptr


def release(keepalive: Any) -> None:
    """Give back now what a request kept for the kernel (the pointer that
    `io_uring_prep_write`/`io_uring_prep_read` return: a buffer export of the caller's
    memory), once the kernel is done with it, rather than when its last reference goes.
    Another thread may hold a reference for a moment (``gc.get_objects()`` in a training
    loop hunting leaks): the export then outlived the request, and releasing the caller's
    view raised ``BufferError`` (a save, load or verify failed, untyped). Anything else it
    may hold is left to its references."""
    if isinstance(keepalive, ffi.CData):
        ffi.release(keepalive)


def io_uring_prep_read(sqe: Any, fd: int, buf: Buffer, offset: int) -> Any:
    ptr = ffi.from_buffer(buf, require_writable=True)
    lib.io_uring_prep_read(sqe, fd, ptr, len(ptr), offset)
    return ptr


def io_uring_prep_fsync(sqe: Any, fd: int, *, datasync: bool = False) -> None:
    lib.io_uring_prep_fsync(sqe, fd, IORING_FSYNC_DATASYNC if datasync else 0)


def io_uring_prep_openat(sqe: Any, path: bytes, flags: int, mode: int, dirfd: int = AT_FDCWD) -> Any:
    cpath = ffi.new("char[]", path)
    lib.io_uring_prep_openat(sqe, dirfd, cpath, flags, mode)
    return cpath


def io_uring_prep_close(sqe: Any, fd: int) -> None:
    lib.io_uring_prep_close(sqe, fd)


def io_uring_submit(ring: Ring) -> int:
    """Submit prepared entries; returns how many the kernel took."""
    return _check(lib.io_uring_submit(ring.ring), "io_uring_submit")


def io_uring_peek_cqe(ring: Ring) -> tuple[int, int] | None:
    """``(user_data, res)`` of the next completion without consuming it, or ``None``."""
    ret = lib.io_uring_peek_cqe(ring.ring, ring.cqes)
    if ret == -11:  # EAGAIN: nothing completed yet
        return None
    _check(ret, "io_uring_peek_cqe")
    cqe = ring.cqes[0]
    return int(cqe.user_data), int(cqe.res)


def io_uring_wait_cqe(ring: Ring) -> tuple[int, int]:
    """Block until a completion is available; ``(user_data, res)``, not consumed."""
    _check(lib.io_uring_wait_cqe(ring.ring, ring.cqes), "io_uring_wait_cqe")
    cqe = ring.cqes[0]
    return int(cqe.user_data), int(cqe.res)


def io_uring_cqe_seen(ring: Ring) -> None:
    """Consume the completion last returned by peek/wait."""
    lib.io_uring_cqe_seen(ring.ring, ring.cqes[0])


def io_uring_peek_batch_cqe(ring: Ring) -> list[tuple[int, int]]:
    """Up to the ring's capacity of ``(user_data, res)`` pairs; consume them with
    `io_uring_cq_advance`."""
    n = lib.io_uring_peek_batch_cqe(ring.ring, ring.cqes, ring.cqe_capacity)
    cqes = ring.cqes
    return [(int(cqes[i].user_data), int(cqes[i].res)) for i in range(n)]


def io_uring_cq_advance(ring: Ring, nr: int) -> None:
    lib.io_uring_cq_advance(ring.ring, nr)


def io_uring_register_eventfd(ring: Ring, fd: int) -> None:
    _check(lib.io_uring_register_eventfd(ring.ring, fd), "io_uring_register_eventfd")


def io_uring_unregister_eventfd(ring: Ring) -> None:
    _check(lib.io_uring_unregister_eventfd(ring.ring), "io_uring_unregister_eventfd")


def statx_dioalign(path: str) -> tuple[int, int] | None:
    """``(mem_align, offset_align)`` from ``statx(STATX_DIOALIGN)``, or ``None`` when the
    kernel reports no direct-I/O alignment for this file."""
    out = ffi.new("struct aiop_dioalign *")
    ret = lib.aiop_statx_dioalign(AT_FDCWD, path.encode(), out)
    if ret == -95:  # EOPNOTSUPP: compiled without STATX_DIOALIGN
        return None
    _check(ret, "statx", path)
    if not out.supported:
        return None
    return int(out.mem_align), int(out.offset_align)


def io_uring_disabled_sysctl() -> int | None:
    """``/proc/sys/kernel/io_uring_disabled`` (0, 1 or 2), or ``None`` if the kernel has none."""
    value = int(lib.aiop_io_uring_disabled())
    return None if value < 0 else value
