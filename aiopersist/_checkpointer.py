"""The long-lived `Checkpointer`: saves that overlap training.

FastPersist's third idea: the checkpoint of step N is written while step N+1 runs its
forward and backward; only the optimizer step of N+1 has to wait, on the *fence*
(``handle.staged``), until every byte has left the live tensors.

- ``mode="fence"`` (default): no copy of the state. The writer streams from the live
  tensors through the bounded staging pool; ``staged`` resolves when the last byte is in
  a staging buffer. Memory: the pool.
- ``mode="snapshot"``: the save's first step copies the tensors into reusable host memory
  (within ``snapshot_bytes``), those of the `TorchSave` extra files too; ``staged``
  resolves right after that copy, and the write goes on from the copy. Memory: the pool
  plus one snapshot per save in flight.

Saves in flight are bounded (``max_in_flight``, default 1) and never interleave: a new
save waits for a free slot, or is skipped with a log line (``on_busy="skip"``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import io
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, TypeVar, cast

import torch

from . import _knobs
from ._backends import IOBackend, create_backend, to_thread_to_the_end
from ._commit import remove_path
from ._direct import AlignedBuffer, copy_bytes
from ._dist import FAILURES, Coordinator, coordinator
from ._exceptions import AiopersistError, ClosedError, maps_os_errors, typed_error
from ._flatten import Flattened, StoredTensor
from ._locate import PathArg, checkpoint_paths
from ._save import (
    ExtraFiles,
    SafetensorsSave,
    SaveInfo,
    TorchSave,
    check_save_arguments,
    fail_together,
    flatten_off_loop,
    given_path,
    save_state,
    torch_save_to,
)
from ._skeleton import MAX_CONTAINER_DEPTH
from ._staging import StagingPool
from ._stream import CudaReady, cuda_ready_streams, record_cuda_ready, settle, use_cuda_ready

log = logging.getLogger("aiopersist")

Mode = Literal["fence", "snapshot"]
OnBusy = Literal["wait", "skip"]


class SnapshotBudgetError(AiopersistError, MemoryError):
    """``mode="snapshot"``: the state's tensors do not fit in ``snapshot_bytes``."""


T = TypeVar("T")


@dataclass(eq=False)
class SaveHandle:
    """A save in progress. ``await handle.staged``: the tensors may be mutated again.
    ``await handle.done``: durable and committed (its result is the `SaveInfo`).

    A skipped save (``on_busy="skip"`` while another ran) has ``skipped`` set, and both
    futures are already resolved (``done`` to ``None``). A failed save raises its error,
    with its type and chain, from both (``staged`` too if it failed before staging).

    ``staged`` and ``done`` are the caller's views of the save's own futures: cancelling
    one (``asyncio.wait_for`` timing out, a cancelled task that awaited it) ends that wait
    only, never the save, its bookkeeping (a manager's retention and mirroring) or the
    handle: the next access gives a fresh view, which resolves as the save does.
    """

    path: str
    _staged: asyncio.Future[None] = field(repr=False)
    _done: asyncio.Future[SaveInfo | None] = field(repr=False)
    skipped: bool = False
    blocked_seconds: float = field(default=0.0)
    """Time the caller spent inside `Checkpointer.save` before it returned."""
    staged_seconds: float | None = field(default=None)
    """Time from the `Checkpointer.save` call until ``staged`` resolved (``None`` until it
    has, and for a save that failed before staging): in snapshot mode the copy out of the
    live tensors, in fence mode about the whole write."""

    _views: dict[str, asyncio.Future[Any]] = field(default_factory=dict, repr=False)

    @property
    def staged(self) -> asyncio.Future[None]:
        return self._view("staged", self._staged)

    @property
    def done(self) -> asyncio.Future[SaveInfo | None]:
        return self._view("done", self._done)

    def _view(self, name: str, own: asyncio.Future[T]) -> asyncio.Future[T]:
        return caller_view(self._views, name, own)

    async def wait(self) -> SaveInfo | None:
        """Wait until durable; the `SaveInfo` (``None`` for a skipped save)."""
        return await self.done


def caller_view(
    views: dict[str, asyncio.Future[Any]], name: str, own: asyncio.Future[T]
) -> asyncio.Future[T]:
    """The caller's view of ``own``, a future the library settles: cancelling the view
    ends the caller's wait only. One view while it lasts (``handle.done is handle.done``,
    its callbacks kept, so that it can be kept in a set), kept in ``views`` under
    ``name``; a new one once a caller has cancelled it. A view made once ``own`` is
    settled is ``own`` itself."""
    view = views.get(name)
    if view is None or view.cancelled():
        view = views[name] = asyncio.shield(own)
        if view is not own:
            view.add_done_callback(_seen)  # the error is the caller's on ``own``: no log for a copy
    return view


def _seen(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class OneClose:
    """The close of an object that closes once: the first ``aclose`` does the work
    (`begin` is true for it, and it calls `end`); one made while that runs waits for it
    to end (`wait`: a wait that is cancelled ends only itself), since returning at once
    would tell its caller that the saves in flight were durable; one made after returns."""

    def __init__(self) -> None:
        self._over: asyncio.Future[None] | None = None

    def begin(self) -> bool:
        if self._over is not None:
            return False
        self._over = asyncio.get_running_loop().create_future()
        return True

    def end(self) -> None:
        if self._over is not None and not self._over.done():
            self._over.set_result(None)

    async def wait(self) -> None:
        if self._over is not None and not self._over.done():
            await asyncio.shield(self._over)


class OwnLoop:
    """The event loop an object's work runs on. Its asyncio parts (the slots, the tasks,
    the ring) work on one loop at a time: used from another loop while saves run on the
    first, a save waited on a semaphore that the first loop's thread released without
    waking it, for good. A call from another loop while the object is busy on its own
    (``busy()``, or a `call` in progress there) raises ``RuntimeError`` at once; once it
    is idle, the object goes with the loop of its next call (an ``aclose`` in a loop of
    its own after the first loop ended; a save there still meets the I/O backend, which
    stays with the loop it was made on)."""

    def __init__(self, what: str, busy: Callable[[], bool]) -> None:
        self._what = what
        self._busy = busy
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls = 0
        self._guard = threading.Lock()  # two threads' calls at once

    def check(self) -> None:
        self._claim(0)

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Around a call that makes the object busy (a save, until its task exists)."""
        self._claim(1)
        try:
            yield
        finally:
            with self._guard:
                self._calls -= 1

    def _claim(self, calls: int) -> None:
        loop = asyncio.get_running_loop()
        with self._guard:
            if self._loop is not None and self._loop is not loop and (self._calls or self._busy()):
                raise RuntimeError(
                    f"this {self._what} is in use on another event loop (its work in flight runs "
                    "there); use one per event loop (thread), or wait until its work is over"
                )
            self._loop = loop
            self._calls += calls


def pending(tasks: Iterable[asyncio.Future[Any]]) -> bool:
    """Whether any of ``tasks`` is not over (read from any thread)."""
    return any(not t.done() for t in list(tasks))


def _resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        if isinstance(exc, asyncio.CancelledError):
            fut.cancel()
        else:
            fut.set_exception(exc)


class _Slot:
    """One save's place among ``max_in_flight``: released once, by whoever comes first."""

    def __init__(self, slots: asyncio.Semaphore) -> None:
        self._slots: asyncio.Semaphore | None = slots

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.release()


@dataclass(frozen=True)
class _Target:
    """Where a save goes: its directories, and the ranks that write it."""

    paths: list[str]
    coord: Coordinator | None
    replicated: bool | Callable[[str], bool] | None


class Checkpointer:
    """Long-lived saver: keeps the ring, the staging pool and the snapshot memory between
    saves (and the file plan, while the state's structure stays the same). Use from one
    event loop; `aclose` when done (or ``async with``). Synchronous training loops use
    `BlockingCheckpointer`."""

    def __init__(
        self,
        *,
        backend: str = "auto",
        staging_bytes: int | None = None,
        queue_depth: int | None = None,
        mode: Mode = "fence",
        snapshot_bytes: int | None = None,
        max_in_flight: int = 1,
        on_busy: OnBusy = "wait",
        max_shard_bytes: int | None = None,
    ) -> None:
        if mode not in ("fence", "snapshot"):
            raise ValueError(f"mode must be 'fence' or 'snapshot', got {mode!r}")
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        chunk = _knobs.chunk_bytes()
        count = _knobs.staging_buffers() if staging_bytes is None else max(2, staging_bytes // chunk)
        self.mode: Mode = mode
        self.on_busy: OnBusy = on_busy
        self.max_in_flight = max_in_flight
        self.snapshot_bytes = snapshot_bytes if snapshot_bytes is not None else _knobs.snapshot_bytes()
        self._backend_name = backend
        self._queue_depth = queue_depth
        self._max_shard = max_shard_bytes or _knobs.shard_bytes()
        self.pool = StagingPool(chunk, count)
        self._backend: IOBackend | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Future[None]] = set()  # the saves and the deletions
        self._deletions: set[asyncio.Future[None]] = set()
        self._handles: list[SaveHandle] = []
        # Snapshot memory, one area per save in flight, reused: a save takes a free area
        # and gives it back once its write is over, never while it is being written from.
        self._snapshots: list[AlignedBuffer] = []
        self._closed = False
        self._closing = OneClose()
        self._loop = OwnLoop("Checkpointer", lambda: pending(self._tasks))
        self._released = False

    # -- the API ---------------------------------------------------------------------------

    @maps_os_errors("Checkpointer.save")
    async def _fail_in_turn(self, coord: Coordinator | None, path: str, error: BaseException) -> NoReturn:
        """`fail_together` for a save that holds no slot, in its turn: once the saves in
        flight are over (their exchanges come first)."""
        if coord is not None and self._slots is not None:
            async with self._slots:
                await fail_together(coord, path, error)
        await fail_together(coord, path, error)

    async def save(
        self,
        state: object,
        path: PathArg,
        *,
        metadata: Mapping[str, str] | None = None,
        overwrite: bool = False,
        allow_pickle: bool = False,
        replicated: bool | Callable[[str], bool] | None = None,
        group: Any = None,
        extra_files: ExtraFiles | None = None,
        cuda_ready: CudaReady | None = None,
    ) -> SaveHandle:
        """Start saving ``state`` to ``path``; returns once the save is planned and started.

        Until ``handle.staged`` resolves, the caller must not mutate the saved tensors
        (``mode="fence"``); in snapshot mode it resolves as soon as the copy is taken.
        ``path`` may list several directories, and under ``torch.distributed`` every rank
        calls `save`, as for [`aiopersist.save`][aiopersist.save] (``replicated``,
        ``group``); ``staged`` then means this rank's bytes are out of its tensors.
        ``extra_files`` as for `aiopersist.save`: a `TorchSave` in it counts for ``staged``
        (fence mode) or is copied with the state (snapshot mode).

        CUDA tensors are read as they are at this call on the caller's current stream of
        their device: an event is recorded there, and the copies out of the tensors wait
        for it on the GPU (not for the work queued after it). ``cuda_ready`` gives those
        events instead (device index -> ``torch.cuda.Event``), for a state produced on
        other streams; devices it leaves out get an event here.
        """
        with self._loop.call():
            return await self._save(
                state,
                path,
                metadata=metadata,
                overwrite=overwrite,
                allow_pickle=allow_pickle,
                replicated=replicated,
                group=group,
                extra_files=extra_files,
                cuda_ready=cuda_ready,
            )

    async def _save(
        self,
        state: object,
        path: PathArg,
        *,
        metadata: Mapping[str, str] | None,
        overwrite: bool,
        allow_pickle: bool,
        replicated: bool | Callable[[str], bool] | None,
        group: Any,
        extra_files: ExtraFiles | None,
        cuda_ready: CudaReady | None,
    ) -> SaveHandle:
        # A failure of this rank before its first exchange is told to the others there
        # (fail_together), rather than leave them waiting.
        coord = coordinator(group)
        try:
            if self._closed:
                raise ClosedError("the Checkpointer is closed")
            paths = checkpoint_paths(path)
            if coord is not None and self.max_in_flight > 1:
                raise ValueError(
                    "max_in_flight > 1 with several ranks: saves would exchange metadata in an order "
                    "that may differ between ranks; use max_in_flight=1"
                )
            if coord is not None and self.on_busy == "skip":
                raise ValueError(
                    "on_busy='skip' with several ranks: each rank would decide alone, so one could skip "
                    "a save another one runs; use on_busy='wait'"
                )
        except Exception as exc:
            await self._fail_in_turn(coord, given_path(path), exc)
        loop = asyncio.get_running_loop()
        start = loop.time()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        target = paths[0]
        if self._slots.locked() and self.on_busy == "skip":
            log.info("aiopersist: a save is still running; skipping the save to %s", target)
            handle = SaveHandle(target, loop.create_future(), loop.create_future(), skipped=True)
            _resolve(handle._staged, None)
            _resolve(handle._done, None)
            return handle
        try:
            await self._slots.acquire()
        except asyncio.CancelledError as exc:  # told to the others, as a failure would be
            await self._fail_in_turn(coord, target, exc)
        slot = _Slot(self._slots)
        try:
            if self._closed:
                raise ClosedError("the Checkpointer was closed while this save waited for a slot")
            if self._backend is None:
                self._backend = create_backend(self._backend_name, queue_depth=self._queue_depth)
            await check_save_arguments(
                metadata, extra_files, paths, coord.world_size if coord is not None else 1
            )
            where = _Target(paths, coord, replicated)
            flat = await flatten_off_loop(state, allow_pickle, coord)
            if extra_files is not None and any(isinstance(c, TorchSave) for c in extra_files.values()):
                extra_files = await asyncio.to_thread(captured_extra_files, extra_files)
            handle = SaveHandle(target, loop.create_future(), loop.create_future())
            # The TorchSave objects' tensors are looked for only when something needs them.
            snapshot = self.mode == "snapshot" and isinstance(flat, Flattened)
            extras = _extra_tensors(extra_files) if snapshot or torch.cuda.is_available() else _NO_EXTRAS
            total = self._check_budget(flat, extras) if isinstance(flat, Flattened) and snapshot else 0
            ready = _cuda_ready(flat, extras, cuda_ready)
        except FAILURES as exc:  # a cancellation too: told to the others, then raised
            try:
                await fail_together(coord, target, exc)  # under the slot: in this save's turn
            finally:
                slot.release()
        except BaseException:
            slot.release()
            raise

        def staged_at(fut: asyncio.Future[None]) -> None:
            if not fut.cancelled() and fut.exception() is None:
                handle.staged_seconds = loop.time() - start

        handle._staged.add_done_callback(staged_at)
        task = asyncio.ensure_future(
            self._run(handle, slot, flat, metadata, overwrite, where, extra_files, ready, extras, total)
        )
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._finished(t, handle, slot))
        self._handles = [h for h in self._handles if not h._done.done()] + [handle]
        handle.blocked_seconds = loop.time() - start
        return handle

    async def fence(self) -> None:
        """Wait until every save in flight is staged (the tensors may be mutated again)."""
        self._loop.check()
        for handle in list(self._handles):
            await asyncio.wait([handle._staged])

    async def wait(self) -> None:
        """Wait until every save in flight is durable (errors stay on their handles), and
        the deletions of the checkpoints they replaced are over. Saves started meanwhile
        are not waited for."""
        self._loop.check()
        saves = [t for t in self._tasks if t not in self._deletions]
        if saves:
            await asyncio.wait(saves)
        if self._deletions:  # those the saves above scheduled as they ended, and older ones
            await asyncio.wait(list(self._deletions))

    @maps_os_errors("Checkpointer.aclose")
    async def aclose(self) -> None:
        """Let the saves in flight finish, then release the ring, the pool and the snapshot.

        If the caller is cancelled meanwhile, the saves in flight are cancelled (none
        leaves a final directory) and waited for before anything is released. A second
        ``aclose`` while the first runs waits for it."""
        self._loop.check()
        if not self._closing.begin():
            await self._closing.wait()
            return
        self._closed = True
        try:
            try:
                await self.wait()
            except BaseException:
                await self._cancel_all()
                raise
        finally:
            try:
                await self._release()
            finally:
                self._closing.end()

    async def _abort(self) -> None:
        """Close now: cancel the saves in flight (none leaves a final directory), wait for
        them to end, release everything."""
        self._closing.begin()
        self._closed = True
        try:
            await self._cancel_all()
        finally:
            try:
                await self._release()
            finally:
                self._closing.end()

    async def _cancel_all(self) -> None:
        # The tasks not done yet: a done one leaves ``_tasks`` only when its done callback
        # runs, on a later turn of the loop. Waiting for ``_tasks`` to empty, a caller
        # cancelled at every await (an anyio cancel scope) never let the loop turn again.
        while pending := [t for t in self._tasks if not t.done()]:
            for task in pending:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # cancelled again: wait on
                await settle(pending)

    async def _release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            if self._backend is not None:
                await self._backend.aclose()
        finally:
            self.pool.close()
            snapshots, self._snapshots = self._snapshots, []
            if snapshots:  # unmapping gigabytes takes a while: in a worker thread
                await asyncio.to_thread(_close_all, snapshots)

    async def __aenter__(self) -> Checkpointer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the work --------------------------------------------------------------------------

    async def _run(
        self,
        handle: SaveHandle,
        slot: _Slot,
        flat: Flattened | Exception,
        metadata: Mapping[str, str] | None,
        overwrite: bool,
        where: _Target,
        extra_files: ExtraFiles | None,
        ready: CudaReady,
        extras: _ExtraTensors,
        snapshot_total: int,
    ) -> None:
        """``snapshot_total``: the snapshot's size (snapshot mode; the copy is the first step)."""
        assert self._backend is not None
        use_cuda_ready(ready)  # for this task, the tasks and the threads it starts
        replaced: list[str] = []  # filled from the publishing thread; list.append is atomic
        memory: AlignedBuffer | None = None
        try:
            if self.mode == "snapshot" and isinstance(flat, Flattened):
                try:
                    memory, stale = self._snapshot_memory(snapshot_total)
                    if stale is not None:
                        _close_off_loop(stale)
                    if memory is None:  # a new area: mapped in a worker thread
                        memory = await to_thread_to_the_end(
                            AlignedBuffer, max(snapshot_total, 1), discard=_close_off_loop
                        )
                    flat, extra_files = await _take_snapshot(
                        flat,
                        extra_files,
                        extras,
                        memory,
                        self.snapshot_bytes - snapshot_total,
                        self.snapshot_bytes,
                    )
                except Exception as exc:
                    if where.coord is None:
                        raise
                    flat = exc  # the other ranks hear of it at the first exchange, as of a flattening's
                else:
                    _resolve(handle._staged, None)
            info = await save_state(
                self._backend,
                self.pool,
                flat,
                where.paths,
                where.coord,
                replicated=where.replicated,
                metadata=metadata,
                overwrite=overwrite,
                max_shard_bytes=self._max_shard,
                staged=lambda: _resolve(handle._staged, None),
                discard=replaced.append,
                extra_files=extra_files,
            )
        except BaseException as exc:
            error: BaseException | None = typed_error(exc, "save")  # typed on the handle, like save()'s
        else:
            error = None
        finally:
            # Everything the save held is given back before `done` resolves, so a caller
            # that awaited `done` finds the slot free (on_busy="skip" does not skip).
            if memory is not None:
                if self._closed:
                    _close_off_loop(memory)
                else:
                    self._snapshots.append(memory)
            slot.release()
            if replaced:
                # The checkpoint this one replaced is deleted after `done`, off its clock.
                self._cleanup(replaced)
        if error is None:
            _resolve(handle._staged, None)
            _resolve(handle._done, info)
            return
        _fail(handle._staged, error)
        _fail(handle._done, error)
        # The error is the caller's, on the handle; seen here so asyncio does not log it.
        for fut in (handle._staged, handle._done):
            if fut.done() and not fut.cancelled():
                fut.exception()
        if not isinstance(error, Exception):
            raise error

    def _cleanup(self, paths: list[str]) -> None:
        task = asyncio.ensure_future(asyncio.to_thread(_delete_all, paths))
        self._tasks.add(task)
        self._deletions.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._deletions.discard)

    def _finished(self, task: asyncio.Future[None], handle: SaveHandle, slot: _Slot) -> None:
        # Runs however the task ended, also when it was cancelled before it ever started
        # (then _run's own handlers never ran): the slot and the handle are settled here.
        self._tasks.discard(task)
        slot.release()
        if task.cancelled():
            _fail(handle._staged, asyncio.CancelledError())
            _fail(handle._done, asyncio.CancelledError())

    def _check_budget(self, flat: Flattened, extras: _ExtraTensors) -> int:
        """The snapshot's size; `SnapshotBudgetError` if it is over ``snapshot_bytes``."""
        total = sum(_padded(s.nbytes) for s in flat.stored)
        total += sum(_padded(_nbytes(t)) for t in extras.tensors)
        if total > self.snapshot_bytes:
            raise SnapshotBudgetError(
                f"snapshot mode: the state's tensors (with those of the TorchSave extra files) take "
                f"{total} bytes, more than "
                f"snapshot_bytes={self.snapshot_bytes}; raise the budget or use mode='fence'"
            )
        return total

    def _snapshot_memory(self, total: int) -> tuple[AlignedBuffer | None, AlignedBuffer | None]:
        """A free snapshot area of at least ``total`` bytes (the largest free one if it is
        big enough; ``None``: map a new one), and a free one too small, to unmap. Both
        mapping and unmapping take long for large areas: the caller does them off the loop."""
        self._snapshots.sort(key=lambda m: m.size)
        if self._snapshots and self._snapshots[-1].size >= total:
            return self._snapshots.pop(), None
        return None, self._snapshots.pop(0) if self._snapshots else None


def _cuda_ready(flat: Flattened | Exception, extras: _ExtraTensors, given: CudaReady | None) -> CudaReady:
    """The ready event of every CUDA device the save reads from: ``given``'s, else one
    recorded now on the caller's current stream of the device."""
    ready = dict(given or {})
    if not torch.cuda.is_available():
        return ready
    devices: set[int] = set()
    if isinstance(flat, Flattened):
        devices.update(s.source.device.index for s in flat.stored if s.source.is_cuda)
    devices.update(t.device.index for t in extras.tensors if t.is_cuda)
    if extras.whole and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        devices.add(torch.cuda.current_device())  # whole objects: their devices are not known
    ready.update(record_cuda_ready(sorted(devices - ready.keys())))
    return ready


def _close_all(areas: Sequence[AlignedBuffer]) -> None:
    for area in areas:
        area.close()


def _close_off_loop(area: AlignedBuffer) -> None:
    """Unmap a snapshot area no one uses any more, in a worker thread (unmapping a
    large one takes a while); inline when no loop runs."""
    try:
        asyncio.get_running_loop().run_in_executor(None, area.close)
    except RuntimeError:  # no running loop, or its executor is shut down
        area.close()


def _padded(n: int) -> int:
    return -(-n // 64) * 64  # every copy starts 64-byte aligned


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def rebuildable(
    obj: object, found: dict[int, torch.Tensor] | None = None, seen: set[int] | None = None, depth: int = 0
) -> bool:
    """Whether `_with_copies` can rebuild ``obj`` with copies of all its tensors: a tree
    (no container reached twice) of dicts, lists, tuples and namedtuples, keyed by plain
    values, over plain values and dense tensors (as an optimizer's or a scheduler's state
    dict is). Anything else may hide tensors, or lose what it is on a rebuild. The tensors
    met on the way are put in ``found`` (by ``id``)."""
    if isinstance(obj, _PLAIN):
        return True
    if isinstance(obj, torch.Tensor):
        if found is not None:
            found.setdefault(id(obj), obj)
        return (
            type(obj) in (torch.Tensor, torch.nn.Parameter)
            and obj.layout == torch.strided
            and not obj.is_quantized
        )
    seen = set() if seen is None else seen
    if id(obj) in seen or depth >= MAX_CONTAINER_DEPTH:
        return False  # shared or cyclic (a rebuild would split or never end), or absurdly deep
    seen.add(id(obj))
    if type(obj) in (dict, collections.OrderedDict, collections.defaultdict):
        items = cast(dict[object, object], obj).items()
        return all(isinstance(k, _PLAIN) and rebuildable(v, found, seen, depth + 1) for k, v in items)
    if type(obj) in (list, tuple) or (isinstance(obj, tuple) and _is_namedtuple(type(obj))):
        return all(rebuildable(v, found, seen, depth + 1) for v in cast(Sequence[object], obj))
    return False


def _is_namedtuple(cls: type) -> bool:
    """A class made by ``collections.namedtuple`` or ``typing.NamedTuple`` (no state of its
    own beyond its fields)."""
    return tuple in cls.__bases__ and hasattr(cls, "_fields") and "__dict__" not in dir(cls)


@dataclass(frozen=True)
class _ExtraTensors:
    """The `TorchSave` and `SafetensorsSave` extra files as snapshot mode and the CUDA
    events see them."""

    tensors: list[torch.Tensor]
    """The tensors of the rebuildable ones, each once: copied one by one."""
    whole: list[str]
    """The names of the others: serialized whole."""


_NO_EXTRAS = _ExtraTensors([], [])


def _extra_tensors(extra_files: ExtraFiles | None) -> _ExtraTensors:
    found: dict[int, torch.Tensor] = {}
    whole: list[str] = []
    for name, content in (extra_files or {}).items():
        if isinstance(content, SafetensorsSave):
            for t in content.tensors.values():
                found.setdefault(id(t), t)
        elif isinstance(content, TorchSave):
            mine: dict[int, torch.Tensor] = {}
            if rebuildable(content.obj, mine):
                for key, t in mine.items():
                    found.setdefault(key, t)
            else:
                whole.append(name)
    return _ExtraTensors(list(found.values()), whole)


class _BoundedSink(io.BytesIO):
    """What ``torch.save`` writes a snapshot into: memory, up to ``limit`` bytes."""

    def __init__(self, name: str, limit: int, budget: int) -> None:
        super().__init__()
        self.over: SnapshotBudgetError | None = None
        """Set when the limit was hit (torch.save reports a failed write as its own error)."""
        self._name = name
        self._limit = limit  # what the tensors and the other whole ones left of ``budget``
        self._budget = budget

    @property
    def error(self) -> SnapshotBudgetError | None:
        """Why a write failed, for `torch_save_to`."""
        return self.over

    def write(self, data: Any, /) -> int:
        with memoryview(data) as view:
            if self.tell() + view.nbytes > self._limit:
                self.over = SnapshotBudgetError(
                    f"snapshot mode: the TorchSave extra file {self._name!r} (serialized whole: it "
                    f"holds objects other than dicts, lists and tuples) does not fit in what is "
                    f"left of snapshot_bytes={self._budget}; raise the budget or use mode='fence'"
                )
                raise self.over
            return super().write(view)


def _with_copies(obj: Any, copies: Mapping[int, torch.Tensor]) -> Any:
    """``obj`` rebuilt with every tensor in ``copies`` (by ``id``) replaced by its copy."""
    if isinstance(obj, torch.Tensor):
        return copies.get(id(obj), obj)
    if isinstance(obj, dict):
        new = copy.copy(obj)  # keeps the type: OrderedDict, defaultdict's factory
        for k, v in obj.items():
            new[k] = _with_copies(v, copies)
        return new
    if isinstance(obj, list):
        return [_with_copies(v, copies) for v in obj]
    if type(obj) is tuple:
        return tuple(_with_copies(v, copies) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_with_copies(v, copies) for v in obj))
    return obj


def captured_extra_files(extra_files: ExtraFiles) -> ExtraFiles:
    """``extra_files`` with the containers of each `TorchSave` that `rebuildable` takes
    copied (`_with_copies`, no tensor copied): what it holds besides tensor data (a step
    count in a dict, a list appended to, an optimizer's per-parameter ``int`` step) is
    what it was at the save, as for the state's own skeleton, while its tensors are read
    until ``staged`` (fence mode) or copied (snapshot mode). One that holds other objects
    is pickled while the file is written, as it is then."""
    return {
        name: TorchSave(_with_copies(c.obj, {})) if isinstance(c, TorchSave) and rebuildable(c.obj) else c
        for name, c in extra_files.items()
    }


async def _take_snapshot(
    flat: Flattened,
    extra_files: ExtraFiles | None,
    extras: _ExtraTensors,
    memory: AlignedBuffer,
    left: int,
    budget: int,
) -> tuple[Flattened, ExtraFiles | None]:
    """Copy every stored tensor, and every tensor of the `TorchSave` extra files, into
    ``memory`` (in a thread: the copies do not hold the GIL); return the state and the
    extra files pointing at the copies. A `TorchSave` that `_with_copies` cannot rebuild
    is serialized whole into at most ``left`` bytes instead (in the same thread)."""
    jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
    pos = 0

    def place(src: torch.Tensor, nbytes: int) -> torch.Tensor:
        nonlocal pos
        dst = torch.frombuffer(memory.view, dtype=torch.uint8, count=nbytes, offset=pos)
        pos += _padded(nbytes)
        typed = dst.view(src.dtype).view(src.shape)
        jobs.append((typed, src))
        return typed

    stored: list[StoredTensor] = []
    copies: dict[int, torch.Tensor] = {}
    whole = {name: cast(TorchSave, (extra_files or {})[name]).obj for name in extras.whole}
    sinks: dict[str, _BoundedSink] = {}
    rebuilt: dict[str, bytes | TorchSave | SafetensorsSave] = {}

    def copy_and_serialize() -> None:
        # The copies' views, one per tensor (tens of thousands for a large state), are
        # made here too: not on the event loop.
        stored.extend(
            StoredTensor(s.name, place(s.source, s.nbytes), s.align) if s.nbytes else s for s in flat.stored
        )
        for t in extras.tensors:
            if _nbytes(t):
                c = place(t.detach(), _nbytes(t))
                param = isinstance(t, torch.nn.Parameter)
                copies[id(t)] = torch.nn.Parameter(c, t.requires_grad) if param else c
        # Copies out of the GPU go into page-locked memory: at the link's speed, and all
        # queued at once (the snapshot area is registered once, and reused by later saves).
        pinned = any(src.is_cuda for _, src in jobs) and memory.pin_for_cuda()
        with cuda_ready_streams():  # the GPU tensors' copies run on this thread's streams
            _copy_all(jobs, pinned)
            remaining = left
            for name, obj in whole.items():
                sinks[name] = sink = _BoundedSink(name, remaining, budget)
                torch_save_to(obj, sink, name)
                remaining -= sink.tell()
        if extra_files is not None and (copies or sinks):  # rebuilt around the copies
            rebuilt.update(
                (
                    name,
                    cast(bytes, sinks[name].getbuffer())  # written from the sink's memory, not copied
                    if name in sinks
                    else TorchSave(_with_copies(c.obj, copies))
                    if isinstance(c, TorchSave)
                    else SafetensorsSave({k: copies.get(id(t), t) for k, t in c.tensors.items()}, c.metadata)
                    if isinstance(c, SafetensorsSave)
                    else c,
                )
                for name, c in extra_files.items()
            )

    thread = asyncio.ensure_future(asyncio.to_thread(copy_and_serialize))
    try:
        await asyncio.shield(thread)
    except asyncio.CancelledError:
        # The thread cannot be stopped: it writes into ``memory`` until it ends, so the
        # memory is neither reused nor unmapped before then.
        await settle([thread])
        raise
    return (
        Flattened(
            flat.skeleton,
            stored,
            flat.aliases,
            flat.views,
            flat.pickled,
            flat.pickled_paths,
            model_only=flat.model_only,
        ),
        rebuilt or extra_files,
    )


def _copy_all(jobs: list[tuple[torch.Tensor, torch.Tensor]], pinned: bool = False) -> None:
    """Copy each source into its destination. With ``pinned`` destinations, the copies out
    of GPUs are queued without waiting on the current streams, then waited for together."""
    devices: set[torch.device] = set()
    for dst, src in jobs:
        if src.device.type == "cpu" and src.is_contiguous() and not (src.is_conj() or src.is_neg()):
            copy_bytes(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
        elif src.is_cuda and pinned:
            dst.copy_(src, non_blocking=True)
            devices.add(src.device)
        else:
            dst.copy_(src)  # strided or on a GPU: torch does the gather or the transfer
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def _delete_all(paths: list[str]) -> None:
    for path in paths:
        remove_path(path)
