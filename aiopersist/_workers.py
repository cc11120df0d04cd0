"""Worker threads that never hold the interpreter open at exit.

`concurrent.futures.ThreadPoolExecutor` joins its workers when the interpreter exits, so a
worker stuck in a system call (a write to a hung mount, a collective waiting for a rank
that died) keeps a crashed training job alive. aiopersist's own I/O and its facades' event
loops run their work on `DaemonThreadPool` instead: at exit, work still running is
abandoned, which the on-disk protocol is made for (nothing is ever half-published).

Abandoned, but not while they are inside torch: `exit_gate` makes the exit wait (a bounded
time) for the jobs under way and refuses new ones, so that no worker comes back from
torch's C++ code while the interpreter finalizes, which aborts the process.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import gc
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("aiopersist")


class ProcessExitingError(RuntimeError):
    """Work refused because the interpreter is exiting (see `_ExitGate`): what it served
    fails (a save abandoned at exit, an exchange of one)."""


class _ExitGate:
    """The work of aiopersist's own threads (every `DaemonThreadPool` job; the threads of
    `aiopersist._dist` that call the job's store and wait for collectives), counted, so
    that the interpreter's finalization never starts while one is under way.

    Torch runs nearly every call (a tensor's copy, an allocation, a collective, dropping a
    process group or a collective's work) with the GIL released, and takes the GIL back on
    return. A thread that returns once the interpreter is finalizing cannot have it:
    CPython ends the thread where it stands (``pthread_exit``), inside torch's C++ frames,
    and the process aborts ("terminate called without an active exception"). A worker
    copying tensors for a load that a crash abandoned, or a gather timing out just as the
    exit gave up on its save, met that.

    `close` (at exit, after the program's own exit hooks: `close_exit_gate`) refuses new
    work from threads other than the main one, which raises `ProcessExitingError`, and
    waits a bounded time for the work under way. The main thread is never refused: it is
    the one that finalizes. A thread sleeping between two looks at a collective (`sleep`)
    is not at work; it is refused when it wakes."""

    def __init__(self) -> None:
        # Re-entrant: a collection while the lock is held may run a finalizer that shuts a
        # mesh down (`_dist._Mesh.close`) on this same thread.
        self._cond = threading.Condition(threading.RLock())
        self._under_way = 0
        self._deadline: float | None = None
        self._local = threading.local()

    def _enter(self) -> None:
        with self._cond:
            if self._deadline is not None:
                raise ProcessExitingError(
                    "the process is exiting: aiopersist's threads take no more work (one coming back from "
                    "torch during the interpreter's shutdown would abort the process)"
                )
            self._under_way += 1
        self._local.counted = True

    def _leave(self) -> None:
        self._local.counted = False
        with self._cond:
            self._under_way -= 1
            if not self._under_way:
                self._cond.notify_all()

    def holds(self) -> bool:
        """Whether this thread may call into torch now (in a region, or the main thread)."""
        return threading.current_thread() is threading.main_thread() or getattr(self._local, "counted", False)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """A region of work (nested regions count once). Raises `ProcessExitingError` once
        the exit has begun."""
        if threading.current_thread() is threading.main_thread():
            yield
            return
        depth = getattr(self._local, "depth", 0)
        if not depth:
            self._enter()
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if not depth and getattr(self._local, "counted", False):
                self._leave()

    def sleep(self, seconds: float) -> None:
        """``time.sleep``, out of the region it is called in (the exit does not wait for
        it). Raises `ProcessExitingError` if the exit began meanwhile: the region is then
        left (see `drop`)."""
        if not getattr(self._local, "counted", False):
            time.sleep(seconds)
            return
        self._leave()
        time.sleep(seconds)
        self._enter()

    def drop(self, refs: list[Any]) -> None:
        """Let go of ``refs`` (process groups, collectives' works) where that is safe: in
        a region, at once; refused, they are kept until the process ends (`kept`)."""
        if not self.holds():
            kept.extend(refs)
        refs.clear()

    def close(self, seconds: float) -> bool:
        """Refuse new work from other threads; wait for the work under way until
        ``seconds`` after the first call (a later call does not wait again). Whether none
        is left."""
        with self._cond:
            if self._deadline is None:
                self._deadline = time.monotonic() + seconds
            return self._cond.wait_for(
                lambda: not self._under_way, max(0.0, self._deadline - time.monotonic())
            )

    def _after_fork_in_child(self) -> None:
        # The parent's threads do not exist in the child.
        self.__init__()  # type: ignore[misc]


exit_gate = _ExitGate()

EXIT_WAIT_SECONDS = 5.0
"""At interpreter exit, how long aiopersist waits for its own work in all, once the saves'
grace is over (`exit_wait_left`): a cancelled save removing what it wrote (the facades'
exit), then the work under way in its threads (`close_exit_gate`): a chunk being copied or
hashed, a store call, a mesh being connected. Such work ends in milliseconds; work that
does not end (a collective waiting for a rank that never comes, a write to a hung mount,
the pickling of a user's object) is left: it ends with the process, or aborts it if it
comes back from torch during the interpreter's last moments."""

EXIT_GATE_FLOOR_SECONDS = 2.0
"""However much of `EXIT_WAIT_SECONDS` the earlier steps of the exit spent, the gate
(`close_exit_gate`) still waits this long for the work under way when it closes. The
facades spend the whole budget waiting for a cancelled save whose thread is held by a
rank that does not come; when that rank's collective times out at the same moment, the
thread is still letting go of the broken mesh (a gloo group's teardown, with the GIL
released: milliseconds) as the budget ends, and the interpreter finalizing under it
aborted the process ("terminate called without an active exception", one exit in
about thirty here). Work that does not end costs the exit this much more."""

_exit_wait_lock = threading.Lock()
_exit_wait_deadline: float | None = None
_exit_wait_warned = False


def exit_wait_left() -> float:
    """Seconds left of the exit's one wait for aiopersist's own work (`EXIT_WAIT_SECONDS`
    from the first call): every step of the exit that waits for it takes from the same
    budget, so that work stuck past it is waited for once, not once a step."""
    global _exit_wait_deadline
    with _exit_wait_lock:
        if _exit_wait_deadline is None:
            _exit_wait_deadline = time.monotonic() + EXIT_WAIT_SECONDS
        return max(0.0, _exit_wait_deadline - time.monotonic())


def exit_waited() -> float:
    """Seconds since the exit's wait for aiopersist's work began (`exit_wait_left`'s first
    call): `EXIT_WAIT_SECONDS`, or more where the gate's floor added to it."""
    with _exit_wait_lock:
        if _exit_wait_deadline is None:
            return 0.0
        return time.monotonic() - (_exit_wait_deadline - EXIT_WAIT_SECONDS)


kept: list[Any] = []
"""What a refused thread could not let go of safely (see `_ExitGate.drop`): the works and
process group of a gather the exit gave up on. Never freed, not even when the interpreter
clears this module: freeing a gloo group waits for its collectives, up to their timeout
(``AIOPERSIST_DIST_TIMEOUT``), which would hold the exit that long. What is here ends with
the process."""
ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))


def close_exit_gate() -> None:
    """Close `exit_gate`, waiting what is left of `exit_wait_left`, and at least
    `EXIT_GATE_FLOOR_SECONDS`. Registered with
    ``atexit`` when this module is first imported, so that it runs after the exit hooks
    registered later (the program's, those that let a save finish); `aiopersist._dist`
    calls it first, before it destroys its groups. Says once when work is left."""
    global _exit_wait_warned
    if not exit_gate.close(max(exit_wait_left(), EXIT_GATE_FLOOR_SECONDS)) and not _exit_wait_warned:
        _exit_wait_warned = True
        log.warning(
            "aiopersist: exiting while one of its threads is still at work after %.1f s (a rank that "
            "does not come, a store that does not answer, a write to a hung disk)",
            exit_waited(),
        )


atexit.register(close_exit_gate)

_Job = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _run(job: _Job) -> None:
    future, fn, args, kwargs = job
    if not future.set_running_or_notify_cancel():
        return
    try:
        with exit_gate.inside():
            result = fn(*args, **kwargs)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


class DaemonThreadPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool of at most ``max_workers`` daemon threads, made as work arrives.

    A subclass of ``ThreadPoolExecutor`` only so that asyncio takes it as a loop's default
    executor; it uses none of its machinery (whose workers are joined at exit), only the
    public ``submit``/``shutdown`` interface.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "aiopersist") -> None:
        # ThreadPoolExecutor.__init__ is deliberately not called: see the class docstring.
        if max_workers <= 0:
            raise ValueError(f"max_workers must be positive, got {max_workers}")
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._guard = threading.Lock()
        self._stopped = False
        _pools.add(self)

    def _after_fork(self) -> None:
        """In a forked child: the parent's workers do not exist here, and the jobs queued
        in the parent are the parent's. Start afresh (as if no thread had been made)."""
        self._jobs = queue.SimpleQueue()
        self._workers = []
        self._idle = 0
        self._guard = threading.Lock()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._guard:
            if self._stopped:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._jobs.put((future, fn, args, kwargs))
            if self._idle:
                self._idle -= 1  # an idle worker will take it
            elif len(self._workers) < self._max:
                worker = threading.Thread(
                    target=self._work, name=f"{self._prefix}_{len(self._workers)}", daemon=True
                )
                self._workers.append(worker)
                worker.start()
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            _run(job)
            del job  # the job's arguments (buffers) are not kept while idle
            with self._guard:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._guard:
            first = not self._stopped
            self._stopped = True
            workers = list(self._workers)
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        if first:
            for _ in workers:
                self._jobs.put(None)
        if wait:
            for worker in workers:
                if worker is not threading.current_thread():
                    worker.join()


_pools: weakref.WeakSet[DaemonThreadPool] = weakref.WeakSet()


_gc_lock = threading.Lock()
_gc_holders = 0
_gc_restore = False


def _reset_in_child() -> None:
    """In a forked child: the parent's worker threads, and the `gc_paused` sections its
    other threads were in, do not go on here. The pools start afresh, and the collector
    is as it was before the first pause (a child forked during one kept it off for good)."""
    global _gc_lock, _gc_holders, _exit_wait_lock, _exit_wait_deadline, _exit_wait_warned
    exit_gate._after_fork_in_child()
    _exit_wait_lock, _exit_wait_deadline, _exit_wait_warned = threading.Lock(), None, False
    for pool in list(_pools):
        pool._after_fork()
    _gc_lock = threading.Lock()
    if _gc_holders:
        _gc_holders = 0
        if _gc_restore:
            gc.enable()


os.register_at_fork(after_in_child=_reset_in_child)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused for a burst of CPU work over a large state
    (flattening it, describing and planning it, building, encoding and parsing its
    manifest): such work makes hundreds of thousands of small, acyclic objects, and every
    collection their allocations trigger walks all of them and the whole state again
    (measured: more than half of `flatten`'s time for 50,000 tensors).

    Nested and concurrent pauses (two saves, a save and a load) are counted: the collector
    is enabled again when the last one ends, and only if it was enabled when the first
    began. Keep a pause to one burst (well under a second): cycles made meanwhile by other
    threads are collected only once it ends."""
    global _gc_holders, _gc_restore
    with _gc_lock:
        if _gc_holders == 0:
            _gc_restore = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_restore:
                gc.enable()
