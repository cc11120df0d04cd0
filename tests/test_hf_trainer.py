"""AioPersistCallback with a real Hugging Face Trainer: a tiny GPT-2 built from a config,
trained on generated tokens, offline. Checkpoints written by the callback must be the
Trainer's own, so that a stock Trainer resumes from them bit-exactly."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, cast

import pytest
import torch

transformers = pytest.importorskip("transformers")

import aiopersist  # noqa: E402
from aiopersist._demo_trainer import Tokens  # noqa: E402
from aiopersist.integrations.transformers import (  # noqa: E402
    AioPersistCallback,
    _checkpoints,
    to_rotate,
)
from tests._hf_ddp_worker import tiny_gpt2  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _trainer(out: Path, callbacks: list[Any], max_steps: int = 8, **kw: Any) -> Any:
    options: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": max_steps,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "save_strategy": "steps",
        "save_steps": 2,
        "logging_steps": 1000,
        "report_to": [],
        "seed": 0,
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    args = transformers.TrainingArguments(**{**options, **kw})
    evaluate = (
        Tokens(8, 16, 128) if options.get("eval_strategy", kw.get("eval_strategy", "no")) != "no" else None
    )
    return transformers.Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=Tokens(64, 16, 128),
        eval_dataset=evaluate,
        callbacks=callbacks,
    )


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


class _StopAt(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step >= self.step:
            control.should_training_stop = True


@pytest.mark.parametrize(
    ("backend", "mode"), [("threads", "fence"), ("io_uring", "fence"), ("threads", "snapshot")]
)
def test_stock_trainer_resumes_bit_exactly_from_callback_checkpoints(
    tmp_path: Path, backend: str, mode: Any
) -> None:
    if backend == "io_uring" and not aiopersist.probe_io_uring().usable:
        pytest.skip("io_uring unavailable")
    # The reference: a stock Trainer, never interrupted, saving nothing.
    stock = _trainer(tmp_path / "stock", [], save_strategy="no")
    stock.train()
    reference = _weights(stock)

    # With the callback, interrupted after step 4.
    callback = AioPersistCallback(backend=backend, mode=mode)
    first = _trainer(tmp_path / "run", [callback, _StopAt(4)])
    first.train()
    ckpt = tmp_path / "run" / "checkpoint-4"
    assert callback.saved == [str(tmp_path / "run" / "checkpoint-2"), str(ckpt)]
    names = set(os.listdir(ckpt))
    assert {
        "model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
        "trainer_state.json", "training_args.bin", "aiopersist.json",
    } <= names  # fmt: skip
    assert transformers.trainer_utils.get_last_checkpoint(str(tmp_path / "run")) == str(ckpt)
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert set(opt) == {"state", "param_groups"}
    report = __import__("asyncio").run(aiopersist.verify(ckpt))
    assert {os.path.basename(f) for f in report.files} >= {"model.safetensors", "optimizer.pt"}

    # A stock Trainer, knowing nothing of aiopersist, resumes and ends where the
    # uninterrupted run ended: bit for bit.
    resumed = _trainer(tmp_path / "run", [])
    resumed.train(resume_from_checkpoint=str(ckpt))
    after = _weights(resumed)
    for k, v in reference.items():
        assert torch.equal(after[k], v), k

    # from_pretrained reads the checkpoint directly.
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(ckpt))
    state4 = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert state4["state"]  # the optimizer had state at step 4
    assert torch.equal(loaded.transformer.wte.weight, loaded.lm_head.weight)  # tied, as saved


def test_callback_run_matches_stock_run_and_honours_save_total_limit(tmp_path: Path) -> None:
    stock = _trainer(tmp_path / "stock", [], save_strategy="no")
    stock.train()
    callback = AioPersistCallback()
    mine = _trainer(tmp_path / "run", [callback], save_total_limit=2)
    mine.train()
    for k, v in _weights(stock).items():
        assert torch.equal(_weights(mine)[k], v), k  # saving changed nothing in training
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-6", "checkpoint-8"]
    assert len(callback.saved) == 4


@pytest.mark.parametrize("backend", ["threads", "io_uring"])
def test_rotation_counts_only_complete_checkpoints(tmp_path: Path, backend: str) -> None:
    """save_total_limit keeps the newest N *complete* checkpoints. A broken one (a stock
    save that crashed, a damaged aiopersist one) neither counts nor protects: older
    than the newest complete one it goes, newer it is left alone."""
    run = tmp_path / "run"

    def ours(step: int) -> Path:
        path = run / f"checkpoint-{step}"
        asyncio.run(aiopersist.save({"w": torch.full((1000,), float(step))}, path, backend=backend))
        return path

    ours(1)
    damaged = ours(2)
    weights = next(p for p in damaged.iterdir() if p.suffix == ".safetensors")
    os.truncate(weights, weights.stat().st_size - 8)
    (run / "checkpoint-3").mkdir()
    (run / "checkpoint-3" / "trainer_state.json").write_text("{}")  # a stock one, finished
    (run / "checkpoint-4").mkdir()  # a stock one that crashed early
    ours(5)
    (run / "checkpoint-7").mkdir()  # broken, newer than any complete one
    found = _checkpoints(str(run))
    assert [(step, ok) for step, _, ok in found] == [
        (1, True),
        (2, False),
        (3, True),
        (4, False),
        (5, True),
        (7, False),
    ]
    names = lambda paths: [os.path.basename(p) for p in paths]  # noqa: E731
    assert names(to_rotate(found, 2)) == ["checkpoint-1", "checkpoint-2", "checkpoint-4"]
    assert names(to_rotate(found, 5)) == ["checkpoint-2", "checkpoint-4"]
    assert to_rotate([(4, str(run / "checkpoint-4"), False)], 1) == []


@pytest.mark.parametrize("backend", ["threads", "io_uring"])
def test_save_total_limit_keeps_complete_checkpoints_past_a_broken_one(tmp_path: Path, backend: str) -> None:
    """A broken checkpoint-7 left by an earlier run: at step 8 the Trainer run still keeps
    two complete checkpoints (6 and 8), where counting every directory would have kept
    only the broken 7 and 8."""
    (tmp_path / "run" / "checkpoint-7").mkdir(parents=True)
    callback = AioPersistCallback(backend=backend)
    _trainer(tmp_path / "run", [callback], save_total_limit=2).train()
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-6", "checkpoint-8"]
    for name in ("checkpoint-6", "checkpoint-8"):
        asyncio.run(aiopersist.verify(tmp_path / "run" / name))  # raises if it is not whole


def test_callback_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    trainer = _trainer(
        tmp_path / "run",
        [AioPersistCallback()],
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
    )
    with pytest.raises(ValueError, match="load_best_model_at_end"):
        trainer.train()


_TRAIN = """
import sys
sys.path.insert(0, {root!r})
from tests.test_hf_trainer import AioPersistCallback, _trainer
from pathlib import Path
_trainer(Path({out!r}), [AioPersistCallback()], max_steps=10_000, save_steps=1).train()
"""


def test_kill_9_mid_save_resumes_from_the_previous_complete_checkpoint(tmp_path: Path) -> None:
    import asyncio
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", _TRAIN.format(root=root, out=str(out))], cwd=root)
    killed_mid_save = False
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            names = os.listdir(out) if out.exists() else []
            complete = [n for n in names if n.startswith("checkpoint-")]
            if len(complete) >= 2 and any(".aiopersist-tmp-" in n for n in names):
                proc.send_signal(signal.SIGKILL)
                killed_mid_save = True
                break
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait()
    assert killed_mid_save, "never saw a save in progress"
    last = transformers.trainer_utils.get_last_checkpoint(str(out))
    assert last is not None
    assert ".aiopersist-tmp-" not in last
    asyncio.run(aiopersist.verify(last))  # complete, every checksum right
    step = int(last.rsplit("-", 1)[1])
    resumed = _trainer(out, [], max_steps=step + 2, save_strategy="no")
    resumed.train(resume_from_checkpoint=last)
    assert resumed.state.global_step == step + 2


def _torchrun(out: Path, mode: str, backend: str) -> list[dict[str, Any]]:
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(port), "-m", "tests._hf_ddp_worker", str(out), mode, backend,
        ],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = sorted(out.glob(f"{mode}-[0-9]*.json"))
    assert len(reports) == 2, (reports, proc.stdout[-2000:], proc.stderr[-3000:])
    return [json.loads(p.read_text()) for p in reports]


@pytest.fixture(scope="module")
def ddp_stock_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The weights of a stock DDP run that never stops (no I/O of ours: made once)."""
    out = tmp_path_factory.mktemp("ddp-stock")
    outs = _torchrun(out, "stock", "threads")
    assert sorted((o["rank"], o["world"]) for o in outs) == [(0, 2), (1, 2)]
    return cast(dict[str, torch.Tensor], torch.load(out / "stock.pt"))


@pytest.mark.parametrize("backend", ["threads", "io_uring"])
def test_under_ddp_a_stock_trainer_resumes_bit_exactly(
    tmp_path: Path, backend: str, ddp_stock_weights: dict[str, torch.Tensor]
) -> None:
    """Two processes under torchrun (DDP over gloo): process 0 writes the callback's
    checkpoints with both ranks' RNG states; a stock Trainer on two processes resumes from
    one and ends with the uninterrupted run's weights, bit for bit."""
    outs = _torchrun(tmp_path, "callback", backend)
    assert sorted((o["rank"], o["world"]) for o in outs) == [(0, 2), (1, 2)]
    checkpoint = tmp_path / "callback" / "checkpoint-4"
    names = set(os.listdir(checkpoint))
    assert {
        "rng_state_0.pth",
        "rng_state_1.pth",
        "model.safetensors",
        "optimizer.pt",
        "trainer_state.json",
    } <= names
    assert "rng_state.pth" not in names
    asyncio.run(aiopersist.verify(checkpoint))
    r0, r1 = (torch.load(checkpoint / f"rng_state_{i}.pth", weights_only=False) for i in (0, 1))
    assert not torch.equal(r0["cpu"], r1["cpu"])  # each rank's own, not rank 0's twice
    _torchrun(tmp_path, "resume", backend)
    for name in ("callback", "resume"):
        got = torch.load(tmp_path / f"{name}.pt")
        for k, v in ddp_stock_weights.items():
            assert torch.equal(got[k], v), (name, k)


def test_under_ddp_save_only_model_writes_the_model_alone(tmp_path: Path) -> None:
    """With ``save_only_model`` the ranks gather no RNG states; process 0 still writes
    alone, in its own group, and no rank waits for another."""
    outs = _torchrun(tmp_path, "model-only", "threads")
    assert sorted((o["rank"], o["world"]) for o in outs) == [(0, 2), (1, 2)]
    for step in (2, 4, 6, 8):
        checkpoint = tmp_path / "model-only" / f"checkpoint-{step}"
        names = set(os.listdir(checkpoint))
        assert {"model.safetensors", "config.json", "trainer_state.json"} <= names, names
        assert not {n for n in names if n.startswith(("rng_state", "optimizer", "scheduler"))}, names
        asyncio.run(aiopersist.verify(checkpoint))


def test_under_ddp_save_on_each_node_is_refused(tmp_path: Path) -> None:
    outs = _torchrun(tmp_path, "each-node", "threads")
    assert sorted(o["rank"] for o in outs) == [0, 1]
    assert all("save_on_each_node" in o["refused"] for o in outs), outs
