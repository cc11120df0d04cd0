"""aiopersist.integrations.accelerate: an asynchronous save_state that Accelerate's own
load_state restores, in one process and under accelerate launch with two."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator

import aiopersist
from aiopersist.integrations.accelerate import save_state, save_state_blocking

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "integrations" / "accelerate" / "cpu_2proc.yaml"


def _setup() -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    return accelerator, model, opt, sched


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object) -> None:
    model(torch.randn(4, 32)).pow(2).mean().backward()
    opt.step()
    sched.step()  # type: ignore[attr-defined]
    opt.zero_grad()


def test_save_state_then_load_state(tmp_path: Path) -> None:
    accelerator, model, opt, sched = _setup()
    _step(model, opt, sched)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    lr = sched.get_last_lr()  # type: ignore[attr-defined]

    async def save() -> aiopersist.SaveInfo | None:
        async with aiopersist.Checkpointer() as ck:
            handle = await save_state(accelerator, tmp_path / "ck", checkpointer=ck)
            await handle.staged
            _step(model, opt, sched)  # training goes on once staged
            return await handle.done

    info = asyncio.run(save())
    assert info is not None
    names = set(os.listdir(tmp_path / "ck"))
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= names
    _step(model, opt, sched)
    accelerator.load_state(str(tmp_path / "ck"))
    for k, v in weights.items():
        assert torch.equal(model.state_dict()[k], v), k
    for k, v in moments.items():
        assert torch.equal(opt.state_dict()["state"][0][k], v), k
    assert sched.get_last_lr() == lr  # type: ignore[attr-defined]


def test_save_state_blocking(tmp_path: Path) -> None:
    accelerator, model, opt, sched = _setup()
    _step(model, opt, sched)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with aiopersist.BlockingCheckpointer() as ck:
        handle = save_state_blocking(accelerator, tmp_path / "ck", checkpointer=ck)
        handle.wait_staged()
        _step(model, opt, sched)
        assert handle.wait() is not None
    accelerator.load_state(str(tmp_path / "ck"))
    for k, v in weights.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_save_state_under_accelerate_launch_two_processes(tmp_path: Path) -> None:
    accelerate = Path(sys.executable).parent / "accelerate"
    proc = subprocess.run(
        [
            str(accelerate), "launch", "--config_file", str(CONFIG), "--main_process_port", str(_free_port()),
            "-m", "tests._accelerate_worker", str(tmp_path), "save-state",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = sorted(
        (json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")), key=lambda o: o["rank"]
    )
    assert [o["rank"] for o in outs] == [0, 1]
    assert all(o["restored"] for o in outs)
    names = set(os.listdir(tmp_path / "ck"))
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "optimizer.bin"} <= names


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
