"""The checkpoint benchmark behind ``aiopersist bench save`` and ``aiopersist bench load``.

What it measures: how long it takes to make a model-shaped state durable on disk (save),
or to bring such a checkpoint back into memory (load), with each of the common ways of
doing it, next to the raw speed of the disk.

The state is a flat ``dict[str, torch.Tensor]`` of CPU tensors shaped like a transformer
(`transformer_state`): an embedding, per-layer bf16 ``qkv``, ``out``, ``mlp.up`` and
``mlp.down`` matrices, and fp32 norms and biases, so that there are a few large tensors
and many small ones, as in a real checkpoint. It is generated once, from a fixed seed,
and sized to about ``size_bytes``; every figure counts its tensor bytes only.

Methods (``SAVE_METHODS`` / ``LOAD_METHODS``):

- ``fio``: the disk's limit. ``fio --ioengine=io_uring --direct=1`` writes (or reads) one
  file of the same byte count, with the engine's request size and depth, its buffers on
  hugetlb pages (see ``aiopersist._bench.raw``); fio's own bandwidth figure is taken.
- ``torch.save`` / ``torch.load``: ``torch.save`` into an open file, then flush and
  ``os.fsync``; ``torch.load(weights_only=True, mmap=False)``.
- ``safetensors``: ``safetensors.torch.save_file`` then an ``os.fsync`` of the file;
  ``safetensors.torch.load_file``.
- ``dcp``: ``torch.distributed.checkpoint.save(state, checkpoint_id=dir)`` in this one
  process, no process group, then an fsync of every file it wrote and of the directory;
  ``dcp.load`` into a preallocated state of empty tensors (allocation not timed).
- ``aiopersist-io_uring`` and ``aiopersist-threads``: ``asyncio.run(aiopersist.save(...))``
  and ``asyncio.run(aiopersist.load(...))`` with that backend; a save's durability (file
  and directory fsyncs, atomic rename) is inside its timing, as it is part of the call.

Every save is durable when its clock stops: besides the fsyncs above, the directory that
received the new file or directory is fsynced too, since a new name is not durable until
its directory is, and aiopersist's publication does the same.

Every load must end with every byte in memory: ``safetensors.torch.load_file`` maps the
file lazily (a private file mapping whose pages are read on first access), so inside the
timing every loaded tensor is touched once per page (`_touch`). That fault reads the page
from the disk; for the methods that already hold the bytes in anonymous memory it costs
microseconds. The first round checks that each method's loaded tensors equal the source
(``torch.equal``, same dtype and shape) and raises if not.

Discipline, the same as ``aiopersist bench raw``:

- The methods are interleaved: each round runs every method once, the starting method
  rotating from round to round, so that a slow spell of a shared disk is spread over the
  methods rather than landing on one.
- Before every timed run dirty pages are synced and, as root, the page cache is dropped
  (``/proc/sys/vm/drop_caches``): no load reads from memory and no save inherits
  another's writeback. Without root the report says the caches stayed.
- Every save writes a fresh file or directory (the previous one is deleted, untimed,
  right after its run). For loads, each method writes its own checkpoint once, untimed,
  before the timed rounds.
- Medians over the rounds are reported, with ratios to fio and to the usual baseline
  (``torch.save`` for saves, ``safetensors`` for loads).

Memory: the peak resident-set growth of this process during each timed call is measured
by a thread that reads ``VmRSS`` from ``/proc/self/status`` every ~2 ms, started right
before the call and stopped right after it; where the kernel lets the peak be reset
(``/proc/self/clear_refs``), the exact high-water mark ``VmHWM`` is taken as well, so a
spike shorter than the sampling interval is not missed. The figure is the peak minus the
RSS just before the call. A load's figure includes the loaded state itself (about the
state's size); fio runs in its own process and has none.

Targets (printed with whether this run met them): aiopersist saves at ``SAVE_VS_FIO`` x
fio and ``SAVE_VS_TORCH`` x torch.save, loads at ``LOAD_VS_FIO`` x fio and
``LOAD_VS_SAFETENSORS`` x safetensors, and a save's peak RSS growth stays within the
staging pool (``chunk_bytes x staging_buffers``) plus ``RSS_STATE_FRACTION`` of the state,
checked against the worst round.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import math
import os
import shutil
import statistics
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TextIO

import torch

from aiopersist import BackendUnavailableError, probe_directory
from aiopersist import load as _aiopersist_load
from aiopersist import save as _aiopersist_save

from .. import _knobs
from .._backends import resolve_backend_name
from .._commit import fsync_directory
from .._direct import PAGE_SIZE
from .raw import _CacheDropper, _fio_run, _GiB, _HugePages, _MiB, _rotated, _size_text, _thp_mode

Kind = Literal["save", "load"]

SAVE_METHODS: tuple[str, ...] = (
    "fio",
    "torch.save",
    "safetensors",
    "dcp",
    "aiopersist-io_uring",
    "aiopersist-threads",
)
"""Every save method, in the default order."""
LOAD_METHODS: tuple[str, ...] = (
    "fio",
    "torch.load",
    "safetensors",
    "dcp",
    "aiopersist-io_uring",
    "aiopersist-threads",
)
"""Every load method, in the default order."""

SAVE_VS_FIO = 0.9
SAVE_VS_TORCH = 2.5
LOAD_VS_FIO = 0.9
LOAD_VS_SAFETENSORS = 1.5
RSS_STATE_FRACTION = 0.10

_AIOPERSIST_PREFIX = "aiopersist-"
_RSS_INTERVAL = 0.002
# The embedding's row count before it is resized to absorb what the layers leave over.
_VOCAB = 32000
_MIN_HIDDEN = 256
_SEED = 20240601

State = dict[str, torch.Tensor]


class _VerificationError(RuntimeError):
    """A method loaded something other than what was saved: never a note, always raised."""


# -- the state -----------------------------------------------------------------------------------


def _layer_bytes(hidden: int) -> int:
    # bf16: qkv 3h*h, out h*h, up 4h*h, down h*4h; fp32: two norms (weight and bias) and the
    # four biases, 13h values in all.
    return 2 * 12 * hidden * hidden + 4 * 13 * hidden


def transformer_state(size_bytes: int, *, seed: int = _SEED) -> State:
    """A transformer-shaped state of about ``size_bytes`` tensor bytes, from a fixed seed.

    The hidden size is the largest power of two (at least 256) that still leaves room for
    8 layers next to a 32000-row embedding; then as many layers as fit, and the embedding
    takes up the rest, so the total lands within one embedding row of ``size_bytes``.
    Values are normally distributed (no NaN, so ``torch.equal`` compares them).
    """
    hidden = _MIN_HIDDEN
    while 8 * _layer_bytes(2 * hidden) + _VOCAB * 2 * hidden * 2 <= size_bytes:
        hidden *= 2
    final_norm = 2 * 4 * hidden
    layers = max(1, (size_bytes - _VOCAB * hidden * 2 - final_norm) // _layer_bytes(hidden))
    rows = max(1024, (size_bytes - layers * _layer_bytes(hidden) - final_norm) // (hidden * 2))

    gen = torch.Generator().manual_seed(seed)

    def big(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)

    def small(n: int, mean: float) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32).normal_(mean, 0.02, generator=gen)

    h = hidden
    state: State = {"embed.weight": big(rows, h)}
    for i in range(layers):
        p = f"layers.{i}."
        state[p + "attn_norm.weight"] = small(h, 1.0)
        state[p + "attn_norm.bias"] = small(h, 0.0)
        state[p + "attn.qkv.weight"] = big(3 * h, h)
        state[p + "attn.qkv.bias"] = small(3 * h, 0.0)
        state[p + "attn.out.weight"] = big(h, h)
        state[p + "attn.out.bias"] = small(h, 0.0)
        state[p + "mlp_norm.weight"] = small(h, 1.0)
        state[p + "mlp_norm.bias"] = small(h, 0.0)
        state[p + "mlp.up.weight"] = big(4 * h, h)
        state[p + "mlp.up.bias"] = small(4 * h, 0.0)
        state[p + "mlp.down.weight"] = big(h, 4 * h)
        state[p + "mlp.down.bias"] = small(h, 0.0)
    state["final_norm.weight"] = small(h, 1.0)
    state["final_norm.bias"] = small(h, 0.0)
    return state


SMALL_TENSOR_BYTES = 4096


def small_tensors_state(size_bytes: int, *, seed: int = _SEED) -> State:
    """About ``size_bytes`` of fp32 tensors of 4 KiB each (200 MiB: 51,200 tensors): the
    per-tensor costs of a format and a writer, with no large tensor to hide them."""
    gen = torch.Generator().manual_seed(seed)
    count = max(1, size_bytes // SMALL_TENSOR_BYTES)
    values = torch.empty(count, SMALL_TENSOR_BYTES // 4, dtype=torch.float32)
    values.normal_(0.0, 0.02, generator=gen)
    return {f"t.{i}": values[i].clone() for i in range(count)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _state_bytes(state: State) -> int:
    return sum(_nbytes(t) for t in state.values())


def _mismatch(loaded: State, source: State) -> str | None:
    """Why ``loaded`` differs from ``source``, or ``None`` when it does not."""
    if loaded.keys() != source.keys():
        missing = sorted(source.keys() - loaded.keys())[:3]
        extra = sorted(loaded.keys() - source.keys())[:3]
        return f"different names (missing {missing}, unexpected {extra})"
    for name, want in source.items():
        got = loaded[name]
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{name}: {got.dtype} {tuple(got.shape)} instead of {want.dtype} {tuple(want.shape)}"
        if not torch.equal(got, want):
            return f"{name}: the values differ"
    return None


def _touch(state: State) -> int:
    """Fault in every page of every tensor (one byte per page, and the last byte).

    A lazily mapped tensor (safetensors' ``load_file``) only reads its pages from the disk
    when they are first accessed; touching them inside the timing makes every method's
    load end with all bytes in memory. The strided read starts at the tensor's first byte,
    so the last byte is read too, for the page a misaligned start leaves uncovered. The
    sum is returned only so that the reads are plainly used.
    """
    acc = 0
    for t in state.values():
        if t.numel() == 0:
            continue
        flat = t.detach().reshape(-1).view(torch.uint8)
        acc += int(flat[::PAGE_SIZE].sum()) + int(flat[-1])
    return acc


# -- memory ----------------------------------------------------------------------------------


_libc: ctypes.CDLL | None = None


def _release_free_memory() -> None:
    """Collect garbage and hand malloc's free memory back to the kernel, before a baseline.

    Memory a previous run freed but glibc kept would be reused by the next run without
    any RSS growth, understating that run's figure.
    """
    global _libc
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)


class _PeakRss:
    """Peak RSS growth of this process over a ``with`` block (see the module docstring)."""

    _STATUS = "/proc/self/status"

    def __init__(self, interval: float = _RSS_INTERVAL) -> None:
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self.hwm_reset = False
        self._fd = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _field(self, name: bytes) -> int:
        # pread at offset 0 re-reads the file without reopening it: cheap enough for 2 ms.
        data = os.pread(self._fd, 8192, 0)
        start = data.find(name)
        if start < 0:
            return 0
        end = data.find(b"\n", start)
        return int(data[start + len(name) : end].split()[0]) * 1024  # reported in kB

    def _sample(self) -> None:
        self.peak = max(self.peak, self._field(b"VmRSS:"))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> _PeakRss:
        try:
            self._fd = os.open(self._STATUS, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return self  # no /proc: no figure (reported as 0)
        with contextlib.suppress(OSError):
            # "5" resets VmHWM to the current RSS (Linux >= 4.0), making it this block's peak.
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        self.baseline = self._field(b"VmRSS:")
        self.peak = self.baseline
        self._thread = threading.Thread(target=self._loop, name="aiopersist-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd < 0:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        if self.hwm_reset:
            self.peak = max(self.peak, self._field(b"VmHWM:"))
        os.close(self._fd)
        self._fd = -1

    @property
    def increase(self) -> int:
        return max(0, self.peak - self.baseline)


class _ThreadCpu:
    """CPU seconds of this process's threads over a ``with`` block, from
    ``/proc/self/task/*/stat`` (user + system): the busiest thread's and all of them.

    Threads can end inside the block (an ``asyncio.run`` shuts its executor down), so
    the table is sampled every ``interval`` and each thread's last reading kept; the
    sampler's own thread is left out. The busiest thread bounds what one rank can move:
    bytes over its CPU seconds is the per-rank ceiling ``bench save`` reports."""

    _TASKS = "/proc/self/task"

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._base: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._own = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.busiest = 0.0
        self.total = 0.0

    def _read(self) -> dict[int, int]:
        ticks: dict[int, int] = {}
        try:
            tids = os.listdir(self._TASKS)
        except OSError:
            return ticks
        for tid in tids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"{self._TASKS}/{tid}/stat", "rb") as f:
                    data = f.read()
                fields = data[data.rindex(b")") + 2 :].split()
                ticks[int(tid)] = int(fields[11]) + int(fields[12])  # utime, stime
        return ticks

    def _merge(self) -> None:
        for tid, v in self._read().items():
            if tid != self._own:
                self._last[tid] = v

    def _loop(self) -> None:
        self._own = threading.get_native_id()
        while not self._stop.wait(self.interval):
            self._merge()

    def __enter__(self) -> _ThreadCpu:
        self._base = self._read()
        self._last = dict(self._base)
        self._thread = threading.Thread(target=self._loop, name="aiopersist-cpu", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._merge()
        used = [(v - self._base.get(tid, 0)) / self._tick for tid, v in self._last.items()]
        self.busiest = max(used, default=0.0)
        self.total = sum(used)


def _mem_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


# -- the methods ---------------------------------------------------------------------------------


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    # dcp warns on every call that it assumes a single process when no group is set up:
    # that is this benchmark's intent, and the warning would only repeat.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)
        yield


def _save_torch(state: State, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(os.path.dirname(path))


def _save_safetensors(state: State, path: str) -> None:
    from safetensors.torch import save_file

    save_file(state, path)
    _fsync_file(path)
    fsync_directory(os.path.dirname(path))


def _save_dcp(state: State, path: str) -> None:
    # The submodule, because the package's own namespace does not re-export it for typing.
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    with _single_process_dcp():
        dcp_save(state, checkpoint_id=path)
    # dcp's writer may already fsync its files; doing it again costs little and makes sure
    # that what is timed is durable whatever its settings.
    for root, _dirs, files in os.walk(path):
        for name in files:
            _fsync_file(os.path.join(root, name))
        fsync_directory(root)
    fsync_directory(os.path.dirname(path))


def _save_aiopersist(state: State, path: str, backend: str) -> None:
    asyncio.run(_aiopersist_save(state, path, backend=backend))


def _load_torch(path: str) -> State:
    loaded = torch.load(path, weights_only=True, mmap=False)
    if not isinstance(loaded, dict):
        raise RuntimeError(f"torch.load returned a {type(loaded).__name__}, not a dict")
    return loaded


def _load_safetensors(path: str) -> State:
    from safetensors.torch import load_file

    loaded: State = load_file(path)
    return loaded


def _load_dcp(path: str, into: State) -> State:
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    with _single_process_dcp():
        dcp_load(into, checkpoint_id=path)
    return into


def _load_aiopersist(path: str, backend: str) -> State:
    return asyncio.run(_aiopersist_load(path, backend=backend))


def _target_name(method: str) -> str:
    """The file or directory name each method writes."""
    return {
        "fio": "fio.bin",
        "torch.save": "torch.pt",
        "torch.load": "torch.pt",
        "safetensors": "model.safetensors",
        "dcp": "dcp",
    }.get(method, method)


def _backend_of(method: str) -> str:
    return method.removeprefix(_AIOPERSIST_PREFIX)


def _saver(method: str, state: State, path: str) -> Callable[[], None]:
    """The timed part of a save by ``method`` (not fio)."""
    if method == "torch.save":
        return lambda: _save_torch(state, path)
    if method == "safetensors":
        return lambda: _save_safetensors(state, path)
    if method == "dcp":
        return lambda: _save_dcp(state, path)
    backend = _backend_of(method)
    return lambda: _save_aiopersist(state, path, backend)


def _loader(method: str, state: State, path: str) -> Callable[[], State]:
    """Untimed preparation, then the timed part of a load by ``method`` (not fio)."""
    if method == "torch.load":
        return lambda: _load_torch(path)
    if method == "safetensors":
        return lambda: _load_safetensors(path)
    if method == "dcp":
        # Preallocated outside the clock, as a training job holds its model already. The
        # pages are not faulted in: every other method's allocation faults in its timing.
        into = {k: torch.empty_like(v) for k, v in state.items()}
        return lambda: _load_dcp(path, into)
    backend = _backend_of(method)
    return lambda: _load_aiopersist(path, backend)


# -- results ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CkptRun:
    """One timed run of one method."""

    seconds: float
    gibs: float
    """State bytes over seconds, in GiB/s (fio: its own figure)."""
    rss_increase: int | None
    """Peak RSS growth during the call, in bytes; ``None`` for fio (another process)."""
    busiest_cpu_s: float | None = None
    """CPU seconds of this process's busiest thread during the call; ``None`` for fio."""
    total_cpu_s: float | None = None
    """CPU seconds of all of this process's threads during the call; ``None`` for fio."""


@dataclass(frozen=True)
class CkptMethodResult:
    """One method's runs and medians."""

    method: str
    runs: tuple[CkptRun, ...]
    """In round order."""
    seconds_median: float
    gibs_median: float
    rss_median_mib: float | None
    rss_max_mib: float | None
    vs_fio: float | None
    """``gibs_median`` over fio's; ``None`` when fio did not run."""
    vs_baseline: float | None
    """``gibs_median`` over the baseline's (torch.save / safetensors); ``None`` without it."""
    ceiling_gibs: float | None = None
    """Median over the runs of the state's bytes over the busiest thread's CPU seconds: what
    one rank could move if that thread were its only limit (``None`` for fio)."""
    cpu_s_per_gib: float | None = None
    """Median CPU seconds of all threads per GiB of state (``None`` for fio)."""


@dataclass(frozen=True)
class CkptTarget:
    """One target and whether this run met it."""

    method: str
    what: str
    """The target in words, e.g. ``save >= 0.90x fio``."""
    measured: str
    met: bool | None
    """``None`` when it could not be checked (the reference did not run)."""


@dataclass(frozen=True)
class CkptReport:
    """What `run_ckpt` measured, and under which conditions."""

    kind: Kind
    directory: str
    state_bytes: int
    tensors: int
    small_tensors: int
    """Tensors under 1 MiB."""
    dtype_bytes: tuple[tuple[str, int], ...]
    """Bytes per dtype, largest first."""
    hidden: int
    """The transformer state's width (0 for the small-tensors state)."""
    layers: int
    rounds: int
    chunk_bytes: int
    buffers: int
    staging_bytes: int
    """aiopersist's staging pool: ``chunk_bytes * buffers``."""
    direct_io: bool
    alignment: int
    caches_dropped: bool
    baseline: str
    """``torch.save`` for saves, ``safetensors`` for loads."""
    results: tuple[CkptMethodResult, ...]
    targets: tuple[CkptTarget, ...]
    skipped: tuple[str, ...]
    notes: tuple[str, ...]
    shape: str = "transformer"
    """The state: ``transformer`` (`transformer_state`) or ``small`` (`small_tensors_state`)."""

    def result(self, method: str) -> CkptMethodResult | None:
        """The figures of ``method``, or ``None`` if it did not run."""
        for r in self.results:
            if r.method == method:
                return r
        return None


def _methods_for(kind: Kind, methods: Sequence[str] | None) -> tuple[str, ...]:
    allowed = SAVE_METHODS if kind == "save" else LOAD_METHODS
    if methods is None:
        return allowed
    if isinstance(methods, str):
        raise TypeError("methods must be a sequence of method names, not one string")
    # torch.save and torch.load name the same pair; accept either for either kind.
    alias = {"torch.load": "torch.save"} if kind == "save" else {"torch.save": "torch.load"}
    chosen = tuple(dict.fromkeys(alias.get(m, m) for m in methods))
    unknown = [m for m in chosen if m not in allowed]
    if unknown:
        raise ValueError(
            f"unknown {kind} method(s) {', '.join(map(repr, unknown))}; expected some of {', '.join(allowed)}"
        )
    if not chosen:
        raise ValueError("no method to run")
    return chosen


def _summarise(
    runs: dict[str, list[CkptRun]], order: tuple[str, ...], baseline: str
) -> tuple[CkptMethodResult, ...]:
    med = {m: statistics.median(r.gibs for r in runs[m]) for m in order}
    out = []
    for m in order:
        rss = [r.rss_increase for r in runs[m] if r.rss_increase is not None]
        gib = runs[m][0].gibs * runs[m][0].seconds if runs[m] else 0.0  # the state's size in GiB
        busiest = [r.busiest_cpu_s for r in runs[m] if r.busiest_cpu_s]
        cpu = [r.total_cpu_s for r in runs[m] if r.total_cpu_s]
        out.append(
            CkptMethodResult(
                method=m,
                runs=tuple(runs[m]),
                seconds_median=statistics.median(r.seconds for r in runs[m]),
                gibs_median=med[m],
                rss_median_mib=statistics.median(rss) / _MiB if rss else None,
                rss_max_mib=max(rss) / _MiB if rss else None,
                vs_fio=med[m] / med["fio"] if "fio" in med else None,
                vs_baseline=med[m] / med[baseline] if baseline in med else None,
                ceiling_gibs=statistics.median(gib / b for b in busiest) if busiest else None,
                cpu_s_per_gib=statistics.median(c / gib for c in cpu) if cpu and gib else None,
            )
        )
    return tuple(out)


def _targets(
    kind: Kind, results: tuple[CkptMethodResult, ...], baseline: str, rss_budget: int
) -> tuple[CkptTarget, ...]:
    def ratio(method: str, x: float | None, want: float, ref: str) -> CkptTarget:
        what = f"{kind} >= {want:.2f}x {ref}"
        if x is None:
            return CkptTarget(method, what, f"{ref} did not run", None)
        return CkptTarget(method, what, f"{x:.2f}x", x >= want)

    out = []
    for r in results:
        if not r.method.startswith(_AIOPERSIST_PREFIX):
            continue
        if kind == "save":
            out.append(ratio(r.method, r.vs_fio, SAVE_VS_FIO, "fio"))
            out.append(ratio(r.method, r.vs_baseline, SAVE_VS_TORCH, baseline))
            worst = r.rss_max_mib
            what = f"peak RSS growth <= {rss_budget / _MiB:.0f} MiB"
            if worst is None:
                out.append(CkptTarget(r.method, what, "not measured", None))
            else:
                out.append(
                    CkptTarget(r.method, what, f"{worst:.0f} MiB (worst round)", worst * _MiB <= rss_budget)
                )
        else:
            out.append(ratio(r.method, r.vs_fio, LOAD_VS_FIO, "fio"))
            out.append(ratio(r.method, r.vs_baseline, LOAD_VS_SAFETENSORS, baseline))
    return tuple(out)


# -- the run ------------------------------------------------------------------------------------


def run_ckpt(
    directory: str,
    *,
    kind: Kind,
    size_bytes: int = 2 << 30,
    rounds: int = 3,
    methods: Sequence[str] | None = None,
    shape: str = "transformer",
    out: TextIO = sys.stdout,
) -> CkptReport:
    """Time checkpoint saves or loads of each method; see the module docstring.
    ``shape``: ``transformer`` or ``small`` (4 KiB tensors: `small_tensors_state`).

    The files go to a scratch directory inside ``directory`` (created if missing), deleted
    at the end. ``size_bytes`` is the approximate state size. Progress lines go to ``out``.
    Needs about three times ``size_bytes`` of memory (the source, one loaded or serialised
    copy, slack) and, for loads, ``size_bytes`` of disk per method.
    """
    if kind not in ("save", "load"):
        raise ValueError(f"kind must be 'save' or 'load', got {kind!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if shape not in ("transformer", "small"):
        raise ValueError(f"shape must be 'transformer' or 'small', got {shape!r}")
    if size_bytes < 16 * _MiB:
        raise ValueError(f"size_bytes={size_bytes} is too small for a meaningful run (at least 16 MiB)")
    wanted = _methods_for(kind, methods)
    baseline = "torch.save" if kind == "save" else "safetensors"
    chunk = _knobs.chunk_bytes()
    nbuf = _knobs.staging_buffers()

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    notes: list[str] = []
    skipped: list[str] = []
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    dio = probe_directory(directory)
    if not dio.direct:
        notes.append(f"no O_DIRECT in {directory} ({dio.reason}): aiopersist used buffered I/O plus fsync")

    fio = shutil.which("fio")
    runnable: list[str] = []
    for m in wanted:
        reason: str | None = None
        if m == "fio":
            if fio is None:
                reason = "fio is not on PATH"
            elif not dio.direct:
                reason = "fio runs with --direct=1, which this directory refuses"
        elif m == "safetensors":
            try:
                import safetensors.torch  # noqa: F401
            except ImportError as exc:
                reason = f"safetensors is not importable ({exc})"
        elif m == "dcp":
            try:
                import torch.distributed.checkpoint  # noqa: F401
            except ImportError as exc:
                reason = f"torch.distributed.checkpoint is not importable ({exc})"
        elif m.startswith(_AIOPERSIST_PREFIX):
            try:
                resolve_backend_name(_backend_of(m))
            except BackendUnavailableError as exc:
                reason = str(exc)
        if reason is None:
            runnable.append(m)
        else:
            skipped.append(m)
            notes.append(f"{m} was skipped: {reason}")
    if not runnable:
        raise RuntimeError("none of the methods asked for can run here: " + "; ".join(notes))

    if shape == "small":
        say(f"generating {size_bytes // SMALL_TENSOR_BYTES} tensors of 4 KiB (seed {_SEED})")
        state = small_tensors_state(size_bytes)
        hidden = layers = 0
    else:
        say(f"generating a transformer-shaped state of about {_size_text(size_bytes)} (seed {_SEED})")
        state = transformer_state(size_bytes)
        hidden = state["final_norm.weight"].numel()
        layers = sum(1 for k in state if k.endswith(".mlp.up.weight"))
    total = _state_bytes(state)
    by_dtype: dict[str, int] = {}
    for t in state.values():
        name = str(t.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + _nbytes(t)
    # fio moves whole requests: its byte count is the state's, rounded up to a request.
    fio_bytes = -(-total // chunk) * chunk

    available = _mem_available()
    if available is not None and available < 3 * total:
        notes.append(
            f"only {available / _GiB:.1f} GiB of memory was available for a {total / _GiB:.2f} GiB state "
            "(about 3x is wanted): figures may include swapping or reclaim"
        )
    per_method_disk = total + total // 16  # formats add headers and alignment padding
    disk_needed = per_method_disk * (len(runnable) if kind == "load" else 1)
    free = shutil.disk_usage(directory).free
    if free < disk_needed:
        raise RuntimeError(
            f"{directory} has {free / _GiB:.2f} GiB free; about {disk_needed / _GiB:.2f} GiB is needed"
        )

    workdir = os.path.join(directory, f".aiopersist-bench-{kind}-{uuid.uuid4().hex[:12]}")
    os.makedirs(workdir)
    paths = {m: os.path.join(workdir, _target_name(m)) for m in runnable}
    drop = _CacheDropper()
    huge = _HugePages(chunk * nbuf)
    runs: dict[str, list[CkptRun]] = {m: [] for m in runnable}
    failed: dict[str, str] = {}

    def fail(m: str, exc: Exception, when: str) -> None:
        # Only the other libraries' failures are notes: aiopersist's own propagate, since a
        # report without the subject would mislead.
        if m.startswith(_AIOPERSIST_PREFIX):
            raise exc
        failed[m] = f"{m} failed {when} and was left out: {type(exc).__name__}: {exc}"
        say(failed[m])

    def fio_run(rw: str) -> CkptRun:
        assert fio is not None
        gibs = _fio_run(fio, paths["fio"], rw, fio_bytes, chunk, nbuf, huge.ok)
        return CkptRun(fio_bytes / _GiB / gibs, gibs, None)

    def timed(thunk: Callable[[], Any]) -> tuple[CkptRun, Any]:
        _release_free_memory()
        drop()
        with _PeakRss() as rss, _ThreadCpu() as cpu:
            start = time.perf_counter()
            result = thunk()
            if kind == "load":
                _touch(result)
            seconds = time.perf_counter() - start
        return CkptRun(seconds, total / _GiB / seconds, rss.increase, cpu.busiest, cpu.total), result

    def save_once(m: str) -> CkptRun:
        path = paths[m]
        try:
            if m == "fio":
                drop()
                return fio_run("write")
            run, _ = timed(_saver(m, state, path))
            return run
        finally:
            # Untimed, and before the next method's sync: every save starts on a fresh name.
            _remove(path)

    def load_once(m: str, verify: bool) -> CkptRun:
        if m == "fio":
            drop()
            return fio_run("read")
        run, loaded = timed(_loader(m, state, paths[m]))
        if verify:
            why = _mismatch(loaded, state)
            if why is not None:
                raise _VerificationError(f"{m}: the loaded state differs from the saved one: {why}")
        del loaded
        return run

    say(
        f"checkpoint {kind}: {_size_text(total)} in {len(state)} tensors, {rounds} round(s), "
        f"methods {', '.join(runnable)}, in {workdir}"
    )
    try:
        if "fio" in runnable:
            huge.__enter__()
        if kind == "load":
            say("writing each method's checkpoint (untimed)")
            for m in runnable:
                save_m = "torch.save" if m == "torch.load" else m
                try:
                    if m == "fio":
                        fio_run("write")
                    else:
                        _saver(save_m, state, paths[m])()
                except Exception as exc:
                    fail(m, exc, "writing its checkpoint")
        for r in range(rounds):
            for m in _rotated(tuple(runnable), r):
                if m in failed:
                    continue
                verify = kind == "load" and r == 0 and m != "fio"
                try:
                    run = save_once(m) if kind == "save" else load_once(m, verify)
                except _VerificationError:
                    raise
                except Exception as exc:
                    fail(m, exc, f"in round {r + 1}")
                    continue
                runs[m].append(run)
                rss = "" if run.rss_increase is None else f"  peak RSS +{run.rss_increase / _MiB:,.0f} MiB"
                say(
                    f"round {r + 1}/{rounds}  {m:<19} {kind}  {run.seconds:7.2f} s  {run.gibs:6.3f} GiB/s"
                    + rss
                    + ("  (verified)" if verify else "")
                )
    finally:
        huge.__exit__()
        shutil.rmtree(workdir, ignore_errors=True)

    for m, why in failed.items():
        skipped.append(m)
        notes.append(why)
    order = tuple(m for m in runnable if m not in failed)
    if not order:
        raise RuntimeError("every method failed: " + "; ".join(failed.values()))
    if "fio" in order:
        notes.append(
            "fio's buffers were on hugetlb pages (--iomem=shmhuge)"
            if huge.ok
            else "fio's buffers were on ordinary pages: no hugetlb pages could be reserved"
        )
        if fio_bytes != total:
            notes.append(f"fio moved {fio_bytes} bytes, the state's {total} rounded up to whole requests")
    notes.append(f"aiopersist's staging buffers ask for transparent huge pages (THP: {_thp_mode()})")
    if drop.note is not None:
        notes.append(drop.note)
    if kind == "load":
        notes.append("a load's peak RSS growth includes the loaded state itself")

    results = _summarise(runs, order, baseline)
    staging = chunk * nbuf
    rss_budget = staging + int(RSS_STATE_FRACTION * total)
    return CkptReport(
        kind=kind,
        directory=directory,
        state_bytes=total,
        tensors=len(state),
        small_tensors=sum(1 for t in state.values() if _nbytes(t) < _MiB),
        dtype_bytes=tuple(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
        hidden=hidden,
        layers=layers,
        shape=shape,
        rounds=rounds,
        chunk_bytes=chunk,
        buffers=nbuf,
        staging_bytes=staging,
        direct_io=dio.direct,
        alignment=dio.offset_align if dio.direct else 1,
        caches_dropped=drop.enabled,
        baseline=baseline,
        results=results,
        targets=_targets(kind, results, baseline, rss_budget),
        skipped=tuple(skipped),
        notes=tuple(notes),
    )


# -- output --------------------------------------------------------------------------------------


def _gib_text(n: int) -> str:
    return f"{n / _GiB:.2f} GiB" if n >= _GiB // 10 else f"{n / _MiB:.1f} MiB"


def _state_line(report: CkptReport) -> str:
    dtypes = ", ".join(f"{name} {_gib_text(n)}" for name, n in report.dtype_bytes)
    return (
        f"state: {_gib_text(report.state_bytes)} in {report.tensors} tensors "
        f"({report.small_tensors} under 1 MiB; {dtypes})"
        + (f", hidden {report.hidden}, {report.layers} layers" if report.shape == "transformer" else "")
    )


def format_ckpt(report: CkptReport) -> str:
    """A plain-text table of ``report``: medians, ratios, memory, every round, then targets."""

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    def mib(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    io_mode = f"O_DIRECT, {report.alignment}-byte alignment" if report.direct_io else "buffered + fsync"
    lines = [
        f"aiopersist checkpoint {report.kind} in {report.directory} ({io_mode})",
        _state_line(report),
        f"{report.rounds} round(s), medians; page cache "
        + ("dropped before each run" if report.caches_dropped else "NOT dropped")
        + f"; aiopersist staging {report.buffers} x {_size_text(report.chunk_bytes)}",
        "",
    ]
    header = (
        "method",
        "seconds",
        "GiB/s",
        "vs fio",
        f"vs {report.baseline}",
        "peak RSS +MiB",
        "ceiling GiB/s",
        "CPU-s/GiB",
        "GiB/s per round",
    )
    rows = [
        (
            r.method,
            f"{r.seconds_median:.2f}",
            f"{r.gibs_median:.3f}",
            ratio(r.vs_fio),
            ratio(r.vs_baseline),
            mib(r.rss_median_mib),
            "-" if r.ceiling_gibs is None else f"{r.ceiling_gibs:.2f}",
            "-" if r.cpu_s_per_gib is None else f"{r.cpu_s_per_gib:.2f}",
            " ".join(f"{x.gibs:.3f}" for x in r.runs),
        )
        for r in report.results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        cells = [
            cell.ljust(w) if i in (0, 8) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    if report.targets:
        lines.append("")
        lines.append("targets (this run):")
        mw = max(len(t.method) for t in report.targets)
        ww = max(len(t.what) for t in report.targets)
        xw = max(len(t.measured) for t in report.targets)
        for t in report.targets:
            verdict = "met" if t.met else ("MISSED" if t.met is False else "not checked")
            lines.append(f"  target  {t.method:<{mw}}  {t.what:<{ww}}  {t.measured:>{xw}}  {verdict}")
        if report.kind == "save":
            budget = report.staging_bytes + int(RSS_STATE_FRACTION * report.state_bytes)
            lines.append(
                f"  (RSS budget {budget / _MiB:.0f} MiB = staging pool {report.staging_bytes / _MiB:.0f} MiB"
                f" + {RSS_STATE_FRACTION:.0%} of the state)"
            )
    if report.skipped:
        lines.append("")
        lines.append("skipped: " + ", ".join(report.skipped))
    if report.notes:
        lines.append("")
        lines.extend(f"note: {n}" for n in report.notes)
    return "\n".join(lines)


def ckpt_report_json(report: CkptReport) -> dict[str, Any]:
    """``report`` as plain JSON-ready data (for ``--json``)."""

    def num(x: float | None) -> float | None:
        # JSON has no infinity; a zero-duration run cannot happen at these sizes, but stay valid.
        return None if x is None or not math.isfinite(x) else x

    return {
        "kind": report.kind,
        "directory": report.directory,
        "state": {
            "bytes": report.state_bytes,
            "tensors": report.tensors,
            "small_tensors": report.small_tensors,
            "dtype_bytes": dict(report.dtype_bytes),
            "shape": report.shape,
            "hidden": report.hidden,
            "layers": report.layers,
        },
        "rounds": report.rounds,
        "chunk_bytes": report.chunk_bytes,
        "buffers": report.buffers,
        "staging_bytes": report.staging_bytes,
        "direct_io": report.direct_io,
        "alignment": report.alignment,
        "caches_dropped": report.caches_dropped,
        "baseline": report.baseline,
        "results": [
            {
                "method": r.method,
                "seconds_median": r.seconds_median,
                "gibs_median": num(r.gibs_median),
                "vs_fio": num(r.vs_fio),
                "vs_baseline": num(r.vs_baseline),
                "rss_increase_median_mib": r.rss_median_mib,
                "rss_increase_max_mib": r.rss_max_mib,
                "ceiling_gibs": num(r.ceiling_gibs),
                "cpu_s_per_gib": num(r.cpu_s_per_gib),
                "runs": [
                    {
                        "seconds": x.seconds,
                        "gibs": num(x.gibs),
                        "rss_increase_bytes": x.rss_increase,
                        "busiest_thread_cpu_s": x.busiest_cpu_s,
                        "total_cpu_s": x.total_cpu_s,
                    }
                    for x in r.runs
                ],
            }
            for r in report.results
        ],
        "targets": [
            {"method": t.method, "target": t.what, "measured": t.measured, "met": t.met}
            for t in report.targets
        ],
        "skipped": list(report.skipped),
        "notes": list(report.notes),
    }


def _bar_color(method: str) -> str:
    if method == "fio":
        return "#9e9e9e"
    if method.startswith(_AIOPERSIST_PREFIX):
        return "#e6550d" if method.endswith("io_uring") else "#fdae6b"
    return "#3182bd"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only backend (``Agg``): no display is needed, and
    none is touched if there is one. A `RuntimeError` says how to install matplotlib."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bars_with_rounds(
    ax: Any,
    medians: Sequence[float],
    rounds: Sequence[Sequence[float]],
    colors: Sequence[str],
    texts: Sequence[str],
    *,
    width: float,
    alpha: float = 1.0,
    label: str = "one round",
) -> None:
    """A bar at each median (at x = 0, 1, ...), a dot for every round's value, the bar's
    text beside its top, and one legend entry for the dots."""
    xs = list(range(len(medians)))
    ax.bar(xs, medians, color=list(colors), alpha=alpha, width=width)
    for x, median, values, text in zip(xs, medians, rounds, texts, strict=True):
        ax.plot([x] * len(values), values, "o", color="#222222", markersize=4)
        ax.annotate(
            text,
            (x + width / 2, median),
            xytext=(3, 0),
            textcoords="offset points",
            ha="left",
            va="center",
            fontsize=8,
        )
    ax.plot([], [], "o", color="#222222", markersize=4, label=label)


def plot_ckpt(report: CkptReport, path: str) -> None:
    """A bar chart of ``report`` as an image at ``path`` (PNG by its name): throughput per
    method (median, with the rounds' range) beside the peak RSS growth, targets drawn in.
    """
    plt = pyplot()
    methods = [r.method for r in report.results]
    colors = [_bar_color(m) for m in methods]
    xs = list(range(len(methods)))
    fig, (ax_bw, ax_mem) = plt.subplots(
        1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [3, 2]}, layout="constrained"
    )

    med = [r.gibs_median for r in report.results]
    lo = [r.gibs_median - min(x.gibs for x in r.runs) for r in report.results]
    hi = [max(x.gibs for x in r.runs) - r.gibs_median for r in report.results]
    ax_bw.bar(xs, med, color=colors, yerr=[lo, hi], capsize=4, ecolor="#444444")
    # Labels sit above the best round, so that the range bar never runs through them, on a
    # white box, so that a target line behind them does not either.
    box = {"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85}
    for x, r in zip(xs, report.results, strict=True):
        label = f"{r.gibs_median:.2f}"
        if r.vs_fio is not None and r.method != "fio":
            label += f"\n{r.vs_fio:.2f}x fio"
        ax_bw.annotate(
            label,
            (x, r.gibs_median + hi[x]),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
            bbox=box,
        )
    fio = report.result("fio")
    base = report.result(report.baseline)
    want_base = SAVE_VS_TORCH if report.kind == "save" else LOAD_VS_SAFETENSORS
    want_fio = SAVE_VS_FIO if report.kind == "save" else LOAD_VS_FIO
    # The best round of each method, with its label above it, stays below the legend's row.
    top = max(m + h for m, h in zip(med, hi, strict=True))
    if fio is not None:
        y = want_fio * fio.gibs_median
        top = max(top, y)
        ax_bw.axhline(y, color="#444444", linestyle="--", linewidth=1, label=f"target {want_fio:g}x fio")
    if base is not None:
        y = want_base * base.gibs_median
        top = max(top, y)
        ax_bw.axhline(
            y, color="#3182bd", linestyle=":", linewidth=1.5, label=f"target {want_base:g}x {report.baseline}"
        )
    if fio is not None or base is not None:
        ax_bw.legend(loc="upper center", ncol=2, fontsize=8, framealpha=0.9)
    ax_bw.set_ylim(0, top * 1.4)
    ax_bw.set_ylabel("GiB/s (median; bars: range over rounds)")
    ax_bw.set_title(f"{report.kind} throughput", fontsize=11)
    ax_bw.set_xticks(xs, methods, rotation=20, ha="right", fontsize=9)
    ax_bw.grid(axis="y", alpha=0.3)

    rss = [r.rss_median_mib if r.rss_median_mib is not None else 0.0 for r in report.results]
    ax_mem.bar(xs, rss, color=colors)
    for x, r in zip(xs, report.results, strict=True):
        text = "n/a" if r.rss_median_mib is None else f"{r.rss_median_mib:,.0f}"
        ax_mem.annotate(
            text, (x, rss[x]), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=8
        )
    mem_top = max(rss, default=0.0)
    if report.kind == "save":
        budget = (report.staging_bytes + RSS_STATE_FRACTION * report.state_bytes) / _MiB
        mem_top = max(mem_top, budget)
        ax_mem.axhline(
            budget, color="#e6550d", linestyle="--", linewidth=1, label=f"aiopersist budget {budget:.0f} MiB"
        )
        ax_mem.legend(loc="upper left", fontsize=8, frameon=False)
    else:
        # A load's growth holds the loaded state; the line shows how much of it is overhead.
        size = report.state_bytes / _MiB
        mem_top = max(mem_top, size)
        ax_mem.axhline(size, color="#444444", linestyle=":", linewidth=1, label=f"state size {size:,.0f} MiB")
        ax_mem.legend(loc="lower right", fontsize=8, framealpha=0.9)
    ax_mem.set_ylim(0, max(mem_top, 1.0) * 1.2)
    ax_mem.set_ylabel("MiB (median)")
    ax_mem.set_title(f"peak RSS growth during the {report.kind}", fontsize=11)
    ax_mem.set_xticks(xs, methods, rotation=20, ha="right", fontsize=9)
    ax_mem.grid(axis="y", alpha=0.3)

    cache = "cold cache" if report.caches_dropped else "page cache NOT dropped"
    fig.suptitle(
        f"aiopersist bench {report.kind}: {_gib_text(report.state_bytes)}, {report.tensors} tensors, "
        f"{report.rounds} round(s), {cache}",
        fontsize=12,
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = [
    "LOAD_METHODS",
    "SAVE_METHODS",
    "CkptMethodResult",
    "CkptReport",
    "CkptRun",
    "CkptTarget",
    "ckpt_report_json",
    "format_ckpt",
    "plot_ckpt",
    "run_ckpt",
    "transformer_state",
]
