"""A checkpoint on disk is untrusted input. Hostile or damaged manifests, indexes, headers
and files give `CheckpointCorruptError` naming the field: never a hang, a read or a
deletion outside the checkpoint, a huge allocation, or an untyped error. A damaged step
never stops a manager from listing, restoring or retaining the others; the manager
touches only its own data. Every I/O test runs on both backends."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import aiopersist
from aiopersist import _commit
from aiopersist._manifest import MAX_SIZE, parse_index
from aiopersist._skeleton import MAX_CONTAINER_DEPTH, MAX_SKELETON_DEPTH
from tests._launch import popen
from tests.conftest import fifo_opened_after
from tests.io.test_corruption import _rewrite_manifest

pytestmark = pytest.mark.asyncio


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(64, 64), "b": torch.randn(64)}, "step": 3}


async def _checkpoint(path: Path, backend: str, state: object = None) -> Path:
    await aiopersist.save(_state() if state is None else state, path, backend=backend)
    return path


async def _refused(path: Any, backend: str, match: str) -> None:
    """load and verify both refuse, with CheckpointCorruptError matching ``match``."""
    with pytest.raises(aiopersist.CheckpointCorruptError, match=match):
        await aiopersist.load(path, backend=backend)
    with pytest.raises(aiopersist.CheckpointCorruptError, match=match):
        await aiopersist.verify(path, backend=backend)


def _sentinel(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "precious.bin").write_bytes(b"do not delete")
    return path / "precious.bin"


# -- part directories and files outside the checkpoint ----------------------------------------


@pytest.mark.parametrize(
    "directory",
    ["..", "../..", ".", "part-0123456789ab/..", "/abs/part-0123456789ab", "x/../part-0123456789ab", ""],
)
async def test_part_directories_that_are_not_parts_are_refused(
    backend_name: str, tmp_path: Path, directory: str
) -> None:
    ckpt = await _checkpoint(tmp_path / "run" / "step-1", backend_name)

    def spread(doc: dict[str, Any]) -> None:
        doc["version"] = 2
        doc["directories"] = [".", directory]

    _rewrite_manifest(ckpt, spread)
    await _refused(ckpt, backend_name, r"directories: .* is not a part directory")


async def test_retention_and_gc_never_delete_through_a_forged_part_directory(
    backend_name: str, tmp_path: Path
) -> None:
    """A step whose manifest lists '..' (or a path to another run) as a part: listing,
    retention and ``gc --apply`` delete nothing outside the manager's own steps, the newest
    step included."""
    run = tmp_path / "run"
    other = _sentinel(tmp_path / "other-run" / "step-1" / "part-0123456789ab")
    async with aiopersist.CheckpointManager(run, backend=backend_name) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, _state())).done
    for name, directory in (("step-1", ".."), ("step-2", "../../other-run/step-1/part-0123456789ab")):

        def forge(doc: dict[str, Any], directory: str = directory) -> None:
            doc["version"] = 2
            doc["directories"] = [".", directory]

        _rewrite_manifest(run / name, forge)
    async with aiopersist.CheckpointManager(run, keep_last=1, backend=backend_name) as mgr:
        found = {s.step: s for s in mgr.scan()}
        assert not found[1].complete
        assert "not a part directory" in (found[1].problem or "")
        assert found[2].complete  # its files are all its own: the listed part holds none
        await (await mgr.save(3, _state())).done
        await mgr.wait()
    from aiopersist._cli import main

    assert main(["gc", str(run), "--keep-last", "1", "--apply", "--leftovers"]) == 0
    assert other.read_bytes() == b"do not delete"
    # Retention deleted step 2 (complete), not what its manifest listed; step 1 is
    # damaged, so left alone.
    assert sorted(n for n in os.listdir(run) if n.startswith("step-")) == ["step-1", "step-3"]


async def test_a_file_outside_the_checkpoint_is_never_read_nor_mirrored(
    backend_name: str, tmp_path: Path
) -> None:
    """A forged manifest points a file at another directory through a part path: load,
    verify, the completeness check and the mirror all refuse it."""
    ckpt = await _checkpoint(tmp_path / "run" / "step-1", backend_name)
    secret = tmp_path / "secret"
    secret.mkdir()
    shutil.copy(ckpt / "state.safetensors", secret / "state.safetensors")

    def outside(doc: dict[str, Any]) -> None:
        doc["version"] = 2
        doc["directories"] = [".", "../../secret"]
        doc["files"]["state.safetensors"]["dir"] = 1

    _rewrite_manifest(ckpt, outside)
    (ckpt / "state.safetensors").unlink()
    await _refused(ckpt, backend_name, "not a part directory")
    mirror = tmp_path / "mirror"
    async with aiopersist.CheckpointManager(tmp_path / "run", mirror=mirror, backend=backend_name) as mgr:
        assert mgr.steps() == []
        await (await mgr.save(2, _state())).done
        await mgr.wait()
    assert sorted(n for n in os.listdir(mirror) if n.startswith("step-")) == ["step-2"]


async def test_links_inside_a_checkpoint_are_not_followed(backend_name: str, tmp_path: Path) -> None:
    """A ``model.safetensors`` (or a manifest's file, or the manifest itself) that is a
    link is refused, inside or out; a safetensors file named directly may be a link."""
    model = {"w": torch.randn(8, 8)}
    hf = await _checkpoint(tmp_path / "hf", backend_name, torch.nn.Linear(8, 8))
    outside = tmp_path / "outside.safetensors"
    (hf / "model.safetensors").rename(outside)
    (hf / "model.safetensors").symlink_to(outside)
    (hf / "aiopersist.json").unlink()  # a plain Hugging Face directory now
    await _refused(hf, backend_name, r"model\.safetensors: a symbolic link, not a regular file")
    # Named directly, the link is the caller's choice.
    back = await aiopersist.load(hf / "model.safetensors", backend=backend_name)
    assert set(back) == {"weight", "bias"}
    ckpt = await _checkpoint(tmp_path / "c", backend_name, model)
    real = tmp_path / "real.json"
    (ckpt / "aiopersist.json").rename(real)
    (ckpt / "aiopersist.json").symlink_to(real)
    await _refused(ckpt, backend_name, r"aiopersist\.json: a symbolic link")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("forged", "match"),
    [
        ({"a/" * 200_000 + "f": 1}, "deeper than 16 subdirectories"),  # 400 KB: once 20 GB to check
        ({"t/\ud800.json": 1}, "is not a name a file can have"),
    ],
)
async def test_forged_file_names_cost_no_more_than_the_manifest(
    backend_name: str, tmp_path: Path, forged: dict[str, int], match: str
) -> None:
    """Names a forger can write into a manifest: a name nested 200,000 deep, a name that
    cannot be encoded. Each is refused by load and verify with `CheckpointCorruptError`,
    in time and memory in proportion to the manifest (the deep name is refused before it
    is split: checking it once took 20 GB)."""
    ckpt = await _checkpoint(tmp_path / "c", backend_name)

    def forge(doc: dict[str, Any]) -> None:
        doc["version"] = 3
        for name, size in forged.items():
            doc["files"][name] = {"bytes": size, "checksum": "0" * 16}

    _rewrite_manifest(ckpt, forge)
    await _refused(ckpt, backend_name, match)


@pytest.mark.timeout(120)
async def test_more_files_than_the_process_may_open_are_read_a_bounded_number_at_a_time(
    backend_name: str, tmp_path: Path
) -> None:
    """A manifest listing 1,000 files, each in a part directory of its own (a forged one
    here; a DCP checkpoint of thousands of ranks, in earnest), under a limit of open
    files well below that: verify opened every file at once (``EMFILE``) and now reads a bounded number
    at a time, reaching the forged checksums; load reads none of them. (The checks of the
    subdirectories once took time in the square of their number, too.)"""
    import resource

    from aiopersist._stream import FILES_AT_ONCE

    ckpt = await _checkpoint(tmp_path / "c", backend_name)
    token = "ab12cd34"
    n = 1_000
    for i in range(n):
        part = ckpt / f"d{i}" / f"part-{token}"
        part.mkdir(parents=True)
        (part / f"f{i}").write_bytes(b"x")

    def forge(doc: dict[str, Any]) -> None:
        doc["version"] = 2
        doc["directories"] = [".", *(f"d{i}/part-{token}" for i in range(n))]
        for i in range(n):
            doc["files"][f"f{i}"] = {"bytes": 1, "checksum": "0" * 16, "dir": i + 1}

    _rewrite_manifest(ckpt, forge)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))  # a test worker's own, to begin with
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + FILES_AT_ONCE + 64, hard))
    try:
        with pytest.raises(aiopersist.CheckpointCorruptError, match="checksum"):
            await aiopersist.verify(ckpt, backend=backend_name)
        assert (await aiopersist.load(ckpt, backend=backend_name)).keys() == _state().keys()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- FIFOs and other special files ------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_a_fifo_never_hangs_load_or_verify(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path / "c", backend_name)
    (ckpt / "state.safetensors").unlink()
    os.mkfifo(ckpt / "state.safetensors")
    await _refused(ckpt, backend_name, r"state\.safetensors: a FIFO, not a regular file")
    ckpt2 = await _checkpoint(tmp_path / "c2", backend_name)
    (ckpt2 / "aiopersist.json").unlink()
    os.mkfifo(ckpt2 / "aiopersist.json")
    await _refused(ckpt2, backend_name, r"aiopersist\.json: a FIFO, not a regular file")
    # Named by a Hugging Face index.
    hf = tmp_path / "hf"
    hf.mkdir()
    os.mkfifo(hf / "model-00001-of-00001.safetensors")
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}})
    )
    await _refused(hf, backend_name, r"a FIFO, not a regular file")
    # Passed as the path itself.
    fifo = tmp_path / "x.safetensors"
    os.mkfifo(fifo)
    await _refused(fifo, backend_name, r"x\.safetensors: a FIFO, not a checkpoint")
    async with aiopersist.CheckpointManager(tmp_path / "run", backend=backend_name) as mgr:
        await (await mgr.save(1, _state())).done
    (tmp_path / "run" / "step-2").mkdir()
    os.mkfifo(tmp_path / "run" / "step-2" / "aiopersist.json")
    async with aiopersist.CheckpointManager(tmp_path / "run", backend=backend_name) as mgr:
        assert mgr.steps() == [1]
        assert (await mgr.restore())["step"] == 3


@pytest.mark.parametrize("name", ["aiopersist.json", "model.safetensors.index.json"])
async def test_a_socket_in_place_of_a_small_file_is_refused_as_what_it_is(
    backend_name: str, tmp_path: Path, name: str
) -> None:
    """A manifest or an index that is a socket is a damaged checkpoint (as a FIFO or a
    device is), not an I/O error (opening a socket fails with ENXIO)."""
    import socket

    if name == "aiopersist.json":
        ckpt = await _checkpoint(tmp_path / "c", backend_name)
        (ckpt / name).unlink()
    else:
        ckpt = tmp_path / "hf"
        ckpt.mkdir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(ckpt / name))
        await _refused(ckpt, backend_name, rf"{re.escape(name)}: a socket, not a regular file")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
async def test_a_file_swapped_for_a_fifo_after_the_checks_never_hangs_the_read(
    backend_name: str, tmp_path: Path, direct: bool
) -> None:
    """A data file replaced by a FIFO between the checks of locate and the read (a race):
    the read's own open must not wait for a writer; it refuses the FIFO. (On a regression
    a writer opens the FIFO after 10 s, so that the test fails rather than hangs.)"""

    from aiopersist._backends import open_backend
    from aiopersist._direct import probe_directory
    from aiopersist._staging import StagingPool
    from aiopersist._stream import read_segments

    fifo = tmp_path / "state.safetensors"
    os.mkfifo(fifo)
    pool = StagingPool()
    try:
        async with open_backend(backend_name) as be:
            with (
                fifo_opened_after(fifo) as waited,
                pytest.raises(aiopersist.CheckpointCorruptError, match="not a regular file"),
            ):
                dest = torch.empty(4096, dtype=torch.uint8)
                dio = dataclasses.replace(probe_directory(str(tmp_path)), direct=direct)
                await read_segments(be, str(fifo), dio, pool, [(0, dest)])
    finally:
        pool.close()
    assert not waited.is_set()  # refused at once, not once a writer came


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("act", ["load", "verify"])
async def test_load_and_verify_never_hang_on_a_fifo_swapped_in_after_locate(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool, act: str
) -> None:
    """The whole path of a load and of a verify (headers, hashing, reads): the data file
    becomes a FIFO right after locate has checked it. Each refuses it at once (a writer
    opens the FIFO after 10 s on a regression, so the test fails rather than hangs)."""

    from aiopersist import _load

    if not direct:
        monkeypatch.setenv("AIOPERSIST_DIRECT_IO", "0")
    ckpt = await _checkpoint(tmp_path / "c", backend_name)
    victim = ckpt / "state.safetensors"
    real = _load.locate

    def swapped(path: Any) -> Any:
        found = real(path)
        victim.unlink()
        os.mkfifo(victim)
        return found

    monkeypatch.setattr(_load, "locate", swapped)
    with (
        fifo_opened_after(victim) as waited,
        pytest.raises(aiopersist.CheckpointCorruptError, match="not a regular file"),
    ):
        await getattr(aiopersist, act)(ckpt, backend=backend_name)
    assert not waited.is_set()  # refused at once, not once a writer came


@pytest.mark.timeout(60)
async def test_a_file_under_a_lease_is_read_once_the_lease_is_given_up(
    backend_name: str, tmp_path: Path
) -> None:
    """Another process holds a write lease on the data file (as an NFS server's delegation
    or Samba's oplocks do): the reads' non-blocking opens must not turn the wait for the
    lease into a failure, nor into a loop of retried opens: the load waits for the holder
    to give it up (which the holder records before it does), then reads."""
    import sys

    from aiopersist._backends._uring import UringBackend

    ckpt = await _checkpoint(tmp_path / "c", backend_name)
    data = ckpt / "state.safetensors"
    released = tmp_path / "released"
    script = (
        "import fcntl, os, signal, sys, time\n"
        f"fd = os.open({str(data)!r}, os.O_RDWR)\n"
        "def give_up(*_):\n"
        "    time.sleep(0.5)\n"
        f"    open({str(released)!r}, 'w').close()\n"
        "    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)\n"
        "signal.signal(signal.SIGIO, give_up)\n"
        "fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)\n"
        "print('held', flush=True)\n"
        "time.sleep(30)\n"
    )
    opens: list[str] = []
    submit = UringBackend._submit

    async def counted(self: Any, prep: Any, call: str, *args: Any, **kwargs: Any) -> Any:
        if call == "io_uring openat":
            opens.append(call)
        return await submit(self, prep, call, *args, **kwargs)

    holder = popen([sys.executable, "-c", script])
    try:
        assert (await asyncio.to_thread(holder.stdout.readline)).strip() == b"held"
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(UringBackend, "_submit", counted)
            loaded = await aiopersist.load(ckpt, backend=backend_name)
        assert released.exists()  # it waited for the lease to be given up
        assert len(opens) <= 2  # io_uring: one non-blocking open, one that waits; no retry loop
        assert torch.equal(loaded["model"]["w"], _state()["model"]["w"])
    finally:
        holder.kill()
        await asyncio.to_thread(holder.communicate)


# -- sizes, shapes and offsets ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t: t.update(shape=[1 << 40, 1 << 40]), r"tensors\['model\.b'\]\.shape .* absurd number"),
        (lambda t: t.update(shape=[1 << 20, 1 << 20]), r"tensors\['model\.b'\]\.offsets .* do not hold"),
        (lambda t: t.update(shape=[0, 1 << 70]), r"tensors\['model\.b'\]\.shape must be an integer"),
        (lambda t: t.update(shape=[-1]), r"tensors\['model\.b'\]\.shape must be an integer"),
        (lambda t: t.update(shape="64"), r"tensors\['model\.b'\]\.shape must be a list"),
        (lambda t: t.update(shape=[True]), r"tensors\['model\.b'\]\.shape must be an integer"),
        (lambda t: t.update(dtype="F128"), r"tensors\['model\.b'\]\.dtype: .*unknown dtype 'F128'"),
        (lambda t: t.update(dtype=None), r"tensors\['model\.b'\]\.dtype must be a string"),
        (lambda t: t.update(offsets=[0]), r"tensors\['model\.b'\]\.offsets must be \[begin, end\]"),
        (lambda t: t.update(offsets=[9, 1]), r"ends before it begins"),
        (lambda t: t.update(offsets=[0, 1 << 63]), r"must be an integer from 0 to"),
        (lambda t: t.update(file="nope.safetensors"), r"tensors\['model\.b'\]\.file: 'nope\.safetensors'"),
        (lambda t: t.update(file=["x"]), r"tensors\['model\.b'\]\.file must be a string"),
    ],
)
async def test_absurd_tensor_records_are_refused(
    backend_name: str, tmp_path: Path, change: Any, match: str
) -> None:
    ckpt = await _checkpoint(tmp_path / "c", backend_name)
    _rewrite_manifest(ckpt, lambda d: change(d["tensors"]["model.b"]))
    await _refused(ckpt, backend_name, match)


async def test_overlapping_tensors_are_refused_by_verify_as_by_load(
    backend_name: str, tmp_path: Path
) -> None:
    """Two tensors over the same bytes (a forged manifest that would make a load allocate
    the file many times over): load and verify refuse alike."""
    ckpt = await _checkpoint(tmp_path / "c", backend_name, {f"t{i}": torch.ones(256) for i in range(4)})

    def overlap(doc: dict[str, Any]) -> None:
        first = doc["tensors"]["t0"]["offsets"]
        for t in doc["tensors"].values():
            t["offsets"] = list(first)

    _rewrite_manifest(ckpt, overlap)
    await _refused(ckpt, backend_name, r"overlaps the one before")


async def test_file_records_are_bounded(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path / "c", backend_name)
    _rewrite_manifest(ckpt, lambda d: d["files"]["state.safetensors"].update(bytes=1 << 70))
    await _refused(ckpt, backend_name, r"files\['state\.safetensors'\]\.bytes must be an integer")
    _rewrite_manifest(
        ckpt, lambda d: d["files"]["state.safetensors"].update(bytes=MAX_SIZE, data_offset=1 << 61)
    )
    await _refused(ckpt, backend_name, r"offsets start at byte 4096 of 'state\.safetensors', expected \d+")


async def test_a_view_reaching_past_its_base_is_refused(backend_name: str, tmp_path: Path) -> None:
    base = torch.arange(100, dtype=torch.float32)
    ckpt = await _checkpoint(tmp_path / "c", backend_name, {"a": base[:10], "b": base[5:50], "n": 1})
    _rewrite_manifest(ckpt, lambda d: next(iter(d["views"].values())).update(shape=[1 << 50], stride=[1]))
    await _refused(ckpt, backend_name, r"views\[.*\] reaches past the \d+ bytes")
    _rewrite_manifest(ckpt, lambda d: next(iter(d["views"].values())).update(stride=[1, 2]))
    await _refused(ckpt, backend_name, r"1 dimensions but 2 strides")


async def test_a_view_claiming_terabytes_moves_to_another_device_as_its_storage(
    backend_name: str, tmp_path: Path
) -> None:
    """A view may claim far more than its base holds (one element, stride 0, 4 TiB):
    ``map_location`` moves each storage once and rebuilds the views on it, as on the CPU;
    copying each view apart would ask the device for the 4 TiB (``meta`` stands in for a
    GPU here: it allocates nothing, and says what would have been)."""
    base = torch.arange(4, dtype=torch.float32)
    state = {"m": {"huge": base[:1].expand(1 << 40), "base": base, "tail": base[1:3]}}
    ckpt = await _checkpoint(tmp_path / "c", backend_name, state)
    got = (await aiopersist.load(ckpt, backend=backend_name, map_location="meta"))["m"]
    for name, t in got.items():
        assert t.device.type == "meta", name
        assert t.untyped_storage().nbytes() == 16, (name, t.untyped_storage().nbytes())
        assert (t.shape, t.stride(), t.storage_offset()) == (
            state["m"][name].shape,
            state["m"][name].stride(),
            state["m"][name].storage_offset(),
        ), name


async def test_hf_headers_with_absurd_shapes_are_refused(backend_name: str, tmp_path: Path) -> None:
    for shape in ([0, 1 << 70], [1 << 40, 1 << 40], [-1], "ab"):
        header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
        path = tmp_path / "x.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header)
        await _refused(
            path, backend_name, r"x\.safetensors: tensor 'w' has (an invalid shape|invalid offsets|offsets)"
        )


async def test_an_hf_index_naming_nothing_is_refused(backend_name: str, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    for body, match in (
        ({"weight_map": {}}, "weight_map is empty"),
        ({"weight_map": []}, "weight_map must be a JSON object"),
        ({}, "weight_map must be a JSON object"),
        ({"weight_map": {"w": "../x.safetensors"}}, "would escape the checkpoint"),
        ({"weight_map": {"w": 3}}, r"weight_map\['w'\] must be a string"),
        ([], "the index must be a JSON object"),
    ):
        (hf / "model.safetensors.index.json").write_text(json.dumps(body))
        await _refused(hf, backend_name, match)
    (hf / "model.safetensors.index.json").write_text("[" * 100_000)
    await _refused(hf, backend_name, "nested too deep|not a valid safetensors index")
    with pytest.raises(aiopersist.CheckpointCorruptError, match="weight_map is empty"):
        parse_index(b'{"weight_map": {}}', "index")


# -- nesting ----------------------------------------------------------------------------------


def _nested(depth: int) -> Any:
    node: Any = {"leaf": torch.ones(2)}
    for _ in range(depth - 1):
        node = {"x": node}
    return node


async def test_deep_nesting_saves_to_the_limit_and_is_refused_beyond(
    backend_name: str, tmp_path: Path
) -> None:
    deepest = _nested(MAX_CONTAINER_DEPTH)
    await aiopersist.save(deepest, tmp_path / "ok", backend=backend_name)
    back = await aiopersist.load(tmp_path / "ok", backend=backend_name)
    for _ in range(MAX_CONTAINER_DEPTH - 1):
        back = back["x"]
    assert torch.equal(back["leaf"], torch.ones(2))
    with pytest.raises(
        aiopersist.UnsupportedStateError, match=r"state(\['x'\])+: containers nested more than"
    ):
        await aiopersist.save(_nested(MAX_CONTAINER_DEPTH + 1), tmp_path / "no", backend=backend_name)
    assert not (tmp_path / "no").exists()


async def test_a_deep_skeleton_is_refused_and_spares_the_other_steps(
    backend_name: str, tmp_path: Path
) -> None:
    """One step whose skeleton nests 100,000 levels (RecursionError in every recursive
    walk): it is refused with a typed error, and the manager lists, restores and retains
    the others."""
    run = tmp_path / "run"
    async with aiopersist.CheckpointManager(run, keep_last=2, backend=backend_name) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, {"step": step, "w": torch.ones(4)})).done

    def deep(doc: dict[str, Any]) -> None:
        node: Any = 0
        for _ in range(MAX_SKELETON_DEPTH + 1):
            node = [node]
        doc["skeleton"]["step"] = node

    _rewrite_manifest(run / "step-2", deep)
    await _refused(run / "step-2", backend_name, r"skeleton.*nested deeper than")
    (run / "step-2" / "aiopersist.json").write_text('{"skeleton": ' + "[" * 100_000 + "]" * 100_000 + "}")
    await _refused(run / "step-2", backend_name, r"aiopersist\.json: JSON nested too deep")
    async with aiopersist.CheckpointManager(run, keep_last=2, backend=backend_name) as mgr:
        assert mgr.steps() == [1]
        assert mgr.latest() == 1
        assert (await mgr.restore())["step"] == 1
        for step in (3, 4):
            await (await mgr.save(step, {"step": step, "w": torch.ones(4)})).done
        await mgr.wait()
        assert mgr.steps() == [3, 4]  # retention went on; the damaged step is left alone
    assert (run / "step-2").is_dir()
    from aiopersist._cli import main

    assert main(["ls", str(run)]) == 0


@pytest.mark.parametrize(
    ("node", "match"),
    [
        ({"__tensor__": 5}, "bad __tensor__ entry"),
        ({"__tensor__": "model.w", "extra": 1}, "bad __tensor__ entry .2 keys"),
        ({"__tuple__": {}}, "bad __tuple__ entry .not a list"),
        ({"__dict__": [[1]]}, "bad __dict__ entry"),
        ({"__float__": "1e999"}, "bad __float__ entry"),
        ({"__bytes__": 5}, "bad __bytes__ entry"),
        ({"__pickle__": -1}, "bad __pickle__ entry"),
        ({"__module__": "x"}, "bad __module__ entry"),
    ],
)
async def test_malformed_skeleton_markers_are_refused(
    backend_name: str, tmp_path: Path, node: Any, match: str
) -> None:
    ckpt = await _checkpoint(tmp_path / "c", backend_name)
    _rewrite_manifest(ckpt, lambda d: d["skeleton"].update(step=node))
    await _refused(ckpt, backend_name, r"skeleton\['step'\]: " + match)


# -- the manager touches only its own data ----------------------------------------------------


async def test_a_forked_two_disk_run_keeps_each_runs_parts(backend_name: str, tmp_path: Path) -> None:
    """A two-disk run copied to two new disks: the copy's manifests still point (by
    relative path) at the original's parts. Each manager reads, retains and deletes its own
    parts only."""
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    async with aiopersist.CheckpointManager([a, b], keep_last=1, backend=backend_name) as mgr:
        for step in (1, 2):
            state = {"step": step, "w": torch.full((256, 256), float(step)), "v": torch.ones(256, 256)}
            await (await mgr.save(step, state)).done
        await mgr.wait()
    fa, fb = tmp_path / "fa" / "run", tmp_path / "fb" / "run"
    shutil.copytree(tmp_path / "a", tmp_path / "fa", symlinks=True)
    shutil.copytree(tmp_path / "b", tmp_path / "fb", symlinks=True)
    original_parts = sorted(p.relative_to(b) for p in b.rglob("part-*"))
    async with aiopersist.CheckpointManager([fa, fb], keep_last=1, backend=backend_name) as fork:
        # The fork reads its own copy: damage the original's part, the fork still restores.
        part = next((b / "step-2").glob("part-*"))
        data = next(part.iterdir())
        saved = data.read_bytes()
        data.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
        assert (await fork.restore())["step"] == 2
        data.write_bytes(saved)
        for step in (3, 4):
            await (
                await fork.save(step, {"step": step, "w": torch.ones(256, 256), "v": torch.ones(256, 256)})
            ).done
        await fork.wait()
        assert fork.steps() == [4]
    assert sorted(p.relative_to(b) for p in b.rglob("part-*")) == original_parts
    async with aiopersist.CheckpointManager([a, b], keep_last=1, backend=backend_name) as mgr:
        assert mgr.steps() == [2]
        assert torch.equal((await mgr.restore())["w"], torch.full((256, 256), 2.0))
    assert not list((fb / "step-2").glob("part-*"))  # the fork deleted its own copy of step 2


async def test_restore_falls_back_to_the_newest_step_that_loads(
    backend_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    async with aiopersist.CheckpointManager(run, mirror=mirror, backend=backend_name) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, {"step": step, "w": torch.full((128,), float(step))})).done
        await mgr.wait()

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))

    flip(run / "step-3" / "state.safetensors")  # the local copy of 3: checksum fails
    async with aiopersist.CheckpointManager(run, mirror=mirror, backend=backend_name) as mgr:
        with caplog.at_level(logging.WARNING, logger="aiopersist"):
            back = await mgr.restore()
        assert back["step"] == 3
        assert mgr.restored_step == 3
        assert "checksum mismatch" in caplog.text
        flip(mirror / "step-3" / "state.safetensors")
        (run / "step-2" / "state.safetensors").unlink()  # 2: incomplete everywhere but the mirror
        target = {"step": 0, "w": torch.zeros(128)}
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="aiopersist"):
            await mgr.restore(into=target)
        assert target["step"] == 2
        assert mgr.restored_step == 2
        assert torch.equal(target["w"], torch.full((128,), 2.0))
        assert "step-3" in caplog.text
        assert "missing" in caplog.text
        with pytest.raises(aiopersist.CheckpointCorruptError, match="could be restored"):
            await mgr.restore(3)
        flip(mirror / "step-2" / "state.safetensors")
        flip(mirror / "step-1" / "state.safetensors")
        flip(run / "step-1" / "state.safetensors")
        with pytest.raises(aiopersist.CheckpointCorruptError, match=r"no checkpoint .* could be restored"):
            await mgr.restore(into=target)
        assert target["step"] == 2  # the failed restores changed nothing


# -- links where a manager's steps are, and refusals that are not damage ----------------------


def _two_disk_state(step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.full((256, 256), float(step)), "v": torch.ones(256, 256)}


async def test_a_fork_whose_other_disk_links_to_the_original_touches_none_of_its_parts(
    backend_name: str, tmp_path: Path
) -> None:
    """A two-disk run forked cheaply: the first directory copied, the second disk's
    ``step-N`` made links to the original's. The fork's steps are left alone (neither
    restored, nor counted, nor deleted by retention or gc); its save over such a step is
    refused; the original keeps every part."""
    orig = [tmp_path / "orig-a", tmp_path / "orig-b"]
    async with aiopersist.CheckpointManager(orig, backend=backend_name) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, _two_disk_state(step))).done
    parts = sorted(p.relative_to(orig[1]) for p in orig[1].rglob("*"))
    fork = [tmp_path / "fork-a", tmp_path / "fork-b"]
    shutil.copytree(orig[0], fork[0], symlinks=True)
    fork[1].mkdir()
    for step in (1, 2, 3):
        (fork[1] / f"step-{step}").symlink_to(orig[1] / f"step-{step}")
    async with aiopersist.CheckpointManager(fork, keep_last=1, backend=backend_name) as mgr:
        found = {s.step: s for s in mgr.scan()}
        assert sorted(found) == [1, 2, 3]
        for info in found.values():
            assert not info.complete
            assert not info.damaged
            assert "symbolic link" in (info.problem or "")
        with pytest.raises(aiopersist.CheckpointNotFoundError):
            await mgr.restore()
        with pytest.raises(aiopersist.CheckpointExistsError, match=r"fork-b/step-2: a symbolic link"):
            await mgr.save(2, _two_disk_state(2), overwrite=True)
        await (await mgr.save(4, _two_disk_state(4))).done
        await mgr.wait()
        assert mgr.steps() == [4]
    from aiopersist._cli import main
    from aiopersist._manager import delete_step

    assert main(["gc", str(fork[0]), str(fork[1]), "--keep-last", "1", "--apply", "--leftovers"]) == 0
    delete_step([str(fork[0] / "step-1"), str(fork[1] / "step-1")])  # asked directly, too
    assert not (fork[0] / "step-1").exists()
    assert sorted(p.relative_to(orig[1]) for p in orig[1].rglob("*")) == parts
    async with aiopersist.CheckpointManager(orig, backend=backend_name) as mgr:
        assert mgr.steps() == [1, 2, 3]
        assert (await mgr.restore())["step"] == 3


async def test_a_one_directory_manager_never_reads_parts_where_a_manifest_points(
    backend_name: str, tmp_path: Path
) -> None:
    """A step of a one-directory manager whose manifest puts files in a part directory
    elsewhere (a two-disk checkpoint moved in, or forged): incomplete, not restored, not
    mirrored. `aiopersist.load` of its path alone finds the part as documented; given as
    a list of one directory, it does not."""
    src = [tmp_path / "x" / "step-5", tmp_path / "elsewhere" / "step-5"]
    state = {"w": torch.full((256, 256), 5.0), "u": torch.full((256, 256), 7.0)}
    await aiopersist.save(state, src, backend=backend_name, metadata={"step": "5"})
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    run.mkdir()
    src[0].rename(run / "step-5")
    back = await aiopersist.load(run / "step-5", backend=backend_name)
    assert torch.equal(back["u"], state["u"])
    with pytest.raises(aiopersist.CheckpointNotFoundError, match="parts in 1 more directories, 0 given"):
        await aiopersist.load([run / "step-5"], backend=backend_name)
    async with aiopersist.CheckpointManager(run, mirror=mirror, backend=backend_name) as mgr:
        (info,) = mgr.scan()
        assert not info.complete
        assert not info.damaged
        with pytest.raises(aiopersist.CheckpointNotFoundError):
            await mgr.restore()
        await (await mgr.save(6, {"w": torch.zeros(2)})).done
        await mgr.wait()
    assert sorted(os.listdir(mirror)) == ["step-6"]
    assert sorted(os.listdir(run)) == [".aiopersist-manager.lock", "step-5", "step-6"]


@pytest.mark.parametrize("how", ["symlinked-file", "hard-linked-twins", "symlinked-manifest"])
async def test_a_checkpoint_refused_for_a_link_is_not_deleted_as_damaged(
    backend_name: str, tmp_path: Path, how: str
) -> None:
    """A Trainer checkpoint whose data file was moved to a cache and linked back (DVC,
    git-annex), or whose identical files a deduplicating copy hard-linked, is intact:
    load and verify refuse it (`LinkedFileError`, a `CheckpointCorruptError`), but it is
    not damaged, so ``gc`` and the rotation keep it."""
    from aiopersist._cli import main

    out = tmp_path / "out"
    for step in (1, 2):
        await aiopersist.save(
            {"w": torch.full((64, 64), float(step))},
            out / f"checkpoint-{step}",
            backend=backend_name,
            extra_files={"a.json": b'{"x": 1}', "b.json": b'{"x": 1}', "trainer_state.json": b"{}"},
        )
    ckpt = out / "checkpoint-1"
    if how == "symlinked-file":
        cache = tmp_path / "cache" / "model.safetensors"
        cache.parent.mkdir()
        (ckpt / "model.safetensors").rename(cache)
        (ckpt / "model.safetensors").symlink_to(cache)
        match = "model.safetensors: a symbolic link"
    elif how == "hard-linked-twins":
        (ckpt / "b.json").unlink()
        os.link(ckpt / "a.json", ckpt / "b.json")
        match = "hard links"
    else:
        real = tmp_path / "aiopersist.json"
        (ckpt / "aiopersist.json").rename(real)
        (ckpt / "aiopersist.json").symlink_to(real)
        match = "aiopersist.json: a symbolic link"
    for act in (aiopersist.load, aiopersist.verify):
        with pytest.raises(aiopersist.LinkedFileError, match=match):
            await act(ckpt, backend=backend_name)
    from aiopersist._manager import scan
    from aiopersist._names import TRAINER_STEPS

    info = {s.step: s for s in scan(str(out), layout=TRAINER_STEPS)}
    assert not info[1].complete
    assert not info[1].damaged
    assert info[2].complete
    assert main(["gc", str(out), "--keep-last", "5", "--apply"]) == 0
    assert main(["gc", str(out), "--keep-last", "1", "--apply"]) == 0
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]


async def test_restore_passes_over_a_step_it_cannot_load(backend_name: str, tmp_path: Path) -> None:
    """A torch.distributed.checkpoint saved as the newest step of a manager's directory
    (retention and gc count it): `restore` says why it does not load it and restores the
    step before."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from aiopersist.integrations.dcp import AiopersistWriter

    run = tmp_path / "run"
    async with aiopersist.CheckpointManager(run, backend=backend_name) as mgr:
        await (await mgr.save(1, {"step": 1, "w": torch.ones(8)})).done
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        writer = AiopersistWriter()
        await asyncio.to_thread(
            dcp.save, {"w": torch.zeros(8)}, checkpoint_id=str(run / "step-2"), storage_writer=writer
        )
    async with aiopersist.CheckpointManager(run, backend=backend_name) as mgr:
        assert mgr.steps() == [1, 2]
        assert {s.step: s.layout for s in mgr.scan()} == {1: "state", 2: "dcp"}
        assert (await mgr.restore())["step"] == 1
        assert mgr.restored_step == 1
        with pytest.raises(aiopersist.CheckpointNotFoundError, match="no complete checkpoint of step 2"):
            await mgr.restore(2)


async def test_odd_names_in_a_manager_directory_are_neither_steps_nor_promoted(
    backend_name: str, tmp_path: Path
) -> None:
    """A link to a checkpoint elsewhere under a step's name, a forged replaced-step name
    that is a link, a step number of hundreds of digits: none is restored, counted,
    mirrored or retained against the real steps; what they lead to is untouched."""
    run, mirror, other = tmp_path / "run", tmp_path / "mirror", tmp_path / "other"
    async with aiopersist.CheckpointManager(run, backend=backend_name) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, {"step": step})).done
        with pytest.raises(ValueError, match="at most 999999999999999999"):
            await mgr.save(10**18, {"step": 0})
    await aiopersist.save({"step": 99}, other, backend=backend_name, metadata={"step": "9"})
    (run / "step-9").symlink_to(other)
    (run / ".step-50.aiopersist-old-0123456789ab").symlink_to(other)
    huge = "9" * 250
    shutil.copytree(run / "step-3", run / f"step-{huge}")
    (run / f"step-{10**18}").mkdir()
    mirror.mkdir()
    (mirror / "step-4").symlink_to(other)  # the mirror's step 4 is someone else's
    async with aiopersist.CheckpointManager(run, keep_last=2, mirror=mirror, backend=backend_name) as mgr:
        assert not (run / ".step-50.aiopersist-old-0123456789ab").exists()  # removed as a leftover
        assert not (run / "step-50").exists()  # never promoted to a step
        found = {s.step: s for s in mgr.scan() if s.tier == "local"}
        assert sorted(found) == [1, 2, 3, 9]  # names past 18 digits are not steps
        assert [(s.step, s.complete) for s in mgr.scan() if s.tier == "mirror"] == [(4, False)]
        assert not found[9].complete
        assert not found[9].damaged
        assert (await mgr.restore())["step"] == 3
        handle = await mgr.save(4, {"step": 4})
        assert await handle.mirrored is None  # not copied over the link
        await mgr.wait()
    assert sorted(n for n in os.listdir(run) if n.startswith("step-")) == sorted(
        ["step-3", "step-4", "step-9", f"step-{huge}", f"step-{10**18}"]
    )
    assert sorted(os.listdir(mirror)) == [".aiopersist-manager.lock", "step-3", "step-4"]
    assert (mirror / "step-4").is_symlink()
    assert (await aiopersist.load(other, backend=backend_name))["step"] == 99


@pytest.mark.parametrize("target", ["nothing", "a-file", "a-directory"])
async def test_the_mirror_never_replaces_a_step_name_that_is_a_link(
    backend_name: str, tmp_path: Path, target: str
) -> None:
    """A mirror's ``step-N`` that is a link (to a step on a disk not mounted now, to a
    file, to a directory) is someone else's: the step is not mirrored over it."""
    run, mirror, elsewhere = tmp_path / "run", tmp_path / "mirror", tmp_path / "elsewhere"
    mirror.mkdir()
    if target == "a-file":
        elsewhere.write_bytes(b"x")
    elif target == "a-directory":
        elsewhere.mkdir()
    (mirror / "step-1").symlink_to(elsewhere)
    async with aiopersist.CheckpointManager(run, mirror=mirror, backend=backend_name) as mgr:
        handle = await mgr.save(1, {"w": torch.ones(4)})
        assert await handle.mirrored is None
        assert await (await mgr.save(2, {"w": torch.ones(4)})).mirrored == str(mirror / "step-2")
    assert (mirror / "step-1").is_symlink()
    assert os.readlink(mirror / "step-1") == str(elsewhere)


# -- durability of created directories, and cancellation ---------------------------------------


async def test_directories_a_save_creates_are_fsynced_into_their_parents(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real = _commit.fsync_directory

    def record(path: str) -> None:
        synced.append(os.path.abspath(path))
        real(path)

    monkeypatch.setattr(_commit, "fsync_directory", record)
    target = tmp_path / "new" / "deeper" / "ckpt"
    await aiopersist.save(_state(), target, backend=backend_name)
    for d in (tmp_path, tmp_path / "new", tmp_path / "new" / "deeper"):
        assert str(d) in synced, d  # each new directory's entry, and the checkpoint's
    synced.clear()
    await aiopersist.save(_state(), [tmp_path / "x" / "c", tmp_path / "y" / "z" / "c"], backend=backend_name)
    for d in (tmp_path, tmp_path / "x", tmp_path / "y", tmp_path / "y" / "z", tmp_path / "y" / "z" / "c"):
        assert str(d) in synced, d
    synced.clear()
    mgr = aiopersist.CheckpointManager(
        [tmp_path / "m" / "a", tmp_path / "m" / "b"], mirror=tmp_path / "mm" / "mirror", backend=backend_name
    )
    async with mgr:
        await (await mgr.save(1, _state())).done
        await mgr.wait()
    for d in (tmp_path, tmp_path / "m", tmp_path / "mm", tmp_path / "mm" / "mirror"):
        assert str(d) in synced, d


async def test_cancelling_a_save_at_any_await_leaves_nothing(backend_name: str, tmp_path: Path) -> None:
    """A save cancelled after 0, 1, 2, ... event-loop iterations (its first await
    included) leaves no temporary directory, on one directory and on two."""
    for target in ([tmp_path / "one" / "c"], [tmp_path / "two" / "c", tmp_path / "two-b" / "c"]):
        for ticks in range(0, 40):
            task = asyncio.ensure_future(
                aiopersist.save(_state(), target, backend=backend_name, overwrite=True)
            )
            for _ in range(ticks):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for d in {p.parent for p in target}:
                left = [n for n in os.listdir(d) if ".aiopersist-tmp-" in n] if d.exists() else []
                assert not left, (ticks, left)
            parts = [p for p in target[1:] if p.exists() for p in p.iterdir()]
            if not (target[0] / "aiopersist.json").exists():
                assert not parts, (ticks, parts)


async def test_gc_over_two_disks_removes_the_parts_by_token(
    backend_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiopersist._cli import main

    a, b = tmp_path / "a", tmp_path / "b"
    async with aiopersist.CheckpointManager([a, b], backend=backend_name) as mgr:
        for step in (1, 2, 3):
            state = {"step": step, "w": torch.ones(256, 256), "v": torch.ones(256, 256)}
            await (await mgr.save(step, state)).done
    assert main(["ls", str(a), str(b)]) == 0
    capsys.readouterr()
    # The first directory alone: as a manager of it alone sees them, the steps are not
    # whole there (their parts are looked for in the directories given only), so gc
    # counts none and deletes nothing, and ls says why.
    assert main(["ls", str(a)]) == 0
    assert "parts in 1 more directories, 0 given" in capsys.readouterr().out
    assert main(["gc", str(a), "--keep-last", "1", "--apply"]) == 0
    assert "keeping 0 complete steps" in capsys.readouterr().out
    assert sorted(p.name for p in a.iterdir() if p.name.startswith("step-")) == ["step-1", "step-2", "step-3"]
    assert main(["gc", str(a), str(b), "--keep-last", "1", "--apply", "--leftovers"]) == 0
    assert sorted(p.name for p in a.iterdir() if p.name.startswith("step-")) == ["step-3"]
    assert sorted(p.name for p in b.iterdir() if p.name.startswith("step-")) == ["step-3"]
    async with aiopersist.CheckpointManager([a, b], backend=backend_name) as mgr:
        assert (await mgr.restore())["step"] == 3


# -- a Trainer's trainer_state.json, read by ls and gc ------------------------------------------


def _state_file(best: str | None, pad: int = 0) -> bytes:
    return json.dumps({"best_model_checkpoint": best, "log_history": ["x" * pad]}).encode()


def _deep_list(checkpoint: Path) -> None:
    (checkpoint / "trainer_state.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)


def _link(checkpoint: Path) -> None:
    # What it leads to names checkpoint-1 the best: a link is not followed, so no best.
    elsewhere = checkpoint.parent.parent / "elsewhere.json"
    elsewhere.write_bytes(_state_file(str(checkpoint.parent / "checkpoint-1")))
    (checkpoint / "trainer_state.json").symlink_to(elsewhere)


def _too_large(checkpoint: Path) -> None:
    # Valid, naming checkpoint-1 the best, but over the limit (lowered to 1000 bytes here).
    (checkpoint / "trainer_state.json").write_bytes(_state_file("checkpoint-1", pad=2000))


DEEP_DICT = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
"""A ``trainer_state.json`` in an `AioPersistCallback` checkpoint (listed by its manifest)."""


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_deep_list, "JSON nested too deep to parse"),
        (DEEP_DICT, "JSON nested too deep to parse"),
        (_link, "a symbolic link, not a regular file"),
        (_too_large, "larger than 1000 bytes"),
    ],
    ids=["deep list", "deep dict, callback checkpoint", "link", "too large"],
)
async def test_an_unreadable_trainer_state_leaves_the_best_unknown_and_the_listing_going(
    backend_name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    damage: Any,
    reason: str,
) -> None:
    """The newest checkpoint's ``trainer_state.json`` nested past Python's recursion limit,
    a link, or too large: ``ls`` lists every checkpoint without a best (it stopped on a
    RecursionError, followed the link, read any size), and ``gc`` refuses with the reason,
    deleting nothing."""
    import importlib

    cli = importlib.import_module("aiopersist._cli.main")  # the module (the package exports its main)
    if damage is _too_large:
        monkeypatch.setattr(cli, "MAX_TRAINER_STATE_BYTES", 1000, raising=False)
    run = tmp_path / "out" / "run"
    for step in (1, 2):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "trainer_state.json").write_bytes(_state_file("checkpoint-1"))
    newest = run / "checkpoint-3"
    if isinstance(damage, bytes):
        extra = {"trainer_state.json": damage}
        await aiopersist.save({"w": torch.ones(4)}, newest, extra_files=extra, backend=backend_name)
    else:
        newest.mkdir()
        damage(newest)
    assert cli.main(["ls", str(run)]) == 0
    out, err = capsys.readouterr()
    assert [line.split()[1] for line in out.splitlines()[1:4]] == [f"checkpoint-{s}" for s in (1, 2, 3)]
    assert "best" not in out
    assert err == ""
    assert cli.main(["ls", "--json", str(run)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(d["name"], d["complete"], d["best"]) for d in listed] == [
        ("checkpoint-1", True, False), ("checkpoint-2", True, False), ("checkpoint-3", True, False)
    ]  # fmt: skip
    for args in (["--keep-last", "1"], ["--keep-last", "1", "--apply"]):
        assert cli.main(["gc", str(run), *args]) == 1
        out, err = capsys.readouterr()
        assert f"{newest / 'trainer_state.json'}: cannot tell the best checkpoint: {reason}" in err
        assert "nothing was deleted" in err
    assert sorted(n for n in os.listdir(run) if n.startswith("checkpoint-")) == [
        "checkpoint-1", "checkpoint-2", "checkpoint-3"
    ]  # fmt: skip
    # The same checkpoints with a sound state: the best is known again.
    os.unlink(newest / "trainer_state.json")
    (newest / "trainer_state.json").write_bytes(_state_file("checkpoint-1"))
    assert cli.main(["ls", str(run)]) == 0
    assert "best (trainer_state.json)" in capsys.readouterr().out
