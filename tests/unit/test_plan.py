"""The write plan (pure): describing a rank's state and planning files from every rank's
description, without processes or files. One process in one directory is the case of
one rank and one writer."""

from __future__ import annotations

import itertools

import pytest
import torch

from aiopersist._exceptions import StateMismatchError
from aiopersist._flatten import flatten
from aiopersist._manifest import RankState
from aiopersist._plan import RankDesc, TensorDesc, describe, plan_write, rank_state


def _desc(rank: int, tensors: list[TensorDesc], local_rank: int | None = None) -> RankDesc:
    return RankDesc(rank, rank if local_rank is None else local_rank, tuple(tensors), RankState({}), "tok")


def _t(name: str, shape: tuple[int, ...], kind: str = "replicated", **kw: object) -> TensorDesc:
    return TensorDesc(name, name.split("@")[0], "F32", shape, 4, kind, **kw)  # type: ignore[arg-type]


def _covered(plan: object, name: str) -> list[tuple[int, int]]:
    rows = []
    for f in plan.files:  # type: ignore[attr-defined]
        for p in f.parts:
            if p.target == name:
                rows.append(p.target_rows or (0, -1))
    return sorted(rows)


def test_describe_marks_shared_local_and_renames_local() -> None:
    flat = flatten({"w": torch.ones(4), "rng": torch.zeros(2), "n": 3})
    tensors = describe(flat, rank=1, world_size=2, replicated=lambda n: n != "rng")
    kinds = {t.name: t.kind for t in tensors}
    assert kinds == {"w": "replicated", "rng@1": "local"}
    state = rank_state(flat, tensors)
    assert state.skeleton == {"w": {"__tensor__": "w"}, "rng": {"__tensor__": "rng@1"}, "n": 3}


def test_one_rank_shares_everything() -> None:
    flat = flatten({"a": torch.ones(3)})
    assert [t.kind for t in describe(flat, 0, 1, replicated=False)] == ["replicated"]


def test_ddp_tensors_are_replicated_without_being_told() -> None:
    flat = flatten({"x": torch.ones(2)})
    flat.replicated.add("x")
    assert [t.kind for t in describe(flat, 1, 2, replicated=None)] == ["replicated"]


def test_replicated_tensors_are_split_between_ranks_and_cover_every_row() -> None:
    big = _t("big", (4096, 1024))  # 16 MiB: split in row slices
    small = [_t(f"s{i}", (256, 256)) for i in range(8)]
    descs = [_desc(r, [big, *small]) for r in range(2)]
    plan = plan_write(descs, num_dirs=2, max_shard_bytes=1 << 40)
    assert plan.imbalance <= 1.05
    assert {f.rank for f in plan.files} == {0, 1}
    assert {(f.rank, f.directory) for f in plan.files} == {(0, 0), (1, 1)}
    rows = _covered(plan, "big")
    assert rows[0][0] == 0
    assert rows[-1][1] == 4096
    assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))
    assert "big" in plan.sliced


def test_plans_are_cached_and_deterministic() -> None:
    descs = [_desc(r, [_t("a", (64, 64)), _t("b", (32,))]) for r in range(2)]
    assert plan_write(descs, 1, 1 << 30) is plan_write(list(descs), 1, 1 << 30)
    again = [_desc(r, [_t("a", (64, 64)), _t("b", (32,))]) for r in range(2)]
    assert plan_write(again, 1, 1 << 30) == plan_write(descs, 1, 1 << 30)


def test_ranks_that_disagree_on_shared_tensors_fail_alike() -> None:
    descs = [_desc(0, [_t("a", (4,))]), _desc(1, [_t("a", (5,))])]
    with pytest.raises(StateMismatchError, match="differ between rank 0 and rank 1"):
        plan_write(descs, 1, 1 << 30)


def test_shards_must_tile_their_tensor() -> None:
    ok = [
        _desc(0, [_t("w", (3, 4), "shard", whole_shape=(5, 4), row_start=0)]),
        _desc(1, [_t("w", (2, 4), "shard", whole_shape=(5, 4), row_start=3)]),
    ]
    plan = plan_write(ok, 1, 1 << 30)
    assert _covered(plan, "w") == [(0, 3), (3, 5)]
    gap = [
        _desc(0, [_t("w", (2, 4), "shard", whole_shape=(5, 4), row_start=0)]),
        _desc(1, [_t("w", (2, 4), "shard", whole_shape=(5, 4), row_start=3)]),
    ]
    with pytest.raises(StateMismatchError, match="do not tile"):
        plan_write(gap, 1, 1 << 30)


def test_an_empty_shard_writes_nothing() -> None:
    descs = [
        _desc(0, [_t("w", (2, 4), "shard", whole_shape=(2, 4), row_start=0)]),
        _desc(1, [_t("w", (0, 4), "shard", whole_shape=(2, 4), row_start=2)]),
    ]
    plan = plan_write(descs, 1, 1 << 30)
    assert _covered(plan, "w") == [(0, 2)]
    assert {f.rank for f in plan.files} == {0}


def test_files_are_cut_at_max_shard_bytes() -> None:
    tensors = [_t(f"t{i}", (256, 256)) for i in range(6)]  # 6 x 256 KiB
    plan = plan_write([_desc(0, tensors)], 2, 600 << 10)  # two writers: named after them
    assert sorted(f.name for f in plan.files) == [
        "state-rank00000-dir00-00001.safetensors",
        "state-rank00000-dir00-00002.safetensors",
        "state-rank00000-dir01-00001.safetensors",
        "state-rank00000-dir01-00002.safetensors",
    ]
    assert (plan.spread, plan.layout) == (True, "state")
    alone = plan_write([_desc(0, tensors)], 1, 600 << 10)  # one writer: Hugging Face's names
    assert [f.name for f in alone.files] == [f"state-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert (alone.spread, alone.needs_index) == (False, False)


def _model(rank: int, tensors: list[TensorDesc]) -> RankDesc:
    return RankDesc(rank, rank, tuple(tensors), RankState({}), "tok", model_only=True)


def test_one_writer_keeps_state_order_and_never_slices() -> None:
    tensors = [
        _t("a", (3,)),
        TensorDesc("h", "h", "F16", (5,), 2, "replicated"),
        _t("big", (8192, 1024)),  # 32 MiB: alone it stays whole
        TensorDesc("d", "d", "F64", (2,), 8, "replicated"),
        _t("b", (4,)),
    ]
    plan = plan_write([_model(0, tensors)], 1, 1 << 40)
    assert [f.name for f in plan.files] == ["model.safetensors"]
    # Largest alignment first, then the state's order: what a single-file save always did.
    assert [p.target for p in plan.files[0].parts] == ["d", "a", "big", "b", "h"]
    assert all(p.target_rows is None for p in plan.files[0].parts)
    assert (plan.layout, plan.spread, plan.sliced) == ("hf-model", False, {})
    shards = plan_write([_model(0, tensors)], 1, 16 << 20)
    assert [f.name for f in shards.files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert shards.needs_index
    # Two writers are a spread save: writer names, and a model is just state there.
    two = plan_write([_model(0, tensors)], 2, 1 << 40)
    assert (two.layout, two.spread, two.needs_index) == ("state", True, False)


def test_a_state_without_tensors_has_no_data_file() -> None:
    # Its objects are in the manifest's skeleton (or pickled.bin): an empty safetensors
    # file would be a file that a framework's own save does not write (Accelerate's, when
    # the save hooks take the weights).
    assert plan_write([_desc(0, [])], 1, 1 << 30).files == ()
    assert plan_write([_desc(0, []), _desc(1, [])], 1, 1 << 30).files == ()


def test_plan_refuses_a_shard_size_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="max_shard_bytes"):
        plan_write([_desc(0, [])], 1, 0)


def test_part_hasher_splits_a_stream_into_parts() -> None:
    import xxhash

    from aiopersist._stream import PartHasher

    data = bytes(range(256)) * 40
    lengths = [0, 100, 1, 5000, 5139]
    hasher = PartHasher(xxhash.xxh3_64(), lengths, xxhash.xxh3_64)
    for chunk in (data[:7], data[7:4096], data[4096:4097], data[4097:]):  # boundaries anywhere
        hasher.update(chunk)
    assert hasher.hexdigest() == xxhash.xxh3_64_hexdigest(data)
    expected, pos = [], 0
    for n in lengths:
        expected.append(xxhash.xxh3_64_hexdigest(data[pos : pos + n]))
        pos += n
    assert hasher.part_digests() == expected
