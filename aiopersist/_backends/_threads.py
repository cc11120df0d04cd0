"""The ``threads`` backend: positional reads and writes in a bounded pool of worker threads.

The fallback where io_uring is unavailable. ``os.pwrite``/``os.preadv`` release the GIL, so
``queue_depth`` threads keep that many requests in flight, like the ring does.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable
from typing import TypeVar

from .._exceptions import CheckpointIOError, from_os_error, io_error
from .._workers import DaemonThreadPool
from ._base import Buffer, IOBackend, to_thread_to_the_end, wait_uncancellable

T = TypeVar("T")


def _positional(
    op: Callable[[int, memoryview, int], int],
    call: str,
    fd: int,
    buf: Buffer,
    offset: int,
    name: str | None,
    *,
    reading: bool,
) -> int:
    """Repeat a positional read or write until ``buf`` is done; a read stops at end of file."""
    # Views are released on the way out, errors included: a traceback that kept one
    # alive would pin the caller's buffer (an mmap could not be unmapped).
    with memoryview(buf) as raw, raw.cast("B") as view:
        total = len(view)
        done = 0
        while done < total:
            try:
                with view[done:] as part:
                    n = op(fd, part, offset + done)
            except BlockingIOError:  # EAGAIN; EINTR is retried by Python itself (PEP 475)
                continue
            except OSError as exc:
                raise from_os_error(exc, call, name) from exc
            if n == 0:
                if reading:
                    break  # end of file
                raise io_error(errno.EIO, f"{call} (no progress)", name)
            done += n
        return done


def _preadv(fd: int, part: memoryview, offset: int) -> int:
    return os.preadv(fd, [part], offset)


def _pwrite_all(fd: int, buf: Buffer, offset: int, name: str | None) -> int:
    return _positional(os.pwrite, "pwrite", fd, buf, offset, name, reading=False)


def _pread_full(fd: int, buf: Buffer, offset: int, name: str | None) -> int:
    return _positional(_preadv, "preadv", fd, buf, offset, name, reading=True)


class ThreadsBackend(IOBackend):
    """Blocking system calls in ``queue_depth`` worker threads."""

    name = "threads"

    def __init__(self, queue_depth: int) -> None:
        super().__init__(queue_depth)
        # Daemon workers: one stuck in a system call never holds a crashed process open.
        self._executor = DaemonThreadPool(queue_depth, thread_name_prefix="aiopersist-io")
        self._slots = asyncio.Semaphore(queue_depth)
        self._in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("an aiopersist backend belongs to the event loop it was first used on")
        return loop

    def _release(self) -> None:
        self._in_flight -= 1
        self._slots.release()

    async def _run(
        self, fn: Callable[..., T], *args: object, discard: Callable[[T], object] | None = None
    ) -> T:
        self._check_open()
        loop = self._bind_loop()
        await self._slots.acquire()
        if self._closed:  # closed while this request waited for its turn
            self._slots.release()
            self._check_open()
        self._in_flight += 1
        try:
            cfut = self._executor.submit(fn, *args)
        except BaseException:
            self._release()
            raise
        # The slot is given back when the thread is done, not when the awaiter wakes: a
        # cancelled awaiter must not let a new request start while this one still runs.
        cfut.add_done_callback(lambda _f: loop.call_soon_threadsafe(self._release))
        return await wait_uncancellable(asyncio.wrap_future(cfut, loop=loop), discard)

    async def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
        name = os.fspath(path)

        def _open() -> int:
            try:
                return os.open(name, flags | os.O_CLOEXEC, mode)
            except OSError as exc:
                raise from_os_error(exc, "open", name) from exc

        fd = await self._run(_open, discard=os.close)
        self._names[fd] = name
        return fd

    async def close(self, fd: int) -> None:
        name = self._names.pop(fd, None)

        def _close() -> None:
            try:
                os.close(fd)
            except OSError as exc:
                raise from_os_error(exc, "close", name) from exc

        await self._run(_close)

    async def write(self, fd: int, buf: Buffer, offset: int) -> int:
        if len(memoryview(buf)) == 0:
            return 0
        return await self._run(_pwrite_all, fd, buf, offset, self._filename(fd))

    async def read(self, fd: int, buf: Buffer, offset: int) -> int:
        if len(memoryview(buf)) == 0:
            return 0
        return await self._run(_pread_full, fd, buf, offset, self._filename(fd))

    async def fsync(self, fd: int, *, datasync: bool = False) -> None:
        name = self._filename(fd)

        def _fsync() -> None:
            try:
                (os.fdatasync if datasync else os.fsync)(fd)
            except OSError as exc:
                raise from_os_error(exc, "fdatasync" if datasync else "fsync", name) from exc

        await self._run(_fsync)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # No new work: idle threads end now, even if the wait below never runs (a
        # cancellation that is level-triggered, as anyio's cancel scopes are, cancelled
        # the thread that would have shut the pool down, and its threads lived on).
        self._executor.shutdown(wait=False)
        # Every thread finishes its request before the pool goes away.
        await to_thread_to_the_end(self._executor.shutdown, True)


__all__ = ["CheckpointIOError", "ThreadsBackend"]
