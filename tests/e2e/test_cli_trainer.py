"""``aiopersist ls`` and ``gc`` on a Hugging Face Trainer's ``output_dir``: real Trainer
runs (a tiny GPT-2 from a config, offline), stock and with `AioPersistCallback`; ``gc``
must leave what the Trainer's own ``save_total_limit`` rotation leaves."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import aiopersist  # noqa: E402
from aiopersist._cli.progress import human  # noqa: E402
from aiopersist._retention import SaveTotalLimit, to_delete  # noqa: E402
from tests._forkserver import aiopersist_cli  # noqa: E402
from tests.e2e.test_hf_trainer import EVAL, AioPersistCallback, _checkpoint_names, _trainer  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# An evaluation at every save; the loss falls, and a higher one is "better", so the best
# checkpoint is the first: the oldest, which rotation must keep.
BEST_FIRST: dict[str, Any] = {**EVAL, "greater_is_better": True}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m aiopersist ARGS``, in a process forked from one that has imported torch
    and the Hugging Face libraries once (tests/_forkserver.py)."""
    return aiopersist_cli(*args)


def _ls(run: Path) -> list[dict[str, Any]]:
    proc = _cli("ls", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout))


def _best(run: Path, name: str) -> str:
    state = json.loads((run / name / "trainer_state.json").read_text())
    return os.path.basename(state["best_model_checkpoint"])


def test_gc_leaves_what_the_trainers_own_rotation_leaves(tmp_path: Path) -> None:
    # The reference: the stock Trainer rotating with save_total_limit=2 keeps the best
    # (the first) and the newest.
    _trainer(tmp_path / "limited", [], **BEST_FIRST, save_total_limit=2).train()
    assert _checkpoint_names(tmp_path / "limited") == ["checkpoint-2", "checkpoint-8"]

    stock = tmp_path / "stock"
    _trainer(stock, [], **BEST_FIRST).train()  # no limit: every checkpoint stays
    assert _best(stock, "checkpoint-8") == "checkpoint-2"
    listed = _ls(stock)
    assert [(d["name"], d["kind"], d["complete"], d["best"]) for d in listed] == [
        ("checkpoint-2", "stock", True, True), ("checkpoint-4", "stock", True, False),
        ("checkpoint-6", "stock", True, False), ("checkpoint-8", "stock", True, False),
    ]  # fmt: skip
    for d in listed:
        files = [p for p in Path(d["path"]).rglob("*") if p.is_file()]
        assert d["bytes"] == sum(p.stat().st_size for p in files) > 0
    text = _cli("ls", str(stock)).stdout
    assert "best (trainer_state.json)" in text
    assert human(listed[0]["bytes"]) in text

    dry = _cli("gc", str(stock), "--keep-last", "2")
    assert dry.returncode == 0, dry.stderr
    assert "would delete checkpoint-4 (stock, " in dry.stdout
    assert "would delete checkpoint-6 (stock, " in dry.stdout
    assert "keeping 2 complete Trainer checkpoints: 2 (best), 8" in dry.stdout
    assert _checkpoint_names(stock) == [f"checkpoint-{s}" for s in (2, 4, 6, 8)]  # a dry run
    done = _cli("gc", str(stock), "--keep-last", "2", "--apply")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no progress line: stderr is a pipe
    assert _checkpoint_names(stock) == _checkpoint_names(tmp_path / "limited")
    # Resumable: the stock Trainer picks the newest and goes on.
    resumed = _trainer(stock, [], max_steps=9, save_strategy="no")
    resumed.train(resume_from_checkpoint=transformers.trainer_utils.get_last_checkpoint(str(stock)))
    assert resumed.state.global_step == 9


def test_ls_and_gc_on_callback_checkpoints_keep_the_best_and_every_k(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _trainer(run, [AioPersistCallback()], **BEST_FIRST).train()
    (run / "checkpoint-1").mkdir()  # a stock save that died before trainer_state.json
    listed = _ls(run)
    assert [(d["step"], d["kind"], d["complete"], d["best"]) for d in listed] == [
        (1, "stock", False, False), (2, "aiopersist", True, True), (4, "aiopersist", True, False),
        (6, "aiopersist", True, False), (8, "aiopersist", True, False),
    ]  # fmt: skip
    assert "trainer_state.json" in listed[0]["problem"]
    # The newest (8), the best (2), every multiple of 4; the broken one is older than the
    # newest complete one: nothing resumes from it.
    proc = _cli("gc", str(run), "--keep-last", "1", "--keep-every", "4", "--apply")
    assert proc.returncode == 0, proc.stderr
    assert "deleting checkpoint-1 (stock, incomplete)" in proc.stdout
    assert "keeping 3 complete Trainer checkpoints: 2 (best), 4, 8" in proc.stdout
    assert _checkpoint_names(run) == ["checkpoint-2", "checkpoint-4", "checkpoint-8"]
    for name in _checkpoint_names(run):
        asyncio.run(aiopersist.verify(run / name))


def test_gc_refuses_when_the_best_cannot_be_told(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (1, 2, 3):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text('{"best_model_checkpoint": null}')
    (run / "checkpoint-3" / "trainer_state.json").write_text("{not json")
    proc = _cli("gc", str(run), "--keep-last", "1", "--apply")
    assert proc.returncode == 1
    assert "cannot tell the best checkpoint" in proc.stderr
    assert "nothing was deleted" in proc.stderr
    assert _checkpoint_names(run) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


@pytest.mark.parametrize("limit", [1, 2, 3, 5])
@pytest.mark.parametrize("best", [None, 1, 3, 6, 9])
def test_save_total_limit_deletes_what_the_stock_rotation_deletes(
    tmp_path: Path, limit: int, best: int | None
) -> None:
    """`SaveTotalLimit` against transformers' own ``rotate_checkpoints`` on real
    directories, a best that is gone (9) included."""
    steps = [1, 2, 3, 5, 6]
    for s in steps:
        (tmp_path / f"checkpoint-{s}").mkdir()
    best_path = str(tmp_path / f"checkpoint-{best}") if best is not None else None
    transformers.trainer_utils.rotate_checkpoints(str(tmp_path), limit, best_path)
    left = sorted(int(n.split("-")[1]) for n in os.listdir(tmp_path))
    assert [s for s in steps if s not in left] == to_delete(steps, SaveTotalLimit(limit, best))


def test_a_crash_mid_delete_leaves_a_leftover_not_a_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    doomed = run / "checkpoint-1"
    (doomed / "many").mkdir(parents=True)
    for i in range(20_000):  # long enough to delete that the kill lands midway
        (doomed / "many" / str(i)).touch()
    (doomed / "trainer_state.json").write_text("{}")
    (run / "checkpoint-2").mkdir()
    (run / "checkpoint-2" / "trainer_state.json").write_text("{}")
    cmd = [sys.executable, "-m", "aiopersist", "gc", str(run), "--keep-last", "1", "--apply"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    killed = False
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if any(".aiopersist-trash-" in n for n in os.listdir(run)):
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(0.001)
    finally:
        proc.kill()
        proc.wait()
    assert killed, "never saw the deletion in progress"
    trash = [n for n in os.listdir(run) if ".aiopersist-trash-" in n]
    assert len(trash) == 1
    assert trash[0].startswith(".checkpoint-1.")
    assert (run / trash[0] / "many").exists()  # killed midway: some of it is still there
    assert [d["name"] for d in _ls(run)] == ["checkpoint-2"]  # no checkpoint-1, whole or not
    text = _cli("ls", str(run)).stdout
    assert "leftovers of interrupted saves or deletions (1;" in text
    assert f"  {trash[0]}" in text
    proc2 = _cli("gc", str(run), "--leftovers", "--apply")
    assert proc2.returncode == 0, proc2.stderr
    assert [n for n in os.listdir(run) if not n.startswith(".aiopersist-manager")] == ["checkpoint-2"]
