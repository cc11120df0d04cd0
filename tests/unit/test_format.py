"""The safetensors layout: pure functions, no I/O except reading back with safetensors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from aiopersist import CheckpointCorruptError, _format
from aiopersist._format import (
    DATA_ALIGNMENT,
    MAX_COUNT,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_JSON_ITEMS,
    bounded_count,
    header_length,
    layout_file,
    parse_header,
)


def _file_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    layout = layout_file([(k, t.dtype, t.shape) for k, t in tensors.items()], metadata)
    body = b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())
    return layout.header + body


def test_data_section_is_aligned_and_safetensors_reads_it(tmp_path: Path) -> None:
    tensors = {
        "w": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "h": torch.randn(4, dtype=torch.float16),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
    }
    layout = layout_file([(k, t.dtype, t.shape) for k, t in tensors.items()], {"step": "10"})
    assert layout.data_offset % DATA_ALIGNMENT == 0
    raw = _file_bytes(tensors, {"step": "10"})
    (tmp_path / "x.safetensors").write_bytes(raw)
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"step": "10"}
        for k, t in tensors.items():
            assert torch.equal(f.get_tensor(k), t)
    parsed = parse_header(raw[8 : layout.data_offset], len(raw), "x")
    assert [e.name for e in parsed.entries] == list(tensors)
    assert parsed.data_offset == layout.data_offset


def _header(spec: dict[str, object]) -> bytes:
    return json.dumps(spec).encode()


@pytest.mark.parametrize(
    ("spec", "size_delta", "match"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, -1, "data section should end"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, 0, "do not match its shape"),
        ({"a": {"dtype": "XX", "shape": [2], "data_offsets": [0, 8]}}, 0, "bad header entry"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 0, "invalid shape"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
            },
            0,
            "gap or overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, 0, "invalid offsets"),
        ({"__metadata__": {"k": 1}}, 0, "__metadata__"),
    ],
)
def test_malformed_headers_are_named(spec: dict[str, object], size_delta: int, match: str) -> None:
    h = _header(spec)
    ends = [v["data_offsets"][1] for k, v in spec.items() if k != "__metadata__"]  # type: ignore[index]
    size = 8 + len(h) + max(ends, default=0) + size_delta
    with pytest.raises(CheckpointCorruptError, match=match) as info:
        parse_header(h, size, "shard-0.safetensors")
    assert "shard-0.safetensors" in str(info.value)


def test_not_json() -> None:
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        parse_header(b"{nope", 100, "f")


def test_absurd_header_length() -> None:
    with pytest.raises(CheckpointCorruptError, match="absurd"):
        header_length(struct.pack("<Q", MAX_HEADER_BYTES + 1), 1 << 40, "f")
    with pytest.raises(CheckpointCorruptError, match="past the end"):
        header_length(struct.pack("<Q", 1000), 500, "f")
    with pytest.raises(CheckpointCorruptError, match="too short"):
        header_length(b"\x01\x02", 2, "f")


def test_duplicate_names_and_bad_metadata_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        layout_file([("a", torch.float32, (1,)), ("a", torch.float32, (1,))])
    with pytest.raises(TypeError, match="metadata"):
        layout_file([], {"k": 1})  # type: ignore[dict-item]


def _one_tensor_header(shape: list[int], nbytes: int) -> bytes:
    return _header({"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, nbytes]}})


def test_a_shape_has_at_most_max_dims_dimensions() -> None:
    h = _one_tensor_header([2] + [1] * (MAX_DIMS - 1), 2)
    assert parse_header(h, 8 + len(h) + 2, "f").entries[0].shape == (2,) + (1,) * (MAX_DIMS - 1)
    for shape in ([2] + [1] * MAX_DIMS, [1 << 62] * 100_000, [0] * (MAX_DIMS + 1)):
        h = _one_tensor_header(shape, 2)
        with pytest.raises(
            CheckpointCorruptError, match=rf"f: tensor 'w' has an invalid shape .* has {len(shape)} dim"
        ):
            parse_header(h, 8 + len(h) + 2, "f")


def test_an_element_count_looks_for_a_zero_first_and_stops_past_the_limit() -> None:
    assert bounded_count([1 << 62] * MAX_DIMS + [0]) == 0
    assert bounded_count([1 << 31, 1 << 31]) == MAX_COUNT
    assert bounded_count([1 << 31, 1 << 31, 2]) is None
    assert bounded_count([1 << 62, 1 << 62], limit=1 << 70) is None  # stopped at the first product past it
    h = _one_tensor_header([1 << 62] * MAX_DIMS, 0)
    with pytest.raises(CheckpointCorruptError, match=rf"holds more than {MAX_COUNT} elements"):
        parse_header(h, 8 + len(h), "f")


def test_the_writer_refuses_a_shape_the_reader_refuses() -> None:
    layout_file([("ok", torch.uint8, (1,) * MAX_DIMS)])
    with pytest.raises(ValueError, match=rf"tensor 'w': its shape .* has {MAX_DIMS + 1} dimensions"):
        layout_file([("w", torch.uint8, (1,) * (MAX_DIMS + 1))])
    with pytest.raises(ValueError, match="not an integer from 0"):
        layout_file([("w", torch.uint8, (MAX_COUNT + 1, 0))])


def test_a_header_of_more_json_values_than_a_checkpoint_holds_is_refused_unparsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = b'{"w":' + b"[" + b"{}," * MAX_JSON_ITEMS + b"{}]}"
    monkeypatch.setattr(_format.json, "loads", _never)
    with pytest.raises(CheckpointCorruptError, match=rf"^f: header: {2 * MAX_JSON_ITEMS + 3} JSON objects"):
        parse_header(h, 8 + len(h), "f")


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("parsed")


def test_the_writer_refuses_a_header_the_reader_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [(f"t{i}", torch.uint8, (1,)) for i in range(100)]
    items = _format.json_items(layout_file(specs).header)
    monkeypatch.setattr(_format, "MAX_JSON_ITEMS", items)
    layout_file(specs)
    monkeypatch.setattr(_format, "MAX_JSON_ITEMS", items - 1)
    with pytest.raises(ValueError, match=rf"these 100 tensors would be \d+ bytes, {items} JSON values"):
        layout_file(specs)
    monkeypatch.setattr(_format, "MAX_JSON_ITEMS", items)
    monkeypatch.setattr(_format, "MAX_HEADER_BYTES", 4096)
    with pytest.raises(ValueError, match="more than a reader takes"):
        layout_file([(f"{i:0100}", torch.uint8, (1,)) for i in range(100)])


def test_dtype_label_names_every_torch_dtype() -> None:
    from aiopersist._format import dtype_label

    assert dtype_label(torch.float32) == "F32"
    assert dtype_label(torch.complex128) == "complex128"
    for dtype in {d for d in vars(torch).values() if isinstance(d, torch.dtype)}:
        assert dtype_label(dtype)  # never raises
