"""``save`` and ``load``: the one-shot entry points, and their blocking twins.

Write path: flatten -> plan files -> stage into aligned buffers (checksummed as they
leave) -> engine -> fsync -> manifest -> publish (temp directory, rename, fsync parent).
Read path: manifest -> engine reads (straight into the destination where aligned) ->
checksum -> tensors -> the object rebuilt, or loaded in place into ``into``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import json
import math
import os
import pickle
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from . import _knobs
from ._backends import IOBackend, open_backend, to_thread_to_the_end
from ._commit import atomic_directory, remove_path
from ._direct import AlignedBuffer, DirectIOInfo, empty_for_direct_read, probe_directory
from ._exceptions import (
    AiopersistError,
    CheckpointCorruptError,
    StateMismatchError,
    UnsupportedStateError,
    maps_os_errors,
)
from ._flatten import Flattened, StoredTensor, build_view, flatten
from ._format import FileLayout, header_length, layout_file, parse_header
from ._into import load_into
from ._locate import MODEL_INDEX, READ_FLAGS, Located, PathArg, checkpoint_paths, locate
from ._manifest import (
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    RankState,
    TensorRecord,
    dump_manifest,
    new_hasher,
    safe_file_name,
)
from ._skeleton import decode
from ._skeleton import refs as skeleton_refs
from ._staging import StagingPool
from ._stream import FileWriter, cuda_ready_streams, read_segments, run_all, settle
from ._workers import DaemonThreadPool

PICKLE_FILE = "pickled.bin"
T = TypeVar("T")


@dataclass(frozen=True)
class SaveInfo:
    """What a save did."""

    path: str
    """Absolute path of the published checkpoint directory."""
    bytes_written: int
    """Bytes this process wrote (headers and manifest included, alignment padding excluded)."""
    files: tuple[str, ...]
    """The files written, relative to `path`."""
    seconds: float
    """Wall time of the whole save, publication included."""
    backend: str
    """The I/O backend that did the work (`io_uring` or `threads`)."""
    tensor_bytes: int = 0
    """Bytes of tensor data stored (shared storages counted once)."""

    @property
    def gib_per_second(self) -> float:
        """`bytes_written` over `seconds`, in GiB/s."""
        return self.bytes_written / (1 << 30) / self.seconds if self.seconds > 0 else float("inf")


# -- planning (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedFile:
    """One data file: its name, the stored tensors in it (by name) and its header."""

    name: str
    tensors: tuple[str, ...]
    layout: FileLayout


def plan_signature(flat: Flattened) -> tuple[object, ...]:
    """What the plan depends on: a plan is reused while this stays the same."""
    return (
        flat.model_only,
        tuple((s.name, s.source.dtype, tuple(s.source.shape), s.alignment) for s in flat.stored),
    )


def plan_files(flat: Flattened, max_shard_bytes: int) -> list[PlannedFile]:
    """Assign stored tensors to safetensors files of at most ``max_shard_bytes`` each.

    Tensors go largest dtype first (stable within a dtype size), so every tensor starts
    at a multiple of its element size and loads can place it for direct reads. A model's
    weights use Hugging Face's names (``model.safetensors`` or ``model-0000i-of-0000n``).
    """
    ordered = sorted(flat.stored, key=lambda s: -s.alignment)
    shards: list[list[StoredTensor]] = [[]]
    size = 0
    for st in ordered:
        if shards[-1] and size + st.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(st)
        size += st.nbytes
    stem = "model" if flat.model_only else "state"
    n = len(shards)
    out = []
    for i, members in enumerate(shards, 1):
        name = f"{stem}.safetensors" if n == 1 else f"{stem}-{i:05d}-of-{n:05d}.safetensors"
        layout = layout_file([(s.name, s.source.dtype, s.source.shape) for s in members], {"format": "pt"})
        out.append(PlannedFile(name, tuple(s.name for s in members), layout))
    return out


# -- save -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchSave:
    """An object to write as ``torch.save`` would, into a file of a checkpoint.

    The bytes ``torch.save`` produces go straight into the staging buffers (a file-like
    object whose ``write`` feeds the engine): no copy of the object is made in memory, so
    tensors in it are read while the file is written, as with the checkpoint's own
    tensors (a `Checkpointer`'s ``staged`` waits for them too in fence mode; in snapshot
    mode they are copied with the state's). ``torch.load(weights_only=True)`` reads the
    file when the object holds only what it allows (state dicts do).
    """

    obj: object


class _TorchSaveSink:
    """What ``torch.save`` writes to, from a worker thread: each ``write`` is handed to the
    `FileWriter` on the event loop, and returns once the bytes are in staging buffers."""

    def __init__(self, writer: FileWriter, loop: asyncio.AbstractEventLoop) -> None:
        self._writer = writer
        self._loop = loop
        self._pos = 0
        self._stopped = False
        self.error: BaseException | None = None
        """The first error a ``write`` raised (torch.save reports it as its own error)."""

    def stop(self) -> None:
        """Make every later ``write`` raise, so that ``torch.save`` ends early."""
        self._stopped = True

    def write(self, data: Any) -> int:
        try:
            if self._stopped:
                raise OSError(errno.ECANCELED, "the save was stopped")
            with memoryview(data) as view:
                n = view.nbytes
                if n:
                    asyncio.run_coroutine_threadsafe(self._writer.write(view), self._loop).result()
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            raise
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True


def torch_save_to(obj: object, sink: Any, name: str) -> None:
    """``torch.save(obj, sink)`` for the extra file ``name``, with typed errors: what made a
    ``write`` fail (a full disk: the sink's ``error``) rather than torch's wrapper of it,
    and `UnsupportedStateError` for what torch cannot serialize (unpicklable objects,
    absurd nesting)."""
    try:
        torch.save(obj, sink)
    except MemoryError:
        raise
    except Exception as exc:
        cause = getattr(sink, "error", None)
        if cause is not None:
            raise cause from None
        raise UnsupportedStateError(
            f"extra_files[{name!r}]: torch.save failed: {type(exc).__name__}: {exc}"
        ) from exc


def _torch_save_when_ready(obj: object, sink: _TorchSaveSink, name: str) -> None:
    with cuda_ready_streams():  # torch.save copies CUDA tensors on this thread's streams
        torch_save_to(obj, sink, name)


async def write_torch_save(
    be: IOBackend,
    path: str,
    dio: DirectIOInfo,
    pool: StagingPool,
    obj: object,
    written: Callable[[], None] | None = None,
) -> FileRecord:
    """Write ``torch.save(obj)``'s bytes as a new file through the engine, checksummed."""
    hasher = new_hasher()
    loop = asyncio.get_running_loop()
    async with FileWriter(be, path, dio, pool, hasher=hasher) as writer:
        sink = _TorchSaveSink(writer, loop)
        name = os.path.basename(path)
        thread = asyncio.ensure_future(asyncio.to_thread(_torch_save_when_ready, obj, sink, name))
        try:
            await asyncio.shield(thread)
        except asyncio.CancelledError:
            # The thread cannot be cancelled: stop it at its next write and wait for it, so
            # the writer is not closed (nor the pool released) under its feet.
            sink.stop()
            await settle([thread])
            raise
        if written is not None:
            written()
    return FileRecord(os.path.basename(path), writer.bytes_written, hasher.hexdigest())


ExtraFiles = Mapping[str, "bytes | TorchSave"]


def countdown(count: int, staged: Callable[[], None] | None) -> Callable[[], None]:
    """A callback to call once per file written: the ``count``-th call calls ``staged``
    (at once when ``count`` is 0)."""
    remaining = count

    def one_written() -> None:
        nonlocal remaining
        remaining -= 1
        if remaining == 0 and staged is not None:
            staged()

    if remaining == 0 and staged is not None:
        staged()
    return one_written


async def write_file(
    be: IOBackend,
    path: str,
    dio: DirectIOInfo,
    pool: StagingPool,
    parts: Sequence[bytes | torch.Tensor],
    written: Callable[[], None] | None = None,
    hasher: Any = None,
) -> FileRecord:
    """Write ``parts`` as a new file, checksummed (by ``hasher`` when given), fsynced.

    The parts must stay unchanged until ``written`` is called (the tensors of a save until
    it is staged): their bytes are copied into staging in worker threads, batched per
    buffer, while the file is being written."""
    hasher = hasher if hasher is not None else new_hasher()
    async with FileWriter(be, path, dio, pool, hasher=hasher) as writer:
        for part in parts:
            await writer.write(part, stable=True)
        await writer.copied()
        if written is not None:
            written()  # every byte is in staging or on its way to the disk
    return FileRecord(os.path.basename(path), writer.bytes_written, hasher.hexdigest())


@maps_os_errors("save")
async def save(
    obj: object,
    path: PathArg,
    *,
    backend: str = "auto",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    max_shard_bytes: int | None = None,
    replicated: bool | Callable[[str], bool] | None = None,
    group: Any = None,
    extra_files: ExtraFiles | None = None,
) -> SaveInfo:
    """Save ``obj`` as a checkpoint directory at ``path``; durable when it returns.

    ``obj`` may be an ``nn.Module``, an optimizer, LR scheduler, ``GradScaler`` or anything
    with ``state_dict()``/``load_state_dict()``, tensors, numpy arrays, and nested dicts,
    lists and tuples of those and of JSON scalars (``int``, ``float`` including ``nan`` and
    ``inf``, ``bool``, ``None``, ``str``) and ``bytes``. Anything else raises
    [`UnsupportedStateError`][aiopersist.UnsupportedStateError] naming its path, unless
    ``allow_pickle=True`` (then it is pickled into a separate file).

    Every data file is a safetensors file; a module or a flat mapping of tensors is saved
    in the Hugging Face layout (``model.safetensors`` or shards with an index), so
    ``from_pretrained`` reads it. An existing ``path`` raises
    [`CheckpointExistsError`][aiopersist.CheckpointExistsError] unless ``overwrite=True``,
    which replaces it atomically once the new checkpoint is durable.

    **Several disks and ranks.** ``path`` may be a list of directories, one per disk: the
    first is the checkpoint (it holds the manifest); the others get a part each. Under
    ``torch.distributed`` every rank of ``group`` (the default group when ``None``) calls
    `save` with the same ``path``; the bytes are split between the ranks, balanced, and
    the checkpoint commits on all ranks or none. ``replicated`` says which tensors are the
    same on every rank (written once, split between the ranks): ``True``, ``False`` or a
    predicate on the tensor's name; by default the tensors of a
    ``DistributedDataParallel`` module and replicated DTensors are, and dim-0 sharded
    DTensors (FSDP2) are written by their owners as slices of one tensor. Anything else is
    this rank's own. `SaveInfo.bytes_written` is what this rank wrote.

    ``extra_files`` maps file names to ``bytes`` or a [`TorchSave`][aiopersist.TorchSave]
    to write beside the data (a ``config.json``, an ``optimizer.pt``): published with the
    checkpoint, checksummed, listed in its manifest. One process and one directory only.
    """
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError("metadata must map str to str")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    from ._dist import coordinator
    from ._parallel import save_spread

    paths = checkpoint_paths(path)
    coord = coordinator(group)  # before any await: it may make the checkpoint's gloo group
    flat: Flattened | Exception
    try:
        flat = flatten(obj, allow_pickle=allow_pickle)
    except Exception as exc:
        if coord is None:
            raise
        flat = exc  # the other ranks hear of it, and fail with it, rather than wait
    shard = max_shard_bytes or _knobs.shard_bytes()
    pool = StagingPool()
    try:
        async with open_backend(backend) as be:
            if coord is None and len(paths) == 1:
                assert isinstance(flat, Flattened)
                return await write_checkpoint(
                    be,
                    pool,
                    flat,
                    plan_files(flat, shard),
                    paths[0],
                    metadata=metadata,
                    overwrite=overwrite,
                    extra_files=extra_files,
                )
            if extra_files:
                raise ValueError("extra_files: only for a save by one process into one directory")
            return await save_spread(
                be,
                pool,
                flat,
                paths,
                coord,
                replicated=replicated,
                metadata=metadata,
                overwrite=overwrite,
                max_shard_bytes=shard,
            )
    finally:
        pool.close()


async def write_checkpoint(
    be: IOBackend,
    pool: StagingPool,
    flat: Flattened,
    planned: Sequence[PlannedFile],
    path: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None,
    overwrite: bool,
    staged: Callable[[], None] | None = None,
    discard: Callable[[str], None] | None = None,
    extra_files: ExtraFiles | None = None,
) -> SaveInfo:
    """Write a flattened state as a checkpoint at ``path`` and publish it; the engine room of
    `save` and of `Checkpointer.save`. ``staged()`` is called once every tensor byte has
    left the caller's tensors (copied into staging buffers), before the fsyncs.
    ``extra_files`` are written beside the data, checksummed and listed in the manifest."""
    start = time.perf_counter()
    sources = {s.name: s.source for s in flat.stored}
    pickled = await asyncio.to_thread(pickle_objects, flat) if flat.pickled else None
    additions = dict(extra_files or {})
    reserved = {pf.name for pf in planned} | {PICKLE_FILE, MANIFEST_NAME, MODEL_INDEX}
    for name in additions:
        safe_file_name(name, "extra_files")
        if name in reserved:
            raise ValueError(f"extra_files: {name!r} is a name the checkpoint itself uses")
    one_written = countdown(len(planned) + (pickled is not None) + len(additions), staged)
    async with atomic_directory(path, overwrite=overwrite, discard=discard or remove_path) as pending:
        dio = await to_thread_to_the_end(probe_directory, pending.tmp)  # its scratch file is in tmp
        jobs = [
            write_file(
                be,
                os.path.join(pending.tmp, pf.name),
                dio,
                pool,
                [pf.layout.header, *(sources[n] for n in pf.tensors)],
                one_written,
            )
            for pf in planned
        ]
        if pickled is not None:
            jobs.append(
                write_file(be, os.path.join(pending.tmp, PICKLE_FILE), dio, pool, [pickled], one_written)
            )
        for name, content in additions.items():
            target = os.path.join(pending.tmp, name)
            if isinstance(content, TorchSave):
                jobs.append(write_torch_save(be, target, dio, pool, content.obj, one_written))
            else:
                jobs.append(write_file(be, target, dio, pool, [content], one_written))
        records = await run_all(jobs)
        files: dict[str, FileRecord] = {}
        tensors: dict[str, TensorRecord] = {}
        for pf, rec in zip(planned, records, strict=False):
            files[pf.name] = FileRecord(pf.name, rec.nbytes, rec.checksum, pf.layout.data_offset)
            for name, entry in zip(pf.tensors, pf.layout.entries, strict=True):
                tensors[name] = TensorRecord(
                    name,
                    pf.name,
                    pf.layout.data_offset + entry.begin,
                    pf.layout.data_offset + entry.end,
                    entry.dtype,
                    entry.shape,
                )
        if pickled is not None:
            files[PICKLE_FILE] = records[len(planned)]
        for rec in records[len(planned) + (pickled is not None) :]:
            files[rec.name] = rec
        manifest = Manifest(
            files=files,
            tensors=tensors,
            skeleton=flat.skeleton,
            aliases=flat.aliases,
            views=flat.views,
            pickle_file=PICKLE_FILE if pickled is not None else None,
            metadata=dict(metadata or {}),
            layout="hf-model" if flat.model_only else "state",
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        )
        extra = [(MANIFEST_NAME, dump_manifest(manifest))]
        if flat.model_only and len(planned) > 1:
            weight_map = {t.name: t.file for t in tensors.values()}
            index = {"metadata": {"total_size": flat.tensor_bytes}, "weight_map": weight_map}
            extra.append((MODEL_INDEX, json.dumps(index, indent=2).encode()))
        extra_records = await run_all(
            write_file(be, os.path.join(pending.tmp, n), dio, pool, [b]) for n, b in extra
        )
    written = sum(r.nbytes for r in records) + sum(r.nbytes for r in extra_records)
    names = tuple(files) + tuple(n for n, _ in extra)
    return SaveInfo(pending.final, written, names, time.perf_counter() - start, be.name, flat.tensor_bytes)


# -- load -----------------------------------------------------------------------------------


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
    # Large tensors get memory the kernel can read into directly (no staging copy).
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


@dataclass(frozen=True)
class _Segment:
    """Bytes ``[begin, end)`` of a file, read into ``dest`` (a uint8 view)."""

    begin: int
    end: int
    dest: torch.Tensor


async def _read_manifest_file(
    be: IOBackend,
    loc: Located,
    pool: StagingPool,
    prefault: _Prefaulter,
    rec: FileRecord,
    segments: Sequence[_Segment],
) -> torch.Tensor:
    """Read every byte of one file into the segments' destinations and check its checksum;
    returns the bytes before the first segment (the header, or the whole pickle file)."""
    assert loc.manifest is not None
    path = loc.path_of(rec)
    ordered = sorted(segments, key=lambda g: g.begin)
    # The whole file is read, header included, so the checksum covers every byte.
    head_len = rec.data_offset if rec.data_offset is not None else rec.nbytes
    head = torch.empty(head_len, dtype=torch.uint8)
    parts = [(0, head)]
    pos = head_len
    for g in ordered:
        if g.begin != pos:
            raise CheckpointCorruptError(f"{path}: bytes {pos}..{g.begin} belong to no tensor")
        parts.append((g.begin, g.dest))
        pos = g.end
    if pos != rec.nbytes:
        raise CheckpointCorruptError(f"{path}: {rec.nbytes - pos} bytes after the last tensor")
    prefault.start()
    # Read in groups of about _HASH_GROUP bytes, a few groups in flight, and checksum each
    # group in file order (in a thread) as soon as it is in: the checksum overlaps the reads.
    hasher = new_hasher()
    groups = _groups(parts, _HASH_GROUP)
    ahead = asyncio.Semaphore(_GROUPS_AHEAD)

    async def read_group(group: list[tuple[int, torch.Tensor]]) -> None:
        async with ahead:
            await read_segments(be, path, loc.dio, pool, group)

    tasks = [asyncio.ensure_future(read_group(g)) for g in groups]
    try:
        for group, task in zip(groups, tasks, strict=True):
            await task
            await asyncio.to_thread(_update, hasher, [d for _, d in group])
    except BaseException:
        for task in tasks:
            task.cancel()
        await settle(tasks)  # requests in flight write into the tensors until they end
        raise
    actual = str(hasher.hexdigest())
    if actual != rec.checksum:
        raise CheckpointCorruptError(f"{path}: checksum mismatch (stored {rec.checksum}, computed {actual})")
    return head


def _needed(manifest: Manifest, state: RankState) -> set[str]:
    """The stored (whole or sliced) tensors a rank's skeleton reaches (the manifest was
    validated: every reference resolves, and an alias points to a stored tensor or a view)."""
    out: set[str] = set()
    for name, _ in skeleton_refs(state.skeleton):
        name = state.aliases.get(name, name)
        out.add(state.views[name].base if name in state.views else name)
    return out


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


def _parts_checked(manifest: Manifest, needed: set[str]) -> bool:
    """Whether every needed tensor has checksums of its own (then it is read alone)."""
    for name in needed:
        if name in manifest.tensors:
            if manifest.tensors[name].checksum is None:
                return False
        elif any(p.checksum is None for p in manifest.sliced[name].slices):
            return False
    return True


async def _load_parts(
    be: IOBackend,
    loc: Located,
    pool: StagingPool,
    prefault: _Prefaulter,
    needed: set[str],
    wants: Mapping[str, _Want],
) -> dict[str, torch.Tensor]:
    """Read the needed tensors, and of a sharded one only the slices that hold the wanted
    rows, each checked against its own checksum."""
    manifest = loc.manifest
    assert manifest is not None
    by_file: dict[str, list[tuple[int, torch.Tensor, str, str]]] = {}
    stored: dict[str, torch.Tensor] = {}
    after: list[Callable[[], None]] = []

    def add(file: str, begin: int, dest: torch.Tensor, checksum: str | None, what: str) -> None:
        by_file.setdefault(file, []).append((begin, dest, checksum or "", what))

    for name in sorted(needed):
        if name in manifest.tensors:
            t = manifest.tensors[name]
            dest = _allocate(
                t.shape, t.dtype, t.begin, loc.dio.direct and t.nbytes >= pool.buffer_bytes, prefault
            )
            stored[name] = dest
            add(t.file, t.begin, dest.reshape(-1).view(torch.uint8), t.checksum, name)
            continue
        sl = manifest.sliced[name]
        want = wants.get(name)
        r0, r1 = want.rows if want is not None and want.rows is not None else (0, sl.shape[0])
        if not 0 <= r0 <= r1 <= sl.shape[0]:
            raise StateMismatchError(f"{name}: rows {r0}..{r1} wanted, the checkpoint has {sl.shape[0]}")
        overlapping = [p for p in sl.slices if p.row_start < r1 and p.row_end > r0]
        first = overlapping[0].begin if overlapping else 0
        shape = (r1 - r0, *sl.shape[1:])
        dest = _allocate(shape, sl.dtype, first, loc.dio.direct and sl.nbytes >= pool.buffer_bytes, prefault)
        stored[name] = dest
        rows = dest.reshape(r1 - r0, math.prod(sl.shape[1:]))
        for p in overlapping:
            what = f"{name}[{p.row_start}:{p.row_end}]"
            if r0 <= p.row_start and p.row_end <= r1:
                add(
                    p.file,
                    p.begin,
                    rows[p.row_start - r0 : p.row_end - r0].reshape(-1).view(torch.uint8),
                    p.checksum,
                    what,
                )
                continue
            # Partly wanted: the whole slice is read (its checksum covers all of it), and
            # the wanted rows copied out.
            scratch = torch.empty((p.row_end - p.row_start, rows.shape[1]), dtype=sl.dtype)
            add(p.file, p.begin, scratch.reshape(-1).view(torch.uint8), p.checksum, what)
            a, b = max(r0, p.row_start), min(r1, p.row_end)

            def copy(
                dst: torch.Tensor = rows[a - r0 : b - r0],
                src: torch.Tensor = scratch[a - p.row_start : b - p.row_start],
            ) -> None:
                dst.copy_(src)

            after.append(copy)
    prefault.start()

    async def one_file(file: str, items: list[tuple[int, torch.Tensor, str, str]]) -> None:
        path = loc.path_of(manifest.files[file])
        await read_segments(be, path, loc.dio, pool, [(begin, dest) for begin, dest, _, _ in items])
        actual = await asyncio.to_thread(_digests, [dest for _, dest, _, _ in items])
        for (_, _, stated, what), got in zip(items, actual, strict=True):
            if got != stated:
                raise CheckpointCorruptError(
                    f"{path}: checksum mismatch in {what} (stored {stated}, computed {got})"
                )

    await run_all(one_file(f, items) for f, items in by_file.items())
    for fn in after:
        fn()
    return stored


def _digests(parts: Sequence[torch.Tensor]) -> list[str]:
    out = []
    for part in parts:
        hasher = new_hasher()
        if part.numel():
            hasher.update(cast(Any, part.numpy()))
        out.append(str(hasher.hexdigest()))
    return out


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
    state = manifest.rank_state(rank)
    needed = _needed(manifest, state) if manifest.version >= 2 else set(manifest.tensors)
    if manifest.version >= 2 and manifest.pickle_file is None and _parts_checked(manifest, needed):
        parts = await _load_parts(be, loc, pool, prefault, needed, wants)
        for name, want in wants.items():
            if name not in parts:
                continue
            saved = manifest.sliced[name].shape if name in manifest.sliced else manifest.tensors[name].shape
            if tuple(saved) != tuple(want.dtensor.shape):
                raise StateMismatchError(
                    f"{name}: shape {list(saved)} saved, {list(want.dtensor.shape)} here; nothing was loaded"
                )
            local = parts[name]
            if want.rows is not None and name in manifest.tensors:  # stored whole: this rank's rows
                local = local[want.rows[0] : want.rows[1]]
            parts[name] = _as_dtensor(local, want)
        return _rebuild(state, parts, None)
    # Every file that holds a byte of a needed tensor is read whole (its checksum covers
    # all of it); files that hold only other ranks' tensors are not read at all.
    wanted_files = {t.file for t in manifest.tensors.values() if t.name in needed}
    wanted_files |= {p.file for sl in manifest.sliced.values() if sl.name in needed for p in sl.slices}
    segments: dict[str, list[_Segment]] = {name: [] for name in manifest.files}
    stored: dict[str, torch.Tensor] = {}
    for t in sorted(manifest.tensors.values(), key=lambda t: (t.file, t.begin)):
        if t.file not in wanted_files:
            continue
        dest = _allocate(
            t.shape, t.dtype, t.begin, loc.dio.direct and t.nbytes >= pool.buffer_bytes, prefault
        )
        stored[t.name] = dest
        segments[t.file].append(_Segment(t.begin, t.end, dest.reshape(-1).view(torch.uint8)))
    for sl in manifest.sliced.values():
        if not any(piece.file in wanted_files for piece in sl.slices):
            continue
        first = sl.slices[0]
        whole = _allocate(
            sl.shape, sl.dtype, first.begin, loc.dio.direct and sl.nbytes >= pool.buffer_bytes, prefault
        )
        stored[sl.name] = whole
        rows = whole.reshape(sl.shape[0], math.prod(sl.shape[1:]))
        for piece in sl.slices:
            if piece.file in wanted_files:
                dest = rows[piece.row_start : piece.row_end].reshape(-1).view(torch.uint8)
                segments[piece.file].append(_Segment(piece.begin, piece.end, dest))
    wanted_files.discard(manifest.pickle_file or "")
    reads = [
        _read_manifest_file(be, loc, pool, prefault, manifest.files[name], segments[name])
        for name in manifest.files
        if name in wanted_files
    ]
    if manifest.pickle_file is not None and allow_pickle:
        reads.append(_read_manifest_file(be, loc, pool, prefault, manifest.files[manifest.pickle_file], []))
    heads = await run_all(reads)
    pickled = None
    if manifest.pickle_file is not None and allow_pickle:
        pickled = await asyncio.to_thread(_unpickle, heads[-1], loc.directory)
    return _rebuild(state, {k: v for k, v in stored.items() if k in needed}, pickled)


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


def pickle_objects(flat: Flattened) -> bytes:
    """The bytes of the pickle file; `UnsupportedStateError` naming the path of the first
    object that cannot be pickled."""
    try:
        return pickle.dumps(flat.pickled, protocol=pickle.HIGHEST_PROTOCOL)
    except MemoryError:
        raise
    except Exception as exc:
        for obj, where in zip(flat.pickled, flat.pickled_paths, strict=True):
            try:
                pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as one:
                raise UnsupportedStateError(
                    f"{where}: cannot be pickled ({type(one).__name__}: {one})"
                ) from one
        raise UnsupportedStateError(
            f"the pickled objects cannot be pickled together ({type(exc).__name__}: {exc})"
        ) from exc


async def _read_header(be: IOBackend, path: str, size: int) -> FileLayout:
    """Read and check a safetensors file's header."""
    fd = await be.open(path, READ_FLAGS)
    try:
        prefix = bytearray(8)
        got = await be.read(fd, prefix, 0)
        n = header_length(bytes(prefix[:got]), size, path)
        raw = bytearray(n)
        if await be.read(fd, raw, 8) != n:
            raise CheckpointCorruptError(f"{path}: header is truncated")
    finally:
        await be.close(fd)
    return parse_header(bytes(raw), size, path)


async def _read_safetensors(
    be: IOBackend, path: str, loc: Located, pool: StagingPool, prefault: _Prefaulter
) -> dict[str, torch.Tensor]:
    layout = await _read_header(be, path, loc.sizes[path])
    out: dict[str, torch.Tensor] = {}
    segments = []
    for e in layout.entries:
        offset = layout.data_offset + e.begin
        t = _allocate(e.shape, e.dtype, offset, loc.dio.direct and e.nbytes >= pool.buffer_bytes, prefault)
        out[e.name] = t
        segments.append((offset, t.reshape(-1).view(torch.uint8)))
    prefault.start()
    await read_segments(be, path, loc.dio, pool, segments)
    return out


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
    tensors = dict(stored)
    for name, spec in state.views.items():
        tensors[name] = build_view(stored[spec.base], spec)
    for name, target in state.aliases.items():
        tensors[name] = tensors[target]

    def tensor(name: str) -> torch.Tensor:
        try:
            return tensors[name]
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


def _to_device(obj: Any, device: torch.device, memo: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = obj.to(device)
        return memo[key]
    if isinstance(obj, dict):
        return {k: _to_device(v, device, memo) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device, memo) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_device(v, device, memo) for v in obj)
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
    pool = StagingPool()
    prefault = _Prefaulter()
    try:
        async with open_backend(backend) as be:
            if loc.manifest is not None:
                wants = _wants(into) if into is not None and loc.manifest.version >= 2 else {}
                state = await _load_manifest(
                    be, loc, pool, prefault, _rank_to_load(loc.manifest, rank), allow_pickle, wants
                )
            else:
                parts = await run_all(_read_safetensors(be, f, loc, pool, prefault) for f in loc.files)
                state = {k: v for p in parts for k, v in p.items()}
    finally:
        prefault.close()
        pool.close()
    if into is not None:
        load_into(into, state, strict=strict)
        return into
    device = torch.device(map_location)
    if device.type != "cpu":
        state = _to_device(state, device, {})
    return state


# -- verify ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyReport:
    """What `verify` checked."""

    path: str
    kind: str
    """``aiopersist`` (manifest and checksums), ``hf-dir`` or ``safetensors`` (headers only)."""
    files: tuple[str, ...]
    bytes_checked: int
    """Bytes read and checked: whole files for ``aiopersist``, headers otherwise."""


async def _hash_file(be: IOBackend, path: str, dio: DirectIOInfo, pool: StagingPool, size: int) -> str:
    """xxh3 of a whole file, read through the pool's buffers with several in flight."""
    hasher = new_hasher()
    window = pool.buffer_bytes
    fd = await be.open(path, READ_FLAGS | dio.open_flags)
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
        try:
            pos = 0
            for task in tasks:  # hashed in file order as the windows arrive
                buf, got = await task
                try:
                    want = min(window, size - pos)
                    if got < want:
                        raise CheckpointCorruptError(f"{path}: short read at {pos} (file shrank?)")
                    with buf.view[:want] as part:
                        await to_thread_to_the_end(hasher.update, part)  # reads the pool's buffer
                finally:
                    pool.release(buf)
                pos += window
        except BaseException:
            for task in tasks:
                task.cancel()
            for task in tasks:  # hand back the buffers of windows that were read anyway
                with contextlib.suppress(BaseException):
                    buf, _ = await task
                    pool.release(buf)
            raise
    finally:
        await be.close(fd)
    return str(hasher.hexdigest())


def _spans_by_file(manifest: Manifest) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges the manifest places in each file, sorted."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for t in manifest.tensors.values():
        spans.setdefault(t.file, []).append((t.begin, t.end))
    for sl in manifest.sliced.values():
        for p in sl.slices:
            spans.setdefault(p.file, []).append((p.begin, p.end))
    return {name: sorted(found) for name, found in spans.items()}


@maps_os_errors("verify")
async def verify(path: PathArg, *, backend: str = "auto") -> VerifyReport:
    """Check a checkpoint without building it: the manifest, every file's size and
    checksum (streamed: memory stays within the staging pool). Hugging Face directories
    and plain safetensors files have no checksums: their headers are checked.

    Raises [`CheckpointCorruptError`][aiopersist.CheckpointCorruptError] (or a sibling)
    naming the file and the fault.
    """
    loc = await asyncio.to_thread(locate, path)
    pool = StagingPool()
    try:
        async with open_backend(backend) as be:
            if loc.manifest is None:
                checked = 0
                for f in loc.files:
                    checked += (await _read_header(be, f, loc.sizes[f])).data_offset
                where = loc.files[0] if loc.kind == "safetensors" else loc.directory
                return VerifyReport(where, loc.kind, loc.files, checked)
            spans = _spans_by_file(loc.manifest)
            names = []
            for name, rec in loc.manifest.files.items():
                full = loc.path_of(rec)
                actual = await _hash_file(be, full, loc.dio, pool, rec.nbytes)
                if actual != rec.checksum:
                    raise CheckpointCorruptError(
                        f"{full}: checksum mismatch (stored {rec.checksum}, computed {actual})"
                    )
                if rec.data_offset is not None:
                    # The file's own header must say what the manifest says, so that any
                    # safetensors reader sees the same tensors.
                    layout = await _read_header(be, full, rec.nbytes)
                    found = sorted(
                        (layout.data_offset + e.begin, layout.data_offset + e.end) for e in layout.entries
                    )
                    if layout.data_offset != rec.data_offset or found != spans.get(name, []):
                        raise CheckpointCorruptError(f"{full}: its header does not match the manifest")
                names.append(full)
            return VerifyReport(loc.directory, "aiopersist", tuple(names), sum(loc.sizes.values()))
    finally:
        pool.close()


# -- blocking twins -------------------------------------------------------------------------


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        "aiopersist.save_sync()/load_sync() called from a running event loop; use `await aiopersist.save()`"
    )


def save_sync(obj: object, path: str | os.PathLike[str], **kwargs: Any) -> SaveInfo:
    """Blocking [`save`][aiopersist.save] for plain scripts (runs its own event loop)."""
    return _run(save(obj, path, **kwargs))


def load_sync(path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """Blocking [`load`][aiopersist.load] for plain scripts (runs its own event loop)."""
    return _run(load(path, **kwargs))
