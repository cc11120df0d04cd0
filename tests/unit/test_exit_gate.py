"""The gate on the work of aiopersist's threads (`_workers.exit_gate`): the exit waits
for the work under way and refuses new work, so that no thread comes back from torch's
C++ code while the interpreter finalizes (which aborts the process)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from aiopersist import _dist, _workers
from aiopersist._workers import DaemonThreadPool, ProcessExitingError, _ExitGate
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


def _held_call(gate: _ExitGate) -> tuple[threading.Thread, list[Any], threading.Event]:
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
    gate = _ExitGate()
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
    gate = _ExitGate()
    worker, _, release = _held_call(gate)
    assert gate.close(0.05) is False
    release.set()
    worker.join(30)


def test_after_close_other_threads_are_refused_and_the_main_thread_is_not() -> None:
    gate = _ExitGate()
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
    gate = _ExitGate()
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
    gate = _ExitGate()
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
        assert any(kept is held for kept in _workers.kept)
        assert gate._under_way == 0
    finally:
        _workers.kept[:] = [kept for kept in _workers.kept if kept is not held]


def test_a_later_close_does_not_wait_again() -> None:
    """The exit closes the gate twice (`_dist` before it destroys its groups, then
    `_workers`' own hook): the wait is bounded once, not once per close."""
    gate = _ExitGate()
    worker, _, release = _held_call(gate)
    try:
        assert gate.close(0.2) is False
        closer, closed = _in_thread(lambda: gate.close(60))
        closer.join(5)
        assert not closer.is_alive()
        assert closed == [False]
    finally:
        release.set()
        worker.join(30)


def test_the_exit_s_steps_share_one_wait_and_say_once_what_is_left(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The facades' cancelled saves (`_blocking`) and the gate's last wait take from one
    budget (`exit_wait_left`): once a facade has waited it out for a stuck thread, the
    gate does not wait for that thread again; closed twice, it warns once."""
    monkeypatch.setattr(_workers, "_exit_wait_deadline", None)
    monkeypatch.setattr(_workers, "_exit_wait_warned", False)
    first = _workers.exit_wait_left()
    assert 0 < first <= _workers.EXIT_WAIT_SECONDS
    assert _workers.exit_wait_left() <= first  # one deadline, not one per caller
    monkeypatch.setattr(_workers, "_exit_wait_deadline", 0.0)  # spent (a facade waited it out)
    assert _workers.exit_wait_left() == 0.0
    gate = _ExitGate()
    monkeypatch.setattr(_workers, "exit_gate", gate)
    worker, _, release = _held_call(gate)
    try:
        with caplog.at_level("WARNING", logger="aiopersist"):
            closer, _ = _in_thread(lambda: (_workers.close_exit_gate(), _workers.close_exit_gate()))
            closer.join(10)  # the budget is spent: neither close waits for the held call
            assert not closer.is_alive()
        assert [r.getMessage().count("still at work") for r in caplog.records] == [1]
    finally:
        release.set()
        worker.join(30)


def test_with_the_budget_spent_the_gate_still_waits_a_moment_for_work_under_way(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A facade waited the whole budget for a cancelled save (`exit_wait_left` is 0);
    the save's thread is still letting go of a broken mesh, a short call into torch.
    The gate waits for it (up to `EXIT_GATE_FLOOR_SECONDS`) rather than let the
    interpreter finalize under it, which aborted the process."""
    monkeypatch.setattr(_workers, "_exit_wait_deadline", 0.0)  # spent
    monkeypatch.setattr(_workers, "_exit_wait_warned", False)
    gate = _ExitGate()
    monkeypatch.setattr(_workers, "exit_gate", gate)
    worker, out, release = _held_call(gate)
    timer = threading.Timer(0.3, release.set)  # the teardown ends soon after the budget
    timer.start()
    try:
        with caplog.at_level("WARNING", logger="aiopersist"):
            _workers.close_exit_gate()
        assert release.is_set()  # the close waited for it
        worker.join(30)
        assert out == ["done"]
        assert not [r for r in caplog.records if "still at work" in r.getMessage()]
    finally:
        timer.cancel()
        release.set()
        worker.join(30)


def test_a_pool_job_under_way_is_waited_for_and_a_later_one_refused() -> None:
    """Every job of a `DaemonThreadPool` (a load's copies, a save's hashing, the FSDP
    saver's background save) is work the exit waits for; a job that starts after the
    exit began fails with `ProcessExitingError`, its function never called."""
    saved = _workers.exit_gate
    _workers.exit_gate = gate = _ExitGate()
    pool = DaemonThreadPool(2, thread_name_prefix="test-gate")
    try:
        entered, release = threading.Event(), threading.Event()

        def job() -> str:
            entered.set()
            release.wait(30)
            return "done"

        first = pool.submit(job)
        assert entered.wait(30)
        closer, closed = _in_thread(lambda: gate.close(60))
        closer.join(0.3)
        assert closer.is_alive()  # waiting for the job
        called: list[int] = []
        later = pool.submit(lambda: called.append(1))
        assert isinstance(later.exception(30), ProcessExitingError)
        assert called == []
        release.set()
        assert first.result(30) == "done"
        closer.join(30)
        assert closed == [True]
    finally:
        release.set()
        pool.shutdown(wait=True)
        _workers.exit_gate = saved


def test_a_worker_inside_torch_when_the_program_exits_does_not_abort_it() -> None:
    """A worker copying tensors (a load abandoned by a crash, a save's staging on a GPU)
    while the main thread exits: without the gate the worker came back from torch during
    the interpreter's finalization and the process aborted ("terminate called without an
    active exception"), 3 times in 3. The exit now waits for the job."""
    script = """
import threading, time, torch
from aiopersist._workers import DaemonThreadPool
torch.set_num_threads(1)
a = torch.randn(400, 400)
started = threading.Event()
def job():
    started.set()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        a @ a  # torch lets go of the GIL in each
    return "job done"
pool = DaemonThreadPool(1)
pool.submit(job)
started.wait()
print("main exits", flush=True)
"""
    proc = launch_run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert b"terminate called" not in proc.stderr
    assert proc.stdout == b"main exits\n"


def test_a_refused_store_call_is_an_error_of_its_caller() -> None:
    """`_StoreCall` (the job's store, a mesh being connected) after the exit began: its
    caller gets the refusal as the call's error, at once."""
    saved = _dist.exit_gate
    _dist.exit_gate = gate = _ExitGate()
    try:
        gate.close(1)
        called: list[int] = []
        with pytest.raises(ProcessExitingError):
            _dist._bounded(lambda: called.append(1), what="a store call", seconds=30)
        assert called == []
    finally:
        _dist.exit_gate = saved


def test_a_forked_child_starts_with_an_open_gate() -> None:
    """The parent's exit is not the child's: a child forked after the parent closed its
    gate calls into torch from its threads."""
    script = """
import os, threading
from aiopersist import _workers
_workers.exit_gate.close(1)
pid = os.fork()
if pid == 0:
    box = []
    def call():
        try:
            with _workers.exit_gate.inside():
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
    saved = _dist.exit_gate
    _dist.exit_gate = gate = _ExitGate()
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
        _dist.exit_gate = saved


def test_what_a_refused_thread_kept_is_never_freed_at_exit() -> None:
    """Freeing a gloo group waits for its collectives (up to their timeout): what a
    refused gather kept must not be freed when the interpreter clears the module, or the
    exit would wait that long. An object kept there is never finalized."""
    script = """
import sys
from aiopersist import _workers

class Kept:
    def __del__(self):
        sys.stdout.write("freed\\n")
        sys.stdout.flush()

_workers.kept.append(Kept())
"""
    proc = launch_run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert b"freed" not in proc.stdout
