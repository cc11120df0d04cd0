"""AioPersistCallback with a real Hugging Face Trainer: a tiny GPT-2 built from a config,
trained on generated tokens, offline. Checkpoints written by the callback must be the
Trainer's own, so that a stock Trainer resumes from them bit-exactly, and a run with the
callback must end as a stock run does: the same weights, checkpoints, best checkpoint and
``trainer_state.json``. Stock reference runs are made once per module."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch

transformers = pytest.importorskip("transformers")

import aiopersist  # noqa: E402
from aiopersist._bench.demo_trainer import Tokens  # noqa: E402
from aiopersist._manager import check_step  # noqa: E402
from aiopersist.integrations.transformers import (  # noqa: E402
    AioPersistCallback,
    _checkpoints,
    to_rotate,
)
from tests._hf_ddp_worker import tiny_gpt2  # noqa: E402
from tests._launch import popen, run  # noqa: E402
from tests.conftest import flip_byte  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BACKENDS = [
    pytest.param(
        "io_uring",
        marks=pytest.mark.skipif(not aiopersist.probe_io_uring().usable, reason="io_uring unavailable"),
    ),
    "threads",
]

# Evaluation every 2 steps, on the steps that save, with a log entry at every step.
EVAL: dict[str, Any] = {
    "eval_strategy": "steps",
    "eval_steps": 2,
    "logging_steps": 1,
    "metric_for_best_model": "loss",
}
# The best checkpoint is the first (the highest loss is "better"), so it is the oldest
# one: rotation must keep it, and load_best_model_at_end goes back to its weights. With
# save_total_limit=1 the stock end of training deletes every other checkpoint.
BEST_FIRST: dict[str, Any] = {
    **EVAL,
    "greater_is_better": True,
    "save_total_limit": 1,
    "load_best_model_at_end": True,
}
# save_strategy="best": a checkpoint at each new best (the loss falls at every evaluation).
SAVE_BEST: dict[str, Any] = {
    **EVAL,
    "save_strategy": "best",
    "save_total_limit": 2,
    "load_best_model_at_end": True,
}


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


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _comparable(state: dict[str, Any]) -> dict[str, Any]:
    """A ``trainer_state.json`` (or a live state's dict) without what differs between two
    runs of the same training: the timings in the log, and the run directory in
    ``best_model_checkpoint``."""
    out = dict(state)
    out["log_history"] = [
        {k: v for k, v in entry.items() if not k.endswith(("_runtime", "_per_second"))}
        for entry in state["log_history"]
    ]
    if out.get("best_model_checkpoint"):
        out["best_model_checkpoint"] = os.path.basename(out["best_model_checkpoint"])
    return out


def _saved_state(checkpoint: Path) -> dict[str, Any]:
    return _comparable(json.loads((checkpoint / "trainer_state.json").read_text()))


def _checkpoint_names(run: Path) -> list[str]:
    return sorted(n for n in os.listdir(run) if n.startswith("checkpoint-"))


class _StopAt(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step >= self.step:
            control.should_training_stop = True


@dataclasses.dataclass
class StockRun:
    """A stock Trainer's run: where it saved, its final weights and state."""

    run: Path
    weights: dict[str, torch.Tensor]
    state: dict[str, Any]


def _stock_run(run: Path, **kw: Any) -> StockRun:
    trainer = _trainer(run, [], **kw)
    trainer.train()
    return StockRun(run, _weights(trainer), dataclasses.asdict(trainer.state))


@pytest.fixture(scope="module")
def stock_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The weights of a stock Trainer that never stops and saves nothing."""
    return _stock_run(tmp_path_factory.mktemp("stock") / "run", save_strategy="no").weights


def _assert_matches_stock(run: Path, callback: AioPersistCallback, trainer: Any, stock: StockRun) -> None:
    """The callback's run ended as the stock one: the same weights, best checkpoint,
    checkpoint directories, files and ``trainer_state.json`` (and a complete, verified
    aiopersist checkpoint in every directory)."""
    _assert_same_weights(_weights(trainer), stock.weights)
    mine = _comparable(dataclasses.asdict(trainer.state))
    theirs = _comparable(stock.state)
    for key in ("best_model_checkpoint", "best_metric", "best_global_step"):
        assert mine[key] == theirs[key], key
    assert mine == theirs  # the log too
    assert _checkpoint_names(run) == _checkpoint_names(stock.run)
    for name in _checkpoint_names(run):
        ours, stocks = run / name, stock.run / name
        assert set(os.listdir(ours)) - {"aiopersist.json"} == set(os.listdir(stocks)), name
        assert _saved_state(ours) == _saved_state(stocks), name
        for small in ("config.json", "generation_config.json"):
            assert (ours / small).read_bytes() == (stocks / small).read_bytes(), (name, small)
        asyncio.run(aiopersist.verify(ours))  # raises unless complete, every checksum right
        assert str(ours) in callback.saved
    assert "_save_checkpoint" not in vars(trainer)  # the Trainer is given back as it was


@pytest.mark.parametrize(
    ("backend", "mode"),
    [
        ("threads", "fence"),
        pytest.param("io_uring", "fence", marks=BACKENDS[0].marks),
        ("threads", "snapshot"),
    ],
)
def test_stock_trainer_resumes_bit_exactly_from_callback_checkpoints(
    tmp_path: Path, backend: str, mode: Any, stock_weights: dict[str, torch.Tensor]
) -> None:
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
    report = asyncio.run(aiopersist.verify(ckpt))
    assert {os.path.basename(f) for f in report.files} >= {"model.safetensors", "optimizer.pt"}

    # A stock Trainer, knowing nothing of aiopersist, resumes and ends where the
    # uninterrupted run ended: bit for bit.
    resumed = _trainer(tmp_path / "run", [])
    resumed.train(resume_from_checkpoint=str(ckpt))
    _assert_same_weights(_weights(resumed), stock_weights)

    # from_pretrained reads the checkpoint directly.
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(ckpt))
    state4 = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert state4["state"]  # the optimizer had state at step 4
    assert torch.equal(loaded.transformer.wte.weight, loaded.lm_head.weight)  # tied, as saved


def test_callback_run_matches_stock_run_and_honours_save_total_limit(
    tmp_path: Path, stock_weights: dict[str, torch.Tensor]
) -> None:
    callback = AioPersistCallback()
    mine = _trainer(tmp_path / "run", [callback], save_total_limit=2)
    mine.train()
    _assert_same_weights(_weights(mine), stock_weights)  # saving changed nothing in training
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-6", "checkpoint-8"]
    assert len(callback.saved) == 4


@dataclasses.dataclass
class StockResumed:
    """A stock run with evaluation, and a stock Trainer resumed from its checkpoint-4."""

    first: StockRun
    resumed: dict[str, Any]


@pytest.fixture(scope="module")
def stock_eval(tmp_path_factory: pytest.TempPathFactory) -> StockResumed:
    run = tmp_path_factory.mktemp("stock-eval") / "run"
    first = _stock_run(run, **EVAL)
    resumed = _trainer(run, [], **EVAL, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-4"))
    return StockResumed(first, dataclasses.asdict(resumed.state))


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_hold_the_steps_log_and_evaluation_as_stock(
    tmp_path: Path, backend: str, stock_eval: StockResumed
) -> None:
    """Each checkpoint's ``trainer_state.json`` is the stock one: the step's log entry and
    the evaluation of that step are in it, with the best metric they give. A stock
    Trainer resumed from it logs and ends as one resumed from a stock checkpoint."""
    stock = stock_eval.first
    assert [e["step"] for e in stock.state["log_history"] if "eval_loss" in e] == [2, 4, 6, 8]
    callback = AioPersistCallback(backend=backend)
    trainer = _trainer(tmp_path / "run", [callback], **EVAL)
    trainer.train()
    _assert_matches_stock(tmp_path / "run", callback, trainer, stock)
    assert _saved_state(tmp_path / "run" / "checkpoint-4")["log_history"][-2:] == [
        e for e in _comparable(stock.state)["log_history"] if e["step"] == 4
    ]

    resumed = _trainer(tmp_path / "run", [], **EVAL, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert _comparable(dataclasses.asdict(resumed.state)) == _comparable(stock_eval.resumed)


@pytest.fixture(scope="module")
def stock_best_first(tmp_path_factory: pytest.TempPathFactory) -> StockRun:
    stock = _stock_run(tmp_path_factory.mktemp("stock-best") / "run", **BEST_FIRST)
    # What the test is about: the best is the oldest checkpoint, not the last one.
    assert os.path.basename(stock.state["best_model_checkpoint"]) == "checkpoint-2"
    assert _checkpoint_names(stock.run) == ["checkpoint-2"]
    return stock


@pytest.mark.parametrize("backend", BACKENDS)
def test_best_checkpoint_is_recorded_kept_and_loaded_at_the_end_as_stock(
    tmp_path: Path, backend: str, stock_best_first: StockRun
) -> None:
    """``metric_for_best_model``, ``save_total_limit=1`` and ``load_best_model_at_end``:
    the best checkpoint (the first) is recorded, survives rotation (which keeps it and
    the newest) and the end of training (which deletes all but it), and its weights are
    loaded at the end, as in a stock run."""
    callback = AioPersistCallback(backend=backend)
    trainer = _trainer(tmp_path / "run", [callback], **BEST_FIRST)
    trainer.train()
    _assert_matches_stock(tmp_path / "run", callback, trainer, stock_best_first)
    assert len(callback.saved) == 4  # every save went through aiopersist


@pytest.fixture(scope="module")
def stock_save_best(tmp_path_factory: pytest.TempPathFactory) -> StockRun:
    stock = _stock_run(tmp_path_factory.mktemp("stock-save-best") / "run", **SAVE_BEST)
    assert _checkpoint_names(stock.run) == ["checkpoint-6", "checkpoint-8"]
    return stock


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_strategy_best_saves_through_the_callback_as_stock(
    tmp_path: Path, backend: str, stock_save_best: StockRun
) -> None:
    """``save_strategy="best"`` decides to save after the evaluation; those saves are the
    callback's, and the run ends as a stock one."""
    callback = AioPersistCallback(backend=backend)
    trainer = _trainer(tmp_path / "run", [callback], **SAVE_BEST)
    trainer.train()
    _assert_matches_stock(tmp_path / "run", callback, trainer, stock_save_best)
    assert [os.path.basename(p) for p in callback.saved] == [f"checkpoint-{s}" for s in (2, 4, 6, 8)]


class _HoldAt(transformers.TrainerCallback):  # type: ignore[misc]
    """At the start of step ``step``, hold training until ``until(run)`` holds (or a
    minute has gone by), and record whether it did."""

    def __init__(self, step: int, run: Path, until: Any) -> None:
        self.step, self.run, self.until = step, run, until
        self.seen: bool | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step + 1 != self.step:
            return
        deadline = time.monotonic() + 60
        while not self.until(self.run) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.seen = bool(self.until(self.run))


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_total_limit_applies_once_a_checkpoint_is_committed(tmp_path: Path, backend: str) -> None:
    """With ``save_total_limit=1``, checkpoint-2 goes once checkpoint-4 is committed,
    in the background: while training is held before the next save, not when that save
    starts."""
    run = tmp_path / "run"
    hold = _HoldAt(5, run, lambda run: _checkpoint_names(run) == ["checkpoint-4"])
    _trainer(run, [AioPersistCallback(backend=backend), hold], save_total_limit=1).train()
    assert hold.seen, _checkpoint_names(run)
    assert _checkpoint_names(run) == ["checkpoint-8"]


class _ReadsOnSave(transformers.TrainerCallback):  # type: ignore[misc]
    """Reads ``checkpoint-N`` in ``on_save``, as callbacks that upload or copy it do:
    records its files, the step in its ``trainer_state.json``, and the checkpoints there."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[str], int, list[str]]] = []

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        run = Path(args.output_dir)
        ckpt = run / f"checkpoint-{state.global_step}"
        files = sorted(set(os.listdir(ckpt)) - {"aiopersist.json"})
        step = json.loads((ckpt / "trainer_state.json").read_text())["global_step"]
        self.seen.append((state.global_step, files, step, _checkpoint_names(run)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_callbacks_on_save_find_the_checkpoint_complete_as_stock(
    tmp_path: Path, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A callback whose ``on_save`` reads the checkpoint (uploads it, copies it, logs it as
    an artifact, as the W&B, MLflow, Neptune, ClearML, Flyte and DVCLive integrations can)
    finds it complete and rotated, as after a stock save. The callback says once, naming
    it, that the saves are waited for because of it."""
    seen = {}
    for name, extra in (("stock", []), ("ours", [AioPersistCallback(backend=backend)])):
        reader = _ReadsOnSave()
        with caplog.at_level(logging.WARNING, logger="aiopersist"):
            _trainer(tmp_path / name, [*extra, reader], save_total_limit=1).train()
        seen[name] = reader.seen
    assert [s[0] for s in seen["stock"]] == [2, 4, 6, 8]
    assert seen["ours"] == seen["stock"]
    said = [r.getMessage() for r in caplog.records if "durable_on_save=False" in r.getMessage()]
    assert len(said) == 1, said
    assert "_ReadsOnSave.on_save" in said[0], said


def test_reads_checkpoint_on_save_tells_which_callbacks_may_read_it() -> None:
    """Callbacks that keep the base ``on_save`` do not read the checkpoint; any other
    ``on_save`` may; transformers' integrations read it as they are configured to."""
    from transformers.integrations.integration_utils import MLflowCallback

    from aiopersist.integrations.transformers import reads_checkpoint_on_save

    assert not reads_checkpoint_on_save(transformers.EarlyStoppingCallback())
    assert not reads_checkpoint_on_save(transformers.trainer_callback.DefaultFlowCallback())
    assert not reads_checkpoint_on_save(_StopAt(1))
    assert reads_checkpoint_on_save(_ReadsOnSave())
    mlflow = MLflowCallback.__new__(MLflowCallback)  # its __init__ needs mlflow installed
    mlflow._auto_end_run = False  # what its __del__ reads
    assert reads_checkpoint_on_save(mlflow)  # not yet set up: it may
    mlflow._log_artifacts = False
    assert not reads_checkpoint_on_save(mlflow)
    mlflow._log_artifacts = True  # HF_MLFLOW_LOG_ARTIFACTS=1
    assert reads_checkpoint_on_save(mlflow)

    class Subclass(MLflowCallback):  # type: ignore[misc]  # as DagsHubCallback: MLflow's on_save
        pass

    sub = Subclass.__new__(Subclass)
    sub._auto_end_run, sub._log_artifacts = False, False
    assert not reads_checkpoint_on_save(sub)


class _RequestJIT(transformers.TrainerCallback):  # type: ignore[misc]
    """Request a just-in-time checkpoint as SIGTERM does once its grace period is over;
    the Trainer's JIT callback takes it at its next event. With ``committed`` (a
    checkpoint directory), the request is made at the start of the step after ``step``,
    once that checkpoint is committed (its name appears only then): the JIT save comes
    before that step's optimizer step. Otherwise it is made at the end of ``step``, and
    taken at the start of the next one."""

    def __init__(self, step: int, committed: Path | None) -> None:
        self.step, self.committed = step, committed
        self.trainer: Any = None

    def _request(self) -> None:
        (jit,) = [
            cb
            for cb in self.trainer.callback_handler.callbacks
            if type(cb).__name__ == "JITCheckpointCallback"
        ]
        jit.jit_manager.is_checkpoint_requested = True

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.committed is not None and state.global_step == self.step:
            deadline = time.monotonic() + 60
            while not self.committed.is_dir() and time.monotonic() < deadline:
                time.sleep(0.01)
            self._request()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.committed is None and state.global_step == self.step:
            self._request()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("saved_step", "checkpoints"), [(4, [2, 4]), (5, [2, 4, 5, 6])], ids=["saved", "unsaved"]
)
def test_jit_checkpoint_never_writes_into_a_committed_checkpoint(
    tmp_path: Path,
    backend: str,
    saved_step: int,
    checkpoints: list[int],
    stock_weights: dict[str, torch.Tensor],
) -> None:
    """``enable_jit_checkpoint``. A request once checkpoint-4 is committed, taken before
    step 5's optimizer step (still step 4): the stock JIT save would write into that
    checkpoint again; here it is left as it is. A request after step 5, which has no
    checkpoint: checkpoint-5 is saved through aiopersist, durable before training goes
    on. Training stops after the next step either way; every checkpoint is complete and
    saved once, and a stock Trainer resumes from the JIT one to the weights of a run that
    never stopped."""
    if "enable_jit_checkpoint" not in transformers.TrainingArguments.__dataclass_fields__:
        pytest.skip("this transformers has no just-in-time checkpoints")
    run = tmp_path / "run"
    callback = AioPersistCallback(backend=backend)
    request = _RequestJIT(saved_step, run / "checkpoint-4" if saved_step == 4 else None)
    trainer = _trainer(run, [callback, request], enable_jit_checkpoint=True)
    request.trainer = trainer
    trainer.train()
    assert trainer.state.global_step == saved_step + 1  # stopped after the next step
    assert _checkpoint_names(run) == [f"checkpoint-{s}" for s in checkpoints]
    assert callback.saved == [str(run / f"checkpoint-{s}") for s in checkpoints]  # each saved once
    for step in checkpoints:
        assert "checkpoint-is-incomplete.txt" not in os.listdir(run / f"checkpoint-{step}")
        assert check_step(str(run / f"checkpoint-{step}"))[0]
        asyncio.run(aiopersist.verify(run / f"checkpoint-{step}"))
    resumed = _trainer(run, [], save_strategy="no")
    resumed.train(resume_from_checkpoint=str(run / f"checkpoint-{saved_step}"))
    _assert_same_weights(_weights(resumed), stock_weights)


@pytest.mark.parametrize("backend", BACKENDS)
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
    assert [(c.step, c.complete) for c in found] == [
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
    assert to_rotate([c for c in found if c.step == 4], 1) == []
    # The best checkpoint stays, as with the stock rotation: with a limit of 1, the best
    # and the newest. A damaged best is not deleted either, and counts as kept.
    assert names(to_rotate(found, 1, best=str(run / "checkpoint-1"))) == [
        "checkpoint-2", "checkpoint-3", "checkpoint-4",
    ]  # fmt: skip
    assert names(to_rotate(found, 1, best=str(run / "checkpoint-2"))) == ["checkpoint-1", "checkpoint-4"]
    # A best that is gone still counts as kept, as in the stock rule: two stay.
    assert names(to_rotate(found, 1, best=str(run / "checkpoint-9"))) == [
        "checkpoint-1", "checkpoint-2", "checkpoint-4",
    ]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotation_and_gc_leave_checkpoints_they_cannot_tell_broken(tmp_path: Path, backend: str) -> None:
    """An incomplete checkpoint goes only when it is proven broken (a file missing or cut
    short, no manifest): one written in a newer format, or whose manifest records
    another step than its name, cannot be told and stays, neither counted nor deleted,
    by the rotation and by ``aiopersist gc``."""
    from tests._forkserver import aiopersist_cli
    from tests.io.test_corruption import _rewrite_manifest

    run = tmp_path / "run"
    for step in (1, 2, 3, 4, 5):
        state = {"w": torch.full((100,), float(step))}
        asyncio.run(aiopersist.save(state, run / f"checkpoint-{step}", backend=backend))
    _rewrite_manifest(run / "checkpoint-1", lambda d: d.update(version=99))
    _rewrite_manifest(run / "checkpoint-2", lambda d: d["metadata"].update(step="9"))
    (run / "checkpoint-3" / "model.safetensors").unlink()  # broken
    found = _checkpoints(str(run))
    assert [(c.step, c.complete, c.damaged) for c in found] == [
        (1, False, False),
        (2, False, False),
        (3, False, True),
        (4, True, False),
        (5, True, False),
    ]
    assert "newer" in (found[0].problem or "")
    assert [os.path.basename(p) for p in to_rotate(found, 5)] == ["checkpoint-3"]
    assert [os.path.basename(p) for p in to_rotate(found, 1)] == ["checkpoint-3", "checkpoint-4"]
    proc = aiopersist_cli("gc", str(run), "--keep-last", "5", "--apply")
    assert proc.returncode == 0, proc.stderr
    assert _checkpoint_names(run) == ["checkpoint-1", "checkpoint-2", "checkpoint-4", "checkpoint-5"]


def test_rotation_orders_by_modification_time_as_stock(tmp_path: Path) -> None:
    """The stock rotation orders checkpoints by modification time (by step when they all
    lie within a second): a rerun into an output_dir that holds an older, longer run's
    checkpoints keeps its own newest ones, not the older run's higher steps."""
    run = tmp_path / "run"
    for step in (2, 4, 6, 8):
        asyncio.run(aiopersist.save({"w": torch.full((10,), float(step))}, run / f"checkpoint-{step}"))
    hour_ago = time.time() - 3600
    for step in (6, 8):  # the older run's
        os.utime(run / f"checkpoint-{step}", (hour_ago, hour_ago + step))
    found = _checkpoints(str(run))
    names = lambda paths: [os.path.basename(p) for p in paths]  # noqa: E731
    assert names(to_rotate(found, 2)) == ["checkpoint-6", "checkpoint-8"]
    assert names(to_rotate(found, 2, best=str(run / "checkpoint-8"))) == ["checkpoint-2", "checkpoint-6"]
    now = time.time()
    for step in (2, 4, 6, 8):  # within a second: times not trusted, steps decide
        os.utime(run / f"checkpoint-{step}", (now, now + step / 10))
    assert names(to_rotate(_checkpoints(str(run)), 2)) == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.parametrize("backend", BACKENDS)
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


class _FailAt(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError("training failed")


class _FailBefore(transformers.TrainerCallback):  # type: ignore[misc]
    """Raises as the step after ``step`` begins: before its optimizer step, so before the
    fence of the save that ``step`` started."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError("training failed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_training_that_raises_finishes_its_save_before_the_error_leaves_train(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stock ``train()`` has written its last checkpoint before an error leaves it; so
    does the callback's: what the caller does next cannot tear it. A retry with
    ``resume_from_checkpoint`` loads older weights into the model before any callback
    runs, which the save in flight would otherwise read, publishing a torn checkpoint
    whose checksums pass; and the newest checkpoint is there for the retry to find. The
    copies into staging are slowed so that the save is still in flight when the error
    comes."""
    from safetensors.torch import load_file

    import aiopersist._stream as stream

    real = stream._copy_all_jobs

    def slow(jobs: Any) -> None:
        time.sleep(0.01)
        real(jobs)

    monkeypatch.setattr(stream, "_copy_all_jobs", slow)
    run = tmp_path / "run"
    trainer = _trainer(run, [AioPersistCallback(backend=backend), _FailBefore(4)], max_steps=6)
    with pytest.raises(RuntimeError, match="training failed"):
        trainer.train()
    assert sorted(os.listdir(run)) == ["checkpoint-2", "checkpoint-4"]  # published, nothing in flight
    live = _weights(trainer)  # step 5's optimizer step never ran: still step 4's weights
    saved = load_file(run / "checkpoint-4" / "model.safetensors")
    _assert_same_weights(saved, {k: live[k] for k in saved})
    trainer.remove_callback(_FailBefore)
    trainer.add_callback(_StopAt(3))
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-2"))  # older weights, loaded in place
    _assert_same_weights(load_file(run / "checkpoint-4" / "model.safetensors"), saved)


class _NormedLM(torch.nn.Module):
    """Embeddings, a BatchNorm (its running statistics change in place in every training
    forward), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 128)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.norm(self.emb(input_ids).transpose(1, 2)).transpose(1, 2)
        logits = self.head(h)
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


class _NormedConfig(transformers.PretrainedConfig):  # type: ignore[misc]
    model_type = "aiopersist-normed"


class _NormedPreTrained(transformers.PreTrainedModel):  # type: ignore[misc]
    config_class = _NormedConfig

    def __init__(self, config: _NormedConfig) -> None:
        super().__init__(config)
        self.inner = _NormedLM()
        self.post_init()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **_: Any) -> dict[str, torch.Tensor]:
        return cast(dict[str, torch.Tensor], self.inner(input_ids, labels))


class _ClearAt(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int, event: threading.Event) -> None:
        self.step, self.event = step, event

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            self.event.clear()  # set again by the next step's forward


@pytest.mark.parametrize("pretrained", [False, True], ids=["module", "pretrained"])
def test_buffers_changed_by_the_next_forward_are_saved_as_they_were_at_the_save(
    tmp_path: Path, pretrained: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next step's forward runs while the checkpoint is written, and changes buffers
    in place (BatchNorm's running statistics); the optimizer step, which the fence holds
    back, changes only parameters. The checkpoint holds the buffers as they were at the
    save, as the stock one does. The copies into staging wait until the next step's
    forward has run (a second at most), so that it always runs first."""
    from safetensors.torch import load_file

    import aiopersist._stream as stream

    forwarded = threading.Event()
    real = stream._copy_all_jobs

    def after_forward(jobs: Any) -> None:
        forwarded.wait(1)
        real(jobs)

    monkeypatch.setattr(stream, "_copy_all_jobs", after_forward)
    saved = {}
    for name, extra in (("stock", []), ("ours", [AioPersistCallback(backend="threads")])):
        torch.manual_seed(0)
        model = _NormedPreTrained(_NormedConfig()) if pretrained else _NormedLM()
        model.register_forward_hook(lambda *_: forwarded.set())
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=3, save_steps=2, per_device_train_batch_size=4,
            report_to=[], seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=Tokens(16, 8, 128),
            callbacks=[*extra, _ClearAt(2, forwarded)],
        )
        trainer.train()
        saved[name] = load_file(tmp_path / name / "checkpoint-2" / "model.safetensors")
    assert saved["ours"].keys() == saved["stock"].keys()
    for key, tensor in saved["stock"].items():
        assert torch.equal(saved["ours"][key], tensor), key


def test_a_compiled_model_given_to_the_trainer_is_saved_as_stock(tmp_path: Path) -> None:
    """A ``PreTrainedModel`` compiled before it is given to the Trainer is saved as
    ``Trainer._save`` saves it: by the unwrapped model's ``save_pretrained``, so the
    checkpoint holds its ``config.json`` too, and the weights under the wrapper's names."""
    from safetensors.torch import load_file

    runs = {}
    for name, extra in (("stock", []), ("ours", [AioPersistCallback()])):
        torch.manual_seed(0)
        model = torch.compile(_NormedPreTrained(_NormedConfig()), backend="eager")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=2, save_steps=2, per_device_train_batch_size=4,
            report_to=[], seed=0, use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
        )  # fmt: skip
        transformers.Trainer(model=model, args=args, train_dataset=Tokens(8, 8, 128), callbacks=extra).train()
        runs[name] = tmp_path / name / "checkpoint-2"
    assert set(os.listdir(runs["ours"])) - {"aiopersist.json"} == set(os.listdir(runs["stock"]))
    assert (runs["ours"] / "config.json").read_bytes() == (runs["stock"] / "config.json").read_bytes()
    ours = load_file(runs["ours"] / "model.safetensors")
    stock = load_file(runs["stock"] / "model.safetensors")
    assert ours.keys() == stock.keys()
    for key, tensor in stock.items():
        assert torch.equal(ours[key], tensor), key


def test_a_trainer_left_by_a_failed_run_saves_as_stock_without_the_callback(tmp_path: Path) -> None:
    """A training that raises never reaches ``on_train_end``: its ``train()`` gives the
    Trainer's save back as the error leaves, so a run without the callback saves as
    stock (nothing would wait on the fence of an asynchronous one)."""
    callback = AioPersistCallback()
    trainer = _trainer(tmp_path / "run", [callback, _FailAt(1)])  # before any save
    with pytest.raises(RuntimeError, match="training failed"):
        trainer.train()
    assert "_save_checkpoint" not in vars(trainer)
    trainer.remove_callback(callback)
    trainer.remove_callback(_FailAt)
    trainer.train()
    assert _checkpoint_names(tmp_path / "run") == [f"checkpoint-{s}" for s in (2, 4, 6, 8)]
    assert "aiopersist.json" not in os.listdir(tmp_path / "run" / "checkpoint-8")
    callback.on_train_end(trainer.args, trainer.state, trainer.control)  # what the failed run left
    assert "_save_checkpoint" not in vars(trainer)


def test_small_files_are_the_stock_ones_byte_for_byte(tmp_path: Path) -> None:
    """``rng_state.pth`` (written by the Trainer's own ``_save_rng_state``: every device's
    generator, as the parallel mode has it), ``scheduler.pt`` and ``training_args.bin``
    are the files ``torch.save`` writes to those names, whose archive records are named
    after the file, as in a stock checkpoint."""
    import zipfile

    runs = {}
    for name, extra in (("stock", []), ("ours", [AioPersistCallback()])):
        _trainer(tmp_path / name, extra, max_steps=2).train()
        runs[name] = tmp_path / name / "checkpoint-2"
    for small in ("rng_state.pth", "scheduler.pt"):
        assert (runs["ours"] / small).read_bytes() == (runs["stock"] / small).read_bytes(), small
    ours, stock = (zipfile.ZipFile(runs[n] / "training_args.bin").namelist() for n in ("ours", "stock"))
    assert ours == stock
    assert stock[0] == "training_args/data.pkl"
    args = {n: torch.load(runs[n] / "training_args.bin", weights_only=False).to_dict() for n in runs}
    assert {**args["ours"], "output_dir": None} == {**args["stock"], "output_dir": None}


def _tokenizer() -> Any:
    """A fast tokenizer built offline, with a default chat template and a named one: its
    ``save_pretrained`` writes ``additional_chat_templates/tool_use.jinja``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.chat_template = {"default": "{{ messages }}", "tool_use": "{{ tools }} {{ messages }}"}
    return fast


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_processing_class_files_are_saved_as_stock_subdirectories_included(
    tmp_path: Path, backend: str
) -> None:
    """The processing class's ``save_pretrained`` files go into every checkpoint as the
    stock save writes them, byte for byte, those in its subdirectories too, and the
    tokenizer loads from the checkpoint with its named chat templates."""
    runs = {}
    for name, callbacks in (("stock", []), ("ours", [AioPersistCallback(backend=backend)])):
        trainer = _trainer(tmp_path / name, callbacks, max_steps=2)
        trainer.processing_class = _tokenizer()
        trainer.train()
        runs[name] = tmp_path / name / "checkpoint-2"
    stock, ours = _tree(runs["stock"]), _tree(runs["ours"])
    assert "additional_chat_templates/tool_use.jinja" in stock
    assert set(ours) - {"aiopersist.json"} == set(stock)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert ours[name] == stock[name], name
    assert (
        ours["additional_chat_templates/tool_use.jinja"] == stock["additional_chat_templates/tool_use.jinja"]
    )
    asyncio.run(aiopersist.verify(runs["ours"]))
    loaded = transformers.AutoTokenizer.from_pretrained(runs["ours"])
    assert loaded.chat_template == _tokenizer().chat_template


class _OwnSaveTrainer(transformers.Trainer):  # type: ignore[misc]
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)


def test_callback_refuses_a_trainer_with_its_own_checkpoint_save(tmp_path: Path) -> None:
    trainer = _OwnSaveTrainer(
        model=tiny_gpt2(),
        args=_trainer(tmp_path / "run", []).args,
        train_dataset=Tokens(64, 16, 128),
        callbacks=[AioPersistCallback()],
    )
    with pytest.raises(ValueError, match="_OwnSaveTrainer overrides"):
        trainer.train()


_TENSOR_PARALLEL = """
import os, sys
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from tests.e2e.test_hf_trainer import AioPersistCallback, _trainer
from pathlib import Path

dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=0, world_size=1)
trainer = _trainer(Path({out!r}), [AioPersistCallback(backend="threads")])
mesh = init_device_mesh("cpu", (1,))
layer = trainer.model.lm_head
layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
try:
    trainer.train()
except ValueError as exc:
    print("refused:", exc)
dist.destroy_process_group()
"""


def test_callback_refuses_tensor_parallel_parameters(tmp_path: Path) -> None:
    """A model with DTensor parameters outside FSDP (tensor parallelism, as a model loaded
    with ``tp_plan``): the stock save gathers whole tensors, the callback would write
    local shards for them. Refused before any step, nothing written. (This model, its
    head alone sharded, would fail in its forward anyway: a real one converts its inputs
    with hooks. The test checks the refusal, not what the old callback wrote.)"""
    import sys

    root = str(Path(__file__).resolve().parents[2])
    code = _TENSOR_PARALLEL.format(root=root, store=str(tmp_path / "store"), out=str(tmp_path / "run"))
    proc = run([sys.executable, "-c", code], text=True, timeout=240, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: AioPersistCallback does not save tensor-parallel (DTensor) parameters" in proc.stdout
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("checkpoint-*"))


_TRAIN = """
import sys
sys.path.insert(0, {root!r})
from tests.e2e.test_hf_trainer import AioPersistCallback, _trainer
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
    root = str(Path(__file__).resolve().parents[2])
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
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(port), "-m", "tests._hf_ddp_worker", str(out), mode, backend,
        ],
        cwd=Path(__file__).resolve().parents[2], text=True, timeout=300,
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


@pytest.mark.parametrize("backend", BACKENDS)
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
    # The newest checkpoint damaged: with the callback, resume_from_checkpoint=True takes
    # checkpoint-6 on both processes (checked by process 0, agreed by both) and still
    # ends with the uninterrupted run's weights; its checkpoint-8 replaces the damaged one.
    newest = tmp_path / "callback" / "checkpoint-8"
    flip_byte(newest / "model.safetensors")
    _torchrun(tmp_path, "resume-checked", backend)
    asyncio.run(aiopersist.verify(newest))
    for name in ("callback", "resume", "resume-checked"):
        got = torch.load(tmp_path / f"{name}.pt")
        for k, v in ddp_stock_weights.items():
            assert torch.equal(got[k], v), (name, k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_under_ddp_the_best_checkpoint_is_kept_and_loaded_as_stock(tmp_path: Path, backend: str) -> None:
    """Under torchrun, with the best checkpoint the first one, save_total_limit=1 and
    load_best_model_at_end: both ranks record the best checkpoint as in a stock run (it
    is in flight on process 0 when they do), it survives rotation and the end of
    training, and every rank loads it at the end once process 0 has committed it. The
    worker makes the stock run first, in the same processes."""
    outs = _torchrun(tmp_path, "best", backend)
    stock_outs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("best-stock-[0-9]*.json"))]
    assert [(o["best"], o["checkpoints"]) for o in stock_outs] == [
        ("checkpoint-2", ["checkpoint-2"]),
        ("checkpoint-2", None),  # only process 0 lists what it kept
    ]
    for key in ("rank", "world", "best", "best_metric", "checkpoints"):
        assert [o[key] for o in outs] == [o[key] for o in stock_outs], key
    asyncio.run(aiopersist.verify(tmp_path / "best" / "checkpoint-2"))
    _assert_same_weights(torch.load(tmp_path / "best.pt"), torch.load(tmp_path / "best-stock.pt"))
    assert "aiopersist.json" not in os.listdir(tmp_path / "best-stock" / "checkpoint-2")


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


def test_under_ddp_save_on_each_node_on_one_node_saves_as_stock(tmp_path: Path) -> None:
    """``save_on_each_node`` on one node: the stock save writes from the node's first
    process, process 0, as the callback does; the checkpoints (with ``save_total_limit``)
    and the final weights are the stock run's. The worker makes the stock run first."""
    outs = _torchrun(tmp_path, "each-node", "threads")
    stock_outs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("each-node-stock-[0-9]*.json"))]
    assert [o["should_save"] for o in stock_outs] == [True, False]
    for key in ("rank", "world", "checkpoints", "should_save"):
        assert [o[key] for o in outs] == [o[key] for o in stock_outs], key
    assert outs[0]["checkpoints"] == ["checkpoint-6", "checkpoint-8"]
    for name in outs[0]["checkpoints"]:
        ours, stock = tmp_path / "each-node" / name, tmp_path / "each-node-stock" / name
        assert set(os.listdir(ours)) - {"aiopersist.json"} == set(os.listdir(stock)), name
        assert _saved_state(ours) == _saved_state(stock), name
        asyncio.run(aiopersist.verify(ours))
    _assert_same_weights(torch.load(tmp_path / "each-node.pt"), torch.load(tmp_path / "each-node-stock.pt"))


def test_under_ddp_save_on_each_node_across_nodes_is_refused(tmp_path: Path) -> None:
    """``save_on_each_node`` on two nodes (two torchrun agents, one process each, on this
    machine): the stock save would write a checkpoint from each node's first process; the
    callback refuses it on every process, naming process 1."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def agent(node: int) -> subprocess.Popen[str]:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "tests._hf_ddp_worker", str(tmp_path), "each-node-nodes", "threads",
        ]  # fmt: skip
        root = Path(__file__).resolve().parents[2]
        return popen(command, cwd=root, text=True)

    agents = [agent(0), agent(1)]
    try:
        results = [agent.communicate(timeout=300) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()
    for agent, (_, err) in zip(agents, results, strict=True):
        assert agent.returncode == 0, err[-3000:]
    outs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("each-node-nodes-[0-9]*.json"))]
    assert sorted(o["rank"] for o in outs) == [0, 1]
    for o in outs:
        assert "save_on_each_node across nodes" in o["refused"], o
        assert "processes [1]" in o["refused"], o


# -- parameters that change before the optimizer step -------------------------------------


class _ShiftingSGD(torch.optim.SGD):
    """SGD with a schedule-free optimizer's protocol: ``eval()`` moves every parameter in
    place (to its evaluation point, here +1), ``train()`` moves it back. The Trainer calls
    ``eval()`` in its evaluation and ``train()`` at the start of each step, before the
    forward: after a save that follows an evaluation, ``train()`` changes the parameters
    the save is reading, long before the optimizer step."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.evaluating = False
        self.saves_staged: list[bool] = []  # at each train() that moved the parameters
        self.callback: AioPersistCallback | None = None

    @torch.no_grad()
    def _shift(self, by: float) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(by)

    def eval(self) -> None:
        if not self.evaluating:
            self._shift(1.0)
            self.evaluating = True

    def train(self) -> None:
        if self.evaluating:
            handle = self.callback._handle if self.callback is not None else None
            if handle is not None:
                self.saves_staged.append(handle.staged())
            self._shift(-1.0)
            self.evaluating = False


class _Regression(torch.nn.Module):
    def __init__(self, max_norm: float | None) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50_000, 64, max_norm=max_norm)
        with torch.no_grad():
            self.emb.weight.mul_(10.0)  # every row past max_norm until it is looked up
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.layers(self.emb(input_ids)).mean(dim=(1, 2))
        return torch.nn.functional.mse_loss(y, labels), y


class _Ids(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 50_000, (n, 512), generator=g)
        self.y = torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.y[i]}


def _moving_run(
    out: Path, case: str, callback: AioPersistCallback | None
) -> dict[int, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    from transformers import Trainer, TrainingArguments, set_seed

    set_seed(0)
    model = _Regression(max_norm=1.0 if case == "embedding-max-norm" else None)
    staged: list[bool] = []
    optimizers: Any = (None, None)
    if case == "optimizer-train":
        optimizer = _ShiftingSGD(model.parameters(), lr=1e-2)
        optimizer.callback = callback
        optimizers = (optimizer, None)
    else:

        def before_forward(*_: Any) -> None:  # the forward renormalises rows in place
            if callback is not None and callback._handle is not None:
                staged.append(callback._handle.staged())

        model.register_forward_pre_hook(before_forward)
    args = TrainingArguments(
        str(out), max_steps=6, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        eval_strategy="steps", eval_steps=2, save_steps=2, learning_rate=1e-2, lr_scheduler_type="constant",
        optim="sgd", report_to=[], disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    trainer = Trainer(
        model, args, train_dataset=_Ids(32), eval_dataset=_Ids(8), optimizers=optimizers,
        callbacks=[callback] if callback is not None else [],
    )  # fmt: skip
    trainer.train()
    if case == "optimizer-train":
        staged = optimizers[0].saves_staged
    if callback is not None:
        assert staged, "no save was in flight where the parameters moved: the test tests nothing"
        assert all(staged), staged  # every save had left the parameters before they moved
    return {s: load_file(str(out / f"checkpoint-{s}" / "model.safetensors")) for s in (2, 4, 6)}


@pytest.mark.parametrize("case", ["optimizer-train", "embedding-max-norm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_parameters_that_move_before_the_optimizer_step_are_saved_as_stock(
    tmp_path: Path, backend: str, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Parameters that change before the optimizer step (where the fence holds a save's
    tensors): a schedule-free-style optimizer's ``train()``, which the Trainer calls before
    each step's forward (it moved the parameters of a checkpoint saved after an
    evaluation while the save read them: every tensor differed from stock), and an
    embedding with ``max_norm``, whose forward renormalises rows in place (hundreds of
    rows differed). The callback waits for the save before such a run's next step: every
    checkpoint equals the stock run's, bit for bit, and the log says why."""
    stock = _moving_run(tmp_path / "stock", case, None)
    with caplog.at_level(logging.INFO, logger="aiopersist"):
        ours = _moving_run(tmp_path / "ours", case, AioPersistCallback(backend=backend))
    for step, tensors in stock.items():
        assert tensors.keys() == ours[step].keys()
        for name, t in tensors.items():
            assert torch.equal(t, ours[step][name]), (case, step, name)
    said = "has train(), which may move" if case == "optimizer-train" else "renormalises rows in the forward"
    assert any(said in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
