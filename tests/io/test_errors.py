"""Errors keep their type. Every system call aiopersist makes is failed in turn (the n-th
call of each ``os`` function, from aiopersist's own code, raises ``EIO``) under every
public operation, on both backends: each failure must come out as a `CheckpointIOError`
with its errno, never a bare ``OSError`` or another type, and must lose nothing already
saved. Then the errors that are not the system's: a full disk inside a ``TorchSave`` file,
unpicklable objects, nested tensors, deep containers, and ``inspect`` printing names from
a checkpoint."""

from __future__ import annotations

import builtins
import errno
import io
import os
import sys
from collections.abc import Awaitable, Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import aiopersist
from aiopersist._cli import main as cli

OS_CALLS = (
    "open",
    "close",
    "read",
    "pread",
    "pwrite",
    "preadv",
    "fsync",
    "fdatasync",
    "fstat",
    "stat",
    "lstat",
    "listdir",
    "mkdir",
    "rmdir",
    "rename",
    "replace",
    "unlink",
    "ftruncate",
)


class Faults:
    """Counts the calls of ``os`` functions (and ``open``) made by aiopersist's own code,
    and fails the ``nth`` call of ``armed`` with ``EIO``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: dict[str, int] = {}
        self.armed: tuple[str, int] | None = None
        self.fired = False
        for name in OS_CALLS:
            monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))
        monkeypatch.setattr(builtins, "open", self._wrap("builtins.open", builtins.open))

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("aiopersist"):
                n = self.counts[name] = self.counts.get(name, 0) + 1
                if self.armed == (name, n):
                    self.fired = True
                    raise OSError(errno.EIO, f"injected EIO in {name}", "injected")
            return real(*args, **kwargs)

        return call

    def arm(self, name: str | None, nth: int = 0) -> None:
        self.counts = {}
        self.fired = False
        self.armed = None if name is None else (name, nth)


def _state(fill: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((256, 64), fill), "b": torch.full((64,), fill)}, "step": int(fill)}


Operation = Callable[[Path, str], Awaitable[None]]


async def _save(tmp: Path, backend: str) -> None:
    await aiopersist.save(_state(2), tmp / "c", backend=backend, overwrite=True)


async def _save_two_dirs(tmp: Path, backend: str) -> None:
    await aiopersist.save(_state(2), [tmp / "c2", tmp / "d2" / "c2"], backend=backend, overwrite=True)


async def _load(tmp: Path, backend: str) -> None:
    back = await aiopersist.load(tmp / "c", backend=backend)
    assert back["step"] == 1


async def _load_two_dirs(tmp: Path, backend: str) -> None:
    await aiopersist.load(tmp / "c2", backend=backend)


async def _verify(tmp: Path, backend: str) -> None:
    await aiopersist.verify(tmp / "c", backend=backend)


async def _checkpointer(tmp: Path, backend: str) -> None:
    async with aiopersist.Checkpointer(backend=backend, mode="snapshot") as ck:
        extra = {"optimizer.pt": aiopersist.TorchSave({"m": torch.ones(8)})}
        handle = await ck.save(_state(2), tmp / "c", overwrite=True, extra_files=extra)
        await handle.done


async def _manager(tmp: Path, backend: str) -> None:
    async with aiopersist.CheckpointManager(
        [tmp / "run", tmp / "run-b"], keep_last=1, mirror=tmp / "mirror", backend=backend
    ) as mgr:
        handle = await mgr.save(mgr.latest() + 1, _state(2))  # type: ignore[operator]
        await handle.done
        await handle.mirrored
        await mgr.restore()


async def _inspect_and_ls(tmp: Path, backend: str) -> None:
    from aiopersist._cli.main import describe
    from aiopersist._manager import scan

    describe(tmp / "c")
    describe(tmp / "c2")
    scan([str(tmp / "run"), str(tmp / "run-b")])


OPERATIONS: dict[str, Operation] = {
    "save": _save,
    "save over two directories": _save_two_dirs,
    "load": _load,
    "load over two directories": _load_two_dirs,
    "verify": _verify,
    "Checkpointer (snapshot, TorchSave)": _checkpointer,
    "CheckpointManager (two dirs, mirror, retention, restore)": _manager,
    "inspect, ls": _inspect_and_ls,
}


async def _prepare(tmp: Path, backend: str) -> None:
    await aiopersist.save(_state(1), tmp / "c", backend=backend, overwrite=True)
    await aiopersist.save(_state(1), [tmp / "c2", tmp / "d2" / "c2"], backend=backend, overwrite=True)
    async with aiopersist.CheckpointManager(
        [tmp / "run", tmp / "run-b"], keep_last=1, mirror=tmp / "mirror", backend=backend
    ) as mgr:
        await (await mgr.save(0, _state(1))).done


async def _intact(tmp: Path, backend: str) -> None:
    """What was saved before is still there, whole: either the old or the new state."""
    for path in (tmp / "c", tmp / "c2"):
        back = await aiopersist.load(path, backend=backend)
        assert back["step"] in (1, 2), path
    async with aiopersist.CheckpointManager([tmp / "run", tmp / "run-b"], mirror=tmp / "mirror") as mgr:
        assert mgr.latest() is not None
        await mgr.restore()


@pytest.mark.asyncio
@pytest.mark.parametrize("operation", list(OPERATIONS))
async def test_every_failed_system_call_is_a_checkpoint_io_error(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    run = OPERATIONS[operation]
    await _prepare(tmp_path, backend_name)
    faults = Faults(monkeypatch)
    faults.arm(None)
    await run(tmp_path, backend_name)  # which calls the operation makes, how often
    reached = dict(faults.counts)
    assert reached, "the fault injector saw no system call"
    tried = 0
    for name, count in sorted(reached.items()):
        for nth in sorted({1, 2, count // 2, count - 1, count} - {0}):
            faults.arm(name, nth)
            outcome: BaseException | None = None
            try:
                await run(tmp_path, backend_name)
            except BaseException as exc:
                outcome = exc
            typed = isinstance(outcome, aiopersist.CheckpointIOError) and outcome.errno == errno.EIO
            if outcome is not None and not typed:
                kind = type(outcome).__name__
                pytest.fail(f"{operation}: EIO in call {nth} of {name} came out as {kind}: {outcome}")
            if faults.fired:
                tried += 1
            faults.arm(None)
            await _intact(tmp_path, backend_name)
    assert tried >= len(reached)
    print(f"{operation}: {tried} failed system calls, each typed and losing nothing")


# -- errors that are not the system's ----------------------------------------------------------


@pytest.mark.asyncio
async def test_disk_full_inside_a_torch_save_file_is_disk_full(backend_name: str, small_fs: Path) -> None:
    """ENOSPC while torch.save streams ``optimizer.pt`` surfaced as torch's RuntimeError;
    it is `DiskFullError`, and nothing is left behind."""
    big = {"state": {i: {"exp_avg": torch.ones(256, 1024)} for i in range(8)}}  # 8 MiB > 4 MiB
    with pytest.raises(aiopersist.DiskFullError) as info:
        await aiopersist.save(
            {"w": torch.ones(8)},
            small_fs / "ckpt",
            backend=backend_name,
            extra_files={"optimizer.pt": aiopersist.TorchSave(big)},
        )
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(small_fs) == []
    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        handle = await ck.save(
            {"w": torch.ones(8)}, small_fs / "ckpt", extra_files={"optimizer.pt": aiopersist.TorchSave(big)}
        )
        with pytest.raises(aiopersist.DiskFullError):
            await handle.done
    assert os.listdir(small_fs) == []


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle a live socket")


@pytest.mark.asyncio
async def test_unpicklable_objects_name_their_path(backend_name: str, tmp_path: Path) -> None:
    state = {"model": {"w": torch.ones(4)}, "extras": [1, {"sock": _Unpicklable()}], "fn": lambda: 1}
    with pytest.raises(
        aiopersist.UnsupportedStateError, match=r"state\['extras'\]\[1\]\['sock'\]: cannot be pickled"
    ):
        await aiopersist.save(state, tmp_path / "c", backend=backend_name, allow_pickle=True)
    del state["extras"]
    with pytest.raises(aiopersist.UnsupportedStateError, match=r"state\['fn'\]: cannot be pickled"):
        await aiopersist.save(state, tmp_path / "c", backend=backend_name, allow_pickle=True)
    assert os.listdir(tmp_path) == []
    with pytest.raises(aiopersist.UnsupportedStateError, match=r"extra_files\['x\.pt'\]: torch\.save failed"):
        await aiopersist.save(
            {"w": torch.ones(2)},
            tmp_path / "c",
            backend=backend_name,
            extra_files={"x.pt": aiopersist.TorchSave({"sock": _Unpicklable()})},
        )
    assert os.listdir(tmp_path) == []


@pytest.mark.asyncio
async def test_nested_and_exotic_tensors_are_refused_by_path(backend_name: str, tmp_path: Path) -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(aiopersist.UnsupportedStateError, match=r"state\['n'\]: nested tensors"):
        await aiopersist.save({"n": nested}, tmp_path / "c", backend=backend_name)
    with pytest.raises(aiopersist.UnsupportedStateError, match=r"state\['s'\]: torch\.sparse_coo"):
        await aiopersist.save({"s": torch.eye(3).to_sparse()}, tmp_path / "c", backend=backend_name)
    with pytest.raises(aiopersist.UnsupportedStateError, match=r"state\['m'\]: tensors on meta"):
        await aiopersist.save({"m": torch.empty(3, device="meta")}, tmp_path / "c", backend=backend_name)
    # A wrapper subclass has no storage of its own (its data pointer is 0): never read from.
    two = TwoTensor(torch.ones(4, 3), torch.zeros(4, 3))
    with pytest.raises(
        aiopersist.UnsupportedStateError, match=r"state\['w'\]\['t'\]: a TwoTensor has no storage"
    ):
        await aiopersist.save({"w": {"t": two}}, tmp_path / "c", backend=backend_name)
    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        with pytest.raises(aiopersist.UnsupportedStateError, match=r"a TwoTensor has no storage"):
            await ck.save({"t": two}, tmp_path / "c")
    assert os.listdir(tmp_path) == []


@pytest.mark.asyncio
async def test_deep_objects_in_snapshot_mode_extra_files(backend_name: str, tmp_path: Path) -> None:
    """A TorchSave object nested deeper than a rebuild may walk is serialized whole (or
    refused with a typed error when torch.save cannot), never a RecursionError."""
    deep: Any = {"leaf": torch.ones(2)}
    for _ in range(400):
        deep = {"x": deep}
    async with aiopersist.Checkpointer(backend=backend_name, mode="snapshot") as ck:
        handle = await ck.save(
            {"w": torch.ones(2)}, tmp_path / "c", extra_files={"d.pt": aiopersist.TorchSave(deep)}
        )
        await handle.done
    back = torch.load(tmp_path / "c" / "d.pt", weights_only=True)
    for _ in range(400):
        back = back["x"]
    assert torch.equal(back["leaf"], torch.ones(2))
    for _ in range(5000):
        deep = {"x": deep}
    async with aiopersist.Checkpointer(backend=backend_name, mode="snapshot") as ck:
        with pytest.raises(aiopersist.UnsupportedStateError, match=r"extra_files\['d\.pt'\]"):
            handle = await ck.save(
                {"w": torch.ones(2)}, tmp_path / "e", extra_files={"d.pt": aiopersist.TorchSave(deep)}
            )
            await handle.done
    assert not (tmp_path / "e").exists()


@pytest.mark.asyncio
async def test_inspect_escapes_control_characters(backend_name: str, tmp_path: Path) -> None:
    hostile = "w\x1b]0;owned\x07\x1b[2J\r\nfake line\u202e"
    await aiopersist.save(
        {hostile: torch.ones(2), "n": 1},
        tmp_path / "c",
        backend=backend_name,
        metadata={"k\x1b[31m": "v\x00\x9b"},
    )
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli(["inspect", str(tmp_path / "c")]) == 0
    text = out.getvalue()
    assert not any(ch in text for ch in "\x1b\x07\r\x00\x9b\u202e")
    assert "w\\x1b]0;owned\\x07\\x1b[2J\\r\\nfake line\\u202e" in text
    assert "k\\x1b[31m: v\\x00\\x9b" in text
