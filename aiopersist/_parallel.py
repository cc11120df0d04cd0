"""Saves spread over several ranks and several directories (SSDs).

The primary directory (the first ``path``) is the checkpoint: it holds the manifest and
its own share of the files. Every further directory gets a part: a fresh subdirectory
``part-<token>`` of the path given for that disk. Parts never take a name that another
save could be using, so the rename of the primary is the one commit point of the whole
save: before it, nothing under the checkpoint's name changed; after it, every part is
complete and durable. A crash in between leaves unreferenced parts, which nothing reads.

Steps, on every rank (one process with several directories is the one-rank case):

1. flatten the state and describe it (names, dtypes, shapes, which tensors are shared by
   every rank, which are this rank's own, which are dim-0 shards of a bigger tensor);
   rank 0 creates the primary's temporary directory; exchange the descriptions;
2. plan (pure, the same on every rank): who writes which bytes to which directory
   (`_partition`), and which files that makes;
3. write this rank's files, each fsynced; exchange what was written;
4. rank 0 fsyncs the part directories, writes the manifest and renames the primary into
   place; exchange the result.

An error on any rank at any step makes every rank raise, and rank 0 removes the
temporary directory and the parts: no checkpoint appears.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._api import SaveInfo, countdown, write_file
from ._backends import IOBackend, to_thread_to_the_end
from ._commit import (
    TMP_MARKER,
    fsync_directory,
    make_directories,
    publish,
    remove_empty_directory,
    remove_path,
)
from ._direct import probe_directory
from ._dist import Coordinator
from ._exceptions import (
    CheckpointExistsError,
    StateMismatchError,
    UnsupportedStateError,
    from_os_error,
)
from ._flatten import Flattened, ViewSpec
from ._format import dtype_name, layout_file
from ._locate import own_parts, part_dir, token_at
from ._manifest import (
    MANIFEST_NAME,
    PART_PREFIX,
    FileRecord,
    Manifest,
    RankState,
    SlicedRecord,
    SliceRecord,
    TensorRecord,
    dump_manifest,
    new_hasher,
)
from ._partition import Entry, Piece, partition, writers_for
from ._skeleton import rename_refs
from ._staging import StagingPool
from ._stream import PartHasher, run_all

Replicated = bool | Callable[[str], bool] | None


# -- describing and planning (pure) ------------------------------------------------------------


@dataclass(frozen=True)
class TensorDesc:
    """One stored tensor, as its rank describes it to the others."""

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
        return math.prod(self.shape) * _dtype(self.dtype).itemsize


@dataclass(frozen=True)
class RankDesc:
    rank: int
    local_rank: int
    tensors: tuple[TensorDesc, ...]
    state: RankState
    token: str
    """Rank 0's names the save (its temporary directory and its parts)."""


def _dtype(name: str) -> torch.dtype:
    from ._format import dtype_from_name

    return dtype_from_name(name)


def describe(flat: Flattened, rank: int, world_size: int, replicated: Replicated) -> tuple[TensorDesc, ...]:
    """Classify this rank's stored tensors: shared by all ranks, this rank's own, or a
    dim-0 shard of a whole tensor."""
    out = []
    for s in flat.stored:
        shape = tuple(int(d) for d in s.source.shape)
        dtype = dtype_name(s.source.dtype)
        if s.name in flat.sharded and flat.sharded[s.name][0][:1] != (0,):
            whole, start = flat.sharded[s.name]
            out.append(TensorDesc(s.name, s.name, dtype, shape, s.alignment, "shard", whole, start))
            continue
        if s.name in flat.replicated or world_size == 1:
            shared = True
        elif callable(replicated):
            shared = bool(replicated(s.name))
        else:
            shared = bool(replicated)
        name = s.name if shared else f"{s.name}@{rank}"
        out.append(TensorDesc(name, s.name, dtype, shape, s.alignment, "replicated" if shared else "local"))
    return tuple(out)


def rank_state(flat: Flattened, tensors: Sequence[TensorDesc]) -> RankState:
    """This rank's skeleton, aliases and views, referring to checkpoint names."""
    names = {t.source: t.name for t in tensors if t.source != t.name}
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
    dtypes: tuple[tuple[str, Any, tuple[int, ...]], ...]
    """(header name, dtype, shape) in file order, for the header."""


@dataclass(frozen=True)
class SpreadPlan:
    files: tuple[FilePlan, ...]
    whole: dict[str, tuple[str, tuple[int, ...]]]
    """Checkpoint tensors stored in one piece: name -> (dtype, shape)."""
    sliced: dict[str, tuple[str, tuple[int, ...]]]
    """Checkpoint tensors stored as row slices: name -> (dtype, whole shape)."""
    imbalance: float


def _rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


_PLANS: dict[tuple[object, ...], SpreadPlan] = {}
_PLANS_KEPT = 4


def plan_spread(descs: Sequence[RankDesc], num_dirs: int, max_shard_bytes: int) -> SpreadPlan:
    """Who writes what where; the same on every rank. Raises `StateMismatchError` when
    the ranks disagree on the shared tensors.

    Plans are cached while the state's structure (every rank's tensors: names, dtypes,
    shapes) and the directories stay the same, as between the saves of a training run.
    """
    key = (tuple((d.rank, d.local_rank, d.tensors) for d in descs), num_dirs, max_shard_bytes)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan_spread(descs, num_dirs, max_shard_bytes)
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return plan


def _plan_spread(descs: Sequence[RankDesc], num_dirs: int, max_shard_bytes: int) -> SpreadPlan:
    ranks = sorted(descs, key=lambda d: d.rank)
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
    entries: list[Entry] = []
    # entry name -> (owner rank or None, desc); shards and local tensors are per rank.
    owner_of: dict[str, tuple[int | None, TensorDesc]] = {}
    shards: dict[str, list[tuple[int, TensorDesc]]] = {}
    for d in ranks:
        for t in d.tensors:
            rows = _rows(t.shape)
            if t.kind == "replicated":
                if d.rank != ranks[0].rank:
                    continue
                key, owner = t.name, None
            elif t.kind == "local":
                key, owner = t.name, d.rank
            else:
                shards.setdefault(t.name, []).append((d.rank, t))
                if rows == 0:
                    continue  # an empty shard (uneven chunks): nothing of it to write
                key, owner = f"{t.name}\0{d.rank}", d.rank
            owner_of[key] = (owner, t)
            entries.append(Entry(key, t.nbytes, max(rows, 1) if t.nbytes else 1, owner))
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
    writers = writers_for([d.local_rank for d in ranks], num_dirs)
    plan = partition(entries, writers)
    whole: dict[str, tuple[str, tuple[int, ...]]] = {}
    sliced: dict[str, tuple[str, tuple[int, ...]]] = {}
    files: list[FilePlan] = []
    for writer, pieces in zip(plan.writers, plan.pieces, strict=True):
        parts: list[tuple[int, PartPlan, tuple[str, Any, tuple[int, ...]]]] = []
        for p in pieces:
            part, shape = _part(p, owner_of[p.name][1])
            if part.target_rows is None:
                whole[part.target] = (owner_of[p.name][1].dtype, shape)
            else:
                t = owner_of[p.name][1]
                sliced[part.target] = (t.dtype, t.whole_shape if t.kind == "shard" else t.shape)
            parts.append(
                (owner_of[p.name][1].align, part, (part.header, _dtype(owner_of[p.name][1].dtype), shape))
            )
        # Largest alignment first (stable), as in single-file plans: loads can place every
        # tensor for direct reads.
        parts.sort(key=lambda x: -x[0])
        groups: list[list[tuple[int, PartPlan, tuple[str, Any, tuple[int, ...]]]]] = [[]]
        size = 0
        for item in parts:
            nbytes = _nbytes(item[2])
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += nbytes
        for i, group in enumerate(groups):
            if not group:
                continue  # a writer with nothing to write writes no file
            suffix = f"-{i + 1:05d}" if len(groups) > 1 else ""
            files.append(
                FilePlan(
                    f"state-rank{writer.rank:05d}-dir{writer.directory:02d}{suffix}.safetensors",
                    writer.rank,
                    writer.directory,
                    tuple(x[1] for x in group),
                    tuple(x[2] for x in group),
                )
            )
    return SpreadPlan(tuple(files), whole, sliced, plan.imbalance)


def _nbytes(spec: tuple[str, Any, tuple[int, ...]]) -> int:
    return math.prod(spec[2]) * int(spec[1].itemsize)


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


# -- the save ---------------------------------------------------------------------------------


def _primary_tmp(final: str, token: str) -> str:
    return os.path.join(os.path.dirname(final), f".{os.path.basename(final)}{TMP_MARKER}{token}")


def _make_primary(final: str, token: str, overwrite: bool) -> str:
    if os.path.lexists(final) and not overwrite:
        raise CheckpointExistsError(f"{final} already exists (pass overwrite=True to replace it)")
    make_directories(os.path.dirname(final))
    tmp = _primary_tmp(final, token)
    try:
        os.mkdir(tmp)
    except OSError as exc:
        raise from_os_error(exc, "mkdir", tmp) from exc
    return tmp


def _old_parts(final: str, paths: Sequence[str]) -> list[str]:
    """The parts of the checkpoint at ``final`` in the directories of this save (to go with
    it when it is replaced): found by its token, never where its manifest points."""
    return own_parts(paths, token_at(final))


async def save_spread(
    be: IOBackend,
    pool: StagingPool,
    flat: Flattened | Exception,
    paths: Sequence[str],
    coord: Coordinator | None,
    *,
    replicated: Replicated,
    metadata: Mapping[str, str] | None,
    overwrite: bool,
    max_shard_bytes: int,
    staged: Callable[[], None] | None = None,
    discard: Callable[[str], None] | None = None,
) -> SaveInfo:
    """Save this rank's ``flat`` as its share of a checkpoint spread over ``paths`` (the
    first is the checkpoint) and the ranks of ``coord``; see the module docstring. An
    exception for ``flat`` (flattening failed here) fails the save on every rank."""
    start = time.perf_counter()
    rank = coord.rank if coord is not None else 0
    world = coord.world_size if coord is not None else 1
    final = paths[0]
    token = uuid.uuid4().hex[:12]
    committed = False

    async def exchange(value: Any, error: BaseException | None = None) -> list[Any]:
        if coord is None:
            if error is not None:
                raise error
            return [value]
        return await coord.exchange(value, error)

    # 1. describe, and (rank 0) claim the temporary directory.
    desc: RankDesc | None = None
    error: BaseException | None = None
    try:
        if isinstance(flat, Exception):
            raise flat
        if flat.pickled:
            raise UnsupportedStateError(
                "pickled objects cannot be saved across several ranks or directories; "
                "save them separately or store them as tensors"
            )
        tensors = describe(flat, rank, world, replicated)
        local_rank = coord.local_rank if coord is not None else 0
        if rank == 0:
            # To its end: a cancellation while the thread makes it would leave it behind.
            await to_thread_to_the_end(_make_primary, final, token, overwrite, discard=remove_empty_directory)
        desc = RankDesc(rank, local_rank, tensors, rank_state(flat, tensors), token)
    except Exception as exc:
        error = exc
    try:
        descs: list[RankDesc] = await exchange(desc, error)
        token = descs[0].token
        # 2. plan: pure and the same everywhere, so it fails everywhere alike.
        plan = plan_spread(descs, len(paths), max_shard_bytes)
        mine = [f for f in plan.files if f.rank == rank]
        assert isinstance(flat, Flattened)
        records, written = await _write_mine(be, pool, flat, mine, paths, token, exchange, staged)
        # 4. commit, on rank 0.
        all_records: list[list[tuple[FilePlan, FileRecord, list[str]]]] = records
        commit_error: BaseException | None = None
        old_parts: list[str] = []
        if rank == 0:
            try:
                old_parts = await asyncio.to_thread(_old_parts, final, paths) if overwrite else []
                await _commit(
                    be, pool, descs, plan, all_records, paths, token, final, metadata, overwrite, discard
                )
                committed = True
            except Exception as exc:
                commit_error = exc
        await exchange(None, commit_error)
    except BaseException:
        # Once the primary is renamed into place the checkpoint is complete: its parts stay,
        # even if a rank then fails to hear about it.
        if rank == 0 and not committed:
            await to_thread_to_the_end(_abort, final, token, paths)
        raise
    if rank == 0 and old_parts:
        # The replaced checkpoint's parts go after it (its primary went at the rename).
        if discard is None:
            await asyncio.to_thread(_remove_all, old_parts)
        else:
            for old in old_parts:
                discard(old)
    names = tuple(rec.name for _, rec, _ in all_records[rank]) if all_records else ()
    return SaveInfo(
        final,
        written,
        names,
        time.perf_counter() - start,
        be.name,
        sum(t.nbytes for t in descs[rank].tensors),
    )


async def _write_mine(
    be: IOBackend,
    pool: StagingPool,
    flat: Flattened,
    mine: Sequence[FilePlan],
    paths: Sequence[str],
    token: str,
    exchange: Callable[..., Any],
    staged: Callable[[], None] | None,
) -> tuple[list[list[tuple[FilePlan, FileRecord, list[str]]]], int]:
    """3. Write this rank's files; every rank's records, by rank, and this rank's bytes."""
    sources = {s.name: s.source for s in flat.stored}
    one_written = countdown(len(mine), staged)
    out: list[tuple[FilePlan, FileRecord, list[str]]] = []
    error: BaseException | None = None
    try:
        dirs: dict[int, str] = {}
        for f in mine:
            if f.directory not in dirs:
                d = _primary_tmp(paths[0], token) if f.directory == 0 else part_dir(paths[f.directory], token)
                await to_thread_to_the_end(make_directories, d)  # the abort must come after
                dirs[f.directory] = d
        probes = {i: await to_thread_to_the_end(probe_directory, d) for i, d in dirs.items()}

        def data(part: PartPlan) -> torch.Tensor:
            src = sources[part.source]
            return src if part.rows is None else src[part.rows[0] : part.rows[1]]

        async def one(f: FilePlan) -> tuple[FilePlan, FileRecord, list[str]]:
            layout = layout_file(list(f.dtypes), {"format": "pt"})
            path = os.path.join(dirs[f.directory], f.name)
            # Every part gets a checksum of its own, so that a load can read and check
            # just the rows it needs.
            hasher = PartHasher(new_hasher(), [e.end - e.begin for e in layout.entries], new_hasher)
            head = _HeadSkip(hasher, layout.data_offset)
            rec = await write_file(
                be,
                path,
                probes[f.directory],
                pool,
                [layout.header, *(data(p) for p in f.parts)],
                one_written,
                hasher=head,
            )
            record = FileRecord(f.name, rec.nbytes, rec.checksum, layout.data_offset, f.directory)
            return f, record, hasher.part_digests()

        out = await run_all(one(f) for f in mine)
    except Exception as exc:
        error = exc
    gathered = await exchange(out, error)
    return gathered, sum(rec.nbytes for _, rec, _ in out)


async def _commit(
    be: IOBackend,
    pool: StagingPool,
    descs: Sequence[RankDesc],
    plan: SpreadPlan,
    records: Sequence[Sequence[tuple[FilePlan, FileRecord, list[str]]]],
    paths: Sequence[str],
    token: str,
    final: str,
    metadata: Mapping[str, str] | None,
    overwrite: bool,
    discard: Callable[[str], None] | None,
) -> None:
    tmp = _primary_tmp(final, token)
    parts = own_parts(paths, token)
    files: dict[str, FileRecord] = {}
    whole: dict[str, TensorRecord] = {}
    slices: dict[str, list[SliceRecord]] = {}
    for per_rank in records:
        for fp, rec, digests in per_rank:
            files[fp.name] = rec
            layout = layout_file(list(fp.dtypes), {"format": "pt"})
            for part, entry, digest in zip(fp.parts, layout.entries, digests, strict=True):
                base = rec.data_offset or 0
                begin, end = base + entry.begin, base + entry.end
                if part.target_rows is None:
                    whole[part.target] = TensorRecord(
                        part.target, fp.name, begin, end, entry.dtype, entry.shape, digest
                    )
                else:
                    slices.setdefault(part.target, []).append(
                        SliceRecord(fp.name, begin, end, part.target_rows[0], part.target_rows[1], digest)
                    )
    sliced = {
        name: SlicedRecord(
            name,
            _dtype(plan.sliced[name][0]),
            plan.sliced[name][1],
            tuple(sorted(s, key=lambda x: x.row_start)),
        )
        for name, s in slices.items()
    }
    state0 = descs[0].state
    ranks = {d.rank: d.state for d in descs[1:] if d.state != state0}
    directories = _relative(final, parts)
    spread = len(descs) > 1 or len(paths) > 1 or bool(sliced)
    manifest = Manifest(
        files=files,
        tensors=whole,
        skeleton=state0.skeleton,
        aliases=state0.aliases,
        views=state0.views,
        metadata=dict(metadata or {}),
        layout="state",
        world_size=len(descs),
        version=2 if spread else 1,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        sliced=sliced,
        directories=directories,
        ranks=ranks,
    )
    dio = await to_thread_to_the_end(probe_directory, tmp)
    await write_file(be, os.path.join(tmp, MANIFEST_NAME), dio, pool, [dump_manifest(manifest)])

    def durable_and_published() -> None:
        for part in parts:
            if os.path.isdir(part):
                # Its files' entries; the part itself and the directories above it were
                # made durable when they were created (make_directories).
                fsync_directory(part)
        publish(tmp, final, overwrite, discard or remove_path)

    await to_thread_to_the_end(durable_and_published)


def _abort(final: str, token: str, paths: Sequence[str]) -> None:
    """Remove what a failed save wrote, unless its rename already published it (a failure
    after the rename, e.g. of the parent's fsync, leaves a visible checkpoint whose parts
    must stay)."""
    parts = own_parts(paths, token)
    published = token_at(final) == token
    _remove_all([_primary_tmp(final, token)] + ([] if published else parts))


def _relative(final: str, parts: Sequence[str]) -> tuple[str, ...]:
    return (".", *(os.path.relpath(p, final) for p in parts))


class _HeadSkip:
    """Feeds the whole file to the file's checksum, and the bytes after the header to the
    per-part hasher."""

    def __init__(self, parts: PartHasher, header: int) -> None:
        self._parts = parts
        self._skip = header

    def update(self, data: Any, /) -> None:
        self._parts.whole.update(data)
        with memoryview(data) as raw, raw.cast("B") as view:
            skip = min(self._skip, len(view))
            self._skip -= skip
            if skip < len(view):
                self._parts.update_parts(view[skip:])

    def hexdigest(self) -> str:
        return self._parts.hexdigest()


def _remove_all(paths: Sequence[str]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            remove_path(p)
        parent = os.path.dirname(p)
        if os.path.basename(p).startswith(PART_PREFIX):
            with contextlib.suppress(OSError):
                os.rmdir(parent)  # the disk's directory for this checkpoint, if now empty
