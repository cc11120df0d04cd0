"""The read plan (pure: no asyncio, no files): which bytes of which files go into which
tensors, and what checks them.

Every load reads through one plan, of one of two kinds:

- **checked spans**: a version 2 manifest whose needed tensors all have checksums of their
  own (no pickle file): only the bytes of the tensors this rank needs are read, and of a
  sharded tensor only the slices that hold the wanted rows, each checked alone;
- **whole files**: everything else (version 1, a pickle file, parts without checksums):
  every file that holds a byte of a needed tensor is read whole, so that the file's
  checksum covers it; files that hold only other ranks' tensors are not read at all.

`verify` reads through a plan too (`plan_verify`): every file whole, checked, nothing
kept. A plain safetensors file or Hugging Face directory (no manifest) is read as spans
without checksums (`plan_safetensors`). The manifest was validated when it was parsed
(every offset inside its file, every reference resolving); the plan adds the checks that
need a rank's view: the rows it wants exist, and the spans of a whole file tile it.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._exceptions import CheckpointCorruptError, StateMismatchError
from ._format import FileLayout
from ._manifest import Manifest, RankState
from ._skeleton import refs as skeleton_refs


@dataclass(frozen=True)
class Target:
    """A tensor to allocate and fill."""

    name: str
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]
    offset: int
    """The file offset its first byte is read from: memory placed for direct reads puts
    the tensor at the same offset modulo the alignment."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * int(self.dtype.itemsize)


@dataclass(frozen=True)
class Span:
    """Bytes ``[begin, end)`` of a file, read into rows of a target."""

    begin: int
    end: int
    target: str
    rows: tuple[int, int] | None = None
    """Rows of the target they fill (``None``: all of it)."""
    checksum: str | None = None
    """Their own checksum, checked alone (``None``: the file's checksum, or none)."""
    what: str = ""
    """How errors name them."""
    keep: tuple[int, int] | None = None
    """A slice only partly wanted: it is read whole into scratch memory (its checksum
    covers all of it), and only its rows ``keep`` are copied into the target's ``rows``."""
    slice_rows: int = 0
    """With ``keep``: the rows of the whole slice."""


@dataclass(frozen=True)
class FileRead:
    file: str
    """The file's name in the manifest (or its path, for a plain safetensors read)."""
    spans: tuple[Span, ...]
    """Ordered by offset."""
    whole: bool
    """Read every byte and check the file's checksum (the spans tile the file after its
    header); otherwise read just the spans."""
    header: tuple[tuple[int, int], ...] | None = None
    """A check-only read (`plan_verify`: no spans, nothing kept): the file is streamed
    through the staging pool for its checksum, and its own safetensors header must place
    exactly these byte ranges (sorted), as the manifest does. ``None``: not checked."""


@dataclass(frozen=True)
class ReadPlan:
    targets: tuple[Target, ...]
    files: tuple[FileRead, ...]
    needed: frozenset[str]
    """The targets the rank's state refers to (the others were read for a checksum)."""
    pickle_file: str | None = None
    """Read whole and unpickled (with ``allow_pickle`` only)."""
    wanted_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Sharded tensors of which only these rows are read (checked-spans plans)."""
    checked_spans: bool = False
    """A checked-spans plan (see the module docstring): the rows wanted are honoured."""


def needed_tensors(manifest: Manifest, state: RankState) -> set[str]:
    """The stored (whole or sliced) tensors a rank's skeleton reaches (the manifest was
    validated: every reference resolves, and an alias points to a stored tensor or a
    view). A version 1 checkpoint has one rank: all of them."""
    if manifest.version < 2:
        return set(manifest.tensors)
    out: set[str] = set()
    for name, _ in skeleton_refs(state.skeleton):
        name = state.aliases.get(name, name)
        out.add(state.views[name].base if name in state.views else name)
    return out


def _parts_checked(manifest: Manifest, needed: Iterable[str]) -> bool:
    """Whether every needed tensor has checksums of its own (then it is read alone)."""
    for name in needed:
        if name in manifest.tensors:
            if manifest.tensors[name].checksum is None:
                return False
        elif any(p.checksum is None for p in manifest.sliced[name].slices):
            return False
    return True


def plan_read(
    manifest: Manifest,
    state: RankState,
    wants: Mapping[str, tuple[int, int] | None] | None = None,
    *,
    allow_pickle: bool = False,
) -> ReadPlan:
    """The plan to load ``state`` (a rank's view of ``manifest``). ``wants`` gives, for
    dim-0 sharded targets, the rows this rank holds (only those are read, where the
    checkpoint's checksums allow it)."""
    needed = needed_tensors(manifest, state)
    if manifest.version >= 2 and manifest.pickle_file is None and _parts_checked(manifest, needed):
        return _plan_spans(manifest, needed, wants or {})
    return _plan_whole(manifest, needed, allow_pickle)


def _plan_spans(
    manifest: Manifest, needed: set[str], wants: Mapping[str, tuple[int, int] | None]
) -> ReadPlan:
    targets: list[Target] = []
    by_file: dict[str, list[Span]] = {}
    wanted_rows: dict[str, tuple[int, int]] = {}
    for name in sorted(needed):
        if name in manifest.tensors:
            t = manifest.tensors[name]
            targets.append(Target(name, t.dtype, t.shape, t.begin))
            by_file.setdefault(t.file, []).append(Span(t.begin, t.end, name, None, t.checksum, name))
            continue
        sl = manifest.sliced[name]
        rows = wants.get(name)
        r0, r1 = rows if rows is not None else (0, sl.shape[0])
        if not 0 <= r0 <= r1 <= sl.shape[0]:
            raise StateMismatchError(f"{name}: rows {r0}..{r1} wanted, the checkpoint has {sl.shape[0]}")
        if rows is not None:
            wanted_rows[name] = (r0, r1)
        overlapping = [p for p in sl.slices if p.row_start < r1 and p.row_end > r0]
        first = overlapping[0].begin if overlapping else 0
        targets.append(Target(name, sl.dtype, (r1 - r0, *sl.shape[1:]), first))
        for p in overlapping:
            what = f"{name}[{p.row_start}:{p.row_end}]"
            a, b = max(r0, p.row_start), min(r1, p.row_end)
            whole_slice = r0 <= p.row_start and p.row_end <= r1
            span = Span(
                p.begin,
                p.end,
                name,
                (a - r0, b - r0),
                p.checksum,
                what,
                None if whole_slice else (a - p.row_start, b - p.row_start),
                p.row_end - p.row_start,
            )
            by_file.setdefault(p.file, []).append(span)
    files = tuple(
        FileRead(f, tuple(sorted(spans, key=lambda s: (s.begin, s.end))), whole=False)
        for f, spans in by_file.items()
    )
    return ReadPlan(tuple(targets), files, frozenset(needed), None, wanted_rows, checked_spans=True)


def _plan_whole(manifest: Manifest, needed: set[str], allow_pickle: bool) -> ReadPlan:
    wanted = {t.file for t in manifest.tensors.values() if t.name in needed}
    wanted |= {p.file for sl in manifest.sliced.values() if sl.name in needed for p in sl.slices}
    wanted.discard(manifest.pickle_file or "")
    targets: list[Target] = []
    spans: dict[str, list[Span]] = {name: [] for name in manifest.files if name in wanted}
    for t in sorted(manifest.tensors.values(), key=lambda t: (t.file, t.begin, t.end)):
        if t.file in wanted:
            targets.append(Target(t.name, t.dtype, t.shape, t.begin))
            spans[t.file].append(Span(t.begin, t.end, t.name, what=t.name))
    for sl in manifest.sliced.values():
        if not any(p.file in wanted for p in sl.slices):
            continue
        targets.append(Target(sl.name, sl.dtype, sl.shape, sl.slices[0].begin))
        for p in sl.slices:
            if p.file in wanted:
                what = f"{sl.name}[{p.row_start}:{p.row_end}]"
                spans[p.file].append(Span(p.begin, p.end, sl.name, (p.row_start, p.row_end), what=what))
    files = [
        FileRead(name, tuple(sorted(spans[name], key=lambda s: (s.begin, s.end))), whole=True)
        for name in manifest.files
        if name in wanted
    ]
    pickle_file = manifest.pickle_file if allow_pickle else None
    return ReadPlan(tuple(targets), tuple(files), frozenset(needed), pickle_file)


def plan_verify(manifest: Manifest) -> ReadPlan:
    """Check every file of a checkpoint, keeping nothing: each is read whole for its
    checksum (streamed, so memory stays within the staging pool), and a data file's
    header must place the same byte ranges as the manifest, so that any safetensors reader
    sees the tensors aiopersist does."""
    placed: dict[str, list[tuple[int, int]]] = {name: [] for name in manifest.files}
    for t in manifest.tensors.values():
        placed[t.file].append((t.begin, t.end))
    for sl in manifest.sliced.values():
        for p in sl.slices:
            placed[p.file].append((p.begin, p.end))
    files = tuple(
        FileRead(
            name,
            (),
            whole=True,
            header=tuple(sorted(placed[name])) if rec.data_offset is not None else None,
        )
        for name, rec in manifest.files.items()
    )
    return ReadPlan((), files, frozenset())


def plan_safetensors(layouts: Iterable[tuple[str, FileLayout]]) -> ReadPlan:
    """Every tensor of plain safetensors files (no manifest, no checksums), by header."""
    targets: list[Target] = []
    files: list[FileRead] = []
    for path, layout in layouts:
        spans = []
        for e in layout.entries:
            begin = layout.data_offset + e.begin
            targets.append(Target(e.name, e.dtype, e.shape, begin))
            spans.append(Span(begin, layout.data_offset + e.end, e.name, what=e.name))
        files.append(FileRead(path, tuple(spans), whole=False))
    names = collections.Counter(t.name for t in targets)
    if len(names) != len(targets):
        dup = sorted(n for n, k in names.items() if k > 1)[:3]
        raise CheckpointCorruptError(f"tensor names given by more than one file: {', '.join(map(repr, dup))}")
    return ReadPlan(tuple(targets), tuple(files), frozenset(names))


def host_bytes(plan: ReadPlan, manifest: Manifest | None) -> int:
    """The host memory a load through ``plan`` allocates: every target, the scratch rows
    of each slice only partly wanted, and what comes before the first span of each file
    read whole (its header; the whole pickle file). A check-only read (`plan_verify`)
    streams through the staging pool and allocates none of it."""
    total = sum(t.nbytes for t in plan.targets)
    targets = {t.name: t for t in plan.targets}
    for read in plan.files:
        for span in read.spans:
            if span.keep is not None:
                t = targets[span.target]
                total += span.slice_rows * math.prod(t.shape[1:]) * int(t.dtype.itemsize)
        if manifest is not None and read.whole and read.spans:
            rec = manifest.files[read.file]
            total += rec.data_offset if rec.data_offset is not None else rec.nbytes
    if manifest is not None and plan.pickle_file is not None:
        total += manifest.files[plan.pickle_file].nbytes
    return total


def check_tiling(read: FileRead, head: int, size: int, where: str) -> None:
    """A whole-file read: its spans must cover every byte from ``head`` to ``size``, once."""
    pos = head
    for s in read.spans:
        if s.begin != pos:
            raise CheckpointCorruptError(f"{where}: bytes {pos}..{s.begin} belong to no tensor")
        pos = s.end
    if pos != size:
        raise CheckpointCorruptError(f"{where}: {size - pos} bytes after the last tensor")
