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
import posixpath
import reprlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import xxhash

from ._exceptions import CheckpointCorruptError, NewerFormatError, UnsupportedStateError
from ._flatten import ViewSpec, dtype_of
from ._format import DTYPES, MAX_DIMS, MAX_JSON_ITEMS, bounded_count, dtype_name, json_items, load_json
from ._format import short_repr as _short
from ._names import MANIFEST_NAME, PART_RE
from ._skeleton import check_skeleton
from ._workers import gc_paused

FORMAT = "aiopersist"
VERSION = 3
"""The newest format this version reads. A save that uses nothing of version 2 (several
directories, several ranks, sliced tensors, files in a subdirectory) writes version 1,
which older readers take; version 3 is version 2 with files more than one subdirectory
deep, which version 2 readers refuse as newer (not as corrupt)."""
MAX_MEMBER_DEPTH = 16
"""How many subdirectories deep a checkpoint's file may be (version 3)."""
MAX_NAME_BYTES = 1024
"""The longest file name, subdirectories included, a checkpoint may list."""
CHECKSUM = "xxh3_64"
MAX_MANIFEST_BYTES = 256 << 20
"""The largest manifest a reader takes (and `dump_manifest` writes), with at most
`MAX_JSON_ITEMS` values: some 700,000 tensors (a training state of 700,000 small tensors
has a manifest of 131 MiB, 7.9 Mi values, that takes 1.1 GB to parse). Parsing a forged
one at both limits takes at most about 2.5 GB (measured: 8 Mi unique keys of 20
characters and an astral character, which makes the decoded text 4 bytes a character)."""
MAX_INDEX_BYTES = MAX_MANIFEST_BYTES // 2
"""The largest ``model.safetensors.index.json`` a reader takes: the index `save` writes
for a manifest it can write is under half its size (every tensor's name appears once in
the index, three times in an ``hf-model`` manifest)."""


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
class EntryRecord:
    """Bytes ``[begin, end)`` of a file that is not a safetensors file (a
    ``torch.distributed.checkpoint`` data file), with a checksum of their own: a reader
    that needs only some of a file's entries checks just those."""

    begin: int
    end: int
    checksum: str


@dataclass(frozen=True)
class RankState:
    """What one rank saved beyond the shared tensors: its skeleton, aliases and views."""

    skeleton: Any
    aliases: dict[str, str] = field(default_factory=dict)
    views: dict[str, ViewSpec] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    files: dict[str, FileRecord]
    tensors: Mapping[str, TensorRecord]
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
    entries: dict[str, tuple[EntryRecord, ...]] = field(default_factory=dict)
    """Checksummed byte ranges of files that are not safetensors files, by file (version 2;
    the ``dcp`` layout: a ``torch.distributed.checkpoint`` directory), ordered by offset."""

    @property
    def token(self) -> str | None:
        """The save's token, as its part directories carry it (``part-<token>``); ``None``
        for a checkpoint in one directory."""
        if len(self.directories) < 2:
            return None
        match = PART_RE.match(os.path.basename(self.directories[1]))
        return match.group(1) if match else None

    def rank_state(self, rank: int) -> RankState:
        """The skeleton, aliases and views rank ``rank`` saved."""
        if rank < 0 or rank >= self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} ranks that saved this checkpoint")
        return self.ranks.get(rank) or RankState(self.skeleton, self.aliases, self.views)

    def to_json(self, *, tensors: bool = True) -> dict[str, Any]:
        """The manifest as a JSON document (without its checksum); ``tensors=False``
        leaves the tensor table out (`dump_manifest` encodes it on its own)."""
        doc = self._v1_json()
        if tensors:
            doc["tensors"] = _tensor_table(self.tensors, self.version)
        if self.version >= 2:
            doc["directories"] = list(self.directories)
            for name, f in self.files.items():
                doc["files"][name]["dir"] = f.directory
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
            if self.entries:
                doc["entries"] = {
                    name: [[e.begin, e.end, e.checksum] for e in found]
                    for name, found in self.entries.items()
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
            "tensors": None,  # the table's place in the document's key order
            "aliases": dict(self.aliases),
            "views": _views_json(self.views),
            "pickle": self.pickle_file,
            "skeleton": self.skeleton,
            "metadata": dict(self.metadata),
        }


def _tensor_table(tensors: Mapping[str, TensorRecord], version: int) -> dict[str, Any]:
    return {
        t.name: {
            "file": t.file,
            "offsets": [t.begin, t.end],
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            **({"checksum": t.checksum} if version >= 2 and t.checksum is not None else {}),
        }
        for t in tensors.values()
    }


class TensorTable(Mapping[str, TensorRecord]):
    """An immutable table of tensor records that encodes itself as JSON once.

    A save's tensor table is most of its manifest (tens of thousands of entries for a
    state of small tensors) and, for a checkpoint in one directory, a function of the
    write plan alone: the plan keeps its table, and every save of that structure reuses
    the encoding instead of building and encoding the entries again."""

    __slots__ = ("_encoded", "_records")

    def __init__(self, records: Mapping[str, TensorRecord]) -> None:
        self._records = dict(records)
        self._encoded: dict[int, tuple[str, str]] = {}

    def __getitem__(self, name: str) -> TensorRecord:
        return self._records[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def encoded(self, version: int) -> tuple[str, str]:
        """The table as a manifest of ``version`` writes it: in its own order, and in the
        canonical form (keys sorted) that the manifest's checksum covers."""
        if version not in self._encoded:
            with gc_paused():
                table = _tensor_table(self._records, version)
                self._encoded[version] = (_dumps(table), _canonical_text(table))
        return self._encoded[version]


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


def _canonical_text(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _canonical(doc: Mapping[str, Any]) -> bytes:
    return _canonical_text(doc).encode()


def _canonical_digest(doc: Any) -> str:
    """xxh3 of ``_canonical(doc)``, hashed a slice at a time (no second copy of a large
    document as bytes: the canonical form is ASCII, its characters are its bytes)."""
    text = _canonical_text(doc)
    hasher = xxhash.xxh3_64()
    for pos in range(0, len(text), 1 << 24):
        hasher.update(text[pos : pos + (1 << 24)].encode())
    return str(hasher.hexdigest())


def _dumps(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False)


def dump_manifest(manifest: Manifest) -> bytes:
    """The manifest file's bytes: compact JSON with a checksum of its canonical form. The
    file keeps the state's key order (a load gives the tensors back in it); the canonical
    form, keys sorted, is only hashed.

    The document is encoded a top-level field at a time, exactly as ``json.dumps`` would
    encode it whole, so that the tensor table's encoding can be the one its `TensorTable`
    keeps (the other fields are small)."""
    with gc_paused():
        doc = manifest.to_json(tensors=False)
        tensors = manifest.tensors
        table = tensors if isinstance(tensors, TensorTable) else TensorTable(tensors)
        ordered, canonical = table.encoded(manifest.version)
        fields = {
            k: (ordered, canonical) if k == "tensors" else (_dumps(v), _canonical_text(v))
            for k, v in doc.items()
        }
        checksum = xxhash.xxh3_64_hexdigest(_object_text((k, fields[k][1]) for k in sorted(fields)).encode())
        fields["manifest_checksum"] = (_dumps(checksum), "")
        data = _object_text((k, text) for k, (text, _) in fields.items()).encode() + b"\n"
    items = json_items(data)
    if len(data) > MAX_MANIFEST_BYTES or items > MAX_JSON_ITEMS:
        raise UnsupportedStateError(
            f"the manifest of these {len(tensors)} tensors would be {len(data)} bytes, {items} JSON "
            f"values: more than a reader takes ({MAX_MANIFEST_BYTES} bytes, {MAX_JSON_ITEMS} values); "
            "save fewer, larger tensors"
        )
    return data


def _object_text(items: Iterable[tuple[str, str]]) -> str:
    """A JSON object from its keys and its values' encodings, as ``json.dumps`` (compact)
    writes one."""
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in items) + "}"


# -- reading: everything a manifest says is checked here, before anything acts on it ------

MAX_SIZE = 1 << 62
"""Largest byte count, offset or dimension a manifest or header may state."""
MAX_WORLD_SIZE = 1 << 20
LAYOUTS = ("state", "hf-model", "dcp", "fsdp")
"""``fsdp``: an FSDP checkpoint of the Hugging Face Trainer or Accelerate, in their own
layout: ``torch.distributed.checkpoint`` directories (``pytorch_model_fsdp_0/``,
``optimizer_0/``) and the framework's files, every one listed by this manifest (files in
subdirectories by ``<subdirectory>/<name>``)."""
"""``dcp``: a ``torch.distributed.checkpoint`` directory written through aiopersist
(its files listed with checksums, no tensors of aiopersist's own)."""
"""The last component of a part directory: ``part-<token>``, the token of the save."""


def safe_file_name(name: object, where: str) -> str:
    """A file name from a manifest, refused unless it names a plain file in the checkpoint
    (and one the file system can hold: no more than 255 bytes, nothing that cannot be
    encoded)."""
    problem = _name_problem(name)
    if problem is not None:
        raise CheckpointCorruptError(f"{where}: file name {_short(name)} {problem}")
    return cast(str, name)


def _name_problem(name: object) -> str | None:
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or os.path.isabs(name)
    ):
        return "would escape the checkpoint directory"
    if _encoded_size(name) > 255:
        return "is not a name a file can have"
    return None


def _encoded_size(name: str) -> int:
    """The bytes of ``name`` on disk; more than any limit when it cannot be encoded (a lone
    surrogate)."""
    try:
        return len(os.fsencode(name))
    except UnicodeEncodeError:
        return MAX_NAME_BYTES + 1


def safe_member_name(name: object, where: str, depth: int = MAX_MEMBER_DEPTH) -> str:
    """A file name from a version 2 manifest: a plain file in the checkpoint
    (`safe_file_name`) or in subdirectories of it, at most ``depth`` deep (one in version
    2), ``<subdirectory>/.../<name>``: each component a plain name (nothing absolute,
    empty, ``.`` or ``..``), at most `MAX_NAME_BYTES` in all."""
    if isinstance(name, str) and "/" in name:
        components = name.split("/", depth + 1)
        problem = (
            f"is deeper than {depth} subdirectories"
            if len(components) > depth + 1
            else next((p for p in map(_name_problem, components) if p is not None), None)
        )
        if problem is None and _encoded_size(name) > MAX_NAME_BYTES:
            problem = f"is longer than {MAX_NAME_BYTES} bytes"
        if problem is not None:
            raise CheckpointCorruptError(f"{where}: file name {_short(name)} {problem}")
        return name
    return safe_file_name(name, where)


def format_version(names: Iterable[str], version: int) -> int:
    """The format version of a manifest listing the files ``names`` that needs ``version``
    for everything else: 3 when a file is more than one subdirectory deep."""
    return max(
        version, 3 if any(n.count("/") > 1 for n in names) else 2 if any("/" in n for n in names) else 1
    )


def dcp_directories(m: Manifest) -> list[str]:
    """The ``torch.distributed.checkpoint`` directories of a checkpoint, relative to it:
    itself (``""``) in the ``dcp`` layout; in the ``fsdp`` layout each one its saver wrote
    (listed with its own manifest, ``<directory>/aiopersist.json``), not a directory of
    other files that happens to hold a ``.metadata``."""
    if m.layout == "dcp":
        return [""]
    if m.layout == "fsdp":
        return sorted(
            posixpath.dirname(n) for n in m.files if posixpath.basename(n) == MANIFEST_NAME and "/" in n
        )
    return []


def member_directories(names: Iterable[str]) -> list[str]:
    """Every subdirectory that the member names (``a/b/c.json``: ``a`` and ``a/b``) need,
    parents before their children."""
    found: set[str] = set()
    for name in names:
        parts = name.split("/")[:-1]
        found.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return sorted(found, key=lambda d: (d.count("/"), d))


def part_token(directory: object, where: str) -> str:
    """The save token of a part directory as a manifest lists it: a relative path whose
    last component is ``part-<token>``, with ``..`` only at its start (parts live on other
    disks, beside the checkpoint's own name there). Anything else is refused, so that no
    manifest can make a reader, retention or ``gc`` reach an arbitrary directory."""
    ok = isinstance(directory, str) and directory and "\0" not in directory and "\\" not in directory
    if ok:
        assert isinstance(directory, str)
        parts = directory.split("/")
        i = 0
        while i < len(parts) and parts[i] == "..":
            i += 1
        rest = parts[i:]
        match = PART_RE.match(rest[-1]) if rest else None
        if match is not None and not os.path.isabs(directory) and all(p not in ("", ".", "..") for p in rest):
            return match.group(1)
    raise CheckpointCorruptError(
        f"{where}: directories: {directory!r} is not a part directory (relative, ending in part-<token>)"
    )


def _object(value: object, what: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointCorruptError(f"{where}: {what} must be a JSON object, got {_short(value)}")
    return value


def _list(value: object, what: str, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise CheckpointCorruptError(f"{where}: {what} must be a list, got {_short(value)}")
    return value


def _str(value: object, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise CheckpointCorruptError(f"{where}: {what} must be a string, got {_short(value)}")
    return value


def _int(value: object, what: str, where: str, limit: int = MAX_SIZE) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise CheckpointCorruptError(
            f"{where}: {what} must be an integer from 0 to {limit}, got {_short(value)}"
        )
    return value


def _dims(value: object, what: str, where: str) -> tuple[int, ...]:
    """A list of at most `MAX_DIMS` integers from 0 to `MAX_SIZE` (a shape or strides)."""
    items = _list(value, what, where)
    if len(items) > MAX_DIMS:
        raise CheckpointCorruptError(
            f"{where}: {what} {_short(items)} has {len(items)} dimensions (at most {MAX_DIMS})"
        )
    return tuple(_int(v, what, where) for v in items)


def _shape(value: object, what: str, where: str) -> tuple[int, ...]:
    dims = _dims(value, what, where)
    if bounded_count(dims, MAX_SIZE) is None:
        raise CheckpointCorruptError(f"{where}: {what} {list(dims)} holds an absurd number of elements")
    return dims


def _pair(value: object, what: str, where: str) -> tuple[int, int]:
    items = _list(value, what, where)
    if len(items) != 2:
        raise CheckpointCorruptError(f"{where}: {what} must be [begin, end], got {_short(value)}")
    begin, end = (_int(v, what, where) for v in items)
    if begin > end:
        raise CheckpointCorruptError(f"{where}: {what} {[begin, end]} ends before it begins")
    return begin, end


def _dtype(value: object, what: str, where: str) -> Any:
    try:
        return dtype_of(_str(value, what, where))
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"{where}: {what}: {exc}") from None


def _checksum(value: object, what: str, where: str) -> str | None:
    return None if value is None else _str(value, what, where)


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and check a manifest; every fault is a `CheckpointCorruptError` naming ``where``
    and the field.

    Checked before anything reads a byte of data: the checksum of the manifest itself;
    every file name (a plain name), part directory (see `part_token`), size, offset,
    dtype and shape (non-negative, bounded); every tensor and slice inside the data
    section of a listed file, and the tensors of each file tiling its data section
    exactly (no overlap, no gap: what is allocated for a load is at most what the files
    hold); views inside their base; aliases and skeleton references to known tensors;
    the skeleton's markers and its nesting depth.
    """
    with gc_paused():
        return _parse_manifest(raw, where)


def _parse_manifest(raw: bytes, where: str) -> Manifest:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(f"{where}: larger than {MAX_MANIFEST_BYTES} bytes")
    doc = load_json(raw, where, limit=MAX_JSON_ITEMS)
    if not isinstance(doc, dict):
        raise CheckpointCorruptError(f"{where}: not a JSON object")
    if doc.get("format") != FORMAT:
        raise CheckpointCorruptError(
            f"{where}: not an aiopersist manifest (format {_short(doc.get('format'))})"
        )
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointCorruptError(f"{where}: format version {_short(version)} is not a number")
    if version > VERSION:
        raise NewerFormatError(
            f"{where}: format version {version} is newer than this aiopersist reads ({VERSION}); upgrade"
        )
    if version < 1:
        raise CheckpointCorruptError(f"{where}: unknown format version {version}")
    stated = doc.pop("manifest_checksum", None)
    try:
        actual = _canonical_digest(doc)
    except (ValueError, RecursionError) as exc:  # a non-finite float, or absurd nesting
        raise CheckpointCorruptError(f"{where}: {type(exc).__name__}: {exc}") from exc
    if stated != actual:
        raise CheckpointCorruptError(
            f"{where}: manifest checksum mismatch (stated {_short(stated)}, computed {actual})"
        )
    if doc.get("checksum_algorithm") != CHECKSUM:
        raise CheckpointCorruptError(
            f"{where}: unknown checksum algorithm {_short(doc.get('checksum_algorithm'))}"
        )
    return _build(doc, version, where)


def _directories(doc: dict[str, Any], version: int, where: str) -> tuple[str, ...]:
    if version < 2 or "directories" not in doc:
        return (".",)
    listed = _list(doc["directories"], "directories", where)
    if not listed or listed[0] != ".":
        raise CheckpointCorruptError(f"{where}: directories: the first must be the checkpoint itself ('.')")
    tokens = {part_token(d, where) for d in listed[1:]}
    if len(tokens) > 1:
        raise CheckpointCorruptError(f"{where}: directories: parts of different saves ({sorted(tokens)})")
    if len(set(listed)) != len(listed):
        raise CheckpointCorruptError(f"{where}: directories: one is listed twice")
    return tuple(listed)


def _files(
    doc: dict[str, Any], directories: tuple[str, ...], version: int, where: str
) -> dict[str, FileRecord]:
    files: dict[str, FileRecord] = {}
    for name, spec in _object(doc.get("files"), "files", where).items():
        if version >= 2:
            safe_member_name(name, where, MAX_MEMBER_DEPTH if version >= 3 else 1)
        else:
            safe_file_name(name, where)
        what = f"files[{name!r}]"
        spec = _object(spec, what, where)
        nbytes = _int(spec.get("bytes"), f"{what}.bytes", where)
        offset = spec.get("data_offset")
        if offset is not None:
            offset = _int(offset, f"{what}.data_offset", where, limit=nbytes)
        directory = _int(spec.get("dir", 0), f"{what}.dir", where, limit=len(directories) - 1)
        checksum = _str(spec.get("checksum"), f"{what}.checksum", where)
        files[name] = FileRecord(name, nbytes, checksum, offset, directory)
    return files


def _tensors(doc: dict[str, Any], files: Mapping[str, FileRecord], where: str) -> dict[str, TensorRecord]:
    tensors: dict[str, TensorRecord] = {}
    for name, spec in _object(doc.get("tensors"), "tensors", where).items():
        # A manifest can list hundreds of thousands of tensors: the common, valid record is checked on a
        # fast path; anything it does not take is checked field by field, which names the
        # field at fault.
        tensors[name] = _tensor_fast(name, spec, files) or _tensor(name, spec, files, where)
    return tensors


def _tensor_fast(name: str, spec: Any, files: Mapping[str, FileRecord]) -> TensorRecord | None:
    """A valid tensor record, or ``None`` for anything else (see `_tensor`)."""
    if type(spec) is not dict:
        return None
    file, offsets, shape, dname = spec.get("file"), spec.get("offsets"), spec.get("shape"), spec.get("dtype")
    checksum = spec.get("checksum")
    if (
        type(file) is not str
        or file not in files
        or type(offsets) is not list
        or len(offsets) != 2
        or type(shape) is not list
        or type(dname) is not str
        or (checksum is not None and type(checksum) is not str)
    ):
        return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= MAX_SIZE:
        return None
    if len(shape) > MAX_DIMS:
        return None
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= MAX_SIZE:
            return None
    count = bounded_count(shape, MAX_SIZE)
    dtype = DTYPES.get(dname)
    if dtype is None or count is None or end - begin != count * dtype.itemsize:
        return None
    return TensorRecord(name, file, begin, end, dtype, tuple(shape), checksum)


def _listed_file(spec: Mapping[str, Any], what: str, files: Mapping[str, FileRecord], where: str) -> str:
    """``spec["file"]``, a name the manifest's ``files`` lists."""
    file = _str(spec.get("file"), f"{what}.file", where)
    if file not in files:
        raise CheckpointCorruptError(f"{where}: {what}.file: {file!r} is not listed in files")
    return file


def _tensor(name: str, spec: Any, files: Mapping[str, FileRecord], where: str) -> TensorRecord:
    """A tensor record checked field by field: `CheckpointCorruptError` names the field."""
    what = f"tensors[{name!r}]"
    spec = _object(spec, what, where)
    file = _listed_file(spec, what, files, where)
    begin, end = _pair(spec.get("offsets"), f"{what}.offsets", where)
    dtype = _dtype(spec.get("dtype"), f"{what}.dtype", where)
    shape = _shape(spec.get("shape"), f"{what}.shape", where)
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise CheckpointCorruptError(
            f"{where}: {what}.offsets {[begin, end]} do not hold its shape {list(shape)} of {dtype}"
        )
    checksum = _checksum(spec.get("checksum"), f"{what}.checksum", where)
    return TensorRecord(name, file, begin, end, dtype, shape, checksum)


def _sliced(name: str, spec: Any, files: Mapping[str, FileRecord], where: str) -> SlicedRecord:
    what = f"sliced[{name!r}]"
    spec = _object(spec, what, where)
    dtype = _dtype(spec.get("dtype"), f"{what}.dtype", where)
    shape = _shape(spec.get("shape"), f"{what}.shape", where)
    if not shape:
        raise CheckpointCorruptError(f"{where}: {what}.shape: a sliced tensor needs rows")
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    slices = []
    pos = 0
    for i, piece in enumerate(_list(spec.get("slices"), f"{what}.slices", where)):
        at = f"{what}.slices[{i}]"
        piece = _object(piece, at, where)
        file = _listed_file(piece, at, files, where)
        begin, end = _pair(piece.get("offsets"), f"{at}.offsets", where)
        r0, r1 = _pair(piece.get("rows"), f"{at}.rows", where)
        if r0 != pos or r1 <= r0:
            raise CheckpointCorruptError(f"{where}: {at}.rows {[r0, r1]}: expected rows from {pos} on")
        if end - begin != (r1 - r0) * row_bytes:
            raise CheckpointCorruptError(f"{where}: {at}.offsets {[begin, end]} do not hold rows {[r0, r1]}")
        checksum = _checksum(piece.get("checksum"), f"{at}.checksum", where)
        slices.append(SliceRecord(file, begin, end, r0, r1, checksum))
        pos = r1
    if pos != shape[0]:
        raise CheckpointCorruptError(f"{where}: {what}: the slices cover {pos} of its {shape[0]} rows")
    return SlicedRecord(name, dtype, shape, tuple(slices))


def _check_tiling(
    files: Mapping[str, FileRecord],
    tensors: Mapping[str, TensorRecord],
    sliced: Mapping[str, SlicedRecord],
    where: str,
) -> None:
    """The stored tensors and slices of each data file fill its data section exactly."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for t in tensors.values():
        spans.setdefault(t.file, []).append((t.begin, t.end, f"tensors[{t.name!r}]"))
    for sl in sliced.values():
        for i, p in enumerate(sl.slices):
            spans.setdefault(p.file, []).append((p.begin, p.end, f"sliced[{sl.name!r}].slices[{i}]"))
    for name, rec in files.items():
        items = sorted(spans.get(name, []))
        if rec.data_offset is None:
            if items:
                raise CheckpointCorruptError(
                    f"{where}: {items[0][2]} is in {name!r}, which has no data section"
                )
            continue
        pos = rec.data_offset
        for begin, end, what in items:
            if begin != pos:
                kind = "overlaps the one before" if begin < pos else "leaves a gap before it"
                raise CheckpointCorruptError(
                    f"{where}: {what}.offsets start at byte {begin} of {name!r}, expected {pos} ({kind})"
                )
            pos = end
        if pos != rec.nbytes:
            raise CheckpointCorruptError(
                f"{where}: files[{name!r}]: its tensors end at byte {pos}, its bytes say {rec.nbytes}"
            )


def _views(doc: Any, nbytes: Mapping[str, int], what: str, where: str) -> dict[str, ViewSpec]:
    views: dict[str, ViewSpec] = {}
    for name, spec in _object(doc, what, where).items():
        at = f"{what}[{name!r}]"
        spec = _object(spec, at, where)
        base = _str(spec.get("base"), f"{at}.base", where)
        if base not in nbytes:
            raise CheckpointCorruptError(f"{where}: {at}.base: unknown tensor {base!r}")
        dtype = _dtype(spec.get("dtype"), f"{at}.dtype", where)
        offset = _int(spec.get("offset"), f"{at}.offset", where)
        shape = _shape(spec.get("shape"), f"{at}.shape", where)
        stride = _dims(spec.get("stride"), f"{at}.stride", where)
        if len(stride) != len(shape):
            raise CheckpointCorruptError(f"{where}: {at}: {len(shape)} dimensions but {len(stride)} strides")
        if offset % dtype.itemsize:
            raise CheckpointCorruptError(
                f"{where}: {at}.offset {offset} is not a multiple of {dtype.itemsize}"
            )
        extent = 0 if 0 in shape else (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1)
        if offset + extent * dtype.itemsize > nbytes[base]:
            raise CheckpointCorruptError(f"{where}: {at} reaches past the {nbytes[base]} bytes of {base!r}")
        views[name] = ViewSpec(base, offset, dtype, shape, stride)
    return views


def _aliases(
    doc: Any, known: Mapping[str, Any], views: Mapping[str, ViewSpec], what: str, where: str
) -> dict[str, str]:
    aliases: dict[str, str] = {}
    for name, target in _object(doc, what, where).items():
        target = _str(target, f"{what}[{name!r}]", where)
        if target not in known and target not in views:
            raise CheckpointCorruptError(f"{where}: {what}[{name!r}]: unknown tensor {target!r}")
        aliases[name] = target
    return aliases


def _rank_part(spec: dict[str, Any], nbytes: Mapping[str, int], what: str, where: str) -> RankState:
    """One rank's skeleton, aliases and views (the top level's, or a ``ranks`` entry's)."""
    views = _views(spec.get("views", {}), nbytes, f"{what}views", where)
    aliases = _aliases(spec.get("aliases", {}), nbytes, views, f"{what}aliases", where)
    # One name, one thing: a view or an alias named like a stored tensor (or an alias like
    # a view) would shadow it, and could name itself through its target.
    for name in views:
        if name in nbytes:
            raise CheckpointCorruptError(f"{where}: {what}views[{name!r}]: the name of a stored tensor")
    for name in aliases:
        if name in nbytes or name in views:
            kind = "stored tensor" if name in nbytes else "view"
            raise CheckpointCorruptError(f"{where}: {what}aliases[{name!r}]: the name of a {kind}")
    if "skeleton" not in spec:
        raise CheckpointCorruptError(f"{where}: {what}skeleton is missing")
    skeleton = spec["skeleton"]

    def known(name: str) -> bool:
        return name in nbytes or name in views or name in aliases

    check_skeleton(skeleton, where, known)
    return RankState(skeleton, aliases, views)


def _build(doc: dict[str, Any], version: int, where: str) -> Manifest:
    directories = _directories(doc, version, where)
    files = _files(doc, directories, version, where)
    tensors = _tensors(doc, files, where)
    sliced = (
        {
            name: _sliced(name, spec, files, where)
            for name, spec in _object(doc["sliced"], "sliced", where).items()
        }
        if version >= 2 and "sliced" in doc
        else {}
    )
    clash = set(sliced) & set(tensors)
    if clash:
        raise CheckpointCorruptError(f"{where}: {sorted(clash)[0]!r} is listed both whole and sliced")
    _check_tiling(files, tensors, sliced, where)
    nbytes = {**{n: t.nbytes for n, t in tensors.items()}, **{n: s.nbytes for n, s in sliced.items()}}
    top = _rank_part(doc, nbytes, "", where)
    world_size = _int(doc.get("world_size", 1), "world_size", where, limit=MAX_WORLD_SIZE)
    if world_size < 1:
        raise CheckpointCorruptError(f"{where}: world_size must be at least 1")
    ranks: dict[int, RankState] = {}
    for key, spec in _object(doc["ranks"], "ranks", where).items() if version >= 2 and "ranks" in doc else ():
        # ASCII digits, canonical, no longer than the largest rank (int() of thousands of
        # digits raises, and isdecimal() takes any script's digits).
        if not (key.isascii() and key.isdigit() and len(key) <= len(str(MAX_WORLD_SIZE))) or not (
            str(int(key)) == key and 0 < int(key) < world_size
        ):
            raise CheckpointCorruptError(
                f"{where}: ranks: {reprlib.repr(key)} is not a rank from 1 to {world_size - 1}"
            )
        ranks[int(key)] = _rank_part(
            _object(spec, f"ranks[{key!r}]", where), nbytes, f"ranks[{key!r}].", where
        )
    pickle_file = doc.get("pickle")
    if pickle_file is not None:
        safe_file_name(pickle_file, where)
        if pickle_file not in files or files[pickle_file].data_offset is not None:
            raise CheckpointCorruptError(
                f"{where}: pickle: {pickle_file!r} is not a listed file without tensors"
            )
    metadata = doc.get("metadata", {})  # always written as an object: 0 or [] is no metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointCorruptError(f"{where}: metadata must map strings to strings")
    layout = doc.get("layout", "state")
    if layout not in LAYOUTS:
        raise CheckpointCorruptError(f"{where}: layout {_short(layout)} is not one of {', '.join(LAYOUTS)}")
    entries = _entries(doc, files, where) if version >= 2 and "entries" in doc else {}
    return Manifest(
        files=files,
        tensors=tensors,
        skeleton=top.skeleton,
        aliases=top.aliases,
        views=top.views,
        pickle_file=pickle_file,
        metadata=metadata,
        layout=layout,
        world_size=world_size,
        version=version,
        created=_str(doc.get("created", ""), "created", where),
        sliced=sliced,
        directories=directories,
        ranks=ranks,
        entries=entries,
    )


def _entries(
    doc: dict[str, Any], files: Mapping[str, FileRecord], where: str
) -> dict[str, tuple[EntryRecord, ...]]:
    """``entries``: for listed files without a safetensors header, byte ranges inside the
    file, in order, not overlapping, each with a checksum."""
    out: dict[str, tuple[EntryRecord, ...]] = {}
    for name, spec in _object(doc["entries"], "entries", where).items():
        what = f"entries[{name!r}]"
        rec = files.get(name)
        if rec is None or rec.data_offset is not None:
            raise CheckpointCorruptError(f"{where}: {what}: not a listed file without tensors")
        found = []
        pos = 0
        for i, item in enumerate(_list(spec, what, where)):
            triple = _list(item, f"{what}[{i}]", where)
            if len(triple) != 3:
                raise CheckpointCorruptError(f"{where}: {what}[{i}]: not [begin, end, checksum]")
            begin = _int(triple[0], f"{what}[{i}] begin", where, limit=rec.nbytes)
            end = _int(triple[1], f"{what}[{i}] end", where, limit=rec.nbytes)
            if begin < pos or end < begin:
                raise CheckpointCorruptError(
                    f"{where}: {what}[{i}]: bytes {begin}..{end} overlap the entry before or run backwards"
                )
            found.append(EntryRecord(begin, end, _str(triple[2], f"{what}[{i}] checksum", where)))
            pos = end
        out[name] = tuple(found)
    return out


def parse_index(raw: bytes, where: str) -> list[str]:
    """The data files a Hugging Face ``model.safetensors.index.json`` names (sorted, each
    once), checked like a manifest's file names; `CheckpointCorruptError` otherwise."""
    if len(raw) > MAX_INDEX_BYTES:
        raise CheckpointCorruptError(f"{where}: larger than {MAX_INDEX_BYTES} bytes")
    doc = load_json(raw, where, "not a valid safetensors index", MAX_JSON_ITEMS)
    weight_map = _object(_object(doc, "the index", where).get("weight_map"), "weight_map", where)
    if not weight_map:
        raise CheckpointCorruptError(f"{where}: weight_map is empty: the index names no file")
    names = {safe_file_name(_str(f, f"weight_map[{k!r}]", where), where) for k, f in weight_map.items()}
    return sorted(names)
