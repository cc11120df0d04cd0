"""Direct I/O: which directories take ``O_DIRECT``, with what alignment, and aligned memory.

``O_DIRECT`` bypasses the page cache, but the buffer address, the file offset and the
length must all be multiples of the device's alignment. The kernel reports it through
``statx(STATX_DIOALIGN)`` (Linux >= 6.1); when it cannot, 4096 is assumed. Whether a file
system takes ``O_DIRECT`` at all (tmpfs does not) is probed once per device by writing a
block to a scratch file.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import logging
import math
import mmap
import os
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from . import _knobs, _native
from ._exceptions import from_os_error, io_error
from ._names import PROBE_PREFIX

log = logging.getLogger("aiopersist")

PAGE_SIZE = mmap.PAGESIZE
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class DirectIOInfo:
    """How files in one directory are written and read."""

    directory: str
    """The directory this answer is for."""
    direct: bool
    """``O_DIRECT`` works there; otherwise buffered I/O plus fsync."""
    mem_align: int
    """Required alignment of buffer addresses."""
    offset_align: int
    """Offsets and lengths of direct requests are multiples of this."""
    source: str
    """Where the alignment came from: ``statx`` or ``default``."""
    reason: str
    """Why direct I/O is or is not used (for ``aiopersist doctor`` and the log)."""

    @property
    def open_flags(self) -> int:
        """Flags to add to ``open``: ``O_DIRECT`` or nothing."""
        return O_DIRECT if self.direct else 0

    def align_up(self, n: int) -> int:
        """``n`` rounded up to a multiple of `offset_align`."""
        a = self.offset_align
        return -(-n // a) * a


_cache: dict[int, DirectIOInfo] = {}
_buffered_logged: set[int] = set()


def _statx_alignment(path: str) -> tuple[int, int] | None:
    if not _native.has_liburing:
        return None
    from ._native import binding

    try:
        return binding.statx_dioalign(path)
    except OSError:
        return None


def _switched_off(directory: str) -> DirectIOInfo:
    return DirectIOInfo(
        directory, False, PAGE_SIZE, 1, "default", "direct I/O switched off (AIOPERSIST_DIRECT_IO=0)"
    )


def _refused_at_open(directory: str) -> DirectIOInfo:
    return DirectIOInfo(
        directory, False, PAGE_SIZE, 1, "default", "the file system refuses O_DIRECT (EINVAL at open)"
    )


def _probe_fd(fd: int, name: str, directory: str, *, write: bool) -> DirectIOInfo:
    """Alignment of the file open on ``fd`` (``O_DIRECT``), checked by one real aligned
    write or read of a block at offset 0."""
    aligned = _statx_alignment(name)
    mem_align, offset_align = aligned if aligned is not None else (_knobs.DEFAULT_ALIGNMENT,) * 2
    source = "statx" if aligned is not None else "default"

    def buffered(reason: str) -> DirectIOInfo:
        return DirectIOInfo(directory, False, mem_align, offset_align, source, reason)

    if mem_align > PAGE_SIZE:
        return buffered(f"direct I/O needs {mem_align}-byte aligned memory, more than a page")
    block = AlignedBuffer(max(offset_align, PAGE_SIZE))
    try:
        if write:
            os.pwrite(fd, block.view, 0)
        else:
            os.preadv(fd, [block.view], 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return buffered(f"the file system refuses O_DIRECT {'writes' if write else 'reads'} (EINVAL)")
        raise from_os_error(exc, "pwrite" if write else "preadv", name) from exc
    finally:
        block.close()
    return DirectIOInfo(
        directory,
        True,
        mem_align,
        offset_align,
        source,
        f"O_DIRECT works ({offset_align}-byte alignment from {source})",
    )


def _device(path: str) -> int:
    try:
        return os.stat(path).st_dev
    except OSError as exc:
        raise from_os_error(exc, "stat", path) from exc


def probe_directory(directory: str | os.PathLike[str], *, refresh: bool = False) -> DirectIOInfo:
    """Find out whether ``directory`` takes ``O_DIRECT`` and with which alignment.

    Writes one block to a scratch file there. Cached per device (``st_dev``). Raises
    [`CheckpointIOError`][aiopersist.CheckpointIOError] when the directory cannot be
    written at all.
    """
    path = os.path.abspath(os.fspath(directory))
    dev = _device(path)
    if not _knobs.direct_io_enabled():
        return _switched_off(path)
    if not refresh and dev in _cache:
        return dataclasses.replace(_cache[dev], directory=path)
    scratch = os.path.join(path, f"{PROBE_PREFIX}{uuid.uuid4().hex}")
    try:
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL or not O_DIRECT:
            raise from_os_error(exc, "open", scratch) from exc
        info = _refused_at_open(path)
    else:
        try:
            info = _probe_fd(fd, scratch, path, write=True)
        finally:
            os.close(fd)
            os.unlink(scratch)
    if not info.direct and dev not in _buffered_logged:
        _buffered_logged.add(dev)
        log.info("aiopersist: %s: %s; using buffered I/O plus fsync", path, info.reason)
    _cache[dev] = info
    return info


def probe_file_for_read(path: str | os.PathLike[str]) -> DirectIOInfo:
    """Like `probe_directory`, for reading an existing file: needs no write access.

    Opens the file itself with ``O_DIRECT`` and reads its first block. Uses, but does not
    fill, the per-device cache of `probe_directory`.
    """
    name = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(name)
    dev = _device(name)
    if not _knobs.direct_io_enabled():
        return _switched_off(directory)
    if dev in _cache:
        return dataclasses.replace(_cache[dev], directory=directory)
    try:
        fd = open_regular(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL or not O_DIRECT:
            raise from_os_error(exc, "open", name) from exc
        return _refused_at_open(directory)  # no O_DIRECT here (or not a regular file: refused at the read)
    if fd is None:
        return _refused_at_open(directory)  # not a regular file: the read refuses it
    try:
        return _probe_fd(fd, name, directory, write=False)
    finally:
        os.close(fd)


def open_regular(name: str, flags: int) -> int | None:
    """``os.open(name, flags)`` for reading a file a checkpoint lists, never blocking on
    what is not a regular file (a FIFO swapped in after the checks would wait for a writer
    for ever): opened with ``O_NONBLOCK``, which is cleared once the file is known to be
    regular. ``None`` (nothing left open) when it is not one. Where a lease held by
    another process (an NFS delegation, an SMB oplock) makes the non-blocking open fail
    with ``EWOULDBLOCK``, a regular file is opened again, waiting for the lease as a plain
    open does."""
    try:
        fd = os.open(name, flags | os.O_NONBLOCK)
    except BlockingIOError:
        if not stat.S_ISREG(os.lstat(name).st_mode):
            return None
        fd = os.open(name, flags)
    return fd if keep_if_regular(fd) else None


def keep_if_regular(fd: int) -> bool:
    """``True``, with ``O_NONBLOCK`` cleared, when ``fd`` is a regular file; else ``False``,
    and ``fd`` is closed."""
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            return True
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return False


HUGE_PAGE_SIZE = 2 << 20
_MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _load_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], fn)


_libc_madvise = _load_madvise()


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], fn)


_libc_fallocate = _load_fallocate()
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV, errno.ESPIPE)


def preallocate(fd: int, length: int, path: str) -> bool:
    """Allocate the file's first ``length`` bytes and set its size (``fallocate(2)``,
    mode 0), before a direct write fills them.

    On ext4 a direct write that extends a file takes the inode's lock
    exclusively, and io_uring hands such a request to a kernel worker instead of issuing
    it at once: the requests in flight then wait for one another, their workers spinning
    on the lock, CPU time the training process pays for. A write into allocated blocks
    takes the lock shared, and they run side by side. Allocating up front also meets a
    full disk before a byte is written.

    Returns ``False`` where the file system or the C library cannot (the writes then
    allocate as they go); raises `CheckpointIOError` (`DiskFullError` when there is no
    room) for a real failure, after which the file may hold part of the allocation (the
    caller truncates it)."""
    if _libc_fallocate is None or length <= 0:
        return False
    while _libc_fallocate(fd, 0, 0, length) != 0:
        err = ctypes.get_errno()
        if err == errno.EINTR:  # a signal (a FUSE mount passes them on): again, as PEP 475 does
            continue
        if err in _NO_FALLOCATE:
            return False
        raise io_error(err, "fallocate", path)
    return True


def _address(m: mmap.mmap) -> int:
    probe = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe  # drop the buffer export at once, or the mapping could not be closed


class AlignedBuffer:
    """Page-aligned memory (an anonymous mapping), zero-filled, as bytes and as a tensor.

    Buffers of 2 MiB or more start on a 2 MiB boundary and ask for transparent huge
    pages: a 4 MiB request over 4 KiB pages scattered in physical memory needs ~1024
    segments and is split by the block layer, over huge pages it needs 2 (measured here:
    reads through the engine went from ~1.0 to ~3.3 GiB/s).
    """

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"buffer size must be positive, got {size}")
        self.size = size
        huge = size >= HUGE_PAGE_SIZE and hasattr(mmap, "MADV_HUGEPAGE")
        extra = HUGE_PAGE_SIZE if huge else 0
        self._map = mmap.mmap(-1, size + extra, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._offset = (-_address(self._map)) % HUGE_PAGE_SIZE if huge else 0
        if huge:
            with contextlib.suppress(OSError):  # THP off or unsupported: plain pages still work
                self._map.madvise(mmap.MADV_HUGEPAGE, self._offset, size)
        self.view = memoryview(self._map)[self._offset : self._offset + size]
        self.address = _address(self._map) + self._offset
        """Where the buffer starts in memory (valid until `close`)."""
        self._tensor: torch.Tensor | None = None
        self.cuda_pinned = False
        """Whether the memory is registered with CUDA (`pin_for_cuda`)."""

    def pin_for_cuda(self) -> bool:
        """Page-lock the memory for CUDA (``cudaHostRegister``), once, so that copies from
        the GPU into it run at the link's speed and asynchronously, not through the
        driver's own bounce buffer. Slow (the pages are faulted in and locked): call it
        off the event loop. Returns whether the memory is pinned; on failure it stays
        pageable (copies still work, slower)."""
        if self.cuda_pinned:
            return True
        if not torch.cuda.is_available():
            return False
        try:
            # cudaHostRegisterPortable (1): pinned for every device's context, not only the
            # current one (a state may span several GPUs).
            err = torch.cuda.cudart().cudaHostRegister(self.address, self.size, 1)  # type: ignore[no-untyped-call]
        except (RuntimeError, AttributeError):
            return False
        self.cuda_pinned = int(err) == 0
        return self.cuda_pinned

    @property
    def tensor(self) -> torch.Tensor:
        """The same memory as a 1-D ``torch.uint8`` tensor (copies into it release the GIL)."""
        if self._tensor is None:
            self._tensor = torch.frombuffer(
                self._map, dtype=torch.uint8, count=self.size, offset=self._offset
            )
        return self._tensor

    def populate(self) -> None:
        """Fault every page in now (``MADV_POPULATE_WRITE``, Linux >= 5.14; else nothing).

        Fresh memory costs a page fault and a zeroing per page on first touch; for a
        direct read that happens inside the submission, on the event loop's thread. Done
        ahead, in another thread, it overlaps the disk instead. Through ``ctypes``, which
        lets go of the GIL (``mmap.madvise`` holds it, and would stall the event loop).
        """
        if _libc_madvise is not None:
            _libc_madvise(
                self.address - self.address % PAGE_SIZE,
                self.size + self.address % PAGE_SIZE,
                _MADV_POPULATE_WRITE,
            )

    def close(self) -> None:
        """Unmap now, or, while something still holds a view of the memory (a request in
        flight keeps one; so does a traceback that keeps a failed request's frame alive),
        as soon as the last view goes: never under a user of it, and never with an error
        that would hide the one being handled (a close runs in ``finally`` blocks)."""
        self._tensor = None
        if self.cuda_pinned:  # before the unmap, as CUDA asks; no copy into it is in flight
            self.cuda_pinned = False
            with contextlib.suppress(RuntimeError, AttributeError):
                torch.cuda.cudart().cudaHostUnregister(self.address)  # type: ignore[no-untyped-call]
        try:
            self.view.release()
            self._map.close()
        except BufferError:
            pass  # exported: the mapping is unmapped by its destructor after the last export

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"<AlignedBuffer {self.size} bytes>"


def empty_for_direct_read(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    file_offset: int,
    prefault: Callable[[AlignedBuffer], object] | None = None,
) -> torch.Tensor:
    """An uninitialised tensor whose memory is laid out so ``O_DIRECT`` can read the file
    bytes at ``file_offset`` straight into it.

    Its data starts at the same offset within a page as ``file_offset`` does within the
    file, on huge-page-backed memory (see `AlignedBuffer`), so every aligned block of the
    file maps onto an aligned block of memory. The tensor keeps the mapping alive. Falls
    back to ``torch.empty`` when that offset does not suit the dtype's alignment.
    ``prefault`` is handed the new mapping, to fault its pages in ahead of the reads.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    phase = file_offset % PAGE_SIZE
    if nbytes == 0 or phase % dtype.itemsize:
        return torch.empty(shape, dtype=dtype)
    mem = AlignedBuffer(phase + nbytes)
    if prefault is not None:
        prefault(mem)
    flat = torch.frombuffer(mem._map, dtype=dtype, count=math.prod(shape), offset=mem._offset + phase)
    return flat.view(shape)


def copy_bytes(dst: int, src: int, n: int) -> None:
    """``memmove`` between two raw addresses, without holding the GIL.

    The staging copies go through this rather than ``Tensor.copy_``: one thread doing a
    plain memmove costs half the CPU of torch's parallel copy (whose worker threads spin),
    leaving the cores to training and to the kernel's I/O work, and writes were ~4% faster
    here. Callers own the bounds: both ranges must be valid for ``n`` bytes.
    """
    ctypes.memmove(dst, src, n)
