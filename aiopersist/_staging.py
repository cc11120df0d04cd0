"""The bounded pool of aligned staging buffers that every byte passes through."""

from __future__ import annotations

import asyncio

from . import _knobs
from ._direct import PAGE_SIZE, AlignedBuffer


class StagingPool:
    """At most ``count`` page-aligned buffers of ``buffer_bytes`` each.

    Buffers are created on first use and reused after. ``acquire`` waits while all are
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
            buf.close()
        else:
            self._free.append(buf)
        self._slots.release()

    def close(self) -> None:
        """Unmap the idle buffers; buffers still out are unmapped when released."""
        self._closed = True
        while self._free:
            self._free.pop().close()

    def __repr__(self) -> str:
        return f"<StagingPool {self.count} x {self.buffer_bytes} bytes, {self.in_use} in use>"
