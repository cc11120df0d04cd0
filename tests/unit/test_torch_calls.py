"""The gate on aiopersist's calls into torch from its threads (`_dist._TorchCalls`): the
exit waits for the calls under way and refuses new ones, so that no thread comes back
from torch's C++ code while the interpreter finalizes (which aborts the process)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from aiopersist import _dist
from aiopersist._dist import ProcessExitingError, _TorchCalls
from tests._launch import run as launch_run


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``fn()`` in a daemon thread; its result or exception lands in the list."""
    out: list[Any] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def _held_call(gate: _TorchCalls) -> tuple[threading.Thread, list[Any], threading.Event]:
    """A thread inside a region of ``gate`` until the returned event is set (then its
    result is "done")."""
    entered, release = threading.Event(), threading.Event()

    def call() -> str:
        with gate.inside():
            entered.set()
            release.wait(30)
            return "done"

    worker, out = _in_thread(call)
    assert entered.wait(30)
    return worker, out, release


def test_close_waits_for_a_call_under_way() -> None:
    gate = _TorchCalls()
    worker, out, release = _held_call(gate)
    closer, closed = _in_thread(lambda: gate.close(60))
    closer.join(0.3)
    assert closer.is_alive()
    assert not closed
    release.set()
    closer.join(60)
    worker.join(60)
    assert closed == [True]
    assert out == ["done"]


def test_close_gives_up_on_a_call_that_does_not_end() -> None:
    gate = _TorchCalls()
    worker, _, release = _held_call(gate)
    assert gate.close(0.05) is False
    release.set()
    worker.join(30)


def test_after_close_other_threads_are_refused_and_the_main_thread_is_not() -> None:
    gate = _TorchCalls()
    assert gate.close(1) is True

    def call() -> str:
        with gate.inside():
            return "called"

    worker, out = _in_thread(call)
    worker.join(30)
    assert len(out) == 1, out
    assert isinstance(out[0], ProcessExitingError), out
    assert "exiting" in str(out[0])
    assert call() == "called"  # the main thread finalizes: never refused


def test_nested_regions_count_once() -> None:
    gate = _TorchCalls()
    depth_ok = threading.Event()

    def call() -> None:
        with gate.inside():
            with gate.inside():
                assert gate._under_way == 1
            assert gate._under_way == 1
            assert gate.holds()
        assert gate._under_way == 0
        assert not gate.holds()
        depth_ok.set()

    worker, out = _in_thread(call)
    worker.join(30)
    assert depth_ok.is_set(), out


def test_a_thread_sleeping_between_looks_is_not_waited_for_and_keeps_what_it_holds() -> None:
    """A gather polling its collective sleeps out of the region: the exit does not wait
    for it; when it wakes it is refused, and what it would have let go of (a process
    group, a work) is kept rather than dropped from a thread that may not come back."""
    gate = _TorchCalls()
    asleep = threading.Event()
    held = object()

    def call() -> None:
        refs = [held]
        with gate.inside():
            try:
                asleep.set()
                gate.sleep(0.5)
            finally:
                gate.drop(refs)
            assert refs == []

    worker, out = _in_thread(call)
    assert asleep.wait(30)
    assert gate.close(30) is True  # not waiting for the sleeper
    worker.join(30)
    try:
        assert len(out) == 1, out
        assert isinstance(out[0], ProcessExitingError), out
        assert any(kept is held for kept in _dist._kept)
        assert gate._under_way == 0
    finally:
        _dist._kept[:] = [kept for kept in _dist._kept if kept is not held]


def test_a_refused_store_call_is_an_error_of_its_caller() -> None:
    """`_StoreCall` (the job's store, a mesh being connected) after the exit began: its
    caller gets the refusal as the call's error, at once."""
    saved = _dist._torch_calls
    _dist._torch_calls = gate = _TorchCalls()
    try:
        gate.close(1)
        called: list[int] = []
        with pytest.raises(ProcessExitingError):
            _dist._bounded(lambda: called.append(1), what="a store call", seconds=30)
        assert called == []
    finally:
        _dist._torch_calls = saved


def test_a_forked_child_starts_with_an_open_gate() -> None:
    """The parent's exit is not the child's: a child forked after the parent closed its
    gate calls into torch from its threads."""
    script = """
import os, threading
from aiopersist import _dist
_dist._torch_calls.close(1)
pid = os.fork()
if pid == 0:
    box = []
    def call():
        try:
            with _dist._torch_calls.inside():
                box.append("called")
        except Exception as exc:
            box.append(repr(exc))
    t = threading.Thread(target=call); t.start(); t.join()
    os._exit(0 if box == ["called"] else 3)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    proc = launch_run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_an_exchange_refused_at_exit_says_so_rather_than_blame_a_rank() -> None:
    """A gather refused because the process is exiting fails with that reason, not as a
    rank that did not come (the old message), nor asks the store where the ranks are."""
    saved = _dist._torch_calls
    _dist._torch_calls = gate = _TorchCalls()
    try:
        import torch.distributed as dist

        store = dist.HashStore()  # type: ignore[attr-defined]
        mesh = _dist._Mesh(store, 0, 2, "test")
        coord = _dist.Coordinator(0, 2, 0, mesh)
        gate.close(1)
        worker, out = _in_thread(lambda: coord.all_gather("x"))
        worker.join(60)
        assert len(out) == 1, out
        assert isinstance(out[0], ProcessExitingError), out
        assert store.num_keys() == 0  # nothing asked of the store
    finally:
        _dist._torch_calls = saved


def test_what_a_refused_thread_kept_is_never_freed_at_exit() -> None:
    """Freeing a gloo group waits for its collectives (up to their timeout): what a
    refused gather kept must not be freed when the interpreter clears the module, or the
    exit would wait that long. An object kept there is never finalized."""
    script = """
import sys
from aiopersist import _dist

class Kept:
    def __del__(self):
        sys.stdout.write("freed\\n")
        sys.stdout.flush()

_dist._kept.append(Kept())
"""
    proc = launch_run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert b"freed" not in proc.stdout
