"""aiopersist.integrations.accelerate: an asynchronous save_state that Accelerate's own
load_state restores, in one process and under accelerate launch with two, and that
behaves as ``accelerator.save_state`` does: its pre-hooks, existing directories,
automatic checkpoint naming."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import aiopersist
from aiopersist.integrations.accelerate import save_state, save_state_blocking
from tests._launch import run

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "integrations" / "accelerate" / "cpu_2proc.yaml"

BACKENDS = [
    pytest.param(
        "io_uring",
        marks=pytest.mark.skipif(not aiopersist.probe_io_uring().usable, reason="io_uring unavailable"),
    ),
    "threads",
]


def _setup(
    project: ProjectConfiguration | None = None,
) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, project_config=project)
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


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    out.update({f"opt.{k}": v.clone() for k, v in opt.state_dict()["state"][0].items()})
    return out


def _assert_restored(
    model: torch.nn.Module, opt: torch.optim.Optimizer, want: dict[str, torch.Tensor]
) -> None:
    got = _state(model, opt)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _tree(root: Path) -> set[str]:
    """Every file under ``root``, by its path in it."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()}


class _Hooks:
    """A save pre-hook that writes files of its own, one in nested subdirectories, and
    with ``takes_weights`` saves the model's weights itself into a subdirectory (as a
    diffusers hook calls ``save_pretrained``), taking them out of the list, for its load
    pre-hook to restore: ``load_state`` fails unless the checkpoint holds what the hooks
    wrote."""

    def __init__(self, accelerator: Accelerator, takes_weights: bool) -> None:
        self.takes_weights = takes_weights
        self.calls: list[tuple[Any, int, str]] = []
        accelerator.register_save_state_pre_hook(self.save)
        accelerator.register_load_state_pre_hook(self.load)

    def save(
        self, models: list[torch.nn.Module], weights: list[dict[str, torch.Tensor]], output_dir: str
    ) -> None:
        self.calls.append((models, len(weights), output_dir))
        Path(output_dir, "hook.json").write_text(json.dumps({"models": len(models)}))
        Path(output_dir, "extra", "deeper").mkdir(parents=True)
        Path(output_dir, "extra", "deeper", "note.txt").write_text("nested")
        if self.takes_weights:
            os.mkdir(os.path.join(output_dir, "hooked_model"))
            torch.save(weights.pop(), os.path.join(output_dir, "hooked_model", "weights.pt"))

    def load(self, models: list[torch.nn.Module], input_dir: str) -> None:
        assert json.loads(Path(input_dir, "hook.json").read_text()) == {"models": 1}
        assert Path(input_dir, "extra", "deeper", "note.txt").read_text() == "nested"
        if self.takes_weights:
            models.pop().load_state_dict(
                torch.load(os.path.join(input_dir, "hooked_model", "weights.pt"), weights_only=True)
            )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("takes_weights", [False, True], ids=["adds-a-file", "saves-the-weights"])
def test_save_state_pre_hooks_are_called_and_what_they_write_is_saved(
    tmp_path: Path, backend: str, takes_weights: bool
) -> None:
    """The hooks registered with ``register_save_state_pre_hook`` get the Accelerator's
    models and the weights list, as with ``save_state``; what they write goes into the
    checkpoint, the weights they leave are written, and ``load_state`` (with the load
    hooks) restores the checkpoint. The files are the stock save's, plus aiopersist's
    manifest (when the hooks took every model's weights, no data file, as stock)."""
    accelerator, model, opt, sched = _setup()
    hooks = _Hooks(accelerator, takes_weights)
    _step(model, opt, sched)
    saved = _state(model, opt)
    accelerator.save_state(str(tmp_path / "stock"))
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        handle = save_state_blocking(accelerator, tmp_path / "ours", checkpointer=ck)
        handle.wait_staged()
        assert handle.wait() is not None
    ours = _tree(tmp_path / "ours") - {"aiopersist.json"}
    assert ours == _tree(tmp_path / "stock")
    assert "extra/deeper/note.txt" in ours
    assert ("hooked_model/weights.pt" in ours, "model.safetensors" in ours) == (
        takes_weights,
        not takes_weights,
    )
    (stock_call, our_call) = hooks.calls
    assert our_call[0] is accelerator._models
    assert our_call[1] == stock_call[1] == 1
    assert not os.path.exists(our_call[2])  # a staging directory, gone once its files are read
    asyncio.run(aiopersist.verify(tmp_path / "ours"))
    _step(model, opt, sched)
    accelerator.load_state(str(tmp_path / "ours"))
    _assert_restored(model, opt, saved)


class _Recorder:
    """Where the framework's code of a save runs: an object registered for checkpointing
    and a save pre-hook record their thread; the hook also asks the event loop to set an
    event and waits for it, which the loop can only do if the hook does not hold its
    thread."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.threads: dict[str, int] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_ran = threading.Event()
        self.loop_ran_during_hook = False
        accelerator.register_for_checkpointing(self)
        accelerator.register_save_state_pre_hook(self.hook)

    def state_dict(self) -> dict[str, Any]:
        self.threads["state_dict"] = threading.get_ident()
        return {"n": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state == {"n": 1}

    def hook(self, models: Any, weights: Any, output_dir: str) -> None:
        self.threads["hook"] = threading.get_ident()
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.loop_ran.set)
        self.loop_ran_during_hook = self.loop_ran.wait(20)
        Path(output_dir, "hook.txt").write_text("hooked")


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_save_state_runs_hooks_and_state_dicts_off_the_event_loop(tmp_path: Path, backend: str) -> None:
    """The event loop's thread only orchestrates: the save hooks, the state dicts and the
    collectives of the asynchronous ``save_state`` run in a worker thread, so the loop
    goes on meanwhile (a hook that waits for the loop is not deadlocked), and the
    checkpoint is the one ``load_state`` restores."""
    accelerator, model, opt, sched = _setup()
    recorder = _Recorder(accelerator)
    _step(model, opt, sched)
    saved = _state(model, opt)

    async def save() -> int:
        loop_thread = threading.get_ident()
        recorder.loop = asyncio.get_running_loop()
        async with aiopersist.Checkpointer(backend=backend) as ck:
            handle = await save_state(accelerator, tmp_path / "ck", checkpointer=ck)
            await handle.done
        return loop_thread

    loop_thread = asyncio.run(save())
    assert recorder.loop_ran_during_hook
    assert loop_thread not in recorder.threads.values()
    assert set(recorder.threads) == {"hook", "state_dict"}
    assert (tmp_path / "ck" / "hook.txt").read_text() == "hooked"
    _step(model, opt, sched)
    accelerator.load_state(str(tmp_path / "ck"))
    _assert_restored(model, opt, saved)


class _Tied(torch.nn.Module):
    """Two layers sharing one weight (as a language model's embedding and head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 8)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffers_changed_by_the_next_forward_are_saved_as_they_were_at_the_save(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next step's forward runs before the optimizer step that the fence holds back,
    and changes buffers in place (BatchNorm's running statistics, ``num_batches_tracked``).
    The checkpoint holds them as they were at the save, as stock ``save_state``'s does: the
    copies into staging are held back here until that forward has run (the old code wrote
    the next step's statistics)."""
    import aiopersist._stream as stream

    forwarded = threading.Event()
    real = stream._copy_all_jobs

    def after_forward(jobs: Any) -> None:
        forwarded.wait(5)
        real(jobs)

    monkeypatch.setattr(stream, "_copy_all_jobs", after_forward)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    model(torch.randn(4, 32)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    accelerator.save_state(str(tmp_path / "stock"))
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        handle = save_state_blocking(accelerator, tmp_path / "ours", checkpointer=ck)
        loss = model(torch.randn(4, 32)).pow(2).mean()  # the next step's forward
        forwarded.set()
        handle.wait_staged()
        loss.backward()
        opt.step()
        handle.wait()
    stock = _load_weights(tmp_path / "stock" / "model.safetensors")
    ours = _load_weights(tmp_path / "ours" / "model.safetensors")
    assert ours.keys() == stock.keys()
    for key, tensor in stock.items():
        assert torch.equal(ours[key], tensor), key


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "torch-save"])
def test_several_models_are_written_one_file_each_as_stock(
    tmp_path: Path, backend: str, safe_serialization: bool
) -> None:
    """With three models (two of them with tied weights), ``save_state`` writes
    ``model.safetensors``, ``model_1.safetensors``, ``model_2.safetensors`` (with
    ``safe_serialization=False``: ``pytorch_model.bin``, ``pytorch_model_1.bin``...): the
    same files as the stock save (plus the manifest), the same tensors under the same
    names (the alias of a tied weight dropped from a safetensors file, as stock drops
    it), restored by ``load_state``."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    models = [_Tied(), torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)), _Tied()]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    *models, opt = accelerator.prepare(*models, opt)
    x = torch.randn(3, 8)
    (models[1](models[0](x)).sum() + models[2](x).sum()).backward()
    opt.step()
    saved = {f"{i}.{k}": v.clone() for i, m in enumerate(models) for k, v in m.state_dict().items()}
    accelerator.save_state(str(tmp_path / "stock"), safe_serialization=safe_serialization)
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        save_state_blocking(
            accelerator, tmp_path / "ours", checkpointer=ck, safe_serialization=safe_serialization
        ).wait()
    assert _tree(tmp_path / "ours") - {"aiopersist.json"} == _tree(tmp_path / "stock")
    names = (
        ["model.safetensors", "model_1.safetensors", "model_2.safetensors"]
        if safe_serialization
        else ["pytorch_model.bin", "pytorch_model_1.bin", "pytorch_model_2.bin"]
    )
    assert set(names) <= _tree(tmp_path / "ours")
    for name in names:
        stock = _load_weights(tmp_path / "stock" / name)
        ours = _load_weights(tmp_path / "ours" / name)
        assert stock.keys() == ours.keys(), name
        assert all(torch.equal(stock[k], ours[k]) for k in stock), name
    asyncio.run(aiopersist.verify(tmp_path / "ours"))
    with torch.no_grad():
        for p in opt.param_groups[0]["params"]:
            p.zero_()
    accelerator.load_state(str(tmp_path / "ours"))
    got = {f"{i}.{k}": v for i, m in enumerate(models) for k, v in m.state_dict().items()}
    assert all(torch.equal(got[k], v) for k, v in saved.items())


class _Drawing:
    """An object registered with ``register_for_checkpointing`` whose ``state_dict()``
    draws random numbers (a seed for the next epoch's augmentation, say)."""

    def state_dict(self) -> dict[str, Any]:
        return {"seed": int(torch.randint(0, 2**31, ())), "py": random.random()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _rng() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_rng(states: tuple[Any, ...]) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


class _Progress:
    """A registered object whose ``state_dict()`` is its live ``__dict__`` (a common
    pattern), one with a list, and one with an object of its own in it."""

    def __init__(self, owner: bool) -> None:
        self.step = 100
        self.history = [1, 2, 3]
        if owner:  # not plain data: pickled in the call (plain data: its containers copied)
            self.owner = _Owner("run-1")

    def state_dict(self) -> dict[str, Any]:
        return self.__dict__

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class _Owner:
    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Owner) and other.name == self.name

    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize("owner", [False, True], ids=["plain", "with-object"])
@pytest.mark.parametrize("mode", ["fence", "snapshot"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_registered_objects_are_saved_as_they_were_at_the_save(
    tmp_path: Path, backend: str, mode: str, owner: bool
) -> None:
    """``custom_checkpoint_<i>.pkl`` holds an object's state as ``save_state`` was
    called, as stock's does: what the loop changes right after (before the fence) is
    not in it, whether its state is plain data or holds an object of its own."""
    results = {}
    for how in ("stock", "ours"):
        accelerator = _setup()[0]
        progress = _Progress(owner)
        accelerator.register_for_checkpointing(progress)
        out = tmp_path / how
        if how == "stock":
            accelerator.save_state(str(out))
        else:
            checkpointer = aiopersist.BlockingCheckpointer(backend=backend, mode=mode)
            with checkpointer as ck:
                handle = save_state_blocking(accelerator, out, checkpointer=ck)
                progress.step += 1
                progress.history.append(4)
                if owner:
                    progress.owner.name = "run-2"
                handle.wait()
        results[how] = torch.load(out / "custom_checkpoint_0.pkl", weights_only=False)
    expected: dict[str, Any] = {"step": 100, "history": [1, 2, 3]}
    if owner:
        expected["owner"] = _Owner("run-1")
    assert results["ours"] == results["stock"] == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_rotation_sorts_by_number_only_over_the_limit_as_stock(tmp_path: Path, backend: str) -> None:
    """An entry without a number in ``checkpoints/`` (a ``latest`` directory, a README):
    ``save_state`` sorts the entries by their numbers only when over ``total_limit``, so
    saves under it go on; over it, both fail alike."""
    for how in ("stock", "ours"):
        project = ProjectConfiguration(str(tmp_path / how), automatic_checkpoint_naming=True, total_limit=3)
        accelerator = _setup(project)[0]
        (tmp_path / how / "checkpoints" / "latest").mkdir(parents=True)
        with aiopersist.BlockingCheckpointer(backend=backend) as ck:
            for _ in range(2):
                if how == "stock":
                    accelerator.save_state()
                else:
                    save_state_blocking(accelerator, checkpointer=ck).wait()
            with pytest.raises(IndexError):
                if how == "stock":
                    accelerator.save_state()
                else:
                    save_state_blocking(accelerator, checkpointer=ck).wait()
    assert (
        sorted(os.listdir(tmp_path / "ours" / "checkpoints"))
        == sorted(os.listdir(tmp_path / "stock" / "checkpoints"))
        == ["checkpoint_0", "checkpoint_1", "latest"]
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_first_save_refused_leaves_the_project_directory_as_stock(tmp_path: Path, backend: str) -> None:
    """Automatic naming, and the first save's name taken: refused as ``save_state``
    refuses it, and the project directory holds ``checkpoints/`` alone after it, as
    after stock's (aiopersist's work place is made only while a save works there)."""
    for how in ("stock", "ours"):
        project = ProjectConfiguration(str(tmp_path / how), automatic_checkpoint_naming=True)
        accelerator = _setup(project)[0]
        (tmp_path / how / "checkpoints" / "checkpoint_0").mkdir(parents=True)
        with (
            aiopersist.BlockingCheckpointer(backend=backend) as ck,
            pytest.raises(ValueError, match="exists"),
        ):
            if how == "stock":
                accelerator.save_state()
            else:
                save_state_blocking(accelerator, checkpointer=ck)
        assert os.listdir(tmp_path / how) == ["checkpoints"], how
        assert accelerator.save_iteration == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_file_holds_what_stock_writes_taken_in_its_order(tmp_path: Path, backend: str) -> None:
    """From the same RNG states, the stock save and ours write the same files with the
    same contents, ``random_states_0.pkl`` included: the RNG states are taken where
    ``save_state`` takes them, before the objects registered for checkpointing give
    their ``state_dict()`` (here one that draws random numbers), so that a resume from
    ours draws what a resume from the stock checkpoint draws."""
    accelerator, model, opt, sched = _setup()
    accelerator.register_for_checkpointing(_Drawing())
    _step(model, opt, sched)
    before = _rng()
    accelerator.save_state(str(tmp_path / "stock"))
    after_stock = _rng()
    _set_rng(before)
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        save_state_blocking(accelerator, tmp_path / "ours", checkpointer=ck).wait()
    assert _same(_rng(), after_stock)
    names = _tree(tmp_path / "stock")
    assert _tree(tmp_path / "ours") - {"aiopersist.json"} == names
    assert {"random_states_0.pkl", "custom_checkpoint_0.pkl"} <= names
    for name in sorted(names):
        stock, ours = tmp_path / "stock" / name, tmp_path / "ours" / name
        if name.endswith(".safetensors"):
            assert _same(_load_weights(stock), _load_weights(ours)), name
        else:
            assert _same(torch.load(stock, weights_only=False), torch.load(ours, weights_only=False)), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_state_into_existing_directories(tmp_path: Path, backend: str) -> None:
    """An existing empty directory is taken, as ``save_state`` takes it. A non-empty one,
    which ``save_state`` writes into, is refused (``CheckpointExistsError``) unless
    ``overwrite=True``, which replaces it as a whole."""
    accelerator, model, opt, sched = _setup()
    _step(model, opt, sched)
    saved = _state(model, opt)
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("an earlier run's")
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        save_state_blocking(accelerator, tmp_path / "empty", checkpointer=ck).wait()
        with pytest.raises(aiopersist.CheckpointExistsError):
            save_state_blocking(accelerator, tmp_path / "full", checkpointer=ck)
        assert os.listdir(tmp_path / "full") == ["notes.txt"]
        save_state_blocking(accelerator, tmp_path / "full", checkpointer=ck, overwrite=True).wait()
    assert "notes.txt" not in os.listdir(tmp_path / "full")
    for name in ("empty", "full"):
        _step(model, opt, sched)
        accelerator.load_state(str(tmp_path / name))
        _assert_restored(model, opt, saved)


@pytest.mark.parametrize("backend", BACKENDS)
def test_automatic_checkpoint_naming_and_total_limit_as_stock(tmp_path: Path, backend: str) -> None:
    """``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)``: the
    checkpoints are named, counted and deleted as ``save_state`` does them, an existing
    name is refused as there (after the deletion, as there), and ``load_state()`` with no
    directory restores the newest."""
    project = {"automatic_checkpoint_naming": True, "total_limit": 2}
    stock, stock_model, stock_opt, stock_sched = _setup(
        ProjectConfiguration(str(tmp_path / "stock"), **project)
    )
    ours, model, opt, sched = _setup(ProjectConfiguration(str(tmp_path / "ours"), **project))

    def names(accelerator: Accelerator) -> list[str]:
        return sorted(os.listdir(os.path.join(accelerator.project_dir, "checkpoints")))

    async def run() -> dict[str, torch.Tensor]:
        async with aiopersist.Checkpointer(backend=backend) as ck:
            for _ in range(3):
                _step(stock_model, stock_opt, stock_sched)
                stock.save_state()
                _step(model, opt, sched)
                handle = await save_state(ours, checkpointer=ck)
                await handle.staged
            await handle.done
            assert names(ours) == names(stock) == ["checkpoint_1", "checkpoint_2"]
            # Nothing but checkpoints/ in the project directory between saves, as stock.
            assert os.listdir(ours.project_dir) == os.listdir(stock.project_dir) == ["checkpoints"]
            assert ours.save_iteration == stock.save_iteration == 3
            for accelerator in (stock, ours):
                accelerator.project_configuration.iteration -= 1  # the name of the last one, again
            with pytest.raises(ValueError, match="already exists"):
                stock.save_state()
            with pytest.raises(ValueError, match="already exists"):
                await save_state(ours, checkpointer=ck)
        return _state(model, opt)

    saved = asyncio.run(run())
    assert names(ours) == names(stock) == ["checkpoint_2"]
    assert os.listdir(ours.project_dir) == os.listdir(stock.project_dir) == ["checkpoints"]
    _step(model, opt, sched)
    ours.load_state()
    _assert_restored(model, opt, saved)


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_dirs_that_name_no_directory_or_a_link_as_stock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """``output_dir=""`` is refused (``FileNotFoundError``, as ``save_state``'s), not taken
    for the current directory, which ``overwrite=True`` would replace whole; ``None``
    without automatic naming raises ``TypeError`` as there; neither counts an iteration.
    A link to a directory is written through, the link kept, as ``save_state`` does."""
    accelerator, model, opt, sched = _setup()
    _step(model, opt, sched)
    saved = _state(model, opt)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "precious.txt").write_text("the user's")
    monkeypatch.chdir(cwd)
    with pytest.raises(FileNotFoundError):
        accelerator.save_state("")  # stock
    with pytest.raises(TypeError):
        accelerator.save_state(None)
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        for overwrite in (False, True):
            with pytest.raises(FileNotFoundError, match="empty path"):
                save_state_blocking(accelerator, "", checkpointer=ck, overwrite=overwrite)
        with pytest.raises(TypeError, match="needs output_dir"):
            save_state_blocking(accelerator, None, checkpointer=ck)
        assert os.listdir(cwd) == ["precious.txt"]
        assert accelerator.save_iteration == 0
        for name in ("real", "real-full"):
            (tmp_path / name).mkdir()
            (tmp_path / f"{name}-link").symlink_to(tmp_path / name)
        (tmp_path / "real-full" / "old.txt").write_text("an earlier run's")
        handle = save_state_blocking(accelerator, tmp_path / "real-link", checkpointer=ck)
        handle.wait()
        assert handle.path == str(tmp_path / "real")
        with pytest.raises(aiopersist.CheckpointExistsError):
            save_state_blocking(accelerator, tmp_path / "real-full-link", checkpointer=ck)
        save_state_blocking(accelerator, tmp_path / "real-full-link", checkpointer=ck, overwrite=True).wait()
    for name in ("real", "real-full"):
        assert (tmp_path / f"{name}-link").is_symlink()
        assert "model.safetensors" in os.listdir(tmp_path / name)
        assert "old.txt" not in os.listdir(tmp_path / name)
        _step(model, opt, sched)
        accelerator.load_state(str(tmp_path / f"{name}-link"))
        _assert_restored(model, opt, saved)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_rotation_counts_every_entry_and_deletes_no_file_as_stock(tmp_path: Path, backend: str) -> None:
    """``total_limit`` counts every entry of ``checkpoints/``, a hidden one of the user's
    too, as ``save_state`` does; an entry to delete that is not a directory fails the
    save with ``NotADirectoryError`` as there, and nothing is deleted (``save_state``
    fails on it too, after the older ones)."""
    project = {"automatic_checkpoint_naming": True, "total_limit": 2}
    stock, stock_model, stock_opt, stock_sched = _setup(
        ProjectConfiguration(str(tmp_path / "stock"), **project)
    )
    ours, model, opt, sched = _setup(ProjectConfiguration(str(tmp_path / "ours"), **project))
    for accelerator in (stock, ours):
        base = Path(accelerator.project_dir) / "checkpoints"
        base.mkdir(parents=True)
        (base / ".cache_7").mkdir()  # the user's, numbered after the checkpoints to come
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        for _ in range(3):
            _step(stock_model, stock_opt, stock_sched)
            stock.save_state()
            _step(model, opt, sched)
            save_state_blocking(ours, checkpointer=ck).wait()
        kept = sorted(os.listdir(Path(ours.project_dir) / "checkpoints"))
        assert (
            kept
            == sorted(os.listdir(Path(stock.project_dir) / "checkpoints"))
            == [".cache_7", "checkpoint_2"]
        )
        for accelerator in (stock, ours):
            (Path(accelerator.project_dir) / "checkpoints" / "notes_0.txt").write_text("the user's")
        with pytest.raises(NotADirectoryError):
            stock.save_state()
        with pytest.raises(NotADirectoryError, match=r"notes_0\.txt"):
            save_state_blocking(ours, checkpointer=ck)
    assert sorted(os.listdir(Path(ours.project_dir) / "checkpoints")) == [
        ".cache_7",
        "checkpoint_2",
        "notes_0.txt",
    ]
    assert ours.save_iteration == stock.save_iteration == 3


class _Views(torch.nn.Module):
    """Buffers that share memory: one a view of a weight, one an alias of another buffer
    (in a module after those, so that the names dropped are theirs, which load_state then
    tolerates), beside BatchNorm (a module version in ``_metadata``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.views = torch.nn.Module()
        self.views.register_buffer("row0", self.lin.weight.data[0])
        self.views.register_buffer("alias", self.bn.running_mean)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


class _Extra(torch.nn.Linear):
    def get_extra_state(self) -> dict[str, int]:
        return {"calls": 3}

    def set_extra_state(self, state: Any) -> None:
        pass


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "torch-save"])
def test_a_state_with_shared_memory_and_module_versions_is_written_as_stock(
    tmp_path: Path, backend: str, safe_serialization: bool
) -> None:
    """Tensors sharing memory are written as ``save_state`` writes them (the later names
    dropped in safetensors; the buffers are still copies taken at the save), module
    versions kept in ``pytorch_model.bin``, and ``load_state`` restores both; a model
    bigger than the checkpointer's shards still goes into one ``model.safetensors``."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_Views())
    model(torch.randn(4, 8))
    with aiopersist.BlockingCheckpointer(backend=backend, max_shard_bytes=1024) as ck:
        accelerator.save_state(str(tmp_path / "stock"), safe_serialization=safe_serialization)
        handle = save_state_blocking(
            accelerator, tmp_path / "ours", checkpointer=ck, safe_serialization=safe_serialization
        )
        handle.wait_staged()
        model(torch.randn(4, 8))  # changes the running statistics in place
        handle.wait()
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    assert sorted(os.listdir(ours)) == sorted([*os.listdir(stock), "aiopersist.json"])
    if safe_serialization:
        theirs, mine = load_file(stock / "model.safetensors"), load_file(ours / "model.safetensors")
    else:
        theirs = torch.load(stock / "pytorch_model.bin", weights_only=True)
        mine = torch.load(ours / "pytorch_model.bin", weights_only=True)
        assert mine._metadata == theirs._metadata  # the modules' versions
        assert (
            mine["views.row0"].untyped_storage().data_ptr() == mine["lin.weight"].untyped_storage().data_ptr()
        )
    assert sorted(mine) == sorted(theirs)
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator.load_state(str(stock))
    stock_loaded = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(4, 8))
    accelerator.load_state(str(ours))
    for name, value in model.state_dict().items():
        assert torch.equal(value, stock_loaded[name]), name
    assert not all(
        torch.equal(saved[k], stock_loaded[k]) for k in saved
    )  # the save's, not the last forward's


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_entry_that_is_not_a_tensor_is_refused_by_name(tmp_path: Path, backend: str) -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_Extra(4, 4))
    with pytest.raises(AttributeError):
        accelerator.save_state(str(tmp_path / "stock"))  # stock: the cleaning fails on it
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        with pytest.raises(aiopersist.UnsupportedStateError, match="'_extra_state' = dict"):
            save_state_blocking(accelerator, tmp_path / "ours", checkpointer=ck)
        assert not (tmp_path / "ours").exists()
        save_state_blocking(
            accelerator, tmp_path / "pickled", checkpointer=ck, safe_serialization=False
        ).wait()
    assert torch.load(tmp_path / "pickled" / "pytorch_model.bin", weights_only=True)["_extra_state"] == {
        "calls": 3
    }
    del model


def _launch(tmp_path: Path, mode: str, **env: str) -> list[dict[str, Any]]:
    """``tests._accelerate_worker`` in ``mode`` under ``accelerate launch`` (two processes
    on CPU): each process's JSON line, by rank."""
    accelerate = Path(sys.executable).parent / "accelerate"
    proc = subprocess.run(
        [
            str(accelerate), "launch", "--config_file", str(CONFIG), "--main_process_port", str(_free_port()),
            "-m", "tests._accelerate_worker", str(tmp_path), mode,
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False, env={**os.environ, **env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sorted(
        (json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")), key=lambda o: o["rank"]
    )


def test_save_state_under_accelerate_launch_two_processes(tmp_path: Path) -> None:
    outs = _launch(tmp_path, "save-state")
    assert [o["rank"] for o in outs] == [0, 1]
    assert all(o["restored"] for o in outs)
    names = set(os.listdir(tmp_path / "ck"))
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "optimizer.bin"} <= names
    # Every rank's save hook ran; process 0's files are the ones written.
    assert [o["hooked"] for o in outs] == [1, 1]
    assert json.loads((tmp_path / "ck" / "hook.json").read_text()) == {"rank": 0}


def test_save_state_into_a_directory_per_process_writes_each_as_stock(tmp_path: Path) -> None:
    """Two processes under ``accelerate launch``, each naming a directory of its own (as
    a ``tempfile.TemporaryDirectory()`` made on each does): ``save_state`` writes into
    each what its process writes, its RNG state and its hook's file (process 0 the rest),
    and each process's ``load_state`` of its own directory brings back its RNG state."""
    outs = _launch(tmp_path, "own-directories")
    assert outs == [{"rank": 0, "restored": True}, {"rank": 1, "restored": True}]
    for rank in (0, 1):
        assert _tree(tmp_path / f"ours-{rank}") - {"aiopersist.json"} == _tree(tmp_path / f"stock-{rank}")
        assert f"random_states_{rank}.pkl" in _tree(tmp_path / f"ours-{rank}")
        assert f"hook-{rank}.json" in _tree(tmp_path / f"ours-{rank}")
        asyncio.run(aiopersist.verify(tmp_path / f"ours-{rank}"))


def test_a_process_whose_directory_is_taken_fails_every_process_at_once(tmp_path: Path) -> None:
    """Rank 1's output_dir is not empty: it raises CheckpointExistsError, rank 0
    RankFailedError naming it (the old code left rank 0 waiting for rank 1 in a gather
    until AIOPERSIST_DIST_TIMEOUT, here 60 s, then failing with another message), nothing
    of rank 1's is touched, and the next save_state works on both."""
    outs = _launch(tmp_path, "one-directory-taken", AIOPERSIST_DIST_TIMEOUT="60")
    assert outs[1]["first"].startswith("CheckpointExistsError:"), outs
    assert outs[0]["first"].startswith(
        "RankFailedError: save_state failed on rank 1: CheckpointExistsError"
    ), outs
    assert outs[0]["second"] == outs[1]["second"] == "ok", outs
    assert (tmp_path / "ck-1" / "mine.txt").read_text() == "kept"
    assert not (tmp_path / "ck-0").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_process_stopped_in_save_state_fails_the_others_within_the_timeout(tmp_path: Path) -> None:
    """Automatic naming: process 1 is stopped (SIGSTOP) right after save_state's check
    that its directory is free. Process 0 raises RankFailedError naming it within
    AIOPERSIST_DIST_TIMEOUT (5 s); the old code waited in the training's own barrier
    (accelerator.wait_for_everyone) for the process group's timeout (30 s here, 30
    minutes by default), then raised torch's error. The first checkpoint stays."""
    accelerate = Path(sys.executable).parent / "accelerate"
    proc = subprocess.run(
        [
            str(accelerate), "launch", "--config_file", str(CONFIG), "--main_process_port", str(_free_port()),
            "-m", "tests._accelerate_worker", str(tmp_path), "stopped-after-check",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "AIOPERSIST_DIST_TIMEOUT": "5"},
    )  # fmt: skip
    outs = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert [o["rank"] for o in outs] == [0], (outs, proc.stderr[-3000:])  # process 1 was killed stopped
    second = outs[0]["second"]
    assert second.startswith("RankFailedError: rank 0: exchanging checkpoint metadata"), outs
    assert "rank 1 did not come to it" in second, outs
    assert os.listdir(tmp_path / "project" / "checkpoints") == ["checkpoint_0"]


@pytest.mark.parametrize("api", ["blocking", "async"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_save_state_under_fsdp2_is_the_stock_layout_and_load_state_restores_it(
    tmp_path: Path, backend: str, api: str
) -> None:
    """Two processes, FSDP2 with SHARDED_STATE_DICT (Accelerate made to take the plugin on
    CPU: tests/_cpu_fsdp.py): every process writes its shards; the checkpoint has the
    stock save_state's files (plus the manifests), and the stock load_state restores the
    weights, the RNG states and the scheduler, so that the next step ends as it does
    from the stock checkpoint, bit for bit."""
    proc = run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(_free_port()),
            "-m", "tests._accelerate_fsdp_worker", str(tmp_path), backend, api,
        ],
        cwd=ROOT, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("report-*.json"))]
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["stock_restored"]
        assert r["ours_restored"]
        assert r["ours_rng"]
        assert r["same_end"]
        assert r["hook_loads"] == ['{"models": 2}'] * 2  # what the save hook wrote, both times

    def files(d: Path) -> set[str]:
        return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}

    # Two models, each with its optimizer: one DCP directory each, as the stock save.
    dcp_dirs = ["pytorch_model_fsdp_0", "pytorch_model_fsdp_1", "optimizer_0", "optimizer_1"]
    assert {d for d in dcp_dirs if (tmp_path / "stock" / d / ".metadata").is_file()} == set(dcp_dirs)
    manifests = {"aiopersist.json", *(f"{d}/aiopersist.json" for d in dcp_dirs)}
    assert files(tmp_path / "ours") == files(tmp_path / "stock") | manifests
    assert reports[0]["verify"] == len(files(tmp_path / "ours")) - 1
    # A registered object as it was at the save, as stock's, though changed once staged.
    assert reports[0]["custom"] == [{"step": 100, "history": [1, 2, 3]}] * 2


class _Stuck:
    """Pickled by ``torch.save`` inside a save (in an optimizer's state: an object of its
    own, so ``optimizer.bin`` is pickled while it is written): holds the save in flight."""

    def __reduce__(self) -> Any:
        print("saving", flush=True)
        time.sleep(600)
        return (int, (0,))


class _Custom:
    """An object registered with ``register_for_checkpointing`` (``custom_checkpoint_0.pkl``)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _hook_stuck_after_the_first(models: Any, weights: Any, output_dir: str) -> None:
    os.makedirs(os.path.join(output_dir, "hooked"), exist_ok=True)
    Path(output_dir, "hooked", "note.txt").write_text("hooked")
    if os.environ.get("STUCK_IN") == "hook" and os.listdir(Path(os.environ["PROJECT"], "checkpoints")):
        print("saving", flush=True)
        time.sleep(600)


_KILLED = """
import os, sys
sys.path.insert(0, {root!r})
import torch
from accelerate.utils import ProjectConfiguration
import aiopersist
from aiopersist.integrations.accelerate import save_state_blocking
from tests.e2e.test_accelerate import _Custom, _Stuck, _hook_stuck_after_the_first, _setup, _step

project = os.environ["PROJECT"]
config = ProjectConfiguration(project, automatic_checkpoint_naming=True, total_limit=3)
accelerator, model, opt, sched = _setup(config)
accelerator.register_for_checkpointing(_Custom())
accelerator.register_save_state_pre_hook(_hook_stuck_after_the_first)
_step(model, opt, sched)
with aiopersist.BlockingCheckpointer(backend={backend!r}) as ck:
    save_state_blocking(accelerator, checkpointer=ck).wait()
    torch.save(model.state_dict(), os.path.join(project, "saved.pt"))
    _step(model, opt, sched)
    if os.environ["STUCK_IN"] == "save":
        next(iter(opt.state.values()))["stuck"] = _Stuck()
    save_state_blocking(accelerator, checkpointer=ck).wait()
"""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stuck_in", ["save", "hook"])
def test_a_save_killed_with_automatic_naming_leaves_nothing_that_load_state_takes(
    tmp_path: Path, backend: str, stuck_in: str
) -> None:
    """Automatic naming: ``load_state()`` with no directory takes the entry of
    ``checkpoints/`` with the highest number, hidden ones too. A process killed (kill -9)
    with a save in flight, or while its save hooks write, leaves nothing there: a stock
    ``load_state()`` restores the last complete checkpoint, and the next save removes
    what the killed one left in the staging place."""
    import signal

    project = tmp_path / "project"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED.format(root=str(ROOT), backend=backend)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "STUCK_IN": stuck_in, "PROJECT": str(project)},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "saving"  # the second save is in flight
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    staging = project / ".aiopersist-staging"
    assert os.listdir(project / "checkpoints") == ["checkpoint_0"]
    assert [n for n in os.listdir(staging) if ".aiopersist-tmp-" in n]  # what the kill left

    config = ProjectConfiguration(str(project), automatic_checkpoint_naming=True, total_limit=3)
    accelerator, model, opt, sched = _setup(config)
    accelerator.register_for_checkpointing(_Custom())
    _step(model, opt, sched)
    accelerator.load_state()  # the stock loader, no directory: the newest checkpoint
    saved = torch.load(project / "saved.pt", weights_only=True)
    for k, v in saved.items():
        assert torch.equal(model.state_dict()[k], v), k
    accelerator.project_configuration.iteration = 1
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        save_state_blocking(accelerator, checkpointer=ck).wait()
    assert not staging.exists()  # the leftovers are gone, and so is the place, emptied
    assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_0", "checkpoint_1"]


@pytest.mark.parametrize("layout", ["bind-mount", "read-only-project"])
def test_automatic_naming_where_the_staging_place_cannot_be_used_saves_beside(
    tmp_path: Path, layout: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``checkpoints/`` a bind mount of a directory of the same disk (same device number,
    yet a rename into it fails with ``EXDEV``), or a writable mount in a project directory
    that cannot be written: the saves work as stock ones do, their work in progress beside
    the checkpoints, with a warning."""
    import subprocess as sp

    from tests.conftest import bind_mounted, mounted_tmpfs

    project = tmp_path / "project"
    with contextlib.ExitStack() as stack:
        if layout == "bind-mount":
            (tmp_path / "volume").mkdir()
            stack.enter_context(bind_mounted(tmp_path / "volume", project / "checkpoints"))
        else:
            stack.enter_context(mounted_tmpfs(project, "size=4m"))
            stack.enter_context(mounted_tmpfs(project / "checkpoints", "size=16m"))
            sp.run(["mount", "-o", "remount,ro", str(project)], check=True)
        config = ProjectConfiguration(str(project), automatic_checkpoint_naming=True, total_limit=2)
        accelerator, model, opt, sched = _setup(config)
        with aiopersist.BlockingCheckpointer() as ck, caplog.at_level("WARNING", logger="aiopersist"):
            for _ in range(3):
                _step(model, opt, sched)
                save_state_blocking(accelerator, checkpointer=ck).wait()
        saved = _state(model, opt)
        assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
        assert "stay beside them" in caplog.text
        _step(model, opt, sched)
        accelerator.load_state()
        _assert_restored(model, opt, saved)
