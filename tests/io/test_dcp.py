"""torch.distributed.checkpoint through aiopersist's writer and reader in one process, on
both backends: what it writes is DCP's format (DCP's own reader reads it, and aiopersist's
reads DCP's own), checksummed and published whole; damaged and hostile directories are
refused with a typed error before anything is acted on."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter

import aiopersist
from aiopersist.integrations.dcp import AiopersistReader, AiopersistWriter
from tests._launch import run

pytestmark = pytest.mark.filterwarnings("ignore")


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 48, generator=g)
    return {
        "model": {
            "w": torch.randn(300, 200, generator=g),
            "bf": torch.randn(33, 7, generator=g).to(torch.bfloat16),
            "t": base.t(),  # not contiguous: written in row-major order, as DCP would
            "view": base[3:9],  # a view into a bigger storage: only its own bytes
            "empty": torch.empty(0, 5),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "i": torch.arange(17, dtype=torch.int32),
        },
        "step": 42,
        "extra": {"lr": [1e-3, 3e-4], "name": "run"},
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {
            k: torch.zeros_like(v) if v.dim() else torch.tensor(0.0, dtype=v.dtype)
            for k, v in state["model"].items()
        },
        "step": 0,
        "extra": {"lr": [], "name": ""},
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ma, mb = a["model"], b["model"]
    tensors = all(ma[k].dtype == mb[k].dtype and torch.equal(ma[k], mb[k]) for k in ma)
    return tensors and a["step"] == b["step"] and a["extra"] == b["extra"]


def _load(path: Path, reader: Any) -> dict[str, Any]:
    target = _zeros_like(_state())
    dcp.load(target, checkpoint_id=str(path), storage_reader=reader)
    return target


def _refused(fn: Any, match: str) -> str:
    """DCP wraps a rank's error in its CheckpointException (a BaseException): the message
    must name what was wrong."""
    with pytest.raises(BaseException) as info:  # noqa: PT011 - DCP's wrapper, checked below
        fn()
    text = str(info.value)
    assert match in text, text
    return text


def test_a_round_trip_through_the_writer_and_both_readers(backend_name: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    state = _state()
    dcp.save(state, checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name))
    assert sorted(os.listdir(ck)) == [".metadata", "__0_0.distcp", "aiopersist.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # nothing beside it
    assert _same(_load(ck, AiopersistReader(backend=backend_name)), state)
    assert _same(_load(ck, FileSystemReader(str(ck))), state)  # no lock-in: DCP's own reader
    report = asyncio.run(aiopersist.verify(ck, backend=backend_name))
    assert sorted(Path(f).name for f in report.files) == [".metadata", "__0_0.distcp"]
    doc = json.loads((ck / "aiopersist.json").read_text())
    assert doc["layout"] == "dcp"
    # One checksummed entry per value written, tiling nothing but what DCP points at.
    assert len(doc["entries"]["__0_0.distcp"]) == 10
    # inspect lists the tensors from DCP's metadata.
    from aiopersist._cli.main import describe

    rows = {t["name"]: t for t in describe(ck)["tensors"]}
    assert sorted(rows) == sorted(f"model.{k}" for k in state["model"])
    assert rows["model.w"]["shape"] == [300, 200]
    assert rows["model.bf"]["dtype"] == "BF16"


def test_the_metadata_records_the_checkpoint_as_filesystemwriter_does(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``storage_meta.checkpoint_id`` is the directory as it was named, a ``Path``, as
    ``FileSystemWriter`` records it (a relative name stays relative)."""
    monkeypatch.chdir(tmp_path)
    metas = {}
    for name, writer in (
        ("stock", FileSystemWriter("stock")),
        ("ours", AiopersistWriter(backend=backend_name)),
    ):
        dcp.save(_state(), checkpoint_id=name, storage_writer=writer)
        metas[name] = FileSystemReader(name).read_metadata().storage_meta
    for name, meta in metas.items():
        assert type(meta.checkpoint_id) is type(metas["stock"].checkpoint_id), name
        assert meta.checkpoint_id == Path(name)
    ours = AiopersistReader(tmp_path / "ours", backend=backend_name).read_metadata().storage_meta
    assert ours.checkpoint_id == Path("ours")  # the reader's own unpickler takes the Path too


def test_a_replaced_checkpoint_is_deleted_off_the_saves_clock(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``overwrite=True``: the replaced checkpoint is deleted in the background after the
    new one is published (the save returns without waiting for it); until then it is a
    temporary-marked leftover beside the checkpoint, and the next publication waits for
    it, so that at most one replaced checkpoint is ever pending."""
    import threading

    from aiopersist.integrations import dcp as aio_dcp

    gate = threading.Event()
    real = aio_dcp.remove_path

    def held(path: str) -> None:
        assert gate.wait(60)
        real(path)

    monkeypatch.setattr(aio_dcp, "remove_path", held)
    ck = tmp_path / "ck"
    for seed in (0, 1):
        writer = AiopersistWriter(overwrite=True, backend=backend_name)
        dcp.save(_state(seed), checkpoint_id=str(ck), storage_writer=writer)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ck"]
    assert len(leftovers) == 1  # its deletion waits
    assert leftovers[0].startswith(".ck.aiopersist-tmp-")
    assert _same(_load(ck, AiopersistReader(backend=backend_name)), _state(1))
    third = threading.Thread(
        target=dcp.save,
        args=(_state(2),),
        kwargs={
            "checkpoint_id": str(ck),
            "storage_writer": AiopersistWriter(overwrite=True, backend=backend_name),
        },
    )
    third.start()
    third.join(1.0)
    assert third.is_alive()  # its publication waits for the pending deletion
    gate.set()
    third.join(60)
    aio_dcp._wait_deletions()
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert _same(_load(ck, AiopersistReader(backend=backend_name)), _state(2))


SLOW_OVERWRITES = """
import os, sys, time
sys.path.insert(0, {root!r})
import torch, torch.distributed.checkpoint as dcp
from aiopersist.integrations import dcp as aio_dcp
from tests.io.test_dcp import _state

real = aio_dcp.remove_path


def slow(path):  # a deletion as slow as a large checkpoint's
    time.sleep({seconds})
    real(path)


aio_dcp.remove_path = slow
for seed in range({saves}):  # each replaces the one before: its deletion in the background
    writer = aio_dcp.AiopersistWriter(overwrite=True, backend={b!r})
    dcp.save(_state(seed), checkpoint_id={ck!r}, storage_writer=writer)
"""
"""A script's start: ``saves`` overwrites of ``ck``, each replaced checkpoint's deletion
taking ``seconds``."""


def test_an_exit_right_after_an_overwrite_leaves_no_replaced_checkpoint(
    backend_name: str, tmp_path: Path
) -> None:
    root = str(Path(__file__).resolve().parents[2])
    script = SLOW_OVERWRITES.format(root=root, ck=str(tmp_path / "ck"), b=backend_name, seconds=0.5, saves=3)
    proc = run([sys.executable, "-c", script], cwd=root, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # the exit waited for the deletion
    assert _same(_load(tmp_path / "ck", FileSystemReader(str(tmp_path / "ck"))), _state(2))


def test_dcps_own_directory_is_read_through_the_engine(backend_name: str, tmp_path: Path) -> None:
    ck = tmp_path / "stock"
    state = _state(1)
    dcp.save(state, checkpoint_id=str(ck), storage_writer=FileSystemWriter(str(ck)))
    assert _same(_load(ck, AiopersistReader(backend=backend_name)), state)


def test_dcps_own_directory_saved_without_collectives_is_read(backend_name: str, tmp_path: Path) -> None:
    # FileSystemWriter with use_collectives=False writes __<rank>.metadata and no .metadata;
    # DCP's load then asks the reader for the rank's own metadata.
    ck = tmp_path / "stock"
    state = _state(1)
    dcp.save(state, storage_writer=FileSystemWriter(str(ck)), use_collectives=False)
    assert sorted(p.name for p in ck.iterdir()) == ["__0.metadata", "__0_0.distcp"]
    assert _same(_load(ck, AiopersistReader(backend=backend_name)), state)


def test_checkpoint_ids_are_told_apart_as_filesystemwriter_tells_them(tmp_path: Path) -> None:
    for cid in ("s3://bucket/ck", "abc://abc.abc", str(tmp_path / "ck"), tmp_path / "ck"):
        for ours, stock in ((AiopersistWriter, FileSystemWriter), (AiopersistReader, FileSystemReader)):
            assert ours.validate_checkpoint_id(cid) == stock.validate_checkpoint_id(cid), (ours, cid)
    assert not AiopersistWriter.validate_checkpoint_id("s3://bucket/ck")


def test_checkpoint_id_is_told_as_filesystemreader_and_writer_tell_it(tmp_path: Path) -> None:
    """``checkpoint_id``: the directory as it was named (a ``Path``), given to the
    constructor or to ``reset``, as DCP's own reader and writer have it."""
    for ours, stock in ((AiopersistWriter, FileSystemWriter), (AiopersistReader, FileSystemReader)):
        for named in (str(tmp_path / "ck"), tmp_path / "ck", "relative/ck"):
            mine, theirs = ours(named), stock(named)
            assert mine.checkpoint_id == theirs.checkpoint_id, (ours, named)
            assert isinstance(mine.checkpoint_id, Path)
            mine.reset(tmp_path / "other")
            theirs.reset(tmp_path / "other")
            assert mine.checkpoint_id == theirs.checkpoint_id == tmp_path / "other"


def test_an_existing_checkpoint_is_kept_unless_overwrite(backend_name: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save(_state(0), checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name))
    _refused(
        lambda: dcp.save(
            _state(1), checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name)
        ),
        "already exists",
    )
    assert _same(_load(ck, AiopersistReader()), _state(0))
    dcp.save(
        _state(1),
        checkpoint_id=str(ck),
        storage_writer=AiopersistWriter(overwrite=True, backend=backend_name),
    )
    assert _same(_load(ck, AiopersistReader()), _state(1))
    from aiopersist.integrations.dcp import _wait_deletions

    _wait_deletions()  # the old one goes in the background
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the old one went, and no temp


def test_an_empty_directory_is_taken_as_filesystemwriter_takes_it(backend_name: str, tmp_path: Path) -> None:
    # tempfile.mkdtemp() named as the checkpoint: FileSystemWriter writes into it, whatever
    # overwrite says; it holds no checkpoint to keep.
    ck = tmp_path / "ck"
    ck.mkdir()
    dcp.save(_state(0), checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name))
    assert _same(_load(ck, FileSystemReader(str(ck))), _state(0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    # A directory holding anything is still refused, and kept as it was.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    _refused(
        lambda: dcp.save(_state(1), checkpoint_id=str(other), storage_writer=AiopersistWriter()),
        "already exists",
    )
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_an_empty_directory_filled_during_the_save_is_kept(backend_name: str, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    ck = tmp_path / "ck"
    ck.mkdir()

    class FillsTheDirectory(DefaultSavePlanner):
        """Something else writes into the directory while the save runs."""

        def resolve_data(self, write_item: Any) -> Any:
            (ck / "late.txt").write_text("written meanwhile")
            return super().resolve_data(write_item)

    _refused(
        lambda: dcp.save(
            _state(0),
            checkpoint_id=str(ck),
            storage_writer=AiopersistWriter(backend=backend_name),
            planner=FillsTheDirectory(),
        ),
        "already exists",
    )
    assert [p.name for p in ck.iterdir()] == ["late.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temporary directory left


def test_overwrite_never_deletes_what_is_no_checkpoints(backend_name: str, tmp_path: Path) -> None:
    # FileSystemWriter writes beside a model.pt or a config.json in the directory; replacing
    # the directory whole would delete them: refused, and everything kept.
    ck = tmp_path / "ck"
    dcp.save(_state(0), checkpoint_id=str(ck), storage_writer=FileSystemWriter(str(ck)))
    torch.save({"x": 1}, ck / "model.pt")
    before = sorted(p.name for p in ck.iterdir())
    _refused(
        lambda: dcp.save(
            _state(1),
            checkpoint_id=str(ck),
            storage_writer=AiopersistWriter(overwrite=True, backend=backend_name),
        ),
        "model.pt",
    )
    from aiopersist.integrations.dcp import _wait_deletions

    _wait_deletions()
    assert sorted(p.name for p in ck.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert _same(_load(ck, AiopersistReader()), _state(0))
    # A checkpoint alone (DCP's, or with its rank-local metadata) is replaced as before.
    (ck / "model.pt").unlink()
    dcp.save(
        _state(1),
        checkpoint_id=str(ck),
        storage_writer=AiopersistWriter(overwrite=True, backend=backend_name),
    )
    assert _same(_load(ck, FileSystemReader(str(ck))), _state(1))


@pytest.mark.root
@pytest.mark.parametrize("space_check", ["on", "off"])
def test_a_full_disk_fails_the_save_and_keeps_the_old_checkpoint(
    backend_name: str, small_fs: Path, space_check: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before anything is written, as `aiopersist.save` refuses it (the free space
    checked first); with the check off, when the write meets the full disk."""
    if space_check == "off":
        monkeypatch.setenv("AIOPERSIST_SPACE_CHECK", "0")
    ck = small_fs / "ck"
    small = {"model": {"w": torch.ones(100)}, "step": 1}
    dcp.save(small, checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name))
    big = {"model": {"w": torch.ones(2 << 20)}, "step": 2}  # 8 MiB on a 4 MiB file system
    writer = AiopersistWriter(overwrite=True, backend=backend_name)
    text = _refused(lambda: dcp.save(big, checkpoint_id=str(ck), storage_writer=writer), "DiskFullError")
    written = [f.stat().st_size for t in small_fs.glob(".*aiopersist-tmp-*") for f in t.iterdir()]
    if space_check == "on":
        assert "nothing was written" in text
        assert sum(written) == 0
    target = {"model": {"w": torch.zeros(100)}, "step": 0}
    dcp.load(target, checkpoint_id=str(ck), storage_reader=AiopersistReader(backend=backend_name))
    assert target["step"] == 1
    assert torch.equal(target["model"]["w"], torch.ones(100))
    # DCP raised without calling finish: the failed save's directory is still there, until
    # the same writer's next save removes it.
    assert [p.name for p in small_fs.iterdir() if ".aiopersist-tmp-" in p.name]
    dcp.save({"model": {"w": torch.ones(100) * 3}, "step": 3}, checkpoint_id=str(ck), storage_writer=writer)
    from aiopersist.integrations.dcp import _wait_deletions

    _wait_deletions()  # the checkpoint it replaced is deleted in the background
    assert sorted(p.name for p in small_fs.iterdir()) == ["ck"]


def test_a_damaged_entry_is_refused_by_the_reader_and_by_verify(backend_name: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save(_state(), checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name))
    data = ck / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # inside the big tensor's bytes
    data.write_bytes(bytes(raw))
    _refused(lambda: _load(ck, AiopersistReader(backend=backend_name)), "checksum mismatch")
    with pytest.raises(aiopersist.CheckpointCorruptError, match="checksum mismatch"):
        asyncio.run(aiopersist.verify(ck, backend=backend_name))


def test_damaged_metadata_is_refused_before_it_is_unpickled(backend_name: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save(_state(), checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name))
    meta = ck / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[-3] ^= 0x01
    meta.write_bytes(bytes(raw))
    _refused(lambda: _load(ck, AiopersistReader(backend=backend_name)), "checksum mismatch")


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_metadata_cannot_run_anything(backend_name: str, tmp_path: Path) -> None:
    """A DCP directory without aiopersist's manifest (DCP's own, or one forged) is read
    through a restricted unpickler: a ``.metadata`` that names anything but DCP's classes
    is refused, and nothing it names runs."""
    ck = tmp_path / "stock"
    dcp.save(_state(), checkpoint_id=str(ck), storage_writer=FileSystemWriter(str(ck)))
    marker = tmp_path / "pwned"
    (ck / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    _refused(lambda: _load(ck, AiopersistReader(backend=backend_name)), "not part of DCP's metadata")
    assert not marker.exists()


def test_storage_records_that_point_outside_are_refused(backend_name: str, tmp_path: Path) -> None:
    ck = tmp_path / "stock"
    dcp.save(_state(), checkpoint_id=str(ck), storage_writer=FileSystemWriter(str(ck)))
    with open(ck / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    (tmp_path / "outside.distcp").write_bytes(b"x" * 100)
    for index, info in list(metadata.storage_data.items())[:1]:
        metadata.storage_data[index] = type(info)("../outside.distcp", 0, 10)
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))
    _refused(
        lambda: _load(ck, AiopersistReader(backend=backend_name)), "would escape the checkpoint directory"
    )
    metadata.storage_data[index] = type(info)("__0_0.distcp", 0, 1 << 40)
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))
    _refused(lambda: _load(ck, AiopersistReader(backend=backend_name)), "run past the end")


def test_aiopersist_load_points_a_dcp_directory_to_dcp(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save(_state(), checkpoint_id=str(ck), storage_writer=AiopersistWriter())
    with pytest.raises(aiopersist.UnsupportedStateError, match=r"torch\.distributed\.checkpoint\.load"):
        asyncio.run(aiopersist.load(ck))
    # And the DCP reader does not take a plain aiopersist checkpoint for a DCP directory.
    plain = tmp_path / "plain"
    aiopersist.save_sync({"w": torch.ones(3)}, plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _refused(
            lambda: dcp.load(
                {"w": torch.zeros(3)}, checkpoint_id=str(plain), storage_reader=AiopersistReader()
            ),
            "not a torch.distributed.checkpoint directory",
        )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_written_from_the_gpu(backend_name: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(3000, 1000, device="cuda", generator=g)
    state = {"model": {"w": w, "t": w[:100].t()}, "step": 3}
    dcp.save(state, checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name))
    target = {"model": {"w": torch.zeros(3000, 1000), "t": torch.zeros(1000, 100)}, "step": 0}
    dcp.load(target, checkpoint_id=str(ck), storage_reader=FileSystemReader(str(ck)))
    assert torch.equal(target["model"]["w"], w.cpu())
    assert torch.equal(target["model"]["t"], w[:100].t().cpu())


def test_bytes_entries_are_dcps_own_bytes(tmp_path: Path) -> None:
    """A value that is not a tensor is written as DCP's planner serialized it: stock
    ``torch.load`` of the entry gives it back."""
    ck = tmp_path / "ck"
    dcp.save({"cfg": {"a": [1, 2]}}, checkpoint_id=str(ck), storage_writer=AiopersistWriter())
    with open(ck / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    [info] = metadata.storage_data.values()
    blob = (ck / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    assert torch.load(io.BytesIO(blob), weights_only=False) == [1, 2]


def test_fence_stager_copies_nothing_and_the_fence_holds(backend_name: str, tmp_path: Path) -> None:
    """async_save with the fence stager hands DCP the live tensors (no copy) and copies
    the rest (containers, values that are not tensors); once wait_staged returns,
    changing the tensors in place (the optimizer step) does not change what is written,
    and the rest may change at once."""
    from aiopersist.integrations.dcp import FenceStager

    ck = tmp_path / "ck"
    state = _state()
    state["model"]["big"] = torch.randn(4096, 1024)  # 16 MiB: many staging buffers
    expected = {k: v.clone() for k, v in state["model"].items()}
    staged = FenceStager(AiopersistWriter()).stage(state)
    assert all(staged["model"][k] is v for k, v in state["model"].items())  # the live tensors
    assert staged["extra"] == state["extra"]
    assert staged["extra"]["lr"] is not state["extra"]["lr"]  # the rest: copied
    writer = AiopersistWriter(backend=backend_name)
    stager = FenceStager(writer)
    upload = dcp.async_save(state, checkpoint_id=str(ck), storage_writer=writer, async_stager=stager)
    state["step"] += 1  # training goes on at once: values that are not tensors
    state["extra"]["lr"][0] = 0.5
    state["extra"]["name"] = "changed"
    stager.wait_staged(upload)
    for t in state["model"].values():
        if t.numel() and t.dtype.is_floating_point:
            t.add_(1.0)  # the optimizer step, in place
    upload.result()
    target = _zeros_like(_state())
    target["model"]["big"] = torch.zeros(4096, 1024)
    dcp.load(target, checkpoint_id=str(ck), storage_reader=AiopersistReader(backend=backend_name))
    for k, v in expected.items():
        assert torch.equal(target["model"][k], v), k
    assert target["step"] == 42
    assert target["extra"] == {"lr": [1e-3, 3e-4], "name": "run"}


def test_fence_stager_ends_the_wait_with_the_saves_error(tmp_path: Path) -> None:
    from aiopersist.integrations.dcp import FenceStager

    ck = tmp_path / "ck"
    dcp.save(_state(), checkpoint_id=str(ck), storage_writer=AiopersistWriter())
    writer = AiopersistWriter()  # no overwrite: the save fails in DCP's planning
    stager = FenceStager(writer)
    upload = dcp.async_save(_state(), checkpoint_id=str(ck), storage_writer=writer, async_stager=stager)
    _refused(lambda: stager.wait_staged(upload, timeout=60), "already exists")
    with pytest.raises(TypeError, match="AiopersistWriter"):
        FenceStager(FileSystemWriter(str(ck)))  # type: ignore[arg-type]
    armed = FenceStager(AiopersistWriter())
    armed.stage({})
    with pytest.raises(RuntimeError, match="has not staged yet"):
        armed.stage({})  # a second save before the first one's fence


def test_fence_stager_ends_the_wait_when_this_ranks_writer_fails(backend_name: str, tmp_path: Path) -> None:
    """A failure in this rank's writer before its write starts (a value DCP cannot
    serialize, an existing checkpoint refused while claiming) ends the wait even without
    ``upload`` (as ``synchronize_staging`` waits), and the stager takes the next save."""
    from aiopersist.integrations.dcp import FenceStager

    ck = tmp_path / "ck"
    writer = AiopersistWriter(backend=backend_name)
    stager = FenceStager(writer)
    upload = dcp.async_save(
        {"w": torch.ones(4), "bad": _NotSerializable()},
        checkpoint_id=str(ck),
        storage_writer=writer,
        async_stager=stager,
    )
    with pytest.raises(pickle.PicklingError):
        stager.wait_staged(timeout=60)
    _refused(upload.result, "PicklingError")
    upload = dcp.async_save(
        {"w": torch.ones(4)}, checkpoint_id=str(ck), storage_writer=writer, async_stager=stager
    )
    stager.synchronize_staging()
    upload.result()
    upload = dcp.async_save(
        {"w": torch.ones(4)}, checkpoint_id=str(ck), storage_writer=writer, async_stager=stager
    )
    with pytest.raises(aiopersist.CheckpointExistsError):
        stager.wait_staged(timeout=60)  # the coordinator's claim refused it
    _refused(upload.result, "already exists")
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


class _PlanningFails(DefaultSavePlanner):
    """DCP's planning fails outside the writer, after its first calls (as a rank that dies
    then breaks the planning's collectives on the others)."""

    def create_local_plan(self) -> Any:
        raise RuntimeError("planning broke")


def test_fence_stager_ends_the_wait_when_dcps_planning_fails(backend_name: str, tmp_path: Path) -> None:
    """A save that fails in DCP's planning never reaches the writer's write: without
    ``upload`` the wait used to last until its timeout (for good without one). It now
    ends, once DCP's upload thread has ended, with `RankFailedError`; the save's own
    error stays on the future, nothing is left on disk, and the stager takes the next save."""
    from aiopersist.integrations.dcp import FenceStager

    ck = tmp_path / "ck"
    writer = AiopersistWriter(backend=backend_name)
    stager = FenceStager(writer)
    upload = dcp.async_save(
        {"w": torch.ones(4)},
        checkpoint_id=str(ck),
        storage_writer=writer,
        async_stager=stager,
        planner=_PlanningFails(),
    )
    with pytest.raises(aiopersist.RankFailedError, match="failed in DCP's planning"):
        stager.wait_staged(timeout=60)
    _refused(upload.result, "planning broke")
    assert list(tmp_path.iterdir()) == []
    upload = dcp.async_save(
        {"w": torch.ones(4)}, checkpoint_id=str(ck), storage_writer=writer, async_stager=stager
    )
    stager.wait_staged()
    upload.result()
    target = {"w": torch.zeros(4)}
    dcp.load(target, checkpoint_id=str(ck), storage_reader=AiopersistReader(backend=backend_name))
    assert torch.equal(target["w"], torch.ones(4))


class _NotSerializable:
    """A value DCP cannot serialize (a stager may still copy it)."""

    def __deepcopy__(self, memo: dict[int, object]) -> _NotSerializable:
        return self

    def __reduce__(self) -> Any:
        raise pickle.PicklingError("this value cannot be pickled")


def test_framing_a_tensor_costs_no_memory_of_its_size() -> None:
    """The torch.save bytes around a tensor's are made without a buffer of the tensor's
    size (torch.save skips the data; nothing fills the gap): framing a 3 GiB tensor stays
    far below 3 GiB of peak memory, in a fresh process."""
    # VmHWM, this process image's own peak (ru_maxrss would carry the forking parent's).
    code = (
        "import torch\n"
        "from aiopersist.integrations.dcp import _archive_around\n"
        "head, tail = _archive_around(torch.float32, (768 << 20,))\n"
        "assert len(head) < 4096 and len(tail) < 4096, (len(head), len(tail))\n"
        "print([ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) < 1 << 20, proc.stdout  # KiB: under 1 GiB


def test_the_readers_own_entries_are_read_without_unpickling(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry that is exactly the archive the writer makes (checked byte for byte around
    the tensor's bytes) becomes a view of the bytes read: no torch.load, no extra copy.
    DCP's own archives still go through torch.load (the test above)."""
    ck = tmp_path / "ck"
    state = {"model": {k: v for k, v in _state()["model"].items() if v.numel()}}
    dcp.save(state, checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load was called for an entry the writer made")

    monkeypatch.setattr(torch, "load", refuse)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    dcp.load(target, checkpoint_id=str(ck), storage_reader=AiopersistReader(backend=backend_name))
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v), k


def test_tensors_that_are_more_than_their_bytes_round_trip_as_with_stock_dcp(
    backend_name: str, tmp_path: Path
) -> None:
    """A lazy conjugate or negative view (its values are not the bytes it points at) is
    written with its values, and a quantized tensor (its archive holds scales too) as
    torch.save's own archive: both readers give back what stock DCP does, and the
    checkpoint verifies."""
    g = torch.Generator().manual_seed(3)
    complex_ = torch.randn(6, 5, dtype=torch.cfloat, generator=g)
    big = torch.randn(40, 8, generator=g)
    scales, zeros = torch.rand(10, generator=g, dtype=torch.double) + 0.1, torch.zeros(10, dtype=torch.long)
    state = {
        "conj": complex_.conj(),
        "neg": torch.randn(7, dtype=torch.cdouble, generator=g)._neg_view(),
        "conj_rows": complex_[2:4].conj(),
        "q": torch.quantize_per_tensor(big, 0.05, 3, torch.qint8),
        "q_rows": torch.quantize_per_channel(big[10:20], scales, zeros, 0, torch.quint8),
        "plain": big,
    }
    assert state["conj"].is_conj()
    assert state["neg"].is_neg()
    expected = {k: v.resolve_conj().resolve_neg() for k, v in state.items()}
    ck = tmp_path / "ck"
    dcp.save(state, checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name))
    for reader in (FileSystemReader(str(ck)), AiopersistReader(backend=backend_name)):
        got = {k: torch.zeros_like(v) for k, v in expected.items() if not v.is_quantized}
        got["q"] = torch.quantize_per_tensor(torch.zeros(40, 8), 0.05, 3, torch.qint8)
        got["q_rows"] = torch.quantize_per_channel(torch.zeros(10, 8), scales, zeros, 0, torch.quint8)
        dcp.load(got, checkpoint_id=str(ck), storage_reader=reader)
        for k, v in expected.items():
            same = torch.equal(got[k].int_repr(), v.int_repr()) if v.is_quantized else torch.equal(got[k], v)
            assert same, (type(reader).__name__, k)
    report = asyncio.run(aiopersist.verify(ck, backend=backend_name))  # raises on a mismatch
    assert report.kind == "aiopersist"


def test_tensor_subclasses_are_written_as_stock_dcp_writes_them(backend_name: str, tmp_path: Path) -> None:
    """A tensor subclass goes through torch.save's own archive, as with DCP's writer: a
    wrapper subclass (no storage of its own, a data pointer of 0) is never read from
    memory, and a plain subclass keeps its class. Both readers give them back (their
    classes allowed for ``weights_only``, as stock ``dcp.load`` needs too)."""
    from torch.testing._internal.two_tensor import TwoTensor

    a = torch.randn(4, 3)
    state = {"two": TwoTensor(a, a * 2), "sub": a.clone().as_subclass(_Marked), "plain": a}
    ck = tmp_path / "ck"
    dcp.save(state, checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name))
    for reader in (FileSystemReader(str(ck)), AiopersistReader(backend=backend_name)):
        got = {
            "two": TwoTensor(torch.zeros(4, 3), torch.zeros(4, 3)),
            "sub": torch.zeros(4, 3).as_subclass(_Marked),
            "plain": torch.zeros(4, 3),
        }
        with torch.serialization.safe_globals([TwoTensor, _Marked]):
            dcp.load(got, checkpoint_id=str(ck), storage_reader=reader)
        assert torch.equal(got["two"].a, a)
        assert torch.equal(got["two"].b, a * 2)
        assert torch.equal(got["sub"], a)
        assert torch.equal(got["plain"], a)
    asyncio.run(aiopersist.verify(ck, backend=backend_name))


class _Marked(torch.Tensor):
    """A plain tensor subclass (with storage of its own)."""


def test_metadata_claims_the_bytes_cannot_hold_are_not_acted_on(backend_name: str, tmp_path: Path) -> None:
    """DCP's own directory has no checksums: a ``.metadata`` whose chunk is larger than
    its tensor is refused before anything is allocated for it, and a dtype its entry does
    not hold (one torch.save cannot write as plain bytes) is refused naming both, with no
    untyped error (stock DCP reads the entry for what it is and casts it into the target)."""
    state = {"w": torch.randn(30, 20), "v": torch.randn(50)}
    for claim in ("huge", "quantized"):
        ck = tmp_path / claim
        dcp.save(state, checkpoint_id=str(ck), storage_writer=FileSystemWriter(str(ck)))
        with open(ck / ".metadata", "rb") as f:
            metadata = pickle.load(f)
        md = metadata.state_dict_metadata["w"]
        if claim == "huge":
            chunk = md.chunks[0]
            md.chunks[0] = type(chunk)(offsets=chunk.offsets, sizes=torch.Size([1 << 40, 20]))
        else:
            md.properties.dtype = torch.qint8
        (ck / ".metadata").write_bytes(pickle.dumps(metadata))
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        reader = AiopersistReader(backend=backend_name)
        said = (
            "w: a chunk at [0, 0] reaches past the tensor"
            if claim == "huge"
            else "a torch.float32 tensor of shape [30, 20], the metadata's chunk is torch.qint8"
        )
        _refused(lambda: dcp.load(got, checkpoint_id=str(ck), storage_reader=reader), said)  # noqa: B023
