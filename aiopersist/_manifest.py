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
VERSION = 2
"""The newest format this version reads. A save that uses nothing of version 2 (several
directories, several ranks, sliced tensors) writes version 1, which older readers take."""
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
    directory: int = 0
    """Index into `Manifest.directories` of the directory that holds the file."""


@dataclass(frozen=True)
class TensorRecord:
    name: str
    file: str
    begin: int
    end: int
    """Absolute byte offsets in ``file``."""
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]
    checksum: str | None = None
    """xxh3 of these bytes alone (version 2): they can be read and checked without the
    rest of the file."""

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SliceRecord:
    """Rows ``[row_start, row_end)`` of a sliced tensor, stored at ``[begin, end)`` of ``file``."""

    file: str
    begin: int
    end: int
    row_start: int
    row_end: int
    checksum: str | None = None
    """xxh3 of the slice's bytes alone."""


@dataclass(frozen=True)
class SlicedRecord:
    """A tensor stored as row slices, possibly in several files (split for balance, or
    dim-0 shards written by their owners)."""

    name: str
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]
    slices: tuple[SliceRecord, ...]
    """Ordered by ``row_start``; they cover every row exactly once."""

    @property
    def nbytes(self) -> int:
        return sum(s.end - s.begin for s in self.slices)


@dataclass(frozen=True)
class RankState:
    """What one rank saved beyond the shared tensors: its skeleton, aliases and views."""

    skeleton: Any
    aliases: dict[str, str] = field(default_factory=dict)
    views: dict[str, ViewSpec] = field(default_factory=dict)


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
    version: int = 1
    created: str = ""
    sliced: dict[str, SlicedRecord] = field(default_factory=dict)
    directories: tuple[str, ...] = (".",)
    """Where the files are, relative to the checkpoint directory; ``"."`` is the checkpoint
    directory itself (the primary), others are parts on other disks."""
    ranks: dict[int, RankState] = field(default_factory=dict)
    """Ranks other than 0 whose skeleton, aliases or views differ from rank 0's (the
    top-level ones)."""

    def rank_state(self, rank: int) -> RankState:
        """The skeleton, aliases and views rank ``rank`` saved."""
        if rank < 0 or rank >= self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} ranks that saved this checkpoint")
        return self.ranks.get(rank) or RankState(self.skeleton, self.aliases, self.views)

    def to_json(self) -> dict[str, Any]:
        doc = self._v1_json()
        if self.version >= 2:
            doc["directories"] = list(self.directories)
            for name, f in self.files.items():
                doc["files"][name]["dir"] = f.directory
            for name, t in self.tensors.items():
                if t.checksum is not None:
                    doc["tensors"][name]["checksum"] = t.checksum
            doc["sliced"] = {
                t.name: {
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "slices": [
                        {
                            "file": sl.file,
                            "offsets": [sl.begin, sl.end],
                            "rows": [sl.row_start, sl.row_end],
                            **({"checksum": sl.checksum} if sl.checksum is not None else {}),
                        }
                        for sl in t.slices
                    ],
                }
                for t in self.sliced.values()
            }
            doc["ranks"] = {
                str(r): {
                    "skeleton": st.skeleton,
                    "aliases": dict(st.aliases),
                    "views": _views_json(st.views),
                }
                for r, st in sorted(self.ranks.items())
            }
        return doc

    def _v1_json(self) -> dict[str, Any]:
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
            "views": _views_json(self.views),
            "pickle": self.pickle_file,
            "skeleton": self.skeleton,
            "metadata": dict(self.metadata),
        }


def _views_json(views: Mapping[str, ViewSpec]) -> dict[str, Any]:
    return {
        name: {
            "base": v.base,
            "offset": v.offset,
            "dtype": dtype_name(v.dtype),
            "shape": list(v.shape),
            "stride": list(v.stride),
        }
        for name, v in views.items()
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


def _views(doc: Any, tensors: Mapping[str, Any], where: str) -> dict[str, ViewSpec]:
    views: dict[str, ViewSpec] = {}
    for name, spec in doc.items():
        if spec["base"] not in tensors:
            raise CheckpointCorruptError(f"{where}: view {name!r} is of unknown tensor {spec['base']!r}")
        views[name] = ViewSpec(
            spec["base"],
            _int(spec["offset"], f"offset of view {name!r}", where),
            dtype_of(spec["dtype"]),
            _shape(spec["shape"], f"shape of view {name!r}", where),
            _shape(spec["stride"], f"stride of view {name!r}", where),
        )
    return views


def _aliases(doc: Any, known: Mapping[str, Any], views: Mapping[str, ViewSpec], where: str) -> dict[str, str]:
    aliases = {str(k): str(v) for k, v in doc.items()}
    for name, target in aliases.items():
        if target not in known and target not in views:
            raise CheckpointCorruptError(f"{where}: alias {name!r} points to unknown tensor {target!r}")
    return aliases


def _sliced(name: str, spec: Any, files: Mapping[str, FileRecord], where: str) -> SlicedRecord:
    dtype = dtype_of(spec["dtype"])
    shape = _shape(spec["shape"], f"shape of {name!r}", where)
    if not shape:
        raise CheckpointCorruptError(f"{where}: sliced tensor {name!r} has no rows")
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    slices = []
    pos = 0
    for piece in spec["slices"]:
        file = piece["file"]
        if file not in files:
            raise CheckpointCorruptError(f"{where}: a slice of {name!r} is in {file!r}, which is not listed")
        begin, end = (_int(v, f"offsets of a slice of {name!r}", where) for v in piece["offsets"])
        r0, r1 = (_int(v, f"rows of a slice of {name!r}", where) for v in piece["rows"])
        if r0 != pos or r1 <= r0 or end - begin != (r1 - r0) * row_bytes or end > files[file].nbytes:
            raise CheckpointCorruptError(f"{where}: slice rows {[r0, r1]} of {name!r} do not fit")
        checksum = piece.get("checksum")
        slices.append(SliceRecord(file, begin, end, r0, r1, None if checksum is None else str(checksum)))
        pos = r1
    if pos != shape[0]:
        raise CheckpointCorruptError(f"{where}: the slices of {name!r} cover {pos} of its {shape[0]} rows")
    return SlicedRecord(name, dtype, shape, tuple(slices))


def _directory(value: object, where: str) -> str:
    if not isinstance(value, str) or not value or "\0" in value or os.path.isabs(value):
        raise CheckpointCorruptError(f"{where}: directory {value!r} must be a relative path")
    return value


def _build(doc: dict[str, Any], version: int, where: str) -> Manifest:
    directories = (
        tuple(_directory(d, where) for d in doc.get("directories", ["."])) if version >= 2 else (".",)
    )
    if not directories or directories[0] != ".":
        raise CheckpointCorruptError(f"{where}: the first directory must be the checkpoint itself ('.')")
    files: dict[str, FileRecord] = {}
    for name, spec in doc["files"].items():
        safe_file_name(name, where)
        offset = spec.get("data_offset")
        directory = _int(spec.get("dir", 0), f"directory of {name}", where)
        if directory >= len(directories):
            raise CheckpointCorruptError(
                f"{where}: file {name!r} is in directory {directory}, which is not listed"
            )
        files[name] = FileRecord(
            name,
            _int(spec["bytes"], f"size of {name}", where),
            str(spec["checksum"]),
            None if offset is None else _int(offset, f"data offset of {name}", where),
            directory,
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
        checksum = spec.get("checksum")
        tensors[name] = TensorRecord(
            name, file, begin, end, dtype, shape, None if checksum is None else str(checksum)
        )
    sliced = {name: _sliced(name, spec, files, where) for name, spec in doc.get("sliced", {}).items()}
    clash = set(sliced) & set(tensors)
    if clash:
        raise CheckpointCorruptError(f"{where}: {sorted(clash)[0]!r} is listed both whole and sliced")
    known = {**tensors, **sliced}
    views = _views(doc["views"], known, where)
    aliases = _aliases(doc["aliases"], known, views, where)
    world_size = _int(doc.get("world_size", 1), "world_size", where)
    ranks: dict[int, RankState] = {}
    for key, spec in doc.get("ranks", {}).items():
        rank = int(key)
        if not 0 < rank < world_size:
            raise CheckpointCorruptError(f"{where}: rank {key!r} is outside the world of {world_size}")
        rviews = _views(spec["views"], known, where)
        ranks[rank] = RankState(spec["skeleton"], _aliases(spec["aliases"], known, rviews, where), rviews)
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
        world_size=world_size,
        version=version,
        created=str(doc.get("created", "")),
        sliced=sliced,
        directories=directories,
        ranks=ranks,
    )
