"""AioPersistCallback under FSDP2: a real Hugging Face Trainer on two processes
(``torchrun``, gloo, CPU) shards a tiny GPT-2 with ``fully_shard`` and saves
``SHARDED_STATE_DICT`` checkpoints. The callback's checkpoints must be the stock FSDP
layout (a DCP directory for the model and one for the optimizer, every rank writing its
shards), so that a stock Trainer resumes from them bit-exactly; every file is
checksummed and the directory is published whole.

Accelerate takes an FSDP plugin only on GPU-like devices; here it is made to take it on
CPU (`tests._cpu_fsdp`), the rest is the libraries' own code. One launch per backend runs
the stock run, the callback's, a stock resume and a refused configuration."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import aiopersist
from aiopersist._manager import check_step, scan
from aiopersist._names import TRAINER_STEPS
from tests._launch import run
from tests.conftest import BACKENDS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=BACKENDS)
def fsdp_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Any]]:
    out = tmp_path_factory.mktemp(f"fsdp-{request.param}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(port), "-m", "tests._hf_fsdp_worker", str(out), str(request.param),
        ],
        cwd=ROOT, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("report-*.json"))]
    assert [r["rank"] for r in reports] == [0, 1], proc.stderr[-3000:]
    return out, reports


def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def test_fsdp_ran_and_the_callback_saved_every_checkpoint(fsdp_run: tuple[Path, list[Any]]) -> None:
    out, reports = fsdp_run
    assert all(r["sharded"] == "DTensor" for r in reports)  # the parameters were sharded
    assert reports[0]["saved"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    # save_total_limit=2, as the stock run rotated
    assert (
        sorted(os.listdir(out / "callback"))
        == sorted(os.listdir(out / "stock"))
        == [
            "checkpoint-6",
            "checkpoint-8",
        ]
    )


def test_training_with_the_callback_ends_as_the_stock_run(fsdp_run: tuple[Path, list[Any]]) -> None:
    out, _ = fsdp_run
    stock, callback = torch.load(out / "stock.pt"), torch.load(out / "callback.pt")
    assert stock.keys() == callback.keys()
    assert all(torch.equal(stock[k], callback[k]) for k in stock)


def test_a_stock_trainer_resumes_bit_exactly_from_the_callbacks_checkpoint(
    fsdp_run: tuple[Path, list[Any]],
) -> None:
    """Model shards, optimizer shards, scheduler and both ranks' RNG states: resuming at
    step 6 ends with the uninterrupted run's weights, bit for bit."""
    out, _ = fsdp_run
    stock, resumed = torch.load(out / "stock.pt"), torch.load(out / "resume.pt")
    assert stock.keys() == resumed.keys()
    assert all(torch.equal(stock[k], resumed[k]) for k in stock)


def test_the_checkpoint_is_the_stock_fsdp_layout_plus_manifests(fsdp_run: tuple[Path, list[Any]]) -> None:
    out, _ = fsdp_run
    ours = _files(out / "callback" / "checkpoint-6")
    stock = _files(out / "stock" / "checkpoint-6")
    manifests = {"aiopersist.json", "pytorch_model_fsdp_0/aiopersist.json", "optimizer_0/aiopersist.json"}
    assert ours == stock | manifests
    assert {"pytorch_model_fsdp_0/__1_0.distcp", "optimizer_0/__1_0.distcp", "rng_state_1.pth"} <= ours
    assert not [n for n in os.listdir(out / "callback") if n.startswith(".")]  # nothing left over


def test_every_file_is_listed_checksummed_and_checked(fsdp_run: tuple[Path, list[Any]]) -> None:
    out, _ = fsdp_run
    checkpoint = out / "callback" / "checkpoint-8"
    report = asyncio.run(aiopersist.verify(checkpoint))
    assert set(report.files) == {str(checkpoint / f) for f in _files(checkpoint) - {"aiopersist.json"}}
    complete, nbytes, problem = check_step(str(checkpoint))
    assert complete
    assert problem is None
    assert nbytes > 0
    [info] = [s for s in scan(str(out / "callback"), layout=TRAINER_STEPS) if s.step == 8]
    assert info.complete
    assert info.kind == "aiopersist"
    with pytest.raises(aiopersist.UnsupportedStateError, match="FSDP checkpoint"):
        aiopersist.load_sync(checkpoint)


@pytest.mark.parametrize(
    "target", ["optimizer_0/__1_0.distcp", "pytorch_model_fsdp_0/.metadata", "scheduler.pt"]
)
def test_a_damaged_file_is_found_by_verify(
    fsdp_run: tuple[Path, list[Any]], tmp_path: Path, target: str
) -> None:
    out, _ = fsdp_run
    checkpoint = tmp_path / "checkpoint-8"
    shutil.copytree(out / "callback" / "checkpoint-8", checkpoint)
    with open(checkpoint / target, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(aiopersist.CheckpointCorruptError, match=target.split("/")[-1]):
        asyncio.run(aiopersist.verify(checkpoint))


def test_a_missing_shard_makes_the_checkpoint_incomplete(
    fsdp_run: tuple[Path, list[Any]], tmp_path: Path
) -> None:
    out, _ = fsdp_run
    checkpoint = tmp_path / "checkpoint-8"
    shutil.copytree(out / "callback" / "checkpoint-8", checkpoint)
    os.unlink(checkpoint / "pytorch_model_fsdp_0" / "__0_0.distcp")
    complete, _, problem = check_step(str(checkpoint))
    assert not complete
    assert problem is not None
    assert "__0_0.distcp: missing" in problem


def test_a_subdirectory_replaced_by_a_link_is_refused(
    fsdp_run: tuple[Path, list[Any]], tmp_path: Path
) -> None:
    """A listed file must not be reached through a link: a checkpoint whose DCP directory
    is a symbolic link (to a copy of itself, elsewhere) is refused before any read."""
    out, _ = fsdp_run
    checkpoint = tmp_path / "checkpoint-8"
    shutil.copytree(out / "callback" / "checkpoint-8", checkpoint)
    elsewhere = tmp_path / "elsewhere"
    (checkpoint / "optimizer_0").rename(elsewhere)
    (checkpoint / "optimizer_0").symlink_to(elsewhere)
    with pytest.raises(
        aiopersist.CheckpointCorruptError, match="optimizer_0: a symbolic link, not a subdirectory"
    ):
        asyncio.run(aiopersist.verify(checkpoint))


def test_the_full_state_dict_is_refused_with_what_to_use(fsdp_run: tuple[Path, list[Any]]) -> None:
    _, reports = fsdp_run
    for r in reports:
        assert "SHARDED_STATE_DICT" in r["full"]
        assert "FULL_STATE_DICT" in r["full"]
