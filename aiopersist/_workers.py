"""Worker threads that never hold the interpreter open at exit.

`concurrent.futures.ThreadPoolExecutor` joins its workers when the interpreter exits, so a
worker stuck in a system call (a write to a hung mount, a collective waiting for a rank
that died) keeps a crashed training job alive. aiopersist's own I/O and its facades' event
loops run their work on `DaemonThreadPool` instead: at exit, work still running is
abandoned, which the on-disk protocol is made for (nothing is ever half-published).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _run(job: _Job) -> None:
    future, fn, args, kwargs = job
    if not future.set_running_or_notify_cancel():
        return
    try:
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
    global _gc_lock, _gc_holders
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
