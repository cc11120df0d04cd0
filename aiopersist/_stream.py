"""Sequential file streams through a backend and a staging pool.

`FileWriter` copies the caller's bytes into aligned staging buffers; every full
buffer becomes one write request while the next buffer fills (double buffering, up to
the pool's size in flight). The unaligned tail is written padded with zeros and the file
truncated to its exact length. `read_segments` does the reverse: aligned windows
are read, several in flight, and each is copied into the destinations it overlaps.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import contextvars
import errno
import itertools
import os
import stat
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch

from . import _knobs
from ._backends import IOBackend
from ._backends._base import Buffer, to_thread_to_the_end
from ._direct import AlignedBuffer, DirectIOInfo, copy_bytes, keep_if_regular, preallocate
from ._exceptions import CheckpointCorruptError, CheckpointIOError, from_os_error
from ._staging import StagingPool

Bytes = bytes | bytearray | memoryview
T = TypeVar("T")


class Hasher(Protocol):
    """A streaming checksum (``xxhash.xxh3_64`` and ``hashlib`` objects qualify)."""

    def update(self, data: Buffer, /) -> None: ...


_IN_THREAD_BYTES = 256 << 10
"""Copies of this many bytes or more (a gather, a buffer's batch of pieces, a staging
window's copies out) run in a worker thread; smaller ones on the event loop, where a
thread hop would cost more than the copy."""


async def _copy_off_loop(nbytes: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, a copy of ``nbytes``: in a worker thread awaited to its end (it
    touches a staging buffer or a tensor the caller owns) when large, else inline."""
    if nbytes < _IN_THREAD_BYTES:
        return fn(*args)
    return await to_thread_to_the_end(fn, *args)


def strided_blocks(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` whose elements, each block's in row-major order and the blocks one
    after the other, are ``t``'s in row-major order; each at most ``limit`` bytes (or one
    element, if that is larger). Rows are grouped while they fit; a row too large is split
    the same way, down to slices of a 1-D tensor."""
    if t.dim() == 0:
        yield t
        return
    if t.dim() == 1:
        step = max(1, limit // t.element_size())
        for start in range(0, t.shape[0], step):
            yield t[start : start + step]
        return
    row_bytes = t[0].numel() * t.element_size() if t.shape[0] else 0
    if row_bytes <= limit:
        rows = max(1, limit // max(1, row_bytes))
        for start in range(0, t.shape[0], rows):
            yield t[start : start + rows]
        return
    for i in range(t.shape[0]):
        yield from strided_blocks(t[i], limit)


CudaReady = Mapping[int, "torch.cuda.Event"]
"""Per CUDA device index, an event that marks where on its stream the saved tensors are
ready: the copies out of them wait for it (on the GPU), and for nothing later."""

_CUDA_READY: contextvars.ContextVar[CudaReady | None] = contextvars.ContextVar(
    "aiopersist_cuda_ready", default=None
)


def record_cuda_ready(devices: Iterable[int]) -> dict[int, torch.cuda.Event]:
    """An event on the calling thread's current stream of each of ``devices``."""
    events: dict[int, torch.cuda.Event] = {}
    for index in devices:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(index))
        events[index] = event
    return events


def caller_cuda_ready() -> dict[int, torch.cuda.Event]:
    """For a save started from another thread (the blocking facades): an event on this
    thread's current stream of the current device, when this process uses CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return {}
    return record_cuda_ready([torch.cuda.current_device()])


def use_cuda_ready(events: CudaReady) -> None:
    """Make ``events`` the ready points for the writes of the current task (and of the
    tasks and threads it starts from now on)."""
    _CUDA_READY.set(events or None)


@contextlib.contextmanager
def cuda_ready_streams() -> Iterator[None]:
    """In a worker thread about to read the save's CUDA tensors with torch's own copies
    (``torch.save``, ``copy_``): for each device with a ready event, a fresh stream that
    waits for the event becomes this thread's current one, so the copies see the state as
    the save found it and wait for nothing the caller queued after."""
    with contextlib.ExitStack() as streams:
        for index, event in (_CUDA_READY.get() or {}).items():
            side = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
            side.wait_event(event)
            streams.enter_context(torch.cuda.stream(side))
        yield


async def settle(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every task has finished, even if the caller is cancelled meanwhile."""
    cancelled = False
    pending = [t for t in tasks if not t.done()]
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
        pending = [t for t in pending if not t.done()]
    for t in tasks:  # mark every failure as seen; the caller reports the first one
        if not t.cancelled():
            t.exception()
    if cancelled:
        raise asyncio.CancelledError()


async def run_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Run ``aws`` concurrently and return their results in order, like `asyncio.gather`,
    except on failure: the first error cancels the others and is raised as itself (not in
    an ``ExceptionGroup``) only once every one of them has ended. So no request is still
    using a staging buffer, a file or a destination tensor when the caller cleans up.
    Cancelling the caller cancels them all, with the same wait."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await settle(tasks)
        raise
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
    if failed is None:
        return [t.result() for t in tasks]
    for t in tasks:
        t.cancel()
    await settle(tasks)
    error = failed.exception()
    assert error is not None
    # Raised with no local holding it or the tasks: the error's traceback holds this
    # frame, which would hold the error back (a cycle that keeps a failed load's
    # destination tensors until the cyclic collector runs).
    del failed, tasks, t, aws
    try:
        raise error
    finally:
        del error


class PartHasher:
    """A file's checksum and, beside it, one checksum per part of the file (consecutive
    byte ranges of the given lengths), from the same stream of updates."""

    def __init__(self, whole: Any, lengths: Sequence[int], new: Any) -> None:
        self.whole = whole
        self.parts = [new() for _ in lengths]
        self._ends = list(itertools.accumulate(lengths))
        self._pos = 0
        self._i = 0

    def update(self, data: Buffer, /) -> None:
        self.whole.update(data)
        self.update_parts(data)

    def update_parts(self, data: Buffer, /) -> None:
        """The per-part checksums alone."""
        with memoryview(data) as raw, raw.cast("B") as view:
            off, n = 0, len(view)
            while off < n:
                while self._i < len(self._ends) and self._pos >= self._ends[self._i]:
                    self._i += 1
                if self._i == len(self._ends):
                    return  # bytes past the last part (none are written)
                take = min(n - off, self._ends[self._i] - self._pos)
                self.parts[self._i].update(view[off : off + take])
                off += take
                self._pos += take

    def hexdigest(self) -> str:
        return str(self.whole.hexdigest())

    def part_digests(self) -> list[str]:
        return [str(h.hexdigest()) for h in self.parts]


class FileWriter:
    """Writes one new file from a stream of byte chunks.

    Bytes are copied into staging buffers from the pool; each full buffer becomes one
    write request while the next one fills. With direct I/O the unaligned tail is written
    padded with zeros and the file is then truncated to its exact length.

    The copies and the checksum run in worker threads, not on the event loop: a buffer's
    copies (a batch: every piece that lands in it, however many tensors) in one thread
    hop, the checksum of each buffer in file order, chained, while other buffers are
    copied and written. Sources written with ``stable=True`` are copied when their buffer
    is launched (or at `copied`); others before `write` returns.

    ``size``, the file's final length when the caller knows it: with direct I/O, a file
    of more than one request has its blocks allocated when it is opened (`preallocate`,
    ``AIOPERSIST_PREALLOCATE``), so that its requests run side by side on ext4; a full
    disk then fails the open, before any request. A wrong ``size`` costs nothing but
    that: the file ends with the bytes written.

    Use ``await open()``, ``await write(...)`` any number of times, then ``await finish()``
    (fsync included) or ``await abort()``. As an async context manager it finishes on
    success and aborts on error.
    """

    def __init__(
        self,
        backend: IOBackend,
        path: str | os.PathLike[str],
        dio: DirectIOInfo,
        pool: StagingPool,
        *,
        hasher: Hasher | None = None,
        size: int | None = None,
    ):
        if dio.direct and pool.buffer_bytes % dio.offset_align:
            raise ValueError(
                f"staging buffers of {pool.buffer_bytes} bytes are not a multiple of the "
                f"{dio.offset_align}-byte direct-I/O alignment of {dio.directory}"
            )
        self.path = os.fspath(path)
        self._backend = backend
        self._dio = dio
        self._pool = pool
        self._fd: int | None = None
        self._buf: AlignedBuffer | None = None
        self._fill = 0
        self._offset = 0  # file offset of the current buffer
        self._pending: list[asyncio.Task[int]] = []
        self._hasher = hasher
        self._pinned: list[torch.Tensor] | None = None  # GPU bounce buffers, made on first use
        self._jobs: list[_CopyJob] = []  # the current buffer's copies, not yet run
        self._copies: list[asyncio.Future[None]] = []  # one per launched buffer: its copies ran
        self._hashed: asyncio.Future[None] | None = None  # the checksum chain's last link
        self.bytes_written = 0
        self._size = size
        self._allocated = 0  # bytes preallocated at open (the file's length until finish)
        self._written_end = 0  # the furthest end of the requests that completed

    async def open(self) -> FileWriter:
        """Create (or truncate) the file; ``O_DIRECT`` when the directory takes it. With
        ``size`` (the file's final length, when the caller knows it) and direct I/O, its
        blocks are allocated first (`preallocate`) when it spans several requests."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._dio.open_flags
        self._fd = await self._backend.open(self.path, flags, 0o644)
        size = self._size
        if (
            self._dio.direct
            and size is not None
            and size > self._pool.buffer_bytes
            and _knobs.preallocate_enabled()
        ):
            length = self._dio.align_up(size)
            try:
                if await to_thread_to_the_end(preallocate, self._fd, length, self.path):
                    self._allocated = length
            except BaseException:
                # ext4 keeps what a failed fallocate allocated: given back, not left to
                # fill the disk until the file is removed.
                fd, self._fd = self._fd, None
                with contextlib.suppress(OSError):
                    await to_thread_to_the_end(os.ftruncate, fd, 0)
                await self._backend.close(fd)
                raise
        return self

    async def __aenter__(self) -> FileWriter:
        return await self.open()

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            await self.finish()
        else:
            await self.abort()

    def _raise_failed(self) -> None:
        """Forget finished requests; raise the first failure among them."""
        still: list[asyncio.Task[int]] = []
        failure: BaseException | None = None
        for task in self._pending:
            if not task.done():
                still.append(task)
            elif not task.cancelled() and (exc := task.exception()) is not None and failure is None:
                failure = exc
        self._pending = still
        if failure is not None:
            raise failure

    async def write(self, data: torch.Tensor | Bytes, *, stable: bool = False) -> None:
        """Append ``data`` (a CPU tensor's bytes, or a bytes-like object) to the file.

        With ``stable=True`` the caller keeps ``data`` alive and unchanged until `copied`
        (or `finish`) returns: its bytes are copied later, in a worker thread, batched with
        the other pieces of their staging buffer. Otherwise they are copied before this
        returns (``data`` may then be reused at once), large pieces in a worker thread.

        A non-contiguous tensor is gathered a block at a time, each block at most one
        staging buffer (rows, or slices of a row or of a 1-D tensor), never as a whole:
        memory stays bounded by the pool, and a large block is gathered in a worker
        thread, not on the event loop.
        """
        if isinstance(data, torch.Tensor) and data.device.type == "cuda":
            await self._write_cuda(data)
            return
        if isinstance(data, torch.Tensor) and not data.is_contiguous() and data.numel():
            for block in strided_blocks(data, self._pool.buffer_bytes):
                gathered = await _copy_off_loop(
                    block.numel() * block.element_size(), torch.Tensor.contiguous, block
                )
                await self.write(gathered, stable=True)  # the gathered copy is this writer's own
            return
        if isinstance(data, torch.Tensor):
            if data.device.type != "cpu":
                raise ValueError(f"expected a CPU tensor, got one on {data.device}")
            src: torch.Tensor | memoryview = data  # contiguous: its bytes from data_ptr() on
            n = data.numel() * data.element_size()
        else:
            src = memoryview(data).cast("B")
            n = len(src)
        pos = 0
        now: list[_CopyJob] = []  # copies to run before returning (unstable data)
        while pos < n:
            if self._buf is None:
                self._raise_failed()
                self._buf = await self._pool.acquire()
                self._fill = 0
            buf = self._buf
            take = min(n - pos, buf.size - self._fill)
            job: _CopyJob = (buf, self._fill, src, pos, take)
            if stable:
                self._jobs.append(job)
            else:
                now.append(job)
            self._fill += take
            pos += take
            self.bytes_written += take
            if self._fill == buf.size:
                if now:  # this buffer's unstable bytes must be in it before it is launched
                    await _run_copies(now)
                    now = []
                self._launch(buf.size)
        if now:
            await _run_copies(now)

    async def write_stable(self, parts: Iterable[torch.Tensor | Bytes]) -> None:
        """``write(part, stable=True)`` for each of ``parts``, in order. A contiguous CPU
        tensor that fits in the current staging buffer without filling it (a state's
        many small tensors) is only queued for its buffer's batch of copies, with no
        await and no per-call overhead; every other part goes through `write`."""
        for part in parts:
            buf = self._buf
            if (
                buf is not None
                and isinstance(part, torch.Tensor)
                and part.is_cpu
                and part.is_contiguous()
                and self._fill + (n := part.nbytes) < buf.size
            ):
                self._jobs.append((buf, self._fill, part, 0, n))
                self._fill += n
                self.bytes_written += n
            else:
                await self.write(part, stable=True)

    async def copied(self) -> None:
        """Wait until every byte handed to `write` so far is in a staging buffer (the
        sources may change from then on). Raises a failure of those copies."""
        if self._jobs:
            jobs, self._jobs = self._jobs, []
            await _run_copies(jobs)
        if self._copies:
            await settle(self._copies)
            for fut in self._copies:
                if not fut.cancelled() and (exc := fut.exception()) is not None:
                    raise exc

    async def _write_cuda(self, data: torch.Tensor) -> None:
        """A GPU tensor: chunks copied device-to-host into two pinned buffers on a side
        stream, the copy of chunk k+1 running while chunk k is staged and written.

        The side stream waits (on the GPU, not the host) for the save's ready event on
        this device (recorded on the caller's stream when the save was asked for; without
        one, for the work queued on this thread's current stream), so the bytes are those
        the caller saw, while later work on the training stream runs on; the training
        stream itself is never synchronized. A non-contiguous tensor is gathered on the
        side stream too, a block (`strided_blocks`: at most one staging buffer) at a time.
        """
        if data.numel() == 0:
            return
        stream = torch.cuda.Stream(device=data.device)  # type: ignore[no-untyped-call]
        ready = (_CUDA_READY.get() or {}).get(data.device.index)
        if ready is not None:
            stream.wait_event(ready)  # the state as it was when the save was asked for
        else:
            stream.wait_stream(torch.cuda.current_stream(data.device))
        if data.is_contiguous():
            await self._copy_out(data, stream)
            return
        for view in strided_blocks(data, self._pool.buffer_bytes):
            with torch.cuda.stream(stream):  # ordered after the ready event, like the copies
                block = view.contiguous()
            await self._copy_out(block, stream)

    async def _copy_out(self, data: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Copy a contiguous GPU tensor's bytes to the host on ``stream`` and write them."""
        src = data.reshape(-1).view(torch.uint8)
        n = src.numel()
        chunk = self._pool.buffer_bytes
        if self._pinned is None:
            self._pinned = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

        def start_copy(k: int) -> tuple[torch.cuda.Event, int]:
            assert self._pinned is not None
            lo, hi = k * chunk, min(n, (k + 1) * chunk)
            with torch.cuda.stream(stream):
                self._pinned[k % 2][: hi - lo].copy_(src[lo:hi], non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
            return event, hi - lo

        chunks = -(-n // chunk)
        pending = start_copy(0)
        for k in range(chunks):
            event, length = pending
            await asyncio.to_thread(event.synchronize)  # the host waits here, not the GPU
            if k + 1 < chunks:
                pending = start_copy(k + 1)  # overlaps the staging of chunk k below
            await self.write(self._pinned[k % 2][:length])

    def _launch(self, length: int) -> None:
        """Hand the current buffer on: its copies (in a thread), then its checksum (in a
        thread, after the previous buffer's), then its write request."""
        assert self._buf is not None
        assert self._fd is not None
        buf, fill, jobs, fd, offset = self._buf, self._fill, self._jobs, self._fd, self._offset
        self._jobs = []
        loop = asyncio.get_running_loop()
        copies: asyncio.Future[None] = loop.create_future()
        hashed: asyncio.Future[None] | None = None
        previous = self._hashed
        if self._hasher is not None:
            hashed = self._hashed = loop.create_future()
        hasher = self._hasher

        async def stage_and_write() -> int:
            try:
                try:
                    if jobs:
                        await _run_copies(jobs)
                except BaseException as exc:
                    _settle_future(copies, exc)
                    raise
                _settle_future(copies, None)
                if hasher is not None:
                    assert hashed is not None
                    try:
                        if previous is not None:
                            await previous  # the checksum runs over the file in order
                        # Taken from the staged bytes as they leave: no second pass.
                        with buf.view[:fill] as staged:
                            await to_thread_to_the_end(hasher.update, staged)
                    except BaseException as exc:
                        _settle_future(hashed, exc)
                        raise
                    _settle_future(hashed, None)
                piece = buf.view[:length]
                try:
                    n = await self._backend.write(fd, piece, offset)
                finally:
                    piece.release()  # so that a stored traceback cannot pin the mapping
                self._written_end = max(self._written_end, offset + n)
                return n
            finally:
                _settle_future(copies, asyncio.CancelledError())
                if hashed is not None:
                    _settle_future(hashed, asyncio.CancelledError())

        task = asyncio.ensure_future(stage_and_write())

        # The buffer goes back to the pool only once the request is over, whatever the
        # task's fate: that is what makes sharing one pool between writers safe.
        def done(_t: asyncio.Task[int]) -> None:
            self._pool.release(buf)

        task.add_done_callback(done)
        self._pending.append(task)
        self._copies = [c for c in self._copies if not c.done()] + [copies]
        self._offset += length
        self._buf = None
        self._fill = 0

    async def finish(self) -> int:
        """Write the tail, wait for every request, set the exact size, fsync, close."""
        assert self._fd is not None, "open() first"
        padded = False
        try:
            if self._buf is not None and self._fill:
                length = self._fill
                if self._dio.direct:
                    length = self._dio.align_up(self._fill)
                    padded = length != self._fill
                    self._buf.view[self._fill : length] = bytes(length - self._fill)
                self._launch(length)  # the checksum runs here: if it fails, abort below
            elif self._buf is not None:
                self._pool.release(self._buf)
                self._buf = None
            await settle(self._pending)
            self._raise_failed()
            if padded or self._allocated > self.bytes_written:
                try:  # a metadata update that can wait on the journal: off the loop
                    await to_thread_to_the_end(os.ftruncate, self._fd, self.bytes_written)
                except OSError as exc:
                    raise from_os_error(exc, "ftruncate", self.path) from exc
            await self._backend.fsync(self._fd)
        except BaseException:
            await self.abort()
            raise
        fd, self._fd = self._fd, None
        await self._backend.close(fd)
        return self.bytes_written

    async def abort(self) -> None:
        """Stop: wait for requests in flight (their buffers), close the file. Keeps the file,
        as long as the requests that completed wrote it (a preallocated file is cut back)."""
        self._jobs = []
        if self._buf is not None:
            self._pool.release(self._buf)
            self._buf = None
        pending, self._pending = self._pending, []
        try:
            await settle(pending)  # raises CancelledError only after they have all ended
        finally:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                if self._allocated:
                    # Preallocated, the file would keep its full length, zeros where no
                    # request wrote: cut back to what was written, as a file that grew.
                    end = min(self._written_end, self.bytes_written)
                    with contextlib.suppress(OSError):
                        await to_thread_to_the_end(os.ftruncate, fd, end)
                await self._backend.close(fd)


_CopyJob = tuple[AlignedBuffer, int, "torch.Tensor | memoryview", int, int]
"""``(buf, offset, src, src_offset, n)``: ``n`` bytes of ``src`` from ``src_offset`` into
``buf`` at ``offset`` (a plain tuple: one is made per tensor piece). Holds ``src``: the
memory stays alive until the copy has run."""


def _copy_all_jobs(jobs: Sequence[_CopyJob]) -> None:
    for buf, offset, src, src_offset, n in jobs:
        if isinstance(src, torch.Tensor):
            ptr = src.data_ptr()
            if not ptr and n:  # never a copy from address 0: a tensor without storage of its own
                raise ValueError(
                    f"a {type(src).__name__} has no storage of its own (a wrapper tensor subclass): "
                    "its bytes cannot be written"
                )
            copy_bytes(buf.address + offset, ptr + src_offset, n)
        else:
            buf.view[offset : offset + n] = src[src_offset : src_offset + n]


async def _run_copies(jobs: Sequence[_CopyJob]) -> None:
    """Run ``jobs`` (memmove lets go of the GIL), off the loop when they are large."""
    await _copy_off_loop(sum(j[4] for j in jobs), _copy_all_jobs, jobs)


def _copy_window_out(
    staged: Sequence[tuple[int, torch.Tensor]], starts: Sequence[int], ws: int, we: int, address: int
) -> None:
    """Copy the file's bytes ``[ws, we)``, read into memory at ``address``, out to the
    ``staged`` segments (sorted, starting at ``starts``) they hold bytes of."""
    i = max(bisect.bisect_right(starts, ws) - 1, 0)
    while i < len(staged) and staged[i][0] < we:
        off, dest = staged[i]
        lo, hi = max(ws, off), min(we, off + dest.numel())
        if lo < hi:
            copy_bytes(dest.data_ptr() + lo - off, address + lo - ws, hi - lo)
        i += 1


def _settle_future(fut: asyncio.Future[None], outcome: BaseException | None) -> None:
    """Resolve ``fut`` once (later calls do nothing); its exception counts as seen."""
    if fut.done():
        return
    if outcome is None:
        fut.set_result(None)
    elif isinstance(outcome, asyncio.CancelledError):
        fut.cancel()
    else:
        fut.set_exception(outcome)
        fut.exception()


def _plan_windows(ranges: Sequence[tuple[int, int]], align: int, window: int) -> list[tuple[int, int]]:
    """Aligned read windows (at most ``window`` long) that cover the byte ``ranges``.

    Ranges are widened to the alignment and merged where they touch, so a run of small
    tensors is read with few large requests and no byte is read twice.
    """
    runs: list[list[int]] = []
    for lo, hi in sorted(ranges):
        a, b = lo - lo % align, -(-hi // align) * align
        if runs and a <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], b)
        else:
            runs.append([a, b])
    return [(ws, min(ws + window, b)) for a, b in runs for ws in range(a, b, window)]


def _direct_part(off: int, dest: torch.Tensor, dio: DirectIOInfo) -> tuple[int, int]:
    """The ``[k0, k1)`` byte range of ``dest`` that O_DIRECT can read straight into it:
    file offset, memory address and length all aligned. Empty when none is."""
    if not dio.direct:
        return 0, 0
    k0 = (-off) % dio.offset_align
    if (dest.data_ptr() + k0) % dio.mem_align:
        return 0, 0
    k1 = k0 + (dest.numel() - k0) // dio.offset_align * dio.offset_align
    return (k0, k1) if k1 > k0 else (0, 0)


FILES_AT_ONCE = 64
"""The most files one load, verify or DCP read has open at once (a checkpoint may list
more files than a process may open: 1024 by default)."""


def files_at_once() -> asyncio.Semaphore:
    """A bound for the files one read has open at once (`FILES_AT_ONCE`)."""
    return asyncio.Semaphore(FILES_AT_ONCE)


async def open_for_read(backend: IOBackend, name: str, flags: int) -> int:
    """Open a file a checkpoint lists for reading through ``backend``, never through a
    link (``flags`` hold ``O_NOFOLLOW``) and never blocking on what is not a regular file:
    the checks before a read found one, but it may have been swapped for a FIFO since,
    whose open would wait for a writer for ever. As `open_regular`: ``O_NONBLOCK`` until
    the file is known to be regular (io_uring would answer ``EAGAIN`` to reads rather
    than wait), and a plain open again where a lease makes it fail with ``EWOULDBLOCK``.
    `CheckpointCorruptError` for anything but a regular file."""

    def refused() -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{name}: not a regular file (it changed since it was checked)")

    def regular() -> bool:
        try:
            return stat.S_ISREG(os.lstat(name).st_mode)
        except OSError:
            return True  # gone, or unreadable: the open's own error says so

    try:
        fd = await backend.open(name, flags | os.O_NONBLOCK)
    except CheckpointIOError as exc:
        if not regular():
            raise refused() from None  # a FIFO under O_DIRECT fails with EINVAL
        if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise
        fd = await backend.open(name, flags)  # a lease: wait for it, as a plain open does
    try:
        ok = keep_if_regular(fd)
    except OSError as exc:
        raise from_os_error(exc, "fstat", name) from exc
    if not ok:
        raise refused()
    return fd


_INLINE_SEGMENTS = 64
"""`read_segments` lays out this many segments at most on the event loop; more in a
worker thread."""


_Segments = list[tuple[int, torch.Tensor]]
"""(file offset, destination) pairs."""


def _lay_out_segments(
    segments: Sequence[tuple[int, torch.Tensor]], dio: DirectIOInfo, window: int
) -> tuple[_Segments, _Segments, list[int], list[tuple[int, int]], int] | None:
    """`read_segments`' requests: the parts read straight into their destination, the
    parts read through staging (and their file offsets), the staging windows, and the end
    of the last segment; ``None`` when there is nothing to read."""
    segs = sorted(((off, d) for off, d in segments if d.numel() > 0), key=lambda sd: sd[0])
    if not segs:
        return None
    last = max(off + d.numel() for off, d in segs)
    direct: _Segments = []
    staged: _Segments = []
    end = 0
    for off, dest in segs:
        if not dest.is_contiguous() or dest.dtype != torch.uint8:
            raise ValueError("read_segments needs contiguous 1-D uint8 destinations")
        if off < end:  # each staging window fills the segments that start in order after it
            raise ValueError(f"read_segments: the segment at {off} overlaps the one before")
        end = off + dest.numel()
        k0, k1 = _direct_part(off, dest, dio)
        if k1 - k0 < window:  # not worth a request of its own
            k0 = k1 = 0
        for a, b in ((0, k0), (k1, dest.numel())):
            if b > a:
                staged.append((off + a, dest[a:b]))
        for a in range(k0, k1, window):
            direct.append((off + a, dest[a : min(a + window, k1)]))
    starts = [off for off, _ in staged]
    align = dio.offset_align if dio.direct else 1
    windows = _plan_windows([(off, off + d.numel()) for off, d in staged], align, window)
    return direct, staged, starts, windows, last


async def read_segments(
    backend: IOBackend,
    path: str | os.PathLike[str],
    dio: DirectIOInfo,
    pool: StagingPool,
    segments: Sequence[tuple[int, torch.Tensor]],
) -> None:
    """Fill each ``(file_offset, dest)`` with the file's bytes at that offset.

    ``dest`` is a contiguous 1-D ``uint8`` CPU tensor (often a byte view of the tensor
    being loaded); segments must not overlap. Where a destination is suitably aligned in
    memory, its aligned middle is read straight into it (no staging copy); everything
    else is read in aligned windows of the pool's buffer size, as many in flight as the
    pool has buffers, and copied out.
    """
    name = os.fspath(path)
    window = pool.buffer_bytes
    if len(segments) <= _INLINE_SEGMENTS:
        laid = _lay_out_segments(segments, dio, window)
    else:  # O(segments) Python and tensor views: thousands of small tensors
        laid = await asyncio.to_thread(_lay_out_segments, segments, dio, window)
    if laid is None:
        return
    direct, staged, starts, windows, last = laid

    fd = await open_for_read(backend, name, os.O_RDONLY | os.O_NOFOLLOW | dio.open_flags)
    try:
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise from_os_error(exc, "fstat", name) from exc
        if last > size:
            raise CheckpointCorruptError(f"{name}: file is truncated ({size} bytes, data needs {last})")

        def short(at: int) -> CheckpointCorruptError:
            return CheckpointCorruptError(f"{name}: file shrank while reading (short read at {at})")

        async def into_destination(off: int, dest: torch.Tensor) -> None:
            if await backend.read(fd, dest.numpy(), off) != dest.numel():
                raise short(off)

        async def through_staging(ws: int, we: int) -> None:
            buf = await pool.acquire()
            try:
                got = await backend.read(fd, buf.view[: we - ws], ws)
                if got < min(we, last) - ws:
                    raise short(ws)
                # A window's copies out (one or thousands of small tensors) in one go.
                await _copy_off_loop(we - ws, _copy_window_out, staged, starts, ws, we, buf.address)
            finally:
                pool.release(buf)

        await run_all(
            [
                *(into_destination(off, dest) for off, dest in direct),
                *(through_staging(ws, we) for ws, we in windows),
            ]
        )
    finally:
        await backend.close(fd)
