"""Every CUDA path, on a GPU: save and load (``map_location="cuda"``, ``into=`` CUDA
objects), the Checkpointer in both modes (a mutation right after ``staged`` on the
training stream, a state made on a side stream, non-contiguous tensors), the manager, the
Trainer callback with fp16 + GradScaler and with bf16, and Accelerate's ``scaler.pt``;
each on both backends. Skipped without a CUDA device (``scripts/gpu-check.sh`` runs them
on a lent GPU machine, and fails if they are skipped there for want of one)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import aiopersist
from aiopersist import Checkpointer, CheckpointManager

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODES = ["fence", "snapshot"]


def _state() -> dict[str, Any]:
    """Tensors of every kind the CUDA paths treat apart."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(3000, 1000, device="cuda", generator=g)  # 12 MiB: several chunks, an uneven last
    big = torch.randn(2048, 2048, device="cuda", generator=g)
    v = torch.randn(6 << 20, device="cuda", generator=g)
    return {
        "w": w,
        "tied": w,  # the same tensor twice: stored once
        "t": w.t(),  # a transposed view of it
        "cols": big[:, ::2],  # 2-D strided
        "strided1d": v[::3],  # 1-D strided, 8 MiB gathered
        "bf16": torch.randn(1 << 20, device="cuda", generator=g).to(torch.bfloat16),
        "fp16": torch.randn(777, 33, device="cuda", generator=g).half(),
        "ints": torch.arange(100_003, device="cuda"),
        "mask": torch.rand(999, device="cuda", generator=g) > 0.5,
        "empty": torch.empty(0, 5, device="cuda"),
        "scalar": torch.tensor(3.5, device="cuda"),
        "nhwc": torch.randn(8, 16, 32, 32, device="cuda", generator=g).to(memory_format=torch.channels_last),
        "cpu": torch.arange(10),  # a CPU tensor beside them
        "step": 7,
    }


def _assert_equal(got: Any, want: Any, device: str | None = None) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        if device is not None:
            assert got.device.type == device
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert torch.equal(got.cpu(), want.cpu())
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _assert_equal(got[k], want[k], device)
    else:
        assert got == want


@pytest.mark.asyncio
async def test_save_then_load_to_cuda_and_to_cpu(backend_name: str, tmp_path: Path) -> None:
    state = _state()
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    await aiopersist.save(state, tmp_path / "ck", backend=backend_name)
    on_gpu = await aiopersist.load(tmp_path / "ck", map_location="cuda", backend=backend_name)
    _assert_equal(on_gpu, want, "cuda")
    assert on_gpu["tied"] is on_gpu["w"]  # tied tensors come back as one tensor, on the GPU too
    on_cpu = await aiopersist.load(tmp_path / "ck", backend=backend_name)
    _assert_equal(on_cpu, want, "cpu")
    await aiopersist.verify(tmp_path / "ck")


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.GELU(), torch.nn.Linear(512, 64)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(32, 256, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.mark.asyncio
async def test_load_into_cuda_module_and_optimizer(backend_name: str, tmp_path: Path) -> None:
    model, opt = _model_and_optimizer(0)
    await aiopersist.save({"model": model, "optim": opt}, tmp_path / "ck", backend=backend_name)
    other, other_opt = _model_and_optimizer(1)
    target = {"model": other, "optim": other_opt}
    assert await aiopersist.load(tmp_path / "ck", into=target, backend=backend_name) is target
    for (name, p), q in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert q.is_cuda, name
        assert torch.equal(p, q), name
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            mine = other_opt.state[q][key]
            assert mine.is_cuda
            assert torch.equal(opt.state[p][key], mine)
    # Training goes on from the loaded state on the GPU.
    other(torch.randn(4, 256, device="cuda")).sum().backward()
    other_opt.step()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_mutation_right_after_staged_does_not_reach_the_checkpoint(
    backend_name: str, mode: Any, tmp_path: Path
) -> None:
    w = torch.randn(16 << 20, device="cuda")  # 64 MiB: many chunks through the pinned buffers
    m = torch.randn(4096, 1024, device="cuda")
    state = {"w": w, "mt": m.t(), "m_cols": m[:, 1::2]}
    want = {k: v.clone() for k, v in state.items()}
    async with Checkpointer(backend=backend_name, mode=mode) as ck:
        handle = await ck.save(state, tmp_path / "ck")
        await handle.staged
        # The optimizer step, at once, on the training stream: queued work the save's
        # copies must not see, whatever they still have to do.
        w.mul_(-2).add_(1)
        m.zero_()
        await handle.done
    loaded = await aiopersist.load(tmp_path / "ck", backend=backend_name)
    _assert_equal(loaded, want, "cpu")


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_state_made_on_a_side_stream_with_its_ready_events(
    backend_name: str, mode: Any, tmp_path: Path
) -> None:
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    w = torch.zeros(8 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(300_000_000)  # type: ignore[no-untyped-call]  # the fill comes late
        w.fill_(7.0)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(side)
    async with Checkpointer(backend=backend_name, mode=mode) as ck:
        # The caller's current stream (the default one) knows nothing of the side stream's
        # work: only the event given says where the state is ready.
        handle = await ck.save({"w": w}, tmp_path / "ck", cuda_ready={w.device.index: ready})
        await handle.done
    loaded = await aiopersist.load(tmp_path / "ck", backend=backend_name)
    assert torch.equal(loaded["w"], torch.full((8 << 20,), 7.0))


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_checkpointer_saves_every_kind_of_cuda_tensor(
    backend_name: str, mode: Any, tmp_path: Path
) -> None:
    state = _state()
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    async with Checkpointer(backend=backend_name, mode=mode) as ck:
        for i in range(2):  # the second save reuses the pinned buffers and the snapshot memory
            handle = await ck.save(state, tmp_path / f"ck{i}")
            info = await handle.done
            assert info is not None
            assert handle.staged_seconds is not None  # set once the tensors were free
    for i in range(2):
        _assert_equal(await aiopersist.load(tmp_path / f"ck{i}", map_location="cuda"), want, "cuda")


@pytest.mark.asyncio
async def test_manager_saves_and_restores_cuda_state(backend_name: str, tmp_path: Path) -> None:
    model, opt = _model_and_optimizer(0)
    async with CheckpointManager(tmp_path / "run", keep_last=2, backend=backend_name) as mgr:
        for step in range(1, 4):
            model(torch.randn(8, 256, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
            handle = await mgr.save(step, {"model": model, "optim": opt})
            await handle.staged
        await mgr.wait()
        assert mgr.steps() == [2, 3]
    other, other_opt = _model_and_optimizer(1)
    async with CheckpointManager(tmp_path / "run", backend=backend_name) as mgr:
        await mgr.restore(into={"model": other, "optim": other_opt})
        assert mgr.restored_step == 3
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert q.is_cuda
        assert torch.equal(p, q)


# -- the Hugging Face Trainer and Accelerate on the GPU --------------------------------------


@pytest.fixture
def fresh_accelerate_state() -> Any:
    """Accelerate keeps one process-wide state and refuses another precision (or the GPU
    after ``cpu=True``) once it exists: each of these tests starts and ends without one."""
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    yield
    state.AcceleratorState._reset_state(reset_partial_state=True)


HF_BACKENDS = [
    pytest.param(
        "io_uring",
        marks=pytest.mark.skipif(not aiopersist.probe_io_uring().usable, reason="io_uring unavailable"),
    ),
    "threads",
]


def _gpu_trainer(out: Path, callbacks: list[Any], precision: str, max_steps: int = 6) -> Any:
    transformers = pytest.importorskip("transformers")
    from aiopersist._bench.demo_trainer import Tokens
    from tests._hf_ddp_worker import tiny_gpt2

    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1000,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **{precision: True},
    )
    return transformers.Trainer(
        model=tiny_gpt2(), args=args, train_dataset=Tokens(64, 16, 128), callbacks=callbacks
    )


@pytest.mark.parametrize("backend", HF_BACKENDS)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_trainer_callback_on_the_gpu_saves_what_the_live_trainer_holds(
    tmp_path: Path, backend: str, precision: str
) -> None:
    from safetensors.torch import load_file

    from aiopersist.integrations.transformers import AioPersistCallback

    callback = AioPersistCallback(backend=backend)
    trainer = _gpu_trainer(tmp_path / "run", [callback], precision, max_steps=4)
    trainer.train()
    ckpt = tmp_path / "run" / "checkpoint-4"
    assert str(ckpt) in callback.saved
    asyncio.run(aiopersist.verify(ckpt))
    assert next(trainer.model.parameters()).is_cuda
    # The weights, optimizer and scaler as the live trainer holds them after step 4.
    saved = load_file(ckpt / "model.safetensors")
    live = trainer.model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(tensor, live[name].cpu()), name
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    live_optim = trainer.optimizer.state_dict()
    for index, st in live_optim["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(optim["state"][index][key].cpu(), value.cpu()), (index, key)
    scaler = getattr(trainer.accelerator, "scaler", None)
    if precision == "fp16":
        assert scaler is not None, "fp16 on a GPU trains with a GradScaler"
        assert "scaler.pt" in os.listdir(ckpt)
        assert torch.load(ckpt / "scaler.pt", weights_only=True) == scaler.state_dict()
    else:
        assert "scaler.pt" not in os.listdir(ckpt)
    # A stock Trainer resumes from it on the GPU, with the same precision.
    resumed = _gpu_trainer(tmp_path / "run", [], precision, max_steps=6)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 6
    if precision == "fp16":
        assert resumed.accelerator.scaler is not None


@pytest.mark.parametrize("backend", HF_BACKENDS)
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_save_state_with_fp16_writes_the_scaler(tmp_path: Path, backend: str) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from aiopersist import BlockingCheckpointer
    from aiopersist.integrations.accelerate import save_state_blocking

    accelerator = Accelerator(mixed_precision="fp16")
    model, opt = _model_and_optimizer(0)
    model, opt = accelerator.prepare(model, opt)
    with accelerator.autocast():
        loss = model(torch.randn(8, 256, device="cuda")).float().square().mean()
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    assert accelerator.scaler is not None
    scale = accelerator.scaler.state_dict()

    with BlockingCheckpointer(backend=backend) as ck:
        save_state_blocking(accelerator, tmp_path / "state", checkpointer=ck).wait()
    assert torch.load(tmp_path / "state" / "scaler.pt", weights_only=True) == scale
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.scaler.update(1.0)
    accelerator.load_state(str(tmp_path / "state"))
    assert accelerator.scaler.state_dict() == scale
    for k, v in accelerator.unwrap_model(model).state_dict().items():
        assert v.is_cuda, k
        assert torch.equal(v, weights[k]), k
