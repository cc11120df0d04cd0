"""``aiopersist demo-trainer``: the Hugging Face Trainer with asynchronous checkpoints.

Offline (``HF_HUB_OFFLINE=1``: the model is built from a config, the data is generated),
a small GPT-2 is trained for ``steps`` steps, checkpointing every ``every`` steps:

1. ``none``: no checkpoints (the baseline step time);
2. ``stock``: the Trainer's own saving;
3. ``aiopersist``: the same saves through `AioPersistCallback`;
4. the aiopersist run again in a child process, killed with SIGKILL while it writes a
   checkpoint; a stock Trainer, knowing nothing of aiopersist, then resumes from the
   newest complete checkpoint (``get_last_checkpoint``) and trains to the end.

After a short warm-up run, runs 1 to 3 are made ``rounds`` times, interleaved, the order
reversed every other round (1 2 3, 3 2 1, 1 2 3, ...). A run's step time is its mean
step, saves included (the first step is left out): what checkpointing costs the
training's throughput. Each round's overhead is taken against that round's baseline;
the demo prints the median over the rounds with their range, and says when a difference
is within the noise: no larger than the baseline's own spread from round to round. It
also prints the checkpoint's size and write speed, whether the resumed run ends with
exactly the weights of the uninterrupted one, and how long the demo took.
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


def _heads(width: int) -> int:
    """Attention heads of about 64 dimensions each that divide ``width`` (GPT-2's rule)."""
    return next(h for h in range(max(1, width // 64), 0, -1) if width % h == 0)


def build_model(shape: Shape) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=shape.layers,
        n_head=_heads(shape.width),
        n_embd=shape.width,
        vocab_size=shape.vocab,
        n_positions=shape.seq,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        # GPT-2's defaults (50256) lie outside this vocabulary; the config says so on
        # stderr. The last token of the vocabulary stands for both here.
        bos_token_id=shape.vocab - 1,
        eos_token_id=shape.vocab - 1,
    )
    model = transformers.GPT2LMHeadModel(config)
    # transformers finds a model's loss by its class name, and "GPT2LMHeadModel" names
    # none: it would warn and fall back to the causal-LM loss. Named here, it is the same loss.
    model.loss_type = "ForCausalLM"
    # lm_head.weight is wte.weight (tied), so no checkpoint holds it, the Trainer's own
    # included. On resume the Trainer re-ties the keys a checkpoint lacks when they are the
    # model's ``_keys_to_ignore_on_save``, and otherwise reports them as missing
    # ("missing keys: ['lm_head.weight']"), which GPT-2 in this version of transformers
    # leaves empty. Listing the tied keys there changes no checkpoint: they are not saved anyway.
    model._keys_to_ignore_on_save = set(model.all_tied_weights_keys)
    return model


def build_trainer(
    out: str, shape: Shape, steps: int, every: int | None, callbacks: list[Any], *, save: bool = True
) -> Any:
    """A Trainer of ``steps`` steps over ``out``, saving every ``every`` steps (if
    ``save``; without, ``every`` is still recorded, as the checkpoint resumed from did)."""
    # The stock save draws a "Writing model shards" bar on stderr whatever ``disable_tqdm``
    # says; the demo prints its own progress.
    cast(Any, transformers.utils.logging).disable_progress_bar()
    model = build_model(shape)
    args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=shape.batch,
        learning_rate=3e-4,
        save_strategy="steps" if every and save else "no",
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
    """Step ends, the time of each stock save, and a progress bar on a terminal."""

    def __init__(self, label: str, steps: int, out: TextIO | None) -> None:
        self.label = label
        self.steps = steps
        self.out = out if out is not None and out.isatty() else None
        self.ends: list[float] = []
        self.saves: list[float] = []
        self._step_end = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        now = time.perf_counter()
        self.ends.append(now)
        self._step_end = now
        if self.out is not None:
            done = state.global_step
            bar = "#" * (24 * done // self.steps)
            self.out.write(f"\r  {self.label:<28} [{bar:<24}] step {done}/{self.steps}")
            self.out.flush()

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.saves.append(time.perf_counter() - self._step_end)

    def mean_step(self) -> float:
        """The mean step from the end of the first step to the end of the last: step i
        runs from the end of step i-1 to the end of step i, so a save made in between is
        counted; the first step (warm-up) is left out."""
        return (self.ends[-1] - self.ends[0]) / (len(self.ends) - 1)

    def clear(self) -> None:
        if self.out is not None:
            self.out.write("\r" + " " * (len(self.label) + 48) + "\r")


@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    step_seconds: tuple[float, ...]
    """Per round, in order: the run's mean step time, saves included."""
    overheads: tuple[float, ...]
    """Per round: ``step / that round's baseline step - 1`` (empty for the baseline)."""
    save_seconds: float | None
    """Median duration of one save (stock: in the training thread; aiopersist: start to durable)."""
    save_bytes: int | None

    @property
    def step_median(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def overhead_median(self) -> float:
        return statistics.median(self.overheads)


@dataclasses.dataclass(frozen=True)
class DemoReport:
    params: int
    shape: Shape
    steps: int
    every: int
    rounds: int
    methods: tuple[Method, ...]
    """The baseline first."""
    killed_at: str | None
    resumed_from: str | None
    matched: bool
    seconds: float = 0.0

    @property
    def baseline_spread(self) -> float:
        """The baseline's own spread from round to round: (max - min) / median."""
        steps = self.methods[0].step_seconds
        return (max(steps) - min(steps)) / statistics.median(steps)

    def within_noise(self, method: Method) -> bool:
        """Whether ``method``'s median overhead is no larger than the baseline's spread
        (always with one round: there is no spread to compare with)."""
        return self.rounds < 2 or abs(method.overhead_median) <= self.baseline_spread


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def _timed(
    label: str,
    out_dir: str,
    shape: Shape,
    steps: int,
    every: int | None,
    aio: bool,
    progress: TextIO,
) -> tuple[float, list[float], int | None, dict[str, torch.Tensor]]:
    """One run: its mean step time, its save times, the checkpoint's size, the final weights."""
    shutil.rmtree(out_dir, ignore_errors=True)
    clock = _Clock(label, steps, progress)
    callbacks: list[Any] = [clock]
    # The clock's on_save only times the stock save: it never reads the checkpoint.
    callback = AioPersistCallback(durable_on_save=False) if aio else None
    if callback is not None:
        callbacks.insert(0, callback)
    trainer = build_trainer(out_dir, shape, steps, every, callbacks)
    trainer.train()
    clock.clear()
    step = clock.mean_step()
    progress.write(f"  {label:<28} {step:.3f} s/step\n")
    progress.flush()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    saves: list[float] = []
    size = None
    if every:
        size = _dir_bytes(os.path.join(out_dir, f"checkpoint-{(steps // every) * every}"))
        saves = [i.seconds for i in callback.infos] if callback is not None else list(clock.saves)
    return step, saves, size, weights


def _child(out_dir: str, steps: int, every: int, layers: int, width: int) -> None:
    shape = Shape(layers=layers, width=width)
    build_trainer(out_dir, shape, steps, every, [AioPersistCallback()]).train()


def _kill_and_resume(
    directory: str, shape: Shape, steps: int, every: int, reference: dict[str, torch.Tensor], out: TextIO
) -> tuple[str | None, str | None, bool]:
    """The aiopersist run in a child process, killed with SIGKILL while it writes a
    checkpoint past half-way, then resumed by a stock Trainer: (the checkpoint being
    written, the one resumed from, whether the final weights equal ``reference``)."""
    run_dir = os.path.join(directory, "killed")
    child = subprocess.Popen(
        [sys.executable, "-m", "aiopersist._bench.demo_trainer", run_dir]
        + [str(n) for n in (steps, every, shape.layers, shape.width)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    killed_at = None
    deadline = time.monotonic() + 300
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
    if last is None:
        out.write("no complete checkpoint to resume from\n")
        return killed_at, None, False
    out.write(f"newest complete: {os.path.basename(last)}\n")
    clock = _Clock("resumed, stock Trainer", steps, out)
    resumed = build_trainer(run_dir, shape, steps, every, [clock], save=False)
    resumed.train(resume_from_checkpoint=last)
    clock.clear()
    after = resumed.model.state_dict()
    matched = all(torch.equal(after[k], v) for k, v in reference.items())
    return killed_at, os.path.basename(last), matched


def run_demo(
    directory: str,
    *,
    steps: int = 20,
    every: int = 5,
    rounds: int = 4,
    shape: Shape | None = None,
    out: TextIO = sys.stdout,
) -> DemoReport:
    """Run the demo under ``directory`` (the model's ``shape``: `Shape` by default),
    printing its progress on ``out``."""
    started = time.perf_counter()
    shape = shape or Shape()
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    params = sum(p.numel() for p in build_model(shape).parameters())
    out.write(
        f"aiopersist demo-trainer: GPT-2 built from a config ({shape.layers} layers, width {shape.width}, "
        f"{params / 1e6:.1f}M parameters), HF Trainer on generated tokens, {steps} steps, "
        f"a checkpoint every {every} steps, {rounds} interleaved rounds\n"
    )
    out.flush()
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
    for rnd in range(rounds):  # interleaved: A B C, then C B A, ...
        for label, name, period, use_aio in modes if rnd % 2 == 0 else modes[::-1]:
            step, saves, nbytes, weights = _timed(
                f"{label} ({rnd + 1}/{rounds})",
                os.path.join(directory, name),
                shape,
                steps,
                period,
                use_aio,
                out,
            )
            steps_of[label].append(step)
            saves_of[label] += saves
            size_of[label] = nbytes
            if use_aio:
                reference = weights
    base = steps_of[modes[0][0]]
    methods = tuple(
        Method(
            label,
            tuple(steps_of[label]),
            () if i == 0 else tuple(s / b - 1 for s, b in zip(steps_of[label], base, strict=True)),
            statistics.median(saves_of[label]) if saves_of[label] else None,
            size_of[label],
        )
        for i, (label, _, _, _) in enumerate(modes)
    )
    killed_at, resumed_from, matched = _kill_and_resume(directory, shape, steps, every, reference, out)
    return DemoReport(
        params,
        shape,
        steps,
        every,
        rounds,
        methods,
        killed_at,
        resumed_from,
        matched,
        time.perf_counter() - started,
    )


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def format_demo(report: DemoReport) -> str:
    base = report.methods[0]
    lines = [
        "",
        f"{'run':<22} {'step s':>7} {'rounds min..max':>15} {'overhead':>9} {'rounds min..max':>15} "
        f"{'save s':>7} {'GiB/s':>6} {'checkpoint':>10}",
    ]
    for m in report.methods:
        steps = f"{min(m.step_seconds):.3f}..{max(m.step_seconds):.3f}"
        if m is base:
            over = spread = "-"
        else:
            over = _pct(m.overhead_median)
            spread = f"{_pct(min(m.overheads))}..{_pct(max(m.overheads))}"
        save = f"{m.save_seconds:.2f}" if m.save_seconds else "-"
        rate = f"{m.save_bytes / _GiB / m.save_seconds:.2f}" if m.save_seconds and m.save_bytes else "-"
        size = f"{m.save_bytes / 2**20:.0f} MiB" if m.save_bytes else "-"
        lines.append(
            f"{m.label:<22} {m.step_median:>7.3f} {steps:>15} {over:>9} {spread:>15} "
            f"{save:>7} {rate:>6} {size:>10}"
        )
    lines += [
        "",
        f"step s: a run's mean step, saves included; median over {report.rounds} rounds. overhead: against",
        "the same round's baseline. stock 'save s' is the Trainer's own save, in the training thread",
        "(no fsync); aiopersist's is the background save, start to durable (O_DIRECT, fsynced).",
        "",
    ]
    if report.rounds < 2:
        lines.append("one round: no spread to judge the noise by (--rounds 2 or more)")
    else:
        lines.append(
            f"noise: the baseline alone moved by {100 * report.baseline_spread:.0f}% between rounds "
            f"((max - min) / median)"
        )
        for m in report.methods[1:]:
            verdict = (
                "WITHIN NOISE: no larger than the baseline's own spread"
                if report.within_noise(m)
                else "beyond the baseline's spread"
            )
            lines.append(f"  {m.label}: {_pct(m.overhead_median)}, {verdict}")
        if any(report.within_noise(m) for m in report.methods[1:]):
            lines.append("  (more rounds, --rounds, or a machine with nothing else running narrow the noise)")
    lines.append("")
    if report.resumed_from is None:
        lines.append("resumed after SIGKILL with a stock Trainer: NO complete checkpoint to resume from")
    else:
        lines.append(
            f"resumed after SIGKILL with a stock Trainer from {report.resumed_from}: final weights "
            f"{'MATCH' if report.matched else 'DIFFER FROM'} the uninterrupted run, bit for bit"
        )
    lines.append(f"done in {report.seconds:.0f} s")
    return "\n".join(lines)


def plot_demo(report: DemoReport, path: str) -> None:
    """A chart of ``report`` as an image at ``path`` (PNG by its name): the mean step time
    of every round per run, and each method's overhead per round against the band of the
    baseline's own spread."""
    from .ckpt import bars_with_rounds, pyplot

    plt = pyplot()
    fig, (ax_step, ax_over) = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    colors = ["#9e9e9e", "#3182bd", "#e6550d"]
    labels = [m.label for m in report.methods]
    xs = list(range(len(labels)))
    bars_with_rounds(
        ax_step,
        [m.step_median for m in report.methods],
        [m.step_seconds for m in report.methods],
        colors[: len(labels)],
        [f"{m.step_median:.3f} s" for m in report.methods],
        width=0.6,
        alpha=0.8,
    )
    ax_step.legend(loc="best", fontsize=8)
    ax_step.set_xlim(-0.5, len(labels) - 0.2)
    ax_step.set_xticks(xs, labels, fontsize=9)
    ax_step.set_ylabel("mean step time, saves included (s)")
    ax_step.set_title("step time (bar: median over rounds)", fontsize=11)
    ax_step.grid(axis="y", alpha=0.3)

    others = report.methods[1:]
    ox = list(range(len(others)))
    spread = 100 * report.baseline_spread
    ax_over.axhspan(
        -spread, spread, color="#dddddd", label=f"within noise: the baseline's own spread ({spread:.0f}%)"
    )
    ax_over.axhline(0, color="#444444", linewidth=0.8)
    bars_with_rounds(
        ax_over,
        [100 * m.overhead_median for m in others],
        [[100 * o for o in m.overheads] for m in others],
        colors[1 : 1 + len(others)],
        [_pct(m.overhead_median) + (" (noise)" if report.within_noise(m) else "") for m in others],
        width=0.5,
        alpha=0.8,
    )
    ax_over.legend(loc="best", fontsize=8)
    ax_over.set_xticks(ox, [m.label for m in others], fontsize=9)
    ax_over.set_xlim(-0.5, len(others) - 0.1)
    # Scaled to the rounds' overheads; a wider band of noise fills the whole height.
    values = [100 * o for m in others for o in m.overheads] + [0.0, 10.0]
    low, high = min(values), max(values)
    margin = 0.25 * (high - low)
    ax_over.set_ylim(low - margin, high + 2 * margin)
    ax_over.set_ylabel("overhead over the same round's baseline (%)")
    ax_over.set_title("overhead (bar: median over rounds)", fontsize=11)
    ax_over.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"aiopersist demo-trainer: GPT-2 {report.params / 1e6:.1f}M parameters, {report.steps} steps, "
        f"a checkpoint every {report.every}, {report.rounds} rounds",
        fontsize=12,
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    _child(sys.argv[1], *map(int, sys.argv[2:6]))
