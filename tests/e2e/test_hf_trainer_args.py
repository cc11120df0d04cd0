"""AioPersistCallback under ``TrainingArguments`` that change what the Trainer writes or
reads at the end of training: each run is compared with a stock Trainer's run of the
same training (files, weights, ``trainer_state.json``). The helpers and the tiny GPT-2
are those of ``test_hf_trainer``."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aiopersist.integrations.transformers import AioPersistCallback  # noqa: E402
from tests.conftest import Gate  # noqa: E402
from tests.e2e.test_hf_trainer import (  # noqa: E402
    BACKENDS,
    StockRun,
    _assert_matches_stock,
    _NormedLM,
    _trainer,
    _weights,
)


class _GateOptimizerAt(transformers.TrainerCallback):  # type: ignore[misc]
    """After the optimizer step of step ``step``, put ``gate`` into the optimizer's first
    parameter group: the next ``optimizer.pt`` written, the save of that step's
    checkpoint, is held while ``torch.save`` pickles it, until the gate opens."""

    def __init__(self, step: int, gate: Gate) -> None:
        self.step, self.gate = step, gate

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
        if state.global_step == self.step:
            optimizer.param_groups[0]["gate"] = self.gate


class _StopOnSave(transformers.TrainerCallback):  # type: ignore[misc]
    """Stop training in ``on_save`` (after the save of an epoch's end, which follows
    ``on_epoch_end``), at step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step >= self.step:
            control.should_training_stop = True


class _OpenGate(transformers.TrainerCallback):  # type: ignore[misc]
    """Open ``gate`` at the Trainer's closing log (``train_runtime``), which comes before
    transformers 5 loads the best model and deletes all checkpoints but the best; or two
    seconds after the save (transformers 4 loads the best model before that log, with no
    event in between: the callback waits there for the save, which the timer lets go)."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.timer: threading.Timer | None = None

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.timer is None and not self.gate.go.is_set():
            self.timer = threading.Timer(2.0, self.gate.go.set)
            self.timer.daemon = True
            self.timer.start()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "train_runtime" in logs:
            self.gate.go.set()

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.timer is not None:
            self.timer.cancel()


# Three epochs of 4 steps, evaluated and saved at each epoch's end; the loss falls, so each
# checkpoint is the best so far; training is stopped in on_save at the end of the second.
EPOCHS: dict[str, Any] = {
    "max_steps": -1,
    "num_train_epochs": 3,
    "per_device_train_batch_size": 16,
    "save_strategy": "epoch",
    "eval_strategy": "epoch",
    "metric_for_best_model": "loss",
    "load_best_model_at_end": True,
    "save_total_limit": 1,
}


class _Warnings(logging.Handler):
    """The warnings of the Trainer's own logger."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _stopped_after_its_save(run: Path, gate: Gate, extra: list[Any]) -> Any:
    callbacks = [_GateOptimizerAt(8, gate), _StopOnSave(8), _OpenGate(gate), *extra]
    trainer = _trainer(run, callbacks, **EPOCHS)
    warnings = _Warnings()
    logger = logging.getLogger("transformers.trainer")
    logger.addHandler(warnings)
    try:
        trainer.train()
    finally:
        logger.removeHandler(warnings)
    # The best checkpoint was there to load (where it is not, the Trainer says so and
    # keeps the weights it has).
    assert not [m for m in warnings.messages if "Could not locate the best model" in m]
    return trainer


@pytest.fixture(scope="module")
def stock_stopped(tmp_path_factory: pytest.TempPathFactory) -> StockRun:
    gate = Gate()
    gate.go.set()  # the stock save pickles the optimizer in the training thread
    run = tmp_path_factory.mktemp("stock-stopped") / "run"
    trainer = _stopped_after_its_save(run, gate, [])
    stock = StockRun(run, _weights(trainer), dataclasses.asdict(trainer.state))
    assert trainer.state.global_step == 8
    assert os.path.basename(stock.state["best_model_checkpoint"]) == "checkpoint-8"
    assert sorted(os.listdir(run)) == ["checkpoint-8"]
    return stock


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stop_after_the_last_save_finds_it_complete_at_the_end_as_stock(
    tmp_path: Path, backend: str, stock_stopped: StockRun
) -> None:
    """Training stopped after the last ``on_epoch_end`` (here by a callback's ``on_save``)
    while its last checkpoint is still being written: the Trainer's end of training
    (``load_best_model_at_end``, the deletion of all checkpoints but the best with
    ``save_total_limit=1``) waits for it, and the run ends as the stock one. The save is
    held until the Trainer's closing log (`_OpenGate`)."""
    gate = Gate()
    callback = AioPersistCallback(backend=backend, durable_on_save=False)
    trainer = _stopped_after_its_save(tmp_path / "run", gate, [callback])
    assert gate.entered.is_set()  # the save of checkpoint-8 was held
    _assert_matches_stock(tmp_path / "run", callback, trainer, stock_stopped)
    assert "_load_best_model" not in vars(trainer)


needs_save_safetensors = pytest.mark.skipif(
    "save_safetensors" not in {f.name for f in dataclasses.fields(transformers.TrainingArguments)},
    reason="transformers 5 has no save_safetensors: it always writes safetensors",
)


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return _NormedLM()


@needs_save_safetensors
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pretrained", [True, False], ids=["gpt2", "module"])
def test_save_safetensors_false_writes_pytorch_model_bin_as_stock(
    tmp_path: Path, backend: str, pretrained: bool
) -> None:
    """``save_safetensors=False`` (transformers 4): the weights are ``pytorch_model.bin``,
    a ``PreTrainedModel``'s as its ``save_pretrained`` writes them, any other module's
    state dict as ``torch.save`` writes it; ``load_best_model_at_end`` (which looks for
    that file) loads the best checkpoint, and the run ends as the stock one."""
    options: dict[str, Any] = {
        "save_safetensors": False,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "metric_for_best_model": "loss",
        "greater_is_better": True,  # the first checkpoint is the best: the one loaded at the end
        "load_best_model_at_end": True,
        "save_total_limit": 1,
        "max_steps": 4,
    }
    runs = {}
    for name, extra in (("stock", []), ("ours", [AioPersistCallback(backend=backend)])):
        trainer = _trainer(tmp_path / name, extra, **options)
        if not pretrained:
            trainer = transformers.Trainer(
                model=_module(),
                args=trainer.args,
                train_dataset=trainer.train_dataset,
                eval_dataset=trainer.eval_dataset,
                callbacks=extra,
            )
        trainer.train()
        runs[name] = trainer
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "stock")) == ["checkpoint-2"]
    ours, stock = tmp_path / "ours" / "checkpoint-2", tmp_path / "stock" / "checkpoint-2"
    assert set(os.listdir(ours)) - {"aiopersist.json"} == set(os.listdir(stock))
    assert "pytorch_model.bin" in os.listdir(ours)
    mine = torch.load(ours / "pytorch_model.bin", weights_only=True)
    theirs = torch.load(stock / "pytorch_model.bin", weights_only=True)
    assert type(mine) is type(theirs)
    assert getattr(mine, "_metadata", None) == getattr(theirs, "_metadata", None)
    assert list(mine) == list(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(mine[key], tensor), key
    got, want = _weights(runs["ours"]), _weights(runs["stock"])  # the best, loaded at the end
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
