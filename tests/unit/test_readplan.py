"""The read plan (pure): which bytes of which files a load reads, into what, checked how;
built from manifests made in memory, without files."""

from __future__ import annotations

import pytest
import torch

from aiopersist._exceptions import CheckpointCorruptError, StateMismatchError
from aiopersist._format import layout_file
from aiopersist._manifest import (
    FileRecord,
    Manifest,
    RankState,
    SlicedRecord,
    SliceRecord,
    TensorRecord,
)
from aiopersist._readplan import (
    FileRead,
    Span,
    check_tiling,
    host_bytes,
    plan_read,
    plan_safetensors,
    plan_verify,
)


def _ref(name: str) -> dict[str, str]:
    return {"__tensor__": name}


def _v1() -> Manifest:
    # An empty tensor and a scalar at the same offset: the spans must still tile the file.
    tensors = {
        "s": TensorRecord("s", "state.safetensors", 96, 100, torch.float32, ()),
        "e": TensorRecord("e", "state.safetensors", 96, 96, torch.float32, (0,)),
        "w": TensorRecord("w", "state.safetensors", 64, 96, torch.float32, (8,)),
    }
    files = {"state.safetensors": FileRecord("state.safetensors", 100, "c", 64)}
    return Manifest(files, tensors, {k: _ref(k) for k in ("s", "e", "w")})


def test_a_version_1_checkpoint_reads_its_files_whole_in_offset_order() -> None:
    plan = plan_read(_v1(), _v1().rank_state(0))
    assert not plan.checked_spans
    [read] = plan.files
    assert read.whole
    assert [(s.begin, s.end, s.target) for s in read.spans] == [(64, 96, "w"), (96, 96, "e"), (96, 100, "s")]
    check_tiling(read, 64, 100, "f")  # no gap, nothing after the last tensor
    assert plan.needed == {"s", "e", "w"}


def test_tiling_names_the_gap_and_the_trailing_bytes() -> None:
    read = FileRead("f", (Span(10, 20, "a"), Span(24, 30, "b")), whole=True)
    with pytest.raises(CheckpointCorruptError, match=r"bytes 20\.\.24 belong to no tensor"):
        check_tiling(read, 10, 30, "f")
    with pytest.raises(CheckpointCorruptError, match="4 bytes after the last tensor"):
        check_tiling(FileRead("f", (Span(10, 20, "a"),), whole=True), 10, 24, "f")


def _v2(checksums: bool = True) -> Manifest:
    """Two ranks: a shared tensor, one local tensor each, and a tensor in 4 row slices of
    2 rows (4 floats a row) over two files."""
    c = "x" if checksums else None
    files = {
        "r0.safetensors": FileRecord("r0.safetensors", 200, "f0", 8),
        "r1.safetensors": FileRecord("r1.safetensors", 200, "f1", 8),
        "other.safetensors": FileRecord("other.safetensors", 24, "f2", 8),
    }
    tensors = {
        "shared": TensorRecord("shared", "r0.safetensors", 8, 24, torch.float32, (4,), c),
        "mine@0": TensorRecord("mine@0", "r0.safetensors", 24, 40, torch.float32, (4,), c),
        "mine@1": TensorRecord("mine@1", "other.safetensors", 8, 24, torch.float32, (4,), c),
    }
    slices = tuple(
        SliceRecord(f"r{i // 2}.safetensors", 40 + 32 * (i % 2), 72 + 32 * (i % 2), 2 * i, 2 * i + 2, c)
        for i in range(4)
    )
    sliced = {"big": SlicedRecord("big", torch.float32, (8, 4), slices)}
    skeleton = {"shared": _ref("shared"), "mine": _ref("mine@0"), "big": _ref("big")}
    ranks = {1: RankState({"shared": _ref("shared"), "mine": _ref("mine@1"), "big": _ref("big")})}
    return Manifest(files, tensors, skeleton, version=2, world_size=2, sliced=sliced, ranks=ranks)


def test_checked_spans_read_only_what_the_rank_needs() -> None:
    m = _v2()
    plan = plan_read(m, m.rank_state(1))
    assert plan.checked_spans
    assert plan.needed == {"shared", "mine@1", "big"}
    by_file = {f.file: [s.target for s in f.spans] for f in plan.files}
    assert by_file == {
        "r0.safetensors": ["shared", "big", "big"],
        "other.safetensors": ["mine@1"],
        "r1.safetensors": ["big", "big"],
    }
    assert all(not f.whole for f in plan.files)
    assert all(s.checksum == "x" for f in plan.files for s in f.spans)


def test_wanted_rows_read_the_overlapping_slices_and_keep_part_of_a_straddled_one() -> None:
    m = _v2()
    plan = plan_read(m, m.rank_state(0), {"big": (3, 6)})
    [big] = [t for t in plan.targets if t.name == "big"]
    assert big.shape == (3, 4)
    spans = sorted((s for f in plan.files for s in f.spans if s.target == "big"), key=lambda s: s.rows or ())
    # Slices [2:4] and [4:6] overlap rows 3..6: the first is read whole, row 3 kept.
    assert [(s.rows, s.keep, s.slice_rows) for s in spans] == [((0, 1), (1, 2), 2), ((1, 3), None, 2)]
    assert plan.wanted_rows == {"big": (3, 6)}
    with pytest.raises(StateMismatchError, match=r"rows 6\.\.9 wanted"):
        plan_read(m, m.rank_state(0), {"big": (6, 9)})


def test_without_checksums_of_their_own_the_needed_files_are_read_whole() -> None:
    m = _v2(checksums=False)
    plan = plan_read(m, m.rank_state(0), {"big": (0, 2)})
    assert not plan.checked_spans
    assert {f.file for f in plan.files} == {"r0.safetensors", "r1.safetensors"}  # not rank 1's own file
    assert all(f.whole for f in plan.files)
    # Everything in a file read whole is read (the checksum covers it), only the needed is kept.
    assert {t.name for t in plan.targets} == {"shared", "mine@0", "big"}
    assert plan.wanted_rows == {}


def test_the_pickle_file_is_read_only_when_allowed() -> None:
    m = _v1()
    m = Manifest(
        {**m.files, "pickled.bin": FileRecord("pickled.bin", 10, "p")},
        m.tensors,
        m.skeleton,
        pickle_file="pickled.bin",
    )
    assert plan_read(m, m.rank_state(0)).pickle_file is None
    assert plan_read(m, m.rank_state(0), allow_pickle=True).pickle_file == "pickled.bin"
    assert "pickled.bin" not in {f.file for f in plan_read(m, m.rank_state(0), allow_pickle=True).files}


def test_verify_reads_every_file_whole_keeps_nothing_and_checks_each_header() -> None:
    m = _v2()
    m = Manifest(
        {**m.files, "pickled.bin": FileRecord("pickled.bin", 10, "p")},
        m.tensors,
        m.skeleton,
        version=2,
        world_size=2,
        sliced=m.sliced,
        ranks=m.ranks,
        pickle_file="pickled.bin",
    )
    plan = plan_verify(m)
    assert (plan.targets, plan.needed, plan.pickle_file) == ((), frozenset(), None)
    assert [f.file for f in plan.files] == list(m.files)  # every file, the other ranks' too
    assert all(f.whole and not f.spans for f in plan.files)
    header = {f.file: f.header for f in plan.files}
    # Whole tensors and slices alike, sorted by offset; no header for the pickle file.
    assert header["r0.safetensors"] == ((8, 24), (24, 40), (40, 72), (72, 104))
    assert header["r1.safetensors"] == ((40, 72), (72, 104))
    assert header["other.safetensors"] == ((8, 24),)
    assert header["pickled.bin"] is None


def test_plain_safetensors_files_are_read_by_their_headers_and_may_not_repeat_a_name() -> None:
    a = layout_file([("x", torch.float16, (3,)), ("y", torch.int64, ())], {})
    b = layout_file([("z", torch.float32, (2, 2))], {})
    plan = plan_safetensors([("a", a), ("b", b)])
    assert [t.name for t in plan.targets] == ["x", "y", "z"]
    assert all(s.checksum is None for f in plan.files for s in f.spans)
    with pytest.raises(CheckpointCorruptError, match="more than one file: 'z'"):
        plan_safetensors([("a", b), ("b", b)])


def test_a_plan_counts_the_host_memory_its_load_allocates() -> None:
    m = _v2()
    # Checked spans, rows 3..6 of big: shared and mine@0 (4 floats each), big's 3 rows of 4
    # floats, and the scratch of the slice it keeps one row of (2 rows).
    assert host_bytes(plan_read(m, m.rank_state(0), {"big": (3, 6)}), m) == 16 + 16 + 48 + 32
    # Whole files: everything in them, and their headers (8 bytes each).
    w = _v2(checksums=False)
    assert host_bytes(plan_read(w, w.rank_state(0)), w) == 16 + 16 + 128 + 8 + 8
    v1 = _v1()
    pickled = Manifest(
        {**v1.files, "pickled.bin": FileRecord("pickled.bin", 10, "p")},
        v1.tensors,
        v1.skeleton,
        pickle_file="pickled.bin",
    )
    assert host_bytes(plan_read(pickled, pickled.rank_state(0)), pickled) == 36 + 64
    assert host_bytes(plan_read(pickled, pickled.rank_state(0), allow_pickle=True), pickled) == 36 + 64 + 10
    assert host_bytes(plan_verify(m), m) == 0  # streamed through the staging pool
