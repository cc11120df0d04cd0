"""Damaged and hostile torch.distributed.checkpoint directories, read by `AiopersistReader`
on both backends: what ``.metadata`` claims is checked before anything acts on it, and
every failure is a typed error naming what was wrong, never a crash, a hang, wrong
values, or memory sized by a claim."""

from __future__ import annotations

import asyncio
import copy
import datetime
import io
import json
import os
import pickle
import re
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import aiopersist
from aiopersist._stream import read_segments
from aiopersist.integrations.dcp import AiopersistReader, AiopersistWriter, _check_pickle_shape
from tests._launch import run
from tests.conftest import fifo_opened_after, run_forking_script
from tests.io.test_corruption import _rewrite_manifest
from tests.io.test_dcp import SLOW_OVERWRITES

pytestmark = pytest.mark.filterwarnings("ignore")

A = MetadataIndex("a", torch.Size([0]))


def _stock(path: Path) -> dict[str, Any]:
    state = {"a": torch.arange(4000.0), "b": {"x": 1, "name": "run"}}
    dcp.save(state, checkpoint_id=str(path), storage_writer=FileSystemWriter(str(path)))
    return state


def _target() -> dict[str, Any]:
    return {"a": torch.zeros(4000), "b": {"x": 0, "name": ""}}


def _metadata(path: Path) -> Metadata:
    with open(path / ".metadata", "rb") as f:
        metadata: Metadata = pickle.load(f)
    return metadata


def _refused(path: Path, backend_name: str, match: str) -> None:
    """DCP wraps the reader's error (in its CheckpointException, or an AssertionError for
    metadata): the message must name what was wrong."""
    with pytest.raises(BaseException) as info:  # noqa: PT011 - DCP's wrapper, checked below
        dcp.load(_target(), checkpoint_id=str(path), storage_reader=AiopersistReader(backend=backend_name))
    assert match in str(info.value), str(info.value)[-2000:]


def _no_record(md: Metadata) -> None:
    del md.storage_data[A]


def _str_key(md: Metadata) -> None:
    md.storage_data["a"] = md.storage_data.pop(A)  # type: ignore[index]


def _storage_meta_int(md: Metadata) -> None:
    md.storage_meta = 5  # type: ignore[assignment]


def _offsets_int(md: Metadata) -> None:
    md.state_dict_metadata["a"].chunks[0].offsets = 5  # type: ignore[union-attr,misc]


def _no_properties(md: Metadata) -> None:
    md.state_dict_metadata["a"].properties = None  # type: ignore[union-attr]


def _no_chunks(md: Metadata) -> None:
    md.state_dict_metadata["a"].chunks = None  # type: ignore[union-attr]


def _size_a_list(md: Metadata) -> None:
    """DCP's planners compare a size with a tensor's ``torch.Size``: a list never equals
    one (the load failed in DCP's planner, untyped)."""
    md.state_dict_metadata["a"].size = [4000]  # type: ignore[union-attr]


def _sizes_a_tuple(md: Metadata) -> None:
    md.state_dict_metadata["a"].chunks[0].sizes = (4000,)  # type: ignore[union-attr,misc]


def _moved(md: Metadata, fqn: str, new: str, place: tuple[Any, ...] | list[Any]) -> None:
    """Value ``fqn`` renamed ``new`` (its metadata and storage record with it) at
    ``place`` in ``planner_data``: a forger's consistent metadata but for the place."""
    md.state_dict_metadata[new] = md.state_dict_metadata.pop(fqn)
    for index in [i for i in md.storage_data if i.fqn == fqn]:
        md.storage_data[MetadataIndex(new, index.offset, index.index)] = md.storage_data.pop(index)
    del md.planner_data[fqn]
    md.planner_data[new] = place


def _place_past_the_list_budget(md: Metadata) -> None:
    """A place DCP's ``set_element`` would make a list of 2**26 ``None`` for (2**40: a
    hang that takes the machine's memory)."""
    _moved(md, "b.x", "b.67108864", ("b", 2**26))


def _places_past_the_list_budget(md: Metadata) -> None:
    """Two lists each within the bound, 18 million elements together."""
    _moved(md, "b.x", "b.9000000", ("b", 9_000_000))
    _moved(md, "b.name", "c.9000000", ("c", 9_000_000))


def _place_a_list(md: Metadata) -> None:
    md.planner_data["a"] = ["a"]


def _place_of_another(md: Metadata) -> None:
    md.planner_data["b.x"] = ("a",)


def _place_inside_another(md: Metadata) -> None:
    _moved(md, "b.name", "b.x.name", ("b", "x", "name"))  # b.x holds a value


def _place_list_and_dict(md: Metadata) -> None:
    _moved(md, "b.name", "b.0", ("b", 0))  # b holds "x" too


def _chunk_twice(md: Metadata) -> None:
    chunks = md.state_dict_metadata["a"].chunks  # type: ignore[union-attr]
    chunks.append(chunks[0])


def _bytes_without_record(md: Metadata) -> None:
    md.state_dict_metadata["a"] = BytesStorageMetadata()


def _transforms_not_a_list(md: Metadata) -> None:
    md.storage_data[A] = _StorageInfo("__0_0.distcp", 0, 5, transform_descriptors=5)  # type: ignore[arg-type]


def _record_without_length(md: Metadata) -> None:
    info = _StorageInfo.__new__(_StorageInfo)
    info.__dict__.update(relative_path="__0_0.distcp", offset=0)
    md.storage_data[A] = info


def _overlapping_records(md: Metadata) -> None:
    inner = md.storage_data[A]
    md.storage_data[MetadataIndex("b.x")] = _StorageInfo(inner.relative_path, inner.offset + 8, 64)


def _same_record_twice(md: Metadata) -> None:
    """Two values read from the very same bytes: one entry loaded into both."""
    md.state_dict_metadata["c"] = copy.deepcopy(md.state_dict_metadata["a"])
    md.storage_data[MetadataIndex("c", torch.Size([0]))] = md.storage_data[A]


def _chunk_gap(md: Metadata) -> None:
    md.state_dict_metadata["a"].chunks[0].sizes = torch.Size([3000])  # type: ignore[union-attr,misc]


def _chunks_overlap(md: Metadata) -> None:
    inner = md.storage_data[A]
    md.state_dict_metadata["a"].chunks.append(ChunkStorageMetadata(torch.Size([1000]), torch.Size([1000])))  # type: ignore[union-attr]
    md.storage_data[MetadataIndex("a", torch.Size([1000]))] = _StorageInfo(
        inner.relative_path, inner.offset, inner.length
    )


def _no_chunk(md: Metadata) -> None:
    md.state_dict_metadata["a"].chunks = []  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_chunk_gap, "a: its chunks do not cover it exactly once (they overlap, or leave part of it"),
        (_chunk_gap, "leave part of it out, around index [3000] of dimensions [0])"),
        (_chunks_overlap, "a: its chunks do not cover it exactly once"),
        (_no_chunk, "a: no chunk holds any of its 4000 elements"),
        (_no_record, "a: the chunk at [0] has no storage record"),
        (_str_key, "a storage record is not keyed by a DCP index"),
        (_storage_meta_int, "storage_meta is a int"),
        (_offsets_int, "a's chunk offsets is not a torch.Size of sizes"),
        (_size_a_list, "a's size is not a torch.Size of sizes from 0 to 2**62"),
        (_sizes_a_tuple, "a's chunk sizes is not a torch.Size of sizes"),
        (_place_past_the_list_budget, "b.67108864: its place in the state dict (planner_data) is not"),
        (_places_past_the_list_budget, "c.9000000: planner_data's places make lists of more than"),
        (_place_a_list, "a: its place in the state dict (planner_data) is not a tuple"),
        (_place_of_another, "b.x: planner_data puts it at ('a',), not where its name says"),
        (_place_inside_another, "b.x.name: planner_data's place for it goes through another value"),
        (_place_list_and_dict, "b.0: planner_data's place for it goes through another value, or through a"),
        (_no_properties, "a: no tensor properties with a dtype"),
        (_no_chunks, "a: its chunks are not a list"),
        (_chunk_twice, "a: the chunk at [0] is listed twice"),
        (_bytes_without_record, "a: no storage record"),
        (_transforms_not_a_list, "transforms that are not a list"),
        (_record_without_length, "not a storage record"),
        (_overlapping_records, "overlap another record's"),
        (_same_record_twice, "overlap another record's"),
    ],
)
def test_malformed_metadata_is_refused_before_it_is_used(
    backend_name: str, tmp_path: Path, mutate: Callable[[Metadata], None], match: str
) -> None:
    """Objects of DCP's metadata classes built with missing or mistyped fields (the
    restricted unpickler lets a pickle set any), records missing or overlapping (reading
    them would hand out bytes twice, or whatever memory a buffer held), chunks that leave
    part of a tensor out or overlap (stock DCP loads the rest and leaves that part of the
    target as it was, silently): a typed refusal
    naming the part, where these used to escape as KeyError, TypeError, AttributeError
    or load leftover memory as values."""
    ck = tmp_path / "ck"
    _stock(ck)
    md = copy.deepcopy(_metadata(ck))
    mutate(md)
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    _refused(ck, backend_name, match)


def test_a_manifest_without_entries_checks_nothing_less(backend_name: str, tmp_path: Path) -> None:
    """A forged manifest (re-sealed) that drops every entry's checksum does not turn the
    per-entry checks off: each record must still be a checked entry."""
    ck = tmp_path / "ck"
    dcp.save({"a": torch.arange(4000.0)}, checkpoint_id=str(ck), storage_writer=AiopersistWriter())
    _rewrite_manifest(ck, lambda doc: doc.pop("entries"))
    _refused(ck, backend_name, "are no checked entry")


def test_a_damaged_value_entry_is_a_typed_error(backend_name: str, tmp_path: Path) -> None:
    """DCP's own directory has no checksums: a value entry (not a tensor) that DCP cannot
    deserialize is a CheckpointCorruptError naming the bytes, as a tensor entry is."""
    ck = tmp_path / "ck"
    _stock(ck)
    info = _metadata(ck).storage_data[MetadataIndex("b.x")]
    with open(ck / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(bytes(info.length))
    _refused(ck, backend_name, f"bytes {info.offset}..{info.offset + info.length}: not a value DCP can read")


@pytest.mark.parametrize(
    ("dtype", "entry", "match"),
    [
        (
            torch.uint4,
            None,
            "holds a torch.float32 tensor of shape [4000], the metadata's chunk is torch.uint4",
        ),
        (
            torch.int64,
            None,
            "holds a torch.float32 tensor of shape [4000], the metadata's chunk is torch.int64",
        ),
        (None, torch.arange(8000.0), "holds a torch.float32 tensor of shape [8000], the metadata's chunk is"),
    ],
    ids=["sub-byte-dtype", "other-dtype", "larger-entry"],
)
def test_an_entry_that_is_not_the_chunk_the_metadata_describes_is_refused(
    backend_name: str, tmp_path: Path, dtype: torch.dtype | None, entry: torch.Tensor | None, match: str
) -> None:
    """DCP's own directory has no checksums: a chunk claimed to be of another dtype than
    its entry holds (stock DCP casts the values into the target: an int64 claim turned
    floats into garbage integers), or an entry larger than the chunk (stock DCP takes the
    first part of it), is refused naming both, never loaded as wrong values."""
    ck = tmp_path / "ck"
    _stock(ck)
    md = _metadata(ck)
    if dtype is not None:
        md.state_dict_metadata["a"].properties.dtype = dtype  # type: ignore[union-attr]
    if entry is not None:
        buf = io.BytesIO()
        torch.save(entry, buf)
        blob = buf.getvalue()
        info = md.storage_data[A]
        with open(ck / info.relative_path, "ab") as f:
            offset = f.tell()
            f.write(blob)
        md.storage_data[A] = _StorageInfo(info.relative_path, offset, len(blob))
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    _refused(ck, backend_name, match)


def _deep_key(depth: int) -> bytes:
    """A dict whose key is a tuple ``depth`` deep (hashing it recurses in C)."""
    return b"\x80\x04}" + b")" + b"\x85" * depth + b"Ns."


def _doubling_key(levels: int) -> bytes:
    """A dict keyed by t(n), t(i+1) = (t(i), t(i)) through the memo: 2**n to hash."""
    body = b")\x940"
    for i in range(levels):
        body += b"j" + struct.pack("<I", i) + b"j" + struct.pack("<I", i) + b"\x86\x940"
    return b"\x80\x04}" + body + b"j" + struct.pack("<I", levels) + b"Ns."


def _hashed_call(levels: int) -> bytes:
    """``OrderedDict(t(n))`` with t(i+1) = (t(i), t(i)) (DUP): 2**n to hash, in the
    argument of a call to an allowed class rather than in a key."""
    return b"\x80\x02ccollections\nOrderedDict\n)" + b"2\x86" * levels + b"K\x01\x86\x85\x85R."


def _build_on_a_class() -> bytes:
    """BUILD with a state of (None, {...}) on ``pathlib.PosixPath`` itself: setattr on
    the class, for the whole process (its ``__fspath__`` made None), then DCP metadata."""
    return b"\x80\x02cpathlib\nPosixPath\nN}X\x0a\x00\x00\x00__fspath__Ns\x86b0N."


def _claims_bytes(n: int) -> bytes:
    """A BINBYTES8 whose count claims ``n`` bytes the pickle does not hold."""
    return b"\x80\x04\x8e" + struct.pack("<Q", n) + b"x."


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (_deep_key(1_000_000), "objects nested more than 64 deep"),
        (_doubling_key(30), "too large to hash"),
        (_doubling_key(100), "objects nested more than 64 deep"),
        (_claims_bytes(16 << 30), "expected 17179869184 bytes"),
        (b"\x80\x04}", "pickle exhausted before seeing STOP"),
        (_hashed_call(40), "REDUCE with arguments too large to hash"),
        (_build_on_a_class(), "BUILD on a class or function"),
    ],
    ids=[
        "deep-key",
        "doubling-key",
        "doubling-deep",
        "claimed-bytes",
        "truncated",
        "hashed-call",
        "build-class",
    ],
)
def test_pickle_bombs_in_metadata_are_refused_unread(
    backend_name: str, tmp_path: Path, raw: bytes, match: str
) -> None:
    """A tiny ``.metadata`` that would crash the interpreter (a key a million tuples deep),
    never finish (a key built of itself twice, a hundred times), or allocate what a count
    claims, is refused from its opcodes before anything is unpickled. In a fresh process
    each: a regression crashes or hangs that process, not the suite."""
    ck = tmp_path / "ck"
    _stock(ck)
    (ck / ".metadata").write_bytes(raw)
    code = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "from aiopersist.integrations.dcp import AiopersistReader\n"
        "try:\n"
        f"    dcp.load({{'a': torch.zeros(4000)}}, checkpoint_id={str(ck)!r},\n"
        f"             storage_reader=AiopersistReader(backend={backend_name!r}))\n"
        "except BaseException as exc:\n"
        "    print('REFUSED', exc)\n"
        "import pathlib\n"
        "assert pathlib.PosixPath.__fspath__ is not None  # no class changed\n"
    )
    proc = run([sys.executable, "-c", code], text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED" in proc.stdout
    assert match in proc.stdout, proc.stdout[-2000:]


def test_chunk_corners_beyond_the_budget_are_refused_at_once(backend_name: str, tmp_path: Path) -> None:
    """A ``.metadata`` of a few hundred bytes claiming a tensor of 20 dimensions of 2, in
    one chunk of 1s: checking that its chunks cover it took 13 s and 850 MiB (24
    dimensions: minutes, gigabytes). The work is bounded for the whole metadata."""
    ck = tmp_path / "ck"
    _stock(ck)
    md = _metadata(ck)
    size, ones = torch.Size([2] * 20), torch.Size([1] * 20)
    md.state_dict_metadata["a"] = TensorStorageMetadata(
        TensorProperties(torch.float32), size, [ChunkStorageMetadata(torch.Size([0] * 20), ones)]
    )
    md.storage_data = {
        MetadataIndex("a", torch.Size([0] * 20)) if k == A else k: v for k, v in md.storage_data.items()
    }
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    _refused(ck, backend_name, "too many to check that their chunks cover each once")


def test_real_metadata_passes_the_opcode_walk() -> None:
    """Every pickle protocol, and DCP's metadata of a sharded state with many chunks."""
    value = {(1, (2, 3)): [1, {2: 3}], "f": frozenset({1, 2}), "s": {4, 5}, "t": (), "n": None}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        _check_pickle_shape(pickle.dumps(value, protocol=protocol), "x")
    _check_pickle_shape(pickle.dumps(_many_chunks()), "x")


def test_long_lists_and_dicts_pass_the_opcode_walk() -> None:
    """A pickler adds a list's or dict's items a thousand at a time (one at a time in
    protocols 0 and 1): the container holds them one level down however many batches
    there are. DCP's metadata of 65,001 values (more than 64 batches) is not nested 65
    deep."""
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        _check_pickle_shape(pickle.dumps([[i] for i in range(65_001)], protocol=protocol), "x")
        _check_pickle_shape(pickle.dumps({i: (i,) for i in range(65_001)}, protocol=protocol), "x")
    values = {f"v{i}": BytesStorageMetadata() for i in range(65_001)}
    records = {MetadataIndex(f"v{i}"): _StorageInfo("__0_0.distcp", i, 1) for i in range(65_001)}
    _check_pickle_shape(pickle.dumps(Metadata(values, storage_data=records)), "x")
    # Nesting is still counted: lists 64 deep pass, 65 deep do not, however built.
    deep: list[Any] = []
    for _ in range(64):
        deep = [deep]
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        _check_pickle_shape(pickle.dumps(deep, protocol=protocol), "x")
        with pytest.raises(aiopersist.CheckpointCorruptError, match="nested more than 64 deep"):
            _check_pickle_shape(pickle.dumps([deep], protocol=protocol), "x")


def _many_chunks() -> Metadata:
    tensors: dict[str, Any] = {}
    records: dict[MetadataIndex, _StorageInfo] = {}
    for i in range(200):
        chunks = [ChunkStorageMetadata(torch.Size([r * 8, 0]), torch.Size([8, 64])) for r in range(4)]
        tensors[f"layers.{i}.w"] = TensorStorageMetadata(
            TensorProperties(torch.bfloat16), torch.Size([32, 64]), chunks
        )
        for r, c in enumerate(chunks):
            records[MetadataIndex(f"layers.{i}.w", c.offsets)] = _StorageInfo(f"__{r}_0.distcp", i * 100, 100)
    return Metadata(tensors, storage_data=records)


@pytest.mark.asyncio
async def test_read_segments_refuses_overlapping_segments(
    backend: aiopersist.IOBackend, tmp_path: Path
) -> None:
    """Each staging window fills the segments that start in order after it: overlapping
    ones would leave parts of a destination unread, so they are refused up front."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 16))
    dio = await asyncio.to_thread(aiopersist.probe_directory, tmp_path)
    pool = aiopersist.StagingPool(1 << 14, 2)
    try:
        outer, inner = torch.empty(4096, dtype=torch.uint8), torch.empty(64, dtype=torch.uint8)
        with pytest.raises(ValueError, match="overlaps the one before"):
            await read_segments(backend, path, dio, pool, [(0, outer), (800, inner)])
        await read_segments(backend, path, dio, pool, [(0, outer), (4096, inner)])  # touching is fine
        assert outer.numpy().tobytes() == path.read_bytes()[:4096]
    finally:
        pool.close()


def test_verify_reads_dcp_metadata_as_a_load_does(tmp_path: Path) -> None:
    """``aiopersist verify`` on a DCP directory whose ``.metadata`` was forged together with
    its manifest (checksums recomputed, the manifest re-sealed): every checksum matches,
    and the metadata is still reported, as a load would refuse it."""
    import xxhash

    ck = tmp_path / "ck"
    dcp.save({"a": torch.arange(4000.0)}, checkpoint_id=str(ck), storage_writer=AiopersistWriter())
    ok = run([sys.executable, "-m", "aiopersist", "verify", str(ck)], text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    md = _metadata(ck)
    md.storage_meta = "forged"  # type: ignore[assignment]
    raw = pickle.dumps(md)
    (ck / ".metadata").write_bytes(raw)

    def reseal(doc: dict[str, Any]) -> None:
        doc["files"][".metadata"].update(bytes=len(raw), checksum=xxhash.xxh3_64_hexdigest(raw))

    _rewrite_manifest(ck, reseal)
    bad = run([sys.executable, "-m", "aiopersist", "verify", str(ck)], text=True)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "corrupt:" in bad.stdout
    assert "storage_meta is a str" in bad.stdout


class _Calls:
    """Pickles as a call of ``builtins.eval``: what a hostile ``.metadata`` would hold."""

    def __reduce__(self) -> Any:
        return (eval, ("1",))


def test_the_resume_check_reads_dcp_metadata_as_a_load_does(backend_name: str, tmp_path: Path) -> None:
    """The integrations' resume check (the Trainer's ``verify_on_resume``, Accelerate's
    ``load_state``) on a checkpoint with a DCP directory whose ``.metadata`` was forged
    with its checksums (a pickle naming ``builtins.eval``): every checksum matches, so it
    passed, and DCP's own reader, which FSDP's loading uses, would unpickle it whole
    (found by the fuzzing helper, through ``aiopersist verify`` against
    ``aiopersist.verify``). Now refused before anything loads it, as the CLI does."""
    from aiopersist.integrations._common import checkpoint_problem

    ck = tmp_path / "ck"
    dcp.save(
        {"a": torch.arange(4000.0)},
        checkpoint_id=str(ck),
        storage_writer=AiopersistWriter(backend=backend_name),
    )
    assert checkpoint_problem(str(ck), backend_name, distributed=False) is None
    md = _metadata(ck)
    md.storage_meta = _Calls()  # type: ignore[assignment]
    _reseal_metadata(ck, md)
    asyncio.run(aiopersist.verify(ck, backend=backend_name))  # sizes and checksums: all match
    problem = checkpoint_problem(str(ck), backend_name, distributed=False)
    assert problem is not None
    assert "builtins.eval is not part of DCP's metadata" in problem, problem


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_data_file_swapped_for_a_fifo_after_the_metadata_never_hangs_the_load(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """The data file becomes a FIFO after ``read_metadata``: the reader's probe of the file
    and its reads refuse it at once (a writer opens the FIFO after 10 s on a regression,
    so that the test fails rather than hangs)."""

    from aiopersist import _direct

    if not direct:
        monkeypatch.setenv("AIOPERSIST_DIRECT_IO", "0")
    ck = tmp_path / "ck"
    dcp.save(
        {"w": torch.randn(1 << 16)},
        checkpoint_id=str(ck),
        storage_writer=AiopersistWriter(backend=backend_name),
    )
    monkeypatch.setattr(_direct, "_cache", {})  # as in a fresh process: the file itself is probed
    victim = ck / "__0_0.distcp"

    class Swapping(AiopersistReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = super().read_metadata(*args, **kwargs)
            victim.unlink()
            os.mkfifo(victim)
            return metadata

    with (
        fifo_opened_after(victim) as waited,
        pytest.raises(BaseException, match="not a regular file") as info,
    ):
        dcp.load(
            {"w": torch.zeros(1 << 16)}, checkpoint_id=str(ck), storage_reader=Swapping(backend=backend_name)
        )
    assert "CheckpointCorruptError" in str(info.value)  # in DCP's CheckpointException
    assert not waited.is_set()  # refused at once, not once a writer came


def test_paths_pickled_by_python_3_13_are_read_on_any_python() -> None:
    """Python 3.13 pickles a ``Path`` as ``pathlib._local.PosixPath`` (DCP's storage_meta
    holds one): the metadata unpickler reads it on Pythons that have no such module."""
    import io

    from aiopersist.integrations.dcp import _MetadataUnpickler

    raw = pickle.dumps(Path("/runs/ck"), protocol=2)  # no frames: the name can be edited
    as_313 = raw.replace(b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n")
    assert as_313 != raw
    assert _MetadataUnpickler(io.BytesIO(as_313)).load() == Path("/runs/ck")


_FORK_AFTER_OVERWRITE = """
pid = os.fork()  # the second save's deletion of the first is pending
if pid == 0:
    w = aio_dcp.AiopersistWriter(backend={b!r})  # the engine's threads are the parent's
    dcp.save({{"w": torch.ones(64)}}, checkpoint_id={ck!r} + "-child", storage_writer=w)
    print("child deletions to wait for at exit", len(aio_dcp._deleting), flush=True)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_child_forked_with_a_deletion_pending_saves_and_exits_at_once(
    backend_name: str, tmp_path: Path
) -> None:
    """A process forked while the background deletion of a replaced checkpoint is
    pending: the child's own DCP save runs (the engine's worker threads were the
    parent's; a regression hangs the save, and the run fails), and it has none of the
    parent's deletions to wait for at exit."""
    root = str(Path(__file__).resolve().parents[2])
    fmt = {"root": root, "ck": str(tmp_path / "ck"), "b": backend_name}
    script = SLOW_OVERWRITES.format(**fmt, seconds=3, saves=2) + _FORK_AFTER_OVERWRITE.format(**fmt)
    out = run_forking_script(script)
    assert "child deletions to wait for at exit 0" in out
    assert "child exit 0" in out
    assert (tmp_path / "ck-child" / ".metadata").is_file()


# -- inspect: every dtype DCP can hold or its metadata name; sizes bounded -------------------


def _aiopersist_dcp(path: Path, backend_name: str) -> None:
    dcp.save(
        {"a": torch.arange(4000.0), "z": torch.randn(4, dtype=torch.complex128)},
        checkpoint_id=str(path),
        storage_writer=AiopersistWriter(backend=backend_name),
    )


def _reseal_metadata(ck: Path, md: Metadata) -> None:
    """``md`` as the checkpoint's ``.metadata``, the manifest re-sealed over it (as a
    forger would): only what the metadata says is wrong."""
    from aiopersist._manifest import new_hasher

    raw = pickle.dumps(md)
    (ck / ".metadata").write_bytes(raw)
    hasher = new_hasher()
    hasher.update(raw)

    def change(doc: dict[str, Any]) -> None:
        doc["files"][".metadata"].update(bytes=len(raw), checksum=hasher.hexdigest())

    _rewrite_manifest(ck, change)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from aiopersist._cli import main

    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_inspect_names_a_dtype_safetensors_has_no_name_for(
    backend_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A valid DCP checkpoint holding a complex128 tensor (safetensors has no name for
    it): listed under torch's name, where inspect used to stop with a raw KeyError."""
    from aiopersist._cli.main import describe, format_description

    ck = tmp_path / "ck"
    _aiopersist_dcp(ck, backend_name)
    rows = {t["name"]: t for t in describe(ck, backend=backend_name)["tensors"]}
    assert (rows["z"]["dtype"], rows["z"]["shape"], rows["z"]["bytes"]) == ("complex128", [4], 64)
    assert (rows["a"]["dtype"], rows["a"]["bytes"]) == ("F32", 16000)
    assert re.search(r"z +complex128 +\[4\] +64 B", format_description(describe(ck)))
    rc, out, err = _cli(capsys, "inspect", "--backend", backend_name, str(ck))
    assert (rc, err) == (0, "")
    assert re.search(r"z +complex128 +\[4\] +64 B", out)
    rc, out, err = _cli(capsys, "inspect", "--json", "--backend", backend_name, str(ck))
    assert (rc, err) == (0, "")
    assert {t["name"]: t["dtype"] for t in json.loads(out)["tensors"]} == {"a": "F32", "z": "complex128"}


def test_inspect_lists_any_dtype_forged_metadata_names(
    backend_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hostile ``.metadata`` (re-sealed in the manifest) may name any dtype torch has
    (quantized, bit, sub-byte ones): inspect lists it by its name, in text and JSON."""
    from aiopersist._cli.main import describe, format_description
    from aiopersist._format import DTYPES

    safetensors_names = {dtype: name for name, dtype in DTYPES.items()}
    ck = tmp_path / "ck"
    _aiopersist_dcp(ck, backend_name)
    original = _metadata(ck)
    dtypes = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)
    assert {torch.qint8, torch.bits8, torch.uint3, torch.complex32} <= set(dtypes)
    for dtype in dtypes:
        md = copy.deepcopy(original)
        md.state_dict_metadata["a"].properties.dtype = dtype  # type: ignore[union-attr]
        _reseal_metadata(ck, md)
        name = safetensors_names.get(dtype, str(dtype).removeprefix("torch."))
        row = {t["name"]: t for t in describe(ck, backend=backend_name)["tensors"]}["a"]
        assert (row["dtype"], row["bytes"]) == (name, 4000 * dtype.itemsize)
        assert re.search(rf"\ba +{re.escape(name)} +\[4000\]", format_description(describe(ck)))
        rc, out, err = _cli(capsys, "inspect", "--json", str(ck))
        assert (rc, err) == (0, "")
        assert json.loads(out)["tensors"][0]["dtype"] == name


def _sized(size: list[int]) -> Callable[[Metadata], None]:
    """Tensor ``a`` (4000 elements) claimed to be of ``size``: its one chunk at offset 0
    of as many dimensions (within it, as the chunk checks want)."""

    def change(md: Metadata) -> None:
        tensor = md.state_dict_metadata["a"]
        zeros = [0] * len(size)
        tensor.size = torch.Size(size) if max(size) < 2**63 else size  # type: ignore[union-attr]
        tensor.chunks[0].offsets = torch.Size(zeros)  # type: ignore[union-attr]
        tensor.chunks[0].sizes = torch.Size([4000] + [1] * (len(size) - 1))  # type: ignore[union-attr]
        md.storage_data[MetadataIndex("a", torch.Size(zeros))] = md.storage_data.pop(A)

    return change


def test_a_state_dict_rebuilt_from_the_places_is_stock_s_and_a_forged_place_is_refused(
    backend_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP rebuilds the nested state dict from ``planner_data`` (loading into an empty
    one, ``load_sharded_optimizer_state_dict``): through the reader, nested dicts and lists
    come back as stock DCP's reader gives them; a forged place (a list index of 2**26,
    re-sealed in the manifest) is refused by the load, verify and inspect before DCP
    grows a list to it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from aiopersist._cli.main import describe

    groups = [{"lr": 0.1, "p": [torch.zeros(2)]}, {"lr": 0.2}]
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3)},
        "optim": {"state": {"0": {"m": torch.ones(3)}}, "groups": groups},
        "step": 7,
    }
    ck = tmp_path / "ck"
    dcp.save(state, checkpoint_id=str(ck), storage_writer=AiopersistWriter(backend=backend_name))
    reader = AiopersistReader(backend=backend_name)
    ours = _load_state_dict_from_keys(checkpoint_id=str(ck), storage_reader=reader)
    stock = _load_state_dict_from_keys(checkpoint_id=str(ck), storage_reader=FileSystemReader(str(ck)))
    assert repr(ours) == repr(stock) == repr(state)
    md = _metadata(ck)
    assert md.planner_data["optim.groups.0.p.0"] == ("optim", "groups", 0, "p", 0)
    md.state_dict_metadata["step.67108864"] = md.state_dict_metadata.pop("step")
    md.storage_data[MetadataIndex("step.67108864")] = md.storage_data.pop(MetadataIndex("step"))
    md.planner_data["step.67108864"] = ("step", 2**26)
    del md.planner_data["step"]
    _reseal_metadata(ck, md)
    match = "step.67108864: its place in the state dict (planner_data) is not a tuple"
    with pytest.raises(BaseException, match=re.escape(match)):  # DCP's wrapper
        _load_state_dict_from_keys(checkpoint_id=str(ck), storage_reader=reader)
    with pytest.raises(aiopersist.CheckpointCorruptError, match=re.escape(match)):
        describe(ck, backend=backend_name)
    rc, out, err = _cli(capsys, "verify", "--backend", backend_name, str(ck))
    assert rc == 1
    assert match in out + err


@pytest.mark.parametrize(
    ("size", "match"),
    [
        ([2**63], "a's size is not a torch.Size of sizes from 0 to 2**62"),
        ([10**400], "a's size is not a torch.Size of sizes from 0 to 2**62"),
        ([2**40, 2**40], "a: its size holds more than 2**62 elements"),
    ],
    ids=["past int64", "past a float", "too many elements"],
)
def test_sizes_no_tensor_can_have_are_refused_by_inspect_verify_and_load(
    backend_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], size: list[int], match: str
) -> None:
    """A tensor's size in ``.metadata`` past what torch can hold: a typed refusal by
    inspect (which used to list it, or stop with a raw OverflowError printing its size),
    verify and a load alike."""
    from aiopersist._cli.main import describe

    ck = tmp_path / "ck"
    dcp.save(
        {"a": torch.arange(4000.0)},
        checkpoint_id=str(ck),
        storage_writer=AiopersistWriter(backend=backend_name),
    )
    md = _metadata(ck)
    _sized(size)(md)
    _reseal_metadata(ck, md)
    with pytest.raises(aiopersist.CheckpointCorruptError, match=re.escape(match)):
        describe(ck, backend=backend_name)
    for args in (["inspect"], ["inspect", "--json"], ["verify"]):
        rc, out, err = _cli(capsys, *args, "--backend", backend_name, str(ck))
        assert rc == 1
        assert match in out + err
    _refused(ck, backend_name, match)


def test_a_size_with_a_zero_among_huge_dimensions_is_listed(
    backend_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tensor with no element, however large its other dimensions: inspect lists it,
    0 bytes, without multiplying them out."""
    from aiopersist._cli.main import describe

    ck = tmp_path / "ck"
    _aiopersist_dcp(ck, backend_name)
    md = _metadata(ck)
    tensor = md.state_dict_metadata["a"]
    shape = torch.Size([2**62] * 200 + [0])
    tensor.size = shape  # type: ignore[union-attr]
    tensor.chunks[0].offsets = torch.Size([0] * 201)  # type: ignore[union-attr]
    tensor.chunks[0].sizes = shape  # type: ignore[union-attr]
    md.storage_data[MetadataIndex("a", torch.Size([0] * 201))] = md.storage_data.pop(A)
    _reseal_metadata(ck, md)
    row = {t["name"]: t for t in describe(ck, backend=backend_name)["tensors"]}["a"]
    assert (row["shape"], row["bytes"]) == (list(shape), 0)
    rc, out, err = _cli(capsys, "inspect", str(ck))
    assert (rc, err) == (0, "")
    assert re.search(r"\ba +F32 +\[4611686018427387904, .*, 0\] +0 B", out)


_CLAIM_SCRIPT = """
import resource, sys
import torch, torch.distributed.checkpoint as dcp
from aiopersist.integrations.dcp import AiopersistReader
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
try:
    dcp.load({"a": torch.zeros(4000), "b": {"x": 0, "name": ""}}, checkpoint_id=sys.argv[1],
             storage_reader=AiopersistReader(backend=sys.argv[2]))
except BaseException as exc:
    print(type(exc).__name__, exc)
"""


def test_a_record_claiming_more_than_the_memory_available_is_refused_before_allocating(
    backend_name: str, tmp_path: Path
) -> None:
    """A record of a sparse file claiming 1 TiB: `NotEnoughMemoryError`, nothing allocated
    (the load runs under an address-space limit, so that a regression fails here rather
    than takes the machine's memory)."""
    _stock(tmp_path)
    md = _metadata(tmp_path)
    info = md.storage_data[A]
    data = tmp_path / info.relative_path
    end = data.stat().st_size
    md.storage_data[A] = _StorageInfo(info.relative_path, end, 1 << 40, info.transform_descriptors)
    os.truncate(data, end + (1 << 40))  # sparse: no block of it is written
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    proc = run([sys.executable, "-c", _CLAIM_SCRIPT, str(tmp_path), backend_name], text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r": loading it needs (\d+) bytes \(1024\.0 GiB\) of host memory", proc.stdout)
    assert found, proc.stdout[-2000:]
    assert 1 << 40 < int(found[1]) < (1 << 40) + (1 << 20)  # the claim, and the values' entries
    assert "NotEnoughMemoryError" in proc.stdout, proc.stdout[-2000:]


class _RunsCode:
    """A value whose unpickling makes a directory: what a hostile pickle could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.path,)


def _with_value(ck: Path, fqn: str, value: object) -> None:
    """``value``, as DCP's planner serializes it, made the entry of the value ``fqn``
    (appended to its file, its record pointed at it), as a forger would."""
    md = _metadata(ck)
    index = MetadataIndex(fqn)
    info = md.storage_data[index]
    buf = io.BytesIO()
    torch.save(value, buf)
    data = ck / info.relative_path
    end = data.stat().st_size
    with open(data, "ab") as f:
        f.write(buf.getvalue())
    md.storage_data[index] = _StorageInfo(
        info.relative_path, end, len(buf.getvalue()), info.transform_descriptors
    )
    (ck / ".metadata").write_bytes(pickle.dumps(md))


def test_a_value_that_would_run_code_is_refused_unrun(backend_name: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _stock(ck)
    ran = tmp_path / "ran"
    _with_value(ck, "b.x", _RunsCode(str(ran)))
    _refused(
        ck,
        backend_name,
        "the value 'b.x' needs unpickling beyond weights_only (Trying to load unsupported GLOBAL posix.mkdir",
    )
    assert not ran.exists()
    # A value of a class of its own is refused too, and loads with allow_pickle=True.
    _with_value(ck, "b.x", datetime.date(2024, 1, 2))
    _refused(ck, backend_name, "'b.x' needs unpickling beyond weights_only")
    target = _target()
    reader = AiopersistReader(backend=backend_name, allow_pickle=True)
    dcp.load(target, checkpoint_id=str(ck), storage_reader=reader)
    assert target["b"]["x"] == datetime.date(2024, 1, 2)
    assert torch.equal(target["a"], torch.arange(4000.0))


def _tiling(rng: Any, offsets: list[int], sizes: list[int], depth: int) -> list[tuple[list[int], list[int]]]:
    """Boxes that tile the box at ``offsets`` of ``sizes``: split along a dimension, again
    and again."""
    splittable = [d for d, n in enumerate(sizes) if n > 1]
    if depth == 0 or not splittable or rng.random() < 0.2:
        return [(offsets, sizes)]
    d = rng.choice(splittable)
    k = rng.randrange(1, sizes[d])
    first = [*sizes[:d], k, *sizes[d + 1 :]]
    second = [*sizes[:d], sizes[d] - k, *sizes[d + 1 :]]
    after = [*offsets[:d], offsets[d] + k, *offsets[d + 1 :]]
    return _tiling(rng, offsets, first, depth - 1) + _tiling(rng, after, second, depth - 1)


def test_the_chunk_cover_check_agrees_with_counting_every_element() -> None:
    """`_check_cover` against the plain count of how many chunks hold each element, on
    random tilings and on tilings with one chunk dropped, shrunk, grown or moved."""
    import random

    from aiopersist.integrations.dcp import _check_cover

    rng = random.Random(7)
    for _ in range(400):
        size = [rng.randint(1, 7) for _ in range(rng.randint(1, 4))]
        boxes = _tiling(rng, [0] * len(size), size, 6)
        i, d = rng.randrange(len(boxes)), rng.randrange(len(size))
        offsets, sizes = boxes[i]
        change = rng.choice(["none", "drop", "shrink", "grow", "move"])
        if change == "drop":
            del boxes[i]
        elif change in ("shrink", "grow") and sizes[d] + (1 if change == "grow" else -1) > 0:
            sizes = [*sizes[:d], sizes[d] + (1 if change == "grow" else -1), *sizes[d + 1 :]]
        elif change == "move" and offsets[d] > 0:
            offsets = [*offsets[:d], offsets[d] - 1, *offsets[d + 1 :]]
        if change != "drop":
            boxes[i] = (offsets, sizes)
        boxes = [(o, n) for o, n in boxes if all(a + b <= m for a, b, m in zip(o, n, size, strict=True))]
        count = torch.zeros(size, dtype=torch.int64)
        for o, n in boxes:
            count[tuple(slice(a, a + b) for a, b in zip(o, n, strict=True))] += 1
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in boxes]
        if bool((count == 1).all()):
            _check_cover(tuple(size), chunks, "t", [1 << 24])
        else:
            with pytest.raises(aiopersist.CheckpointCorruptError, match="t: "):
                _check_cover(tuple(size), chunks, "t", [1 << 24])
