"""torch.distributed.checkpoint through aiopersist's writer and reader, on real ranks
(gloo over TCP): DTensor-sharded state saved on 2 ranks and loaded bit-exact on 1, 2 and 3
(DCP reshards), by aiopersist's reader and by DCP's own; and DCP's own checkpoints read by
aiopersist's reader."""

from __future__ import annotations

from pathlib import Path

import pytest

import aiopersist
from tests._launch import run
from tests.conftest import BACKENDS, flip_byte
from tests.e2e.test_distributed import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore")


def _dcp(scenario: str, base: Path, backend: str, world: int) -> list[dict[str, object]]:
    outs = run_ranks(scenario, base, backend, world=world, worker="tests._dcp_worker")
    for out in outs:
        assert out["rc"] == 0, out["stderr"]
        assert "ok" in out, out
    return outs


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_save_on_2_ranks_loads_bit_exact_on_1_2_and_3(tmp_path: Path, backend: str) -> None:
    outs = _dcp("save", tmp_path, backend, world=2)
    assert outs[0]["ok"]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "aiopersist.json"]
    assert not [p.name for p in tmp_path.iterdir() if ".aiopersist-tmp-" in p.name]
    for scenario, world in (("load", 1), ("load", 3), ("load-stock", 3)):  # 2 on 2: the tests below
        for out in _dcp(scenario, tmp_path, backend, world=world):
            assert out["ok"]["mismatch"] == [], (scenario, world, out)
    # Every byte is checksummed: aiopersist verifies the directory as any checkpoint.
    import asyncio

    report = asyncio.run(aiopersist.verify(tmp_path / "ck", backend=backend))
    assert len(report.files) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcps_own_sharded_checkpoint_loads_through_aiopersist(tmp_path: Path, backend: str) -> None:
    _dcp("save-stock", tmp_path, backend, world=2)
    for out in _dcp("load", tmp_path, backend, world=3):  # resharded, as DCP's reader would
        assert out["ok"]["mismatch"] == [], out


def test_async_save_on_2_ranks(tmp_path: Path) -> None:
    outs = _dcp("async-save", tmp_path, "threads", world=2)
    assert outs[0]["ok"]["metadata"] == "Metadata"
    for out in _dcp("load", tmp_path, "threads", world=2):
        assert out["ok"]["mismatch"] == [], out


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_dying_in_dcps_planning_ends_the_other_ranks_fence(tmp_path: Path, backend: str) -> None:
    """Rank 1 dies in DCP's planning of an ``async_save`` with `FenceStager`: rank 0's
    ``wait_staged()``, without the upload future, raises `RankFailedError` (it waited
    until its timeout, for good without one), and nothing is left on disk."""
    outs = run_ranks("fence-rank-dies-in-planning", tmp_path, backend, world=2, worker="tests._dcp_worker")
    assert outs[1]["rc"] == 3, outs[1]
    assert outs[0].get("ok") == {"fence": "RankFailedError", "left": []}, outs[0]


def test_fsdp2_model_and_optimizer_on_2_ranks_resume_bit_exact_on_1_2_and_3(tmp_path: Path) -> None:
    """FSDP2 (``fully_shard``, on CPU with gloo): the model's and AdamW's sharded state
    from ``get_state_dict`` saved through the writer on 2 ranks, loaded through the reader
    and ``set_state_dict`` on 1, 2 and 3 ranks: every tensor equal, and training goes on."""
    saved = _dcp("fsdp-save", tmp_path, "threads", world=2)
    count = saved[0]["ok"]["tensors"]
    assert count >= 12  # 3 layers x (weight, bias) x (parameter, exp_avg, exp_avg_sq)
    for world in (1, 2, 3):
        for out in _dcp("fsdp-load", tmp_path, "threads", world=world):
            assert out["ok"]["mismatch"] == [], (world, out)
            assert out["ok"]["tensors"] == count


def _train_fsdp2(out: Path, ranks: int, steps: int) -> dict[str, object]:
    """The example loop (integrations/dcp/train_fsdp2.py) under torchrun."""
    import json
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    proc = run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-port", str(port), str(root / "integrations" / "dcp" / "train_fsdp2.py"),
            "--out", str(out), "--steps", str(steps), "--every", "5", "--width", "64", "--depth", "2",
        ],
        cwd=root, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]))


def test_the_fsdp2_example_resumes_exactly_where_it_stopped(tmp_path: Path) -> None:
    """torchrun with 2 ranks: 15 steps straight, against 10 steps then a restart that
    resumes from step 10: the same loss to the last bit. (Resuming on another number of
    ranks: the FSDP2 test above.)"""
    straight = _train_fsdp2(tmp_path / "a", 2, 15)
    first = _train_fsdp2(tmp_path / "b", 2, 10)
    assert first["newest"] == 10
    resumed = _train_fsdp2(tmp_path / "b", 2, 15)
    assert (resumed["start"], resumed["newest"]) == (10, 15)
    assert resumed["loss"] == straight["loss"]
    # Its newest checkpoint damaged: a rerun passes over it (AiopersistReader refuses it
    # on both ranks), resumes from step 10, and replaces step 15 when it reaches it.
    flip_byte(tmp_path / "b" / "step-15" / "__0_0.distcp")
    again = _train_fsdp2(tmp_path / "b", 2, 15)
    assert (again["start"], again["newest"]) == (10, 15)
    assert again["loss"] == straight["loss"]
    import asyncio

    asyncio.run(aiopersist.verify(tmp_path / "b" / "step-15"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_disks_each_rank_writes_its_part_and_both_readers_find_it(tmp_path: Path, backend: str) -> None:
    """Rank 1's file goes to the second disk, in a part directory of the save's token; DCP's
    record points at it relative to the checkpoint, so DCP's own reader finds it too. An
    overwrite replaces both, and the old part goes."""
    outs = _dcp("save-disks", tmp_path, backend, world=2)
    assert outs[0]["ok"]["files"] == [".metadata", "__0_0.distcp", "aiopersist.json"]
    [part] = (tmp_path / "disk1" / "ck").iterdir()
    assert part.name.startswith("part-")
    assert sorted(p.name for p in part.iterdir()) == ["__1_0.distcp"]
    for scenario, world in (("load", 3), ("load-stock", 2)):
        for out in _dcp(scenario, tmp_path, backend, world=world):
            assert out["ok"]["mismatch"] == [], (scenario, world, out)
    import asyncio

    assert len(asyncio.run(aiopersist.verify(tmp_path / "ck", backend=backend)).files) == 3
    _dcp("resave-disks", tmp_path, backend, world=2)
    [new_part] = (tmp_path / "disk1" / "ck").iterdir()
    assert new_part.name != part.name
    assert len(asyncio.run(aiopersist.verify(tmp_path / "ck", backend=backend)).files) == 3
    assert not [p.name for p in tmp_path.rglob("*") if ".aiopersist-tmp-" in p.name]
