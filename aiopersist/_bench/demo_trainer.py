"""``aiopersist demo-trainer``: the Hugging Face Trainer with asynchronous checkpoints.

Offline (``HF_HUB_OFFLINE=1``: the model is built from a config, the data is generated),
a small GPT-2 is trained for ``steps`` steps, checkpointing every ``every`` steps:

1. ``none``: no checkpoints (the baseline step time);
2. ``stock``: the Trainer's own saving;
3. ``aiopersist``: the same saves through `AioPersistCallback`;
4. the aiopersist run again in a child process, killed with SIGKILL while it writes a
   checkpoint; a stock Trainer, knowing nothing of aiopersist, then resumes from the
   newest complete checkpoint (``get_last_checkpoint``) and trains to the end.

Runs 1 to 3 are made twice, interleaved (1 2 3 3 2 1), after a short warm-up run. It
prints the median step time of each and its overhead, the checkpoint's size and write
speed, and whether the resumed run ends with exactly the weights of the uninterrupted
one.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, TextIO, cast

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import transformers

from .._names import TMP_MARKER
from ..integrations.transformers import AioPersistCallback

_GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int = 4
    width: int = 384
    vocab: int = 8192
    seq: int = 64
    batch: int = 8


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Generated token sequences (a fixed seed: every run sees the same data)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def build_trainer(out: str, shape: Shape, steps: int, every: int | None, callbacks: list[Any]) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=shape.layers,
        n_head=max(1, shape.width // 64),
        n_embd=shape.width,
        vocab_size=shape.vocab,
        n_positions=shape.seq,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=shape.batch,
        learning_rate=3e-4,
        save_strategy="steps" if every else "no",
        save_steps=every or 1,
        logging_steps=10_000,
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    data = Tokens(steps * shape.batch, shape.seq, shape.vocab)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.remove_callback(transformers.PrinterCallback)  # the demo prints its own progress
    return trainer


class _Clock(transformers.TrainerCallback):
    """Step times, the time of each stock save, and a progress bar."""

    def __init__(self, label: str, steps: int, out: TextIO | None) -> None:
        self.label = label
        self.steps = steps
        self.out = out
        self.ends: list[float] = []
        self.saves: list[float] = []
        self._last = time.perf_counter()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if not self.ends:
            self._last = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        now = time.perf_counter()
        self.ends.append(now)
        self._step_end = now
        if self.out is not None:
            done = state.global_step
            bar = "#" * (24 * done // self.steps)
            self.out.write(f"\r  {self.label:<24} [{bar:<24}] step {done}/{self.steps}")
            self.out.flush()

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.saves.append(time.perf_counter() - self._step_end)

    def step_times(self) -> list[float]:
        # Step i's time runs from the end of step i-1 to the end of step i, so that a save
        # made in between is counted; the first step (warm-up) is left out.
        return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]


@dataclasses.dataclass(frozen=True)
class Run:
    label: str
    step: float
    save_seconds: float | None
    save_bytes: int | None


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def _timed(
    label: str,
    out_dir: str,
    shape: Shape,
    steps: int,
    every: int | None,
    aio: bool,
    progress: TextIO | None,
) -> tuple[list[float], list[float], int | None, dict[str, torch.Tensor]]:
    """One run: its step times, its save times, the checkpoint's size, the final weights."""
    shutil.rmtree(out_dir, ignore_errors=True)
    clock = _Clock(label, steps, progress)
    callbacks: list[Any] = [clock]
    callback = AioPersistCallback() if aio else None
    if callback is not None:
        callbacks.insert(0, callback)
    trainer = build_trainer(out_dir, shape, steps, every, callbacks)
    trainer.train()
    if progress is not None:
        progress.write("\n")
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    saves: list[float] = []
    size = None
    if every:
        size = _dir_bytes(os.path.join(out_dir, f"checkpoint-{(steps // every) * every}"))
        saves = [i.seconds for i in callback.infos] if callback is not None else list(clock.saves)
    return clock.step_times(), saves, size, weights


def _child(out_dir: str, steps: int, every: int) -> None:
    build_trainer(out_dir, Shape(), steps, every, [AioPersistCallback()]).train()


def run_demo(directory: str, *, steps: int = 30, every: int = 5, out: TextIO = sys.stdout) -> bool:
    """Run the demo under ``directory``; returns whether the resumed run matched."""
    shape = Shape()
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    params = sum(
        p.numel()
        for p in build_trainer(os.path.join(directory, "probe"), shape, 1, None, []).model.parameters()
    )
    out.write(
        f"aiopersist demo-trainer: GPT-2 built from a config ({shape.layers} layers, width {shape.width}, "
        f"{params / 1e6:.1f}M parameters), HF Trainer on generated tokens, {steps} steps, "
        f"a checkpoint every {every} steps\n"
    )
    # Warm-up: the first training in a process pays for allocations and thread start.
    build_trainer(os.path.join(directory, "warmup"), shape, 3, None, []).train()
    modes = [
        ("no checkpoints", "none", None, False),
        ("stock Trainer saving", "stock", every, False),
        ("AioPersistCallback", "aio", every, True),
    ]
    steps_of: dict[str, list[float]] = {m[0]: [] for m in modes}
    saves_of: dict[str, list[float]] = {m[0]: [] for m in modes}
    size_of: dict[str, int | None] = {}
    reference: dict[str, torch.Tensor] = {}
    for rnd in range(2):  # interleaved: A B C, then C B A
        for label, name, period, use_aio in modes if rnd == 0 else modes[::-1]:
            times, saves, nbytes, weights = _timed(
                f"{label} ({rnd + 1}/2)", os.path.join(directory, name), shape, steps, period, use_aio, out
            )
            steps_of[label] += times
            saves_of[label] += saves
            size_of[label] = nbytes
            if use_aio:
                reference = weights
    runs = [
        Run(
            label,
            statistics.median(steps_of[label]),
            statistics.median(saves_of[label]) if saves_of[label] else None,
            size_of[label],
        )
        for label, _, _, _ in modes
    ]
    none, stock, aio = runs

    # Killed mid-save, then resumed by a stock Trainer.
    run_dir = os.path.join(directory, "killed")
    child = subprocess.Popen(
        [sys.executable, "-m", "aiopersist._bench.demo_trainer", run_dir, str(steps), str(every)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    killed_at = None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and child.poll() is None:
            names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
            complete = [n for n in names if n.startswith("checkpoint-")]
            writing = [n for n in names if TMP_MARKER in n]
            if complete and writing and len(complete) * every >= steps // 2:
                child.send_signal(signal.SIGKILL)
                killed_at = writing[0].split(TMP_MARKER)[0].lstrip(".")
                break
            time.sleep(0.005)
    finally:
        child.kill()
        child.wait()
    last: str | None = cast(Any, transformers.trainer_utils).get_last_checkpoint(run_dir)
    out.write(f"  killed with SIGKILL while writing {killed_at or '(no save caught in flight)'}; ")
    matched = False
    if last is not None:
        out.write(f"newest complete: {os.path.basename(last)}\n")
        clock = _Clock("resumed, stock Trainer", steps, out)
        resumed = build_trainer(run_dir, shape, steps, None, [clock])
        resumed.train(resume_from_checkpoint=last)
        out.write("\n")
        after = resumed.model.state_dict()
        matched = all(torch.equal(after[k], v) for k, v in reference.items())
    else:
        out.write("no complete checkpoint to resume from\n")

    out.write("\n")
    out.write(f"{'run':<24} {'step s':>7} {'overhead':>9} {'save s':>7} {'GiB/s':>7} {'checkpoint':>11}\n")
    for r in (none, stock, aio):
        over = "-" if r is none else f"{100 * (r.step / none.step - 1):+.0f}%"
        save = f"{r.save_seconds:.2f}" if r.save_seconds else "-"
        rate = f"{r.save_bytes / _GiB / r.save_seconds:.2f}" if r.save_seconds and r.save_bytes else "-"
        size = f"{r.save_bytes / 2**20:.0f} MiB" if r.save_bytes else "-"
        out.write(f"{r.label:<24} {r.step:>7.3f} {over:>9} {save:>7} {rate:>7} {size:>11}\n")
    out.write(
        "\nstock 'save s' is the Trainer's own save, in the training thread (no fsync);\n"
        "aiopersist's is the background save, start to durable (O_DIRECT, fsynced).\n"
    )
    out.write(
        f"resumed after SIGKILL with a stock Trainer: final weights "
        f"{'MATCH' if matched else 'DIFFER FROM'} the uninterrupted run, bit for bit\n"
    )
    return matched


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
