"""The checkpoint manifest (pure): what is where, with checksums, as strict JSON.

``aiopersist.json`` sits beside the data files. It records the format version, every
file with its size and checksum, every stored tensor (file, absolute byte offsets, dtype,
shape), aliases and views, the JSON skeleton of the saved object, the pickle file if any,
and the caller's metadata. It carries its own checksum, so a flipped byte anywhere in it
is detected, and every file name in it is checked to stay inside the checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ._exceptions import CheckpointCorruptError
from ._flatten import ViewSpec, dtype_of
from ._format import dtype_name

FORMAT = "aiopersist"
VERSION = 1
MANIFEST_NAME = "aiopersist.json"
CHECKSUM = "xxh3_64"
MAX_MANIFEST_BYTES = 1 << 30


def new_hasher() -> xxhash.xxh3_64:
    """The streaming checksum of data files (xxh3-64: ~14 GB/s, releases the GIL)."""
    return xxhash.xxh3_64()


@dataclass(frozen=True)
class FileRecord:
    name: str
    nbytes: int
    checksum: str
    data_offset: int | None = None
    """Start of the safetensors data section; ``None`` for the pickle file."""


@dataclass(frozen=True)
class TensorRecord:
    name: str
    file: str
    begin: int
    end: int
    """Absolute byte offsets in ``file``."""
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Manifest:
    files: dict[str, FileRecord]
    tensors: dict[str, TensorRecord]
    skeleton: Any
    aliases: dict[str, str] = field(default_factory=dict)
    views: dict[str, ViewSpec] = field(default_factory=dict)
    pickle_file: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    layout: str = "state"
    """``hf-model`` (a model's weights in the Hugging Face layout) or ``state``."""
    world_size: int = 1
    version: int = VERSION
    created: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "created": self.created,
            "layout": self.layout,
            "world_size": self.world_size,
            "checksum_algorithm": CHECKSUM,
            "files": {
                f.name: {"bytes": f.nbytes, "checksum": f.checksum, "data_offset": f.data_offset}
                for f in self.files.values()
            },
            "tensors": {
                t.name: {
                    "file": t.file,
                    "offsets": [t.begin, t.end],
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                }
                for t in self.tensors.values()
            },
            "aliases": dict(self.aliases),
            "views": {
                name: {
                    "base": v.base,
                    "offset": v.offset,
                    "dtype": dtype_name(v.dtype),
                    "shape": list(v.shape),
                    "stride": list(v.stride),
                }
                for name, v in self.views.items()
            },
            "pickle": self.pickle_file,
            "skeleton": self.skeleton,
            "metadata": dict(self.metadata),
        }


def _canonical(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def dump_manifest(manifest: Manifest) -> bytes:
    """The manifest file's bytes: compact JSON with a checksum of its canonical form."""
    doc = manifest.to_json()
    doc["manifest_checksum"] = xxhash.xxh3_64_hexdigest(_canonical(doc))
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def safe_file_name(name: object, where: str) -> str:
    """A file name from a manifest, refused unless it names a plain file in the checkpoint."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or os.path.isabs(name)
    ):
        raise CheckpointCorruptError(f"{where}: file name {name!r} would escape the checkpoint directory")
    return name


def _int(value: object, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointCorruptError(f"{where}: {what} must be a non-negative integer, got {value!r}")
    return value


def _shape(value: object, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise CheckpointCorruptError(f"{where}: {what} must be a list, got {value!r}")
    return tuple(_int(v, what, where) for v in value)


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and check a manifest; every fault is a `CheckpointCorruptError` naming ``where``."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise CheckpointCorruptError(f"{where}: not a JSON object")
    if doc.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{where}: not an aiopersist manifest (format {doc.get('format')!r})")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointCorruptError(f"{where}: format version {version!r} is not a number")
    if version > VERSION:
        raise CheckpointCorruptError(
            f"{where}: format version {version} is newer than this aiopersist reads ({VERSION}); upgrade"
        )
    if version < 1:
        raise CheckpointCorruptError(f"{where}: unknown format version {version}")
    stated = doc.pop("manifest_checksum", None)
    try:
        actual = xxhash.xxh3_64_hexdigest(_canonical(doc))
    except ValueError as exc:  # a non-finite float somewhere: never written by aiopersist
        raise CheckpointCorruptError(f"{where}: {exc}") from exc
    if stated != actual:
        raise CheckpointCorruptError(
            f"{where}: manifest checksum mismatch (stated {stated}, computed {actual})"
        )
    if doc.get("checksum_algorithm") != CHECKSUM:
        raise CheckpointCorruptError(f"{where}: unknown checksum algorithm {doc.get('checksum_algorithm')!r}")
    try:
        return _build(doc, version, where)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorruptError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from exc


def _build(doc: dict[str, Any], version: int, where: str) -> Manifest:
    files: dict[str, FileRecord] = {}
    for name, spec in doc["files"].items():
        safe_file_name(name, where)
        offset = spec.get("data_offset")
        files[name] = FileRecord(
            name,
            _int(spec["bytes"], f"size of {name}", where),
            str(spec["checksum"]),
            None if offset is None else _int(offset, f"data offset of {name}", where),
        )
    tensors: dict[str, TensorRecord] = {}
    for name, spec in doc["tensors"].items():
        file = spec["file"]
        if file not in files:
            raise CheckpointCorruptError(
                f"{where}: tensor {name!r} is in {file!r}, which the manifest does not list"
            )
        begin, end = (_int(v, f"offsets of {name!r}", where) for v in spec["offsets"])
        dtype = dtype_of(spec["dtype"])
        shape = _shape(spec["shape"], f"shape of {name!r}", where)
        if end - begin != math.prod(shape) * dtype.itemsize or end > files[file].nbytes:
            raise CheckpointCorruptError(
                f"{where}: tensor {name!r} has offsets {[begin, end]} that do not fit"
            )
        tensors[name] = TensorRecord(name, file, begin, end, dtype, shape)
    views: dict[str, ViewSpec] = {}
    for name, spec in doc["views"].items():
        if spec["base"] not in tensors:
            raise CheckpointCorruptError(f"{where}: view {name!r} is of unknown tensor {spec['base']!r}")
        views[name] = ViewSpec(
            spec["base"],
            _int(spec["offset"], f"offset of view {name!r}", where),
            dtype_of(spec["dtype"]),
            _shape(spec["shape"], f"shape of view {name!r}", where),
            _shape(spec["stride"], f"stride of view {name!r}", where),
        )
    aliases = {str(k): str(v) for k, v in doc["aliases"].items()}
    for name, target in aliases.items():
        if target not in tensors and target not in views:
            raise CheckpointCorruptError(f"{where}: alias {name!r} points to unknown tensor {target!r}")
    pickle_file = doc.get("pickle")
    if pickle_file is not None:
        safe_file_name(pickle_file, where)
        if pickle_file not in files:
            raise CheckpointCorruptError(f"{where}: pickle file {pickle_file!r} is not listed")
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointCorruptError(f"{where}: metadata must map strings to strings")
    return Manifest(
        files=files,
        tensors=tensors,
        skeleton=doc["skeleton"],
        aliases=aliases,
        views=views,
        pickle_file=pickle_file,
        metadata=metadata,
        layout=str(doc.get("layout", "state")),
        world_size=_int(doc.get("world_size", 1), "world_size", where),
        version=version,
        created=str(doc.get("created", "")),
    )
