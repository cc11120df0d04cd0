"""The raw sequential I/O benchmark behind ``aiopersist bench raw``.

What it measures: how fast one large file is written (open, write everything, fsync,
close) and read back (open, read everything into memory, close) by each method, all with
the same request size (the staging chunk) and the same number of requests in flight (the
staging buffers):

- ``fio``: the reference. ``fio --ioengine=io_uring --direct=1`` with ``--bs`` the chunk
  size and ``--iodepth`` the buffer count (``--end_fsync=1`` on writes); its own
  ``bw_bytes`` figure is taken. Skipped, with a note, when ``fio`` is not installed.
- ``io_uring`` and ``threads``: aiopersist's engine, a `FileWriter`
  over that backend for writes and `read_segments` for reads, through a
  `StagingPool` of that geometry. The bytes come from (and go to) a
  ``uint8`` tensor in memory, as a checkpoint's would.
- ``buffered``: plain Python file objects (page cache plus ``os.fsync``), the baseline
  that a naive checkpoint writer gets.

Discipline, because a shared disk is noisy:

- The methods are interleaved: every round runs each method's write, then each method's
  read, and the starting method rotates from round to round, so that a slow spell of the
  disk is spread over the methods instead of landing on one.
- Before every timed write and read the dirty pages are synced and, when running as root,
  the page cache is dropped (``/proc/sys/vm/drop_caches``), so that no method reads from
  memory or inherits another's writeback. Without root the caches stay and the report
  says so.
- Every write goes to a fresh file: the previous round's is deleted before the sync and
  the clock, so that no method overwrites blocks already allocated (fio would) or pays
  inside its timing for freeing them (an ``O_TRUNC`` open would).
- Medians over the rounds are reported, with each method's ratio to fio's median.
- The first round checks that the bytes read back are the bytes written.

Setting up (the source data, the backend, the staging buffers' memory) is not timed; a
write is timed from the open to the close after fsync, a read from the open to the close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from aiopersist import (
    BackendUnavailableError,
    DirectIOInfo,
    FileWriter,
    IOBackend,
    StagingPool,
    create_backend,
    probe_directory,
    read_segments,
)

from .. import _knobs
from .._backends import resolve_backend_name
from .._direct import AlignedBuffer

METHODS: tuple[str, ...] = ("fio", "io_uring", "threads", "buffered")
"""Every method, in the default order."""

_GiB = 1 << 30
_MiB = 1 << 20
# The engine and the buffered method are fed (and drained) in pieces of this size, the
# way a checkpoint hands over one tensor at a time.
_PIECE = 64 * _MiB
# Random generation in pieces keeps its scratch memory small next to a multi-GiB source.
_RANDOM_PIECE = 256 * _MiB
_DROP_CACHES = "/proc/sys/vm/drop_caches"


@dataclass(frozen=True)
class MethodResult:
    """One method's figures, in GiB/s (2**30 bytes per second)."""

    method: str
    write_gibs: tuple[float, ...]
    """Write throughput of each round, in round order."""
    read_gibs: tuple[float, ...]
    """Read throughput of each round, in round order."""
    write_median: float
    read_median: float
    write_vs_fio: float | None
    """``write_median / fio's write_median``; ``None`` when fio did not run."""
    read_vs_fio: float | None
    """``read_median / fio's read_median``; ``None`` when fio did not run."""


@dataclass(frozen=True)
class RawReport:
    """What `run_raw` measured, and under which conditions."""

    directory: str
    size_bytes: int
    """Bytes written and read per method and round."""
    rounds: int
    chunk_bytes: int
    """Request size (staging buffer size, fio ``--bs``)."""
    buffers: int
    """Requests in flight (staging buffers, fio ``--iodepth``)."""
    direct_io: bool
    """Whether the directory takes ``O_DIRECT`` (the engine uses it when it does)."""
    alignment: int
    """Direct-I/O offset alignment of the directory (1 when buffered)."""
    caches_dropped: bool
    """Whether the page cache was dropped before every timed call."""
    results: tuple[MethodResult, ...]
    """The methods that ran, in the order asked for."""
    skipped: tuple[str, ...]
    """Methods asked for that could not run (see ``notes`` for why)."""
    notes: tuple[str, ...]

    def result(self, method: str) -> MethodResult | None:
        """The figures of ``method``, or ``None`` if it did not run."""
        for r in self.results:
            if r.method == method:
                return r
        return None


class _CacheDropper:
    """Syncs and drops the page cache; remembers whether it could."""

    def __init__(self) -> None:
        self.enabled = os.geteuid() == 0
        self.note: str | None = (
            None if self.enabled else "not running as root: the page cache was not dropped"
        )

    def __call__(self) -> None:
        os.sync()
        if not self.enabled:
            return
        try:
            with open(_DROP_CACHES, "w") as f:
                f.write("3\n")
        except OSError as exc:
            # A container can deny this even to root; the run goes on, flagged.
            self.enabled = False
            self.note = f"the page cache could not be dropped ({exc}); reads may have come from memory"


def _gibs(nbytes: int, seconds: float) -> float:
    return nbytes / _GiB / seconds if seconds > 0 else float("inf")


def _random_source(size: int) -> torch.Tensor:
    source = torch.empty(size, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(20240601)
    for pos in range(0, size, _RANDOM_PIECE):
        source[pos : pos + _RANDOM_PIECE].random_(0, 256, generator=gen)
    return source


# -- fio ------------------------------------------------------------------------------------


def _thp_mode() -> str:
    """The kernel's transparent-huge-page mode (the bracketed word), or ``unknown``."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


class _HugePages:
    """Reserve hugetlb pages for fio's buffers while the benchmark runs (root only).

    The engine's staging buffers sit on transparent huge pages (see `AlignedBuffer`);
    fio's own buffers only get huge pages from a hugetlb reservation (``--iomem=shmhuge``).
    Without it fio's requests would be split into many more memory segments than the
    engine's and the comparison would flatter the engine. The old setting is restored.
    """

    _KNOB = "/proc/sys/vm/nr_hugepages"

    def __init__(self, nbytes: int) -> None:
        self.wanted = -(-nbytes // (2 << 20)) + 4
        self.before: int | None = None
        self.ok = False

    def __enter__(self) -> _HugePages:
        if os.geteuid() != 0 or not os.path.exists(self._KNOB):
            return self
        with contextlib.suppress(OSError, ValueError):
            with open(self._KNOB) as f:
                self.before = int(f.read())
            with open(self._KNOB, "w") as f:
                f.write(str(self.before + self.wanted))
            with open(self._KNOB) as f:
                self.ok = int(f.read()) >= self.before + self.wanted
        return self

    def __exit__(self, *exc: object) -> None:
        if self.before is not None:
            with contextlib.suppress(OSError), open(self._KNOB, "w") as f:
                f.write(str(self.before))


def _fio_run(fio: str, path: str, rw: str, size: int, chunk: int, buffers: int, huge: bool) -> float:
    """Throughput in GiB/s by fio's own ``bw_bytes``."""
    cmd = [
        fio,
        "--name=aiopersist-raw",
        # fio splits --filename on ':' (several files), so a colon in the path is escaped.
        "--filename=" + path.replace(":", "\\:"),
        f"--rw={rw}",
        f"--bs={chunk}",
        f"--size={size}",
        "--ioengine=io_uring",
        "--direct=1",
        f"--iodepth={buffers}",
        "--output-format=json",
    ]
    if huge:
        cmd.append("--iomem=shmhuge")
    if rw == "write":
        # No preallocation: the engine's writes extend a fresh file, so fio's do too.
        cmd += ["--end_fsync=1", "--fallocate=none"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise RuntimeError(f"fio {rw} failed (exit status {proc.returncode}): {tail}")
    # fio may print warnings before the JSON document.
    start = proc.stdout.find("{")
    if start < 0:
        raise RuntimeError(f"fio {rw} printed no JSON: {proc.stdout.strip()[-2000:]}")
    data: dict[str, Any] = json.loads(proc.stdout[start:])
    bw = float(data["jobs"][0][rw]["bw_bytes"])
    if bw <= 0:
        raise RuntimeError(f"fio {rw} reported no bandwidth")
    return bw / _GiB


# -- aiopersist's engine ------------------------------------------------------------------


async def _warm_pool(pool: StagingPool) -> None:
    # Fault every staging buffer's pages in before the clock starts, as fio allocates its
    # buffers before it measures: the benchmark is about the I/O path.
    bufs = [await pool.acquire() for _ in range(pool.count)]
    for buf in bufs:
        buf.tensor.fill_(0)
    for buf in bufs:
        pool.release(buf)


@contextlib.asynccontextmanager
async def _engine(
    backend_name: str, chunk: int, buffers: int
) -> AsyncIterator[tuple[IOBackend, StagingPool]]:
    """A backend and a warmed pool of the benchmark's geometry, released afterwards."""
    backend = create_backend(backend_name, queue_depth=buffers)
    pool = StagingPool(chunk, buffers)
    try:
        await _warm_pool(pool)
        yield backend, pool
    finally:
        pool.close()
        await backend.aclose()


async def _engine_write(
    backend_name: str, path: str, dio: DirectIOInfo, source: torch.Tensor, chunk: int, buffers: int
) -> float:
    async with _engine(backend_name, chunk, buffers) as (backend, pool):
        start = time.perf_counter()
        async with FileWriter(backend, path, dio, pool) as writer:
            for pos in range(0, source.numel(), _PIECE):
                await writer.write(source[pos : pos + _PIECE])
        return time.perf_counter() - start


async def _engine_read(
    backend_name: str, path: str, dio: DirectIOInfo, dest: torch.Tensor, chunk: int, buffers: int
) -> float:
    async with _engine(backend_name, chunk, buffers) as (backend, pool):
        start = time.perf_counter()
        await read_segments(backend, path, dio, pool, [(0, dest)])
        return time.perf_counter() - start


# -- plain Python files ----------------------------------------------------------------------


def _buffered_write(path: str, source: torch.Tensor) -> float:
    view = source.numpy().data
    total = len(view)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        pos = 0
        while pos < total:
            end = min(pos + _PIECE, total)
            while pos < end:
                pos += f.write(view[pos:end])
        os.fsync(f.fileno())
    return time.perf_counter() - start


def _buffered_read(path: str, dest: torch.Tensor) -> float:
    view = dest.numpy().data
    total = len(view)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < total:
            n = f.readinto(view[pos : min(pos + _PIECE, total)])
            if not n:
                raise RuntimeError(f"{path}: file ended after {pos} of {total} bytes")
            pos += n
    return time.perf_counter() - start


# -- the run -----------------------------------------------------------------------------------


def _check_methods(methods: Sequence[str] | None) -> tuple[str, ...]:
    if methods is None:
        return METHODS
    if isinstance(methods, str):
        raise TypeError("methods must be a sequence of method names, not one string")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(
            f"unknown method(s) {', '.join(map(repr, unknown))}; expected some of {', '.join(METHODS)}"
        )
    chosen = tuple(dict.fromkeys(methods))
    if not chosen:
        raise ValueError("no method to run")
    return chosen


def _rotated(seq: tuple[str, ...], by: int) -> tuple[str, ...]:
    """Round ``by``'s order: rotated by ``by`` and, every other round, reversed. Rotation
    alone keeps each method's predecessor, and the one after a method that churns memory
    (1 GiB freed, fresh pages to fault in) pays for it in every round; reversing gives each
    method both neighbours."""
    k = by % len(seq)
    order = seq[k:] + seq[:k]
    return order if by % 2 == 0 else order[::-1]


def run_raw(
    directory: str,
    *,
    size_bytes: int = 2 << 30,
    rounds: int = 3,
    chunk_bytes: int | None = None,
    buffers: int | None = None,
    methods: Sequence[str] | None = None,
    out: TextIO = sys.stdout,
) -> RawReport:
    """Measure sequential write and read throughput of each method; see the module docstring.

    Each method writes its own ``size_bytes`` file in ``directory`` (created if missing);
    the files are deleted at the end. ``chunk_bytes`` and ``buffers`` default to the
    staging knobs. ``size_bytes`` is rounded down to a whole number of chunks so that every
    method issues the same requests. Progress lines go to ``out``. Needs about twice
    ``size_bytes`` of memory (the source and the destination) and ``size_bytes`` of disk
    per method.
    """
    chunk = chunk_bytes if chunk_bytes is not None else _knobs.chunk_bytes()
    nbuf = buffers if buffers is not None else _knobs.staging_buffers()
    StagingPool(chunk, nbuf)  # the pool's own checks on the geometry, before any work
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    size = size_bytes - size_bytes % chunk
    if size <= 0:
        raise ValueError(f"size_bytes={size_bytes} is less than one chunk of {chunk} bytes")
    wanted = _check_methods(methods)

    notes: list[str] = []
    if size != size_bytes:
        notes.append(f"size rounded down from {size_bytes} to {size} bytes (a whole number of chunks)")
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    dio = probe_directory(directory)
    if dio.direct and chunk % dio.offset_align:
        raise ValueError(f"chunk_bytes={chunk} is not a multiple of the {dio.offset_align}-byte alignment")
    if not dio.direct:
        notes.append(f"no O_DIRECT in {directory} ({dio.reason}): the engine used buffered I/O plus fsync")

    skipped: list[str] = []
    fio = shutil.which("fio")
    runnable: list[str] = []
    for m in wanted:
        if m == "fio":
            if fio is None:
                skipped.append(m)
                notes.append("fio is not on PATH: fio was skipped and there are no ratios")
                continue
            if not dio.direct:
                skipped.append(m)
                notes.append("fio was skipped: it runs with --direct=1, which this directory refuses")
                continue
        elif m in ("io_uring", "threads"):
            try:
                resolve_backend_name(m)
            except BackendUnavailableError as exc:
                skipped.append(m)
                notes.append(f"{m} was skipped: {exc}")
                continue
        runnable.append(m)
    order = tuple(runnable)
    if not order:
        raise RuntimeError("none of the methods asked for can run here: " + "; ".join(notes))

    free = shutil.disk_usage(directory).free
    if free < size * len(order):
        raise RuntimeError(
            f"{directory} has {free / _GiB:.2f} GiB free; "
            f"{len(order)} files of {size / _GiB:.2f} GiB are needed"
        )

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    drop = _CacheDropper()
    say(
        f"raw sequential I/O: {_size_text(size)} per file, {rounds} round(s), "
        f"{_size_text(chunk)} requests, {nbuf} in flight, in {directory}"
    )
    source = _random_source(size)
    # The destination is aligned memory, as the engine's loader allocates for large tensors,
    # so the engine reads straight into it; filled now so its pages are faulted in.
    dest_mem = AlignedBuffer(size)
    dest = dest_mem.tensor
    dest.fill_(0)
    huge = _HugePages(chunk * nbuf)
    if "fio" in order:
        huge.__enter__()
        notes.append(
            "fio's buffers are on hugetlb pages (--iomem=shmhuge)"
            if huge.ok
            else "fio's buffers are on ordinary pages: no hugetlb pages could be reserved"
        )
    notes.append(f"the engine's buffers ask for transparent huge pages (THP: {_thp_mode()})")

    token = uuid.uuid4().hex[:12]
    paths = {m: os.path.join(directory, f".aiopersist-bench-{m}-{token}.bin") for m in order}
    writes: dict[str, list[float]] = {m: [] for m in order}
    reads: dict[str, list[float]] = {m: [] for m in order}

    def write_once(m: str) -> float:
        path = paths[m]
        # Deleted before the clock starts: fio would overwrite an existing file in place,
        # the others would pay for freeing its blocks (O_TRUNC) inside their timing.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        drop()
        if m == "fio":
            assert fio is not None
            return _fio_run(fio, path, "write", size, chunk, nbuf, huge.ok)
        if m == "buffered":
            return _gibs(size, _buffered_write(path, source))
        return _gibs(size, asyncio.run(_engine_write(m, path, dio, source, chunk, nbuf)))

    def read_once(m: str, verify: bool) -> float:
        path = paths[m]
        if m == "fio":
            drop()
            assert fio is not None
            return _fio_run(fio, path, "read", size, chunk, nbuf, huge.ok)
        if verify:
            # A stale copy of the source from another method must not pass for this one's.
            dest.zero_()
        reader: Callable[[], float]
        if m == "buffered":
            reader = lambda: _buffered_read(path, dest)  # noqa: E731
        else:
            reader = lambda: asyncio.run(_engine_read(m, path, dio, dest, chunk, nbuf))  # noqa: E731
        drop()
        gibs = _gibs(size, reader())
        if verify and not torch.equal(dest, source):
            bad = int(torch.nonzero(dest != source)[0].item())
            raise RuntimeError(f"{m}: the bytes read back differ from those written (first at offset {bad})")
        return gibs

    try:
        for r in range(rounds):
            ordered = _rotated(order, r)
            for m in ordered:
                g = write_once(m)
                writes[m].append(g)
                say(f"round {r + 1}/{rounds}  {m:<9} write {g:7.3f} GiB/s")
            for m in ordered:
                g = read_once(m, verify=r == 0)
                reads[m].append(g)
                say(
                    f"round {r + 1}/{rounds}  {m:<9} read  {g:7.3f} GiB/s"
                    + ("  (verified)" if r == 0 and m != "fio" else "")
                )
    finally:
        huge.__exit__()
        for path in paths.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    if drop.note is not None:
        notes.append(drop.note)
    w_med = {m: statistics.median(writes[m]) for m in order}
    r_med = {m: statistics.median(reads[m]) for m in order}
    has_fio = "fio" in order
    results = tuple(
        MethodResult(
            method=m,
            write_gibs=tuple(writes[m]),
            read_gibs=tuple(reads[m]),
            write_median=w_med[m],
            read_median=r_med[m],
            write_vs_fio=w_med[m] / w_med["fio"] if has_fio else None,
            read_vs_fio=r_med[m] / r_med["fio"] if has_fio else None,
        )
        for m in order
    )
    return RawReport(
        directory=directory,
        size_bytes=size,
        rounds=rounds,
        chunk_bytes=chunk,
        buffers=nbuf,
        direct_io=dio.direct,
        alignment=dio.offset_align if dio.direct else 1,
        caches_dropped=drop.enabled,
        results=results,
        skipped=tuple(skipped),
        notes=tuple(notes),
    )


def _size_text(n: int) -> str:
    if n % _GiB == 0:
        return f"{n // _GiB} GiB"
    if n % _MiB == 0:
        return f"{n // _MiB} MiB"
    return f"{n} B"


def format_raw(report: RawReport) -> str:
    """A plain-text table of ``report``: medians, ratios to fio, then every round."""

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    def each(xs: tuple[float, ...]) -> str:
        return " ".join(f"{x:.3f}" for x in xs)

    io_mode = f"O_DIRECT, {report.alignment}-byte alignment" if report.direct_io else "buffered + fsync"
    lines = [
        f"aiopersist raw sequential I/O in {report.directory} ({io_mode})",
        f"{_size_text(report.size_bytes)} per file, {_size_text(report.chunk_bytes)} requests, "
        f"{report.buffers} in flight, {report.rounds} round(s), medians in GiB/s, page cache "
        + ("dropped before each run" if report.caches_dropped else "NOT dropped"),
        "",
    ]
    header = ("method", "write", "vs fio", "read", "vs fio", "write per round", "read per round")
    rows = [
        (
            r.method,
            f"{r.write_median:.3f}",
            ratio(r.write_vs_fio),
            f"{r.read_median:.3f}",
            ratio(r.read_vs_fio),
            each(r.write_gibs),
            each(r.read_gibs),
        )
        for r in report.results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        cells = [
            cell.ljust(w) if i in (0, 5, 6) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    if report.skipped:
        lines.append("")
        lines.append("skipped: " + ", ".join(report.skipped))
    if report.notes:
        lines.append("")
        lines.extend(f"note: {n}" for n in report.notes)
    return "\n".join(lines)


__all__ = ["METHODS", "MethodResult", "RawReport", "format_raw", "run_raw"]
