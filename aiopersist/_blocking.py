"""The synchronous twins: `save_sync`, `load_sync`, and `BlockingCheckpointer`, the
`Checkpointer` for synchronous training loops.

The event loop runs in a background thread (an anyio blocking portal); the calls here
hand work to it and wait. The training thread keeps the GIL almost all the time: the
writer's Python work is per 4 MiB chunk, and its copies and checksums run in C with the
GIL released.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Self, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from . import _knobs
from ._checkpointer import Checkpointer, Mode, OnBusy, SaveHandle
from ._exceptions import ClosedError
from ._load import load
from ._locate import PathArg
from ._manager import CheckpointManager, ManagedSaveHandle
from ._retention import Retention
from ._save import ExtraFiles, SaveInfo, save
from ._stream import CudaReady, caller_cuda_ready
from ._workers import DaemonThreadPool, exit_wait_left

log = logging.getLogger("aiopersist")
T = TypeVar("T")


LOOP_WORKERS = 8
"""Threads of the default executor of each event loop aiopersist runs itself."""


def run_loop(coro: Coroutine[Any, Any, T], name: str = "aiopersist") -> T:
    """``asyncio.run(coro)``, on a loop whose default executor (``asyncio.to_thread``) is a
    `DaemonThreadPool` of its own. asyncio's default, a ``ThreadPoolExecutor``, refuses new
    work once the interpreter has begun to exit (``concurrent.futures`` sets that before
    the interpreter joins the threads still running), so a save finishing then (in DCP's
    upload thread after the program's last line, or in an exit hook) would fail halfway
    and be lost. As ``asyncio.run``, a first Ctrl-C in the main thread cancels the work
    (which cleans up after itself), then raises ``KeyboardInterrupt``; at the end the tasks
    left are cancelled and waited for, their errors reported; the executor is then shut
    down without waiting (a thread still at work stays with its daemon thread, and no
    thread is started: ``asyncio.run`` starts one to join the executor, which Python
    3.12.0 and 3.12.1 refuse during the interpreter's exit)."""
    loop = asyncio.new_event_loop()
    loop.set_default_executor(DaemonThreadPool(LOOP_WORKERS, f"{name}-worker"))
    main = loop.create_task(coro)
    interrupts = 0
    previous: Any = None
    if threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        # As asyncio.run: the first Ctrl-C cancels the work (a save cleans up after itself,
        # through its cancellation), then KeyboardInterrupt is raised; a second one at once.
        def on_sigint(signum: int, frame: Any) -> None:
            nonlocal interrupts
            interrupts += 1
            if interrupts == 1 and not main.done():
                main.cancel()
                loop.call_soon_threadsafe(lambda: None)
                return
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        try:
            return loop.run_until_complete(main)
        except asyncio.CancelledError:
            if interrupts and main.uncancel() == 0:
                raise KeyboardInterrupt from None
            raise
    finally:
        try:
            if previous is not None and signal.getsignal(signal.SIGINT) is on_sigint:
                signal.signal(signal.SIGINT, previous)
            _cancel_the_rest(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()  # shuts the default executor down, without waiting


def _cancel_the_rest(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks left on ``loop`` and wait for them; their errors are reported to
    the loop's exception handler, as ``asyncio.run`` reports them."""
    left = asyncio.all_tasks(loop)
    for task in left:
        task.cancel()
    if not left:
        return
    loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    for task in left:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception while aiopersist's loop was shutting down",
                    "exception": task.exception(),
                    "task": task,
                }
            )


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_loop(coro)
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


async def _await(fut: Any) -> Any:
    # Shielded: a wait interrupted (Ctrl-C, the portal's cancel scope) never cancels the
    # save's own future.
    return await asyncio.shield(fut)


def _call(portal: BlockingPortal, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``portal.call(fn, *args)`` for the facades, as their async twins behave under
    ``asyncio.run``: a wait interrupted in this thread (Ctrl-C) cancels the call and
    gives it `_EXIT_CANCEL_SECONDS` to end (its own cleanup: a cancelled save removes
    what it wrote, a cancelled ``restore(into=...)`` ends its copy into the target)
    before the interruption goes on; the call went on in the background while the
    caller's handler ran. A portal that has stopped (the facade closed) raises
    `ClosedError`, not anyio's ``RuntimeError``."""
    finished = threading.Event()

    async def run() -> T:
        try:
            return await fn(*args)
        finally:
            finished.set()

    try:
        fut = portal.start_task_soon(run)
    except RuntimeError as exc:
        if "not running" not in str(exc):  # anyio's words for a portal that has stopped
            raise
        raise ClosedError("closed: its event loop has stopped") from exc
    try:
        return fut.result()
    except BaseException:
        if not fut.done():  # interrupted here, not the call's own error
            fut.cancel()
            finished.wait(_EXIT_CANCEL_SECONDS)
        raise


def _outcome(portal: BlockingPortal, fut: asyncio.Future[T]) -> T:
    """What ``fut`` (settled on the loop) gives: read here once it is settled (a save
    handle after its facade was closed: the loop is gone, the outcome is not), else
    waited for on the loop."""
    if fut.cancelled():  # asyncio's CancelledError is a BaseException: not in sync code
        raise concurrent.futures.CancelledError("the save was cancelled (its facade closed while it ran)")
    if fut.done():
        return fut.result()
    result: T = _call(portal, _await, fut)
    return result


class BlockingSaveHandle:
    """A save in progress, seen from a synchronous thread."""

    def __init__(self, portal: BlockingPortal, handle: SaveHandle) -> None:
        self._portal = portal
        self.handle = handle

    @property
    def path(self) -> str:
        return self.handle.path

    @property
    def skipped(self) -> bool:
        return self.handle.skipped

    @property
    def blocked_seconds(self) -> float:
        """Time the event loop spent starting the save (see `SaveHandle`)."""
        return self.handle.blocked_seconds

    @property
    def staged_seconds(self) -> float | None:
        """As `SaveHandle.staged_seconds`: from the save call until the tensors were free."""
        return self.handle.staged_seconds

    def wait_staged(self) -> None:
        """Block until the saved tensors may be mutated again (the fence)."""
        _outcome(self._portal, self.handle._staged)

    def wait(self) -> SaveInfo | None:
        """Block until the checkpoint is durable; its `SaveInfo` (``None`` if skipped)."""
        result: SaveInfo | None = _outcome(self._portal, self.handle._done)
        return result

    def staged(self) -> bool:
        """Whether the fence has passed (without waiting)."""
        return self.handle._staged.done()

    def done(self) -> bool:
        """Whether the save is over, durable or failed (without waiting)."""
        return self.handle._done.done()


class _LoopThread:
    """An asyncio event loop in a daemon thread, driven through an anyio blocking portal.

    Daemon, with a daemon default executor (`DaemonThreadPool`): neither keeps the
    interpreter alive. A facade still open when the interpreter exits is closed by
    `_close_open_facades`, before anything is torn down.
    """

    def __init__(self, name: str) -> None:
        ready: concurrent.futures.Future[tuple[BlockingPortal, asyncio.AbstractEventLoop]]
        ready = concurrent.futures.Future()

        async def serve() -> None:
            loop = asyncio.get_running_loop()
            loop.set_default_executor(DaemonThreadPool(LOOP_WORKERS, f"{name}-worker"))
            async with BlockingPortal() as portal:
                ready.set_result((portal, loop))
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(serve)
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()
        self.portal, self.loop = ready.result()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop (cancelling what still runs on it) and wait for its thread."""
        try:
            self.portal.start_task_soon(self.portal.stop, True).result(timeout)
        except (RuntimeError, concurrent.futures.TimeoutError):
            return  # already stopped, or wedged: a daemon thread, left to the exit
        self.thread.join(timeout)


_open_facades: set[_OnPortal] = set()
_exit_hook_lock = threading.Lock()
_exit_hook_registered = False


def _register_exit_hook() -> None:
    """Close the open facades at interpreter exit, before threads are joined and modules
    torn down (``threading._register_atexit``, which runs then, where available)."""
    global _exit_hook_registered
    with _exit_hook_lock:
        if _exit_hook_registered:
            return
        _exit_hook_registered = True
    import concurrent.futures.thread  # noqa: F401  its exit hook registered first, so it runs after ours

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_close_open_facades)
            return
        except RuntimeError:  # the interpreter is already shutting down
            pass
    atexit.register(_close_open_facades)


def _forget_facades_in_child() -> None:
    """In a forked child the parent's facades are the parent's: their event-loop threads
    do not exist here, and closing them at exit would wait out the exit grace for
    nothing."""
    _open_facades.clear()


os.register_at_fork(after_in_child=_forget_facades_in_child)


def _close_open_facades() -> None:
    for facade in list(_open_facades):
        facade._close_at_exit(_knobs.exit_grace(), interpreter_exit=True)


class _OnPortal:
    """An async object driven from synchronous code: it lives on an event loop in a
    background daemon thread from `_start` until `close`."""

    _portal: BlockingPortal
    _closed = True
    _closing_thread: threading.Thread | None = None

    def _start(self, make: Callable[[], Awaitable[Any]]) -> Any:
        _register_exit_hook()
        self._closed_over = threading.Event()
        """Set once the first close (or the exit's) has ended: a close from another
        thread meanwhile waits for it."""
        self._loop_thread = _LoopThread(f"aiopersist-{type(self).__name__}")
        self._portal = self._loop_thread.portal
        try:
            made = self._portal.call(make)
        except BaseException:
            self._loop_thread.stop()
            raise
        self._closed = False
        _open_facades.add(self)
        return made

    def _aclose(self) -> Awaitable[None]:
        raise NotImplementedError

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`_call` on this facade's loop; `ClosedError` once it is closed."""
        if self._closed:
            raise ClosedError(f"the {type(self).__name__} is closed")
        return _call(self._portal, fn, *args)

    def _wait_closed(self) -> None:
        """A close made while another runs (in another thread) waits for it: returning at
        once would tell its caller that the saves in flight were durable."""
        over = getattr(self, "_closed_over", None)
        here = threading.current_thread()
        # Not on the loop's thread, nor on the thread of the close that runs (a signal
        # handler's close on top of it): either would wait for itself.
        if over is not None and here not in (self._loop_thread.thread, self._closing_thread):
            over.wait()

    def close(self) -> None:
        """Finish what is in flight, release everything, stop the background loop. A
        second ``close`` while the first runs waits for it."""
        if self._closed:
            self._wait_closed()
            return
        self._closed = True
        self._closing_thread = threading.current_thread()
        _open_facades.discard(self)
        try:
            self._portal.call(self._aclose)
        except BaseException:
            # Interrupted (Ctrl-C while waiting): the loop cancels what is in flight, and
            # gets a bounded time for it; what still runs then is left to its daemon thread.
            self._loop_thread.stop(timeout=_EXIT_CANCEL_SECONDS)
            raise
        finally:
            self._closed_over.set()
        self._loop_thread.stop()

    def _close_at_exit(self, grace: float, *, interpreter_exit: bool = False) -> None:
        """At interpreter exit: give the saves in flight ``grace`` seconds to finish, then
        cancel them (a cancelled save removes what it wrote) and give that a few seconds
        (`_EXIT_CANCEL_SECONDS`; at the interpreter's exit, what is left of the exit's one
        wait for aiopersist's work, `_workers.exit_wait_left`, which the threads' wait
        shares). Never raises, and never waits much longer than ``grace``: the process
        must end. What is still running then is abandoned with the loop's daemon thread;
        it has published nothing, and the next start removes what it left."""
        if self._closed:
            return
        self._closed = True
        self._closing_thread = threading.current_thread()
        _open_facades.discard(self)
        try:
            self._end_at_exit(grace, interpreter_exit)
        finally:
            self._closed_over.set()

    def _end_at_exit(self, grace: float, interpreter_exit: bool) -> None:
        finished = threading.Event()

        async def close() -> None:
            try:
                await self._aclose()
            finally:
                finished.set()

        # A plain asyncio task, cancelled once (not through the portal, whose cancel scopes
        # would cancel it again at every await of the saves' cleanup).
        closing = asyncio.run_coroutine_threadsafe(close(), self._loop_thread.loop)
        try:
            if not finished.wait(grace):
                log.warning(
                    "aiopersist: exiting with work still in flight after %g s (AIOPERSIST_EXIT_GRACE: "
                    "a save, or a manager's retention and mirroring): cancelled; a cancelled save "
                    "publishes nothing, and what it wrote is removed now or by the next start",
                    grace,
                )
                closing.cancel()
                finished.wait(exit_wait_left() if interpreter_exit else _EXIT_CANCEL_SECONDS)
        except BaseException:  # a second Ctrl-C while waiting: exit now
            closing.cancel()
            return
        if not finished.is_set():
            return  # the loop's daemon thread is left to the exit
        try:
            closing.result(timeout=0)
        except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
            pass
        except BaseException as exc:  # the save's own error: the caller never waited for it
            log.warning("aiopersist: a save in flight at exit failed: %s", exc)
        self._loop_thread.stop(timeout=_EXIT_CANCEL_SECONDS)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            # Leaving on an error (an exception, Ctrl-C, sys.exit): as at interpreter exit,
            # the saves in flight get AIOPERSIST_EXIT_GRACE seconds, then are cancelled: a
            # crashed job is not held open by a save stuck on its disk.
            self._close_at_exit(_knobs.exit_grace())


_EXIT_CANCEL_SECONDS = 5.0
"""At exit, how long a cancelled save gets to remove what it wrote."""


class BlockingCheckpointer(_OnPortal):
    """`Checkpointer` with blocking calls; the same arguments. Close it (or use ``with``)."""

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
        self.checkpointer: Checkpointer = self._start(
            functools.partial(
                _make,
                backend=backend,
                staging_bytes=staging_bytes,
                queue_depth=queue_depth,
                mode=mode,
                snapshot_bytes=snapshot_bytes,
                max_in_flight=max_in_flight,
                on_busy=on_busy,
                max_shard_bytes=max_shard_bytes,
            )
        )

    def save(
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
    ) -> BlockingSaveHandle:
        """Start a save; returns once it is planned and started (see `Checkpointer.save`).

        CUDA tensors are read as they are on this thread's current stream of the current
        device at this call (``cuda_ready`` as for `Checkpointer.save`)."""
        ready = caller_cuda_ready() if cuda_ready is None else cuda_ready  # here, not in the loop's thread
        handle = self._call(
            functools.partial(
                self.checkpointer.save,
                state,
                path,
                metadata=metadata,
                overwrite=overwrite,
                allow_pickle=allow_pickle,
                replicated=replicated,
                group=group,
                extra_files=extra_files,
                cuda_ready=ready,
            )
        )
        return BlockingSaveHandle(self._portal, handle)

    def fence(self) -> None:
        """Block until every save in flight is staged."""
        self._call(self.checkpointer.fence)

    def wait(self) -> None:
        """Block until every save in flight is durable."""
        self._call(self.checkpointer.wait)

    def _aclose(self) -> Awaitable[None]:
        return self.checkpointer.aclose()


async def _make(**kwargs: Any) -> Checkpointer:
    return Checkpointer(**kwargs)


class BlockingManagedSaveHandle(BlockingSaveHandle):
    """A `CheckpointManager` save, seen from a synchronous thread."""

    def __init__(self, portal: BlockingPortal, managed: ManagedSaveHandle) -> None:
        super().__init__(portal, managed.handle)
        self.managed = managed

    @property
    def step(self) -> int:
        return self.managed.step

    def wait_mirrored(self) -> str | None:
        """Block until the mirror has the step: its path there (``None`` without a
        mirror); raises why the mirror could not take it."""
        result: str | None = _outcome(self._portal, self.managed._mirrored)
        return result


class BlockingCheckpointManager(_OnPortal):
    """`CheckpointManager` with blocking calls, on an event loop in a background thread;
    the same arguments. Close it (or use ``with``)."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        mirror: str | os.PathLike[str] | None = None,
        mirror_keep_last: int | None = None,
        backend: str = "auto",
        mode: Mode = "fence",
        retention: Retention | None = None,
        mirror_retention: Retention | None = None,
    ) -> None:
        self.manager: CheckpointManager = self._start(
            functools.partial(
                _make_manager,
                directory,
                keep_last=keep_last,
                keep_every=keep_every,
                mirror=mirror,
                mirror_keep_last=mirror_keep_last,
                backend=backend,
                mode=mode,
                retention=retention,
                mirror_retention=mirror_retention,
            )
        )

    def save(
        self,
        step: int,
        state: object,
        *,
        metadata: Mapping[str, str] | None = None,
        overwrite: bool = False,
        replicated: bool | Callable[[str], bool] | None = None,
        group: Any = None,
        cuda_ready: CudaReady | None = None,
    ) -> BlockingManagedSaveHandle:
        """Start saving step ``step``; see `CheckpointManager.save` (CUDA tensors as for
        `BlockingCheckpointer.save`)."""
        ready = caller_cuda_ready() if cuda_ready is None else cuda_ready
        managed = self._call(
            functools.partial(
                self.manager.save,
                step,
                state,
                metadata=metadata,
                overwrite=overwrite,
                replicated=replicated,
                group=group,
                cuda_ready=ready,
            )
        )
        return BlockingManagedSaveHandle(self._portal, managed)

    def steps(self) -> list[int]:
        return self.manager.steps()

    def latest(self) -> int | None:
        return self.manager.latest()

    @property
    def restored_step(self) -> int | None:
        """The step the last `restore` loaded (an older one when the newest was damaged),
        or ``None`` before one."""
        return self.manager.restored_step

    def restore(self, step: int | None = None, *, into: object = None, **kwargs: Any) -> Any:
        """Block while `CheckpointManager.restore` loads the step."""
        return self._call(functools.partial(self.manager.restore, step, into=into, **kwargs))

    def wait(self) -> None:
        """Block until the saves in flight, their retention and mirroring are over."""
        self._call(self.manager.wait)

    def _aclose(self) -> Awaitable[None]:
        return self.manager.aclose()


async def _make_manager(directory: Any, *, backend: str, mode: Mode, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(directory, backend=backend, mode=mode, **kwargs)
