"""``torch.distributed.checkpoint`` (DCP) on aiopersist's engine.

`AiopersistWriter` is a DCP ``StorageWriter`` and `AiopersistReader` a ``StorageReader``:
``dcp.save``, ``dcp.async_save`` and ``dcp.load`` run through them unchanged otherwise, so
DCP's planners (replica de-duplication, resharding on load, ``get_state_dict`` and
``set_state_dict``) keep working::

    import torch.distributed.checkpoint as dcp
    from aiopersist.integrations.dcp import AiopersistReader, AiopersistWriter

    dcp.save(state_dict, checkpoint_id=path, storage_writer=AiopersistWriter())
    dcp.load(state_dict, checkpoint_id=path, storage_reader=AiopersistReader())

What the writer adds to DCP's own ``FileSystemWriter``:

- every rank's data file is written through the engine (io_uring, ``O_DIRECT``, aligned
  staging buffers, GPU tensors copied out through pinned buffers), checksummed as it is
  written, and fsynced;
- the directory appears whole or not at all: the ranks write into a temporary directory
  beside it, and the coordinator publishes it with one atomic rename once every file,
  the DCP metadata and aiopersist's manifest are durable (DCP renames only ``.metadata``);
- an existing checkpoint is refused unless ``overwrite=True``, which replaces it
  atomically;
- ``aiopersist.json`` lists every file with its checksum, and every entry of a data file
  with a checksum of its own: ``aiopersist verify`` checks the directory, and the reader
  checks each entry it reads.

The files are DCP's own format: ``.metadata`` (the pickled DCP ``Metadata``) and
``__<rank>_0.distcp`` data files whose entries are ``torch.save`` archives (tensors) or
DCP's serialized bytes (other values). Stock ``dcp.load`` with ``FileSystemReader``
reads them; `AiopersistReader` also reads directories written by ``FileSystemWriter``
(without checksums to check: they have none).

The reader never unpickles more than DCP's metadata classes from ``.metadata`` (a
restricted unpickler), and loads tensor entries with ``weights_only=True``. Values that
are not tensors are deserialized by DCP's planner, as stock ``dcp.load`` does
(``torch.load`` with ``weights_only=False``): load those only from checkpoints you trust.

`FenceStager` makes ``dcp.async_save`` copy no tensor (aiopersist's fence semantics).

``disks=[...]`` spreads the ranks' files over several disks (rank ``i`` to disk ``i mod
D``), in part directories published with the checkpoint.

Limits: DCP's experimental
``use_collectives=False`` mode is refused; a save that fails in DCP's write step leaves
its temporary directory ``.<name>.aiopersist-tmp-<token>`` (and its parts) until the
same writer's next save removes them (a `CheckpointManager` removes such leftovers when
it starts, as does ``aiopersist gc DIR --keep-last N --leftovers --apply``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import copy
import dataclasses
import datetime
import errno
import io
import itertools
import logging
import math
import os
import pickle
import pickletools
import re
import reprlib
import stat
import struct
import threading
import time
import uuid
import zipfile
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .. import _knobs
from .._backends import open_backend, to_thread_to_the_end
from .._blocking import run_loop
from .._commit import (
    check_room,
    fsync_directory,
    make_directories,
    make_temp,
    publish_with_parts,
    remove_path,
)
from .._direct import probe_directory, probe_file_for_read
from .._exceptions import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    RankFailedError,
    UnsupportedStateError,
    from_os_error,
)
from .._format import MAX_COUNT, bounded_count
from .._load import _check_memory
from .._locate import absolute_path, checkpoint_paths, locate, own_parts, read_small, regular_size, token_at
from .._manifest import (
    EntryRecord,
    FileRecord,
    Manifest,
    dcp_directories,
    dump_manifest,
    format_version,
    new_hasher,
    safe_file_name,
)
from .._names import DCP_METADATA, MANIFEST_NAME, part_dir, temp_path
from .._save import write_file
from .._staging import StagingPool
from .._stream import (
    Bytes,
    PartHasher,
    files_at_once,
    read_segments,
    record_cuda_ready,
    run_all,
    use_cuda_ready,
)
from .._workers import DaemonThreadPool

__all__ = ["AiopersistReader", "AiopersistWriter", "FenceStager"]

from torch.distributed.checkpoint import filesystem as _dcp_filesystem

_DCP_VERSION: str | None = getattr(_dcp_filesystem, "CURRENT_DCP_VERSION", None)
"""What DCP's own writer stamps on its metadata (never checked on load)."""

log = logging.getLogger("aiopersist")

METADATA_FILE = DCP_METADATA
"""DCP's metadata file: the name its ``FileSystemReader`` looks for."""

T = TypeVar("T")

_ENGINE = DaemonThreadPool(8, thread_name_prefix="aiopersist-dcp")
"""Threads that run the engine's event loops for DCP's synchronous calls (daemon threads:
a crashed job is never held open by one)."""


_DELETER = DaemonThreadPool(1, thread_name_prefix="aiopersist-dcp-delete")
_deleting: list[concurrent.futures.Future[None]] = []
_deleting_lock = threading.Lock()


def _delete_later(path: str) -> None:
    """Remove ``path`` (a replaced checkpoint, under its temporary name, or its part) in a
    background thread, off the save's clock: DCP waits for the whole save before the next
    one starts, and deleting a large checkpoint takes as long as writing a good part of it
    (0.12 s of a 0.4 s save of 576 MiB here). Until it is gone it is a leftover like any
    other (marked temporary). The next publication waits for it, so that no more than
    one replaced checkpoint is ever waiting; so does the interpreter's exit, for at most
    ``AIOPERSIST_EXIT_GRACE`` seconds."""
    with _deleting_lock:
        _deleting.append(_DELETER.submit(remove_path, path))


def _wait_deletions(timeout: float | None = None) -> None:
    with _deleting_lock:
        pending = list(_deleting)
        _deleting.clear()
    concurrent.futures.wait(pending, timeout=timeout)


atexit.register(lambda: _wait_deletions(_knobs.exit_grace()))


def _forget_deletions_in_child() -> None:
    """In a forked child the parent's deletions are the parent's: nothing to wait for."""
    global _deleting_lock
    _deleting.clear()
    _deleting_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_deletions_in_child)


def _on_engine(make: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
    """Run ``make()`` on an event loop of its own in an engine thread (DCP calls the
    storage layer from plain threads, and from a thread with a running loop too)."""
    return _ENGINE.submit(lambda: run_loop(make(), "aiopersist-dcp"))


def _as_torch_future(cf: concurrent.futures.Future[T]) -> Future[T]:
    fut: Future[T] = Future()

    def done(f: concurrent.futures.Future[T]) -> None:
        exc = f.exception()
        if exc is not None:
            fut.set_exception(cast(Any, exc))
        else:
            fut.set_result(f.result())

    cf.add_done_callback(done)
    return fut


# -- torch.save archives around raw tensor bytes ---------------------------------------------

_ARCHIVES: dict[tuple[torch.dtype, tuple[int, ...]], tuple[bytes, bytes]] = {}
_ARCHIVES_KEPT = 4096


def _archive_around(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """The bytes of ``torch.save`` of a contiguous CPU tensor of this dtype and shape that
    come before its data, and those after: written around the tensor's own bytes, they
    make the archive ``torch.save`` writes (``torch.load`` reads it; only the zip CRC of
    the data record is left 0, which ``torch.load`` does not check). The tensor's bytes go
    from its memory (or its GPU) through the engine, never through a Python copy."""
    key = (dtype, shape)
    found = _ARCHIVES.get(key)
    if found is not None:
        return found
    proto = torch.empty(shape, dtype=dtype)  # never touched: its pages are never faulted in
    nbytes = proto.numel() * proto.element_size()
    if nbytes == 0:  # nothing to put around: the archive itself
        buf = io.BytesIO()
        torch.save(proto, buf)
        return buf.getvalue(), b""
    archive = _SkippedArchive()
    with torch.serialization.skip_data():
        torch.save(proto, cast(Any, archive))  # a file-like object, as torch.save takes
    start = len(archive.before)
    if archive.skipped != nbytes:
        raise RuntimeError(f"unexpected torch.save archive layout for {dtype} {list(shape)}")
    archive.seek(0)
    with zipfile.ZipFile(archive) as zf:  # reads the headers only, never the skipped bytes
        records = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
    if len(records) != 1 or records[0].file_size != nbytes:
        raise RuntimeError(f"unexpected torch.save archive layout for {dtype} {list(shape)}")
    header = records[0].header_offset
    name_len, extra_len = struct.unpack_from("<HH", archive.before, header + 26)
    if header + 30 + name_len + extra_len != start:
        raise RuntimeError(f"unexpected torch.save archive layout for {dtype} {list(shape)}")
    parts = (bytes(archive.before), bytes(archive.after))
    if len(_ARCHIVES) >= _ARCHIVES_KEPT:
        _ARCHIVES.pop(next(iter(_ARCHIVES)))
    _ARCHIVES[key] = parts
    return parts


class _SkippedArchive(io.RawIOBase):
    """The file ``torch.save`` writes under ``skip_data``, holding the bytes written and
    only the length of the data record it skips (one seek forward), not as many zeros:
    framing a tensor costs no memory of the tensor's size. Then readable, with zeros in
    the gap, for `zipfile` to check the layout (it reads headers only)."""

    def __init__(self) -> None:
        super().__init__()
        self.before = bytearray()
        self.after = bytearray()
        self.skipped = 0
        self._pos = 0

    @property
    def _size(self) -> int:
        return len(self.before) + self.skipped + len(self.after)

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        raw = bytes(memoryview(data).cast("B"))
        if self._pos != self._size:
            raise RuntimeError("torch.save wrote out of order")
        (self.after if self.skipped else self.before).extend(raw)
        self._pos += len(raw)
        return len(raw)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        target = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence] + offset
        if target > self._size:  # a skip forward: the data record, once, before anything after it
            if self.skipped or self._pos != self._size or self.after:
                raise RuntimeError("torch.save skipped more than one record")
            self.skipped = target - self._size
        self._pos = target
        return target

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = min(len(out), self._size - self._pos)
        gap_start, gap_end = len(self.before), len(self.before) + self.skipped
        for i in range(n):  # headers only: a few dozen bytes at a time
            at = self._pos + i
            if at < gap_start:
                out[i] = self.before[at]
            elif at < gap_end:
                out[i] = 0
            else:
                out[i] = self.after[at - gap_end]
        self._pos += n
        return n


# -- the writer ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Prefix:
    """A rank's part of the global plan: its files' prefix and the save's token (its
    temporary directory)."""

    prefix: str
    token: str
    directory: int = 0
    """Index of the directory (disk) the rank writes to: 0 is the checkpoint itself."""


@dataclasses.dataclass(frozen=True)
class _Written:
    """A write result on its way to the coordinator: DCP's storage record, the entry's own
    checksum, and the record of the file that holds it."""

    info: _StorageInfo
    checksum: str
    file: FileRecord


class _Fence:
    """One save's staging point: set once every byte of this rank's tensors has left them
    (or the write failed, or the save's upload thread ended without writing)."""

    _POLL = 0.1
    """How often a wait looks at the upload thread (seconds)."""

    def __init__(self, cuda_ready: dict[int, Any]) -> None:
        self.cuda_ready = cuda_ready
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.upload_thread: threading.Thread | None = None
        """DCP's thread running this save, noted at the writer's first call from it."""

    def set(self) -> None:
        self._done.set()

    def fail(self, error: BaseException | None) -> None:
        if error is not None and not self._done.is_set():
            self.error = error
        self._done.set()

    def note_upload_thread(self) -> None:
        if self.upload_thread is None:
            self.upload_thread = threading.current_thread()

    def wait(self, timeout: float | None) -> bool:
        """Wait until set or failed; ``False`` after ``timeout`` seconds. A save that
        failed outside the writer (DCP's planning: a collective broken by a rank that
        died, a planner's error) never reaches ``write_data``, and its upload thread ends
        (DCP's executor lets it go with the save): that ends the wait too, failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = self._POLL if deadline is None else min(self._POLL, deadline - time.monotonic())
            if self._done.wait(max(left, 0.0)):
                return True
            thread = self.upload_thread
            if thread is not None and not thread.is_alive():
                # The thread ends after the save's last step: a save that staged set the
                # fence before it (fail keeps that).
                self.fail(
                    RankFailedError(
                        "the DCP save ended before it wrote this rank's tensors: it failed in "
                        "DCP's planning, on this rank or another (its error is on the future "
                        "dcp.async_save returned)"
                    )
                )
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False


def _new_fence() -> _Fence:
    """A fence for a save starting now: CUDA tensors are read as of this moment, on the
    caller's current stream."""
    ready: dict[int, Any] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        ready = record_cuda_ready([torch.cuda.current_device()])
    return _Fence(ready)


def _copy_all_but_tensors(obj: Any) -> Any:
    """``obj`` with its dicts, lists and tuples rebuilt and every value that is not a
    tensor deep-copied; the tensors themselves are the same objects."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps a dict subclass and what it carries (default_factory)
        for k, v in obj.items():
            out[k] = _copy_all_but_tensors(v)
        return out
    if type(obj) is list:
        return [_copy_all_but_tensors(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_copy_all_but_tensors(v) for v in obj)
    return copy.deepcopy(obj)


class FenceStager:
    """A DCP ``AsyncStager`` with aiopersist's fence semantics: ``dcp.async_save``
    returns at once and copies no tensor; the writer reads the live tensors while training
    goes on, and `wait_staged` returns once every byte of this rank's tensors has left
    them (copied into the writer's staging buffers), which is what the next optimizer
    step must wait for. Memory: the staging pool, not a copy of the state.

        writer = AiopersistWriter()
        stager = FenceStager(writer)
        upload = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, async_stager=stager)
        loss.backward()                 # forward and backward overlap the save
        stager.wait_staged(upload)      # the fence: right before optimizer.step()
        optimizer.step()

    Nothing may change the saved tensors in place before `wait_staged` returns (the
    optimizer step, or buffers that a forward pass updates in place); the rest of the
    state (a step counter, a learning-rate list) is copied by ``async_save`` and may
    change at once. CUDA tensors are
    read as they were when ``async_save`` was called on the caller's current stream.
    Only DCP's thread executor (the default) is supported: a process executor would write
    from a copy of the writer that this stager cannot see. When training runs collectives
    while the save is in flight (FSDP, DDP), pass ``async_save`` a process group of the
    save's own (``dist.new_group(backend="gloo")``), as DCP requires with any writer.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, writer: AiopersistWriter) -> None:
        if not isinstance(writer, AiopersistWriter):
            raise TypeError(
                f"FenceStager needs the AiopersistWriter the save uses, got {type(writer).__name__}"
            )
        self.writer = writer
        self._fence: _Fence | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Any) -> Any:
        """No copy of the tensors: arm the writer's fence for this save and hand on the
        state with its tensors live. Everything else in it (its containers, and the values
        that are not tensors: a step, a learning-rate list) is copied here, as DCP's own
        stager copies it, so that training may change those at once."""
        if self._fence is not None and not self._fence.wait(0):
            raise RuntimeError(
                "FenceStager: the previous save has not staged yet; "
                "call wait_staged() before the next async_save"
            )
        staged = _copy_all_but_tensors(state_dict)
        self._fence = self.writer._fence = _new_fence()
        return staged

    def wait_staged(
        self, upload: concurrent.futures.Future[Any] | None = None, timeout: float | None = None
    ) -> None:
        """Block until this rank's tensors may change again. A save that fails before it
        writes ends the wait too: with ``upload`` (what ``async_save`` returned) raising
        the save's own error; without it, a failure in this rank's writer raises that
        error and one elsewhere (DCP's planning, on this rank or another) raises
        [`RankFailedError`][aiopersist.RankFailedError] once DCP's upload thread has ended.
        A failed write raises its error. Raises `TimeoutError` after ``timeout`` seconds."""
        fence = self._fence
        if fence is None:
            return
        if upload is not None:
            # The save ended (failed in DCP's planning, or over): nothing reads the tensors.
            upload.add_done_callback(lambda f: fence.fail(None if f.cancelled() else f.exception()))
        if not fence.wait(timeout):
            raise TimeoutError(f"the save did not stage within {timeout} s")
        if fence.error is not None:
            raise fence.error

    def synchronize_staging(self) -> None:
        self.wait_staged()

    def close(self) -> None:
        self._fence = None


class AiopersistWriter(StorageWriter):
    """A DCP ``StorageWriter`` on aiopersist's engine; see the module docstring.

    ``path`` is the checkpoint directory (or pass ``checkpoint_id`` to ``dcp.save``).
    ``overwrite=False`` refuses an existing one with
    [`CheckpointExistsError`][aiopersist.CheckpointExistsError] (DCP wraps it in its
    ``CheckpointException``); ``overwrite=True`` replaces it atomically once the new one
    is durable. ``backend`` as for `aiopersist.save`.

    ``publish=False`` writes the directory in place, for a save that publishes a larger
    directory holding it (an FSDP checkpoint of the Trainer or Accelerate, see
    the Trainer and Accelerate integrations): ``path`` must not exist, its parent is that
    unpublished directory, and the writer leaves ``path`` complete and durable in it
    (files, ``.metadata``, manifest, the directory's entries fsynced) without renaming
    anything. What a failed save leaves there is the publishing save's to remove.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        disks: Sequence[str | os.PathLike[str]] = (),
        overwrite: bool = False,
        backend: str = "auto",
        publish: bool = True,
    ) -> None:
        super().__init__()
        if not publish and disks:
            raise ValueError("AiopersistWriter: publish=False writes one directory in place, without disks")
        self.publish = publish
        self.path = absolute_path(path) if path is not None else None
        self.checkpoint_id: Path | None = Path(path) if path is not None else None
        """The checkpoint as it was named, recorded in the metadata's ``storage_meta`` as
        ``FileSystemWriter`` records it (a ``Path``)."""
        self.disks = [absolute_path(d, "disks") for d in disks]
        self.overwrite = overwrite
        self.backend = backend
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank = 0
        self._token: str | None = None
        self._fence: _Fence | None = None
        """Armed by a `FenceStager` for the next ``write_data``."""
        self.written: list[FileRecord] = []
        """The files the last save wrote on this rank (its data file; on the coordinator,
        ``.metadata`` and the manifest too)."""
        self._pending: tuple[list[str], str] | None = None
        """On the coordinator, between claiming a save's directories and its ``finish``: the
        checkpoint's paths and the save's token."""
        self._into_empty = False
        """The coordinator's save goes where an empty directory stands (a stock
        ``FileSystemWriter`` writes into it, whatever ``overwrite`` says)."""

    def _note_upload_thread(self) -> None:
        """Called by DCP's first calls of a save (in its upload thread, with
        ``async_save``): the armed fence learns the thread, so that a wait on it ends when
        the save fails where the writer never hears of it."""
        if self._fence is not None:
            self._fence.note_upload_thread()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._note_upload_thread()
        if checkpoint_id is not None:
            self.path = absolute_path(checkpoint_id, "checkpoint_id")
            self.checkpoint_id = Path(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        self._note_upload_thread()
        self._path()  # raises without a checkpoint directory
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def _paths(self) -> list[str]:
        """The checkpoint, then its place on each further disk (``<disk>/<its name>``, as a
        `CheckpointManager` lays steps out), where the ranks that write there put a part."""
        final = self._path()
        return checkpoint_paths([final, *(os.path.join(d, os.path.basename(final)) for d in self.disks)])

    def _path(self) -> str:
        if self.path is None:
            raise ValueError(
                "AiopersistWriter: no checkpoint directory (pass path, or checkpoint_id to dcp.save)"
            )
        return self.path

    def set_up_storage_writer(self, is_coordinator: bool, **kwargs: Any) -> None:
        self._note_upload_thread()
        try:
            self._set_up(is_coordinator, **kwargs)
        except BaseException as exc:
            self._fail_fence(exc)
            raise

    def _set_up(self, is_coordinator: bool, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                "AiopersistWriter needs DCP's collectives (use_collectives=True): the coordinator "
                "publishes the whole directory at once"
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self.written = []
        if self._pending is not None:
            # This writer's previous save failed after claiming its directories (on some
            # rank, in DCP's write step, so that finish never ran): DCP runs one save at a
            # time, so nothing writes there any more.
            paths, token = self._pending
            self._pending = self._token = None
            for leftover in [temp_path(paths[0], token), *own_parts(paths, token)]:
                if os.path.lexists(leftover):
                    log.info("aiopersist: removing %s, left by a failed DCP save", leftover)
                    remove_path(leftover)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: claim the temporary directory (refusing an existing
        checkpoint unless ``overwrite``) and hand every rank its prefix and the token."""
        try:
            return self._claim(plans)
        except BaseException as exc:
            self._fail_fence(exc)
            raise

    def _claim(self, plans: list[SavePlan]) -> list[SavePlan]:
        token = uuid.uuid4().hex[:12]
        ndirs = len(self._paths())
        if self.publish:
            # An empty directory is no checkpoint: taken as FileSystemWriter takes it (a
            # tempfile.mkdtemp() named as the checkpoint), even without overwrite.
            self._into_empty = not self.overwrite and _empty_directory(self._path())
            if self.overwrite:
                _check_only_a_checkpoint(self._path())
            make_temp(self._path(), self.overwrite or self._into_empty, token)
            self._pending = (self._paths(), token)
        else:
            _make_in_place(self._path())
        self._token = token
        # Rank i writes to disk i mod D: the ranks' files spread evenly over the disks.
        return [
            dataclasses.replace(plan, storage_data=_Prefix(f"__{i}_", token, i % ndirs))
            for i, plan in enumerate(plans)
        ]

    def _fail_fence(self, error: BaseException) -> None:
        """This rank's part of the save failed before its write started: the fence of a
        `FenceStager` waiting on it is released with the error (and never reused)."""
        fence, self._fence = self._fence, None
        if fence is not None:
            fence.fail(error)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fence, self._fence = self._fence, None
        try:
            return self._write_data(plan, planner, fence)
        except BaseException as exc:  # before the write started: nothing else ends the wait
            if fence is not None:
                fence.fail(exc)
            raise

    def _write_data(
        self, plan: SavePlan, planner: SavePlanner, fence: _Fence | None
    ) -> Future[list[WriteResult]]:
        where: _Prefix = plan.storage_data
        if not isinstance(where, _Prefix):
            raise ValueError(
                "AiopersistWriter.write_data: the plan did not come through its prepare_global_plan"
            )
        paths = self._paths()
        final = paths[0]
        if where.directory >= len(paths):
            raise ValueError(
                f"AiopersistWriter: this rank writes to disk {where.directory}, but it has {len(paths)}"
            )
        name = f"{where.prefix}0.distcp"
        if where.directory == 0:
            tmp, rel = self._staging(where.token), name
        else:
            tmp = part_dir(paths[where.directory], where.token)
            rel = os.path.relpath(os.path.join(tmp, name), final)  # what DCP's reader joins to the path
        # BYTE_IO values first, then tensors, as FileSystemWriter orders them.
        items = sorted(plan.items, key=lambda it: it.type != WriteItemType.BYTE_IO)
        pieces = [_pieces(item, planner) for item in items]
        backend = self.backend
        ready = fence.cuda_ready if fence is not None else {}
        staged = fence.set if fence is not None else None

        async def write() -> list[WriteResult]:
            use_cuda_ready(ready)
            results = await _write_rank_file(backend, tmp, name, rel, where.directory, items, pieces, staged)
            if results:
                self.written.append(results[0].storage_data.file)
            return results

        cf = _on_engine(write)
        if fence is not None:
            cf.add_done_callback(lambda f: fence.fail(f.exception()))  # a failure ends the wait too
        return _as_torch_future(cf)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: DCP's ``.metadata`` and aiopersist's manifest into the
        temporary directory, then the directory published under the checkpoint's name."""
        final = self._path()
        storage: dict[MetadataIndex, _StorageInfo] = {}
        files: dict[str, FileRecord] = {}
        entries: dict[str, list[EntryRecord]] = {}
        for per_rank in results:
            for wr in per_rank:
                w = wr.storage_data
                if not isinstance(w, _Written):
                    raise ValueError(
                        "AiopersistWriter.finish: a write result did not come from its write_data"
                    )
                storage[wr.index] = w.info
                files[w.file.name] = w.file
                entries.setdefault(w.file.name, []).append(
                    EntryRecord(w.info.offset, w.info.offset + w.info.length, w.checksum)
                )
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        metadata.version = _DCP_VERSION or metadata.version
        if self._token is None:
            raise ValueError(
                "AiopersistWriter.finish: no save in progress (prepare_global_plan did not run here)"
            )
        token, self._token = self._token, None
        self._pending = None  # from here on this save cleans up after itself
        paths = self._paths()
        tmp = self._staging(token)
        parts = own_parts(paths, token)
        if not self.publish:
            raw = pickle.dumps(metadata)
            backend = self.backend
            manifest = _dcp_manifest(files, entries, len(results), ())
            self.written += _on_engine(
                lambda: _write_metadata_and_manifest(backend, tmp, raw, manifest)
            ).result()
            fsync_directory(tmp)
            return
        published = False
        try:
            # The replaced checkpoint's parts, found by its token (they go after the rename).
            old_parts = own_parts(paths, token_at(final)) if self.overwrite and parts else []
            manifest = _dcp_manifest(
                files, entries, len(results), tuple(os.path.relpath(p, final) for p in parts)
            )
            raw = pickle.dumps(metadata)
            backend = self.backend
            _on_engine(lambda: _write_metadata_and_manifest(backend, tmp, raw, manifest)).result()
            _wait_deletions()  # what earlier saves replaced: one replaced checkpoint at most
            if self._into_empty:
                _remove_empty_directory(final)
            publish_with_parts(tmp, final, parts, self.overwrite, discard=_delete_later)
            published = True
        except BaseException:
            for p in [tmp] if published else [tmp, *parts]:
                remove_path(p)
            raise
        for old in old_parts:
            _delete_later(old)

    def _staging(self, token: str) -> str:
        """Where this save writes its primary directory: the temporary one it publishes,
        or the checkpoint itself with ``publish=False``."""
        return temp_path(self._path(), token) if self.publish else self._path()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """As ``FileSystemWriter``'s: a local path (not a URL such as ``s3://...``)."""
        return bool(_dcp_filesystem.FileSystem.validate_checkpoint_id(checkpoint_id))


def _empty_directory(path: str) -> bool:
    """``path`` is a directory (not a link to one) with nothing in it."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and not os.listdir(path)
    except OSError:
        return False


_CHECKPOINT_NAMES = re.compile(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp|" + re.escape(MANIFEST_NAME))
"""What a DCP checkpoint directory holds, as DCP's writer or this one writes it."""


def _check_only_a_checkpoint(path: str) -> None:
    """Before ``overwrite=True`` replaces ``path`` whole: refuse when it holds anything a
    checkpoint does not (a ``model.pt``, a ``config.json``, a directory), which
    ``FileSystemWriter`` leaves beside the files it writes and the swap would delete."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise CheckpointExistsError(f"{path} exists and is not a directory")
        names = os.listdir(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise from_os_error(exc, "listdir", path) from exc
    foreign = sorted(n for n in names if not _CHECKPOINT_NAMES.fullmatch(n))
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise CheckpointExistsError(
            f"{path} holds what is no checkpoint's ({shown}): overwrite=True replaces the whole "
            "directory and would delete it (FileSystemWriter writes beside it); save to a "
            "directory of the checkpoint's own"
        )


def _remove_empty_directory(path: str) -> None:
    """Remove the empty directory a save without ``overwrite`` takes the place of: what
    was written there since the save began is kept, and the save refused."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise CheckpointExistsError(
                f"{path} already exists (pass overwrite=True to replace it)"
            ) from None
        raise from_os_error(exc, "rmdir", path) from exc


def _make_in_place(path: str) -> None:
    """The directory a ``publish=False`` save writes: new, in its unpublished parent."""
    try:
        os.mkdir(path)
    except FileExistsError:
        raise CheckpointExistsError(f"{path} already exists") from None
    except OSError as exc:
        raise from_os_error(exc, "mkdir", path) from exc


def _dcp_manifest(
    files: dict[str, FileRecord],
    entries: Mapping[str, Sequence[EntryRecord]],
    world_size: int,
    parts: tuple[str, ...] = (),
    layout: str = "dcp",
) -> Manifest:
    """The manifest of a DCP directory (or, ``layout="fsdp"``, of a checkpoint holding DCP
    directories): its files, and each data file's entries in order."""
    return Manifest(
        files=files,
        tensors={},
        skeleton={},
        layout=layout,
        world_size=world_size,
        version=format_version(files, 2),
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        directories=(".", *parts),
        entries={n: tuple(sorted(e, key=lambda x: x.begin)) for n, e in entries.items()},
    )


def _nbytes(piece: Bytes | torch.Tensor) -> int:
    return piece.numel() * piece.element_size() if isinstance(piece, torch.Tensor) else len(piece)


def _pieces(item: WriteItem, planner: SavePlanner) -> list[Bytes | torch.Tensor]:
    """What one entry of a data file is made of: DCP's bytes for a value that is not a
    tensor; for a tensor, ``torch.save``'s archive around the tensor's own bytes (read
    from the live tensor, on the CPU or the GPU, when the file is written)."""
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise TypeError(f"{item.index.fqn}: the planner resolved a bytes entry to {type(data).__name__}")
        return [data.getbuffer()]  # written from the planner's buffer, not a copy of it
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{item.index.fqn}: the planner resolved a tensor entry to {type(data).__name__}")
    t = data.detach()
    if t.is_nested or t.layout != torch.strided:
        raise TypeError(f"{item.index.fqn}: {t.layout} tensors cannot be written")
    if t.is_conj() or t.is_neg():
        # A lazy conjugate or negative view: its values are not the bytes it points at.
        t = t.resolve_conj().resolve_neg()
    plain = type(t) is torch.Tensor
    framing = _framing(t.dtype, tuple(t.shape)) if plain and not t.is_quantized else None
    if framing is None:
        # A tensor whose archive holds more than its bytes (a quantized tensor's scales, a
        # tensor subclass and what it wraps): torch.save's own archive of it, as DCP's
        # FileSystemWriter writes.
        t = t.cpu()
        if plain and t.untyped_storage().nbytes() > t.nbytes:
            t = t.clone()  # only its own elements, not the whole storage it views
        buf = io.BytesIO()
        torch.save(t, buf)
        return [buf.getbuffer()]
    head, tail = framing
    return [head, t, tail] if t.numel() else [head + tail]


def _framing(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes] | None:
    """`_archive_around`, or ``None`` for a dtype that ``torch.save`` does not write as
    plain bytes in one record."""
    try:
        return _archive_around(dtype, shape)
    except Exception:  # e.g. sub-byte dtypes: torch.save does not know them
        return None


async def _write_rank_file(
    backend: str,
    tmp: str,
    name: str,
    rel: str,
    directory: int,
    items: Sequence[WriteItem],
    pieces: Sequence[list[Bytes | torch.Tensor]],
    staged: Callable[[], None] | None = None,
) -> list[WriteResult]:
    """One rank's data file: every entry in order, checksummed as a whole and entry by
    entry, fsynced. ``staged()`` is called once every byte has left the tensors."""
    if not items:
        if staged is not None:
            staged()
        return []
    lengths = [sum(_nbytes(p) for p in ps) for ps in pieces]
    hasher = PartHasher(new_hasher(), lengths, new_hasher)
    if directory:
        await to_thread_to_the_end(make_directories, tmp)  # this rank's part on its disk
    if _knobs.space_check_enabled():  # before anything is written, as aiopersist.save
        await asyncio.to_thread(check_room, tmp, sum(lengths), "save", os.path.join(tmp, name))
    dio = await asyncio.to_thread(probe_directory, tmp)
    pool = StagingPool()
    try:
        async with open_backend(backend) as be:
            rec = await write_file(
                be,
                os.path.join(tmp, name),
                dio,
                pool,
                [p for ps in pieces for p in ps],
                staged,
                hasher=hasher,
                size=sum(lengths),
            )
    finally:
        pool.close()
    results = []
    offset = 0
    rec = dataclasses.replace(rec, directory=directory)
    for item, n, digest in zip(items, lengths, hasher.part_digests(), strict=True):
        info = _StorageInfo(rel, offset, n)
        results.append(
            WriteResult(index=item.index, size_in_bytes=n, storage_data=_Written(info, digest, rec))
        )
        offset += n
    return results


async def _write_metadata_and_manifest(
    backend: str, tmp: str, raw: bytes, manifest: Manifest
) -> list[FileRecord]:
    """``.metadata``, then the manifest listing it; their records."""
    dio = await asyncio.to_thread(probe_directory, tmp)
    pool = StagingPool()
    try:
        async with open_backend(backend) as be:
            rec = await write_file(be, os.path.join(tmp, METADATA_FILE), dio, pool, [raw])
            manifest = dataclasses.replace(manifest, files={**manifest.files, METADATA_FILE: rec})
            data = await asyncio.to_thread(dump_manifest, manifest)
            return [rec, await write_file(be, os.path.join(tmp, MANIFEST_NAME), dio, pool, [data])]
    finally:
        pool.close()


# -- the reader ---------------------------------------------------------------------------------

_METADATA_CLASSES = frozenset(
    {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    }
)
_PATHS = frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"})
MAX_METADATA_BYTES = 1 << 30


MAX_PICKLE_DEPTH = 64
"""How deeply DCP's metadata may nest (it needs about ten levels)."""
MAX_KEY_WEIGHT = 1024
"""How many objects a dict key or set member of DCP's metadata may be made of, shared
parts counted each time they appear (a key is hashed and compared whole)."""


def _pickle_ops() -> dict[str, tuple[int, int, int, int]]:
    """Per opcode: what it does to the stack, for `_check_pickle_shape`: (kind, items it
    pops before a mark or without one, items it pushes, which of them are keys)."""
    special = {"MARK": 1, "PUT": 2, "BINPUT": 2, "LONG_BINPUT": 2, "MEMOIZE": 3, "GET": 4, "BINGET": 4,
               "LONG_BINGET": 4, "POP": 5, "POP_MARK": 6, "DUP": 7, "STOP": 8, "GLOBAL": 10,
               "STACK_GLOBAL": 11}  # fmt: skip
    # 4: a call (REDUCE, NEWOBJ...), whose arguments the callee may hash (OrderedDict,
    # an Enum's or a layout's lookup): as heavy as a key at most.
    keys = {"SETITEM": 1, "SETITEMS": 2, "DICT": 2, "ADDITEMS": 3, "FROZENSET": 3, "REDUCE": 4,
            "NEWOBJ": 4, "NEWOBJ_EX": 4, "INST": 4, "OBJ": 4}  # fmt: skip
    table = {}
    for op in pickletools.opcodes:
        before = op.stack_before
        if op.name in special:
            table[op.code] = (special[op.name], 0, 0, 0)
        elif pickletools.markobject in before:  # pops to the mark, then the items before it
            table[op.code] = (
                9,
                before.index(pickletools.markobject),
                len(op.stack_after),
                keys.get(op.name, 0),
            )
        else:
            table[op.code] = (0, len(before), len(op.stack_after), keys.get(op.name, 0))
    return table


_PICKLE_OPS = _pickle_ops()
_ADDS_TO = frozenset(
    op.code
    for op in pickletools.opcodes
    if op.name in ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD")
)
"""The opcodes that add to the object below their items (a list, dict or set its
items, an object its state) and push that object back: it holds them one level down,
however many times it is added to (a pickler adds a long list's items a thousand at a
time)."""


def _check_pickle_shape(raw: bytes, where: str) -> None:
    """Walk the pickle's opcodes (without running any) and refuse, before it is
    unpickled, what would make unpickling or hashing its objects blow up: a count that
    claims more bytes than the pickle holds, objects nested deeper than
    `MAX_PICKLE_DEPTH`, and dict keys or set members heavier than `MAX_KEY_WEIGHT`
    (a tuple a million deep crashes the interpreter's hash; one built of itself twice,
    a hundred times over, never finishes hashing), arguments of a call (``REDUCE``,
    ``NEWOBJ``...) heavier than that too (the callee may hash them: ``OrderedDict``, an
    enum's lookup), and a ``BUILD`` on a class or function (``GLOBAL``): it would set
    attributes on the class itself, for the whole process (``PosixPath.__fspath__``,
    ``MetadataIndex.__hash__``), where DCP's metadata only ever builds instances. Each
    stack item is tracked as its depth and its weight (objects in it, shared ones counted
    each time), a class or function as depth -1; marks are kept apart, as the unpickler
    keeps them, with what lies below the last one out of reach."""
    stack: list[tuple[int, int]] = []
    marks: list[int] = []  # the stack's length at each mark
    memo: dict[int, tuple[int, int]] = {}
    table = _PICKLE_OPS
    leaf = (0, 1)
    named = (-1, 1)  # a class or function (GLOBAL, STACK_GLOBAL)
    deepest = MAX_PICKLE_DEPTH
    append = stack.append
    try:
        for op, arg, _ in pickletools.genops(raw):
            kind, pops, pushes, keys = table[op.code]
            fence = marks[-1] if marks else 0
            if kind == 0:
                if len(stack) - pops < fence:
                    raise ValueError(f"{op.name} with too few items on the stack")
                if pops == 0:
                    if pushes:
                        append(leaf)
                    continue
                if pushes == 1 and pops <= 2 and not keys:  # the common case, without lists
                    d, w = stack[-1]
                    if pops == 2:
                        del stack[-1]
                        d0, w0 = stack[-1]
                        if op.code in _ADDS_TO:  # APPEND, BUILD: one level below the object
                            if d0 < 0:
                                raise ValueError(f"{op.name} on a class or function")
                            if d >= deepest:
                                raise ValueError(f"objects nested more than {deepest} deep")
                            stack[-1] = (max(d0, d + 1), w0 + w)
                            continue
                        d, w = max(d, d0), w + w0
                    if d >= deepest:
                        raise ValueError(f"objects nested more than {deepest} deep")
                    stack[-1] = (d + 1, w + 1)
                    continue
                children = stack[-pops:]
                del stack[-pops:]
                if keys == 1 and children[1][1] > MAX_KEY_WEIGHT:  # SETITEM: dict, key, value
                    raise ValueError("a dict key too large to hash")
                if keys == 4 and any(w > MAX_KEY_WEIGHT for _, w in children[1:]):
                    raise ValueError(f"{op.name} with arguments too large to hash")
                if op.code in _ADDS_TO and children[0][0] < 0:
                    raise ValueError(f"{op.name} on a class or function")
            elif kind == 9:
                at = marks.pop()
                if at - pops < (marks[-1] if marks else 0):
                    raise ValueError(f"{op.name} with too few items on the stack")
                marked = stack[at:]
                children = stack[at - pops :]
                del stack[at - pops :]
                if keys and any(w > MAX_KEY_WEIGHT for _, w in (marked[0::2] if keys == 2 else marked)):
                    raise ValueError("a dict key, set member or call's argument too large to hash")
                if op.code in _ADDS_TO and children and children[0][0] < 0:
                    raise ValueError(f"{op.name} on a class or function")
            elif kind == 1:
                marks.append(len(stack))
                continue
            elif kind in (2, 3):  # PUT, MEMOIZE: the top item, never one below the mark
                if len(stack) <= fence:
                    raise ValueError(f"{op.name} with nothing on the stack")
                memo[cast(int, arg) if kind == 2 else len(memo)] = stack[-1]
                continue
            elif kind == 4:
                append(memo[cast(int, arg)])
                continue
            elif kind == 5:  # POP: the top item, or the mark itself when none is above it
                if len(stack) > fence:
                    stack.pop()
                else:
                    marks.pop()
                continue
            elif kind == 6:
                del stack[marks.pop() :]
                continue
            elif kind == 7:
                if len(stack) <= fence:
                    raise ValueError("DUP with nothing on the stack")
                append(stack[-1])
                continue
            elif kind == 10:  # GLOBAL
                append(named)
                continue
            elif kind == 11:  # STACK_GLOBAL: the module's and the name's strings
                if len(stack) - 2 < fence:
                    raise ValueError("STACK_GLOBAL with too few items on the stack")
                stack[-2:] = [named]
                continue
            else:  # STOP
                break
            if op.code in _ADDS_TO:  # the object first, then what is added to it
                depth = max(children[0][0], 1 + max((d for d, _ in children[1:]), default=-1))
                item = (depth, sum(w for _, w in children))
            else:
                depth = 1 + max((d for d, _ in children), default=-1)
                item = (depth, 1 + sum(w for _, w in children))
            if depth > deepest:
                raise ValueError(f"objects nested more than {deepest} deep")
            if pushes == 1:
                append(item)
            elif pushes:
                stack.extend([item] * pushes)
    except Exception as exc:  # also: truncated, a count past the end, a bad memo or stack
        raise CheckpointCorruptError(f"{where}: not DCP metadata ({type(exc).__name__}: {exc})") from exc


def _is_count(value: object) -> bool:
    """A non-negative int (not a bool): a size, an offset, a length."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dims(value: object, what: str, where: str) -> tuple[int, ...]:
    """Sizes or offsets: a ``torch.Size`` (what DCP writes, and what its planners compare
    with a tensor's size: a list never equals one, and the load failed in DCP's planner
    with an untyped error) of counts from 0 to `MAX_COUNT` (a tensor's must fit torch's
    int64)."""
    if not isinstance(value, torch.Size) or not all(_is_count(n) and n <= MAX_COUNT for n in value):
        raise CheckpointCorruptError(f"{where}: {what} is not a torch.Size of sizes from 0 to 2**62")
    return tuple(value)


def _check_metadata(metadata: object, where: str) -> None:
    """DCP's ``Metadata`` as DCP writes it, checked before anything acts on it: every
    value of a known type with its fields (the restricted unpickler lets a pickle build
    objects with any fields), every tensor's chunks inside the tensor, each once, with a
    storage record, and every value that is not a tensor with one."""
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{where}: not DCP metadata")
    tensors = getattr(metadata, "state_dict_metadata", None)
    records = getattr(metadata, "storage_data", None)
    if not isinstance(tensors, dict) or not isinstance(records, dict):
        raise CheckpointCorruptError(f"{where}: not DCP metadata with storage records")
    budget = [_MAX_CORNER_WORK]
    if not all(isinstance(i, MetadataIndex) and isinstance(getattr(i, "fqn", None), str) for i in records):
        raise CheckpointCorruptError(f"{where}: a storage record is not keyed by a DCP index")
    meta = getattr(metadata, "storage_meta", None)
    if meta is not None and not isinstance(meta, StorageMeta):
        raise CheckpointCorruptError(f"{where}: storage_meta is a {type(meta).__name__}")
    for fqn, md in tensors.items():
        if not isinstance(fqn, str):
            raise CheckpointCorruptError(f"{where}: a value named by a {type(fqn).__name__}")
        if isinstance(md, BytesStorageMetadata):
            if MetadataIndex(fqn) not in records:
                raise CheckpointCorruptError(f"{where}: {fqn}: no storage record")
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointCorruptError(f"{where}: {fqn}: a {type(md).__name__}, not DCP's")
        props = getattr(md, "properties", None)
        if not isinstance(props, TensorProperties) or not isinstance(
            getattr(props, "dtype", None), torch.dtype
        ):
            raise CheckpointCorruptError(f"{where}: {fqn}: no tensor properties with a dtype")
        size = _dims(getattr(md, "size", None), f"{fqn}'s size", where)
        if bounded_count(size) is None:
            raise CheckpointCorruptError(f"{where}: {fqn}: its size holds more than 2**62 elements")
        chunks = getattr(md, "chunks", None)
        if not isinstance(chunks, list | tuple):
            raise CheckpointCorruptError(f"{where}: {fqn}: its chunks are not a list")
        seen: set[tuple[int, ...]] = set()
        for chunk in chunks:
            if not isinstance(chunk, ChunkStorageMetadata):
                raise CheckpointCorruptError(f"{where}: {fqn}: a chunk that is a {type(chunk).__name__}")
            offsets = _dims(getattr(chunk, "offsets", None), f"{fqn}'s chunk offsets", where)
            sizes = _dims(getattr(chunk, "sizes", None), f"{fqn}'s chunk sizes", where)
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise CheckpointCorruptError(f"{where}: {fqn}: a chunk of another rank than the tensor")
            if any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
                raise CheckpointCorruptError(
                    f"{where}: {fqn}: a chunk at {list(offsets)} reaches past the tensor"
                )
            if offsets in seen:
                raise CheckpointCorruptError(f"{where}: {fqn}: the chunk at {list(offsets)} is listed twice")
            seen.add(offsets)
            if MetadataIndex(fqn, torch.Size(offsets)) not in records:
                raise CheckpointCorruptError(
                    f"{where}: {fqn}: the chunk at {list(offsets)} has no storage record"
                )
        _check_cover(size, chunks, f"{where}: {fqn}", budget)
    _check_planner_data(getattr(metadata, "planner_data", None), tensors, where)


_MAX_PATH = 1000
"""The longest place in a state dict ``planner_data`` may give a value: DCP finds the
places by recursion, one call a level (so fewer than Python's default recursion limit of
1000), and its load planner joins a place's keys in time quadratic in its length."""

_MAX_LIST_SLOTS = 1 << 24
"""How many list elements ``planner_data``'s places may make DCP create at most, beyond one
for each value of the checkpoint: DCP's ``set_element`` grows a list one ``None`` at a
time up to the index it is given, so a place with index ``2**40`` is a hang and all the
memory (16 Mi slots take a second and 128 MiB)."""


def _check_planner_data(data: object, values: dict[str, object], where: str) -> None:
    """DCP's default planners record each value's place in the nested state dict it was
    saved from (``planner_data``: a name to a tuple of keys and list indices), and DCP
    acts on it when it rebuilds that state dict (loading into an empty one,
    ``load_sharded_optimizer_state_dict``, ``unflatten_state_dict``): checked where it
    names a value of the checkpoint. Each place is a tuple of keys (strings) and list
    indices, starting with a key, whose keys joined by dots are the value's name (as DCP
    names them, so a value cannot be put in another's place), no place goes through
    another value or is both a list and a dict, and the lists they make stay within
    `_MAX_LIST_SLOTS`. Anything else (None, a custom planner's own data) is left alone:
    DCP's load planner does not read it."""
    if not isinstance(data, dict):
        return
    kind: dict[int, str] = {}  # a node of the places' tree: "leaf", "dict" or "list"
    child: dict[tuple[int, str | int], int] = {}
    highest: dict[int, int] = {}  # a list node's highest index
    slots, budget = 0, _MAX_LIST_SLOTS + len(values)
    for fqn in values:
        if fqn not in data:
            continue  # DCP writes none without flattening; its planners then use the names
        path = data[fqn]
        if not (
            type(path) is tuple
            and 0 < len(path) <= _MAX_PATH
            and type(path[0]) is str
            and all(type(k) is str or (type(k) is int and 0 <= k < budget) for k in path)
        ):
            raise CheckpointCorruptError(
                f"{where}: {fqn}: its place in the state dict (planner_data) is not a tuple of at"
                f" most {_MAX_PATH} keys and list indices below {budget}, starting with a key"
            )
        if ".".join(map(str, path)) != fqn:
            raise CheckpointCorruptError(
                f"{where}: {fqn}: planner_data puts it at {reprlib.repr(path)}, not where its name says"
            )
        node = 0
        for key in path:
            wanted = "list" if type(key) is int else "dict"
            if kind.setdefault(node, wanted) != wanted:
                raise CheckpointCorruptError(
                    f"{where}: {fqn}: planner_data's place for it goes through another value,"
                    " or through a list that is also a dict"
                )
            top = highest.get(node, -1)
            if type(key) is int and key > top:
                slots += key - top
                highest[node] = key
                if slots > budget:
                    raise CheckpointCorruptError(
                        f"{where}: {fqn}: planner_data's places make lists of more than {budget}"
                        " elements in all"
                    )
            node = child.setdefault((node, key), len(child) + 1)
        if kind.setdefault(node, "leaf") != "leaf":
            raise CheckpointCorruptError(
                f"{where}: {fqn}: planner_data puts it where other values are (a dict or a list of them)"
            )


_MAX_CORNER_WORK = 1 << 24
"""How much `_check_cover` does for the whole of a checkpoint's metadata at most: chunk
corners times the dimensions they are told apart by (a few seconds). DCP's chunks split
one or two dimensions (two or four corners a chunk): millions of chunks stay within it;
a ``.metadata`` of a few hundred bytes claiming 2**24 corners of 24 dimensions does not."""


def _check_cover(
    size: tuple[int, ...], chunks: Sequence[ChunkStorageMetadata], where: str, budget: list[int]
) -> None:
    """The (checked) ``chunks`` of a tensor of ``size`` cover every element exactly once:
    DCP writes a tensor whole, and a load fills its target from the chunks, so a gap would
    leave part of the target as it was (silently), and an overlap hides a gap (or gives
    an element two values).

    A box's indicator function is the signed sum of step functions at its corners (+1 at
    a corner with an even number of upper bounds, -1 at an odd one), and those step
    functions are linearly independent: the chunks' indicators sum to the tensor's (every
    element covered once, none outside) exactly when their signed corners sum to the
    tensor's. Linear in the chunks, where comparing them pairwise is quadratic; only the
    dimensions some chunk splits count (``2**k`` corners a chunk for ``k`` of them)."""
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks if all(c.sizes)]
    split = [d for d in range(len(size)) if any(o[d] != 0 or n[d] != size[d] for o, n in boxes)]
    if not all(size):
        return  # no elements (nor chunks that hold any: each is inside the tensor)
    if not boxes:
        raise CheckpointCorruptError(f"{where}: no chunk holds any of its {bounded_count(size)} elements")
    budget[0] -= ((len(boxes) + 1) << len(split)) * max(1, len(split))
    if budget[0] < 0:
        raise CheckpointCorruptError(
            f"{where}: {len(boxes)} chunks split along {len(split)} dimensions: with the tensors"
            " before it, too many to check that their chunks cover each once"
        )
    corners: dict[tuple[int, ...], int] = {}
    whole = (tuple(0 for _ in size), size)
    for (offsets, sizes), sign in [*((box, 1) for box in boxes), (whole, -1)]:
        for mask in range(1 << len(split)):
            corner = tuple(
                offsets[d] + sizes[d] if mask >> i & 1 else offsets[d] for i, d in enumerate(split)
            )
            value = corners.get(corner, 0) + (-sign if mask.bit_count() & 1 else sign)
            if value:
                corners[corner] = value
            else:
                del corners[corner]
    if corners:
        at = min(corners)
        raise CheckpointCorruptError(
            f"{where}: its chunks do not cover it exactly once (they overlap, or leave part of it"
            f" out, around index {list(at)} of dimensions {split})"
        )


def _check_apart(ranges: Sequence[tuple[int, int]], where: str) -> None:
    """Sorted ``[begin, end)`` byte ranges of one file: none may overlap another (DCP
    never writes overlapping entries; reading them would hand out bytes twice, and
    their total could exceed the file)."""
    end = 0
    for b, e in ranges:
        if b == e:
            continue  # empty: reads nothing
        if b < end:
            raise CheckpointCorruptError(f"{where}: bytes {b}..{e} overlap another record's")
        end = e


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` and nothing else: only its own classes, dtypes,
    ``torch.Size``, layouts and paths can be named, so a hostile ``.metadata`` cannot
    make the load call anything."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES)
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module in ("pathlib", "pathlib._local") and name in _PATHS)
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")
        if module == "pathlib._local":  # Python 3.13 pickles its paths so; any Python reads them
            module = "pathlib"
        return super().find_class(module, name)


class AiopersistReader(StorageReader):
    """A DCP ``StorageReader`` on aiopersist's engine; see the module docstring.

    Reads directories written by `AiopersistWriter` (every ``.metadata`` and entry read
    is checked against the checksums of ``aiopersist.json`` first) and by DCP's own
    ``FileSystemWriter`` (no checksums to check). ``path`` is the checkpoint directory
    (or pass ``checkpoint_id`` to ``dcp.load``).

    Values that are not tensors are deserialized by DCP's default planner with
    ``torch.load(weights_only=False)``, which runs whatever a pickle names: each is first
    loaded with ``weights_only=True``, and one that needs more (a class of its own, or a
    hostile pickle) is refused with `UnsupportedStateError`, nothing of it run, unless
    ``allow_pickle=True`` (only for checkpoints you trust). A planner of your own
    deserializes its values as it likes: they are handed to it unchecked.
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, backend: str = "auto", allow_pickle: bool = False
    ) -> None:
        super().__init__()
        self.path = absolute_path(path) if path is not None else None
        self.checkpoint_id: Path | None = Path(path) if path is not None else None
        """The checkpoint as it was named (a ``Path``, as ``FileSystemReader.checkpoint_id``)."""
        self.backend = backend
        self.allow_pickle = allow_pickle
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self._sizes: dict[str, int] = {}
        self._files: dict[str, tuple[str, str]] = {}
        """A storage record's ``relative_path`` -> the file's name and its full path."""
        self._checked = False
        """The directory has aiopersist's manifest: every file and entry is listed."""
        self._entries: dict[tuple[str, int, int], str] = {}
        """(file, begin, end) -> the entry's checksum, from the manifest (none for DCP's own
        directories)."""
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] = {}
        """(fqn, chunk offsets) -> the saved chunk's dtype and shape, from the metadata."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = absolute_path(checkpoint_id, "checkpoint_id")
            self.checkpoint_id = Path(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.storage_data = {}

    def _path(self) -> str:
        if self.path is None:
            raise ValueError(
                "AiopersistReader: no checkpoint directory (pass path, or checkpoint_id to dcp.load)"
            )
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``Metadata``, checked: against the manifest's checksum when there is one,
        through a restricted unpickler always, and every storage record it gives (a plain
        file in the directory, bytes inside it; with a manifest, exactly one checksummed
        entry) before anything is read from the data files.

        With ``rank`` (DCP asks so when there is no ``.metadata``), the rank's own
        ``__<rank>.metadata`` that ``FileSystemWriter`` writes in a save with
        ``use_collectives=False``; `AiopersistWriter` never writes those."""
        root = self._path()
        rank = kwargs.get("rank")
        if rank is None:
            meta_name = METADATA_FILE
        elif isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
            meta_name = f"__{rank}{METADATA_FILE}"
        else:
            raise ValueError(f"AiopersistReader.read_metadata: rank {rank!r} is not a rank")
        meta_path = os.path.join(root, meta_name)
        self._sizes, self._entries, self._files = {}, {}, {}
        self._checked = False
        manifest: Manifest | None = None
        if os.path.lexists(os.path.join(root, MANIFEST_NAME)):
            if rank is not None:
                raise CheckpointNotFoundError(
                    f"{root}: an AiopersistWriter checkpoint has no per-rank {meta_name}"
                )
            loc = locate(root)
            manifest = loc.manifest
            if manifest is None or manifest.layout != "dcp":
                raise CheckpointCorruptError(
                    f"{root}: an aiopersist checkpoint, not a torch.distributed.checkpoint directory "
                    "(load it with aiopersist.load)"
                )
            self._sizes = {n: r.nbytes for n, r in manifest.files.items()}
            self._checked = True
            # Files in part directories on other disks: DCP's records name them relative
            # to the checkpoint, as the manifest's directories place them.
            for n, r in manifest.files.items():
                full = loc.path_of(r)
                self._files[os.path.relpath(full, root)] = (n, full)
            self._entries = {
                (n, e.begin, e.end): e.checksum for n, found in manifest.entries.items() for e in found
            }
        elif not os.path.lexists(meta_path):
            raise CheckpointNotFoundError(f"{root}: no torch.distributed.checkpoint here (no {meta_name})")
        raw = read_small(meta_path, MAX_METADATA_BYTES)
        if manifest is not None:
            rec = manifest.files.get(METADATA_FILE)
            if rec is None:
                raise CheckpointCorruptError(f"{root}: the manifest does not list {METADATA_FILE}")
            actual = new_hasher()
            actual.update(raw)
            if len(raw) != rec.nbytes or actual.hexdigest() != rec.checksum:
                raise CheckpointCorruptError(f"{meta_path}: checksum mismatch (damaged since it was written)")
        _check_pickle_shape(raw, meta_path)
        try:
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        except Exception as exc:
            said = str(exc)  # may show the objects it failed on: bounded
            said = said if len(said) <= 300 else said[:300] + "..."
            what = f"{type(exc).__name__}: {said}"
            raise CheckpointCorruptError(f"{meta_path}: not DCP metadata ({what})") from exc
        _check_metadata(metadata, meta_path)
        ranges: dict[str, list[tuple[int, int]]] = {}
        for index, info in metadata.storage_data.items():
            name = self._check_record(root, index, info)
            # A list: two records of the same bytes overlap (one entry loaded into two values).
            ranges.setdefault(name, []).append((info.offset, info.offset + info.length))
        for name, found in ranges.items():
            _check_apart(sorted(found), f"{meta_path}: the records of {name}")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return cast(Metadata, metadata)  # checked above

    def _check_record(self, root: str, index: object, info: object) -> str:
        """The name of the file a storage record points into, once the record is checked."""
        where = f"{root}/{METADATA_FILE}: {index}"
        if not isinstance(info, _StorageInfo) or not all(
            hasattr(info, f) for f in ("relative_path", "offset", "length", "transform_descriptors")
        ):
            raise CheckpointCorruptError(f"{where}: not a storage record")
        if self._checked:  # aiopersist's manifest lists every file
            found = (
                self._files.get(os.path.normpath(info.relative_path))
                if isinstance(info.relative_path, str)
                else None
            )
            if found is None:
                raise CheckpointCorruptError(f"{where}: {info.relative_path!r} is no file of the checkpoint")
            name = found[0]
        else:
            name = safe_file_name(info.relative_path, where)
            self._files[name] = (name, os.path.join(root, name))
        if info.transform_descriptors is not None and not isinstance(
            info.transform_descriptors, list | tuple
        ):
            raise CheckpointCorruptError(f"{where}: transforms that are not a list")
        if info.transform_descriptors:
            raise CheckpointCorruptError(
                f"{where}: stored with transforms {list(info.transform_descriptors)}, which AiopersistReader "
                "does not apply (read it with DCP's FileSystemReader)"
            )
        if not (_is_count(info.offset) and _is_count(info.length)):
            raise CheckpointCorruptError(f"{where}: offset and length must be non-negative ints")
        if self._checked:  # aiopersist's manifest checksums every entry a record may point at
            if (name, info.offset, info.offset + info.length) not in self._entries:
                raise CheckpointCorruptError(
                    f"{where}: bytes {info.offset}+{info.length} of {name} are no checked entry"
                )
        elif name not in self._sizes:
            self._sizes[name] = regular_size(os.path.join(root, name), where)
        if info.offset + info.length > self._sizes[name]:
            raise CheckpointCorruptError(
                f"{where}: bytes {info.offset}+{info.length} run past the end of {name}"
            )
        return name

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointCorruptError(f"{self._path()}: DCP metadata without storage records")
        self.storage_data = metadata.storage_data
        self._chunks = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[(fqn, tuple(chunk.offsets))] = (md.properties.dtype, tuple(chunk.sizes))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every entry the plan needs (each once, however many items use it) through
        the engine, check each against its checksum, then hand them to the planner. The
        entries are allocated first: `NotEnoughMemoryError` when they need more host memory
        than is available (a record of a sparse file may claim terabytes)."""
        keys = {
            (info.relative_path, info.offset, info.offset + info.length): info.length
            for info in map(self._record, plan.items)
        }
        # Every entry is allocated before a byte of it is read (and checked): a record of
        # a sparse file may claim more than the machine has.
        _check_memory(sum(keys.values()), self._path())
        wanted = {key: torch.empty(length, dtype=torch.uint8) for key, length in keys.items()}
        files = {rel: self._files[os.path.normpath(rel)] for rel, _, _ in wanted}
        backend = self.backend
        _on_engine(lambda: _read_entries(backend, {r: f[1] for r, f in files.items()}, wanted)).result()
        for (rel, begin, end), blob in wanted.items():
            name = files[rel][0]
            stated = self._entries.get((name, begin, end))
            if stated is None:
                continue
            hasher = new_hasher()
            hasher.update(cast(Any, blob.numpy()))
            if hasher.hexdigest() != stated:
                raise CheckpointCorruptError(
                    f"{files[rel][1]}: checksum mismatch in bytes {begin}..{end} "
                    "(damaged since it was written)"
                )
        loaded: dict[tuple[str, int, int], torch.Tensor] = {}
        for req in plan.items:
            info = self._record(req)
            key = (info.relative_path, info.offset, info.offset + info.length)
            blob = wanted[key]
            if req.type == LoadItemType.BYTE_IO:
                value = blob.numpy().tobytes()
                where = f"{files[key[0]][1]} bytes {key[1]}..{key[2]}"
                if not self.allow_pickle and _unpickles_anything(planner):
                    _check_value(value, req.storage_index.fqn, where)
                try:
                    planner.load_bytes(req, io.BytesIO(value))
                except Exception as exc:  # DCP's deserializing of bytes it cannot read
                    raise CheckpointCorruptError(
                        f"{files[key[0]][1]} bytes {key[1]}..{key[2]}: not a value DCP can read "
                        f"({type(exc).__name__}: {exc})"
                    ) from exc
                continue
            if key not in loaded:
                index = req.storage_index
                layout = self._chunks.get((index.fqn, tuple(index.offset or ())))
                raw = _raw_tensor(blob, *layout) if layout is not None else None
                where = f"{files[key[0]][1]} bytes {key[1]}..{key[2]}"
                stored = raw if raw is not None else _load_tensor(blob, where)
                if layout is not None and (stored.dtype, tuple(stored.shape)) != layout:
                    # The entry is the chunk the metadata describes, or the load would cast
                    # it, or take part of it, without a word.
                    raise CheckpointCorruptError(
                        f"{where}: {index.fqn}: the entry holds a {stored.dtype} tensor of shape "
                        f"{list(stored.shape)}, the metadata's chunk is {layout[0]} of {list(layout[1])}"
                    )
                loaded[key] = stored
            _copy_into(req, planner, loaded[key])
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _record(self, req: ReadItem) -> _StorageInfo:
        info = self.storage_data.get(req.storage_index)
        if info is None:
            raise CheckpointCorruptError(f"{self._path()}: no storage record for {req.storage_index}")
        return info

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """As ``FileSystemReader``'s: a local path (not a URL such as ``s3://...``)."""
        return bool(_dcp_filesystem.FileSystem.validate_checkpoint_id(checkpoint_id))


def check_metadata_of(path: str | os.PathLike[str]) -> None:
    """Each torch.distributed.checkpoint directory of the aiopersist checkpoint at
    ``path`` (a DCP checkpoint, or the sharded state of an FSDP one; not a file that
    happens to be named ``.metadata``): its ``.metadata`` read as `AiopersistReader`
    reads it, so that what the checksums cannot tell (metadata forged together with its
    manifest: a pickle naming other classes, records pointing elsewhere) is refused with
    `CheckpointCorruptError` before anything loads it. `aiopersist.verify` checks sizes
    and checksums; the CLI's ``verify`` and the integrations' resume checks add this."""
    loc = locate(os.fspath(path))
    if loc.manifest is not None:
        for sub in dcp_directories(loc.manifest):
            AiopersistReader(os.path.join(loc.directory, sub)).read_metadata()


def _unpickles_anything(planner: LoadPlanner) -> bool:
    """Whether ``planner`` deserializes values as DCP's default planner does, with
    ``torch.load(weights_only=False)``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    return getattr(type(planner), "load_bytes", None) is DefaultLoadPlanner.load_bytes


def _check_value(value: bytes, fqn: str, where: str) -> None:
    """A value's bytes, refused unless ``torch.load(weights_only=True)`` reads them: the
    default planner's ``torch.load(weights_only=False)`` would run whatever the pickle
    names (the same pickle, read by the restricted unpickler first, can name only what
    it allows). A pickle that names anything else is an `UnsupportedStateError`; bytes
    that are no value at all a `CheckpointCorruptError`."""
    try:
        torch.load(io.BytesIO(value), map_location="cpu", weights_only=True)
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        named = next((line for line in lines if "GLOBAL" in line), None)
        if isinstance(exc, pickle.UnpicklingError) and named is not None:
            raise UnsupportedStateError(
                f"{where}: the value {fqn!r} needs unpickling beyond weights_only ({named[:300]}); "
                "nothing of it was run. Pass AiopersistReader(..., allow_pickle=True) to load it, only "
                "for checkpoints you trust: unpickling can run code"
            ) from exc
        after = [b for a, b in itertools.pairwise(lines) if a.endswith("WeightsUnpickler error:")]
        why = (after or lines or [""])[0][:300]
        raise CheckpointCorruptError(
            f"{where}: not a value DCP can read ({type(exc).__name__}: {why})"
        ) from exc


def _raw_tensor(blob: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The tensor of an entry that is exactly the archive `AiopersistWriter` writes for a
    chunk of this dtype and shape (the same bytes around the tensor's), as a view of the
    bytes read: no copy and no unpickling. ``None`` for anything else (DCP's own archives
    differ in their CRC fields): `torch.load` reads those."""
    if not isinstance(dtype, torch.dtype) or not all(isinstance(n, int) and n >= 0 for n in shape):
        return None
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or nbytes > blob.numel():  # a claim the bytes read cannot hold: not acted on
        return None
    framing = _framing(dtype, shape)
    if framing is None:
        return None
    head, tail = framing
    if blob.numel() != len(head) + nbytes + len(tail):
        return None
    raw = blob.numpy()
    if raw[: len(head)].tobytes() != head or raw[len(head) + nbytes :].tobytes() != tail:
        return None
    try:
        return blob[len(head) : len(head) + nbytes].view(dtype).view(shape)
    except RuntimeError:  # not aligned for this dtype here: torch.load copes
        return None


def _load_tensor(blob: torch.Tensor, where: str) -> torch.Tensor:
    try:
        t = torch.load(io.BytesIO(blob.numpy().tobytes()), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointCorruptError(f"{where}: not a tensor archive ({type(exc).__name__}: {exc})") from exc
    if not isinstance(t, torch.Tensor):
        raise CheckpointCorruptError(f"{where}: holds a {type(t).__name__}, not a tensor")
    return t


def _copy_into(req: ReadItem, planner: LoadPlanner, stored: torch.Tensor) -> None:
    from torch.distributed._shard._utils import narrow_tensor_by_index

    if len(req.storage_offsets) != stored.dim() or any(
        o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, stored.shape, strict=True)
    ):
        raise CheckpointCorruptError(
            f"{req.storage_index.fqn}: the stored chunk {list(stored.shape)} does not hold rows "
            f"{list(req.storage_offsets)}+{list(req.lengths)}"
        )
    part = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != part.size():
        raise CheckpointCorruptError(
            f"{req.storage_index.fqn}: the stored chunk has shape {list(part.shape)}, "
            f"the target {list(target.shape)}"
        )
    target.copy_(part)
    planner.commit_tensor(req, target)


async def _read_entries(
    backend: str, paths: dict[str, str], wanted: dict[tuple[str, int, int], torch.Tensor]
) -> None:
    """Read every wanted ``(relative path, begin, end)`` entry into its tensor; ``paths``
    gives each relative path's full path."""
    by_file: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for (rel, begin, _), dest in wanted.items():
        by_file.setdefault(paths[rel], []).append((begin, dest))
    pool = StagingPool()
    try:
        async with open_backend(backend) as be:
            bound = files_at_once()

            async def one(path: str, segments: list[tuple[int, torch.Tensor]]) -> None:
                async with bound:
                    dio = await asyncio.to_thread(probe_file_for_read, path)
                    await read_segments(be, path, dio, pool, segments)

            await run_all(one(p, segs) for p, segs in by_file.items())
    finally:
        pool.close()
