"""save / load of a flat mapping of CPU tensors, on both backends."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import aiopersist
from tests._launch import popen, run

pytestmark = pytest.mark.asyncio


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(64, 48)
    return {
        "f32": torch.randn(300, 77),
        "bf16": torch.randn(129, 3, dtype=torch.bfloat16),
        "f16": torch.randn(5, dtype=torch.float16),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "i8": torch.randint(-128, 127, (33,), dtype=torch.int8),
        "u8": torch.randint(0, 255, (1000,), dtype=torch.uint8),
        "i64": torch.arange(10),
        "bool": torch.rand(17) > 0.5,
        "f8": torch.randn(16).to(torch.float8_e4m3fn),
        "f8e5m2": torch.randn(16).to(torch.float8_e5m2),
        "f8fnuz": torch.randn(16).to(torch.float8_e4m3fnuz),
        "f8e5m2fnuz": torch.randn(16).to(torch.float8_e5m2fnuz),
        "f8e8m0": torch.rand(16).to(torch.float8_e8m0fnu),
        "c64": torch.randn(4, dtype=torch.complex64),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "transposed": base.t(),  # non-contiguous
        "strided": base[::3, 1::2],
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # compare bytes, so that NaN payloads and float8 compare exactly
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


async def test_round_trip_every_dtype(backend_name: str, io_mode: str, tmp_path: Path) -> None:
    state = _state()
    info = await aiopersist.save(state, tmp_path / "ckpt", backend=backend_name, metadata={"step": "3"})
    assert info.backend == backend_name
    assert info.files == ("model.safetensors", "aiopersist.json")
    assert info.bytes_written == sum((tmp_path / "ckpt" / f).stat().st_size for f in info.files)
    loaded = await aiopersist.load(tmp_path / "ckpt", backend=backend_name)
    assert list(loaded) == list(state)
    for k in state:
        assert _same(loaded[k], state[k]), k
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what Hugging Face's loaders ask for
        for k in state:  # safetensors' own reader: every dtype under its name
            assert _same(f.get_tensor(k), state[k]), k
    # nothing left beside the checkpoint
    assert os.listdir(tmp_path) == ["ckpt"]


async def test_load_plain_safetensors_file(backend_name: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    state = {"a": torch.randn(10, 10), "b": torch.arange(5, dtype=torch.int32)}
    save_file(state, str(tmp_path / "plain.safetensors"))
    loaded = await aiopersist.load(tmp_path / "plain.safetensors", backend=backend_name)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def _cyclic() -> dict[str, object]:
    d: dict[str, object] = {"x": 1}
    d["self"] = d
    return d


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"a": object()}, r"state\['a'\]: builtins\.object is not a tensor"),
        (
            {"optim": {"param_groups": [{"lr": 0.1, "betas": {0.9, 0.99}}]}},
            r"state\['optim'\]\['param_groups'\]\[0\]\['betas'\]: builtins\.set",
        ),
        ({"s": torch.zeros(2).to_sparse()}, r"state\['s'\]: torch\.sparse_coo"),
        ({"k": {frozenset(): 1}}, r"state\['k'\]: dict key frozenset\(\)"),
        ({"c": _cyclic()}, r"state\['c'\]\['self'\]: the object contains itself"),
        ({"e": torch.zeros(2, dtype=torch.complex128)}, r"state\['e'\]: dtype torch\.complex128"),
    ],
)
async def test_unsupported_state_names_the_key(state: object, match: str, tmp_path: Path) -> None:
    with pytest.raises(aiopersist.UnsupportedStateError, match=match):
        await aiopersist.save(state, tmp_path / "x")  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()
    assert os.listdir(tmp_path) == []


async def test_existing_path_needs_overwrite(backend_name: str, tmp_path: Path) -> None:
    await aiopersist.save({"a": torch.zeros(3)}, tmp_path / "c", backend=backend_name)
    with pytest.raises(aiopersist.CheckpointExistsError):
        await aiopersist.save({"a": torch.ones(3)}, tmp_path / "c", backend=backend_name)
    assert isinstance(aiopersist.CheckpointExistsError("x"), FileExistsError)
    loaded = await aiopersist.load(tmp_path / "c", backend=backend_name)
    assert torch.equal(loaded["a"], torch.zeros(3))
    await aiopersist.save({"a": torch.ones(3)}, tmp_path / "c", backend=backend_name, overwrite=True)
    loaded = await aiopersist.load(tmp_path / "c", backend=backend_name)
    assert torch.equal(loaded["a"], torch.ones(3))
    assert os.listdir(tmp_path) == ["c"]


async def test_missing_checkpoint(backend_name: str, tmp_path: Path) -> None:
    with pytest.raises(aiopersist.CheckpointNotFoundError):
        await aiopersist.load(tmp_path / "nothing", backend=backend_name)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(aiopersist.CheckpointNotFoundError, match=r"model\.safetensors"):
        await aiopersist.load(tmp_path / "emptydir", backend=backend_name)


async def test_truncated_checkpoint_is_corrupt(backend_name: str, tmp_path: Path) -> None:
    await aiopersist.save({"a": torch.randn(1000)}, tmp_path / "c", backend=backend_name)
    f = tmp_path / "c" / "model.safetensors"
    os.truncate(f, f.stat().st_size - 10)
    with pytest.raises(aiopersist.CheckpointCorruptError, match=r"model\.safetensors"):
        await aiopersist.load(tmp_path / "c", backend=backend_name)


@pytest.mark.root
async def test_disk_full_keeps_the_older_checkpoint(
    backend_name: str, small_fs: Path, space_check: str
) -> None:
    old = {"a": torch.randn(1000)}
    await aiopersist.save(old, small_fs / "c", backend=backend_name)
    with pytest.raises(aiopersist.DiskFullError) as info:
        await aiopersist.save(
            {"a": torch.randn(4 << 20)}, small_fs / "c", backend=backend_name, overwrite=True
        )
    assert info.value.errno == 28
    assert ("nothing was written" in str(info.value)) == (space_check == "checked"), info.value
    assert sorted(os.listdir(small_fs)) == ["c"]  # no temporary directory left
    loaded = await aiopersist.load(small_fs / "c", backend=backend_name)
    assert torch.equal(loaded["a"], old["a"])
    # after freeing space, saving works again
    await aiopersist.save({"a": torch.randn(100)}, small_fs / "d", backend=backend_name)


@pytest.mark.root
async def test_a_view_claiming_more_than_the_disk_holds_is_refused_before_writing(
    backend_name: str, small_fs: Path
) -> None:
    """A model's weights are written in the Hugging Face layout, views materialized: a view
    of 4 bytes claiming 4 TiB (stride 0) would be streamed until the disk is full. The
    free space is checked first: DiskFullError, nothing written (the old code wrote the
    4 MiB file system full before failing)."""
    model = torch.nn.Linear(4, 4)
    kept = model.weight.detach().clone()
    await aiopersist.save(model, small_fs / "c", backend=backend_name)
    model.weight = torch.nn.Parameter(torch.ones(1).expand(1 << 40).view(1 << 20, 1 << 20))  # 4 TiB
    with pytest.raises(aiopersist.DiskFullError, match="nothing was written") as info:
        await aiopersist.save(model, small_fs / "c", backend=backend_name, overwrite=True)
    assert info.value.errno == 28
    assert sorted(os.listdir(small_fs)) == ["c"]
    assert torch.equal((await aiopersist.load(small_fs / "c", backend=backend_name))["weight"], kept)


async def test_killed_save_leaves_no_final_directory(tmp_path: Path) -> None:
    """kill -9 in the middle of a save: nothing under the final name, older one intact."""
    await aiopersist.save({"a": torch.arange(10)}, tmp_path / "old")
    script = f"""
import asyncio, os, sys, torch, aiopersist
from aiopersist import _commit
real = _commit.publish
def publish_then_die(tmp, final, overwrite, discard=None):
    os.kill(os.getpid(), 9)  # die after every byte is written, right before the rename
_commit.publish = publish_then_die
asyncio.run(aiopersist.save({{"a": torch.randn(1 << 20)}}, {str(tmp_path / "new")!r}))
"""
    proc = await asyncio.to_thread(run, [sys.executable, "-c", script], timeout=120)
    assert proc.returncode == -9
    assert not (tmp_path / "new").exists()
    leftovers = [n for n in os.listdir(tmp_path) if n != "old"]
    assert all(".aiopersist-tmp-" in n for n in leftovers)
    assert torch.equal((await aiopersist.load(tmp_path / "old"))["a"], torch.arange(10))


@pytest.mark.root
async def test_load_from_read_only_file_system(backend_name: str, tmp_path: Path) -> None:
    """Loading needs no write access (the direct-I/O probe reads the file itself)."""
    import subprocess as sp

    from aiopersist import _direct

    src = tmp_path / "src"
    state = {"a": torch.randn(5000)}
    await aiopersist.save(state, src / "c", backend=backend_name)
    ro = tmp_path / "ro"
    ro.mkdir()

    def mount(*args: str) -> int:
        return sp.run(["mount", *args], capture_output=True, check=False).returncode

    if await asyncio.to_thread(mount, "--bind", str(src), str(ro)) != 0:
        pytest.skip("cannot make a bind mount here")
    try:
        await asyncio.to_thread(mount, "-o", "remount,bind,ro", str(ro))
        with pytest.raises(OSError, match="Read-only"):
            (ro / "probe").write_bytes(b"x")  # the mount really is read-only
        _direct._cache.clear()
        loaded = await aiopersist.load(ro / "c", backend=backend_name)
        assert torch.equal(loaded["a"], state["a"])
    finally:
        await asyncio.to_thread(sp.run, ["umount", "-l", str(ro)], check=False)


async def test_large_tensors_load_straight_into_their_memory(
    backend_name: str, io_mode: str, tmp_path: Path
) -> None:
    torch.manual_seed(1)
    state = {
        "odd": torch.randint(0, 255, (4097,), dtype=torch.uint8),  # puts the next ones off-page
        "big": torch.randn(1536, 1024),  # 6 MiB
        "big_bf16": torch.randn(3, 1024, 1024, dtype=torch.bfloat16),
        "tail": torch.randn(7),
    }
    await aiopersist.save(state, tmp_path / "c", backend=backend_name)
    loaded = await aiopersist.load(tmp_path / "c", backend=backend_name)
    for k in state:
        assert _same(loaded[k], state[k]), k
    big = loaded.pop("big")
    del loaded
    big.mul_(2)  # an ordinary, writable tensor that outlives everything else (x2 is exact)
    assert torch.equal(big, state["big"] * 2)


async def test_kill_9_at_random_moments_keeps_a_whole_checkpoint(tmp_path: Path) -> None:
    """A process overwriting one checkpoint in a loop is killed at random moments: what is
    under the final name is always one complete save, never a mix or a half."""
    import random
    import signal

    script = f"""
import os, sys, torch, aiopersist
path = {str(tmp_path / "c")!r}
step = 0
while True:
    step += 1
    w, v = torch.full((4, 1 << 20), float(step)), torch.full((1000,), float(step))
    state = {{"step": step, "w": w, "v": v}}
    aiopersist.save_sync(state, path, overwrite=True)
    print(step, flush=True)
"""
    rng = random.Random(1234)
    for _trial in range(5):
        proc = popen([sys.executable, "-c", script])
        await asyncio.to_thread(proc.stdout.readline)  # one save is complete
        await asyncio.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.communicate)
        await aiopersist.verify(tmp_path / "c")
        back = await aiopersist.load(tmp_path / "c")
        step = back["step"]
        assert torch.equal(back["w"], torch.full((4, 1 << 20), float(step)))
        assert torch.equal(back["v"], torch.full((1000,), float(step)))
        assert not [n for n in os.listdir(tmp_path) if n != "c" and ".aiopersist-tmp-" not in n]


async def test_a_cancelled_load_into_leaves_the_target_alone_once_cancelled(
    backend_name: str, tmp_path: Path
) -> None:
    """``load(into=...)`` cancelled while it copies into the live tensors: the copy ran on
    in its thread after ``CancelledError`` reached the caller, whose handler then saw the
    target change under it (found by the cancellation helper). Now the cancelled load
    waits for the copy to end before raising, as the rest of the engine does."""
    state = {f"t{i:02d}": torch.full((1 << 20,), float(i + 1)) for i in range(48)}  # 192 MiB
    await aiopersist.save(state, tmp_path / "ck", backend=backend_name)

    def loaded(target: dict[str, torch.Tensor]) -> int:
        return sum(1 for v in target.values() if v[-1].item() != 0)

    for _ in range(20):  # until a cancel lands during the copy
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        task = asyncio.ensure_future(aiopersist.load(tmp_path / "ck", into=target, backend=backend_name))
        for _turn in range(1_000_000):  # the loop's turns until the copy shows
            if loaded(target) or task.done():
                break
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            continue  # the load ended before the cancel came: try again
        seen = loaded(target)
        await asyncio.sleep(0.2)
        assert loaded(target) == seen, "the target changed after the cancelled load returned"
        return
    pytest.skip("no cancel landed during the copy in 20 tries")


async def test_a_level_triggered_cancellation_leaves_no_backend_behind(
    backend_name: str, tmp_path: Path
) -> None:
    """Saves, loads and verifies cancelled by anyio's cancel scopes (the cancellation comes
    again at every await, so it also met the backend's close): the threads backend's
    worker threads were left running, 8 more for each one (found by the cancellation
    helper), and a cancelled io_uring close could skip closing its ring. Now every
    backend is gone when the call ends: no thread, no descriptor left."""
    import threading

    import anyio

    state = {f"t{i}": torch.randn(4 << 20) for i in range(4)}  # 64 MiB
    path = tmp_path / "ck"
    await aiopersist.save(state, path, backend=backend_name)

    def io_threads() -> int:
        return sum(t.name.startswith("aiopersist-io") for t in threading.enumerate())

    threads, fds = io_threads(), len(os.listdir("/proc/self/fd"))
    caught = 0
    for i in range(4):
        for call in (
            lambda: aiopersist.save(state, path, backend=backend_name, overwrite=True),
            lambda: aiopersist.load(path, backend=backend_name),
            lambda: aiopersist.verify(path, backend=backend_name),
        ):
            with anyio.move_on_after(0.002 + 0.004 * i) as scope:
                await call()
            caught += scope.cancelled_caught
    assert caught  # the cancellations landed
    assert io_threads() == threads
    assert len(os.listdir("/proc/self/fd")) == fds
    await aiopersist.verify(path, backend=backend_name)  # and the checkpoint is whole
