"""The bounded pool of aligned staging buffers that every byte passes through, and the
idle buffers kept between pools for the next one."""

from __future__ import annotations

import asyncio
import os
import threading

from . import _knobs
from ._direct import PAGE_SIZE, AlignedBuffer

_spare: list[AlignedBuffer] = []
"""Idle buffers of pools that were closed, for the next pool (of any save, load or thread)
to take instead of mapping new memory: a new mapping costs a page fault and the zeroing
of every page on first touch, and mapping and unmapping take the process's memory-map
lock for writing, which stalls every other thread that faults a page meanwhile (the
training's, whose allocator maps and unmaps its large tensors). Bounded by
``AIOPERSIST_STAGING_KEEP_BYTES``."""
_spare_lock = threading.Lock()


def _take_spare(size: int) -> AlignedBuffer | None:
    with _spare_lock:
        for i, buf in enumerate(_spare):
            if buf.size == size:
                return _spare.pop(i)
    return None


def _keep_or_close(buf: AlignedBuffer) -> None:
    """Keep an idle buffer for the next pool if that stays within the bound, else unmap it."""
    keep = _knobs.staging_keep_bytes()
    with _spare_lock:
        if sum(b.size for b in _spare) + buf.size <= keep:
            _spare.append(buf)
            return
    buf.close()


def release_spare() -> int:
    """Unmap the idle buffers kept between pools; returns how many bytes were released."""
    with _spare_lock:
        gone = _spare[:]
        _spare.clear()
    for buf in gone:
        buf.close()
    return sum(b.size for b in gone)


def _after_fork_in_child() -> None:
    # The child's copies of the parent's buffers: not registered with CUDA here (CUDA
    # does not survive a fork), and the parent's to account for. Dropped, not reused.
    global _spare_lock
    _spare_lock = threading.Lock()
    for buf in _spare:
        buf.cuda_pinned = False
        buf.close()
    _spare.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class StagingPool:
    """At most ``count`` page-aligned buffers of ``buffer_bytes`` each.

    Buffers are created on first use (or taken from those a closed pool left idle) and
    reused after. ``acquire`` waits while all are
    out; ``peak_in_use`` records the most ever out at once, so tests and benchmarks can
    check that staging memory stays within ``count * buffer_bytes``.
    """

    def __init__(self, buffer_bytes: int | None = None, count: int | None = None) -> None:
        size = buffer_bytes if buffer_bytes is not None else _knobs.chunk_bytes()
        n = count if count is not None else _knobs.staging_buffers()
        if size <= 0 or size % PAGE_SIZE:
            raise ValueError(f"staging buffer size must be a positive multiple of {PAGE_SIZE}, got {size}")
        if n < 2:
            raise ValueError(f"a staging pool needs at least 2 buffers (double buffering), got {n}")
        self.buffer_bytes = size
        self.count = n
        self._free: list[AlignedBuffer] = []
        self._created = 0
        self._slots = asyncio.Semaphore(n)
        self.in_use = 0
        self.peak_in_use = 0
        self.acquisitions = 0
        self._closed = False

    buffer_bytes: int
    """Size of each buffer."""
    count: int
    """Most buffers that can exist at once."""
    in_use: int
    """Buffers acquired and not yet released."""
    peak_in_use: int
    """The most buffers ever out at once."""
    acquisitions: int
    """How many times a buffer was handed out (each is one staged request)."""

    @property
    def capacity_bytes(self) -> int:
        """The pool's memory bound: ``count * buffer_bytes``."""
        return self.buffer_bytes * self.count

    async def acquire(self) -> AlignedBuffer:
        """Take a buffer, waiting while all are out. Give it back with `release`."""
        if self._closed:
            raise RuntimeError("the staging pool is closed")
        await self._slots.acquire()
        if self._free:
            buf = self._free.pop()
        elif (spare := _take_spare(self.buffer_bytes)) is not None:
            buf = spare
        else:
            try:
                buf = AlignedBuffer(self.buffer_bytes)
            except BaseException:
                self._slots.release()
                raise
            self._created += 1
        self.in_use += 1
        self.acquisitions += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return buf

    def release(self, buf: AlignedBuffer) -> None:
        """Return a buffer; only once no I/O request uses it any more."""
        self.in_use -= 1
        if self._closed:
            _keep_or_close(buf)
        else:
            self._free.append(buf)
        self._slots.release()

    def close(self) -> None:
        """Give the idle buffers up (kept for the next pool within
        ``AIOPERSIST_STAGING_KEEP_BYTES``, else unmapped); buffers still out go the same
        way when released."""
        self._closed = True
        while self._free:
            _keep_or_close(self._free.pop())

    def __repr__(self) -> str:
        return f"<StagingPool {self.count} x {self.buffer_bytes} bytes, {self.in_use} in use>"
