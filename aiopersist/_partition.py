"""The partitioner (pure: no I/O): which writer writes which bytes of a checkpoint.

A *writer* is a ``(rank, directory)`` pair: one process writing into one of the
directories (typically one per SSD). `writers_for` hands out the directories of a node
among its ranks: with at least as many directories as ranks per node, a rank takes every
directory ``d`` with ``d % ranks_per_node == local_rank``; with fewer, ranks share, rank
``r`` taking directory ``local_rank % num_dirs``.

`partition` then spreads the stored tensors (*entries*) over the writers. An entry is
either *replicated* (identical on every rank, so any writer may write it, exactly once)
or *owned* by one rank (only that rank holds it, so one of that rank's writers must
write it). The algorithm, with ``fair = total bytes / number of writers``:

1. **Split.** An entry too big to place whole without unbalancing the writers (more than
   ``fair / 2`` bytes, and at least ``2 * min_piece_bytes``) and with at least two rows is
   cut along dim 0 into ``k = min(rows, ceil(nbytes / target))`` row slices, with
   ``target = max(fair / 4, min_piece_bytes)``; rows are spread as evenly as possible, the
   first slices taking the extra rows. An owned entry is split only if its owner has more
   than one writer: a slice can only go to the owner's writers anyway. Everything else
   stays one whole piece (zero-byte entries too, so every name is written), and so does
   everything when there is one writer: it gains nothing from slices.
2. **Assign**, longest processing time first: the owned pieces, largest first (ties by
   name, then first row), each to the least-loaded writer of its owner; then the
   replicated pieces in the same order, each to the least-loaded writer of all, so they
   fill the gaps the owned ones left. Ties go to the lowest writer index.

Greedy placement leaves the fullest writer at most one piece above the mean (when all
is replicated), so with slices of at most about ``fair / 4`` and many entries it ends
within a few percent of it. Owned bytes cannot move, though: a rank that owns more than
its writers' fair share stays above it whatever the replicated entries do.

Sizes are compared in exact integer arithmetic, and the order of the entries does not
matter (they are sorted first), so every rank that computes the plan from the same
entries and the same writers (in the same order: a writer's index breaks ties) gets the
same plan.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    name: str
    """Unique name of the stored tensor."""
    nbytes: int
    """Total bytes (``>= 0``)."""
    rows: int
    """Size of dim 0: the unit of splitting; ``1`` for 0-d tensors and anything that must
    not be split. ``nbytes`` is a multiple of ``rows`` when ``rows > 0``."""
    owner: int | None = None
    """``None``: replicated (identical on every rank; written once, by any writer). An int:
    only that rank holds it, and one of its writers must write it."""


@dataclass(frozen=True)
class Writer:
    rank: int
    directory: int
    """Index into the list of directories."""


@dataclass(frozen=True)
class Piece:
    name: str
    """The entry this piece belongs to."""
    row_start: int
    row_end: int
    """Rows ``[row_start, row_end)`` of the entry."""
    nbytes: int
    whole: bool
    """True when the piece is the entire entry (the entry was not split)."""


@dataclass(frozen=True)
class Plan:
    writers: tuple[Writer, ...]
    pieces: tuple[tuple[Piece, ...], ...]
    """``pieces[i]``: what ``writers[i]`` writes, sorted by name, then first row."""

    def for_rank(self, rank: int) -> list[tuple[Writer, tuple[Piece, ...]]]:
        """The writers of ``rank``, in plan order, each with its pieces."""
        return [(w, p) for w, p in zip(self.writers, self.pieces, strict=True) if w.rank == rank]

    @property
    def writer_bytes(self) -> tuple[int, ...]:
        """Bytes per writer, in plan order."""
        return tuple(sum(p.nbytes for p in ps) for ps in self.pieces)

    @property
    def imbalance(self) -> float:
        """``max(writer_bytes) / mean(writer_bytes)``: 1.0 is perfect; 1.0 too when there
        is nothing to write."""
        loads = self.writer_bytes
        total = sum(loads)
        if total == 0:
            return 1.0
        return max(loads) * len(loads) / total


def writers_for(local_ranks: Sequence[int], num_dirs: int) -> tuple[Writer, ...]:
    """The writers of every rank, ordered by ``(rank, directory)``.

    ``local_ranks[r]`` is rank ``r``'s rank on its node (torchrun's ``LOCAL_RANK``); nodes
    are assumed alike, with ``max(local_ranks) + 1`` ranks each, and each has directories
    ``0 .. num_dirs - 1``. Every rank gets at least one writer.
    """
    if num_dirs < 1:
        raise ValueError(f"num_dirs must be at least 1, got {num_dirs}")
    if len(local_ranks) == 0:
        raise ValueError("local_ranks is empty: there must be at least one rank")
    for rank, local in enumerate(local_ranks):
        if local < 0:
            raise ValueError(f"local_ranks[{rank}] is negative: {local}")
    per_node = max(local_ranks) + 1
    writers: list[Writer] = []
    for rank, local in enumerate(local_ranks):
        if num_dirs >= per_node:
            writers.extend(Writer(rank, d) for d in range(local, num_dirs, per_node))
        else:
            writers.append(Writer(rank, local % num_dirs))
    return tuple(writers)


def partition(entries: Sequence[Entry], writers: Sequence[Writer], *, min_piece_bytes: int = 1 << 20) -> Plan:
    """Which writer writes which rows of which entry (see the module docstring).

    ``writers[i]`` keeps index ``i`` in the plan. ``ValueError`` on an invalid entry (named
    in the message), on no writers or a writer given twice, or on ``min_piece_bytes < 1``.
    """
    if min_piece_bytes < 1:
        raise ValueError(f"min_piece_bytes must be at least 1, got {min_piece_bytes}")
    if len(writers) == 0:
        raise ValueError("no writers")
    of_rank: dict[int, list[int]] = {}
    seen: set[Writer] = set()
    for i, w in enumerate(writers):
        if w in seen:
            raise ValueError(f"writer (rank {w.rank}, directory {w.directory}) is given twice")
        seen.add(w)
        of_rank.setdefault(w.rank, []).append(i)

    ordered = sorted(entries, key=lambda e: e.name)
    for prev, e in zip([None, *ordered], ordered, strict=False):
        _check(e, of_rank)
        if prev is not None and prev.name == e.name:
            raise ValueError(f"entry {e.name!r} is given twice")

    count = len(writers)
    total = sum(e.nbytes for e in ordered)
    owned: list[tuple[int, Piece]] = []
    replicated: list[Piece] = []
    for e in ordered:
        if e.owner is None:
            replicated.extend(_cut(e, _slices(e, total, count, min_piece_bytes)))
        else:
            k = _slices(e, total, count, min_piece_bytes) if len(of_rank[e.owner]) > 1 else 1
            owned.extend((e.owner, p) for p in _cut(e, k))

    assigned: list[list[Piece]] = [[] for _ in writers]
    loads = [0] * count
    # One heap of (load, writer index) per owner, one for all: the least-loaded writer,
    # ties to the lowest index, in O(log writers).
    heaps = {rank: [(0, i) for i in idx] for rank, idx in of_rank.items()}
    for owner, piece in sorted(owned, key=lambda op: _lpt_order(op[1])):
        heap = heaps[owner]
        _, i = heapq.heappop(heap)
        loads[i] += piece.nbytes
        heapq.heappush(heap, (loads[i], i))
        assigned[i].append(piece)
    everyone = [(load, i) for i, load in enumerate(loads)]
    heapq.heapify(everyone)
    for piece in sorted(replicated, key=_lpt_order):
        _, i = heapq.heappop(everyone)
        loads[i] += piece.nbytes
        heapq.heappush(everyone, (loads[i], i))
        assigned[i].append(piece)

    return Plan(
        writers=tuple(writers),
        pieces=tuple(tuple(sorted(ps, key=lambda p: (p.name, p.row_start))) for ps in assigned),
    )


def _check(e: Entry, of_rank: dict[int, list[int]]) -> None:
    if e.nbytes < 0:
        raise ValueError(f"entry {e.name!r} has a negative size: {e.nbytes} bytes")
    if e.rows < 0:
        raise ValueError(f"entry {e.name!r} has a negative number of rows: {e.rows}")
    if e.rows == 0 and e.nbytes > 0:
        raise ValueError(f"entry {e.name!r} has {e.nbytes} bytes but no rows")
    if e.rows > 0 and e.nbytes % e.rows != 0:
        raise ValueError(f"entry {e.name!r}: {e.nbytes} bytes do not divide into {e.rows} rows")
    if e.owner is not None and e.owner not in of_rank:
        raise ValueError(f"entry {e.name!r} is owned by rank {e.owner}, which has no writer")


def _slices(e: Entry, total: int, count: int, min_piece_bytes: int) -> int:
    """How many row slices ``e`` is cut into (1: not split), for ``fair = total / count``."""
    if count == 1 or e.rows < 2 or e.nbytes < 2 * min_piece_bytes or 2 * count * e.nbytes <= total:
        return 1
    if total >= 4 * count * min_piece_bytes:  # target = fair / 4
        wanted = -(-4 * count * e.nbytes // total)
    else:  # target = min_piece_bytes
        wanted = -(-e.nbytes // min_piece_bytes)
    return min(e.rows, wanted)


def _cut(e: Entry, k: int) -> list[Piece]:
    """``e`` as ``k`` row slices, as even as rows allow, the first ones a row longer."""
    if k <= 1:
        return [Piece(e.name, 0, e.rows, e.nbytes, whole=True)]
    row_bytes = e.nbytes // e.rows
    base, extra = divmod(e.rows, k)
    pieces = []
    start = 0
    for j in range(k):
        end = start + base + (1 if j < extra else 0)
        pieces.append(Piece(e.name, start, end, (end - start) * row_bytes, whole=False))
        start = end
    return pieces


def _lpt_order(p: Piece) -> tuple[int, str, int]:
    return (-p.nbytes, p.name, p.row_start)
