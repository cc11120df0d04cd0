"""BlockingCheckpointer: the Checkpointer from plain threads (no event loop of their own)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import aiopersist
from tests.io.test_checkpointer import _state


def test_blocking_facade_from_a_plain_thread(tmp_path: Path) -> None:
    results: list[object] = []

    def training_loop() -> None:
        state = _state(5)
        with aiopersist.BlockingCheckpointer(mode="fence") as ck:
            h = ck.save(state, tmp_path / "c")
            h.wait_staged()
            for t in state["weights"].values():  # type: ignore[union-attr]
                t.zero_()
            info = h.wait()
            results.append(info)
            assert h.done()
            ck.fence()

    thread = threading.Thread(target=training_loop)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert isinstance(results[0], aiopersist.SaveInfo)
    back = aiopersist.load_sync(tmp_path / "c")
    assert back["step"] == 5
    assert float(back["weights"]["w0"].abs().sum()) > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blocking_save_reads_cuda_tensors_as_the_calling_thread_left_them(tmp_path: Path) -> None:
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    w = torch.zeros(4 << 20, device="cuda")
    torch.cuda.synchronize()
    with aiopersist.BlockingCheckpointer() as ck:
        with torch.cuda.stream(side):  # current in this thread only, not in the loop's thread
            torch.cuda._sleep(500_000_000)  # type: ignore[no-untyped-call]
            w.fill_(7.0)
            handle = ck.save({"w": w}, tmp_path / "c")
        handle.wait()
    assert torch.equal(aiopersist.load_sync(tmp_path / "c")["w"], torch.full((4 << 20,), 7.0))


@pytest.mark.parametrize("backend", ["threads", "io_uring"])
def test_after_close_a_handle_gives_its_outcome_and_a_call_raises_closed_error(
    tmp_path: Path, backend: str
) -> None:
    """``with BlockingCheckpointer() as ck: h = ck.save(...)`` then ``h.wait()`` after the
    block raised anyio's ``RuntimeError('This portal is not running')`` though the save
    was committed; so did every call of a closed facade (found by the cancellation
    helper). A handle now gives its save's outcome after the close, and a closed facade
    raises `ClosedError`, as its async twin does."""
    from tests.conftest import URING_OK

    if backend == "io_uring" and not URING_OK:
        pytest.skip("io_uring unavailable")
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        handle = ck.save(_state(1), tmp_path / "c")
    info = handle.wait()
    assert isinstance(info, aiopersist.SaveInfo)
    handle.wait_staged()
    assert handle.done()
    with pytest.raises(aiopersist.ClosedError):
        ck.save(_state(2), tmp_path / "d")
    with pytest.raises(aiopersist.ClosedError):
        ck.wait()
    with aiopersist.BlockingCheckpointManager(
        tmp_path / "run", mirror=tmp_path / "m", backend=backend
    ) as mgr:
        managed = mgr.save(1, _state(1))
    assert managed.wait() is not None
    assert managed.wait_mirrored() == str(tmp_path / "m" / "step-1")
    for call in (mgr.restore, mgr.wait, lambda: mgr.save(2, _state(2))):
        with pytest.raises(aiopersist.ClosedError):
            call()
    assert not (tmp_path / "d").exists()


def test_a_close_on_the_closing_thread_returns_and_a_cancelled_save_raises_an_exception(
    tmp_path: Path,
) -> None:
    """A second ``close`` on the thread already closing (a signal handler's, on top of
    the first) returned at once before, and must not wait for itself (found by the review
    helper: it hung). A handle of a save cancelled when its facade closed raises
    ``concurrent.futures.CancelledError`` (an ``Exception``) from ``wait()``, not
    asyncio's ``CancelledError``, a ``BaseException`` that sync code does not catch."""
    import concurrent.futures
    import signal

    ck = aiopersist.BlockingCheckpointer(backend="threads")
    handle = ck.save({"w": torch.randn(16 << 20)}, tmp_path / "c")
    previous = signal.signal(signal.SIGUSR1, lambda *_: ck.close())
    try:
        timer = threading.Timer(0.01, lambda: os.kill(os.getpid(), signal.SIGUSR1))
        timer.start()
        ck.close()  # the handler's close runs on this thread, inside this one
        timer.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert handle.done()
    ck2 = aiopersist.BlockingCheckpointer(backend="threads")
    handle2 = ck2.save({"w": torch.randn(32 << 20)}, tmp_path / "d")
    ck2._close_at_exit(0.0)  # no grace: the save in flight is cancelled
    try:
        handle2.wait()
    except concurrent.futures.CancelledError:
        assert not (tmp_path / "d").exists()
    else:
        assert (tmp_path / "d").exists()  # it was over before the close: nothing to cancel
