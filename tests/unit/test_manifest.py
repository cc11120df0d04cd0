"""The manifest's encoding (pure): `dump_manifest` encodes a field at a time and reuses a
plan's tensor table, and must write exactly the bytes, and the checksum, that encoding
the whole document at once gives; and the records a plan keeps are its files' layout."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
import xxhash

from aiopersist import _manifest as manifest_module
from aiopersist._exceptions import CheckpointCorruptError, UnsupportedStateError
from aiopersist._flatten import ViewSpec, flatten
from aiopersist._format import MAX_DIMS, MAX_HEADER_BYTES, MAX_JSON_ITEMS, json_items
from aiopersist._manifest import (
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    FileRecord,
    Manifest,
    RankState,
    SlicedRecord,
    SliceRecord,
    TensorRecord,
    TensorTable,
    _canonical,
    dcp_directories,
    dump_manifest,
    format_version,
    member_directories,
    parse_index,
    parse_manifest,
    safe_member_name,
)
from aiopersist._plan import RankDesc, describe, plan_write, rank_state


def _whole_document_bytes(m: Manifest) -> bytes:
    """The manifest as encoding the document whole defines it: the checksum of the sorted,
    ASCII-only canonical form, then the document in its own order."""
    doc = m.to_json()
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    doc["manifest_checksum"] = xxhash.xxh3_64_hexdigest(canonical.encode())
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def _manifest(version: int) -> Manifest:
    # Names that JSON escapes, sorts differently from insertion order, or writes as \u
    # escapes: the field-at-a-time encoding must agree with the whole one on all of them.
    names = ["zeta", "Ünïcode.wéight", 'quote"d\\back', "tab\there", "emoji.😀", "a"]
    tensors: dict[str, TensorRecord] = {}
    offset = 128
    for i, name in enumerate(names):
        checksum = f"{i:016x}" if version >= 2 else None
        tensors[name] = TensorRecord(
            name, "state.safetensors", offset, offset + 16, torch.float32, (2, 2), checksum
        )
        offset += 16
    files = {"state.safetensors": FileRecord("state.safetensors", offset, "0" * 16, 128)}
    skeleton = {n: {"__tensor__": n} for n in names} | {"lr": 1e-05, "nan": {"__float__": "nan"}, "ok": True}
    kw: dict[str, object] = {}
    if version >= 2:
        kw = {
            "sliced": {
                "s": SlicedRecord(
                    "s", torch.bfloat16, (4,), (SliceRecord("state.safetensors", 0, 8, 0, 4, "ab" * 8),)
                )
            },
            "directories": (".", "../other/part-0123456789ab"),
            "ranks": {1: RankState({"x": 1}, {"y": "a"}, {})},
        }
    return Manifest(
        files=files,
        tensors=tensors,
        skeleton=skeleton,
        aliases={"tied": "a"},
        views={"v": ViewSpec("a", 4, torch.float32, (2,), (1,))},
        metadata={"note": 'ünï "quoted"', "step": "7"},
        layout="state",
        world_size=2 if version >= 2 else 1,
        version=version,
        created="2026-11-23T00:00:00+00:00",
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("version", [1, 2])
def test_field_at_a_time_encoding_is_the_whole_documents(version: int) -> None:
    m = _manifest(version)
    assert dump_manifest(m) == _whole_document_bytes(m)
    # The same table, kept (as a plan keeps it): the same bytes, encoded once.
    table = TensorTable(m.tensors)
    kept = Manifest(**{**m.__dict__, "tensors": table})
    assert dump_manifest(kept) == _whole_document_bytes(m)
    assert table.encoded(version) is table.encoded(version)


def test_a_plans_records_are_its_layout_and_make_a_manifest_that_parses() -> None:
    state = {"b": torch.ones(3, dtype=torch.float16), "a": torch.zeros(2, 2), "n": torch.arange(5)}
    flat = flatten(state)
    tensors = describe(flat, 0, 1, None)
    desc = RankDesc(0, 0, tensors, rank_state(flat, tensors), "tok", flat.model_only)
    plan = plan_write([desc], 1, 1 << 40)
    assert plan.records is plan.records  # made once per plan
    (f,) = plan.files
    for part, entry in zip(f.parts, f.layout.entries, strict=True):
        rec = plan.records[part.target]
        base = f.layout.data_offset
        assert (rec.file, rec.begin, rec.end) == (f.name, base + entry.begin, base + entry.end)
        assert (rec.dtype, rec.shape, rec.checksum) == (entry.dtype, entry.shape, None)
    size = f.layout.data_offset + f.layout.data_bytes
    m = Manifest(
        files={f.name: FileRecord(f.name, size, "0" * 16, f.layout.data_offset)},
        tensors=plan.records,
        skeleton=desc.state.skeleton,
        layout=plan.layout,
    )
    back = parse_manifest(dump_manifest(m), "test")
    assert list(back.tensors) == list(plan.records)
    assert all(back.tensors[n] == plan.records[n] for n in back.tensors)


@pytest.mark.parametrize(
    "name",
    [
        "optimizer_0/__0_0.distcp",
        "pytorch_model_fsdp_0/.metadata",
        "scheduler.pt",
        "additional_chat_templates/tool_use.jinja",
        "a/b/c/d.json",
    ],
)
def test_a_version_2_file_may_be_in_subdirectories(name: str) -> None:
    assert safe_member_name(name, "m") == name


@pytest.mark.parametrize(
    "name", ["../x", "a/../x", "a/..", "./x", "a/./b", "/a/b", "a//b", "a/", "/x", "a\\b/c", "", "a/b\0"]
)
def test_a_subdirectory_name_cannot_lead_out(name: str) -> None:
    with pytest.raises(CheckpointCorruptError, match="would escape the checkpoint directory"):
        safe_member_name(name, "m")


def test_names_are_bounded_in_depth_length_and_encoding() -> None:
    assert safe_member_name("a/" * 16 + "f", "m") == "a/" * 16 + "f"
    for name, match in [
        ("a/" * 17 + "f", "deeper than 16 subdirectories"),
        ("a/" * 200_000 + "f", "deeper than 16 subdirectories"),  # refused before it is split
        (("x" * 200 + "/") * 6 + "f", "longer than 1024 bytes"),
        ("x" * 256, "is not a name a file can have"),
        ("d/\ud800.json", "is not a name a file can have"),
        ("\ud800", "is not a name a file can have"),
    ]:
        with pytest.raises(CheckpointCorruptError, match=match):
            safe_member_name(name, "m")
    with pytest.raises(CheckpointCorruptError, match="deeper than 1 subdirectories"):
        safe_member_name("a/b/c.json", "m", depth=1)  # a version 2 manifest


def test_the_format_version_follows_the_deepest_name() -> None:
    assert format_version(["model.safetensors", "config.json"], 1) == 1
    assert format_version(["model.safetensors", "templates/a.jinja"], 1) == 2
    assert format_version(["unet/sub/config.json"], 1) == 3
    assert format_version(["x"], 2) == 2


def test_a_version_2_manifest_with_deeper_names_is_refused_and_version_3_takes_them() -> None:
    def manifest(version: int) -> bytes:
        m = Manifest(
            files={"a/b/c.json": FileRecord("a/b/c.json", 2, "0" * 16)},
            tensors={},
            skeleton={},
            version=version,
        )
        return dump_manifest(m)

    with pytest.raises(CheckpointCorruptError, match="deeper than 1 subdirectories"):
        parse_manifest(manifest(2), "m")
    assert list(parse_manifest(manifest(3), "m").files) == ["a/b/c.json"]


def test_the_dcp_directories_are_those_their_saver_wrote() -> None:
    def manifest(layout: str, names: list[str]) -> Manifest:
        files = {n: FileRecord(n, 1, "0" * 16) for n in names}
        return Manifest(files=files, tensors={}, skeleton={}, layout=layout, version=3)

    hooked = ["notes/.metadata", "ema/dcp/.metadata", "ema/dcp/__0_0.distcp"]
    fsdp = ["optimizer_0/.metadata", "optimizer_0/aiopersist.json", "optimizer_0/__0_0.distcp"]
    assert dcp_directories(manifest("fsdp", [*fsdp, *hooked, "trainer_state.json"])) == ["optimizer_0"]
    assert dcp_directories(manifest("dcp", [".metadata", "__0_0.distcp"])) == [""]
    assert dcp_directories(manifest("hf-model", ["model.safetensors", *hooked])) == []


def test_member_directories_lists_every_directory_parents_first() -> None:
    names = ["z/y/x.bin", "a.json", "b/c.txt", "z/w.txt", "b/d/e/f"]
    assert member_directories(names) == ["b", "z", "b/d", "z/y", "b/d/e"]
    assert member_directories(["a", "b"]) == []


def _sealed(doc: dict[str, Any]) -> bytes:
    """A manifest document as a forger writes it: any content, with a valid checksum."""
    doc = {k: v for k, v in doc.items() if k != "manifest_checksum"}
    doc["manifest_checksum"] = xxhash.xxh3_64_hexdigest(_canonical(doc))
    return json.dumps(doc).encode()


def _small_doc() -> dict[str, Any]:
    """A valid version 2 manifest: tensor ``a`` (2 rows of a byte), sliced ``s`` (2 rows),
    a view ``v`` of ``a``."""
    return {
        "format": "aiopersist",
        "version": 2,
        "checksum_algorithm": "xxh3_64",
        "world_size": 1,
        "layout": "state",
        "directories": ["."],
        "files": {"f.safetensors": {"bytes": 4100, "checksum": "0" * 16, "data_offset": 4096, "dir": 0}},
        "tensors": {"a": {"file": "f.safetensors", "offsets": [4096, 4098], "dtype": "U8", "shape": [2]}},
        "sliced": {
            "s": {
                "dtype": "U8",
                "shape": [2],
                "slices": [{"file": "f.safetensors", "offsets": [4098, 4100], "rows": [0, 2]}],
            }
        },
        "views": {"v": {"base": "a", "offset": 0, "dtype": "U8", "shape": [1], "stride": [1]}},
        "aliases": {},
        "ranks": {},
        "skeleton": {"a": {"__tensor__": "a"}, "s": {"__tensor__": "s"}, "v": {"__tensor__": "v"}},
        "metadata": {},
        "pickle": None,
    }


_MANY = [1] * MAX_DIMS
_HUGE = [1 << 62] * 100_000


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda d: d["tensors"]["a"].update(shape=[2, *_MANY]),
            r"tensors\['a'\]\.shape \[2, 1, .*\] has 65 dim",
        ),
        (lambda d: d["tensors"]["a"].update(shape=_HUGE), r"tensors\['a'\]\.shape .* has 100000 dimensions"),
        (lambda d: d["sliced"]["s"].update(shape=[2, *_MANY]), r"sliced\['s'\]\.shape .* has 65 dimensions"),
        (lambda d: d["views"]["v"].update(shape=[1, *_MANY]), r"views\['v'\]\.shape .* has 65 dimensions"),
        (
            lambda d: d["views"]["v"].update(shape=[1] * 65, stride=[1] * 65),
            r"views\['v'\]\.shape .* has 65 dimensions",
        ),
        (lambda d: d["views"]["v"].update(stride=_HUGE), r"views\['v'\]\.stride .* has 100000 dimensions"),
        (
            lambda d: d.update(
                ranks={"1": {"skeleton": {}, "views": {"w": {**d["views"]["v"], "shape": _HUGE}}}}
            ),
            r"ranks\['1'\]\.views\['w'\]\.shape .* has 100000 dimensions",
        ),
    ],
)
def test_a_shape_of_more_than_max_dims_dimensions_is_refused(change: Any, match: str) -> None:
    doc = _small_doc()
    doc["world_size"] = 2
    change(doc)
    with pytest.raises(CheckpointCorruptError, match=rf"^m: {match}"):
        parse_manifest(_sealed(doc), "m")


def test_a_shape_of_max_dims_dimensions_parses() -> None:
    m = parse_manifest(_sealed(_small_doc()), "m")
    assert (m.tensors["a"].shape, m.sliced["s"].shape, m.views["v"].shape) == ((2,), (2,), (1,))
    doc = _small_doc()
    doc["tensors"]["a"]["shape"] = [2, *_MANY[1:]]
    doc["views"]["v"].update(shape=_MANY, stride=_MANY)
    doc["sliced"]["s"]["shape"] = [2, *_MANY[1:]]
    m = parse_manifest(_sealed(doc), "m")
    assert len(m.tensors["a"].shape) == len(m.views["v"].stride) == len(m.sliced["s"].shape) == MAX_DIMS
    # Strides are not a shape: their product is not an element count.
    doc["views"]["v"].update(shape=[1, 1, 1], stride=[1 << 40] * 3)
    assert parse_manifest(_sealed(doc), "m").views["v"].stride == (1 << 40,) * 3


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda d: d.update(ranks={"9" * 5000: {"skeleton": {}}}),
            r"ranks: '9999.*9999' is not a rank from 1",
        ),
        (lambda d: d.update(ranks={"\u0661": {"skeleton": {}}}), r"ranks: '\u0661' is not a rank from 1"),
        (lambda d: d.update(ranks={"01": {"skeleton": {}}}), r"ranks: '01' is not a rank from 1"),
        (lambda d: d.update(ranks={"2": {"skeleton": {}}}), r"ranks: '2' is not a rank from 1 to 1"),
        (
            lambda d: d["views"].update(
                a={"base": "a", "offset": 0, "dtype": "U8", "shape": [1], "stride": [1]}
            ),
            r"views\['a'\]: the name of a stored tensor",
        ),
        (lambda d: d["aliases"].update(a="v"), r"aliases\['a'\]: the name of a stored tensor"),
        (lambda d: d["aliases"].update(s="a"), r"aliases\['s'\]: the name of a stored tensor"),
        (lambda d: d["aliases"].update(v="a"), r"aliases\['v'\]: the name of a view"),
        (
            lambda d: d.update(
                ranks={"1": {"skeleton": {}, "aliases": {"v2": "a"}, "views": {"v2": d["views"]["v"]}}}
            ),
            r"ranks\['1'\]\.aliases\['v2'\]: the name of a view",
        ),
    ],
)
def test_rank_keys_and_names_that_cannot_be_told_apart_are_refused(change: Any, match: str) -> None:
    """A rank's key is a rank in ASCII digits (``int()`` of thousands of digits raises
    ValueError, and ``isdecimal`` takes any script's digits); a view or an alias named like
    a stored tensor (or an alias like a view) would shadow it, and could lead ``inspect``
    round in circles."""
    doc = _small_doc()
    doc["world_size"] = 2
    change(doc)
    with pytest.raises(CheckpointCorruptError, match=rf"^m: {match}"):
        parse_manifest(_sealed(doc), "m")


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("parsed")


def test_a_manifest_of_more_json_values_than_a_checkpoint_holds_is_refused_unparsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """25 MB of empty objects would take 600 MB to parse: refused from a count of bytes."""
    raw = b'{"format":"aiopersist","version":1,"junk":[' + b"{}," * MAX_JSON_ITEMS + b"{}]}"
    monkeypatch.setattr(manifest_module.json, "loads", _never)
    with pytest.raises(
        CheckpointCorruptError, match=rf"^m: {2 * MAX_JSON_ITEMS + 5} JSON objects, lists and"
    ):
        parse_manifest(raw, "m")
    with pytest.raises(CheckpointCorruptError, match=rf"^m: larger than {MAX_MANIFEST_BYTES} bytes"):
        parse_manifest(b" " * (MAX_MANIFEST_BYTES + 1), "m")
    index = b'{"weight_map":{' + b'"a":"b",' * MAX_JSON_ITEMS + b'"c":"d"}}'
    with pytest.raises(CheckpointCorruptError, match=rf"^i: {MAX_JSON_ITEMS + 2} JSON objects"):
        parse_index(index, "i")
    with pytest.raises(CheckpointCorruptError, match=rf"^i: larger than {MAX_INDEX_BYTES} bytes"):
        parse_index(b" " * (MAX_INDEX_BYTES + 1), "i")


def _training_state(n: int) -> tuple[Manifest, bytes]:
    """The manifest of a training state of ``n`` small tensors, saved by one rank with
    checksums of their own (version 2): a model's weights, and Adam's two moments and step
    for each, with long names; and the header of its data file."""
    layers = n // 4
    model = {
        f"model.layers.{i}.block_sparse_moe.experts.{i}.w1.weight": torch.zeros(2) for i in range(layers)
    }
    optim = {
        "state": {
            i: {"step": torch.zeros(()), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
            for i in range(layers)
        },
        "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": list(range(layers))}],
    }
    flat = flatten({"model": model, "optim": optim, "step": 3})
    tensors = describe(flat, 0, 1, None)
    desc = RankDesc(0, 0, tensors, rank_state(flat, tensors), "tok", flat.model_only)
    plan = plan_write([desc], 1, 1 << 40)
    (f,) = plan.files
    records = {
        name: dataclasses.replace(rec, checksum="0123456789abcdef") for name, rec in plan.records.items()
    }
    size = f.layout.data_offset + f.layout.data_bytes
    m = Manifest(
        files={f.name: FileRecord(f.name, size, "0" * 16, f.layout.data_offset)},
        tensors=records,
        skeleton=desc.state.skeleton,
        layout=plan.layout,
        version=2,
    )
    return m, f.layout.header


def test_the_bounds_take_the_manifest_of_hundreds_of_thousands_of_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A manifest grows linearly with its tensors: the bounds take 500,000 of a training
    state's (and its header); the reader takes what the writer writes, up to the limit."""
    m, header = _training_state(4000)
    raw = dump_manifest(m)
    assert len(parse_manifest(raw, "m").tensors) == len(m.tensors) == 4000
    scale = 500_000 // 4000
    assert json_items(raw) * scale < MAX_JSON_ITEMS
    assert len(raw) * scale < MAX_MANIFEST_BYTES
    assert len(raw) * scale // 2 < MAX_INDEX_BYTES
    assert json_items(header) * scale < MAX_JSON_ITEMS
    assert len(header) * scale < MAX_HEADER_BYTES
    monkeypatch.setattr(manifest_module, "MAX_JSON_ITEMS", json_items(raw))
    assert len(parse_manifest(dump_manifest(m), "m").tensors) == 4000
    monkeypatch.setattr(manifest_module, "MAX_JSON_ITEMS", json_items(raw) - 1)
    with pytest.raises(UnsupportedStateError, match=r"the manifest of these 4000 tensors would be \d+ bytes"):
        dump_manifest(m)
    with pytest.raises(CheckpointCorruptError, match="JSON objects, lists and commas"):
        parse_manifest(raw, "m")
    monkeypatch.setattr(manifest_module, "MAX_JSON_ITEMS", json_items(raw))
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", len(raw) - 1)
    with pytest.raises(UnsupportedStateError, match="more than a reader takes"):
        dump_manifest(m)
