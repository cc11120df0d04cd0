"""The I/O backend protocol that every backend implements with identical semantics."""

from __future__ import annotations

import abc
import asyncio
import os
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from .._exceptions import ClosedError

T = TypeVar("T")

Buffer = Any  # anything exposing the (C-contiguous) buffer protocol


async def wait_uncancellable(fut: asyncio.Future[T], discard: Callable[[T], object] | None = None) -> T:
    """Await ``fut`` to its end even if the awaiting task is cancelled meanwhile.

    An I/O request that was handed to the kernel (or to a worker thread) keeps using its
    buffer until it completes; the caller typically returns that buffer to a pool in a
    ``finally`` block. So a cancelled awaiter first waits for the completion, then lets
    ``CancelledError`` propagate: by the time any ``finally`` runs, the buffer is free.
    A result that the cancellation throws away is handed to ``discard`` (an ``open``
    closes the descriptor it got, so that it does not leak).
    """
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                cancelled = True
                continue
            # The request ended in the same step as the cancellation: it is over, and the
            # cancellation wins.
            _discard(fut, discard)
            raise
        if cancelled:
            _discard(fut, discard)
            raise asyncio.CancelledError()
        return result


async def to_thread_to_the_end(
    fn: Callable[..., T], /, *args: object, discard: Callable[[T], object] | None = None
) -> T:
    """``asyncio.to_thread(fn, *args)``, awaited to its end even if the caller is cancelled
    meanwhile (then ``CancelledError`` follows, and ``discard`` gets the result it throws
    away): for work whose effects the caller's cleanup must come after, such as a
    directory it makes, a rename it publishes or a buffer it reads."""
    return await wait_uncancellable(asyncio.ensure_future(asyncio.to_thread(fn, *args)), discard)


def _discard(fut: asyncio.Future[T], discard: Callable[[T], object] | None) -> None:
    if fut.cancelled():
        return
    if fut.exception() is None and discard is not None:  # exception(): marks an error as seen
        discard(fut.result())


class IOBackend(abc.ABC):
    """Open, write, read, fsync and close files as awaitables.

    Semantics shared by every backend:

    - ``write`` writes the whole buffer (short writes, ``EINTR`` and ``EAGAIN`` are
      retried); ``read`` fills the buffer or stops at end of file and returns the count.
    - At most ``queue_depth`` requests are in flight; more callers wait their turn.
    - ``aclose`` lets the requests in flight complete; callers still waiting for a turn,
      and any later call, fail with [`ClosedError`][aiopersist.ClosedError] (their request
      is never submitted).
    - Errors are [`CheckpointIOError`][aiopersist.CheckpointIOError] (``DiskFullError`` for ENOSPC)
      carrying the errno and the file name.
    - Cancelling an awaiter never frees its buffer early: the awaiter waits for its
      request to complete, then raises ``CancelledError``.
    - A backend belongs to the event loop it was first used on.
    """

    name: ClassVar[str]
    """``"io_uring"`` or ``"threads"``."""
    queue_depth: int
    """Most requests in flight at once."""

    def __init__(self, queue_depth: int) -> None:
        if queue_depth <= 0:
            raise ValueError(f"queue_depth must be positive, got {queue_depth}")
        self.queue_depth = queue_depth
        self._names: dict[int, str] = {}
        self._closed = False

    # -- helpers shared by implementations ------------------------------------------

    def _filename(self, fd: int) -> str | None:
        return self._names.get(fd)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"the {self.name} backend is closed")

    # -- the protocol ----------------------------------------------------------------

    @property
    @abc.abstractmethod
    def in_flight(self) -> int:
        """Requests handed to the kernel or a worker thread and not yet completed."""

    @abc.abstractmethod
    async def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
        """Open ``path`` and return the file descriptor (``O_CLOEXEC`` is always added;
        ``mode`` defaults to ``0o644``)."""

    @abc.abstractmethod
    async def close(self, fd: int) -> None:
        """Close a descriptor."""

    @abc.abstractmethod
    async def write(self, fd: int, buf: Buffer, offset: int) -> int:
        """Write all of ``buf`` at ``offset``; returns ``len(buf)``."""

    @abc.abstractmethod
    async def read(self, fd: int, buf: Buffer, offset: int) -> int:
        """Read into ``buf`` from ``offset`` until it is full or the file ends; returns the count."""

    @abc.abstractmethod
    async def fsync(self, fd: int, *, datasync: bool = False) -> None:
        """Flush the file's data (and metadata unless ``datasync``) to stable storage."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Wait for requests in flight, then release the ring or threads."""

    async def __aenter__(self: _B) -> _B:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} queue_depth={self.queue_depth} in_flight={self.in_flight}>"


_B = TypeVar("_B", bound=IOBackend)
