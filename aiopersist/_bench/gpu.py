"""``aiopersist bench gpu``: what checkpointing costs a GPU training run.

A GPT-style decoder (about 1.07B parameters by default: 20 layers of width 2048, a 32k
vocabulary; bf16 weights, AdamW with fp32 moments, so 10 bytes per parameter in the
checkpoint) trains on the GPU, checkpointing every step and every 10 steps, in each of
these modes, interleaved round by round:

- ``none``: no checkpoint (the baseline);
- ``torch.save``: ``torch.save`` of the state dicts plus fsync, in the loop;
- ``dcp``: ``torch.distributed.checkpoint.async_save`` with the process-based checkpointer
  and the pinned, shared-memory stager (torchtitan's ``async_with_pinned_mem``): the
  optimizer step waits for its staging, the next save for the previous upload;
- ``fence`` and ``snapshot``: `BlockingCheckpointer` in either mode; the optimizer step
  waits on ``wait_staged()``, the next save for the previous one to be durable.

Steps are sized so that a checkpoint every step is possible at all: the number of
micro-batches per step is calibrated until a step takes about as long as one aiopersist
save on its own (every-10 runs use a tenth of those micro-batches, so a checkpoint is due
about as often in time). Per mode and cadence: the mean step time and its overhead over
``none``, the time the training thread was blocked per step, the save's duration, the
device-to-host rate of the copy out of the GPU (snapshot and ``dcp``; fence mode's copy is
paced by the disk) against a plain pinned copy measured in the same run, and the write
rate against fio on the same disk. Then loading to the GPU: `aiopersist.load` with
``map_location="cuda"`` against ``safetensors.torch.load_file(device="cuda")`` on the
same files, page cache dropped before each (when root).

Targets (checked on a GPU only): every-step overhead <= 3%, blocked <= 1% of a step,
device-to-host >= 80% of the pinned copy, overhead and blocked time at most a third of
``dcp``'s, writes >= 0.9x fio.

``--dry-run`` runs the same harness on the CPU with a tiny model (no pinned memory, no
targets): everything but the CUDA work, for the CPU machine's tests.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch
import torch.nn.functional as F

from aiopersist import BlockingCheckpointer, BlockingSaveHandle, load_sync

from .ranks import drop_caches

# aiopersist's modes first: when the time budget cuts a round short, they have run.
MODES: tuple[str, ...] = ("none", "fence", "snapshot", "dcp", "torch.save")
CADENCES: tuple[int, ...] = (1, 10)


# -- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 32768
    width: int = 2048
    layers: int = 20
    heads: int = 16
    seq: int = 1024

    @property
    def parameters(self) -> int:
        per_layer = 12 * self.width * self.width + 13 * self.width  # attention, MLP, norms, biases
        return self.vocab * self.width + self.seq * self.width + self.layers * per_layer + 2 * self.width


DRY_CONFIG = GPTConfig(vocab=512, width=64, layers=2, heads=4, seq=32)


def config_for(parameters: float) -> GPTConfig:
    """A width-2048 (or wider) GPT with at least ``parameters`` parameters."""
    width = 2048 if parameters <= 2.5e9 else 4096
    base = GPTConfig(width=width, heads=width // 128, layers=1)
    per_layer = base.parameters - GPTConfig(width=width, heads=width // 128, layers=0).parameters
    rest = GPTConfig(width=width, heads=width // 128, layers=0).parameters
    layers = max(1, math.ceil((parameters - rest) / per_layer))
    return GPTConfig(width=width, heads=width // 128, layers=layers)


class _Block(torch.nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1 = torch.nn.LayerNorm(c.width)
        self.qkv = torch.nn.Linear(c.width, 3 * c.width)
        self.proj = torch.nn.Linear(c.width, c.width)
        self.ln2 = torch.nn.LayerNorm(c.width)
        self.fc = torch.nn.Linear(c.width, 4 * c.width)
        self.out = torch.nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        mlp: torch.Tensor = self.out(F.gelu(self.fc(self.ln2(x))))
        return x + mlp


class GPT(torch.nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(c.vocab, c.width)
        self.pos = torch.nn.Embedding(c.seq, c.width)
        self.blocks = torch.nn.ModuleList(_Block(c) for _ in range(c.layers))
        self.ln = torch.nn.LayerNorm(c.width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.ln(x) @ self.embed.weight.t()  # the head tied to the embedding
        return logits


class MixedAdamW(torch.optim.Optimizer):
    """AdamW for low-precision weights with fp32 moments (as mixed-precision training keeps
    them): the update is computed in fp32 and rounded into the weights."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.95)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": 1e-8, "weight_decay": 0.1})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
                n = float(st["step"])
                g = p.grad.float()
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2**n)).sqrt_().add_(group["eps"])
                w = p.float().mul_(1 - group["lr"] * group["weight_decay"])
                w.addcdiv_(st["exp_avg"], denom, value=-group["lr"] / (1 - b1**n))
                p.copy_(w)


# -- measurement helpers --------------------------------------------------------------------


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def pinned_copy_gbps(device: torch.device, nbytes: int, rounds: int = 3) -> float | None:
    """Device-to-host GB/s of one plain copy into pinned memory (the best this link gives)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(rounds + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / min(times[1:]) / 1e9


# -- the training loop ----------------------------------------------------------------------


@dataclass
class RunFigures:
    """One run of one mode at one cadence."""

    steps: list[float] = field(default_factory=list)
    blocked: list[float] = field(default_factory=list)
    """Per step after the warm-up: the training thread's time spent in or waiting on saves."""
    saves: list[float] = field(default_factory=list)
    """Per save: from the call until durable."""
    staged: list[float] = field(default_factory=list)
    """Per save: from the call until the live tensors were free (the copy out of the GPU)."""
    written: list[float] = field(default_factory=list)
    """Per save: the write after staging (snapshot, dcp), or the whole save (fence)."""


class _Trainer:
    def __init__(self, cfg: GPTConfig, device: torch.device, micro_batch: int) -> None:
        self.cfg = cfg
        self.device = device
        dtype = torch.bfloat16
        with torch.device(device):
            self.model = GPT(cfg).to(dtype)
        self.opt = MixedAdamW(self.model.parameters())
        self.tokens = torch.randint(cfg.vocab, (micro_batch, cfg.seq + 1), device=device)
        self.accum = 1
        self.step(1)  # the optimizer's state exists from here: the checkpoint has its full size
        self.state_bytes = sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> Iterator[torch.Tensor]:
        yield from self.model.state_dict().values()
        for st in self.opt.state.values():
            yield from (v for v in st.values() if isinstance(v, torch.Tensor))

    def forward_backward(self, accum: int) -> None:
        x, y = self.tokens[:, :-1], self.tokens[:, 1:]
        for _ in range(accum):
            logits = self.model(x)
            loss = F.cross_entropy(logits.float().view(-1, self.cfg.vocab), y.reshape(-1)) / accum
            loss.backward()  # type: ignore[no-untyped-call]

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)

    def sync(self) -> None:
        """Wait for the training stream only: the saves' copies on their own streams run on."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def step(self, accum: int) -> float:
        t0 = time.perf_counter()
        self.forward_backward(accum)
        self.optimizer_step()
        self.sync()
        return time.perf_counter() - t0

    def state(self) -> dict[str, object]:
        return {"model": self.model, "optim": self.opt}

    def state_dicts(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


class _Dcp:
    """``dcp.async_save`` as torchtitan's ``async_with_pinned_mem`` runs it."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.dist = dist
        self.own_group = False
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
            dist.init_process_group("gloo", rank=0, world_size=1)
            self.own_group = True
        pinned = device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(pinned, True, True, pinned))

    def save(self, state: dict[str, Any], path: str) -> Any:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save

        return async_save(
            state,
            checkpoint_id=path,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self.stager,
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stager.close()
        if self.own_group:
            with contextlib.suppress(Exception):
                self.dist.destroy_process_group()


def _done_time(fut: Future[Any], start: float, out: list[float]) -> None:
    fut.add_done_callback(lambda _f: out.append(time.perf_counter() - start))


def run_mode(
    t: _Trainer,
    mode: str,
    cadence: int,
    saves: int,
    accum: int,
    where: str,
    ck: dict[str, BlockingCheckpointer],
    dcp: _Dcp | None,
) -> RunFigures:
    """One warm-up step, then ``cadence * saves`` steps with a save after every
    ``cadence``-th optimizer step."""
    fig = RunFigures()
    handle: BlockingSaveHandle | None = None
    pending: list[tuple[Any, float, list[float], list[float]]] = []  # dcp: response, start, staged, done
    aiop_started: list[tuple[BlockingSaveHandle, float]] = []
    paths: list[str] = []
    steps = 1 + cadence * saves
    for i in range(steps):
        t0 = time.perf_counter()
        t.forward_backward(accum)
        blocked = 0.0
        tw = time.perf_counter()
        if handle is not None:
            handle.wait_staged()  # the fence: right before the optimizer mutates
        if pending:
            pending[-1][0].staging_completion.result()
        blocked += time.perf_counter() - tw
        t.optimizer_step()
        t.sync()
        if i > 0 and (i - 1) % cadence == 0 and mode != "none":
            path = os.path.join(where, f"{mode.replace('.', '-')}-{i}")
            ts = time.perf_counter()
            if mode == "torch.save":
                with open(path + ".pt", "wb") as f:
                    torch.save(t.state_dicts(), f)
                    f.flush()
                    os.fsync(f.fileno())
                fig.saves.append(time.perf_counter() - ts)
                paths.append(path + ".pt")
            elif mode == "dcp":
                assert dcp is not None
                if pending:
                    pending[-1][0].upload_completion.result()  # one save at a time, as torchtitan
                    _remove(paths[-1])
                resp = dcp.save(t.state_dicts(), path)
                staged_at: list[float] = []
                done_at: list[float] = []
                _done_time(resp.staging_completion, ts, staged_at)
                _done_time(resp.upload_completion, ts, done_at)
                pending.append((resp, ts, staged_at, done_at))
                paths.append(path)
            else:
                handle = ck[mode].save(t.state(), path, overwrite=True)
                aiop_started.append((handle, ts))
                paths.append(path)
            blocked += time.perf_counter() - ts
        if i > 0:
            fig.steps.append(time.perf_counter() - t0)
            fig.blocked.append(blocked)
    for resp, _ts, staged_at, done_at in pending:
        resp.upload_completion.result()
        fig.staged += staged_at
        fig.saves += done_at
        if staged_at and done_at:
            fig.written.append(done_at[0] - staged_at[0])
    for h, _ts in aiop_started:
        info = h.wait()
        if info is not None:
            fig.saves.append(info.seconds)
            staged = h.staged_seconds or 0.0
            fig.staged.append(staged)
            fig.written.append(info.seconds - staged if mode == "snapshot" else info.seconds)
    for p in paths[:-1] if mode in ("fence", "snapshot") else paths:
        _remove(p)
    return fig


# -- the benchmark --------------------------------------------------------------------------


@dataclass
class ModeResult:
    mode: str
    cadence: int
    step_s: float
    overhead: float
    blocked_s: float
    blocked_share: float
    save_s: float | None
    d2h_gbps: float | None
    write_gbps: float | None
    error: str | None = None


@dataclass
class GpuReport:
    device: str
    dry_run: bool
    parameters: int
    checkpoint_bytes: int
    micro_batch: int
    accum: dict[int, int]
    rounds: int
    pinned_copy_gbps: float | None
    fio_write_gbps: float | None
    results: list[ModeResult]
    load: dict[str, float | None]
    targets: list[dict[str, Any]]
    notes: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _fio_gbps(directory: str, nbytes: int) -> float | None:
    fio = shutil.which("fio")
    if fio is None:
        return None
    from .raw import _fio_run

    chunk = 4 << 20
    size = max(chunk, min(nbytes, 8 << 30) // chunk * chunk)
    path = os.path.join(directory, "fio-write")
    try:
        return _fio_run(fio, path, "write", size, chunk, 8, False) * 2**30 / 1e9
    finally:
        _remove(path)


def _load_gbps(path: str, device: torch.device, rounds: int) -> dict[str, float | None]:
    """aiopersist.load(map_location=device) against safetensors' load_file on its files."""
    from safetensors.torch import load_file

    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    nbytes = sum(os.path.getsize(f) for f in files)
    times: dict[str, list[float]] = {"aiopersist": [], "safetensors": []}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for r in range(rounds):
        order = ["aiopersist", "safetensors"] if r % 2 == 0 else ["safetensors", "aiopersist"]
        for how in order:
            drop_caches()
            t0 = time.perf_counter()
            if how == "aiopersist":
                state = load_sync(path, map_location=str(device))
            else:
                state = {f: load_file(f, device=str(device)) for f in files}
            sync()
            times[how].append(time.perf_counter() - t0)
            del state
            if device.type == "cuda":
                torch.cuda.empty_cache()
    a, s = statistics.median(times["aiopersist"]), statistics.median(times["safetensors"])
    return {
        "bytes": float(nbytes),
        "aiopersist_gbps": nbytes / a / 1e9,
        "safetensors_gbps": nbytes / s / 1e9,
        "ratio": s / a,
    }


def run_gpu(
    directory: str,
    *,
    dry_run: bool = False,
    parameters: float = 1.0e9,
    micro_batch: int = 4,
    rounds: int = 2,
    modes: Sequence[str] = MODES,
    cadences: Sequence[int] = CADENCES,
    budget_s: float | None = None,
    out: TextIO = sys.stdout,
) -> GpuReport:
    """Run the benchmark (see the module docstring); files go under ``directory``."""
    started = time.perf_counter()
    notes: list[str] = []
    if dry_run:
        device = torch.device("cpu")
        cfg = DRY_CONFIG
        micro_batch = 2
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("bench gpu needs a CUDA device (use --dry-run to rehearse on the CPU)")
        device = torch.device("cuda", torch.cuda.current_device())
        cfg = config_for(parameters)
    os.makedirs(directory, exist_ok=True)
    work = os.path.join(directory, f".aiopersist-bench-gpu-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    checkpointers: dict[str, BlockingCheckpointer] = {}
    dcp: _Dcp | None = None
    try:
        t = _Trainer(cfg, device, micro_batch)
        params = sum(p.numel() for p in t.model.parameters())
        state_bytes = t.state_bytes
        # Snapshot mode holds the whole state in host memory: its budget is the state's size.
        budget = state_bytes + state_bytes // 20 + (64 << 20)
        for m in ("fence", "snapshot"):
            if m in modes:
                checkpointers[m] = BlockingCheckpointer(mode=m, snapshot_bytes=budget)
        out.write(
            f"model: {params / 1e9:.2f}B parameters (width {cfg.width}, {cfg.layers} layers), "
            f"checkpoint {t.state_bytes / 1e9:.2f} GB, on {device}\n"
        )
        if "dcp" in modes:
            try:
                dcp = _Dcp(device)
                warm = dcp.save(t.state_dicts(), os.path.join(work, "dcp-warm-up"))
                warm.upload_completion.result()  # the background process starts here, not in a run
                _remove(os.path.join(work, "dcp-warm-up"))
            except Exception as exc:
                notes.append(f"dcp.async_save could not run: {type(exc).__name__}: {exc}")
                modes = [m for m in modes if m != "dcp"]
                dcp = None
        # Calibration: one step, one save on its own (the faster aiopersist mode's time).
        step1 = statistics.median(t.step(1) for _ in range(3))
        save_alone = []
        for m, ck in checkpointers.items():
            for k in range(2):  # the first save pays the staging pool's and the ring's start
                info = ck.save(t.state(), os.path.join(work, f"calibrate-{m}"), overwrite=True).wait()
                if k and info is not None:
                    save_alone.append(info.seconds)
            _remove(os.path.join(work, f"calibrate-{m}"))
        save_s = min(save_alone) if save_alone else step1
        max_accum = 4 if dry_run else 256
        accum1 = max(1, min(max_accum, math.ceil(1.1 * save_s / step1)))
        accum = {c: max(1, round(accum1 / c)) if c > 1 else accum1 for c in cadences}
        out.write(
            f"calibration: a step of 1 micro-batch {step1:.3f} s, one save {save_s:.2f} s: "
            + ", ".join(f"every {c}: {a} micro-batches per step" for c, a in accum.items())
            + "\n"
        )
        pinned = pinned_copy_gbps(device, min(t.state_bytes, 4 << 30))
        saves_per_run = {c: 3 if c == 1 else 2 for c in cadences}

        def estimate(m: str, c: int) -> float:
            """Seconds one run should take, with a margin: its steps, plus the last save's
            completion (and for torch.save, its saves in the loop at about twice the time)."""
            seconds = (1 + c * saves_per_run[c]) * step1 * accum[c] + save_s
            if m == "torch.save":
                seconds += saves_per_run[c] * 2 * save_s
            return 1.25 * seconds

        # Runs that would not end before the budget's end (less what the fio reference, the
        # load comparison and closing need) are left out, and said to be.
        deadline = started + budget_s if budget_s is not None else math.inf
        reserve = 4 * save_s + 30
        figures: dict[tuple[str, int], list[RunFigures]] = {(m, c): [] for m in modes for c in cadences}
        errors: dict[tuple[str, int], str] = {}
        left_out: set[tuple[str, int]] = set()
        fio: list[float] = []
        rounds_run = 0
        interrupted = False
        try:
            for r in range(rounds):
                order = list(modes[r % len(modes) :]) + list(modes[: r % len(modes)])
                ran = 0
                for c in cadences:
                    for m in order:
                        if (m, c) in errors:
                            continue
                        if time.perf_counter() + estimate(m, c) + reserve > deadline:
                            left_out.add((m, c))
                            continue
                        drop_caches()
                        try:
                            fig = run_mode(t, m, c, saves_per_run[c], accum[c], work, checkpointers, dcp)
                        except Exception as exc:
                            errors[(m, c)] = f"{type(exc).__name__}: {exc}"
                            out.write(f"round {r + 1}: {m} every {c}: failed: {errors[(m, c)]}\n")
                            continue
                        ran += 1
                        figures[(m, c)].append(fig)
                        out.write(
                            f"round {r + 1}/{rounds} every {c:<2} {m:<10} "
                            f"step {statistics.mean(fig.steps):.3f} s  "
                            f"blocked {statistics.mean(fig.blocked):.3f} s\n"
                        )
                        out.flush()
                if not ran:
                    break
                rounds_run += 1
                if time.perf_counter() + 2 * save_s + 10 < deadline:
                    drop_caches()
                    g = _fio_gbps(work, t.state_bytes)
                    if g is not None:
                        fio.append(g)
        except KeyboardInterrupt:
            interrupted = True
            notes.append("interrupted (SIGINT, the time limit): only the runs that ended are reported")
        if left_out:
            notes.append(
                f"the time budget ({budget_s:.0f} s) left out "
                + ", ".join(f"{m} every {c}" for m, c in sorted(left_out))
                + " in some rounds (estimated from a step of "
                + f"{step1:.2f} s per micro-batch and a save of {save_s:.1f} s)"
            )
        rounds = rounds_run
        if not fio:
            notes.append("fio is not on PATH: no write ratio (the GPU check carries it in its bundle)")
        fio_gbps = _median(fio)
        results: list[ModeResult] = []
        for c in cadences:
            base_runs = figures.get(("none", c), [])
            base_steps = [s for f in base_runs for s in f.steps]
            base = statistics.mean(base_steps) if base_steps else None
            for m in modes:
                runs = figures[(m, c)]
                if not runs:
                    why = errors.get((m, c), "not run: time budget" if (m, c) in left_out else "not run")
                    nan = math.nan
                    results.append(ModeResult(m, c, nan, nan, nan, nan, None, None, None, why))
                    continue
                # The mean, not the median: at a cadence of 10 only one step in ten saves.
                step = statistics.mean(s for f in runs for s in f.steps)
                blocked = statistics.mean(b for f in runs for b in f.blocked)
                staged = _median([s for f in runs for s in f.staged])
                written = _median([w for f in runs for w in f.written])
                results.append(
                    ModeResult(
                        m,
                        c,
                        step,
                        step / base - 1 if base else math.nan,
                        blocked,
                        blocked / step,
                        _median([s for f in runs for s in f.saves]),
                        t.state_bytes / staged / 1e9 if staged and m in ("snapshot", "dcp") else None,
                        t.state_bytes / written / 1e9 if written and m in ("snapshot", "fence") else None,
                    )
                )
        # Loading to the device, from a fresh snapshot-mode checkpoint.
        load: dict[str, float | None] = {}
        try:
            if interrupted or time.perf_counter() + 4 * save_s > deadline:
                raise TimeoutError("no time left in the budget")
            ck = checkpointers.get("snapshot") or BlockingCheckpointer()
            path = os.path.join(work, "load-me")
            ck.save(t.state(), path, overwrite=True).wait()
            del t
            if device.type == "cuda":
                torch.cuda.empty_cache()
            load = _load_gbps(path, device, max(2, rounds))
            _remove(path)
        except Exception as exc:
            notes.append(f"the load comparison failed: {type(exc).__name__}: {exc}")
        targets = [] if dry_run else _targets(results, pinned, fio_gbps, cadences)
        return GpuReport(
            str(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu (dry run)",
            dry_run,
            params,
            state_bytes,
            micro_batch,
            accum,
            rounds,
            pinned,
            fio_gbps,
            results,
            load,
            targets,
            notes,
        )
    finally:
        for ck in checkpointers.values():
            ck.close()
        if dcp is not None:
            dcp.close()
        shutil.rmtree(work, ignore_errors=True)


def _targets(
    results: list[ModeResult], pinned: float | None, fio: float | None, cadences: Sequence[int]
) -> list[dict[str, Any]]:
    """The issue's targets, each with the figure measured and whether it was met."""
    by = {(r.mode, r.cadence): r for r in results if r.error is None}
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, at_most: bool) -> None:
        met = None if value is None or math.isnan(value) else (value <= limit if at_most else value >= limit)
        out.append({"target": name, "value": value, "limit": limit, "met": met})

    every = by.get(("dcp", 1))
    for m in ("fence", "snapshot"):
        r = by.get((m, 1))
        if r is None:
            continue
        add(f"{m}: every-step overhead <= 3%", r.overhead, 0.03, True)
        add(f"{m}: blocked <= 1% of a step", r.blocked_share, 0.01, True)
        if every is not None and every.overhead > 0:
            add(f"{m}: overhead <= 1/3 of dcp's", r.overhead / every.overhead, 1 / 3, True)
        if every is not None and every.blocked_s > 0:
            add(f"{m}: blocked <= 1/3 of dcp's", r.blocked_s / every.blocked_s, 1 / 3, True)
        if fio and r.write_gbps is not None:
            add(f"{m}: writes >= 0.9x fio", r.write_gbps / fio, 0.9, False)
    snap = by.get(("snapshot", 1))
    if pinned and snap is not None and snap.d2h_gbps is not None:
        add("snapshot: device-to-host >= 80% of a pinned copy", snap.d2h_gbps / pinned, 0.8, False)
    return out


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_gpu(report: GpuReport) -> str:
    """The report as markdown (also what the command prints)."""
    lines = [
        f"## bench gpu{' (dry run on the CPU: no figure here means anything)' if report.dry_run else ''}",
        "",
        f"{report.device}; {report.parameters / 1e9:.2f}B parameters, checkpoint "
        f"{report.checkpoint_bytes / 1e9:.2f} GB; micro-batch {report.micro_batch}, micro-batches per step "
        + ", ".join(f"{a} (every {c})" for c, a in report.accum.items())
        + f"; {report.rounds} round(s), interleaved.",
        "",
        f"Plain pinned device-to-host copy: {_f(report.pinned_copy_gbps, '.1f')} GB/s; "
        f"fio write on the same disk: {_f(report.fio_write_gbps, '.2f')} GB/s.",
        "",
        "| every | mode | step s | overhead | blocked s/step | blocked % | save s | D2H GB/s | write GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report.results:
        if r.error is not None:
            lines.append(f"| {r.cadence} | {r.mode} | {r.error} | | | | | | |")
            continue
        lines.append(
            f"| {r.cadence} | {r.mode} | {r.step_s:.3f} | {r.overhead * 100:+.1f}% | {r.blocked_s:.4f} | "
            f"{r.blocked_share * 100:.2f}% | {_f(r.save_s, '.2f')} | {_f(r.d2h_gbps, '.1f')} | "
            f"{_f(r.write_gbps, '.2f')} |"
        )
    if report.load:
        where = "the CPU" if report.dry_run else "the GPU"
        lines += [
            "",
            f"Loading {(report.load.get('bytes') or 0) / 1e9:.2f} GB to {where}: "
            f"aiopersist {_f(report.load.get('aiopersist_gbps'), '.2f')} GB/s, safetensors.load_file "
            f"{_f(report.load.get('safetensors_gbps'), '.2f')} GB/s: {_f(report.load.get('ratio'), '.2f')}x.",
        ]
    if report.targets:
        met = sum(1 for t in report.targets if t["met"])
        lines += ["", f"Targets: {met} of {len(report.targets)} met.", ""]
        lines += ["| target | figure | met |", "| --- | --- | --- |"]
        verdict = {True: "yes", False: "no", None: "-"}
        for t in report.targets:
            lines.append(f"| {t['target']} | {_f(t['value'], '.3f')} | {verdict[t['met']]} |")
    lines += [f"- note: {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


def _finite(obj: Any) -> Any:
    """NaN (a mode that did not run) as null: the JSON stays standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def write_outputs(report: GpuReport, json_path: str | None, markdown_path: str | None) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(_finite(report.to_json()), f, indent=1)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(format_gpu(report))
