"""CheckpointManager: numbered steps, retention, the mirror tier, startup cleanup, and
the faults it must survive (a real kill -9, a real full file system, a mirror that
comes and goes). Every I/O test runs on both backends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import aiopersist
from aiopersist._names import LOCK_NAME, TRASH_MARKER
from tests._launch import popen, run
from tests.conftest import URING_OK, flip_byte

BACKENDS = [
    "threads",
    pytest.param("io_uring", marks=pytest.mark.skipif(not URING_OK, reason="io_uring unavailable")),
]
ROOT = Path(__file__).resolve().parents[2]


def state_of(step: int) -> dict[str, object]:
    return {"w": torch.full((64, 64), float(step)), "b": torch.arange(10) + step, "step": step}


def _names(d: Path) -> list[str]:
    """What is in ``d`` besides the manager's lock file, which stays for good."""
    return sorted(n for n in os.listdir(d) if n != LOCK_NAME) if d.exists() else []


# -- the manager ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_steps_latest_restore(tmp_path: Path, backend: str) -> None:
    async with aiopersist.CheckpointManager(tmp_path / "ck", backend=backend) as mgr:
        assert mgr.steps() == []
        assert mgr.latest() is None
        with pytest.raises(aiopersist.CheckpointNotFoundError):
            await mgr.restore()
        for step in (1, 2, 10):
            handle = await mgr.save(step, state_of(step))
            await handle.staged
            info = await handle.done
            assert info is not None
            assert info.path.endswith(f"step-{step}")
        await mgr.wait()
        assert mgr.steps() == [1, 2, 10]
        assert mgr.latest() == 10
        back = await mgr.restore()
        assert back["step"] == 10
        assert torch.equal(back["w"], torch.full((64, 64), 10.0))
        old = await mgr.restore(2)
        assert old["step"] == 2
        target = state_of(0)
        await mgr.restore(1, into=target)
        assert torch.equal(target["w"], torch.full((64, 64), 1.0))  # type: ignore[arg-type]
        with pytest.raises(aiopersist.CheckpointNotFoundError, match="step 3"):
            await mgr.restore(3)
        with pytest.raises(TypeError, match="non-negative int"):
            await mgr.save(-1, state_of(0))
        with pytest.raises(aiopersist.CheckpointExistsError):
            await (await mgr.save(2, state_of(2))).done
        assert mgr.steps() == [1, 2, 10]  # the failed save lost nothing


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_retention_keep_last_and_keep_every(tmp_path: Path, backend: str) -> None:
    async with aiopersist.CheckpointManager(tmp_path, keep_last=2, keep_every=5, backend=backend) as mgr:
        for step in range(1, 12):
            await (await mgr.save(step, state_of(step))).done
        await mgr.wait()
        assert mgr.steps() == [5, 10, 11]
        assert not [n for n in _names(tmp_path) if not n.startswith("step-")]  # no trash left


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_retention_policies_local_and_mirror(tmp_path: Path, backend: str) -> None:
    local, mirror = tmp_path / "local", tmp_path / "shared"
    async with aiopersist.CheckpointManager(
        local,
        retention=aiopersist.KeepLast(1) | aiopersist.KeepSteps({2}),
        mirror=mirror,
        mirror_retention=aiopersist.KeepEvery(2),
        backend=backend,
    ) as mgr:
        for step in range(1, 6):
            await (await mgr.save(step, state_of(step))).done
        await mgr.wait()
        assert _names(local) == ["step-2", "step-5"]
        # The mirror keeps the even steps, and the newest (never deleted, whatever the policy).
        assert _names(mirror) == ["step-2", "step-4", "step-5"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_wait_on_a_handle_that_times_out_changes_nothing_of_the_save(
    tmp_path: Path, backend: str
) -> None:
    """``asyncio.wait_for(handle.done, t)`` timing out cancelled the save's own future: the
    manager's retention and mirroring, which waited on it, never ran (every step kept
    with ``keep_last=1``, no mirror), and the handle said CancelledError for good though
    the step was committed (found by the cancellation helper). The caller's futures are
    views now: a timed-out wait ends that wait only."""
    local, mirror = tmp_path / "local", tmp_path / "shared"
    async with aiopersist.CheckpointManager(local, keep_last=1, mirror=mirror, backend=backend) as mgr:
        for step in range(3):
            handle = await mgr.save(step, state_of(step))
            for fut in (handle.staged, handle.done, handle.mirrored):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(fut, 0.0001)
            assert handle.done is handle.done  # one view while it lasts
            info = await handle.done
            assert info is not None
            assert info.path.endswith(f"step-{step}")
            assert await handle.mirrored == str(mirror / f"step-{step}")
        await mgr.wait()
        assert _names(local) == ["step-2"]
        assert _names(mirror) == ["step-0", "step-1", "step-2"]
    with aiopersist.BlockingCheckpointManager(local, backend=backend) as blocking:
        handle = blocking.save(3, state_of(3))
        assert handle.wait() is not None  # a blocking wait on the same kind of handle
        assert blocking.latest() == 3


def test_retention_and_its_shorthands_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        aiopersist.CheckpointManager(tmp_path / "a", retention=aiopersist.KeepLast(1), keep_last=2)
    with pytest.raises(ValueError, match="not both"):
        aiopersist.CheckpointManager(
            tmp_path / "b", mirror=tmp_path / "m", mirror_retention=aiopersist.KeepAll(), mirror_keep_last=1
        )
    with pytest.raises(TypeError, match="Retention"):
        aiopersist.CheckpointManager(tmp_path / "c", retention=3)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_an_incomplete_step_is_not_trusted(tmp_path: Path) -> None:
    async with aiopersist.CheckpointManager(tmp_path) as mgr:
        await (await mgr.save(1, state_of(1))).done
        await (await mgr.save(2, state_of(2))).done
    # A step directory whose manifest is gone, and one whose data file is truncated.
    (tmp_path / "step-2" / "aiopersist.json").unlink()
    (tmp_path / "step-3").mkdir()
    mgr = aiopersist.CheckpointManager(tmp_path)
    try:
        assert mgr.steps() == [1]
        assert mgr.latest() == 1
        scan = {s.step: s for s in mgr.scan()}
        assert not scan[2].complete
        assert "aiopersist.json" in (scan[2].problem or "")
        back = await mgr.restore()
        assert back["step"] == 1
    finally:
        await mgr.aclose()


@pytest.mark.asyncio
async def test_start_removes_leftovers_of_crashes(tmp_path: Path) -> None:
    async with aiopersist.CheckpointManager(tmp_path) as mgr:
        await (await mgr.save(1, state_of(1))).done
    for name in (
        ".step-2.aiopersist-tmp-0123456789ab",
        f".step-1{TRASH_MARKER}0123456789ab",
        ".step-1.aiopersist-old-x",
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "junk").write_bytes(b"x")
    with caplog_at_info() as records:
        mgr = aiopersist.CheckpointManager(tmp_path)
        await mgr.aclose()
    assert _names(tmp_path) == ["step-1"]
    assert any("interrupted" in r.getMessage() for r in records)


class caplog_at_info:
    def __enter__(self) -> list[logging.LogRecord]:
        self.records: list[logging.LogRecord] = []
        self.handler = logging.Handler()
        self.handler.emit = self.records.append  # type: ignore[method-assign]
        self.logger = logging.getLogger("aiopersist")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_over_two_directories_and_orphan_parts(tmp_path: Path, backend: str) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    async with aiopersist.CheckpointManager(dirs, keep_last=1, backend=backend) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, {"w": torch.randn(1 << 19)})).done
        await mgr.wait()
        assert mgr.steps() == [2]
        assert _names(tmp_path / "b") == ["step-2"]  # step 1's part went with it
    orphan = tmp_path / "b" / "step-2" / "part-000000000000"
    orphan.mkdir()
    (tmp_path / "b" / "step-7" / "part-111111111111").mkdir(parents=True)
    mgr = aiopersist.CheckpointManager(dirs)
    await mgr.aclose()
    assert not orphan.exists()
    assert _names(tmp_path / "b") == ["step-2"]
    assert len(_names(tmp_path / "b" / "step-2")) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_mirror_tier_and_losing_the_local_disk(tmp_path: Path, backend: str) -> None:
    local, mirror = tmp_path / "local", tmp_path / "shared"
    async with aiopersist.CheckpointManager(
        local, keep_last=1, mirror=mirror, mirror_keep_last=2, backend=backend
    ) as mgr:
        for step in (1, 2, 3):
            handle = await mgr.save(step, state_of(step))
            await handle.done
            assert await handle.mirrored == str(mirror / f"step-{step}")
        await mgr.wait()
        assert _names(local) == ["step-3"]
        assert _names(mirror) == ["step-2", "step-3"]
        assert mgr.steps() == [2, 3]
    await aiopersist.verify(mirror / "step-2", backend=backend)
    # The local disk is lost: restore comes from the mirror.
    import shutil

    shutil.rmtree(local)
    mgr = aiopersist.CheckpointManager(local, mirror=mirror, backend=backend)
    try:
        assert mgr.latest() == 3
        back = await mgr.restore()
        assert back["step"] == 3
    finally:
        await mgr.aclose()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_mirror_of_a_checkpoint_over_two_directories_is_one_directory(
    tmp_path: Path, backend: str
) -> None:
    async with aiopersist.CheckpointManager(
        [tmp_path / "a", tmp_path / "b"], mirror=tmp_path / "m", backend=backend
    ) as mgr:
        await (await mgr.save(4, {"w": torch.randn(1 << 19), "n": 4})).mirrored
    copy = tmp_path / "m" / "step-4"
    assert sum(1 for n in _names(copy) if n.endswith(".safetensors")) == 2
    report = await aiopersist.verify(copy, backend=backend)
    assert all(str(copy) in f for f in report.files)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_mirror_unavailable_then_back(tmp_path: Path, backend: str) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")  # the mirror lies under a file: every attempt fails
    mirror = blocker / "mirror"
    async with aiopersist.CheckpointManager(tmp_path / "local", mirror=mirror, backend=backend) as mgr:
        with caplog_at_info() as records:
            for step in (1, 2):
                handle = await mgr.save(step, state_of(step))
                assert (await handle.done) is not None  # local saves go on
                with pytest.raises(aiopersist.CheckpointIOError):
                    await handle.mirrored
        assert any("mirroring step" in r.getMessage() for r in records)
        assert mgr.steps() == [1, 2]
        blocker.unlink()
        blocker.mkdir()  # the mirror is back
        with caplog_at_info() as records:
            handle = await mgr.save(3, state_of(3))
            assert await handle.mirrored == str(mirror / "step-3")
        # The catch-up says how far it is, step by step.
        said = [r.getMessage() for r in records]
        assert any("copying 3 steps" in m for m in said), said
        assert [m.split("; ")[1].split(",")[0] for m in said if " copied (" in m] == [
            "1 of 3 steps", "2 of 3 steps", "3 of 3 steps",
        ]  # fmt: skip
    assert _names(mirror) == ["step-1", "step-2", "step-3"]  # it caught up


@pytest.mark.root
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_disk_full_fails_the_save_keeps_the_rest(tmp_path: Path, backend: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)]
    if (await asyncio.to_thread(subprocess.run, mount, check=False)).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        async with aiopersist.CheckpointManager(disk, backend=backend) as mgr:
            await (await mgr.save(1, {"w": torch.full((1 << 18,), 1.0)})).done  # 1 MiB
            filler = disk / "filler"
            filler.write_bytes(b"\0" * (3 << 20))
            with pytest.raises(aiopersist.DiskFullError) as caught:
                await (await mgr.save(2, {"w": torch.full((1 << 19,), 2.0)})).done  # 2 MiB: no room
            assert caught.value.errno == 28  # ENOSPC
            assert mgr.steps() == [1]
            back = await mgr.restore()
            assert torch.equal(back["w"], torch.full((1 << 18,), 1.0))
            assert _names(disk) == ["filler", "step-1"]  # nothing half-written left
            filler.unlink()
            await (await mgr.save(2, {"w": torch.full((1 << 19,), 2.0)})).done
            assert mgr.steps() == [1, 2]
    finally:
        await asyncio.to_thread(subprocess.run, ["umount", str(disk)], check=False)


def test_blocking_manager(tmp_path: Path) -> None:
    with aiopersist.BlockingCheckpointManager(tmp_path, keep_last=1, mirror=tmp_path / "m") as mgr:
        handle = mgr.save(5, state_of(5))
        handle.wait_staged()
        assert handle.wait() is not None
        assert handle.wait_mirrored() == str(tmp_path / "m" / "step-5")
        assert handle.step == 5
        mgr.wait()
        assert mgr.steps() == [5]
        assert mgr.latest() == 5
        assert mgr.restore()["step"] == 5


# -- kill -9 ----------------------------------------------------------------------------------

_SAVER = textwrap.dedent(
    """
    import asyncio, sys, torch, aiopersist

    async def main(directory, backend):
        async with aiopersist.CheckpointManager(directory, keep_last=3, backend=backend) as mgr:
            step = (mgr.latest() or 0) + 1
            print("ready", flush=True)
            while True:
                state = {"w": torch.full((1 << 18,), float(step)), "step": step}
                handle = await mgr.save(step, state)
                await handle.done
                step += 1

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_kill_9_at_random_moments(tmp_path: Path, backend: str) -> None:
    """12 trials (each starts a Python that imports torch: about 2 s): a process saving in
    a loop is killed at a random moment; each time the newest complete step restores
    exactly what it saved, and no step directory is incomplete."""
    rng = random.Random(1234)
    directory = tmp_path / "ck"
    restored = []
    for _ in range(12):
        proc = popen([sys.executable, "-c", _SAVER, str(directory), backend], cwd=ROOT)
        try:
            assert (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)).strip() == b"ready"
            await asyncio.sleep(rng.uniform(0.0, 0.6))
        finally:
            proc.kill()
            await asyncio.to_thread(proc.communicate)
        mgr = aiopersist.CheckpointManager(directory, backend=backend)  # its start cleans up
        try:
            for info in mgr.scan():
                assert info.complete, info  # nothing half-written under a step's name
            assert not [n for n in _names(directory) if not n.startswith("step-")]
            latest = mgr.latest()
            if latest is not None:
                back = await mgr.restore()
                assert back["step"] == latest
                assert torch.equal(back["w"], torch.full((1 << 18,), float(latest)))
                restored.append(latest)
        finally:
            await mgr.aclose()
    assert len(set(restored)) >= 5  # the trials really did interrupt a running loop


@pytest.mark.asyncio
async def test_start_puts_back_a_step_moved_aside_by_an_interrupted_overwrite(tmp_path: Path) -> None:
    """Without renameat2, an overwrite moves the old step aside first: if the process dies
    before the new one is moved in, the next start puts the old one back."""
    async with aiopersist.CheckpointManager(tmp_path) as mgr:
        await (await mgr.save(1, state_of(1))).done
    (tmp_path / "step-1").rename(tmp_path / ".step-1.aiopersist-old-0123456789ab")
    mgr = aiopersist.CheckpointManager(tmp_path)
    try:
        assert mgr.steps() == [1]
        assert (await mgr.restore())["step"] == 1
    finally:
        await mgr.aclose()


async def _loop(mgr: aiopersist.CheckpointManager, to: int) -> int:
    """The docs' resume loop: restore if there is a step, then save each step up to ``to``;
    the step it started from."""
    start = 0
    if await mgr.alatest() is not None:
        start = (await mgr.restore())["step"]
    for step in range(start + 1, to + 1):
        await (await mgr.save(step, state_of(step))).done
    return start


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("damage", ["flipped", "truncated", "file lost"])
@pytest.mark.asyncio
async def test_a_run_that_fell_back_past_a_damaged_step_saves_that_step_again(
    tmp_path: Path, backend: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest step damaged (its data flipped: complete by its manifest, caught by the
    restore's checksums; truncated or a file lost: incomplete and proven broken):
    the resume loop restores the step before it and, reaching the damaged step, replaces
    it with a warning. It failed there with CheckpointExistsError, at every rerun."""
    run = tmp_path / "ck"
    async with aiopersist.CheckpointManager(run, backend=backend) as mgr:
        assert await _loop(mgr, 3) == 0
    data = run / "step-3" / "state.safetensors"
    if damage == "flipped":
        flip_byte(data)
    elif damage == "truncated":
        os.truncate(data, data.stat().st_size // 2)
    else:
        data.unlink()
    with caplog.at_level(logging.WARNING, logger="aiopersist"):
        async with aiopersist.CheckpointManager(run, backend=backend) as mgr:
            assert await _loop(mgr, 4) == 2
            assert mgr.steps() == [1, 2, 3, 4]
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("aiopersist: step 3 replaces ") and "damaged" in m for m in said), said
    await aiopersist.verify(run / "step-3", backend=backend)
    back = await aiopersist.load(run / "step-3", backend=backend)
    assert torch.equal(back["w"], state_of(3)["w"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_only_damaged_steps_are_no_silent_fresh_start(
    tmp_path: Path, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every step damaged: restore() raises CheckpointCorruptError listing each (not
    CheckpointNotFoundError, which a loop takes for a fresh start), latest() warns of
    each once, and a run started afresh regardless replaces them as it reaches them. A
    step that is not damaged but not loadable either (its manifest of a newer format) is
    never replaced unasked, nor is a step directory without a manifest (it may not be
    the manager's: only what its manifest proves broken is)."""
    run = tmp_path / "ck"
    async with aiopersist.CheckpointManager(run, backend=backend) as mgr:
        await _loop(mgr, 2)
    os.truncate(run / "step-1" / "state.safetensors", 10)
    (run / "step-2" / "state.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="aiopersist"):
        async with aiopersist.CheckpointManager(run, backend=backend) as mgr:
            with pytest.raises(aiopersist.CheckpointCorruptError) as caught:
                await mgr.restore()
            message = str(caught.value)
            assert "step-1/state.safetensors" in message
            assert "step-2/state.safetensors: missing" in message
            assert mgr.latest() is None
            assert mgr.latest() is None
            passed = [r.getMessage() for r in caplog.records if "latest() passes over" in r.getMessage()]
            assert len(passed) == 2, passed  # once each
            assert await _loop(mgr, 2) == 0
            assert mgr.steps() == [1, 2]
    # A newer format's step: refused to load, but not proven broken, so not replaced.
    doc = json.loads((run / "step-2" / "aiopersist.json").read_text())
    doc["version"] = 999
    (run / "step-2" / "aiopersist.json").write_text(json.dumps(doc))
    async with aiopersist.CheckpointManager(run, backend=backend) as mgr:
        assert (await mgr.restore())["step"] == 1
        with pytest.raises(aiopersist.CheckpointExistsError):
            await (await mgr.save(2, state_of(2))).done
    (run / "step-2" / "aiopersist.json").unlink()
    async with aiopersist.CheckpointManager(run, backend=backend) as mgr:
        with pytest.raises(aiopersist.CheckpointExistsError):
            await (await mgr.save(2, state_of(2))).done


# -- one manager per directory --------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_second_manager_on_the_directory_is_refused(tmp_path: Path, backend: str) -> None:
    """While a manager is open (here with a save in flight), another one on its directory
    raises at once, names the holder, and touches nothing; once the first is closed, the
    directory can be managed again."""
    first = aiopersist.CheckpointManager(tmp_path / "ck", backend=backend)
    try:
        await (await first.save(1, state_of(1))).done
        handle = await first.save(2, state_of(2))
        with pytest.raises(aiopersist.DirectoryInUseError) as info:
            aiopersist.CheckpointManager(tmp_path / "ck", backend=backend)
        assert info.value.directory == str(tmp_path / "ck")
        assert info.value.holder.startswith(f"pid {os.getpid()} on ")
        assert "another CheckpointManager" in str(info.value)
        await handle.done  # the refused manager's start-up cleanup did not run
        assert first.steps() == [1, 2]
    finally:
        await first.aclose()
    async with aiopersist.CheckpointManager(tmp_path / "ck", backend=backend) as again:
        assert (await again.restore())["step"] == 2


_HOLDER = textwrap.dedent(
    """
    import sys, aiopersist
    mgr = aiopersist.CheckpointManager(sys.argv[1], mirror=sys.argv[2])
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def test_a_manager_in_another_process_holds_its_directories_until_it_dies(tmp_path: Path) -> None:
    """A real second process: its directory and its mirror are refused to this one, and to
    `aiopersist gc --apply`; after kill -9 the kernel has dropped the lock."""
    local, mirror, other = tmp_path / "local", tmp_path / "mirror", tmp_path / "other"
    mirror.mkdir()
    with aiopersist.BlockingCheckpointManager(local) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_of(step)).wait()
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(local), str(mirror)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        with pytest.raises(aiopersist.DirectoryInUseError) as info:
            aiopersist.CheckpointManager(local)
        assert info.value.holder.startswith(f"pid {proc.pid} on ")
        # A manager of another directory that shares the mirror is refused too, and lets
        # go of the directory it had already locked.
        with pytest.raises(aiopersist.DirectoryInUseError) as info:
            aiopersist.CheckpointManager(other, mirror=mirror)
        assert info.value.directory == str(mirror)
        aiopersist.BlockingCheckpointManager(other).close()
        gc = run(
            [sys.executable, "-m", "aiopersist", "gc", str(local), "--keep-last", "1", "--apply"],
            cwd=ROOT, text=True, timeout=120,
        )  # fmt: skip
        assert gc.returncode == 1, gc.stdout + gc.stderr
        assert f"pid {proc.pid}" in gc.stderr
        assert _names(local) == ["step-1", "step-2", "step-3"]  # nothing deleted
    finally:
        proc.kill()
        proc.communicate()  # reaps it and closes the pipes
    gc = run(
        [sys.executable, "-m", "aiopersist", "gc", str(local), "--keep-last", "1", "--apply"],
        cwd=ROOT, text=True, timeout=120,
    )  # fmt: skip
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert _names(local) == ["step-3"]
    with aiopersist.BlockingCheckpointManager(local, mirror=mirror) as mgr:
        assert mgr.latest() == 3


def test_directory_in_use_error_pickles() -> None:
    import pickle

    exc = aiopersist.DirectoryInUseError("/ck", "pid 1 on h")
    back = pickle.loads(pickle.dumps(exc))
    assert (back.directory, back.holder, str(back)) == ("/ck", "pid 1 on h", str(exc))


def test_a_forked_child_does_not_keep_the_lock(tmp_path: Path) -> None:
    """A process forked while a manager is open (a DataLoader worker, say) closes its copy
    of the lock file at once: when the manager closes, the directory is free, though the
    child lives on."""
    mgr = aiopersist.BlockingCheckpointManager(tmp_path / "ck")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: waits until the parent is done, touching nothing else
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        mgr.close()
        aiopersist.BlockingCheckpointManager(tmp_path / "ck").close()
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def test_a_refused_argument_leaves_the_directory_unlocked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode") as info:
        aiopersist.CheckpointManager(tmp_path / "ck", mode="bogus")  # type: ignore[arg-type]
    assert info.value is not None  # the traceback (and the half-made manager) still alive
    aiopersist.BlockingCheckpointManager(tmp_path / "ck").close()


def test_a_lock_file_that_leads_elsewhere_is_never_written_through(tmp_path: Path) -> None:
    """The lock file is in the directory, so untrusted: planted as a symbolic link (to a
    user's file, or to nothing), the manager truncated the file it led to and wrote its
    pid there, or made the file it named (found by the fuzzing helper); ``gc --apply``
    the same. Now a link is refused (`LinkedFileError`) and left as it is, anything but a
    regular file too, and a hard-linked lock file is locked without being written."""
    victim = tmp_path / "victim.txt"
    victim.write_text("IMPORTANT USER DATA")
    run_dir = tmp_path / "run"
    with aiopersist.BlockingCheckpointManager(run_dir) as mgr:
        mgr.save(1, state_of(1)).wait()
    lock = run_dir / LOCK_NAME
    for target in (victim, tmp_path / "nothing-here"):
        lock.unlink()
        lock.symlink_to(target)
        with pytest.raises(aiopersist.LinkedFileError, match="lock file is a symbolic link"):
            aiopersist.BlockingCheckpointManager(run_dir)
        gc = run(
            [sys.executable, "-m", "aiopersist", "gc", str(run_dir), "--keep-last", "1", "--apply"],
            cwd=ROOT, text=True, timeout=120,
        )  # fmt: skip
        assert gc.returncode == 1, gc.stdout + gc.stderr
        assert "symbolic link" in gc.stderr, gc.stderr
        assert victim.read_text() == "IMPORTANT USER DATA"
        assert not (tmp_path / "nothing-here").exists()
        assert lock.is_symlink()
    lock.unlink()
    os.mkfifo(lock)
    with pytest.raises(aiopersist.CheckpointIOError, match="not a regular file"):
        aiopersist.BlockingCheckpointManager(run_dir)
    lock.unlink()
    os.link(victim, lock)
    with aiopersist.BlockingCheckpointManager(run_dir) as mgr:
        assert mgr.restore()["step"] == 1
        with pytest.raises(aiopersist.DirectoryInUseError):
            aiopersist.CheckpointManager(run_dir)  # still locked
    assert victim.read_text() == "IMPORTANT USER DATA"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_read_only_directory_is_managed_unlocked(
    tmp_path: Path, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory on a read-only mount (to restore from) cannot hold the lock file: the
    manager warns and goes on without the lock."""
    src = tmp_path / "src"
    with aiopersist.BlockingCheckpointManager(src, backend=backend) as mgr:
        mgr.save(5, state_of(5)).wait()
    os.remove(src / LOCK_NAME)  # the lock file the first manager left
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a bind mount here")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        with (
            caplog.at_level(logging.WARNING, logger="aiopersist"),
            aiopersist.BlockingCheckpointManager(ro, backend=backend) as mgr,
        ):
            assert mgr.restore()["step"] == 5
        assert "cannot be locked" in caplog.text
        assert "Read-only" in caplog.text
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


# -- what a step directory claims -----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_step_copied_under_another_name_is_not_taken_for_it(tmp_path: Path, backend: str) -> None:
    """``step-99`` holding step 1's checkpoint (its manifest records step 1) is not step
    99: not counted, not restored, and its retention does not make the real steps go."""
    directory = tmp_path / "ck"
    async with aiopersist.CheckpointManager(directory, backend=backend, keep_last=1) as mgr:
        await (await mgr.save(1, state_of(1))).wait()
        shutil.copytree(directory / "step-1", directory / "step-99")
        for step in (2, 3):
            await (await mgr.save(step, state_of(step))).wait()
        await mgr.wait()
        assert mgr.steps() == [3]
        assert _names(directory) == ["step-3", "step-99"]  # step-1 went by retention; the copy stays
        back = await mgr.restore()
        assert mgr.restored_step == 3
        assert back["step"] == 3
        info = next(s for s in mgr.scan() if s.step == 99)
        assert not info.complete
        assert not info.damaged  # it may be a good checkpoint of step 1: left alone
        assert "records step '1'" in (info.problem or "")


@pytest.mark.asyncio
async def test_the_step_just_committed_is_not_deleted_by_its_own_retention(tmp_path: Path) -> None:
    """Below a higher step (a run resumed from an older one), a save survives the
    retention that follows its commit: the newest save is always there."""
    async with aiopersist.CheckpointManager(tmp_path / "ck", keep_last=1) as mgr:
        await (await mgr.save(10, state_of(10))).wait()
        await (await mgr.save(5, state_of(5))).wait()
        await mgr.wait()
        assert mgr.steps() == [5, 10]
        assert (await mgr.restore(5))["step"] == 5


def test_the_manager_s_step_in_metadata_cannot_be_overridden(tmp_path: Path) -> None:
    async def main() -> None:
        async with aiopersist.CheckpointManager(tmp_path / "ck") as mgr:
            with pytest.raises(ValueError, match="'step' is the manager's"):
                await mgr.save(3, state_of(3), metadata={"step": "7"})
            await (await mgr.save(4, state_of(4), metadata={"step": "4", "run": "a"})).wait()
            assert mgr.steps() == [4]

    asyncio.run(main())
    assert _names(tmp_path / "ck") == ["step-4"]


@pytest.mark.parametrize("name", ["step-03", "step-\u0663", "step-\uff13", "step-3\n", "step-3 ", "step-+3"])
@pytest.mark.asyncio
async def test_names_that_are_not_canonical_are_no_steps(tmp_path: Path, name: str) -> None:
    """Only ``step-<digits>`` (ASCII, no leading zero, nothing after) is a step: a complete
    checkpoint under another name is neither counted nor deleted, and retention never
    takes the step of that number, which is another directory."""
    directory = tmp_path / "ck"
    await aiopersist.save(state_of(3), directory / name)
    (directory / "step-3").mkdir()  # incomplete: retention leaves it alone
    (directory / "step-3" / "notes.txt").write_text("mine")
    async with aiopersist.CheckpointManager(directory, keep_last=1) as mgr:
        for step in (4, 5):
            await (await mgr.save(step, state_of(step))).wait()
        await mgr.wait()
        assert mgr.steps() == [5]
    assert _names(directory) == sorted([name, "step-3", "step-5"])
    assert (directory / "step-3" / "notes.txt").read_text() == "mine"
    assert (await aiopersist.load(directory / name))["step"] == 3


@pytest.mark.asyncio
async def test_the_async_scans_run_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ascan``/``asteps``/``alatest`` give what the synchronous ones give, from a
    worker thread: the manifests are read there, never on the loop's thread."""
    import threading

    from aiopersist import _manager

    loop_thread = threading.get_ident()
    readers: set[int] = set()
    real = _manager._checked_step

    def watched(*args: Any, **kwargs: Any) -> Any:
        readers.add(threading.get_ident())
        return real(*args, **kwargs)

    async with aiopersist.CheckpointManager(tmp_path / "ck") as mgr:
        for step in (1, 2):
            await (await mgr.save(step, state_of(step))).wait()
        await mgr.wait()
        monkeypatch.setattr(_manager, "_checked_step", watched)
        assert await mgr.asteps() == [1, 2]
        assert await mgr.alatest() == 2
        assert [s.step for s in await mgr.ascan()] == [1, 2]
    assert readers
    assert loop_thread not in readers


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_step_waiting_for_the_mirror_is_not_deleted_locally_first(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a slow mirror, later steps commit while an earlier copy runs: a committed
    step whose own copy has not started yet is spared by their local retention, so every
    step the mirror's policy keeps reaches it (the mirror lost steps under load)."""
    from aiopersist import _manager

    real = _manager.copy_step

    def slow_copy(*args: Any) -> Any:
        time.sleep(0.3)  # a slow shared file system
        return real(*args)

    monkeypatch.setattr(_manager, "copy_step", slow_copy)
    local, mirror = tmp_path / "local", tmp_path / "shared"
    async with aiopersist.CheckpointManager(
        local, keep_last=1, mirror=mirror, mirror_retention=aiopersist.KeepAll(), backend=backend
    ) as mgr:
        for step in range(1, 6):
            await (await mgr.save(step, state_of(step))).done
        await mgr.wait()
    assert _names(local) == ["step-5"]
    assert _names(mirror) == [f"step-{s}" for s in range(1, 6)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_commits_during_a_pass_share_the_next_one(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each pass of retention and mirroring scans every step of both tiers: the commits
    that come while one runs share the next, instead of one pass each falling further
    behind (400 saves 20 ms apart: the close waited 62 s). Every step is still mirrored,
    every handle told, and the local retention ends as a pass per commit left it."""
    from aiopersist import _manager

    real = _manager.copy_step

    def slow_copy(*args: Any) -> Any:
        time.sleep(0.3)  # a slow shared file system
        return real(*args)

    monkeypatch.setattr(_manager, "copy_step", slow_copy)
    passes = 0
    sync = _manager.CheckpointManager._sync_mirror

    async def counted(self: Any) -> None:
        nonlocal passes
        passes += 1
        await sync(self)

    monkeypatch.setattr(_manager.CheckpointManager, "_sync_mirror", counted)
    local, mirror = tmp_path / "local", tmp_path / "shared"
    async with aiopersist.CheckpointManager(
        local, keep_last=2, mirror=mirror, mirror_keep_last=5, backend=backend
    ) as mgr:
        handles = [await mgr.save(step, state_of(step)) for step in range(1, 9)]
        for h in handles:
            await h.done
        await mgr.wait()
    assert passes <= 3, passes  # one per commit before
    told = [await h.mirrored for h in handles]
    # Steps 1-3: mirrored, or dropped by the mirror's retention (which depends on the pass
    # their commit fell in); the five newest are there.
    assert all(p in (None, str(mirror / f"step-{s}")) for s, p in zip(range(1, 4), told, strict=False)), told
    assert told[3:] == [str(mirror / f"step-{s}") for s in range(4, 9)], told
    assert _names(local) == ["step-7", "step-8"]
    assert _names(mirror) == [f"step-{s}" for s in range(4, 9)]


async def _w(path: Path, backend: str) -> float:
    return float((await aiopersist.load(path, backend=backend))["w"][0, 0])


@pytest.mark.root
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_step_retention_cannot_delete_stops_neither_the_others_nor_the_mirror(
    tmp_path: Path, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """step-1 made immutable (``chattr +i``: even root cannot delete it): retention says so
    and goes on; the mirror still gets every step (a failing deletion used to end the
    pass: nothing more was deleted or mirrored, ever, and asyncio reported the task)."""
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr")
    local, mirror = tmp_path / "local", tmp_path / "shared"
    step1 = local / "step-1"
    try:
        async with aiopersist.CheckpointManager(local, keep_last=1, mirror=mirror, backend=backend) as mgr:
            await (await mgr.save(1, state_of(1))).mirrored
            immutable = await asyncio.to_thread(
                subprocess.run, ["chattr", "+i", str(step1)], capture_output=True
            )
            if immutable.returncode != 0:
                pytest.skip("the file system does not take chattr +i")
            handles = [await mgr.save(s, state_of(s)) for s in (2, 3, 4)]
            told = [await h.mirrored for h in handles]
        assert told == [str(mirror / f"step-{s}") for s in (2, 3, 4)]
        assert _names(mirror) == [f"step-{s}" for s in range(1, 5)]
        assert _names(local) == ["step-1", "step-4"]
        assert "retention could not delete" in caplog.text
        assert "never retrieved" not in caplog.text
    finally:
        await asyncio.to_thread(subprocess.run, ["chattr", "-i", str(step1)], check=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_step_saved_again_reaches_the_mirror_as_saved_again(tmp_path: Path, backend: str) -> None:
    """``overwrite=True`` of a step the mirror has: the mirror's copy is replaced too (it
    kept the old one, complete by its manifest, and ``mirrored`` named it). Also while
    another step's pass runs during the new save: that pass leaves the step to its own."""
    from aiopersist import _manager

    local, mirror = tmp_path / "local", tmp_path / "shared"
    async with aiopersist.CheckpointManager(local, mirror=mirror, backend=backend) as mgr:
        await (await mgr.save(5, state_of(1))).mirrored
        assert await (await mgr.save(5, state_of(2), overwrite=True)).mirrored == str(mirror / "step-5")
        assert await _w(mirror / "step-5", backend) == 2.0
        real = _manager.copy_step

        def slow_copy(*args: Any) -> Any:
            time.sleep(0.3)
            return real(*args)

        _manager.copy_step = slow_copy
        try:
            h6 = await mgr.save(6, state_of(6))
            h5 = await mgr.save(5, state_of(3), overwrite=True)  # in flight while step 6's pass copies
            assert await h6.mirrored == str(mirror / "step-6")
            assert await h5.mirrored == str(mirror / "step-5")
        finally:
            _manager.copy_step = real
    assert await _w(local / "step-5", backend) == 3.0
    assert await _w(mirror / "step-5", backend) == 3.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_step_whose_mirroring_failed_is_tried_again_before_retention_takes_it(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first copy to the mirror fails (EIO): step 1's handle says so, and the log that
    it is tried again after the next save, which it is, before the local retention
    (``keep_last=1``) deletes it (it deleted it first: the mirror never had step 1)."""
    import errno

    from aiopersist import _manager

    real = _manager.copy_step
    calls = []

    def failing_once(*args: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(*args)

    monkeypatch.setattr(_manager, "copy_step", failing_once)
    local, mirror = tmp_path / "local", tmp_path / "shared"
    async with aiopersist.CheckpointManager(local, keep_last=1, mirror=mirror, backend=backend) as mgr:
        with pytest.raises(aiopersist.CheckpointIOError):
            await (await mgr.save(1, state_of(1))).mirrored
        assert _names(local) == ["step-1"]
        assert await (await mgr.save(2, state_of(2))).mirrored == str(mirror / "step-2")
    assert "tried again after the next save" in caplog.text
    assert _names(mirror) == ["step-1", "step-2"]
    assert _names(local) == ["step-2"]


@pytest.mark.asyncio
async def test_a_pass_cancelled_before_it_starts_leaves_nothing_waiting(tmp_path: Path) -> None:
    """The manager closed (its tasks cancelled) in the same turn a pass was started: the
    pass never runs its own cleanup, so the commits waiting on it and the next one are
    ended and the manager is not left thinking a pass runs."""
    mgr = aiopersist.CheckpointManager(tmp_path / "local", mirror=tmp_path / "shared", backend="threads")
    loop = asyncio.get_running_loop()
    mgr._pass_steps.append(1)
    mgr._pass_next = loop.create_future()
    outcome = mgr._pass_next
    mgr._start_pass()
    (task,) = list(mgr._tasks)
    mgr._pass_steps.append(2)  # a commit queued for the next pass
    mgr._pass_next = nxt = loop.create_future()
    task.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert task.cancelled()
    assert outcome.cancelled()
    assert nxt.cancelled()
    assert not mgr._pass_running
    assert mgr._pass_steps == []
    await mgr.aclose()


def _record_allocations(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Weak references to every tensor a load allocates from now on."""
    import weakref

    import aiopersist._load as load_module

    allocated: list[Any] = []
    allocate = load_module._allocate

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = allocate(*args, **kwargs)
        allocated.append(weakref.ref(t))
        return t

    monkeypatch.setattr(load_module, "_allocate", recording)
    return allocated


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_restore_falling_back_lets_go_of_the_failed_step_s_tensors_first(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newest step fails its checksum: before the older step is loaded, every tensor
    the failed attempt allocated is gone, without the cyclic collector. The kept error's
    frames held them, so a fallback needed memory for two states at once (on a machine
    with room for one and a half, NotEnoughMemoryError instead of the older step)."""
    import gc

    import aiopersist._manager as manager_module

    run = tmp_path / "ck"
    async with aiopersist.CheckpointManager(run, backend=backend) as mgr:
        await _loop(mgr, 2)
    flip_byte(run / "step-2" / "state.safetensors")

    allocated = _record_allocations(monkeypatch)
    alive_at_attempt: list[int] = []
    load = manager_module.load

    async def spying(*args: Any, **kwargs: Any) -> Any:
        alive_at_attempt.append(sum(r() is not None for r in allocated))
        return await load(*args, **kwargs)

    monkeypatch.setattr(manager_module, "load", spying)
    gc.collect()
    gc.disable()
    try:
        async with aiopersist.CheckpointManager(run, backend=backend) as mgr:
            back = await mgr.restore()
    finally:
        gc.enable()
    assert back["step"] == 1
    assert allocated  # the failed attempt did allocate its tensors
    assert alive_at_attempt == [0, 0], alive_at_attempt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_what_a_save_never_replaces_unasked(tmp_path: Path, backend: str) -> None:
    """Only what restore proved damaged in the local copy, once: not a step directory
    without a manifest (a Hugging Face directory the user put there), not a local step of
    a newer format whose mirror copy is the damaged one, not a step a second time after
    the replacement (restore's verdict served one save)."""
    run, mirror = tmp_path / "ck", tmp_path / "mirror"
    async with aiopersist.CheckpointManager(run, mirror=mirror, backend=backend) as mgr:
        await _loop(mgr, 3)
    # A user's directory named like a step, with no manifest.
    (run / "step-5").mkdir()
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4)}, str(run / "step-5" / "model.safetensors"))
    (run / "step-5" / "notes.txt").write_text("mine")
    # Step 2: newer format locally (not damage), damaged in the mirror.
    doc = json.loads((run / "step-2" / "aiopersist.json").read_text())
    doc["version"] = 999
    (run / "step-2" / "aiopersist.json").write_text(json.dumps(doc))
    flip_byte(mirror / "step-2" / "state.safetensors")
    # Step 3: damaged locally and in the mirror.
    flip_byte(run / "step-3" / "state.safetensors")
    flip_byte(mirror / "step-3" / "state.safetensors")
    async with aiopersist.CheckpointManager(run, mirror=mirror, backend=backend) as mgr:
        assert (await mgr.restore())["step"] == 1
        for step in (5, 2):
            with pytest.raises(aiopersist.CheckpointExistsError):
                await (await mgr.save(step, state_of(step))).done
        await (await mgr.save(3, state_of(3))).done  # replaces the damaged one
        with pytest.raises(aiopersist.CheckpointExistsError):
            await (await mgr.save(3, state_of(4))).done  # but not twice
    assert sorted(os.listdir(run / "step-5")) == ["model.safetensors", "notes.txt"]
    assert json.loads((run / "step-2" / "aiopersist.json").read_text())["version"] == 999
    back = await aiopersist.load(run / "step-3", backend=backend)
    assert torch.equal(back["w"], state_of(3)["w"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_failed_load_lets_go_of_its_tensors_without_the_collector(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    await aiopersist.save(state_of(1), tmp_path / "ck", backend=backend)
    flip_byte(tmp_path / "ck" / "state.safetensors")
    allocated = _record_allocations(monkeypatch)
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(aiopersist.CheckpointCorruptError):
            await aiopersist.load(tmp_path / "ck", backend=backend)
        alive = sum(r() is not None for r in allocated)
    finally:
        gc.enable()
    assert allocated
    assert alive == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_step_saved_again_over_damage_replaces_the_mirror_s_damaged_copy_too(
    tmp_path: Path, backend: str
) -> None:
    """Both copies of step 2 damaged: restore falls back to step 1; the save of step 2
    replaces the local copy, and the mirror's copy (complete by its manifest, so the
    catch-up used to pass it over) is replaced as well."""
    run, mirror = tmp_path / "ck", tmp_path / "mirror"
    async with aiopersist.CheckpointManager(run, mirror=mirror, backend=backend) as mgr:
        await _loop(mgr, 2)
    flip_byte(run / "step-2" / "state.safetensors")
    flip_byte(mirror / "step-2" / "state.safetensors")
    async with aiopersist.CheckpointManager(run, mirror=mirror, backend=backend) as mgr:
        assert await _loop(mgr, 2) == 1
        await mgr.wait()
    for tier in (run, mirror):
        await aiopersist.verify(tier / "step-2", backend=backend)
        back = await aiopersist.load(tier / "step-2", backend=backend)
        assert torch.equal(back["w"], state_of(2)["w"])
