"""The partitioner: which writer writes which rows of which entry (pure, no I/O)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiopersist._partition import Entry, Piece, Plan, Writer, partition, writers_for

# -- strategies -------------------------------------------------------------------------------


@st.composite
def writer_sets(draw: st.DrawFn) -> tuple[Writer, ...]:
    """Writers as `writers_for` makes them, or any distinct (rank, directory) pairs in any order."""
    if draw(st.booleans()):
        local_ranks = draw(st.lists(st.integers(0, 3), min_size=1, max_size=6))
        return writers_for(local_ranks, draw(st.integers(1, 5)))
    pairs = draw(
        st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), min_size=1, max_size=8, unique=True)
    )
    return tuple(Writer(r, d) for r, d in pairs)


@st.composite
def entry_lists(draw: st.DrawFn, ranks: Sequence[int]) -> list[Entry]:
    """Entries with unique names, owned by one of ``ranks`` or replicated."""
    names = draw(st.lists(st.text("abcxyz._", min_size=1, max_size=6), max_size=25, unique=True))
    entries = []
    for name in names:
        rows = draw(st.integers(0, 40))
        row_bytes = 0 if rows == 0 else draw(st.sampled_from([0, 1, 2, 4, 96, 1000, 4096, 50_000]))
        owner = draw(st.one_of(st.none(), st.sampled_from(sorted(set(ranks)))))
        entries.append(Entry(name, rows * row_bytes, rows, owner))
    return entries


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[Entry], tuple[Writer, ...], int]:
    writers = draw(writer_sets())
    entries = draw(entry_lists([w.rank for w in writers]))
    min_piece_bytes = draw(st.sampled_from([1, 64, 4096, 100_000, 1 << 20]))
    return entries, writers, min_piece_bytes


def _expected_slices(e: Entry, entries: Sequence[Entry], writers: Sequence[Writer], min_piece: int) -> int:
    """The splitting rule, restated with exact fractions."""
    if len(writers) == 1:
        return 1  # slices gain one writer nothing
    if e.owner is not None and sum(w.rank == e.owner for w in writers) < 2:
        return 1
    fair = Fraction(sum(x.nbytes for x in entries), len(writers))
    if e.rows < 2 or not (e.nbytes > fair / 2 and e.nbytes >= 2 * min_piece):
        return 1
    return min(e.rows, math.ceil(e.nbytes / max(fair / 4, Fraction(min_piece))))


def _by_name(plan: Plan) -> dict[str, list[tuple[int, Piece]]]:
    out: dict[str, list[tuple[int, Piece]]] = defaultdict(list)
    for i, pieces in enumerate(plan.pieces):
        for p in pieces:
            out[p.name].append((i, p))
    return out


# -- partition: properties --------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(problem=problems())
def test_every_row_is_written_exactly_once_by_an_allowed_writer(
    problem: tuple[list[Entry], tuple[Writer, ...], int],
) -> None:
    entries, writers, min_piece = problem
    plan = partition(entries, writers, min_piece_bytes=min_piece)

    assert plan.writers == writers
    assert len(plan.pieces) == len(writers)
    for pieces in plan.pieces:
        assert list(pieces) == sorted(pieces, key=lambda p: (p.name, p.row_start))
    assert sum(plan.writer_bytes) == sum(e.nbytes for e in entries)

    placed = _by_name(plan)
    assert set(placed) == {e.name for e in entries}
    for e in entries:
        slices = sorted(placed[e.name], key=lambda ip: ip[1].row_start)
        assert len(slices) == _expected_slices(e, entries, writers, min_piece)
        row = 0
        for i, p in slices:
            assert p.row_start == row
            assert p.row_end > p.row_start or e.rows == 0
            assert p.nbytes == (p.row_end - p.row_start) * (e.nbytes // e.rows if e.rows else 0)
            assert p.whole == (len(slices) == 1)
            if e.owner is not None:
                assert writers[i].rank == e.owner
            row = p.row_end
        assert row == e.rows
        assert sum(p.nbytes for _, p in slices) == e.nbytes
        lengths = [p.row_end - p.row_start for _, p in slices]
        assert lengths == sorted(lengths, reverse=True)
        assert max(lengths) - min(lengths) <= 1


@settings(max_examples=60, deadline=None)
@given(problem=problems(), data=st.data())
def test_the_plan_does_not_depend_on_the_order_of_the_entries(
    problem: tuple[list[Entry], tuple[Writer, ...], int], data: st.DataObject
) -> None:
    entries, writers, min_piece = problem
    shuffled = data.draw(st.permutations(entries))
    assert partition(shuffled, writers, min_piece_bytes=min_piece) == partition(
        entries, writers, min_piece_bytes=min_piece
    )


@settings(max_examples=60, deadline=None)
@given(problem=problems())
def test_replicated_loads_stay_within_one_piece_of_the_mean(
    problem: tuple[list[Entry], tuple[Writer, ...], int],
) -> None:
    # Greedy least-loaded placement: the fullest writer got its last piece while it was the
    # emptiest, so it exceeds the mean by at most that piece.
    entries, writers, min_piece = problem
    entries = [Entry(e.name, e.nbytes, e.rows) for e in entries]
    plan = partition(entries, writers, min_piece_bytes=min_piece)
    loads = plan.writer_bytes
    biggest = max((p.nbytes for ps in plan.pieces for p in ps), default=0)
    assert max(loads) * len(loads) <= sum(loads) + biggest * len(loads)


@settings(max_examples=50, deadline=None)
@given(problem=problems())
def test_for_rank_gives_each_rank_its_writers(problem: tuple[list[Entry], tuple[Writer, ...], int]) -> None:
    entries, writers, min_piece = problem
    plan = partition(entries, writers, min_piece_bytes=min_piece)
    ranks = sorted({w.rank for w in writers})
    seen = []
    for rank in ranks:
        mine = plan.for_rank(rank)
        assert mine
        assert all(w.rank == rank for w, _ in mine)
        seen.extend(mine)
    assert sorted(seen, key=lambda wp: plan.writers.index(wp[0])) == list(
        zip(plan.writers, plan.pieces, strict=True)
    )
    assert plan.for_rank(max(ranks) + 1) == []


# -- partition: examples ----------------------------------------------------------------------


def test_largest_first_to_the_least_loaded_writer_ties_to_the_lowest_index() -> None:
    entries = [Entry("d", 100, 1), Entry("c", 100, 1), Entry("b", 200, 1), Entry("a", 300, 1)]
    plan = partition(entries, writers_for([0, 1], 1))
    # a -> 0 (300, 0); b -> 1 (300, 200); c -> 1 (300, 300); d -> 0 on the tie
    assert plan == Plan(
        writers=(Writer(0, 0), Writer(1, 0)),
        pieces=(
            (Piece("a", 0, 1, 300, whole=True), Piece("d", 0, 1, 100, whole=True)),
            (Piece("b", 0, 1, 200, whole=True), Piece("c", 0, 1, 100, whole=True)),
        ),
    )
    assert plan.writer_bytes == (400, 300)
    assert plan.imbalance == pytest.approx(400 / 350)


def test_owned_pieces_go_first_largest_first_then_replicated_fill_in() -> None:
    writers = writers_for([0, 1], 4)
    assert writers == (Writer(0, 0), Writer(0, 2), Writer(1, 1), Writer(1, 3))
    entries = [
        Entry("a", 100, 1, owner=0),
        Entry("b", 100, 1, owner=0),
        Entry("c", 200, 1, owner=0),
        Entry("r1", 300, 1),
        Entry("r2", 100, 1),
    ]
    plan = partition(entries, writers)
    # owned: c -> (0, 0); a, b -> (0, 2). replicated: r1 -> (1, 1), the lowest of the empty
    # writers; r2 -> (1, 3)
    assert [[p.name for p in ps] for ps in plan.pieces] == [["c"], ["a", "b"], ["r1"], ["r2"]]
    assert plan.writer_bytes == (200, 200, 300, 100)
    assert [w for w, _ in plan.for_rank(1)] == [Writer(1, 1), Writer(1, 3)]


def test_a_single_huge_replicated_tensor_is_sliced_and_balanced_over_two_writers() -> None:
    huge = Entry("embed", 4096 * 8192 * 2, 4096)  # 64 MiB
    plan = partition([huge], writers_for([0, 1], 1))
    # fair = 32 MiB, target = 8 MiB: eight slices of 512 rows, four per writer
    assert [len(ps) for ps in plan.pieces] == [4, 4]
    assert plan.writer_bytes == (huge.nbytes // 2, huge.nbytes // 2)
    assert plan.imbalance == 1.0
    assert all(not p.whole and p.row_end - p.row_start == 512 for ps in plan.pieces for p in ps)


def test_uneven_rows_give_the_extra_rows_to_the_first_slices() -> None:
    plan = partition([Entry("w", 10 * 3, 10)], writers_for([0, 1], 1), min_piece_bytes=8)
    # fair = 15, target = max(15 / 4, 8) = 8: ceil(30 / 8) = 4 slices of 3, 3, 2, 2 rows
    pieces = sorted((p for ps in plan.pieces for p in ps), key=lambda p: p.row_start)
    assert [(p.row_start, p.row_end, p.nbytes) for p in pieces] == [
        (0, 3, 9),
        (3, 6, 9),
        (6, 8, 6),
        (8, 10, 6),
    ]
    assert plan.writer_bytes == (15, 15)


def test_one_process_with_two_directories_spreads_its_bytes_over_both() -> None:
    writers = writers_for([0], 2)
    assert writers == (Writer(0, 0), Writer(0, 1))
    entries = [
        Entry("model.weight", 8 << 20, 1024),
        Entry("model.bias", 8 << 10, 1024),
        Entry("optim.step", 8, 1, owner=0),
        Entry("optim.exp_avg", 8 << 20, 1024, owner=0),  # owned, but its owner has two writers
    ]
    plan = partition(entries, writers)
    assert all(b > 0 for b in plan.writer_bytes)
    assert plan.imbalance < 1.01
    assert {w.directory for w, ps in plan.for_rank(0) if any(p.name == "optim.exp_avg" for p in ps)} == {0, 1}


def test_rows_of_one_are_never_split() -> None:
    entries = [Entry("blob", 1 << 30, 1), Entry("scalar", 4, 1), Entry("small", 1 << 20, 256)]
    plan = partition(entries, writers_for([0, 1, 2, 3], 4), min_piece_bytes=1)
    blob = [p for ps in plan.pieces for p in ps if p.name == "blob"]
    assert blob == [Piece("blob", 0, 1, 1 << 30, whole=True)]


def test_an_owned_entry_whose_owner_has_one_writer_stays_whole_on_it() -> None:
    writers = writers_for([0, 1], 1)
    entries = [Entry("shard", 64 << 20, 4096, owner=1), Entry("other", 1 << 20, 16)]
    plan = partition(entries, writers)
    assert plan.pieces[1] == (Piece("shard", 0, 4096, 64 << 20, whole=True),)
    assert plan.pieces[0] == (Piece("other", 0, 16, 1 << 20, whole=True),)
    assert plan.imbalance == pytest.approx(2 * 64 / 65)  # owned bytes cannot move


def test_empty_and_zero_byte_entries_are_still_placed() -> None:
    entries = [Entry("empty", 0, 0), Entry("zero_rows", 0, 7), Entry("none", 0, 1, owner=1)]
    plan = partition(entries, writers_for([0, 1], 4))
    assert sorted(p.name for ps in plan.pieces for p in ps) == ["empty", "none", "zero_rows"]
    assert plan.writer_bytes == (0, 0, 0, 0)
    assert plan.imbalance == 1.0
    assert partition([], writers_for([0], 1)) == Plan(writers=(Writer(0, 0),), pieces=((),))


# -- partition: balance on transformer-shaped states ------------------------------------------


def _gpt(
    vocab: int, hidden: int, layers: int, *, prefix: str = "", itemsize: int = 2
) -> list[tuple[str, int, int]]:
    """(name, nbytes, rows) of a GPT-like model's tensors."""
    h = hidden
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("wte", (vocab, h)),
        ("wpe", (2048, h)),
        ("ln_f.weight", (h,)),
        ("ln_f.bias", (h,)),
    ]
    for i in range(layers):
        shapes += [
            (f"h.{i}.ln_1.weight", (h,)),
            (f"h.{i}.ln_1.bias", (h,)),
            (f"h.{i}.attn.qkv.weight", (3 * h, h)),
            (f"h.{i}.attn.qkv.bias", (3 * h,)),
            (f"h.{i}.attn.proj.weight", (h, h)),
            (f"h.{i}.attn.proj.bias", (h,)),
            (f"h.{i}.ln_2.weight", (h,)),
            (f"h.{i}.ln_2.bias", (h,)),
            (f"h.{i}.mlp.up.weight", (4 * h, h)),
            (f"h.{i}.mlp.up.bias", (4 * h,)),
            (f"h.{i}.mlp.down.weight", (h, 4 * h)),
            (f"h.{i}.mlp.down.bias", (h,)),
        ]
    return [(prefix + name, math.prod(shape) * itemsize, shape[0]) for name, shape in shapes]


MODELS = [
    pytest.param((50257, 768, 12), id="gpt2-small"),
    pytest.param((32000, 1024, 24), id="h1024-l24"),
    pytest.param((50304, 2048, 24), id="h2048-l24"),
    pytest.param((32000, 4096, 32), id="h4096-l32"),
]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("num_writers", [2, 4, 8])
def test_replicated_transformer_is_balanced(model: tuple[int, int, int], num_writers: int) -> None:
    entries = [Entry(n, b, r) for n, b, r in _gpt(*model)]
    assert len(entries) >= 8 * num_writers
    for writers in (writers_for(range(num_writers), 1), writers_for([0], num_writers)):
        plan = partition(entries, writers)
        assert plan.imbalance <= 1.05, (model, num_writers, plan.imbalance)


def _layer_owner(name: str, ranks: int) -> int:
    """The owner of an optimizer-state tensor: ranks own whole layers, rank 0 the rest."""
    parts = name.split(".")
    return int(parts[2]) % ranks if parts[1] == "h" else 0


@pytest.mark.parametrize("model", MODELS[1:])  # gpt2-small: its embedding alone exceeds a fair share
@pytest.mark.parametrize(
    ("ranks", "dirs_per_rank"), [(1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (1, 8), (2, 4), (4, 2), (8, 1)]
)
def test_half_owned_transformer_is_balanced(
    model: tuple[int, int, int], ranks: int, dirs_per_rank: int
) -> None:
    # The weights are replicated; the same-shaped optimizer state is owned, layer by layer.
    replicated = [Entry(n, b, r) for n, b, r in _gpt(*model)]
    owned = [Entry(n, b, r, owner=_layer_owner(n, ranks)) for n, b, r in _gpt(*model, prefix="exp_avg.")]
    writers = writers_for(range(ranks), ranks * dirs_per_rank)
    assert len(writers) == ranks * dirs_per_rank
    assert len(replicated) + len(owned) >= 8 * len(writers)
    plan = partition(replicated + owned, writers)
    assert plan.imbalance <= 1.05, (model, ranks, dirs_per_rank, plan.imbalance)


# -- partition: errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (Entry("neg.bytes", -4, 1), "negative size"),
        (Entry("neg.rows", 0, -1), "negative number of rows"),
        (Entry("no.rows", 8, 0), "no rows"),
        (Entry("ragged", 10, 3), "do not divide"),
        (Entry("orphan", 8, 1, owner=5), "rank 5, which has no writer"),
        (Entry("negative.owner", 8, 1, owner=-1), "rank -1, which has no writer"),
    ],
)
def test_invalid_entries_are_named(entry: Entry, message: str) -> None:
    with pytest.raises(ValueError, match=rf"{entry.name!r}.*{message}"):
        partition([Entry("fine", 8, 2), entry], writers_for([0, 1], 1))


def test_duplicate_names_are_named() -> None:
    with pytest.raises(ValueError, match=r"'twice' is given twice"):
        partition([Entry("twice", 8, 1), Entry("once", 8, 1), Entry("twice", 4, 1)], writers_for([0], 1))


def test_bad_writers_and_knobs() -> None:
    with pytest.raises(ValueError, match="no writers"):
        partition([Entry("a", 8, 1)], [])
    with pytest.raises(ValueError, match=r"rank 1, directory 0\) is given twice"):
        partition([Entry("a", 8, 1)], [Writer(1, 0), Writer(0, 0), Writer(1, 0)])
    with pytest.raises(ValueError, match="min_piece_bytes"):
        partition([Entry("a", 8, 1)], [Writer(0, 0)], min_piece_bytes=0)


# -- writers_for ------------------------------------------------------------------------------


def test_writers_for_examples() -> None:
    assert writers_for([0], 2) == (Writer(0, 0), Writer(0, 1))
    assert writers_for([0, 1], 4) == (Writer(0, 0), Writer(0, 2), Writer(1, 1), Writer(1, 3))
    assert writers_for([0, 1, 2, 3], 2) == (Writer(0, 0), Writer(1, 1), Writer(2, 0), Writer(3, 1))
    assert writers_for([0, 1, 2], 4) == (Writer(0, 0), Writer(0, 3), Writer(1, 1), Writer(2, 2))
    # two nodes of two ranks, three directories each
    assert writers_for([0, 1, 0, 1], 3) == (
        Writer(0, 0),
        Writer(0, 2),
        Writer(1, 1),
        Writer(2, 0),
        Writer(2, 2),
        Writer(3, 1),
    )


@settings(max_examples=120, deadline=None)
@given(local_ranks=st.lists(st.integers(0, 9), min_size=1, max_size=20), num_dirs=st.integers(1, 12))
def test_writers_for_gives_every_rank_its_own_valid_writers(local_ranks: list[int], num_dirs: int) -> None:
    writers = writers_for(local_ranks, num_dirs)
    per_node = max(local_ranks) + 1
    assert list(writers) == sorted(set(writers), key=lambda w: (w.rank, w.directory))
    assert {w.rank for w in writers} == set(range(len(local_ranks)))
    assert all(0 <= w.directory < num_dirs for w in writers)
    dirs_of: dict[int, set[int]] = defaultdict(set)
    for w in writers:
        dirs_of[w.rank].add(w.directory)
    for rank, local in enumerate(local_ranks):
        dirs = dirs_of[rank]
        # ranks with the same local rank (on other nodes) use the same directories
        assert dirs == dirs_of[local_ranks.index(local)]
        if num_dirs >= per_node:
            assert len(dirs) in (num_dirs // per_node, -(-num_dirs // per_node))
            assert all(d % per_node == local for d in dirs)
        else:
            assert dirs == {local % num_dirs}


@settings(max_examples=100, deadline=None)
@given(nodes=st.integers(1, 4), per_node=st.integers(1, 8), num_dirs=st.integers(1, 12))
def test_writers_for_on_alike_nodes_uses_every_directory_evenly(
    nodes: int, per_node: int, num_dirs: int
) -> None:
    local_ranks = [r % per_node for r in range(nodes * per_node)]
    writers = writers_for(local_ranks, num_dirs)
    for node in range(nodes):
        users: dict[int, int] = defaultdict(int)  # directory -> how many of the node's writers use it
        for w in writers:
            if w.rank // per_node == node:
                users[w.directory] += 1
        assert set(users) == set(range(num_dirs))
        if num_dirs >= per_node:
            assert set(users.values()) == {1}  # no directory shared within a node
        else:
            assert set(users.values()) <= {per_node // num_dirs, -(-per_node // num_dirs)}


@pytest.mark.parametrize(
    ("local_ranks", "num_dirs", "message"),
    [
        ([0, 1], 0, "num_dirs"),
        ([], 2, "local_ranks is empty"),
        ([0, -1], 2, r"local_ranks\[1\] is negative"),
    ],
)
def test_writers_for_rejects_bad_input(local_ranks: list[int], num_dirs: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        writers_for(local_ranks, num_dirs)


def test_one_writer_writes_every_entry_whole() -> None:
    entries = [Entry("big", 64 << 20, 1024), Entry("small", 1 << 10, 16), Entry("mine", 8 << 20, 8, owner=0)]
    plan = partition(entries, [Writer(0, 0)], min_piece_bytes=1)
    assert all(p.whole for p in plan.pieces[0])
    assert [p.name for p in plan.pieces[0]] == ["big", "mine", "small"]
