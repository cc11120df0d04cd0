"""The ``io_uring`` backend: one ring per event loop, completions reaped on its eventfd.

Requests are prepared into submission entries as callers arrive and submitted in one
``io_uring_submit`` per event-loop iteration (batched). The ring's eventfd is watched with
``loop.add_reader``; when it fires, every available completion is reaped and its future
resolved. In-flight requests are bounded by the queue depth (a semaphore), so a free
submission entry always exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from .._exceptions import CheckpointIOError, io_error
from .._native import binding as uring
from ._base import Buffer, IOBackend, wait_uncancellable

log = logging.getLogger("aiopersist")

_RETRY = {errno.EINTR, errno.EAGAIN}
_IGNORED = 0  # user_data of NOPs that stand in for entries whose preparation failed


def _discard_result(discard: Callable[[int], object], res: int) -> None:
    if res >= 0:
        discard(res)


def _prep_rw(
    prep: Callable[[Any, int, Buffer, int], Any], fd: int, buf: Buffer, offset: int, sqe: Any
) -> Any:
    return prep(sqe, fd, buf, offset)


@dataclass(eq=False)
class _Request:
    future: asyncio.Future[int]
    keepalive: Any  # the pointers the kernel uses until completion


class UringBackend(IOBackend):
    """io_uring through liburing; see the module docstring for the machinery."""

    name = "io_uring"

    def __init__(self, queue_depth: int) -> None:
        super().__init__(queue_depth)
        self._loop = asyncio.get_running_loop()
        self._ring = uring.io_uring_queue_init(queue_depth)
        try:
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            try:
                uring.io_uring_register_eventfd(self._ring, self._efd)
            except BaseException:
                os.close(self._efd)
                raise
        except BaseException:
            uring.io_uring_queue_exit(self._ring)
            raise
        self._loop.add_reader(self._efd, self._reap)
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self._slots = asyncio.Semaphore(queue_depth)
        self._unsubmitted: list[int] = []  # prepared, not yet taken by the kernel, in order
        self._flush_scheduled = False
        self._broken: CheckpointIOError | None = None

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    # -- submission --------------------------------------------------------------------

    async def _submit(
        self,
        prep: Callable[[Any], Any],
        call: str,
        filename: str | None,
        discard: Callable[[int], object] | None = None,
    ) -> int:
        """Prepare one request with ``prep(sqe)``, submit it (batched) and return ``res``."""
        self._check_open()
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("an io_uring backend belongs to the event loop it was created on")
        if self._broken is not None:
            raise self._broken
        await self._slots.acquire()
        if self._closed or self._broken is not None:
            # Closed (or broken) while this request waited for its turn: the ring may be
            # gone already, so nothing is prepared on it.
            self._slots.release()
            self._check_open()
            assert self._broken is not None
            raise self._broken
        sqe = None
        try:
            sqe = uring.io_uring_get_sqe(self._ring)
            if sqe is None:  # cannot happen while in-flight <= entries; keep the invariant loud
                raise RuntimeError("io_uring submission queue full despite the in-flight bound")
            rid = next(self._ids)
            # No local keeps the pointers: once the completion drops them, nothing (not
            # even a traceback through this frame) pins the caller's buffer.
            request = _Request(self._loop.create_future(), prep(sqe))
            uring.io_uring_sqe_set_data64(sqe, rid)
        except BaseException:
            if sqe is not None:
                # The entry is already in the queue: turn it into a harmless NOP whose
                # completion is ignored, rather than submit whatever it held.
                uring.io_uring_prep_nop(sqe)
                uring.io_uring_sqe_set_data64(sqe, _IGNORED)
                self._unsubmitted.append(_IGNORED)
                self._schedule_flush_later()
            else:
                self._slots.release()
            raise
        self._requests[rid] = request
        self._unsubmitted.append(rid)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        # A negative res is an errno, not a result to discard (no descriptor to close).
        res = await wait_uncancellable(
            request.future, None if discard is None else functools.partial(_discard_result, discard)
        )
        if res < 0:
            raise io_error(-res, call, filename)
        return res

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._unsubmitted or self._closed_ring or self._broken is not None:
            return
        try:
            taken = uring.io_uring_submit(self._ring)
        except CheckpointIOError as exc:
            if exc.errno in _RETRY or exc.errno == errno.EBUSY:
                self._schedule_flush_later()
                return
            # The kernel took none of the waiting entries: fail exactly those, and refuse
            # further work. Requests it took earlier complete normally (their buffers
            # stay with them until then); the ring is torn down at aclose().
            self._broken = exc
            waiting, self._unsubmitted = self._unsubmitted, []
            for rid in waiting:
                self._slots.release()
                req = self._requests.pop(rid, None)
                if req is not None:
                    kept, req.keepalive = req.keepalive, None
                    uring.release(kept)  # never given to the kernel
                    if not req.future.done():
                        req.future.set_exception(exc)
            return
        del self._unsubmitted[:taken]
        if self._unsubmitted:
            self._schedule_flush_later()

    def _schedule_flush_later(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_later(0.0005, self._flush)

    # -- completion ----------------------------------------------------------------------

    def _reap(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        while True:
            cqes = uring.io_uring_peek_batch_cqe(self._ring)
            if not cqes:
                return
            uring.io_uring_cq_advance(self._ring, len(cqes))
            for rid, res in cqes:
                self._complete(rid, res)

    def _complete(self, rid: int, res: int) -> None:
        if rid == _IGNORED:
            self._slots.release()
            return
        req = self._requests.pop(rid, None)
        if req is None:  # pragma: no cover - a completion we never asked for
            log.warning("io_uring: completion for unknown request %d (res=%d)", rid, res)
            return
        self._slots.release()
        # The kernel is done with the memory: the pointers go now, the buffer export with
        # them (`binding.release`), whoever else holds a reference.
        kept, req.keepalive = req.keepalive, None
        uring.release(kept)
        if not req.future.done():
            req.future.set_result(res)

    # -- operations ------------------------------------------------------------------------

    async def _rw(self, fd: int, buf: Buffer, offset: int, *, write: bool) -> int:
        name = self._filename(fd)
        call = "io_uring write" if write else "io_uring read"
        prep = uring.io_uring_prep_write if write else uring.io_uring_prep_read
        done = 0
        # Views are released on the way out, errors included: a traceback that kept one
        # alive would pin the caller's buffer (an mmap could not be unmapped).
        with memoryview(buf) as raw, raw.cast("B") as view:
            total = len(view)
            while done < total:
                with view[done:] as part:
                    pos = offset + done
                    try:
                        n = await self._submit(functools.partial(_prep_rw, prep, fd, part, pos), call, name)
                    except CheckpointIOError as exc:
                        if exc.errno in _RETRY:
                            continue
                        raise
                if n == 0:
                    if write:
                        raise io_error(errno.EIO, f"{call} (no progress)", name)
                    break  # end of file
                done += n
        return done

    async def write(self, fd: int, buf: Buffer, offset: int) -> int:
        return await self._rw(fd, buf, offset, write=True)

    async def read(self, fd: int, buf: Buffer, offset: int) -> int:
        return await self._rw(fd, buf, offset, write=False)

    async def fsync(self, fd: int, *, datasync: bool = False) -> None:
        await self._retrying(
            lambda sqe: uring.io_uring_prep_fsync(sqe, fd, datasync=datasync),
            "io_uring fsync",
            self._filename(fd),
        )

    async def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
        name = os.fspath(path)
        raw = os.fsencode(name)
        fd = await self._retrying(
            lambda sqe: uring.io_uring_prep_openat(sqe, raw, flags | os.O_CLOEXEC, mode),
            "io_uring openat",
            name,
            discard=os.close,
            # With O_NONBLOCK, EAGAIN is the answer (a lease held elsewhere): retrying it
            # would spin a core until the lease goes.
            retry=_RETRY - {errno.EAGAIN} if flags & os.O_NONBLOCK else _RETRY,
        )
        self._names[fd] = name
        return fd

    async def close(self, fd: int) -> None:
        name = self._names.pop(fd, None)
        # A close is not retried: after EINTR the descriptor state is unspecified.
        await self._submit(lambda sqe: uring.io_uring_prep_close(sqe, fd), "io_uring close", name)

    async def _retrying(
        self,
        prep: Callable[[Any], Any],
        call: str,
        filename: str | None,
        discard: Callable[[int], object] | None = None,
        retry: Collection[int] = _RETRY,
    ) -> int:
        while True:
            try:
                return await self._submit(prep, call, filename, discard)
            except CheckpointIOError as exc:
                if exc.errno not in retry:
                    raise

    # -- teardown ----------------------------------------------------------------------------

    @property
    def _closed_ring(self) -> bool:
        return self._ring.closed

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Let every request in flight complete (their buffers are in the kernel's hands).
        pending = [req.future for req in self._requests.values()]
        try:
            if pending:
                self._flush()
                await asyncio.gather(*(wait_uncancellable(f) for f in pending), return_exceptions=True)
        finally:
            self._teardown()  # the ring and its eventfd, also when the wait was cancelled

    def _teardown(self) -> None:
        if self._ring.closed:
            return
        self._loop.remove_reader(self._efd)
        if self._requests and self._broken is None:
            # Closed without aclose() (e.g. loop shutting down): block until the kernel is
            # done with every buffer before the ring and the keepalives go away.
            if self._unsubmitted:
                uring.io_uring_submit(self._ring)
                self._unsubmitted.clear()
            while self._requests:
                rid, _res = uring.io_uring_wait_cqe(self._ring)
                uring.io_uring_cqe_seen(self._ring)
                req = self._requests.pop(rid, None)
                if req is not None:
                    uring.release(req.keepalive)
        uring.io_uring_queue_exit(self._ring)
        os.close(self._efd)

    def close_now(self) -> None:
        """Synchronous teardown for when no event loop runs any more; blocks on in-flight I/O."""
        self._closed = True
        self._teardown()
