"""A crash must end the process. Real processes: a script that raises, or gets Ctrl-C, with a
blocking facade open (and under the Trainer) exits promptly with its own traceback; a save
in flight is finished within the grace period, or cancelled (nothing published) and what
it left is removed by the next start. Closing a backend under load fails the waiting
requests with a typed error, on both backends."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

import aiopersist
from tests._launch import run
from tests.conftest import URING_OK

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = [
    "threads",
    pytest.param("io_uring", marks=pytest.mark.skipif(not URING_OK, reason="io_uring unavailable")),
]


def _said_once_with_the_time_waited(err: str) -> None:
    """The exit's warning about work left, once, with the time it waited for it: the
    budget (5 s) and the gate's last wait (2 s at least, after a spent budget)."""
    waited = re.findall(r"still at work after (\d+\.\d) s", err)
    assert len(waited) == 1, err
    assert 5.0 <= float(waited[0]) < 8.5, err


def _run(code: str, *, grace: float | None = None, timeout: float = 120) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    if grace is not None:
        env["AIOPERSIST_EXIT_GRACE"] = str(grace)
    proc = run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        text=True,
        timeout=timeout,  # a hang fails the test (TimeoutExpired) rather than holding CI
    )
    return proc.returncode, proc.stderr


def _leftovers(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if ".aiopersist-tmp-" in n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_script_that_raises_with_a_checkpointer_open_exits_and_finishes_the_save(
    tmp_path: Path, backend: str
) -> None:
    rc, err = _run(
        f"""
        import aiopersist, torch
        ck = aiopersist.BlockingCheckpointer(backend={backend!r})
        ck.save({{"w": torch.ones(64 << 20 >> 2)}}, {str(tmp_path / "ckpt")!r})
        raise RuntimeError("training blew up")
        """
    )
    assert rc == 1, err
    assert "RuntimeError: training blew up" in err  # the original traceback
    import asyncio

    asyncio.run(aiopersist.verify(tmp_path / "ckpt"))  # the save in flight was finished
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_no_grace_the_save_in_flight_is_cancelled_and_leaves_nothing(
    tmp_path: Path, backend: str
) -> None:
    rc, err = _run(
        f"""
        import aiopersist, torch
        ck = aiopersist.BlockingCheckpointer(backend={backend!r})
        ck.save({{"w": torch.ones(256 << 20 >> 2)}}, {str(tmp_path / "ckpt")!r})
        raise RuntimeError("training blew up")
        """,
        grace=0,
    )
    assert rc == 1, err
    assert "RuntimeError: training blew up" in err
    assert not (tmp_path / "ckpt").exists()
    assert _leftovers(tmp_path) == []


def test_a_save_stuck_past_the_grace_is_abandoned_and_the_next_start_cleans_up(tmp_path: Path) -> None:
    """A save whose ``torch.save`` thread cannot be stopped (held by a Gate for 60 s): the
    process still exits within the grace plus the cancellation allowance, publishes
    nothing, and the next manager start removes the temporary directory."""
    run = tmp_path / "run"
    rc, err = _run(
        f"""
        import aiopersist, torch
        from tests.conftest import Gate
        gate = Gate()  # holds torch.save of it for up to 30 s
        ck = aiopersist.BlockingCheckpointer()
        extra = {{"x.pt": aiopersist.TorchSave(gate)}}
        ck.save({{"w": torch.ones(8)}}, {str(run / "step-1")!r}, extra_files=extra)
        gate.entered.wait(20)
        raise KeyboardInterrupt
        """,
        grace=0.5,
        timeout=60,
    )
    assert rc != 0, err
    assert "KeyboardInterrupt" in err
    assert err.count("still in flight after 0.5 s") == 1  # it said "after 0 s"
    # The stuck thread is waited for once in the exit (the cancelled save's cleanup and the
    # threads' last wait share one budget), and said once.
    _said_once_with_the_time_waited(err)
    # Abandoned, not waited for: had the exit waited for the gate (30 s), the save would
    # have gone on and published step-1.
    assert not (run / "step-1").exists()
    assert len(_leftovers(run)) == 1
    with aiopersist.BlockingCheckpointManager(run) as mgr:
        assert mgr.steps() == []
    assert _leftovers(run) == []


def test_ctrl_c_with_a_manager_open_exits_and_keeps_every_committed_step(tmp_path: Path) -> None:
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    rc, err = _run(
        f"""
        import os, signal, time, aiopersist, torch
        # Ctrl-C raises KeyboardInterrupt here even when started in the background, as CI
        # may start it (then SIGINT is inherited as ignored).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        mgr = aiopersist.BlockingCheckpointManager({str(run)!r}, keep_last=2, mirror={str(mirror)!r})
        for step in range(3):
            mgr.save(step, {{"w": torch.full((1 << 20,), float(step))}}).wait_staged()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(20)
        raise SystemExit("SIGINT did not interrupt")
        """
    )
    assert rc == -2 or "KeyboardInterrupt" in err, (rc, err)
    with aiopersist.BlockingCheckpointManager(run, mirror=mirror) as mgr:
        assert mgr.latest() == 2
        assert float(mgr.restore()["w"][0]) == 2.0
    assert _leftovers(run) == []


def test_a_crash_under_the_trainer_exits_with_the_traceback(tmp_path: Path) -> None:
    """Training raises while the callback's save of step 2 is in flight: the process ends
    with the Trainer's traceback, and the checkpoint of step 2 is whole."""
    pytest.importorskip("transformers")
    out = tmp_path / "run"
    rc, err = _run(
        f"""
        import transformers
        from pathlib import Path
        from aiopersist.integrations.transformers import AioPersistCallback
        from tests.e2e.test_hf_trainer import _trainer

        class Boom(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == 3:
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")

        _trainer(Path({str(out)!r}), [AioPersistCallback(), Boom()], max_steps=8, save_steps=2).train()
        """
    )
    assert rc == 1, err
    assert "RuntimeError: CUDA error: an illegal memory access" in err
    assert "trainer.py" in err  # the Trainer's own frames: the original traceback
    import asyncio

    asyncio.run(aiopersist.verify(out / "checkpoint-2"))
    assert _leftovers(out) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_a_backend_under_load_fails_the_waiters_with_a_typed_error(backend: str) -> None:
    """64 writes on a queue of 2, closed at once: the two in flight complete, the 62 that
    wait fail with ClosedError, nothing is submitted on a closed ring (it used to segfault
    or hang), and later calls fail the same way."""
    rc, err = _run(
        f"""
        import asyncio, os, tempfile, aiopersist

        async def main():
            be = aiopersist.create_backend({backend!r}, queue_depth=2)
            path = os.path.join(tempfile.mkdtemp(), "f")
            fd = await be.open(path, os.O_WRONLY | os.O_CREAT)
            tasks = [asyncio.ensure_future(be.write(fd, bytearray(1 << 20), i << 20)) for i in range(64)]
            await asyncio.sleep(0)
            closing = asyncio.ensure_future(be.aclose())
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await closing
            done = sum(1 for r in results if r == 1 << 20)
            closed = sum(1 for r in results if isinstance(r, aiopersist.ClosedError))
            assert done + closed == 64, results
            assert closed >= 60, (done, closed)
            try:
                await be.read(fd, bytearray(10), 0)
            except aiopersist.ClosedError as exc:
                print("after close:", exc)
            os.close(fd)
            print("resolved", done, closed)

        asyncio.run(main())
        """,
        timeout=60,
    )
    assert rc == 0, err


def test_the_next_trainer_run_removes_what_an_abandoned_save_left(tmp_path: Path) -> None:
    """A Trainer run killed (or abandoned at exit) mid-save leaves a temporary directory:
    the next run with the callback removes it, and nothing else."""
    pytest.importorskip("transformers")
    from aiopersist.integrations.transformers import AioPersistCallback
    from tests.e2e.test_hf_trainer import _trainer

    out = tmp_path / "run"
    (out / ".checkpoint-2.aiopersist-tmp-0123456789ab").mkdir(parents=True)
    (out / ".checkpoint-2.aiopersist-tmp-0123456789ab" / "model.safetensors").write_bytes(b"half")
    (out / ".checkpoint-1.aiopersist-trash-0123456789ab").mkdir()
    (out / ".keep-me").write_text("the user's")
    _trainer(out, [AioPersistCallback()], max_steps=2, save_steps=2).train()
    assert sorted(os.listdir(out)) == [".keep-me", "checkpoint-2"]
    import asyncio

    asyncio.run(aiopersist.verify(out / "checkpoint-2"))


# Each way out on one backend (the stuck part, a pickling, is the same on both; each case
# waits out the grace and the exit's wait for the stuck job, about 13 s).
@pytest.mark.parametrize(
    ("how", "backend"),
    [
        ("raise", "threads"),
        pytest.param(
            "sys-exit", "io_uring", marks=pytest.mark.skipif(not URING_OK, reason="io_uring unavailable")
        ),
    ],
)
def test_leaving_a_with_block_on_an_error_is_bounded_by_the_grace(
    tmp_path: Path, backend: str, how: str
) -> None:
    """``with BlockingCheckpointer() as ck:`` left by an exception or ``sys.exit`` while a
    save is stuck (the pickling of one of its files sleeps for 10 minutes): the process
    ends after the grace, the save cancelled and nothing published, as when the facade
    is left open. It used to wait for the save without bound. (The manager's facade
    shares this exit.)"""
    stop = 'raise RuntimeError("training blew up")' if how == "raise" else "sys.exit(3)"
    rc, err = _run(
        f"""
        import sys, time
        import aiopersist, torch

        class Stuck:
            def __reduce__(self):
                time.sleep(600)
                return (int, (0,))

        with aiopersist.BlockingCheckpointer(backend={backend!r}) as ck:
            extra = {{"x.pt": aiopersist.TorchSave(Stuck())}}
            ck.save({{"w": torch.ones(8)}}, {str(tmp_path / "ckpt")!r}, extra_files=extra)
            time.sleep(0.5)
            {stop}
        """,
        grace=1,
        timeout=90,
    )
    assert rc == (1 if how == "raise" else 3), err
    _said_once_with_the_time_waited(err)  # said once (it was twice)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("backend", "ending", "stager"), [("threads", "raise", "default"), ("io_uring", "normal", "fence")]
)
def test_an_async_save_still_uploading_when_the_program_ends_is_finished(
    tmp_path: Path, backend: str, ending: str, stager: str
) -> None:
    """``dcp.async_save`` through `AiopersistWriter`, then the script ends (its last line,
    or an exception) without waiting for the future: DCP's upload thread is joined at
    exit, as with its own writer, and the checkpoint it finishes then is complete (the
    engine's loops keep their worker threads when the interpreter has begun to exit;
    asyncio's own executor refuses work then, and the save was lost)."""
    if backend == "io_uring" and not URING_OK:
        pytest.skip("io_uring unavailable")
    ckpt = tmp_path / "ckpt"
    rc, err = _run(
        f"""
        import warnings
        import torch
        import torch.distributed.checkpoint as dcp
        from aiopersist.integrations.dcp import AiopersistWriter, FenceStager
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        state = {{f"t{{i}}": torch.full((1 << 20,), float(i)) for i in range(16)}}
        state["step"] = 7
        writer = AiopersistWriter(backend={backend!r})
        stager = FenceStager(writer) if {stager!r} == "fence" else None
        dcp.async_save(state, checkpoint_id={str(ckpt)!r}, storage_writer=writer, async_stager=stager)
        if {ending!r} == "raise":
            raise RuntimeError("training blew up")
        """
    )
    assert rc == (1 if ending == "raise" else 0), err
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from aiopersist.integrations.dcp import AiopersistReader

    for reader in (FileSystemReader(str(ckpt)), AiopersistReader(ckpt)):
        target: dict[str, object] = {f"t{i}": torch.zeros(1 << 20) for i in range(16)}
        target["step"] = 0
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(target, checkpoint_id=str(ckpt), storage_reader=reader)
        assert target["step"] == 7
        assert all(torch.equal(target[f"t{i}"], torch.full((1 << 20,), float(i))) for i in range(16))
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_sync_in_an_exit_hook_saves(tmp_path: Path, backend: str) -> None:
    """A last checkpoint taken by ``aiopersist.save_sync`` in an ``atexit`` hook (after the
    interpreter began to exit) is written whole."""
    rc, err = _run(
        f"""
        import atexit
        import aiopersist, torch

        def last() -> None:
            state = {{"w": torch.ones(1 << 20)}}
            aiopersist.save_sync(state, {str(tmp_path / "last")!r}, backend={backend!r})

        atexit.register(last)
        """
    )
    assert rc == 0, err
    import asyncio

    asyncio.run(aiopersist.verify(tmp_path / "last"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_during_save_sync_cancels_the_save_and_leaves_nothing(tmp_path: Path, backend: str) -> None:
    """Ctrl-C while ``save_sync`` runs: the save is cancelled (its work in progress
    removed), then ``KeyboardInterrupt`` ends the program, as under ``asyncio.run``."""
    rc, err = _run(
        f"""
        import os, signal, time, aiopersist, torch

        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal

        class Interrupts:
            def __reduce__(self):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
                return (int, (0,))

        state = {{"w": torch.ones(16 << 20)}}
        extra = {{"slow.pt": aiopersist.TorchSave({{"x": Interrupts()}})}}
        aiopersist.save_sync(state, {str(tmp_path / "ckpt")!r}, backend={backend!r}, extra_files=extra)
        raise SystemExit("Ctrl-C did not interrupt the save")
        """
    )
    assert rc == -2, (rc, err)
    assert "KeyboardInterrupt" in err
    assert sorted(os.listdir(tmp_path)) == []  # no checkpoint, no temporary directory


@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_during_a_blocking_restore_cancels_it_before_the_interrupt_goes_on(
    tmp_path: Path, backend: str
) -> None:
    """Ctrl-C while ``BlockingCheckpointManager.restore(into=...)`` copies into the target:
    ``KeyboardInterrupt`` reached the caller while the restore went on in the background
    loop, changing the target under the caller's handler (found by the cancellation
    helper). Now the interrupted call is cancelled and ends first, as ``save_sync`` and
    ``asyncio.run`` do: the target no longer changes once the interrupt is raised."""
    if backend == "io_uring" and not URING_OK:
        pytest.skip("io_uring unavailable")
    rc, err = _run(
        f"""
        import os, signal, sys, threading, time, aiopersist, torch

        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
        state = {{f"t{{i:02d}}": torch.full((1 << 20,), float(i + 1)) for i in range(48)}}

        def loaded(target):
            return sum(1 for v in target.values() if v[-1].item() != 0)

        with aiopersist.BlockingCheckpointManager({str(tmp_path / "run")!r}, backend={backend!r}) as mgr:
            mgr.save(0, state).wait()
            for attempt in range(20):  # until the interrupt lands during the copy
                target = {{k: torch.zeros_like(v) for k, v in state.items()}}
                fired = []

                def interrupt():
                    for _ in range(200_000):
                        n = loaded(target)
                        if n:
                            fired.append(n)  # how far the copy was when Ctrl-C came
                            os.kill(os.getpid(), signal.SIGINT)
                            return
                        time.sleep(0.00005)

                threading.Thread(target=interrupt, daemon=True).start()
                try:
                    mgr.restore(into=target)
                    time.sleep(0.5)  # an interrupt that came late lands here
                except KeyboardInterrupt:
                    seen = loaded(target)
                    time.sleep(0.3)
                    if loaded(target) != seen:
                        sys.exit(f"the target changed after Ctrl-C: {{seen}} -> {{loaded(target)}}")
                    if fired and fired[0] < len(state):
                        sys.exit(0)  # interrupted mid-copy, and nothing changed after
        sys.exit(3)  # never interrupted mid-copy
        """
    )
    if rc == 3:
        pytest.skip("no interrupt landed during the copy in 20 tries")
    assert rc == 0, err
