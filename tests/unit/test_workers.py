"""The base layer's worker helpers (pure: threads, no event loop)."""

from __future__ import annotations

import gc
import threading

from aiopersist._workers import gc_paused


def test_gc_pause_nests_across_threads_and_restores_the_collector() -> None:
    assert gc.isenabled()
    inside = threading.Event()
    leave = threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            leave.wait(10)

    with gc_paused():
        assert not gc.isenabled()
        t = threading.Thread(target=other)
        t.start()
        assert inside.wait(10)
    # The first pause ended while the other thread's goes on: still paused.
    assert not gc.isenabled()
    leave.set()
    t.join(10)
    assert gc.isenabled()
    try:
        with gc_paused():  # an error inside still restores it
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()


def test_gc_pause_leaves_a_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        with gc_paused(), gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
