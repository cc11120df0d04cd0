"""The on-disk format (pure: no I/O): safetensors headers and alignment arithmetic.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON header + the data
section, where the header maps each tensor name to its dtype, shape and
``[begin, end)`` byte offsets *relative to the data section*, tensors packed without
gaps. aiopersist pads the JSON with spaces (which every safetensors reader accepts) so
the data section starts on a `DATA_ALIGNMENT` boundary: direct reads of the data
can then land page-aligned.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from ._exceptions import CheckpointCorruptError

DATA_ALIGNMENT = 4096
"""The data section of every file aiopersist writes starts at a multiple of this."""

MAX_HEADER_BYTES = 100 * (1 << 20)
"""Refuse headers longer than this (safetensors' own limit): a corrupt length field must
not make the reader allocate gigabytes."""

MAX_JSON_ITEMS = 1 << 23
"""Most values a JSON document aiopersist reads (a safetensors header, a manifest, an
index) may hold, counted before it is parsed as the ``{``, ``[`` and ``,`` in its bytes
(an overestimate where strings hold them). ``json.loads`` costs up to some 250 bytes of
memory per value (a key and its value, an object of one key) whatever the document's
size; bounding the values bounds that. A manifest takes about 11 values per tensor, a
safetensors header about 8: some 700,000 tensors in one checkpoint (or one file)."""

# safetensors dtype names <-> torch dtypes, for every dtype both sides know.
_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
# Dtypes of newer torch versions, where this one has them (unsigned ones from torch 2.3,
# float8_e8m0fnu from 2.7).
_DTYPES.update(
    (name, dtype)
    for name, dtype in (
        ("U16", getattr(torch, "uint16", None)),
        ("U32", getattr(torch, "uint32", None)),
        ("U64", getattr(torch, "uint64", None)),
        ("F8_E4M3FNUZ", getattr(torch, "float8_e4m3fnuz", None)),
        ("F8_E5M2FNUZ", getattr(torch, "float8_e5m2fnuz", None)),
        ("F8_E8M0", getattr(torch, "float8_e8m0fnu", None)),
    )
    if dtype is not None
)
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}
DTYPES: Mapping[str, torch.dtype] = _DTYPES
"""safetensors dtype names to torch dtypes (read only)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype; ``KeyError`` if safetensors has none."""
    return _DTYPE_NAMES[dtype]


def dtype_label(dtype: torch.dtype) -> str:
    """A name of any torch dtype for people: its safetensors name where it has one
    (``F32``), else torch's own without ``torch.`` (``complex128``, ``qint8``). Never
    raises (a DCP checkpoint may hold, or its metadata name, any dtype)."""
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


def supported_dtype(dtype: torch.dtype) -> bool:
    return dtype in _DTYPE_NAMES


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in a safetensors file: where its bytes are, relative to the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class FileLayout:
    """Everything needed to write or read one safetensors file."""

    header: bytes
    """The length prefix plus the padded JSON: written first, exactly ``data_offset`` bytes."""
    entries: tuple[TensorEntry, ...]
    metadata: Mapping[str, str]

    @property
    def data_offset(self) -> int:
        return len(self.header)

    @property
    def data_bytes(self) -> int:
        return self.entries[-1].end if self.entries else 0

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.data_bytes


def layout_file(
    tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
    *,
    alignment: int = DATA_ALIGNMENT,
) -> FileLayout:
    """Lay out tensors (in the given order) in one safetensors file with an aligned data section."""
    entries: list[TensorEntry] = []
    header: dict[str, Any] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name, dtype, shape in tensors:
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        shp = tuple(int(s) for s in shape)
        problem = unwritable_shape(shp)
        if problem is not None:
            raise ValueError(f"tensor {name!r}: {problem}")
        nbytes = math.prod(shp) * dtype.itemsize
        entry = TensorEntry(name, dtype, shp, pos, pos + nbytes)
        entries.append(entry)
        header[name] = {
            "dtype": dtype_name(dtype),
            "shape": list(shp),
            "data_offsets": [entry.begin, entry.end],
        }
        pos += nbytes
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    total = align_up(8 + len(body), alignment)
    items = json_items(body)
    if total - 8 > MAX_HEADER_BYTES or items > MAX_JSON_ITEMS:
        raise ValueError(
            f"the safetensors header of these {len(entries)} tensors would be {total - 8} bytes, "
            f"{items} JSON values: more than a reader takes ({MAX_HEADER_BYTES} bytes, "
            f"{MAX_JSON_ITEMS} values)"
        )
    padded = body + b" " * (total - 8 - len(body))
    return FileLayout(struct.pack("<Q", len(padded)) + padded, tuple(entries), dict(metadata or {}))


def json_items(raw: bytes) -> int:
    """An upper bound on the values of the JSON document ``raw`` (see `MAX_JSON_ITEMS`): a
    count of bytes, at memory speed, no parsing."""
    return raw.count(b"{") + raw.count(b"[") + raw.count(b",")


def check_json_items(raw: bytes, where: str, limit: int) -> None:
    """`CheckpointCorruptError` naming ``where`` when ``raw`` may hold more than ``limit``
    values: refused before ``json.loads`` builds them."""
    items = json_items(raw)
    if items > limit:
        raise CheckpointCorruptError(
            f"{where}: {items} JSON objects, lists and commas, more than the {limit} a checkpoint may "
            "hold (damaged or hostile)"
        )


def load_json(raw: bytes, where: str, invalid: str = "not valid JSON", limit: int | None = None) -> object:
    """``raw``, a JSON document read from a checkpoint (a header, a manifest, an index, a
    Trainer's state), parsed; `CheckpointCorruptError` naming ``where`` for more values
    than ``limit`` (`MAX_JSON_ITEMS` by default; refused unparsed), bytes that are not
    UTF-8 JSON (``invalid`` says so), or nesting too deep to parse (a ``RecursionError``
    otherwise)."""
    check_json_items(raw, where, MAX_JSON_ITEMS if limit is None else limit)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, and ints past the digit limit
        raise CheckpointCorruptError(f"{where}: {invalid} ({exc})") from exc
    except RecursionError:
        raise CheckpointCorruptError(f"{where}: JSON nested too deep to parse (damaged or hostile)") from None


def header_length(prefix: bytes, file_size: int, name: str) -> int:
    """Validate the 8-byte length prefix of a safetensors file; returns the JSON length."""
    if len(prefix) < 8 or file_size < 8:
        raise CheckpointCorruptError(f"{name}: too short to be a safetensors file ({file_size} bytes)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointCorruptError(f"{name}: header length {n} is absurd (limit {MAX_HEADER_BYTES})")
    if 8 + n > file_size:
        raise CheckpointCorruptError(
            f"{name}: header length {n} runs past the end of the file ({file_size} bytes)"
        )
    return int(n)


MAX_COUNT = 1 << 62
"""Largest dimension, element count or offset a header may state."""

MAX_DIMS = 64
"""Most dimensions a tensor may have, in a header, a manifest or a save: NumPy's limit
(``Tensor.numpy()`` refuses more), far beyond any real tensor. A longer shape is damaged
or hostile: refused before anything multiplies its dimensions."""


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def shape_problem(shape: Sequence[object]) -> str | None:
    """What is wrong with ``shape`` as a header or a manifest states it (``None``: nothing):
    more than `MAX_DIMS` dimensions, a dimension that is not an integer from 0 to
    `MAX_COUNT`, or more than `MAX_COUNT` elements. The product stops as soon as it passes
    the limit, so no shape costs more than `MAX_DIMS` small multiplications."""
    if len(shape) > MAX_DIMS:
        return f"has {len(shape)} dimensions (at most {MAX_DIMS})"
    if not all(_count(s) for s in shape):
        return f"has a dimension that is not an integer from 0 to {MAX_COUNT}"
    if bounded_count(cast(Sequence[int], shape)) is None:
        return f"holds more than {MAX_COUNT} elements"
    return None


def bounded_count(shape: Sequence[int], limit: int = MAX_COUNT) -> int | None:
    """The element count of ``shape`` (non-negative integers), ``None`` when it is over
    ``limit``: a zero dimension first, then the product, stopped once past ``limit``."""
    if 0 in shape:
        return 0
    count = 1
    for dim in shape:
        count *= dim
        if count > limit:
            return None
    return count


def unwritable_shape(shape: Sequence[int]) -> str | None:
    """Why a reader would refuse a tensor of ``shape`` (``None``: it would not), for a
    writer to say before it writes anything."""
    problem = shape_problem(tuple(shape))
    return None if problem is None else f"its shape {short_repr(list(shape))} {problem}"


def short_repr(value: object) -> str:
    """``repr(value)`` cut to 80 characters, for an error message; a long list, dict or
    string is cut before it is converted (no repr of a million items)."""
    if isinstance(value, list) and len(value) > 8:
        text = repr(value[:8])[:-1] + ", ...]"
    elif isinstance(value, dict) and len(value) > 8:
        text = repr(dict(itertools.islice(value.items(), 8)))[:-1] + ", ...}"
    elif isinstance(value, str) and len(value) > 80:
        text = repr(value[:80])
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_header(header_json: bytes, file_size: int, name: str) -> FileLayout:
    """Parse and check a safetensors JSON header (the bytes after the length prefix).

    Raises `CheckpointCorruptError` naming ``name`` for anything malformed: bad
    JSON, unknown dtype, offsets out of order, overlapping, gapped or past the end.
    """
    raw = load_json(header_json, f"{name}: header")
    if not isinstance(raw, dict):
        raise CheckpointCorruptError(f"{name}: header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointCorruptError(f"{name}: __metadata__ must map strings to strings")
    data_offset = 8 + len(header_json)
    entries: list[TensorEntry] = []
    for key, spec in raw.items():
        try:
            dtype = dtype_from_name(spec["dtype"])
            shape = tuple(spec["shape"]) if isinstance(spec["shape"], list) else None
            begin, end = spec["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(
                f"{name}: bad header entry for tensor {key!r}: {short_repr(spec)}"
            ) from exc
        problem = "is not a list" if shape is None else shape_problem(shape)
        if problem is not None or shape is None:
            raise CheckpointCorruptError(
                f"{name}: tensor {key!r} has an invalid shape {short_repr(spec['shape'])}: it {problem}"
            )
        if not (_count(begin) and _count(end) and begin <= end):
            raise CheckpointCorruptError(
                f"{name}: tensor {key!r} has invalid offsets {short_repr([begin, end])}"
            )
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointCorruptError(
                f"{name}: tensor {key!r} offsets {[begin, end]} do not match "
                f"its shape {list(shape)} and dtype"
            )
        entries.append(TensorEntry(key, dtype, shape, begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise CheckpointCorruptError(
                f"{name}: tensor {e.name!r} starts at {e.begin}, expected {pos} (gap or overlap)"
            )
        pos = e.end
    if data_offset + pos != file_size:
        raise CheckpointCorruptError(
            f"{name}: data section should end at byte {data_offset + pos} but the file has {file_size} bytes"
        )
    header = struct.pack("<Q", len(header_json)) + header_json
    return FileLayout(header, tuple(entries), metadata)
