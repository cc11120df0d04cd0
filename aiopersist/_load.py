"""``load`` and ``verify``: a checkpoint read back, checked as it is read.

Read path: locate (what is at the path) -> manifest (validated) -> engine reads (straight
into the destination where aligned) -> checksum -> tensors -> the object rebuilt, or loaded
in place into ``into``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from . import _knobs, _memory
from ._backends import IOBackend, open_backend, to_thread_to_the_end
from ._direct import AlignedBuffer, DirectIOInfo, empty_for_direct_read
from ._exceptions import (
    AiopersistError,
    CheckpointCorruptError,
    NotEnoughMemoryError,
    StateMismatchError,
    UnsupportedStateError,
    maps_os_errors,
)
from ._flatten import _byte_extent, build_view, flatten
from ._format import FileLayout, header_length, parse_header
from ._into import load_into
from ._locate import READ_FLAGS, Located, PathArg, locate
from ._manifest import FileRecord, Manifest, RankState, new_hasher
from ._readplan import (
    FileRead,
    ReadPlan,
    Span,
    check_tiling,
    host_bytes,
    plan_read,
    plan_safetensors,
    plan_verify,
)
from ._skeleton import decode
from ._staging import StagingPool
from ._stream import files_at_once, open_for_read, read_segments, run_all, settle
from ._workers import DaemonThreadPool

Progress = Callable[[int], None]
"""Called on the event loop's thread with the bytes just read and checked (a window, a
group or a file), as the read executor completes them."""


class _Prefaulter:
    """Faults destination memory in, in file order, in one background thread, so that the
    page faults and zeroing of fresh memory overlap the reads instead of stalling them.

    Mappings are collected while a file's tensors are allocated and handed to the thread
    by `start`: faulting holds the process's memory-map lock, and every further ``mmap``
    on the event loop's thread would wait for it.
    """

    def __init__(self) -> None:
        self._pool = DaemonThreadPool(1, thread_name_prefix="aiopersist-prefault")
        self._waiting: list[AlignedBuffer] = []

    def __call__(self, mem: AlignedBuffer) -> None:
        self._waiting.append(mem)

    def start(self) -> None:
        waiting, self._waiting = self._waiting, []
        for mem in waiting:
            self._pool.submit(mem.populate)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _allocate(
    shape: tuple[int, ...], dtype: torch.dtype, offset: int, direct_ok: bool, prefault: _Prefaulter
) -> torch.Tensor:
    """The one place a load allocates a tensor: large tensors get memory the kernel can
    read into directly (no staging copy), placed at ``offset`` modulo the alignment."""
    if direct_ok:
        return empty_for_direct_read(shape, dtype, offset, prefault)
    return torch.empty(shape, dtype=dtype)


_HASH_GROUP = 64 << 20
_GROUPS_AHEAD = 4


def _groups(
    segments: Sequence[tuple[int, torch.Tensor]], group_bytes: int
) -> list[list[tuple[int, torch.Tensor]]]:
    """Consecutive segments bundled into groups of at least ``group_bytes`` (the last may
    be smaller); a segment is never split."""
    groups: list[list[tuple[int, torch.Tensor]]] = [[]]
    size = 0
    for seg in segments:
        if size >= group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(seg)
        size += seg[1].numel()
    return groups


def _update(hasher: Any, parts: Sequence[torch.Tensor]) -> None:
    for part in parts:
        if part.numel():
            hasher.update(cast(Any, part.numpy()))


def _digests(parts: Sequence[torch.Tensor]) -> list[str]:
    """One checksum per part."""
    out = []
    for part in parts:
        hasher = new_hasher()
        _update(hasher, [part])
        out.append(str(hasher.hexdigest()))
    return out


def _check_memory(needed: int, where: str, doing: str = "loading it") -> None:
    """`NotEnoughMemoryError` when a load would allocate ``needed`` bytes of host memory
    and this process has less available (see `_memory`): refused before anything is
    allocated, so that a checkpoint claiming more than the machine has (a sparse file,
    whose checksum cannot be checked before it is read) is a typed error, not the OOM
    killer. Device memory is not counted: a load reads into host memory first. ``doing``
    says what needs the memory, after ``where`` in the message."""
    if needed == 0 or not _knobs.memory_check_enabled():
        return
    available = _memory.available_bytes()
    if available is not None and needed > available:
        raise NotEnoughMemoryError(
            f"{where}: {doing} needs {needed} bytes ({needed / (1 << 30):.1f} GiB) of host memory, "
            f"{available} ({available / (1 << 30):.1f} GiB) are available (free memory and swap, within "
            "this process's memory cgroup); nothing was allocated",
            needed,
            available,
        )


class _Destinations:
    """The plan's targets, allocated, and the memory each span is read into."""

    def __init__(self, plan: ReadPlan, loc: Located, pool: StagingPool, prefault: _Prefaulter) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._after: list[Callable[[], None]] = []
        for t in plan.targets:
            direct_ok = loc.dio.direct and t.nbytes >= pool.buffer_bytes
            self.tensors[t.name] = _allocate(t.shape, t.dtype, t.offset, direct_ok, prefault)

    def memory(self, span: Span) -> torch.Tensor:
        """The uint8 view ``span`` is read into (scratch memory for a slice only partly
        wanted: its wanted rows are copied out by `finish`)."""
        dest = self.tensors[span.target]
        if span.rows is not None:
            rows = dest.reshape(dest.shape[0], math.prod(dest.shape[1:]))  # sliced: at least 1-D
            dest = rows[span.rows[0] : span.rows[1]]
            if span.keep is not None:
                scratch = torch.empty((span.slice_rows, rows.shape[1]), dtype=rows.dtype)
                k0, k1 = span.keep

                def copy(dst: torch.Tensor = dest, src: torch.Tensor = scratch[k0:k1]) -> None:
                    dst.copy_(src)

                self._after.append(copy)
                dest = scratch
        return dest.reshape(-1).view(torch.uint8)

    def finish(self) -> None:
        for fn in self._after:
            fn()


async def _read_whole(
    be: IOBackend,
    path: str,
    dio: DirectIOInfo,
    pool: StagingPool,
    rec: FileRecord,
    read: FileRead,
    dests: _Destinations,
    progress: Progress | None = None,
) -> torch.Tensor:
    """Read every byte of one file into its spans' memory and check the file's checksum;
    returns the bytes before the first span (the header, or the whole pickle file)."""
    head_len = rec.data_offset if rec.data_offset is not None else rec.nbytes
    check_tiling(read, head_len, rec.nbytes, path)
    head = torch.empty(head_len, dtype=torch.uint8)
    # A view per span (thousands of small tensors): in a worker thread.
    parts = await asyncio.to_thread(lambda: [(0, head), *((s.begin, dests.memory(s)) for s in read.spans)])
    # Read in groups of about _HASH_GROUP bytes, a few groups in flight, and checksum each
    # group in file order (in a thread) as soon as it is in: the checksum overlaps the reads.
    hasher = new_hasher()
    groups = _groups(parts, _HASH_GROUP)
    ahead = asyncio.Semaphore(_GROUPS_AHEAD)

    async def read_group(group: list[tuple[int, torch.Tensor]]) -> None:
        async with ahead:
            await read_segments(be, path, dio, pool, group)

    tasks = [asyncio.ensure_future(read_group(g)) for g in groups]
    try:
        for group, task in zip(groups, tasks, strict=True):
            await task
            await asyncio.to_thread(_update, hasher, [d for _, d in group])
            if progress is not None:
                progress(sum(d.numel() for _, d in group))
    except BaseException:
        for task in tasks:
            task.cancel()
        await settle(tasks)  # requests in flight write into the tensors until they end
        raise
    _check_checksum(path, rec, str(hasher.hexdigest()))
    return head


def _check_checksum(path: str, rec: FileRecord, actual: str) -> None:
    if actual != rec.checksum:
        raise CheckpointCorruptError(f"{path}: checksum mismatch (stored {rec.checksum}, computed {actual})")


async def _check_whole(
    be: IOBackend,
    path: str,
    dio: DirectIOInfo,
    pool: StagingPool,
    rec: FileRecord,
    read: FileRead,
    progress: Progress | None = None,
) -> None:
    """A check-only read of one whole file: its checksum (streamed through the pool) and,
    for a data file, its own header against the byte ranges the manifest places in it."""
    _check_checksum(path, rec, await _hash_file(be, path, dio, pool, rec.nbytes, progress))
    if read.header is not None:
        layout = await _read_header(be, path, rec.nbytes)
        found = tuple(
            sorted((layout.data_offset + e.begin, layout.data_offset + e.end) for e in layout.entries)
        )
        if layout.data_offset != rec.data_offset or found != read.header:
            raise CheckpointCorruptError(f"{path}: its header does not match the manifest")


async def _read_spans(
    be: IOBackend,
    path: str,
    dio: DirectIOInfo,
    pool: StagingPool,
    read: FileRead,
    dests: _Destinations,
    progress: Progress | None = None,
) -> None:
    """Read just the spans of one file; those with checksums of their own are checked."""
    memory = await asyncio.to_thread(lambda: [dests.memory(s) for s in read.spans])
    await read_segments(be, path, dio, pool, [(s.begin, m) for s, m in zip(read.spans, memory, strict=True)])
    checked = [(s, m) for s, m in zip(read.spans, memory, strict=True) if s.checksum is not None]
    actual = await asyncio.to_thread(_digests, [m for _, m in checked]) if checked else []
    for (span, _), got in zip(checked, actual, strict=True):
        if got != span.checksum:
            raise CheckpointCorruptError(
                f"{path}: checksum mismatch in {span.what} (stored {span.checksum}, computed {got})"
            )
    if progress is not None:
        progress(sum(m.numel() for m in memory))


async def execute_read(
    be: IOBackend,
    loc: Located,
    pool: StagingPool,
    prefault: _Prefaulter,
    plan: ReadPlan,
    progress: Progress | None = None,
) -> tuple[dict[str, torch.Tensor], list[object] | None]:
    """Run a `ReadPlan`: the needed tensors, checked, and the unpickled objects (when the
    plan reads the pickle file). ``progress`` is told of the bytes read and checked as they
    are (see `Progress`)."""
    where = loc.files[0] if loc.kind == "safetensors" else loc.directory

    def allocate() -> _Destinations:
        _check_memory(host_bytes(plan, loc.manifest), where)
        return _Destinations(plan, loc, pool, prefault)

    dests = await asyncio.to_thread(allocate)  # one allocation per tensor: off the event loop
    prefault.start()
    manifest = loc.manifest

    bound = files_at_once()

    async def one(read: FileRead) -> None:
        async with bound:
            if manifest is None:  # a plain safetensors file: named by its path
                rec = loc.records.get(read.file)
                if rec is None:
                    await _read_spans(be, read.file, loc.dio, pool, read, dests, progress)
                    return
                # A file of an aiopersist checkpoint: read whole, against its checksum there.
                spans = tuple(sorted(read.spans, key=lambda s: (s.begin, s.end)))
                head = spans[0].begin if spans else rec.nbytes
                whole = FileRead(read.file, spans, whole=True)
                rec = dataclasses.replace(rec, data_offset=head)
                await _read_whole(be, read.file, loc.dio, pool, rec, whole, dests, progress)
                return
            rec = manifest.files[read.file]
            path = loc.path_of(rec)
            if read.whole and not read.spans:  # check-only (verify): nothing to keep
                await _check_whole(be, path, loc.dio, pool, rec, read, progress)
            elif read.whole:
                await _read_whole(be, path, loc.dio, pool, rec, read, dests, progress)
            else:
                await _read_spans(be, path, loc.dio, pool, read, dests, progress)

    jobs: list[Any] = [one(read) for read in plan.files]
    if plan.pickle_file is not None and manifest is not None:
        rec = manifest.files[plan.pickle_file]
        jobs.append(
            _read_whole(
                be, loc.path_of(rec), loc.dio, pool, rec, FileRead(rec.name, (), True), dests, progress
            )
        )
    try:
        done = await run_all(jobs)
    except BaseException:
        # Neither this frame nor its readers' (held by the error's traceback, and by the
        # readers' closure over it) keeps the destination tensors: a caller that goes on
        # to another checkpoint (a restore falling back) would hold two states at once.
        jobs.clear()
        del dests
        raise
    await asyncio.to_thread(dests.finish)
    pickled = None
    if plan.pickle_file is not None:
        pickled = await asyncio.to_thread(_unpickle, done[-1], loc.directory)
    return {k: v for k, v in dests.tensors.items() if k in plan.needed}, pickled


@dataclass(frozen=True)
class _Want:
    """What ``load(into=...)`` needs of one stored tensor: some rows, as a DTensor."""

    rows: tuple[int, int] | None
    """Rows of a dim-0 sharded tensor this rank holds; ``None``: all of it."""
    dtensor: torch.Tensor
    """The target DTensor: its mesh and placements rebuild the loaded one."""


def _wants(into: object) -> dict[str, _Want]:
    """The DTensors in ``into``, by the names a save of ``into`` would give them."""
    try:
        flat = flatten(into, allow_pickle=True)
    except AiopersistError:
        return {}
    local = {s.name: s.source for s in flat.stored}
    out = {}
    for name, dt in flat.dtensors.items():
        rows = None
        if name in flat.sharded and name in local:
            start = flat.sharded[name][1]
            rows = (start, start + int(local[name].shape[0]))
        out[name] = _Want(rows, dt)
    return out


def _as_dtensor(local: torch.Tensor, want: _Want) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    target = want.dtensor
    assert isinstance(target, DTensor)
    return DTensor.from_local(
        local,
        target.device_mesh,
        target.placements,
        run_check=False,
        shape=target.shape,
        stride=target.stride(),
    )


async def _load_manifest(
    be: IOBackend,
    loc: Located,
    pool: StagingPool,
    prefault: _Prefaulter,
    rank: int,
    allow_pickle: bool,
    wants: Mapping[str, _Want],
) -> Any:
    manifest = loc.manifest
    assert manifest is not None

    def planned() -> tuple[RankState, ReadPlan]:  # O(tensors) Python: in a worker thread
        state = manifest.rank_state(rank)
        rows = {k: w.rows for k, w in wants.items()}
        return state, plan_read(manifest, state, rows, allow_pickle=allow_pickle)

    state, plan = await asyncio.to_thread(planned)
    stored, pickled = await execute_read(be, loc, pool, prefault, plan)
    if plan.checked_spans:
        for name, want in wants.items():
            if name not in stored:
                continue
            saved = manifest.sliced[name].shape if name in manifest.sliced else manifest.tensors[name].shape
            if tuple(saved) != tuple(want.dtensor.shape):
                raise StateMismatchError(
                    f"{name}: shape {list(saved)} saved, {list(want.dtensor.shape)} here; nothing was loaded"
                )
            local = stored[name]
            if want.rows is not None and name not in plan.wanted_rows:  # read whole: this rank's rows
                local = local[want.rows[0] : want.rows[1]]
            stored[name] = _as_dtensor(local, want)
    return await asyncio.to_thread(_rebuild, state, stored, pickled)


UNLOADABLE_LAYOUTS = {
    "dcp": (
        "a torch.distributed.checkpoint directory (written through aiopersist.integrations.dcp): load "
        "it with torch.distributed.checkpoint.load(state_dict, storage_reader=AiopersistReader(path)); "
        "aiopersist.verify checks it"
    ),
    "fsdp": (
        "an FSDP checkpoint of the Hugging Face Trainer or Accelerate: resume from it with "
        "trainer.train(resume_from_checkpoint=path) or accelerator.load_state(path); its "
        "torch.distributed.checkpoint subdirectories load with torch.distributed.checkpoint.load and "
        "AiopersistReader; aiopersist.verify checks it"
    ),
}
"""The layouts of aiopersist checkpoints that `load` does not read, and what reads them."""


def _unpickle(raw: torch.Tensor, where: str) -> list[object]:
    try:
        pickled = pickle.loads(raw.numpy().tobytes())
    except MemoryError:
        raise
    except Exception as exc:  # it passed its checksum: what it names is missing here
        raise UnsupportedStateError(
            f"{where}: the pickled objects cannot be unpickled here ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(pickled, list):
        raise CheckpointCorruptError(f"{where}: the pickle file does not hold a list")
    return pickled


async def _read_header(be: IOBackend, path: str, size: int) -> FileLayout:
    """Read and check a safetensors file's header."""
    fd = await open_for_read(be, path, READ_FLAGS)
    try:
        prefix = bytearray(8)
        got = await be.read(fd, prefix, 0)
        n = header_length(bytes(prefix[:got]), size, path)
        raw = bytearray(n)
        if await be.read(fd, raw, 8) != n:
            raise CheckpointCorruptError(f"{path}: header is truncated")
    finally:
        await be.close(fd)
    return await asyncio.to_thread(parse_header, bytes(raw), size, path)  # megabytes of JSON


def _rank_to_load(manifest: Manifest, rank: int | None) -> int:
    if rank is not None:
        if not 0 <= rank < manifest.world_size:
            raise ValueError(f"rank={rank}, but the checkpoint was saved by {manifest.world_size} ranks")
        return rank
    dist = torch.distributed
    if manifest.world_size > 1 and dist.is_available() and dist.is_initialized():
        mine = dist.get_rank()
        if mine < manifest.world_size:
            return mine
    return 0


def _rebuild(state: RankState, stored: dict[str, torch.Tensor], pickled: list[object] | None) -> Any:
    """The saved object, from the tensors read (``stored``: those the skeleton reaches,
    `needed_tensors`). Views and aliases are made as the skeleton names them: one that
    nothing names has its base unread (a version 2 manifest may list such a one), and
    is not made."""
    views: dict[str, torch.Tensor] = {}

    def tensor(name: str) -> torch.Tensor:
        name = state.aliases.get(name, name)  # validated: an alias names a stored tensor or a view
        if name in state.views:
            if name not in views:  # made once: every name of it is the same tensor
                spec = state.views[name]
                views[name] = build_view(tensor(spec.base), spec)
            return views[name]
        try:
            return stored[name]
        except KeyError:
            raise CheckpointCorruptError(f"manifest skeleton refers to unknown tensor {name!r}") from None

    def unpickled(i: int) -> object:
        if pickled is None:
            raise UnsupportedStateError(
                "the checkpoint holds pickled objects; pass allow_pickle=True to load() to unpickle them "
                "(only for checkpoints you trust: unpickling can run code)"
            )
        try:
            return pickled[i]
        except IndexError:
            raise CheckpointCorruptError(f"manifest skeleton refers to unknown pickled object {i}") from None

    return decode(state.skeleton, tensor, unpickled)


def _tensors_in(obj: Any, found: dict[int, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found[id(obj)] = obj
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors_in(v, found)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _tensors_in(v, found)


def _on_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor on ``device``, tensors that share memory still sharing it
    there: the bytes of each storage that its tensors cover are copied once, and every
    tensor is rebuilt on them with its own offset, shape and strides. ``Tensor.to``
    alone would copy each view apart, in full: a view of 4 bytes claiming 4 TiB (stride
    0) would ask the device for 4 TiB."""
    found: dict[int, torch.Tensor] = {}
    _tensors_in(obj, found)
    spans: dict[tuple[int, int], tuple[int, int]] = {}
    for t in found.values():
        if _shares(t):
            start, end = _byte_extent(t)
            key = _storage_key(t)
            low, high = spans.get(key, (start, end))
            spans[key] = (min(low, start), max(high, end))
    moved: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
    for t in found.values():
        key = _storage_key(t)
        if key in spans and key not in moved:
            start, end = spans[key]
            start -= start % 16  # a multiple of every dtype's size
            span = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), start, (end - start,), (1,))
            moved[key] = (start, span.to(device))
    memo: dict[int, torch.Tensor] = {}
    for key_id, t in found.items():
        key = _storage_key(t)
        if not _shares(t) or key not in moved:
            memo[key_id] = t.to(device)
            continue
        start, span = moved[key]
        offset = (t.storage_offset() * t.element_size() - start) // t.element_size()
        memo[key_id] = torch.empty(0, dtype=t.dtype, device=device).set_(
            span.untyped_storage(), offset, t.shape, t.stride()
        )
    return _replaced(obj, memo)


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _shares(t: torch.Tensor) -> bool:
    """A plain CPU tensor with memory: moved as a span of its storage (`_on_device`)."""
    return type(t) is torch.Tensor and t.device.type == "cpu" and t.numel() > 0


def _replaced(obj: Any, memo: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return memo[id(obj)]
    if isinstance(obj, dict):
        return {k: _replaced(v, memo) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replaced(v, memo) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_replaced(v, memo) for v in obj)
    return obj


@maps_os_errors("load")
async def load(
    path: PathArg,
    *,
    into: object = None,
    map_location: str | torch.device = "cpu",
    strict: bool = True,
    backend: str = "auto",
    allow_pickle: bool = False,
    rank: int | None = None,
) -> Any:
    """Load a checkpoint: the saved object rebuilt, or loaded in place into ``into``.

    Reads an aiopersist checkpoint (checksums verified), a Hugging Face model directory
    (``model.safetensors`` or shards with an index) or a single safetensors file. Modules
    and other stateful objects come back as their state dicts; tied tensors come back
    as one tensor. With ``into`` (a module, an optimizer, anything with
    ``load_state_dict``, a tensor, or a dict or list holding those), the state is loaded
    into it and ``into`` is returned; with ``strict``, missing or unexpected keys raise
    [`StateMismatchError`][aiopersist.StateMismatchError] before anything is changed.
    Pickled objects are only unpickled with ``allow_pickle=True``.

    A checkpoint saved by several ranks loads in one process or on any number of ranks:
    shared and sharded tensors come back whole; each rank's own tensors (saved with
    ``replicated=False``) come back for ``rank``, which defaults to this process's rank
    in ``torch.distributed`` (0 without it, and 0 for ranks the checkpoint does not have).
    Only the files that hold what that rank needs are read.
    """
    loc = await asyncio.to_thread(locate, path)
    if loc.manifest is not None and loc.manifest.layout in UNLOADABLE_LAYOUTS:
        raise UnsupportedStateError(f"{loc.directory} is {UNLOADABLE_LAYOUTS[loc.manifest.layout]}")
    pool = StagingPool()
    prefault = _Prefaulter()
    try:
        async with open_backend(backend) as be:
            if loc.manifest is not None:
                wants = (
                    await asyncio.to_thread(_wants, into)
                    if into is not None and loc.manifest.version >= 2
                    else {}
                )
                state = await _load_manifest(
                    be, loc, pool, prefault, _rank_to_load(loc.manifest, rank), allow_pickle, wants
                )
            else:
                layouts = await run_all(_read_header(be, f, loc.sizes[f]) for f in loc.files)
                plan = await asyncio.to_thread(plan_safetensors, list(zip(loc.files, layouts, strict=True)))
                state, _ = await execute_read(be, loc, pool, prefault, plan)
    finally:
        prefault.close()
        pool.close()
    if into is not None:
        # Copies into the caller's live tensors: a cancelled load waits for the copy to end,
        # so that nothing changes them after CancelledError reaches the caller.
        await to_thread_to_the_end(functools.partial(load_into, into, state, strict=strict))
        return into
    device = torch.device(map_location)
    if device.type != "cpu":
        state = await to_thread_to_the_end(_on_device, state, device)
    return state


# -- verify ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyReport:
    """What `verify` checked."""

    path: str
    kind: str
    """``aiopersist`` (manifest and checksums), ``hf-dir`` or ``safetensors`` (headers only,
    but see `checksummed`)."""
    files: tuple[str, ...]
    bytes_checked: int
    """Bytes read and checked: whole files for ``aiopersist``, headers otherwise (whole
    files for those in `checksummed`)."""
    checksummed: tuple[str, ...] = ()
    """``hf-dir`` and ``safetensors``: the files an aiopersist checkpoint around them
    lists, checked against the checksums of its manifest."""


async def _hash_file(
    be: IOBackend,
    path: str,
    dio: DirectIOInfo,
    pool: StagingPool,
    size: int,
    progress: Progress | None = None,
) -> str:
    """xxh3 of a whole file, read through the pool's buffers with several in flight;
    ``progress`` hears of each window once it is hashed."""
    hasher = new_hasher()
    window = pool.buffer_bytes
    fd = await open_for_read(be, path, READ_FLAGS | dio.open_flags)
    try:

        async def window_at(pos: int) -> tuple[Any, int]:
            buf = await pool.acquire()
            try:
                length = min(window, dio.align_up(size - pos) if dio.direct else size - pos)
                got = await be.read(fd, buf.view[:length], pos)
            except BaseException:
                pool.release(buf)
                raise
            return buf, got

        tasks = [asyncio.ensure_future(window_at(pos)) for pos in range(0, size, window)]
        taken = 0  # the windows whose buffers this loop has had (and gives back itself)
        try:
            pos = 0
            for task in tasks:  # hashed in file order as the windows arrive
                buf, got = await task
                taken += 1
                try:
                    want = min(window, size - pos)
                    if got < want:
                        raise CheckpointCorruptError(f"{path}: short read at {pos} (file shrank?)")
                    with buf.view[:want] as part:
                        await to_thread_to_the_end(hasher.update, part)  # reads the pool's buffer
                finally:
                    pool.release(buf)
                if progress is not None:
                    progress(want)
                pos += window
        except BaseException:
            for task in tasks:
                task.cancel()
            # Hand back the buffers of the windows read anyway and not yet taken: a window
            # the loop took is given back by it, and once more would hand the same buffer
            # to two readers at once.
            for task in tasks[taken:]:
                with contextlib.suppress(BaseException):
                    buf, _ = await task
                    pool.release(buf)
            raise
    finally:
        await be.close(fd)
    return str(hasher.hexdigest())


@maps_os_errors("verify")
async def verify(
    path: PathArg, *, backend: str = "auto", progress: Callable[[int, int], None] | None = None
) -> VerifyReport:
    """Check a checkpoint without building it: the manifest, every file's size and
    checksum (streamed: memory stays within the staging pool). Hugging Face directories
    and plain safetensors files have no checksums: their headers are checked.

    ``progress``, if given, is called as the data is checked: ``progress(done, total)``,
    the bytes checked so far and the bytes to check, each time a window of a file (a
    staging buffer's worth) has been read and hashed, on the event loop's thread (so it
    must be quick: draw a progress bar, do no I/O that blocks). It is not called for the
    formats without checksums, whose headers alone are read.

    Raises [`CheckpointCorruptError`][aiopersist.CheckpointCorruptError] (or a sibling)
    naming the file and the fault.

    The ``.metadata`` of a torch.distributed.checkpoint directory is checked like any
    file, by size and checksum; what it says is not read here (it is DCP's pickle). The
    ``aiopersist verify`` command and the integrations' resume checks also read it as
    ``AiopersistReader`` does (``aiopersist.integrations.dcp.check_metadata_of``), which
    refuses metadata forged together with its checksums.
    """
    loc = await asyncio.to_thread(locate, path)
    pool = StagingPool()
    try:
        async with open_backend(backend) as be:
            if loc.manifest is None:
                checked = 0
                summed: list[str] = []
                for f in loc.files:
                    head = (await _read_header(be, f, loc.sizes[f])).data_offset
                    rec = loc.records.get(f)
                    if rec is None:
                        checked += head
                        continue
                    # A file of an aiopersist checkpoint: its checksum there, too.
                    _check_checksum(f, rec, await _hash_file(be, f, loc.dio, pool, rec.nbytes))
                    checked += rec.nbytes
                    summed.append(f)
                where = loc.files[0] if loc.kind == "safetensors" else loc.directory
                return VerifyReport(where, loc.kind, loc.files, checked, tuple(summed))
            plan = plan_verify(loc.manifest)
            prefault = _Prefaulter()
            counted = None
            if progress is not None:
                total = sum(loc.manifest.files[f.file].nbytes for f in plan.files)
                done = 0

                def counted(n: int) -> None:
                    nonlocal done
                    done += n
                    progress(done, total)

            try:
                await execute_read(be, loc, pool, prefault, plan, counted)
            finally:
                prefault.close()
            names = tuple(loc.path_of(loc.manifest.files[f.file]) for f in plan.files)
            return VerifyReport(loc.directory, "aiopersist", names, sum(loc.sizes.values()))
    finally:
        pool.close()
