"""torch.distributed.checkpoint through aiopersist's writer and reader, on real ranks
(gloo over TCP): DTensor-sharded state saved on 2 ranks and loaded bit-exact on 1, 2 and 3
(DCP reshards), by aiopersist's reader and by DCP's own; and DCP's own checkpoints read by
aiopersist's reader."""

from __future__ import annotations

from pathlib import Path

import pytest

import aiopersist
from tests.conftest import BACKENDS
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
    for scenario, world in (("load", 1), ("load", 2), ("load", 3), ("load-stock", 3)):
        for out in _dcp(scenario, tmp_path, backend, world=world):
            assert out["ok"]["mismatch"] == [], (scenario, world, out)
    # Every byte is checksummed: aiopersist verifies the directory as any checkpoint.
    import asyncio

    report = asyncio.run(aiopersist.verify(tmp_path / "ck", backend=backend))
    assert len(report.files) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcps_own_sharded_checkpoint_loads_through_aiopersist(tmp_path: Path, backend: str) -> None:
    _dcp("save-stock", tmp_path, backend, world=2)
    for world in (1, 3):
        for out in _dcp("load", tmp_path, backend, world=world):
            assert out["ok"]["mismatch"] == [], out


def test_async_save_on_2_ranks(tmp_path: Path) -> None:
    outs = _dcp("async-save", tmp_path, "threads", world=2)
    assert outs[0]["ok"]["metadata"] == "Metadata"
    for out in _dcp("load", tmp_path, "threads", world=2):
        assert out["ok"]["mismatch"] == [], out
