"""FileWriter and read_segments over both backends, direct and buffered."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import aiopersist
from aiopersist._stream import FileWriter, read_segments, run_all
from tests.conftest import Gate, mounted_image

pytestmark = pytest.mark.asyncio

CHUNK = 64 << 10


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize(
    "size", [0, 1, 511, 512, 4095, 4096, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 12345]
)
async def test_exact_size_and_content(
    backend: aiopersist.IOBackend, io_mode: str, tmp_path: Path, size: int
) -> None:
    dio = aiopersist.probe_directory(tmp_path)
    assert dio.direct == (io_mode == "direct") or (io_mode == "direct" and not dio.direct)
    pool = aiopersist.StagingPool(CHUNK, 3)
    data = _bytes(size)
    path = tmp_path / "f.bin"
    async with FileWriter(backend, path, dio, pool) as w:
        # uneven pieces, mixing tensors and bytes-like sources
        await w.write(data[: size // 3])
        await w.write(memoryview(data[size // 3 : size // 2].numpy()))
        await w.write(data[size // 2 :])
    assert w.bytes_written == size
    assert path.stat().st_size == size  # padded tail truncated away
    assert path.read_bytes() == data.numpy().tobytes()
    assert pool.in_use == 0
    assert pool.peak_in_use <= pool.count
    back = torch.empty(size, dtype=torch.uint8)
    await read_segments(backend, path, dio, pool, [(0, back)])
    assert torch.equal(back, data)
    pool.close()


async def test_a_tensor_without_storage_is_refused_not_read_from_address_0(
    backend: aiopersist.IOBackend, tmp_path: Path
) -> None:
    """A wrapper tensor subclass reports a data pointer of 0: the writer raises instead of
    copying from there (which would crash the process), however the tensor is queued."""
    from torch.testing._internal.two_tensor import TwoTensor

    dio = aiopersist.probe_directory(tmp_path)
    pool = aiopersist.StagingPool(CHUNK, 3)
    for small in (True, False):
        n = 64 if small else 3 * CHUNK  # queued in a buffer's batch, or written on its own
        two = TwoTensor(torch.ones(n, dtype=torch.uint8), torch.ones(n, dtype=torch.uint8))
        assert two.data_ptr() == 0
        with pytest.raises(ValueError, match="TwoTensor has no storage of its own"):
            async with FileWriter(backend, tmp_path / f"f{n}", dio, pool) as w:
                await w.write_stable([_bytes(100), two, _bytes(10)])
        assert pool.in_use == 0
    pool.close()


async def test_many_small_pieces_land_in_order_with_the_rest(
    backend: aiopersist.IOBackend, io_mode: str, tmp_path: Path
) -> None:
    """`write_stable` queues small contiguous tensors without awaiting; every other kind of
    piece (bytes, a strided view, one that fills a buffer, empty ones) takes `write`'s way.
    Whatever the mix, the file is the pieces in order."""
    dio = aiopersist.probe_directory(tmp_path)
    pool = aiopersist.StagingPool(CHUNK, 2)
    src = _bytes(8 * CHUNK, seed=5)
    pieces: list[Any] = []
    pos = 0
    for i, n in enumerate([1, 7, 4096, 0, 300, CHUNK - 11, 13, 2 * CHUNK + 5, 64, 3, CHUNK, 511] * 2):
        n = min(n, src.numel() - pos)
        piece = src[pos : pos + n]
        if i % 5 == 1:
            pieces.append(piece.numpy().tobytes())
        elif i % 7 == 3 and n >= 2:
            # A strided view with the same bytes in row-major order: (n/2, 2) transposed back.
            half = n // 2 * 2
            pieces.append(piece[:half].reshape(2, half // 2).t().contiguous().t())
            if n > half:
                pieces.append(piece[half:])
        else:
            pieces.append(piece)
        pos += n
    path = tmp_path / "m.bin"
    async with FileWriter(backend, path, dio, pool) as w:
        await w.write_stable(pieces)
        await w.copied()
    assert w.bytes_written == pos
    assert path.read_bytes() == src[:pos].numpy().tobytes()
    assert pool.in_use == 0
    assert pool.peak_in_use <= 2
    pool.close()


async def test_segments_land_where_they_belong(
    backend: aiopersist.IOBackend, io_mode: str, tmp_path: Path
) -> None:
    dio = aiopersist.probe_directory(tmp_path)
    pool = aiopersist.StagingPool(CHUNK, 2)
    data = _bytes(5 * CHUNK + 77, seed=3)
    path = tmp_path / "s.bin"
    path.write_bytes(data.numpy().tobytes())
    cuts = [(5, 100), (100, CHUNK + 3), (CHUNK + 3, CHUNK + 3), (2 * CHUNK + 1, 5 * CHUNK + 77)]
    dests = [(a, torch.empty(b - a, dtype=torch.uint8)) for a, b in cuts]
    await read_segments(backend, path, dio, pool, dests)
    for (a, b), (_, d) in zip(cuts, dests, strict=True):
        assert torch.equal(d, data[a:b])
    assert pool.peak_in_use <= 2
    pool.close()


async def test_truncated_file_is_reported(backend: aiopersist.IOBackend, tmp_path: Path) -> None:
    dio = aiopersist.probe_directory(tmp_path)
    pool = aiopersist.StagingPool(CHUNK, 2)
    path = tmp_path / "t.bin"
    path.write_bytes(b"x" * 1000)
    with pytest.raises(aiopersist.CheckpointCorruptError, match="truncated"):
        await read_segments(backend, path, dio, pool, [(500, torch.empty(1000, dtype=torch.uint8))])
    pool.close()


async def test_shared_pool_never_exceeded_by_concurrent_writers(
    backend: aiopersist.IOBackend, tmp_path: Path
) -> None:
    dio = aiopersist.probe_directory(tmp_path)
    pool = aiopersist.StagingPool(CHUNK, 3)
    datas = [_bytes(7 * CHUNK + i, seed=i) for i in range(4)]

    async def one(i: int) -> None:
        async with FileWriter(backend, tmp_path / f"w{i}", dio, pool) as w:
            for piece in datas[i].split(CHUNK // 3):
                await w.write(piece)

    await asyncio.gather(*(one(i) for i in range(4)))
    for i, d in enumerate(datas):
        assert (tmp_path / f"w{i}").read_bytes() == d.numpy().tobytes()
    assert pool.peak_in_use <= 3
    assert pool.in_use == 0
    pool.close()


async def test_cancelled_writer_returns_every_buffer(backend: aiopersist.IOBackend, tmp_path: Path) -> None:
    dio = aiopersist.probe_directory(tmp_path)
    pool = aiopersist.StagingPool(1 << 20, 4)
    data = _bytes(64 << 20)

    async def write_all() -> None:
        async with FileWriter(backend, tmp_path / "c", dio, pool) as w:
            for piece in data.split(1 << 20):
                await w.write(piece)

    task = asyncio.create_task(write_all())
    for _ in range(10_000):  # until requests are in flight (bounded: no endless loop)
        if backend.in_flight >= 2:
            break
        await asyncio.sleep(0)
    assert backend.in_flight >= 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.in_use == 0
    assert backend.in_flight == 0
    pool.close()  # unmaps: would raise BufferError if a request still held one


@pytest.mark.slow
async def test_512_mib_round_trip(backend: aiopersist.IOBackend, tmp_path: Path) -> None:
    dio = aiopersist.probe_directory(tmp_path)
    pool = aiopersist.StagingPool()
    size = (512 << 20) + 4321  # with an unaligned tail
    data = _bytes(size, seed=11)
    path = tmp_path / "big.bin"
    async with FileWriter(backend, path, dio, pool) as w:
        for piece in data.split(48 << 20):
            await w.write(piece)
    assert path.stat().st_size == size
    back = torch.empty(size, dtype=torch.uint8)
    await read_segments(backend, path, dio, pool, [(0, back)])
    assert torch.equal(back, data)
    pool.close()
    os.unlink(path)


@pytest.mark.root
async def test_writer_on_full_file_system(backend: aiopersist.IOBackend, small_fs: Path) -> None:
    dio = aiopersist.probe_directory(small_fs)
    pool = aiopersist.StagingPool(CHUNK, 2)
    with pytest.raises(aiopersist.DiskFullError):
        async with FileWriter(backend, small_fs / "full", dio, pool) as w:
            await w.write(_bytes(8 << 20))
    assert pool.in_use == 0
    pool.close()


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.mark.parametrize("hint", ["exact", "larger", "smaller"])
async def test_a_file_of_known_size_is_allocated_before_its_first_write(
    backend: aiopersist.IOBackend, tmp_path: Path, hint: str
) -> None:
    """Its size known, a direct file's blocks are allocated when it is opened: its requests
    write into allocated blocks (on ext4 they then run side by side, not one at a time).
    It ends with exactly the bytes written, whatever the size it was given."""
    dio = aiopersist.probe_directory(tmp_path)
    if not dio.direct:
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    size = 3 * CHUNK + 12345
    given = {"exact": size, "larger": size + 5 * CHUNK, "smaller": 2 * CHUNK}[hint]
    pool = aiopersist.StagingPool(CHUNK, 3)
    data = _bytes(size)
    path = tmp_path / "f.bin"
    async with FileWriter(backend, path, dio, pool, size=given) as w:
        assert path.stat().st_size == dio.align_up(given)
        assert _allocated(path) >= given
        await w.write(data)
    assert path.stat().st_size == size
    assert path.read_bytes() == data.numpy().tobytes()
    assert pool.in_use == 0
    pool.close()


@pytest.mark.parametrize("case", ["switched off", "one request", "buffered"])
async def test_no_preallocation_where_it_does_not_serve(
    backend: aiopersist.IOBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """``AIOPERSIST_PREALLOCATE=0``; a file that one request writes; a buffered file (the
    page cache allocates at writeback): the file grows as it is written."""
    if case == "switched off":
        monkeypatch.setenv("AIOPERSIST_PREALLOCATE", "0")
    if case == "buffered":
        monkeypatch.setenv("AIOPERSIST_DIRECT_IO", "0")
    dio = aiopersist.probe_directory(tmp_path)
    size = CHUNK if case == "one request" else 3 * CHUNK
    pool = aiopersist.StagingPool(CHUNK, 3)
    path = tmp_path / "f.bin"
    async with FileWriter(backend, path, dio, pool, size=size) as w:
        assert path.stat().st_size == 0
        await w.write(_bytes(size))
    assert path.read_bytes() == _bytes(size).numpy().tobytes()
    pool.close()


@pytest.mark.root
async def test_a_file_larger_than_the_free_space_fails_at_open_having_written_nothing(
    backend: aiopersist.IOBackend, tmp_path: Path
) -> None:
    """A real ext4 file system with 2.4 MiB free and a file of 8 MiB: `DiskFullError` from
    the allocation, before any request, and no descriptor or buffer left behind."""
    with mounted_image(tmp_path / "fs", 4 << 20) as fs:
        dio = aiopersist.probe_directory(fs)
        assert dio.direct
        pool = aiopersist.StagingPool(CHUNK, 3)
        fds = len(os.listdir("/proc/self/fd"))
        with pytest.raises(aiopersist.DiskFullError) as info:
            async with FileWriter(backend, fs / "big", dio, pool, size=8 << 20) as w:
                await w.write(_bytes(8 << 20))
        assert info.value.call == "fallocate"
        assert pool.acquisitions == 0  # not one request made
        assert len(os.listdir("/proc/self/fd")) == fds
        # What the failed allocation took (ext4 keeps it) is given back, not left to fill
        # the disk until the file is removed.
        assert (fs / "big").stat().st_size == 0
        assert _allocated(fs / "big") == 0
        pool.close()


async def test_an_aborted_preallocated_file_is_cut_back_to_what_was_written(
    backend: aiopersist.IOBackend, tmp_path: Path
) -> None:
    """`abort` keeps the file as far as its completed requests wrote it, as a file that
    grew: not at its preallocated length with zeros after (a reader would take it for
    whole)."""
    dio = aiopersist.probe_directory(tmp_path)
    if not dio.direct:
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    pool = aiopersist.StagingPool(CHUNK, 3)
    data = _bytes(2 * CHUNK)
    path = tmp_path / "f.bin"
    with pytest.raises(RuntimeError, match="stop"):
        async with FileWriter(backend, path, dio, pool, size=8 * CHUNK) as w:
            await w.write(data)  # two full buffers: two requests
            raise RuntimeError("stop")
    assert path.stat().st_size == 2 * CHUNK
    assert path.read_bytes() == data.numpy().tobytes()
    assert pool.in_use == 0
    pool.close()


async def test_fallocate_interrupted_by_a_signal_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """EINTR (a FUSE mount passes signals on) is not a failure: the call is made again, as
    Python retries its own system calls. The C call is replaced to make it fail once."""
    import ctypes
    import errno

    from aiopersist import _direct

    real = _direct._libc_fallocate
    assert real is not None
    calls = []

    def interrupted_once(fd: int, mode: int, offset: int, length: int) -> int:
        calls.append(length)
        if len(calls) == 1:
            ctypes.set_errno(errno.EINTR)
            return -1
        return real(fd, mode, offset, length)

    monkeypatch.setattr(_direct, "_libc_fallocate", interrupted_once)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert _direct.preallocate(fd, 1 << 20, "f")
        assert calls == [1 << 20, 1 << 20]
        assert os.fstat(fd).st_size == 1 << 20
    finally:
        os.close(fd)


@pytest.mark.root
async def test_a_file_system_that_cannot_preallocate_is_written_as_it_goes(
    backend: aiopersist.IOBackend, tmp_path: Path
) -> None:
    """ext2 takes O_DIRECT but not ``fallocate`` (no extents): the writer goes on without
    it, and the file is whole."""
    with mounted_image(tmp_path / "fs", 16 << 20, "ext2") as fs:
        dio = aiopersist.probe_directory(fs)
        assert dio.direct
        pool = aiopersist.StagingPool(CHUNK, 3)
        data = _bytes(3 * CHUNK + 7)
        async with FileWriter(backend, fs / "f", dio, pool, size=data.numel()) as w:
            assert (fs / "f").stat().st_size == 0
            await w.write(data)
        assert (fs / "f").read_bytes() == data.numpy().tobytes()
        pool.close()


@pytest.mark.parametrize(("shift", "mem_shift"), [(0, 0), (1, 1), (4096, 0), (0, 1)])
async def test_aligned_destination_is_read_without_staging(
    backend: aiopersist.IOBackend, tmp_path: Path, shift: int, mem_shift: int
) -> None:
    """An aligned destination gets its aligned middle straight from the kernel."""
    from aiopersist._direct import AlignedBuffer

    dio = aiopersist.probe_directory(tmp_path)
    if not dio.direct:
        pytest.skip(f"no O_DIRECT here: {dio.reason}")
    size = 8 * CHUNK + 1000
    data = _bytes(size + 8192, seed=5)
    path = tmp_path / "a.bin"
    path.write_bytes(data.numpy().tobytes())
    mem = AlignedBuffer(size + 8192)
    dest = mem.tensor[mem_shift : mem_shift + size]
    pool = aiopersist.StagingPool(CHUNK, 2)
    await read_segments(backend, path, dio, pool, [(shift, dest)])
    assert torch.equal(dest, data[shift : shift + size])
    if (mem_shift - shift) % dio.mem_align == 0:
        assert pool.acquisitions <= 2  # only the unaligned head and tail were staged
    else:
        assert pool.acquisitions >= 8  # memory and file disagree on alignment: all staged
    pool.close()
    del dest
    mem.close()


async def test_non_contiguous_tensor_is_written_in_bounded_blocks(
    backend: aiopersist.IOBackend, tmp_path: Path
) -> None:
    dio = aiopersist.probe_directory(tmp_path)
    pool = aiopersist.StagingPool(CHUNK, 2)
    t = torch.randn(300, 200).t()  # non-contiguous
    third = torch.randn(10, 10, 10).permute(2, 0, 1)
    async with FileWriter(backend, tmp_path / "nc", dio, pool) as w:
        await w.write(t)
        await w.write(third)
    expected = t.contiguous().numpy().tobytes() + third.contiguous().numpy().tobytes()
    assert (tmp_path / "nc").read_bytes() == expected
    pool.close()


async def test_strided_1d_tensor_is_never_copied_whole(
    backend: aiopersist.IOBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dio = aiopersist.probe_directory(tmp_path)
    pool = aiopersist.StagingPool(CHUNK, 2)
    base = torch.randn(8 << 20)  # 32 MiB
    strided = base[::2]  # 16 MiB, 1-D, non-contiguous
    wide = torch.randn(2, 3 << 20)[:, ::3]  # two rows of 4 MiB, each larger than a buffer
    expected = strided.contiguous().numpy().tobytes() + wide.contiguous().numpy().tobytes()
    largest = 0
    original = torch.Tensor.contiguous

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal largest
        if not self.is_contiguous():
            largest = max(largest, self.numel() * self.element_size())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", counting)
    async with FileWriter(backend, tmp_path / "s", dio, pool) as w:
        await w.write(strided)
        await w.write(wide)
    monkeypatch.undo()
    assert 0 < largest <= CHUNK  # gathered a buffer at a time, never whole
    assert (tmp_path / "s").read_bytes() == expected
    pool.close()


# -- run_all: the first failure stops the rest, and they have ended before it is raised ------


async def test_run_all_returns_results_in_order() -> None:
    async def after(delay: float, value: int) -> int:
        await asyncio.sleep(delay)
        return value

    assert await run_all([after(0.02, 1), after(0.0, 2), after(0.01, 3)]) == [1, 2, 3]
    assert await run_all([]) == []


async def test_run_all_raises_the_first_error_as_itself_after_the_others_ended() -> None:
    ended: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.01)  # cleanup that takes a moment, like returning a buffer
            ended.append("slow")

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise aiopersist.DiskFullError(28, "No space left on device", "f")

    with pytest.raises(aiopersist.DiskFullError):  # not an ExceptionGroup
        await asyncio.wait_for(run_all([slow(), fails(), slow()]), 10)
    assert ended == ["slow", "slow"]


async def test_cancelling_run_all_waits_for_every_job() -> None:
    ended: list[int] = []

    async def job(i: int) -> None:
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.01)
            ended.append(i)

    task = asyncio.ensure_future(run_all([job(0), job(1)]))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(ended) == [0, 1]


def _others() -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


@contextlib.contextmanager
def _loop_errors() -> Iterator[list[dict[str, object]]]:
    """What the event loop reports as unhandled (a task's exception nobody retrieved, for
    one), collected instead of logged; garbage is collected before the block ends."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        yield seen
        gc.collect()
    finally:
        loop.set_exception_handler(None)


class _Unpicklable:
    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("this object refuses to be pickled")


async def test_a_failing_file_stops_the_others_before_the_save_raises(
    backend_name: str, tmp_path: Path
) -> None:
    """One file of a save fails (its torch.save raises) while a large tensor file is still
    being written: the save raises that error (typed, naming the file, chained to torch's),
    once nothing of it is running, and leaves nothing behind."""
    state = {"big": _bytes(64 << 20)}
    extra = {"bad.pt": aiopersist.TorchSave({"x": _Unpicklable()})}
    with _loop_errors() as unhandled:
        with pytest.raises(
            aiopersist.UnsupportedStateError, match=r"extra_files\['bad\.pt'\].*refuses to be pickled"
        ):
            await aiopersist.save(state, tmp_path / "ck", extra_files=extra, backend=backend_name)
        assert not _others()
    assert unhandled == []
    assert os.listdir(tmp_path) == []


async def test_cancelling_a_save_stops_its_torch_save_thread(backend_name: str, tmp_path: Path) -> None:
    """A file that torch.save produces in a worker thread: cancelling the save waits for
    the thread (it cannot be interrupted), stops it at its next write, and leaves nothing
    running or on disk."""
    gate = Gate()
    obj = {"gate": gate, "big": _bytes(8 << 20)}
    task = asyncio.ensure_future(
        aiopersist.save(
            {"w": _bytes(1024)},
            tmp_path / "ck",
            extra_files={"optimizer.pt": aiopersist.TorchSave(obj)},
            backend=backend_name,
        )
    )
    with _loop_errors() as unhandled:
        assert await asyncio.to_thread(gate.entered.wait, 30)  # torch.save is pickling
        task.cancel()
        await asyncio.sleep(0.1)
        assert not task.done()  # waiting for the thread, which still uses the writer
        gate.go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not _others()
    assert unhandled == []
    assert os.listdir(tmp_path) == []


class _BrokenHasher:
    """A checksum that fails on its ``fail_at``-th update."""

    def __init__(self, fail_at: int) -> None:
        self.left = fail_at

    def update(self, data: object, /) -> None:
        self.left -= 1
        if self.left == 0:
            raise ZeroDivisionError("hasher broke")


@pytest.mark.parametrize("fail_at", [1, 3])  # a full buffer's checksum (in write), or the tail's (in finish)
async def test_a_failing_checksum_leaks_no_fd_and_no_buffer(
    backend: aiopersist.IOBackend, tmp_path: Path, fail_at: int
) -> None:
    dio = aiopersist.probe_directory(tmp_path)
    pool = aiopersist.StagingPool(CHUNK, 3)
    fds = len(os.listdir("/proc/self/fd"))
    w = FileWriter(backend, tmp_path / "f.bin", dio, pool, hasher=_BrokenHasher(fail_at))
    with pytest.raises(ZeroDivisionError, match="hasher broke"):
        async with w:
            await w.write(_bytes(2 * CHUNK + 100))
    assert pool.in_use == 0
    assert len(os.listdir("/proc/self/fd")) == fds
    pool.close()


# -- staging memory kept between pools ---------------------------------------------------------


@pytest.fixture
def no_spares() -> Iterator[None]:
    """The process's idle staging buffers released before and after the test."""
    from aiopersist._staging import release_spare

    release_spare()
    yield
    release_spare()


async def test_a_closed_pool_s_buffers_serve_the_next_pool_and_leak_nothing_into_its_files(
    backend: aiopersist.IOBackend, io_mode: str, tmp_path: Path, no_spares: None
) -> None:
    """The next save's pool takes the buffers a finished one left (no new mapping), and
    what those buffers held never reaches a file: a short file written through them after
    a long one of other bytes has exactly its own bytes and length (the padded tail is
    zeroed, then truncated away)."""
    from aiopersist._staging import _spare

    dio = aiopersist.probe_directory(tmp_path)
    first = aiopersist.StagingPool(CHUNK, 3)
    async with FileWriter(backend, tmp_path / "a", dio, first) as w:
        await w.write(torch.full((3 * CHUNK + 100,), 0xFF, dtype=torch.uint8))
    addresses = {b.address for b in first._free}
    first.close()
    assert {b.address for b in _spare} == addresses  # kept, not unmapped
    second = aiopersist.StagingPool(CHUNK, 3)
    for size in (7, CHUNK + 7):
        data = _bytes(size, seed=size)
        async with FileWriter(backend, tmp_path / f"b{size}", dio, second) as w:
            await w.write(data)
        raw = (tmp_path / f"b{size}").read_bytes()
        assert raw == data.numpy().tobytes()
        back = torch.empty(size, dtype=torch.uint8)
        await read_segments(backend, tmp_path / f"b{size}", dio, second, [(0, back)])
        assert torch.equal(back, data)
    assert second._created == 0  # every buffer it used was the first pool's
    assert {b.address for b in second._free} <= addresses
    second.close()


@pytest.mark.parametrize(("keep", "kept"), [("0", 0), (str(CHUNK), 1), (str(2 * CHUNK + 1), 2), ("", 3)])
async def test_the_idle_staging_memory_kept_is_bounded(
    backend: aiopersist.IOBackend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_spares: None,
    keep: str,
    kept: int,
) -> None:
    """``AIOPERSIST_STAGING_KEEP_BYTES`` bounds what closed pools leave mapped (0: none;
    by default one default pool's worth); the rest is unmapped."""
    from aiopersist._staging import _spare

    monkeypatch.setenv("AIOPERSIST_STAGING_KEEP_BYTES", keep)
    dio = aiopersist.probe_directory(tmp_path)
    pool = aiopersist.StagingPool(CHUNK, 3)
    async with FileWriter(backend, tmp_path / "a", dio, pool) as w:
        await w.write(_bytes(3 * CHUNK))
    assert len(pool._free) == 3
    closed = list(pool._free)
    pool.close()
    assert len(_spare) == kept
    for buf in closed:
        assert buf._map.closed == (buf not in _spare)


async def test_a_verify_stopped_mid_file_hands_each_buffer_back_once(
    backend_name: str, tmp_path: Path, no_spares: None
) -> None:
    """A verify that stops while hashing a file (here its ``progress`` raises after the
    first window) gave the windows it had hashed back to the pool a second time: the
    same buffer twice among the free ones, for two readers at once, and the pool's bound
    exceeded. Each goes back once: the buffers left over are distinct, and the next
    verify of the same checkpoint passes."""
    from aiopersist._staging import _spare

    path = tmp_path / "ck"
    await aiopersist.save({"w": torch.arange(5 << 20, dtype=torch.int32)}, path, backend=backend_name)
    calls = 0

    def stop(done: int, total: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("stopped by the caller")

    with pytest.raises(RuntimeError, match="stopped by the caller"):
        await aiopersist.verify(path, backend=backend_name, progress=stop)
    assert len({id(b) for b in _spare}) == len(_spare)
    await aiopersist.verify(path, backend=backend_name)
    assert len({id(b) for b in _spare}) == len(_spare)
