"""aiopersist.integrations.accelerate.load_state: Accelerate's ``load_state`` once the
checkpoint is checked against its checksums. A damaged checkpoint named by its path is
refused with nothing loaded; with automatic naming the newest checkpoint that checks out
is loaded. Accelerate alone loads the damage silently. Real files, both backends."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate.utils import ProjectConfiguration

import aiopersist
from aiopersist.integrations.accelerate import load_state, save_state_blocking
from tests.conftest import flip_byte
from tests.e2e.test_accelerate import BACKENDS, _assert_restored, _setup, _state, _step


def _three_checkpoints(project: Path, backend: str) -> list[dict[str, torch.Tensor]]:
    """checkpoint_0 to checkpoint_2 by automatic naming, a step apart; each one's state."""
    project_config = ProjectConfiguration(str(project), automatic_checkpoint_naming=True)
    accelerator, model, opt, sched = _setup(project_config)
    states = []
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        for _ in range(3):
            _step(model, opt, sched)
            states.append(_state(model, opt))
            save_state_blocking(accelerator, checkpointer=ck).wait()
    assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    return states


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_newest_checkpoint_that_checks_out_is_loaded(
    tmp_path: Path, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    states = _three_checkpoints(tmp_path / "p", backend)
    flip_byte(tmp_path / "p" / "checkpoints" / "checkpoint_2" / "optimizer.bin")
    accelerator, model, opt, sched = _setup(
        ProjectConfiguration(str(tmp_path / "p"), automatic_checkpoint_naming=True)
    )
    _step(model, opt, sched)
    with caplog.at_level(logging.WARNING, logger="aiopersist"):
        load_state(accelerator, backend=backend)
    _assert_restored(model, opt, states[1])
    said = [r.getMessage() for r in caplog.records if "load_state: loading" in r.getMessage()]
    assert len(said) == 1, said
    assert "checkpoint_1, the newest checkpoint that checks out" in said[0]
    assert "passed over: checkpoint_2 (" in said[0]
    assert "optimizer.bin: checksum mismatch" in said[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_damaged_checkpoint_is_refused_with_nothing_loaded(tmp_path: Path, backend: str) -> None:
    _three_checkpoints(tmp_path / "p", backend)
    base = tmp_path / "p" / "checkpoints"
    flip_byte(base / "checkpoint_2" / "model.safetensors")
    accelerator, model, opt, sched = _setup()
    _step(model, opt, sched)
    before = _state(model, opt)
    with pytest.raises(aiopersist.CheckpointCorruptError, match=r"checkpoint_2/model\.safetensors: checksum"):
        load_state(accelerator, base / "checkpoint_2", backend=backend)
    _assert_restored(model, opt, before)
    # Every checkpoint damaged: none is loaded, each is named.
    flip_byte(base / "checkpoint_1" / "random_states_0.pkl")
    os.truncate(base / "checkpoint_0" / "model.safetensors", 100)
    accelerator, model, opt, sched = _setup(
        ProjectConfiguration(str(tmp_path / "p"), automatic_checkpoint_naming=True)
    )
    _step(model, opt, sched)
    before = _state(model, opt)
    with pytest.raises(aiopersist.CheckpointCorruptError) as caught:
        load_state(accelerator, backend=backend)
    message = str(caught.value)
    assert "no checkpoint in" in message
    assert "checkpoint_2/model.safetensors: checksum mismatch" in message
    assert "checkpoint_1/random_states_0.pkl: checksum mismatch" in message
    assert "checkpoint_0/model.safetensors: 100 bytes" in message
    _assert_restored(model, opt, before)


def test_a_stock_checkpoint_is_loaded_unchecked_as_accelerate_would(tmp_path: Path) -> None:
    accelerator, model, opt, sched = _setup()
    _step(model, opt, sched)
    saved = _state(model, opt)
    accelerator.save_state(str(tmp_path / "stock"))  # no manifest
    _step(model, opt, sched)
    load_state(accelerator, tmp_path / "stock")
    _assert_restored(model, opt, saved)
