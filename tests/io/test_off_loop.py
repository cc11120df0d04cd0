"""The event loop's thread only orchestrates: the work that grows with the state (the
snapshot's views and copies, mapping and unmapping its memory, truncating a file to its
size, the many small writes of ``torch.save``) runs in worker threads, or reaches the
loop in batches. Each test records which threads did the work."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import aiopersist
from aiopersist import _save, _stream
from aiopersist._direct import AlignedBuffer
from aiopersist._stream import FileWriter

pytestmark = pytest.mark.asyncio


def _state(n: int = 200) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((100 + i,), float(i)) for i in range(n)}  # lengths unaligned


async def test_snapshot_views_copies_and_memory_are_handled_off_the_loop(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = threading.get_ident()
    views: set[int] = set()
    closed: set[int] = set()
    real_frombuffer = torch.frombuffer
    real_close = AlignedBuffer.close

    def frombuffer(*args: Any, **kwargs: Any) -> torch.Tensor:
        views.add(threading.get_ident())
        return real_frombuffer(*args, **kwargs)

    areas: list[AlignedBuffer] = []

    def close(self: AlignedBuffer) -> None:
        if any(self is a for a in areas):
            closed.add(threading.get_ident())
        real_close(self)

    monkeypatch.setattr(torch, "frombuffer", frombuffer)
    monkeypatch.setattr(AlignedBuffer, "close", close)
    state = _state()
    extra = {"optim.pt": aiopersist.TorchSave({"m": [torch.ones(3), torch.zeros(5)]})}
    ck = aiopersist.Checkpointer(backend=backend_name, mode="snapshot")
    try:
        for i in range(2):
            handle = await ck.save(state, tmp_path / f"ck{i}", extra_files=extra)
            await handle.done
        areas.extend(ck._snapshots)
        assert areas
    finally:
        await ck.aclose()
    assert views
    assert loop_thread not in views
    assert closed
    assert loop_thread not in closed
    back = await aiopersist.load(tmp_path / "ck1")
    assert all(torch.equal(back[k], v) for k, v in state.items())


async def test_truncating_a_direct_io_file_to_its_size_is_off_the_loop(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = threading.get_ident()
    callers: set[int] = set()
    real = os.ftruncate

    def ftruncate(fd: int, length: int) -> None:
        callers.add(threading.get_ident())
        real(fd, length)

    monkeypatch.setattr(os, "ftruncate", ftruncate)
    await aiopersist.save(_state(3), tmp_path / "ck", backend=backend_name)
    if not aiopersist.probe_directory(str(tmp_path)).direct:
        pytest.skip("no direct I/O here: nothing is padded, nothing truncated")
    assert callers
    assert loop_thread not in callers
    back = await aiopersist.load(tmp_path / "ck", backend=backend_name)
    assert all(torch.equal(back[k], v) for k, v in _state(3).items())


async def test_torch_save_s_small_writes_reach_the_loop_in_batches(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An optimizer-like state of 12,000 small tensors (several batches): ``torch.save`` writes it in
    thousands of pieces; the writer on the loop gets a few batches, and the file is
    byte for byte what ``torch.save`` writes."""
    calls = 0
    real = FileWriter.write

    async def write(self: FileWriter, data: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        await real(self, data, **kwargs)

    monkeypatch.setattr(FileWriter, "write", write)
    optim = {
        "state": {i: {"exp_avg": torch.full((7,), float(i)), "step": torch.tensor(i)} for i in range(6000)}
    }
    await aiopersist.save(
        {"w": torch.ones(2)},
        tmp_path / "ck",
        backend=backend_name,
        extra_files={"optim.pt": aiopersist.TorchSave(optim)},
    )
    size = (tmp_path / "ck" / "optim.pt").stat().st_size
    assert calls <= size // _save._SINK_BATCH + 4  # batches, and the other files' writes
    back = torch.load(tmp_path / "ck" / "optim.pt", weights_only=True)
    assert back["state"].keys() == optim["state"].keys()
    assert all(torch.equal(back["state"][i]["exp_avg"], optim["state"][i]["exp_avg"]) for i in (0, 777, 5999))
    await aiopersist.verify(tmp_path / "ck")


@pytest.mark.parametrize("layout", ["aiopersist", "safetensors-file"])
async def test_a_load_allocates_and_parses_headers_off_the_loop(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """One allocation per tensor, the parse of a header (megabytes of JSON for a large
    model), planning the reads, laying out the requests and rebuilding the state run in
    worker threads."""
    from aiopersist import _load

    state = _state()
    if layout == "aiopersist":
        await aiopersist.save(state, tmp_path / "ck", backend=backend_name)
        path = tmp_path / "ck"
    else:
        from safetensors.torch import save_file

        save_file(state, str(tmp_path / "m.safetensors"))
        path = tmp_path / "m.safetensors"
    loop_thread = threading.get_ident()
    seen: dict[str, set[int]] = {
        "_allocate": set(),
        "parse_header": set(),
        "plan_read": set(),
        "plan_safetensors": set(),
        "_rebuild": set(),
    }

    def watched(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen[name].add(threading.get_ident())
            return real(*args, **kwargs)

        return call

    for name in seen:
        monkeypatch.setattr(_load, name, watched(name, getattr(_load, name)))
    # A view of each span's memory, and the requests for them (200 segments: more than
    # read_segments lays out on the loop).
    seen["memory"], seen["_lay_out_segments"] = set(), set()
    monkeypatch.setattr(_load._Destinations, "memory", watched("memory", _load._Destinations.memory))
    monkeypatch.setattr(_stream, "_lay_out_segments", watched("_lay_out_segments", _stream._lay_out_segments))
    back = await aiopersist.load(path, backend=backend_name)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert seen["_allocate"]
    assert seen["memory"]
    assert seen["_lay_out_segments"]
    if layout == "aiopersist":  # the manifest describes the file
        assert seen["plan_read"]
        assert seen["_rebuild"]
    else:
        assert seen["parse_header"]
        assert seen["plan_safetensors"]
    assert loop_thread not in set().union(*seen.values())


async def test_safetensors_extra_files_are_checked_and_laid_out_off_the_loop(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `SafetensorsSave` file's tensors are checked (before anything is written) and its
    header built (when it is written) in worker threads: O(tensors) Python each."""
    loop_thread = threading.get_ident()
    callers: list[int] = []
    real = _save.safetensors_parts

    def parts(*args: Any, **kwargs: Any) -> Any:
        callers.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(_save, "safetensors_parts", parts)
    second = _state(50)
    extra = {"model_1.safetensors": aiopersist.SafetensorsSave(second, {"format": "pt"})}
    await aiopersist.save(_state(), tmp_path / "ck", extra_files=extra, backend=backend_name)
    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        await (await ck.save(_state(), tmp_path / "ck2", extra_files=extra)).done
    assert len(callers) == 4  # checked, then written, by each save
    assert loop_thread not in callers
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "ck2" / "model_1.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in second.items())
