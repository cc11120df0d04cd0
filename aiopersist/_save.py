"""``save``, and the one executor of a `WritePlan` that every save runs through.

A save, on every rank (one process in one directory is the one-rank, one-writer case):

1. flatten the state (in a worker thread) and `describe` it; rank 0 creates the
   checkpoint's temporary directory; the ranks exchange their descriptions;
2. `plan_write` (pure, the same on every rank, cached between saves of one structure);
3. write this rank's files (tensors copied into staging and checksummed in worker
   threads, written by the engine, fsynced); rank 0 also writes the pickle file and the
   extra files; the ranks exchange what they wrote;
4. rank 0 writes the manifest (and Hugging Face's index for a sharded model), fsyncs the
   part directories and publishes the temporary directory under the checkpoint's name;
   the ranks exchange the result.

The primary directory (the first ``path``) is the checkpoint: it holds the manifest and
its own share of the files. Every further directory gets a part: a fresh subdirectory
``part-<token>`` of the path given for that disk. Parts never take a name that another
save could be using, so the rename of the primary is the one commit point of the whole
save: before it, nothing under the checkpoint's name changed; after it, every part is
complete and durable. A crash in between leaves unreferenced parts, which nothing reads.
An error on any rank at any step makes every rank raise, and rank 0 removes the
temporary directory and the parts: no checkpoint appears.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import itertools
import json
import os
import pickle
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from . import _knobs
from ._backends import IOBackend, open_backend, to_thread_to_the_end
from ._commit import (
    check_room,
    fsync_directory,
    make_directories,
    make_temp,
    publish_with_parts,
    remove_empty_directory,
    remove_path,
)
from ._direct import DirectIOInfo, probe_directory
from ._dist import FAILURES, Coordinator, Exchanges, coordinator
from ._exceptions import (
    AiopersistError,
    CheckpointCorruptError,
    RankFailedError,
    UnsupportedStateError,
    maps_os_errors,
)
from ._flatten import Flattened, flatten
from ._format import dtype_from_name, layout_file, supported_dtype
from ._locate import PathArg, checkpoint_paths, own_parts, read_manifest, token_at
from ._manifest import (
    FileRecord,
    Manifest,
    SlicedRecord,
    SliceRecord,
    TensorRecord,
    dump_manifest,
    format_version,
    member_directories,
    new_hasher,
    safe_member_name,
)
from ._names import MANIFEST_NAME, MODEL_INDEX, PART_PREFIX, PICKLE_FILE, part_dir, temp_path
from ._plan import FilePlan, PartPlan, RankDesc, Replicated, WritePlan, describe, plan_write, rank_state
from ._staging import StagingPool
from ._stream import Bytes, FileWriter, PartHasher, cuda_ready_streams, run_all, settle


@dataclass(frozen=True)
class SaveInfo:
    """What a save did."""

    path: str
    """Absolute path of the published checkpoint directory."""
    bytes_written: int
    """Bytes this process wrote (headers and manifest included, alignment padding excluded)."""
    files: tuple[str, ...]
    """The files this process wrote, by name (those of a part are in its directory)."""
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


# -- extra files ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchSave:
    """An object to write as ``torch.save`` would, into a file of a checkpoint.

    The bytes ``torch.save`` produces go straight into the staging buffers (a file-like
    object whose ``write`` feeds the engine): no copy of the object is made in memory, so
    tensors in it are read while the file is written, as with the checkpoint's own
    tensors (a `Checkpointer`'s ``staged`` waits for them too in fence mode; in snapshot
    mode they are copied with the state's). With a `Checkpointer`, the containers of an
    object made of dicts, lists, tuples and namedtuples over plain values and tensors (a
    state dict) are copied when ``save`` is called: what it holds besides tensor data is
    what it was then. ``torch.load(weights_only=True)`` reads the file when the object
    holds only what it allows (state dicts do).
    """

    obj: object


@dataclass(frozen=True)
class SafetensorsSave:
    """Tensors to write as a safetensors file into a checkpoint, as
    ``safetensors.torch.save_file(tensors, path, metadata)`` writes them (a second model's
    ``model_1.safetensors``): any safetensors reader reads it.

    Streamed, as the checkpoint's own tensors: their bytes go from the tensors (CPU or
    GPU, contiguous or not) through the staging buffers to the disk, with no copy of the
    whole in memory; a `Checkpointer`'s ``staged`` waits for them in fence mode, and
    snapshot mode copies them. The file is checksummed whole in the manifest.

    Refused before anything is written, with the name of the file and of the tensor: a
    name that is not a ``str``, a value that is not a tensor, a dtype safetensors has no
    name for, a sparse or otherwise not strided tensor, and two tensors that share memory
    (as ``save_file`` refuses them: keep one name, as Accelerate's
    ``clean_state_dict_for_safetensors`` does). Lazy conjugate and negative views are
    written with their values.
    """

    tensors: Mapping[str, torch.Tensor]
    metadata: Mapping[str, str] | None = None


ExtraFiles = Mapping[str, "bytes | TorchSave | SafetensorsSave"]


def safetensors_parts(content: SafetensorsSave, name: str) -> list[bytes | torch.Tensor]:
    """What `SafetensorsSave` ``content`` writes to the file ``name``: the header, then each
    tensor; ``TypeError``/``ValueError`` naming what cannot be written. No tensor's data is
    read (a conjugate or negative view is resolved: a copy of that tensor alone)."""
    what = f"extra_files: {name!r}"
    if not isinstance(content.tensors, Mapping):
        raise TypeError(f"{what}: SafetensorsSave takes a mapping of names to tensors")
    tensors: list[torch.Tensor] = []
    described: list[tuple[str, torch.dtype, Sequence[int]]] = []
    spans: list[tuple[str, int, int, str]] = []
    for key, t in content.tensors.items():
        if not isinstance(key, str):
            raise TypeError(f"{what}: a tensor name must be a str, got {key!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {key!r} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided or t.is_nested or t.device.type not in ("cpu", "cuda"):
            raise TypeError(
                f"{what}: {key!r} is a {t.layout} tensor on {t.device}: safetensors holds dense "
                "CPU or GPU tensors"
            )
        if not supported_dtype(t.dtype):
            raise TypeError(f"{what}: {key!r} has dtype {t.dtype}, which safetensors cannot hold")
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()  # their bytes are not their values
        if t.numel():
            lo = t.data_ptr()
            spans.append((str(t.device), lo, lo + _span_bytes(t), key))
        tensors.append(t)
        described.append((key, t.dtype, tuple(t.shape)))
    spans.sort()
    for (dev, _, hi, first), (dev2, lo, _, second) in itertools.pairwise(spans):
        if dev == dev2 and lo < hi:
            raise ValueError(
                f"{what}: {first!r} and {second!r} share memory, which safetensors cannot hold: "
                "keep one of them"
            )
    try:
        layout = layout_file(described, content.metadata)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None
    return [layout.header, *tensors]


def _span_bytes(t: torch.Tensor) -> int:
    """How many bytes from its first element a (non-empty) strided tensor reaches."""
    last = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


_SINK_BATCH = 1 << 20
"""`_TorchSaveSink` gathers ``torch.save``'s small writes (its pickle and zip records
come a few bytes at a time: ~11,000 of a 200 MiB optimizer state's 12,000 writes are
under 4 KiB) into batches of this many bytes, each handed to the event loop at once."""


class _TorchSaveSink:
    """What ``torch.save`` writes to, from a worker thread: its writes are handed to the
    `FileWriter` on the event loop (small ones gathered into batches of `_SINK_BATCH`
    bytes, so the loop is not woken for each), and return once their bytes are in staging
    buffers or in the batch. `drain` hands on the last batch."""

    def __init__(self, writer: FileWriter, loop: asyncio.AbstractEventLoop) -> None:
        self._writer = writer
        self._loop = loop
        self._pos = 0
        self._batch = bytearray()
        self._stopped = False
        self.error: BaseException | None = None
        """The first error a ``write`` raised (torch.save reports it as its own error)."""

    def stop(self) -> None:
        """Make every later ``write`` raise, so that ``torch.save`` ends early."""
        self._stopped = True

    def _hand_on(self, view: memoryview) -> None:
        asyncio.run_coroutine_threadsafe(self._writer.write(view), self._loop).result()

    def _hand_on_batch(self) -> None:
        if self._batch:
            # A fresh batch: views of the old one may outlive the write (never resized).
            batch, self._batch = self._batch, bytearray()
            self._hand_on(memoryview(batch))

    def write(self, data: Any) -> int:
        try:
            if self._stopped:
                raise OSError(errno.ECANCELED, "the save was stopped")
            with memoryview(data) as raw, raw.cast("B") as view:
                n = view.nbytes
                if n and len(self._batch) + n <= _SINK_BATCH:
                    self._batch += view
                elif n:
                    self._hand_on_batch()
                    if n < _SINK_BATCH:
                        self._batch += view
                    else:
                        self._hand_on(view)
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            raise
        self._pos += n
        return n

    async def drain(self) -> None:
        """On the loop, once ``torch.save`` has returned: write the last batch."""
        if self._batch:
            batch, self._batch = self._batch, bytearray()
            await self._writer.write(memoryview(batch))

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
    name: str | None = None,
) -> FileRecord:
    """Write ``torch.save(obj)``'s bytes as a new file through the engine, checksummed;
    its record is named ``name`` (by default the file's own name)."""
    hasher = new_hasher()
    loop = asyncio.get_running_loop()
    name = os.path.basename(path) if name is None else name
    async with FileWriter(be, path, dio, pool, hasher=hasher) as writer:
        sink = _TorchSaveSink(writer, loop)
        thread = asyncio.ensure_future(asyncio.to_thread(_torch_save_when_ready, obj, sink, name))
        try:
            await asyncio.shield(thread)
        except asyncio.CancelledError:
            # The thread cannot be cancelled: stop it at its next write and wait for it, so
            # the writer is not closed (nor the pool released) under its feet.
            sink.stop()
            await settle([thread])
            raise
        await sink.drain()
        if written is not None:
            written()
    return FileRecord(name, writer.bytes_written, hasher.hexdigest())


async def write_file(
    be: IOBackend,
    path: str,
    dio: DirectIOInfo,
    pool: StagingPool,
    parts: Sequence[Bytes | torch.Tensor],
    written: Callable[[], None] | None = None,
    hasher: Any = None,
    name: str | None = None,
    size: int | None = None,
) -> FileRecord:
    """Write ``parts`` as a new file, checksummed (by ``hasher`` when given), fsynced; its
    record is named ``name`` (by default the file's own name). ``size``: the parts' bytes
    in all, when the caller knows them (else summed here: a few parts).

    The parts must stay unchanged until ``written`` is called (the tensors of a save until
    it is staged): their bytes are copied into staging in worker threads, batched per
    buffer, while the file is being written."""
    hasher = hasher if hasher is not None else new_hasher()
    if size is None:
        size = sum(p.nbytes if isinstance(p, torch.Tensor) else memoryview(p).nbytes for p in parts)
    async with FileWriter(be, path, dio, pool, hasher=hasher, size=size) as writer:
        await writer.write_stable(parts)
        await writer.copied()
        if written is not None:
            written()  # every byte is in staging or on its way to the disk
    name = os.path.basename(path) if name is None else name
    return FileRecord(name, writer.bytes_written, hasher.hexdigest())


async def write_extra_files(
    be: IOBackend,
    directory: str,
    dio: DirectIOInfo,
    pool: StagingPool,
    files: ExtraFiles,
    written: Callable[[], None] | None = None,
) -> list[FileRecord]:
    """Write ``files`` (name → ``bytes``, `TorchSave` or `SafetensorsSave`) into ``directory``, making the
    subdirectories their names hold (durably: their entries are fsynced once written, the
    directory's own are the caller's); their records, named by their paths. ``written``
    is called once per file, as by `write_file`."""
    subdirectories = [os.path.join(directory, d) for d in member_directories(files)]
    for sub in subdirectories:
        await to_thread_to_the_end(make_directories, sub)
    tensor_files = [(n, c) for n, c in files.items() if isinstance(c, SafetensorsSave)]
    # Their headers, O(tensors): in a worker thread.
    parts = dict(await asyncio.to_thread(_safetensors_files, tensor_files)) if tensor_files else {}
    done = await run_all(
        write_torch_save(be, os.path.join(directory, n), dio, pool, c.obj, written, name=n)
        if isinstance(c, TorchSave)
        else write_file(be, os.path.join(directory, n), dio, pool, parts[n], written, name=n)
        if isinstance(c, SafetensorsSave)
        else write_file(be, os.path.join(directory, n), dio, pool, [c], written, name=n)
        for n, c in files.items()
    )
    for sub in reversed(subdirectories):
        await to_thread_to_the_end(fsync_directory, sub)
    return done


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


# -- the entry point ------------------------------------------------------------------------


async def check_save_arguments(
    metadata: Mapping[str, str] | None, extra_files: ExtraFiles | None, paths: Sequence[str], ranks: int
) -> None:
    """What `save` and `Checkpointer.save` refuse before anything is written (the
    `SafetensorsSave` files' tensors, O(tensors), in a worker thread)."""
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError("metadata must map str to str")
    if extra_files:
        if ranks > 1 or len(paths) > 1:
            raise ValueError("extra_files: only for a save by one process into one directory")
        check_file_names(extra_files, (PICKLE_FILE, MANIFEST_NAME, MODEL_INDEX), "extra_files")
        tensor_files = [(n, c) for n, c in extra_files.items() if isinstance(c, SafetensorsSave)]
        if tensor_files:
            await asyncio.to_thread(_safetensors_files, tensor_files)  # refused before anything is written


def _safetensors_files(
    files: list[tuple[str, SafetensorsSave]],
) -> list[tuple[str, list[bytes | torch.Tensor]]]:
    """Each file's parts (`safetensors_parts`), by name."""
    return [(name, safetensors_parts(content, name)) for name, content in files]


def check_file_names(names: Iterable[str], reserved: Sequence[str], what: str) -> None:
    """``ValueError`` for a name among ``names`` (the files to write into a checkpoint) that
    would escape it, lie more than `MAX_MEMBER_DEPTH` subdirectories deep, be one of the
    names the checkpoint itself uses (``reserved``), or be one of those as a directory."""
    names = list(names)
    for name in names:
        try:
            safe_member_name(name, what)
        except CheckpointCorruptError as exc:
            raise ValueError(str(exc)) from None
        if name in reserved:
            raise ValueError(f"{what}: {name!r} is a name the checkpoint itself uses")
    check_file_tree([*names, *reserved], what)


def check_file_tree(names: Iterable[str], what: str) -> None:
    """``ValueError`` when a name among ``names`` (files, ``<subdirectory>/.../<name>``)
    is also a directory another one needs: ``a`` and ``a/b`` cannot both be files."""
    files = set(names)
    clash = files.intersection(member_directories(files))
    if clash:
        name = min(clash)
        inside = min(f for f in files if f.startswith(name + "/"))
        raise ValueError(f"{what}: {name!r} is a file and also the directory that holds {inside!r}")


def _reserved(name: str) -> ValueError:
    return ValueError(f"extra_files: {name!r} is a name the checkpoint itself uses")


async def flatten_off_loop(
    obj: object, allow_pickle: bool, coord: Coordinator | None
) -> Flattened | Exception:
    """`flatten` in a worker thread (it walks the whole state); with several ranks a
    failure is returned, for the others to hear of it and fail with it rather than wait."""
    try:
        return await asyncio.to_thread(flatten, obj, allow_pickle=allow_pickle)
    except Exception as exc:
        if coord is None:
            raise
        return exc


def save_label(final: str) -> tuple[str]:
    """What the exchanges of the save to ``final`` say they are, in their tags (see
    `Coordinator`)."""
    return (os.path.basename(final),)


def given_path(path: object) -> str:
    """The checkpoint's path as given (the first of several), for `fail_together`'s tag
    when ``path`` itself is what was wrong."""
    if isinstance(path, Sequence) and not isinstance(path, str | bytes) and path:
        path = path[0]
    try:
        return os.path.abspath(os.fsdecode(path))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return repr(path)


async def fail_together(coord: Coordinator | None, final: str, error: BaseException) -> NoReturn:
    """Raise ``error``, a failure of this rank before its save to ``final`` reached its first
    exchange (an argument, the backend, the snapshot, the caller cancelling it), after
    telling the other ranks at
    that exchange: they raise `RankFailedError` at once rather than wait for this rank
    until ``AIOPERSIST_DIST_TIMEOUT``, and the ranks stay in step for the next save. If
    telling them fails too, ``error`` is raised all the same, with a note saying so."""
    if coord is not None:
        try:
            await Exchanges(coord, save_label(final))(None, error)
        except Exception as exc:
            if exc is not error:
                error.add_note(f"aiopersist: telling the other ranks of this failure failed too: {exc}")
    raise error


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

    ``extra_files`` maps file names to ``bytes``, a [`TorchSave`][aiopersist.TorchSave] or
    a [`SafetensorsSave`][aiopersist.SafetensorsSave] to write beside the data (a
    ``config.json``, an ``optimizer.pt``, a second model's weights): published with the
    checkpoint, checksummed, listed in its manifest. A name may put its file in
    subdirectories (``templates/chat.jinja``). One process and one directory only.
    """
    coord = coordinator(group)  # a failure below is told to the other ranks (fail_together)
    try:
        if max_shard_bytes is not None and max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        paths = checkpoint_paths(path)
        await check_save_arguments(metadata, extra_files, paths, coord.world_size if coord is not None else 1)
        flat = await flatten_off_loop(obj, allow_pickle, coord)
    except FAILURES as exc:
        await fail_together(coord, given_path(path), exc)
    pool = StagingPool()
    try:
        async with contextlib.AsyncExitStack() as stack:
            try:
                be = await stack.enter_async_context(open_backend(backend))
            except FAILURES as exc:  # the backend would not start here
                await fail_together(coord, paths[0], exc)
            return await save_state(
                be,
                pool,
                flat,
                paths,
                coord,
                replicated=replicated,
                metadata=metadata,
                overwrite=overwrite,
                max_shard_bytes=max_shard_bytes or _knobs.shard_bytes(),
                extra_files=extra_files,
            )
    finally:
        pool.close()


# -- the executor ---------------------------------------------------------------------------


def _describe(
    flat: Flattened, rank: int, local_rank: int, world: int, replicated: Replicated, token: str
) -> RankDesc:
    tensors = describe(flat, rank, world, replicated)
    return RankDesc(rank, local_rank, tensors, rank_state(flat, tensors), token, flat.model_only)


@dataclass(frozen=True)
class _Written:
    """One data file a rank wrote: its plan, its record, and a checksum per part (version 2
    plans only)."""

    plan: FilePlan
    record: FileRecord
    digests: tuple[str, ...]


async def save_state(
    be: IOBackend,
    pool: StagingPool,
    flat: Flattened | Exception,
    paths: Sequence[str],
    coord: Coordinator | None,
    *,
    replicated: Replicated,
    metadata: Mapping[str, str] | None,
    overwrite: bool,
    max_shard_bytes: int,
    staged: Callable[[], None] | None = None,
    discard: Callable[[str], None] | None = None,
    extra_files: ExtraFiles | None = None,
) -> SaveInfo:
    """Save this rank's ``flat`` as its share of a checkpoint at ``paths`` (the first is the
    checkpoint) over the ranks of ``coord``; see the module docstring. An exception for
    ``flat`` (flattening failed here) fails the save on every rank. ``staged()`` is called
    once every byte of this rank's tensors has left them (copied into staging buffers),
    before the fsyncs; a replaced checkpoint is handed to ``discard`` (a worker thread
    calls it), or deleted."""
    start = time.perf_counter()
    rank = coord.rank if coord is not None else 0
    world = coord.world_size if coord is not None else 1
    final = paths[0]
    token = uuid.uuid4().hex[:12]
    committed = False
    at_commit = False

    exchange = Exchanges(coord, save_label(final))

    # 1. describe, and (rank 0) claim the temporary directory.
    desc: RankDesc | None = None
    error: BaseException | None = None
    try:
        if isinstance(flat, Exception):
            raise flat
        if flat.pickled and (world > 1 or len(paths) > 1):
            raise UnsupportedStateError(
                "pickled objects cannot be saved across several ranks or directories; "
                "save them separately or store them as tensors"
            )
        local_rank = coord.local_rank if coord is not None else 0
        described = asyncio.ensure_future(
            asyncio.to_thread(_describe, flat, rank, local_rank, world, replicated, token)
        )
        try:
            if rank == 0:
                # To its end: a cancellation while the thread makes it would leave it behind.
                await to_thread_to_the_end(
                    make_temp, final, overwrite, token, discard=lambda made: remove_empty_directory(made.tmp)
                )
        finally:
            await settle([described])
        desc = described.result()
    except FAILURES as exc:  # a cancellation too: told to the others, then raised
        error = exc
    try:
        descs: list[RankDesc] = await exchange(desc, error)
        token = descs[0].token
        assert isinstance(flat, Flattened)
        # 2. plan (pure and the same everywhere, so it fails everywhere alike), 3. write;
        # a failure here is every rank's.
        plan: WritePlan | None = None
        mine: list[_Written] = []
        extras: list[FileRecord] = []
        write_error: BaseException | None = None
        try:
            plan = await asyncio.to_thread(plan_write, descs, len(paths), max_shard_bytes)
            mine, extras = await _write_mine(be, pool, flat, plan, paths, token, rank, staged, extra_files)
        except FAILURES as exc:
            write_error = exc
        written: list[list[_Written]] = await exchange(mine, write_error)
        assert plan is not None
        # 4. commit, on rank 0.
        commit_error: BaseException | None = None
        old_parts: list[str] = []
        if rank == 0:
            try:
                if overwrite and len(paths) > 1:
                    # Found by the replaced checkpoint's token (a manifest read): pure after that.
                    old_parts = own_parts(paths, await asyncio.to_thread(token_at, final))
                extras += await _commit(be, pool, descs, plan, written, extras, paths, token, metadata)
                await to_thread_to_the_end(
                    publish_with_parts,
                    temp_path(final, token),
                    final,
                    own_parts(paths, token),
                    overwrite,
                    discard or remove_path,
                )
                committed = True
            except FAILURES as exc:
                commit_error = exc
            if committed and old_parts:
                # The replaced checkpoint's parts go after it (its primary went at the
                # rename), before the ranks hear of the commit: a rank that fails to then
                # must not leave them behind.
                if discard is None:
                    await asyncio.to_thread(_remove_all, old_parts)
                else:
                    for old in old_parts:
                        discard(old)
        at_commit = True
        await exchange(None, commit_error)
    except BaseException as exc:
        # Once the primary is renamed into place the checkpoint is complete: its parts stay,
        # even if a rank then fails to hear about it.
        if rank == 0 and not committed:
            await to_thread_to_the_end(_abort, final, token, paths)
        elif rank == 0:
            exc.add_note(f"aiopersist: the checkpoint {final} was committed before this failure")
        elif at_commit and isinstance(exc, RankFailedError) and isinstance(exc.__cause__, RuntimeError):
            # Contact lost while rank 0 committed (not a failure it told): what is on disk says.
            records = [w.record for per_rank in written for w in per_rank]
            exc.add_note(await asyncio.to_thread(_commit_seen, final, token, len(paths) > 1, records))
        raise
    records = [w.record for w in written[rank]] + extras
    return SaveInfo(
        final,
        sum(r.nbytes for r in records),
        tuple(r.name for r in records),
        time.perf_counter() - start,
        be.name,
        sum(t.nbytes for t in descs[rank].tensors),
    )


async def _write_mine(
    be: IOBackend,
    pool: StagingPool,
    flat: Flattened,
    plan: WritePlan,
    paths: Sequence[str],
    token: str,
    rank: int,
    staged: Callable[[], None] | None,
    extra_files: ExtraFiles | None,
) -> tuple[list[_Written], list[FileRecord]]:
    """3. Write this rank's data files and (rank 0) the pickle and extra files into the
    primary; returns their records. ``staged`` is called once all have left the state."""
    sources = {s.name: s.source for s in flat.stored}
    mine = plan.of_rank(rank)
    pickled = await asyncio.to_thread(pickle_objects, flat) if flat.pickled else None
    additions = dict(extra_files or {}) if rank == 0 else {}
    for name in sorted(additions.keys() & {f.name for f in plan.files}):
        raise _reserved(name)
    check_file_tree([*additions, *(f.name for f in plan.files)], "extra_files")
    one_written = countdown(len(mine) + (pickled is not None) + len(additions), staged)
    dirs: dict[int, str] = {}
    for d in sorted({f.directory for f in mine} | ({0} if pickled is not None or additions else set())):
        where = temp_path(paths[0], token) if d == 0 else part_dir(paths[d], token)
        await to_thread_to_the_end(make_directories, where)  # the abort must come after
        dirs[d] = where
    probes = {i: await to_thread_to_the_end(probe_directory, d) for i, d in dirs.items()}
    # What each directory takes of this rank's (data files, the pickle, the extra files of
    # known size), against its free space: before anything is written.
    needed = dict.fromkeys(dirs, 0)
    for f in mine:
        needed[f.directory] += f.layout.data_offset + f.layout.data_bytes
    if pickled is not None:
        needed[0] += len(pickled)
    if additions:
        needed[0] += sum(len(c) for c in additions.values() if isinstance(c, bytes | bytearray | memoryview))
    if _knobs.space_check_enabled():
        for d, n in needed.items():
            await asyncio.to_thread(check_room, dirs[d], n, "save")

    def data(part: PartPlan) -> torch.Tensor:
        src = sources[part.source]
        return src if part.rows is None else src[part.rows[0] : part.rows[1]]

    async def one(f: FilePlan) -> _Written:
        layout = f.layout
        path = os.path.join(dirs[f.directory], f.name)
        parts: PartHasher | None = None
        hasher: Any = new_hasher()
        if plan.spread:
            # Every part gets a checksum of its own, so that a load can read and check
            # just the rows it needs.
            parts = PartHasher(new_hasher(), [e.end - e.begin for e in layout.entries], new_hasher)
            hasher = _HeadSkip(parts, layout.data_offset)
        rec = await write_file(
            be,
            path,
            probes[f.directory],
            pool,
            [layout.header, *(data(p) for p in f.parts)],
            one_written,
            hasher=hasher,
            size=layout.file_bytes,
        )
        record = FileRecord(f.name, rec.nbytes, rec.checksum, layout.data_offset, f.directory)
        return _Written(f, record, tuple(parts.part_digests()) if parts is not None else ())

    jobs: list[Any] = [one(f) for f in mine]
    if pickled is not None:
        jobs.append(
            write_file(be, os.path.join(dirs[0], PICKLE_FILE), probes[0], pool, [pickled], one_written)
        )
    if additions:
        jobs.append(write_extra_files(be, dirs[0], probes[0], pool, additions, one_written))
    done = await run_all(jobs)
    rest = done[len(mine) :]  # the pickle file's record, then the extra files' (a list)
    extras: list[FileRecord] = [*rest[:-1], *rest[-1]] if additions else rest
    return done[: len(mine)], extras


async def _commit(
    be: IOBackend,
    pool: StagingPool,
    descs: Sequence[RankDesc],
    plan: WritePlan,
    written: Sequence[Sequence[_Written]],
    extras: Sequence[FileRecord],
    paths: Sequence[str],
    token: str,
    metadata: Mapping[str, str] | None,
) -> list[FileRecord]:
    """4. The manifest (and the model index) from every rank's records, into the primary."""
    tmp = temp_path(paths[0], token)
    out = await asyncio.to_thread(_manifest_files, descs, plan, written, extras, paths, token, metadata)
    dio = await to_thread_to_the_end(probe_directory, tmp)
    return list(await run_all(write_file(be, os.path.join(tmp, n), dio, pool, [b]) for n, b in out))


def _manifest_files(
    descs: Sequence[RankDesc],
    plan: WritePlan,
    written: Sequence[Sequence[_Written]],
    extras: Sequence[FileRecord],
    paths: Sequence[str],
    token: str,
    metadata: Mapping[str, str] | None,
) -> list[tuple[str, bytes]]:
    """The manifest's bytes (and the model index's), from every rank's records: CPU work
    proportional to the number of tensors, for a worker thread."""
    files: dict[str, FileRecord] = {}
    whole: dict[str, TensorRecord] = {}  # version 2: every part has a checksum of its own
    slices: dict[str, list[SliceRecord]] = {}
    for per_rank in written:
        for w in per_rank:
            files[w.plan.name] = w.record
            if not plan.spread:
                continue
            base = w.record.data_offset or 0
            for part, entry, digest in zip(w.plan.parts, w.plan.layout.entries, w.digests, strict=True):
                begin, end = base + entry.begin, base + entry.end
                if part.target_rows is None:
                    whole[part.target] = TensorRecord(
                        part.target, w.plan.name, begin, end, entry.dtype, entry.shape, digest
                    )
                else:
                    slices.setdefault(part.target, []).append(
                        SliceRecord(w.plan.name, begin, end, part.target_rows[0], part.target_rows[1], digest)
                    )
    pickle_file = None
    for rec in extras:
        files[rec.name] = rec
        if rec.name == PICKLE_FILE:
            pickle_file = PICKLE_FILE
    sliced = {
        name: SlicedRecord(
            name,
            dtype_from_name(plan.sliced[name][0]),
            plan.sliced[name][1],
            tuple(sorted(s, key=lambda x: x.row_start)),
        )
        for name, s in slices.items()
    }
    state0 = descs[0].state
    manifest = Manifest(
        files=files,
        tensors=whole if plan.spread else plan.records,  # version 1: the plan's, made once
        skeleton=state0.skeleton,
        aliases=state0.aliases,
        views=state0.views,
        pickle_file=pickle_file,
        metadata=dict(metadata or {}),
        layout=plan.layout,
        world_size=len(descs),
        version=format_version(files, 2 if plan.spread else 1),
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        sliced=sliced,
        directories=_directories(paths, token),
        ranks={d.rank: d.state for d in descs[1:] if d.state != state0},
    )
    out = [(MANIFEST_NAME, dump_manifest(manifest))]
    if plan.needs_index:
        weight_map = {t.name: t.file for t in manifest.tensors.values()}
        total = sum(t.nbytes for t in manifest.tensors.values())
        out.append(
            (
                MODEL_INDEX,
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode(),
            )
        )
    return out


def _directories(paths: Sequence[str], token: str) -> tuple[str, ...]:
    """The manifest's directories: the primary, then the parts, relative to the primary."""
    return (".", *(os.path.relpath(p, paths[0]) for p in own_parts(paths, token)))


def _commit_seen(final: str, token: str, several: bool, records: Sequence[FileRecord]) -> str:
    """What a rank other than 0, which lost contact with the others while rank 0 committed
    the save to ``final`` (its ``token``; ``several`` directories; every rank's data files
    ``records``), finds on disk, as a note for its error."""
    try:
        manifest = read_manifest(final)
    except (AiopersistError, OSError):
        manifest = None
    if manifest is not None and (
        manifest.token == token
        if several
        else bool(records)
        and all((r.nbytes, r.checksum) == _size_and_sum(manifest.files.get(r.name)) for r in records)
    ):
        return f"aiopersist: the checkpoint {final} was committed by rank 0 before contact was lost"
    return (
        f"aiopersist: the checkpoint {final} was not committed when contact was lost "
        "(if rank 0 is only stopped, it may still commit it)"
    )


def _size_and_sum(record: FileRecord | None) -> tuple[int, str] | None:
    return None if record is None else (record.nbytes, record.checksum)


def _abort(final: str, token: str, paths: Sequence[str]) -> None:
    """Remove what a failed save wrote, unless its rename already published it (a failure
    after the rename, e.g. of the parent's fsync, leaves a visible checkpoint whose parts
    must stay)."""
    parts = own_parts(paths, token)
    published = bool(parts) and token_at(final) == token
    _remove_all([temp_path(final, token)] + ([] if published else parts))


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


class _HeadSkip:
    """Feeds the whole file to the file's checksum, and the bytes after the header to the
    per-part hasher."""

    def __init__(self, parts: PartHasher, header: int) -> None:
        self._parts = parts
        self._skip = header

    def update(self, data: Any, /) -> None:
        self._parts.whole.update(data)
        with memoryview(data) as raw, raw.cast("B") as view:
            skip = min(self._skip, len(view))
            self._skip -= skip
            if skip < len(view):
                self._parts.update_parts(view[skip:])

    def hexdigest(self) -> str:
        return self._parts.hexdigest()


def _remove_all(paths: Sequence[str]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            remove_path(p)
        parent = os.path.dirname(p)
        if os.path.basename(p).startswith(PART_PREFIX):
            with contextlib.suppress(OSError):
                os.rmdir(parent)  # the disk's directory for this checkpoint, if now empty
