"""The write plan (pure: no asyncio, no files): which bytes of which rank go into which
file of which directory, under which names.

One plan covers every save. A save by one process into one directory is the case of one
rank and one writer: its files take the Hugging Face names (``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` shards for a model's weights; ``state...`` for
anything else) and its manifest is format version 1. A save over several ranks or
directories names each file after its writer (``state-rank00000-dir00.safetensors``),
may store a tensor as row slices (split for balance, or dim-0 shards written by their
owners), and its manifest is version 2.

Steps, the same on every rank (the plan is computed from every rank's description, so
that all ranks get the same one, or the same error):

1. `describe` a rank's flattened state: names, dtypes, shapes, and whether each tensor is
   shared by every rank, this rank's own, or a dim-0 shard of a bigger tensor;
2. `plan_write`: check the descriptions agree, `partition` the bytes over the writers
   (one ``(rank, directory)`` pair each), and cut each writer's pieces into files of at
   most ``max_shard_bytes``, largest alignment first, each with its safetensors header.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ._exceptions import StateMismatchError, UnsupportedStateError
from ._flatten import Flattened, ViewSpec
from ._format import FileLayout, dtype_from_name, dtype_name, layout_file
from ._manifest import RankState, TensorRecord, TensorTable
from ._partition import Entry, Piece, partition, writers_for
from ._partition import Plan as Partitioned
from ._skeleton import rename_refs
from ._workers import gc_paused

Replicated = bool | Callable[[str], bool] | None


class TensorDesc(NamedTuple):
    """One stored tensor, as its rank describes it to the others (a named tuple: a state
    has tens of thousands of them, made on every save)."""

    name: str
    """Its name in the checkpoint: rank-local tensors carry ``@rank``; shards carry the whole
    tensor's name."""
    source: str
    """Its name in this rank's flattened state."""
    dtype: str
    shape: tuple[int, ...]
    """The local shape (a shard's own rows)."""
    align: int
    kind: str
    """``replicated``, ``local`` or ``shard``."""
    whole_shape: tuple[int, ...] = ()
    """For a shard: the whole tensor's shape."""
    row_start: int = 0
    """For a shard: its first row in the whole tensor."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class RankDesc:
    rank: int
    local_rank: int
    tensors: tuple[TensorDesc, ...]
    state: RankState
    token: str
    """Rank 0's names the save (its temporary directory and its parts)."""
    model_only: bool = False
    """The state was a model's weights (Hugging Face names, when one writer writes all)."""


def describe(flat: Flattened, rank: int, world_size: int, replicated: Replicated) -> tuple[TensorDesc, ...]:
    """Classify this rank's stored tensors: shared by all ranks, this rank's own, or a
    dim-0 shard of a whole tensor (only with several ranks: alone, a rank holds it whole)."""
    with gc_paused():
        return _describe(flat, rank, world_size, replicated)


def _describe(flat: Flattened, rank: int, world_size: int, replicated: Replicated) -> tuple[TensorDesc, ...]:
    out = []
    for s in flat.stored:
        src = s.source
        shape = tuple(src.shape)  # torch.Size: ints already
        dtype = dtype_name(src.dtype)
        align = s.align or src.element_size()
        if world_size > 1 and s.name in flat.sharded and flat.sharded[s.name][0][:1] != (0,):
            whole, start = flat.sharded[s.name]
            out.append(TensorDesc(s.name, s.name, dtype, shape, align, "shard", whole, start))
            continue
        if world_size == 1 or s.name in flat.replicated:
            shared = True
        elif callable(replicated):
            shared = bool(replicated(s.name))
        else:
            shared = bool(replicated)
        name = s.name if shared else f"{s.name}@{rank}"
        kind = "replicated" if shared else "local"
        out.append(TensorDesc(name, s.name, dtype, shape, align, kind))
    return tuple(out)


def rank_state(flat: Flattened, tensors: Sequence[TensorDesc]) -> RankState:
    """This rank's skeleton, aliases and views, referring to checkpoint names."""
    names = {t.source: t.name for t in tensors if t.source != t.name}
    if not names:
        return RankState(flat.skeleton, flat.aliases, flat.views)
    aliases = {k: names.get(v, v) for k, v in flat.aliases.items()}
    views = {
        k: ViewSpec(names.get(v.base, v.base), v.offset, v.dtype, v.shape, v.stride)
        for k, v in flat.views.items()
    }
    return RankState(rename_refs(flat.skeleton, names), aliases, views)


@dataclass(frozen=True)
class PartPlan:
    """Bytes of one tensor in one file: rows ``rows`` of the rank's source tensor."""

    source: str
    header: str
    rows: tuple[int, int] | None
    """Rows of the source tensor (``None``: all of it)."""
    target: str
    """The checkpoint tensor it belongs to."""
    target_rows: tuple[int, int] | None
    """Rows of the checkpoint tensor (``None``: the whole tensor, stored in one piece)."""


@dataclass(frozen=True)
class FilePlan:
    name: str
    rank: int
    directory: int
    parts: tuple[PartPlan, ...]
    layout: FileLayout
    """Its safetensors header and where each part lies after it (in ``parts`` order)."""


@dataclass(frozen=True)
class WritePlan:
    files: tuple[FilePlan, ...]
    whole: dict[str, tuple[str, tuple[int, ...]]]
    """Checkpoint tensors stored in one piece: name -> (dtype, shape)."""
    sliced: dict[str, tuple[str, tuple[int, ...]]]
    """Checkpoint tensors stored as row slices: name -> (dtype, whole shape)."""
    imbalance: float
    spread: bool
    """Several ranks or directories, or sliced tensors: a version 2 manifest, with a
    checksum per part so that a load reads just the parts it needs."""
    layout: str
    """The manifest's layout: ``hf-model`` (a model's weights, by one writer, in the
    Hugging Face names) or ``state``."""

    def of_rank(self, rank: int) -> list[FilePlan]:
        return [f for f in self.files if f.rank == rank]

    @functools.cached_property
    def records(self) -> TensorTable:
        """The manifest's records of the tensors stored whole (without per-part checksums),
        in file order: the whole tensor table of a version 1 manifest, made (and encoded)
        once per plan rather than once per save."""
        records: dict[str, TensorRecord] = {}
        for f in self.files:
            base = f.layout.data_offset
            for part, entry in zip(f.parts, f.layout.entries, strict=True):
                if part.target_rows is None:
                    records[part.target] = TensorRecord(
                        part.target, f.name, base + entry.begin, base + entry.end, entry.dtype, entry.shape
                    )
        return TensorTable(records)

    @property
    def needs_index(self) -> bool:
        """A model's weights in several shards: Hugging Face's index goes beside them."""
        return self.layout == "hf-model" and len(self.files) > 1


def _rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


_PLANS: dict[tuple[object, ...], WritePlan] = {}
_PLANS_KEPT = 4
_PLANS_LOCK = threading.Lock()


def plan_write(descs: Sequence[RankDesc], num_dirs: int, max_shard_bytes: int) -> WritePlan:
    """Who writes what where; the same on every rank. Raises `StateMismatchError` when
    the ranks disagree on the shared tensors.

    Plans are cached while the state's structure (every rank's tensors: names, dtypes,
    shapes) and the directories stay the same, as between the saves of a training run.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    with gc_paused():
        key = (
            tuple((d.rank, d.local_rank, d.model_only, d.tensors) for d in descs),
            num_dirs,
            max_shard_bytes,
        )
        with _PLANS_LOCK:
            plan = _PLANS.get(key)
        if plan is None:
            plan = _plan_write(descs, num_dirs, max_shard_bytes)
            with _PLANS_LOCK:
                if len(_PLANS) >= _PLANS_KEPT:
                    _PLANS.pop(next(iter(_PLANS)))
                _PLANS[key] = plan
        return plan


def _check_replicated(ranks: Sequence[RankDesc]) -> None:
    shared0 = {t.name: (t.dtype, t.shape) for t in ranks[0].tensors if t.kind == "replicated"}
    for d in ranks[1:]:
        mine = {t.name: (t.dtype, t.shape) for t in d.tensors if t.kind == "replicated"}
        if mine != shared0:
            diff = sorted(set(mine.items()) ^ set(shared0.items()))
            raise StateMismatchError(
                f"the replicated tensors differ between rank 0 and rank {d.rank}: "
                + ", ".join(f"{n} {dt} {list(sh)}" for n, (dt, sh) in diff[:5])
                + (" ..." if len(diff) > 5 else "")
                + " (pass replicated=False, or a predicate, for state that is not the same on every rank)"
            )


def _check_shards(shards: dict[str, list[tuple[int, TensorDesc]]]) -> None:
    for name, owned in shards.items():
        dtypes = {t.dtype for _, t in owned}
        wholes = {t.whole_shape for _, t in owned}
        if len(dtypes) != 1 or len(wholes) != 1:
            raise StateMismatchError(f"the shards of {name!r} disagree on dtype or shape: {dtypes} {wholes}")
        covered = sorted((t.row_start, t.row_start + _rows(t.shape)) for _, t in owned if _rows(t.shape))
        pos = 0
        for a, b in covered:
            if a != pos:
                raise StateMismatchError(
                    f"the shards of {name!r} do not tile its rows (gap or overlap at {pos})"
                )
            pos = b
        whole_rows = _rows(next(iter(wholes)))
        if pos != whole_rows:
            raise StateMismatchError(f"the shards of {name!r} cover {pos} of its {whole_rows} rows")


def _plan_write(descs: Sequence[RankDesc], num_dirs: int, max_shard_bytes: int) -> WritePlan:
    ranks = sorted(descs, key=lambda d: d.rank)
    _check_replicated(ranks)
    entries: list[Entry] = []
    # entry name -> (owner rank or None, desc, order); shards and local tensors are per
    # rank. The order (rank, index in its state) keeps a file's tensors in state order.
    owner_of: dict[str, tuple[int | None, TensorDesc, tuple[int, int]]] = {}
    shards: dict[str, list[tuple[int, TensorDesc]]] = {}
    for r, d in enumerate(ranks):
        for i, t in enumerate(d.tensors):
            rows = _rows(t.shape)
            if t.kind == "replicated":
                if r != 0:
                    continue
                key, owner = t.name, None
            elif t.kind == "local":
                key, owner = t.name, d.rank
            else:
                shards.setdefault(t.name, []).append((d.rank, t))
                if rows == 0:
                    continue  # an empty shard (uneven chunks): nothing of it to write
                key, owner = f"{t.name}\0{d.rank}", d.rank
            owner_of[key] = (owner, t, (r, i))
            entries.append(Entry(key, t.nbytes, max(rows, 1) if t.nbytes else 1, owner))
    _check_shards(shards)
    writers = writers_for([d.local_rank for d in ranks], num_dirs)
    alone = len(writers) == 1
    if alone:  # one writer writes everything, whole: what partition would say, in O(n)
        pieces = tuple(Piece(e.name, 0, e.rows, e.nbytes, whole=True) for e in entries)
        assignment = Partitioned(writers, (pieces,))
    else:
        assignment = partition(entries, writers)
    whole: dict[str, tuple[str, tuple[int, ...]]] = {}
    sliced: dict[str, tuple[str, tuple[int, ...]]] = {}
    # Per writer: its files, each a list of (part, header spec).
    groups_of: list[tuple[int, int, list[list[tuple[PartPlan, tuple[str, Any, tuple[int, ...]]]]]]] = []
    for writer, pieces in zip(assignment.writers, assignment.pieces, strict=True):
        parts: list[tuple[tuple[int, int, int, int], PartPlan, tuple[str, Any, tuple[int, ...]], int]] = []
        for p in pieces:
            _, t, order = owner_of[p.name]
            part, shape = _part(p, t)
            if part.target_rows is None:
                whole[part.target] = (t.dtype, shape)
            else:
                sliced[part.target] = (t.dtype, t.whole_shape if t.kind == "shard" else t.shape)
            # Largest alignment first, then state order: every tensor starts at a multiple
            # of its element size, so loads can place it for direct reads.
            parts.append(
                (
                    (-t.align, *order, p.row_start),
                    part,
                    (part.header, dtype_from_name(t.dtype), shape),
                    p.nbytes,
                )
            )
        parts.sort(key=lambda x: x[0])
        groups: list[list[tuple[PartPlan, tuple[str, Any, tuple[int, ...]]]]] = [[]]
        size = 0
        for _, part, spec, nbytes in parts:
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((part, spec))
            size += nbytes
        groups_of.append((writer.rank, writer.directory, [g for g in groups if g]))
    model_only = alone and all(d.model_only for d in ranks)
    files: list[FilePlan] = []
    for rank, directory, groups in groups_of:
        n = len(groups)
        for i, group in enumerate(groups, 1):
            if alone:  # Hugging Face's names
                stem = "model" if model_only else "state"
                name = f"{stem}.safetensors" if n == 1 else f"{stem}-{i:05d}-of-{n:05d}.safetensors"
            else:
                suffix = f"-{i:05d}" if n > 1 else ""
                name = f"state-rank{rank:05d}-dir{directory:02d}{suffix}.safetensors"
            try:
                layout = layout_file([spec for _, spec in group], {"format": "pt"})
            except ValueError as exc:  # more tensors than one file's header holds
                raise UnsupportedStateError(f"{name}: {exc}; pass a smaller max_shard_bytes") from None
            files.append(FilePlan(name, rank, directory, tuple(p for p, _ in group), layout))
    return WritePlan(
        files=tuple(files),
        whole=whole,
        sliced=sliced,
        imbalance=assignment.imbalance,
        spread=not alone or bool(sliced),
        layout="hf-model" if model_only else "state",
    )


def _part(p: Piece, t: TensorDesc) -> tuple[PartPlan, tuple[int, ...]]:
    """The file part for piece ``p`` of tensor ``t``, and its shape."""
    if t.kind == "shard":
        g0, g1 = t.row_start + p.row_start, t.row_start + p.row_end
        rows = None if p.whole else (p.row_start, p.row_end)
        shape = (p.row_end - p.row_start, *t.shape[1:]) if t.shape else t.shape
        return PartPlan(t.source, f"{t.name}[{g0}:{g1}]", rows, t.name, (g0, g1)), shape
    if p.whole:
        return PartPlan(t.source, t.name, None, t.name, None), t.shape
    shape = (p.row_end - p.row_start, *t.shape[1:])
    part = PartPlan(
        t.source,
        f"{t.name}[{p.row_start}:{p.row_end}]",
        (p.row_start, p.row_end),
        t.name,
        (p.row_start, p.row_end),
    )
    return part, shape
