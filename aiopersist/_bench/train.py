"""``aiopersist bench train``: what checkpointing every step costs a training loop.

A CPU training loop (an MLP of about 50M parameters with AdamW, the batch sized so that
one step takes about as long as writing its checkpoint on the idle machine) checkpoints after every
optimizer step, in one of four modes, interleaved round by round:

- ``none``: no checkpoint (the baseline step time);
- ``torch.save``: ``torch.save`` of the state dicts plus fsync, in the loop;
- ``fence``: `BlockingCheckpointer` in fence mode: the save runs in the background and the
  next optimizer step waits on ``wait_staged()``;
- ``snapshot``: the same in snapshot mode (a host copy first, then the write);
- ``dcp``: ``torch.distributed.checkpoint.async_save`` of the model's and optimizer's
  state dicts (``get_state_dict``) with DCP's default stager (a host copy, in the call)
  and ``FileSystemWriter``; the next save waits for the previous upload;
- ``dcp-aiopersist``: the same with aiopersist's `FenceStager` and `AiopersistWriter`:
  no copy, and the next optimizer step waits on ``wait_staged``;
- ``fio``: a reference writer. ``fio`` writes the checkpoint's byte count (O_DIRECT,
  io_uring, 4 MiB requests, a fresh file, fsync at the end) in a separate process after
  each optimizer step, and the next optimizer step waits for it to exit. It does no
  serialisation, no copy and no checksum, but it is no floor: fio pays its process start
  and buffer setup each time, and the scheduler shares the cores between its threads
  and the training's.
  Skipped when ``fio`` is missing.

For each mode: the median step time and its overhead over ``none``, the time the training
thread was blocked per save (starting the save, plus waiting on the fence; for
``torch.save`` the whole save), that time as a share of the save's duration, and the peak
growth of resident memory. Targets: aiopersist adds at most 10% to the step time and
blocks at most 5% of the save's duration; fence mode stays within the staging pool.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from aiopersist import BlockingCheckpointer, BlockingSaveHandle

DCP_ASYNC_RATIO = 0.25
"""Target: ``dcp-aiopersist``'s step overhead at most this share of stock ``dcp``'s."""
MODES: tuple[str, ...] = ("none", "torch.save", "fio", "fence", "snapshot")
DCP_MODES: tuple[str, ...] = ("dcp", "dcp-aiopersist")
"""Also available (not run by default): ``dcp.async_save`` with DCP's own stager and
``FileSystemWriter``, and with aiopersist's `FenceStager` and `AiopersistWriter`."""


def build_model(hidden: int = 2048, layers: int = 12) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks)


def _rss_hwm_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


@dataclass(frozen=True)
class TrainResult:
    mode: str
    step_seconds: float
    """Median step time."""
    overhead: float
    """``step_seconds / none's - 1``."""
    blocked_seconds: float
    """Median time the training thread was blocked per save."""
    save_seconds: float
    """Median duration of one save (start to durable)."""
    rss_growth_mib: float
    """Peak resident-memory growth over the loop's own, worst round."""
    round_overheads: tuple[float, ...] = ()
    """Per round: the median step of the round over ``none``'s median step in the same
    round, less 1 (the spread of ``overhead``)."""

    @property
    def blocked_share(self) -> float:
        return self.blocked_seconds / self.save_seconds if self.save_seconds > 0 else 0.0


@dataclass(frozen=True)
class TrainReport:
    params: int
    checkpoint_bytes: int
    batch: int
    steps: int
    rounds: int
    staging_bytes: int
    results: tuple[TrainResult, ...]
    python_pace: dict[str, float] = field(default_factory=dict)
    """Per mode: a pure-Python thread's pace while a save runs, as a share of its pace
    without one (the interpreter the writer leaves to training)."""


def _fio_write(fio: str, path: str, size: int) -> subprocess.Popen[bytes]:
    """Start fio writing ``size`` bytes (rounded up to whole requests) to a fresh ``path``
    the way a save does."""
    chunk = min(4 << 20, -(-size // 4096) * 4096)
    size = -(-size // chunk) * chunk
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return subprocess.Popen(
        [
            fio,
            "--name=aiopersist-train-floor",
            "--filename=" + path.replace(":", "\\:"),
            "--rw=write",
            f"--bs={chunk}",
            f"--size={size}",
            "--ioengine=io_uring",
            "--direct=1",
            "--iodepth=8",
            "--end_fsync=1",
            "--fallocate=none",
            "--output-format=terse",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _fio_wait(proc: subprocess.Popen[bytes]) -> None:
    _, err = proc.communicate()
    if proc.returncode != 0:
        tail = err.decode(errors="replace")[-2000:]
        raise RuntimeError(f"fio failed (exit status {proc.returncode}): {tail}")


class _Loop:
    def __init__(self, directory: str, batch: int, hidden: int, layers: int) -> None:
        self.model = build_model(hidden, layers)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, hidden)
        self.directory = directory
        self.fio = shutil.which("fio") or "fio"
        self.checkpoint_bytes = sum(p.numel() for p in self.model.parameters()) * 4 * 3
        self.step()  # AdamW's state exists from here on: the checkpoint has its full size

    def step(self) -> None:
        loss = self.model(self.x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)

    def forward_backward(self) -> None:
        self.model(self.x).pow(2).mean().backward()

    def state(self) -> dict[str, object]:
        return {"model": self.model, "optim": self.opt}

    def run(
        self, mode: str, steps: int, ck: dict[str, BlockingCheckpointer]
    ) -> tuple[list[float], list[float], list[float], float]:
        """``steps`` steps checkpointing after each: step times, blocked time per save,
        save durations, peak RSS growth in MiB."""
        path = os.path.join(self.directory, f"ckpt-{mode}")
        step_times: list[float] = []
        blocked: list[float] = []
        save_times: list[float] = []
        handle: BlockingSaveHandle | None = None
        fio: subprocess.Popen[bytes] | None = None
        fio_started = 0.0
        waited = 0.0
        base_kib = _status_kib("VmRSS")
        _rss_hwm_reset()
        upload: Any = None  # dcp modes: the previous async_save's upload future
        stager: Any = None
        upload_started = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            self.forward_backward()
            if stager is not None:
                tw = time.perf_counter()
                stager.wait_staged(upload)  # the fence: right before the optimizer mutates
                waited = time.perf_counter() - tw
            if handle is not None:
                tw = time.perf_counter()
                handle.wait_staged()  # the fence: right before the optimizer mutates
                waited = time.perf_counter() - tw
            if fio is not None:
                tw = time.perf_counter()
                _fio_wait(fio)
                blocked.append(time.perf_counter() - tw)
                save_times.append(time.perf_counter() - fio_started)
                fio = None
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
            ts = time.perf_counter()
            if mode == "torch.save":
                with open(path + ".pt", "wb") as f:
                    torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()}, f)
                    f.flush()
                    os.fsync(f.fileno())
                save_times.append(time.perf_counter() - ts)
                blocked.append(time.perf_counter() - ts)
            elif mode == "fio":
                fio_started = time.perf_counter()
                fio = _fio_write(self.fio, path + ".fio", self.checkpoint_bytes)
            elif mode in DCP_MODES:
                if upload is not None:  # DCP saves one at a time
                    upload.result()
                    save_times.append(time.perf_counter() - upload_started)
                ts2 = time.perf_counter()
                upload, stager = _dcp_async_save(mode, self.model, self.opt, path)
                upload_started = ts2
                blocked.append(waited + time.perf_counter() - ts)
                waited = 0.0
            elif mode in ck:
                previous = handle
                # Starts at once if the previous save is durable; else waits for it here.
                handle = ck[mode].save(self.state(), path, overwrite=True)
                if previous is not None:
                    blocked.append(waited + time.perf_counter() - ts)
                    info = previous.wait()
                    if info is not None:
                        save_times.append(info.seconds)
            step_times.append(time.perf_counter() - t0)
        if handle is not None:
            info = handle.wait()
            if info is not None:
                save_times.append(info.seconds)
        if fio is not None:
            _fio_wait(fio)
            save_times.append(time.perf_counter() - fio_started)
        if upload is not None:
            upload.result()
            save_times.append(time.perf_counter() - upload_started)
        growth = (_status_kib("VmHWM") - base_kib) / 1024
        return step_times, blocked, save_times, growth


def _dcp_async_save(
    mode: str, model: torch.nn.Module, opt: torch.optim.Optimizer, path: str
) -> tuple[Any, Any]:
    """Start ``dcp.async_save`` of the model and optimizer: (its upload future, the
    stager whose fence the next optimizer step waits on, or None)."""
    import warnings

    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import async_save

    from ..integrations.dcp import AiopersistWriter, FenceStager

    # DCP's own writer warns from its upload thread on every overwrite (by design here),
    # and DCP from the upload thread, on every save, that there is no process group.
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says so on every call
        if mode == "dcp":
            writer = FileSystemWriter(path + ".dcp", overwrite=True)
            return async_save(state, checkpoint_id=path + ".dcp", storage_writer=writer), None
        aio = AiopersistWriter(overwrite=True)
        stager = FenceStager(aio)
        return async_save(state, checkpoint_id=path + ".dcp", storage_writer=aio, async_stager=stager), stager


def _step_seconds(loop: _Loop, batch: int, steps: int = 3) -> float:
    loop.x = torch.randn(batch, loop.x.shape[1])
    loop.step()  # warm-up: the allocator's caches for this batch size
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loop.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _calibrate(probe: _Loop, ck: BlockingCheckpointer, path: str, out: TextIO) -> int:
    """The batch size whose step takes about as long as one save of the checkpoint.

    A step costs a fixed part (the optimizer's pass over every parameter, the per-layer
    overhead) plus a part per sample, and the part per sample is not constant (caches),
    so the batch is found by the secant method on measured step times, starting from two
    small batches, until a step is within 10% of the save (at most 4 more steps).
    """
    saves = []
    for _ in range(2):
        info = ck.save(probe.state(), path, overwrite=True).wait()
        saves.append(info.seconds if info is not None else 0.5)
    save_s = min(saves)  # the first save also pays for the staging pool's first touch
    points = [(b, _step_seconds(probe, b)) for b in (32, 128)]
    for _ in range(4):
        b = next_batch(points, save_s)
        if b is None:
            break
        points.append((b, _step_seconds(probe, b)))
    batch, step_s = min(points, key=lambda p: abs(p[1] - save_s))
    out.write(f"calibration: one save {save_s:.2f} s on its own; batch {batch}: a step {step_s:.2f} s\n")
    return batch


def next_batch(points: Sequence[tuple[int, float]], save_s: float) -> int | None:
    """The next batch size to try, from the last two (batch, step seconds) measured; None
    when the last step is within 10% of ``save_s`` or the batch would not change."""
    (b0, t0), (b1, t1) = points[-2:]
    if abs(t1 / save_s - 1) <= 0.10:
        return None
    slope = (t1 - t0) / (b1 - b0) if b1 != b0 else 0.0
    # A noisy pair of steps can give a slope near 0 or below: then the whole step is taken
    # as per-sample cost (an underestimate of the batch, corrected on the next round).
    per_sample = slope if slope > 0 else t1 / b1
    # At most 4x either way per round: one noisy step must not send the batch flying.
    b = max(8, b1 // 4, min(4 * b1, round(b1 + (save_s - t1) / per_sample)))
    return None if b == b1 else b


def _python_pace(until: Callable[[], bool], at_least: float = 0.0) -> float:
    """Iterations per second of a pure-Python loop (it holds the GIL between checks)."""
    n = 0
    t0 = time.perf_counter()
    while True:
        for _ in range(2000):
            n += 1
        elapsed = time.perf_counter() - t0
        if until() and elapsed >= at_least:
            return n / elapsed


def _gil_share(loop: _Loop, ck: BlockingCheckpointer, path: str, rounds: int) -> float:
    """How much of its pace a pure-Python thread keeps while ``ck`` saves the loop's state:
    the median over ``rounds`` of (pace during a save) / (pace for as long without one)."""
    shares = []
    for _ in range(rounds):
        handle = ck.save(loop.state(), path, overwrite=True)
        t0 = time.perf_counter()
        during = _python_pace(handle.done)
        seconds = time.perf_counter() - t0
        handle.wait()
        alone = _python_pace(lambda: True, at_least=seconds)
        shares.append(during / alone)
    return statistics.median(shares)


def run_train(
    directory: str,
    *,
    rounds: int = 3,
    steps: int = 6,
    batch: int | None = None,
    hidden: int = 2048,
    layers: int = 12,
    modes: Sequence[str] = MODES,
    out: TextIO = sys.stdout,
) -> TrainReport:
    """Run the benchmark; see the module docstring. Files go under ``directory``."""
    if "fio" in modes and shutil.which("fio") is None:
        out.write("fio is not installed: the fio reference is skipped\n")
        modes = [m for m in modes if m != "fio"]
    os.makedirs(directory, exist_ok=True)
    work = os.path.join(directory, f".aiopersist-bench-train-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    checkpointers = {
        "fence": BlockingCheckpointer(mode="fence"),
        "snapshot": BlockingCheckpointer(mode="snapshot"),
    }
    try:
        probe = _Loop(work, 64, hidden, layers)
        params = sum(p.numel() for p in probe.model.parameters())
        ckpt_bytes = params * 4 * 3  # weights + AdamW's two moments
        if batch is None:
            batch = _calibrate(probe, checkpointers["fence"], os.path.join(work, "calibrate"), out)
        loop = _Loop(work, batch, hidden, layers)
        del probe
        out.write(
            f"model: {params / 1e6:.1f}M parameters, checkpoint {ckpt_bytes / 2**20:.0f} MiB, batch {batch}, "
            f"{steps} steps x {rounds} rounds per mode\n"
        )
        per_mode: dict[str, dict[str, list[float]]] = {
            m: {"step": [], "blocked": [], "save": [], "rss": [], "round": []} for m in modes
        }
        for r in range(rounds):
            order = list(modes[r % len(modes) :]) + list(modes[: r % len(modes)])
            for mode in order:
                os.sync()
                steps_t, blocked, saves, growth = loop.run(mode, steps, checkpointers)
                per_mode[mode]["step"] += steps_t[1:]  # the first step of a run warms up
                per_mode[mode]["blocked"] += blocked
                per_mode[mode]["save"] += saves
                per_mode[mode]["rss"].append(growth)
                per_mode[mode]["round"].append(statistics.median(steps_t[1:]))
                out.write(
                    f"round {r + 1}/{rounds}  {mode:<10} step {statistics.median(steps_t[1:]):.3f} s"
                    + (f"  blocked/save {statistics.median(blocked):.3f} s" if blocked else "")
                    + "\n"
                )
                out.flush()
        base = statistics.median(per_mode["none"]["step"]) if "none" in per_mode else float("nan")
        results = []
        base_rounds = per_mode["none"]["round"] if "none" in per_mode else []
        for mode in modes:
            d = per_mode[mode]
            step = statistics.median(d["step"])
            by_round = tuple(s / b - 1 for s, b in zip(d["round"], base_rounds, strict=False))
            results.append(
                TrainResult(
                    mode,
                    step,
                    step / base - 1,
                    statistics.median(d["blocked"]) if d["blocked"] else 0.0,
                    statistics.median(d["save"]) if d["save"] else 0.0,
                    max(d["rss"]),
                    by_round,
                )
            )
        pace = {
            mode: _gil_share(loop, checkpointers[mode], os.path.join(work, f"gil-{mode}"), rounds)
            for mode in ("fence", "snapshot")
            if mode in modes
        }
        staging = checkpointers["fence"].checkpointer.pool.capacity_bytes
        return TrainReport(params, ckpt_bytes, batch, steps, rounds, staging, tuple(results), pace)
    finally:
        for ck in checkpointers.values():
            ck.close()
        shutil.rmtree(work, ignore_errors=True)


def dcp_overhead_ratio(report: TrainReport) -> tuple[float, tuple[float, ...]] | None:
    """``dcp-aiopersist``'s step overhead over stock ``dcp``'s: of the medians, and round
    by round (the same rounds, so the same state of the disk); ``None`` unless both modes
    ran and stock DCP cost something."""
    found = {r.mode: r for r in report.results}
    ours, stock = found.get("dcp-aiopersist"), found.get("dcp")
    if ours is None or stock is None or stock.overhead <= 0:
        return None
    rounds = tuple(o / s for o, s in zip(ours.round_overheads, stock.round_overheads, strict=False) if s > 0)
    return ours.overhead / stock.overhead, rounds


def format_train(report: TrainReport) -> str:
    lines = [
        f"aiopersist bench train: {report.params / 1e6:.1f}M parameters + AdamW, checkpoint "
        f"{report.checkpoint_bytes / 2**20:.0f} MiB every step, batch {report.batch}, medians",
        "",
        "{:<11} {:>7} {:>9} {:>15} {:>15} {:>7} {:>10} {:>14}".format(
            "mode",
            "step s",
            "overhead",
            "rounds min..max",
            "blocked/save s",
            "save s",
            "blocked %",
            "peak RSS +MiB",
        ),
    ]
    for r in report.results:
        blocked = f"{r.blocked_seconds:.3f}" if r.mode != "none" else "-"
        share = f"{100 * r.blocked_share:.1f}%" if r.mode != "none" else "-"
        save = f"{r.save_seconds:.2f}" if r.mode != "none" else "-"
        spread = (
            f"{100 * min(r.round_overheads):+.0f}%..{100 * max(r.round_overheads):+.0f}%"
            if r.mode != "none" and r.round_overheads
            else "-"
        )
        lines.append(
            f"{r.mode:<11} {r.step_seconds:>7.3f} {100 * r.overhead:>8.1f}% {spread:>15} {blocked:>15} "
            f"{save:>7} {share:>10} {r.rss_growth_mib:>14.0f}"
        )
    if report.python_pace:
        lines.append("")
        lines.append(
            "a pure-Python thread's pace while a save runs (the interpreter left to training): "
            + ", ".join(f"{mode} {100 * share:.0f}%" for mode, share in report.python_pace.items())
        )
    floor = next((r for r in report.results if r.mode == "fio"), None)
    if floor is not None:
        lines.append("")
        lines.append(
            f"reference: fio alone (O_DIRECT writes of the same bytes, no serialisation, another process) "
            f"adds {100 * floor.overhead:.1f}%"
        )
    lines.append("")
    lines.append(
        f"targets: aiopersist step overhead <= 10%, blocked <= 5% of a save, fence RSS growth over none's "
        f"within the staging pool ({report.staging_bytes / 2**20:.0f} MiB, +50% slack)"
    )
    ratio = dcp_overhead_ratio(report)
    if ratio is not None:
        median, rounds = ratio
        lines.append(
            f"  dcp-aiopersist overhead {median:.2f} of stock dcp's (target <= {DCP_ASYNC_RATIO:.2f}) "
            f"{'met' if median <= DCP_ASYNC_RATIO else 'MISSED'}"
            + (f"; by round {' '.join(f'{x:.2f}' for x in rounds)}" if rounds else "")
        )
    # The loop's own peak moves from run to run (the allocator); none's is subtracted.
    base_rss = next((r.rss_growth_mib for r in report.results if r.mode == "none"), 0.0)
    for r in report.results:
        extra_rss = r.rss_growth_mib - base_rss
        if r.mode in ("fence", "snapshot"):
            lines.append(
                f"  {r.mode:<9} overhead {100 * r.overhead:.1f}% "
                f"{'met' if r.overhead <= 0.10 else 'MISSED'}; "
                f"blocked {100 * r.blocked_share:.1f}% {'met' if r.blocked_share <= 0.05 else 'MISSED'}"
                + (
                    f"; RSS {extra_rss:+.0f} MiB over none's "
                    f"{'met' if extra_rss * 2**20 <= report.staging_bytes * 1.5 else 'MISSED'}"
                    if r.mode == "fence"
                    else ""
                )
            )
    return "\n".join(lines)


def plot_train(report: TrainReport, path: str) -> None:
    """A chart of ``report`` as an image at ``path`` (PNG by its name): each mode's step
    overhead over ``none`` (median, with every round's) against the 10% target, beside the
    time the training thread was blocked per save."""
    from .ckpt import bars_with_rounds, pyplot

    plt = pyplot()
    fig, (ax_over, ax_blocked) = plt.subplots(
        1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]}, layout="constrained"
    )
    others = [r for r in report.results if r.mode != "none"]
    modes = [r.mode for r in others]
    xs = list(range(len(others)))
    colors = [_mode_color(m) for m in modes]
    bars_with_rounds(
        ax_over,
        [100 * r.overhead for r in others],
        [[100 * o for o in r.round_overheads] for r in others],
        colors,
        [f"{100 * r.overhead:+.0f}%" for r in others],
        width=0.6,
        label="one round (its median step over none's)",
    )
    ax_over.axhline(10, color="#444444", linestyle="--", linewidth=1, label="target: aiopersist +10%")
    ax_over.axhline(0, color="#444444", linewidth=0.8)
    ax_over.legend(loc="best", fontsize=8)
    ax_over.set_xticks(xs, modes, fontsize=9)
    ax_over.set_xlim(-0.5, len(others) - 0.2)
    ax_over.set_ylabel("step time over none's (%)")
    ax_over.set_title("overhead per step (bar: median step over all rounds)", fontsize=11)
    ax_over.grid(axis="y", alpha=0.3)

    blocked = [1000 * r.blocked_seconds for r in others]
    ax_blocked.bar(xs, blocked, color=colors, width=0.6)
    for x, r in zip(xs, others, strict=True):
        ax_blocked.annotate(
            f"{1000 * r.blocked_seconds:.0f} ms\n{100 * r.blocked_share:.0f}% of a save",
            (x, 1000 * r.blocked_seconds),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax_blocked.set_ylim(0, max(blocked, default=0.0) * 1.3 + 1)
    ax_blocked.set_xticks(xs, modes, fontsize=9)
    ax_blocked.set_ylabel("training thread blocked per save (ms, median)")
    ax_blocked.set_title("blocked per save", fontsize=11)
    ax_blocked.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"aiopersist bench train: {report.params / 1e6:.1f}M parameters + AdamW, checkpoint "
        f"{report.checkpoint_bytes / 2**20:.0f} MiB every step, batch {report.batch}, "
        f"{report.steps} steps x {report.rounds} round(s)",
        fontsize=12,
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mode_color(mode: str) -> str:
    if mode in ("fence", "snapshot", "dcp-aiopersist"):
        return "#e6550d" if mode != "snapshot" else "#fdae6b"
    if mode == "fio":
        return "#9e9e9e"
    return "#3182bd"
