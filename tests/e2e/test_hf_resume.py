"""AioPersistCallback checks the checkpoint a Trainer resumes from (``verify_on_resume``):
a damaged checkpoint named by its path is refused before the Trainer loads anything from
it; with ``resume_from_checkpoint=True`` the newest checkpoint that checks out is taken,
and the run ends as a stock run resumed from that checkpoint ends, bit for bit. The
Trainer alone loads a damaged checkpoint silently (flipped weights, flipped optimizer
moments). A real Trainer (tiny GPT-2 from a config), real files, both backends."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import aiopersist  # noqa: E402
from aiopersist.integrations.transformers import AioPersistCallback  # noqa: E402
from tests.conftest import flip_byte  # noqa: E402
from tests.e2e.test_hf_trainer import (  # noqa: E402
    BACKENDS,
    _assert_same_weights,
    _StopAt,
    _trainer,
    _weights,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with the callback, stopped after step 4: checkpoint-2 and checkpoint-4."""
    out = tmp_path_factory.mktemp("interrupted") / "run"
    _trainer(out, [AioPersistCallback(backend="threads"), _StopAt(4)]).train()
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]
    return out


def _copy(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to, symlinks=True)
    return to


@pytest.fixture(scope="module")
def from_checkpoint_2(interrupted: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The weights of a stock Trainer resumed from checkpoint-2 (intact) to the end."""
    run = _copy(interrupted, tmp_path_factory.mktemp("stock") / "run")
    trainer = _trainer(run, [], save_strategy="no")
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    return _weights(trainer)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.pt", "trainer_state.json"])
def test_a_damaged_checkpoint_named_by_its_path_is_refused_before_anything_is_loaded(
    interrupted: Path, tmp_path: Path, backend: str, damaged: str
) -> None:
    run = _copy(interrupted, tmp_path / "run")
    checkpoint = run / "checkpoint-4"
    flip_byte(checkpoint / damaged)
    trainer = _trainer(run, [AioPersistCallback(backend=backend)])
    before = _weights(trainer)
    with pytest.raises(aiopersist.CheckpointCorruptError, match=f"checkpoint-4.*{damaged}.*checksum"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    _assert_same_weights(_weights(trainer), before)  # nothing of it loaded
    assert trainer.state.global_step == 0
    assert sorted(os.listdir(run)) == ["checkpoint-2", "checkpoint-4"]  # nothing written or deleted


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_true_passes_over_a_damaged_newest_checkpoint_and_ends_as_stock_from_the_one_before(
    interrupted: Path,
    tmp_path: Path,
    backend: str,
    from_checkpoint_2: dict[str, torch.Tensor],
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = _copy(interrupted, tmp_path / "run")
    flip_byte(run / "checkpoint-4" / "optimizer.pt")  # the Trainer alone loads it silently
    callback = AioPersistCallback(backend=backend)
    trainer = _trainer(run, [callback])
    with caplog.at_level(logging.WARNING, logger="aiopersist"):
        trainer.train(resume_from_checkpoint=True)
    said = [r.getMessage() for r in caplog.records if "resume_from_checkpoint=True" in r.getMessage()]
    assert len(said) == 1, said
    assert f"resuming from {run / 'checkpoint-2'}, " in said[0], said
    assert "passed over: checkpoint-4 (" in said[0], said
    assert "optimizer.pt: checksum mismatch" in said[0], said
    _assert_same_weights(_weights(trainer), from_checkpoint_2)
    # The run saved checkpoint-4 again, whole: the damaged one is gone.
    assert str(run / "checkpoint-4") in callback.saved
    asyncio.run(aiopersist.verify(run / "checkpoint-4", backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_true_with_every_checkpoint_damaged_is_refused_naming_each(
    interrupted: Path, tmp_path: Path, backend: str
) -> None:
    run = _copy(interrupted, tmp_path / "run")
    flip_byte(run / "checkpoint-4" / "model.safetensors")
    (run / "checkpoint-2" / "scheduler.pt").unlink()
    trainer = _trainer(run, [AioPersistCallback(backend=backend)])
    before = _weights(trainer)
    with pytest.raises(aiopersist.CheckpointCorruptError) as caught:
        trainer.train(resume_from_checkpoint=True)
    message = str(caught.value)
    assert "no checkpoint in" in message
    assert "checkpoint-4/model.safetensors: checksum mismatch" in message
    assert "checkpoint-2/scheduler.pt: missing" in message
    _assert_same_weights(_weights(trainer), before)
    assert sorted(os.listdir(run)) == ["checkpoint-2", "checkpoint-4"]


def test_checkpoints_without_a_manifest_and_verify_on_resume_false_are_the_trainer_s(
    interrupted: Path, tmp_path: Path
) -> None:
    """A stock save's checkpoint (no manifest) is not checked: the Trainer resumes from it
    as it would. ``verify_on_resume=False`` leaves even a damaged one to the Trainer,
    which loads the flipped weights."""
    run = _copy(interrupted, tmp_path / "run")
    (run / "checkpoint-4" / "aiopersist.json").unlink()
    trainer = _trainer(run, [AioPersistCallback(backend="threads")], max_steps=6, save_strategy="no")
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 6

    run = _copy(interrupted, tmp_path / "run-unchecked")
    flip_byte(run / "checkpoint-4" / "model.safetensors")
    trainer = _trainer(run, [AioPersistCallback(verify_on_resume=False)], max_steps=6, save_strategy="no")
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-4"))  # loaded, damage and all
    assert trainer.state.global_step == 6
