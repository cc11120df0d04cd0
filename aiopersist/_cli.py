"""The ``aiopersist`` command line: ``doctor``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from ._backends import describe_platform, probe_io_uring
from ._direct import probe_directory
from ._exceptions import AiopersistError


def _doctor(args: argparse.Namespace) -> int:
    rows = list(describe_platform().items())
    path = os.path.abspath(args.path)
    rows.append(("path", path))
    try:
        dio = probe_directory(path)
    except OSError as exc:  # CheckpointIOError included
        rows.append(("O_DIRECT", f"cannot probe: {exc}"))
    else:
        rows.append(("O_DIRECT", "yes" if dio.direct else f"no: {dio.reason}"))
        rows.append(
            ("alignment", f"memory {dio.mem_align}, offset {dio.offset_align} (from {dio.source})")
            if dio.direct
            else ("alignment", "none needed (buffered I/O)")
        )
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    import torch

    directory = os.path.abspath(args.dir) if args.dir else tempfile.mkdtemp(prefix="aiopersist-demo-")
    os.makedirs(directory, exist_ok=True)
    # A transformer-shaped state: embeddings, per-layer attention and MLP weights in bf16/fp32.
    torch.manual_seed(0)
    hidden, layers = 1024, max(1, args.size_mib // 24)
    state: dict[str, torch.Tensor] = {"embed.weight": torch.randn(8192, hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        state[f"layers.{i}.attn.qkv.weight"] = torch.randn(3 * hidden, hidden, dtype=torch.bfloat16)
        state[f"layers.{i}.attn.out.weight"] = torch.randn(hidden, hidden, dtype=torch.bfloat16)
        state[f"layers.{i}.mlp.up.weight"] = torch.randn(4 * hidden, hidden, dtype=torch.bfloat16)
        state[f"layers.{i}.mlp.down.weight"] = torch.randn(hidden, 4 * hidden, dtype=torch.bfloat16)
        state[f"layers.{i}.norm.weight"] = torch.ones(hidden, dtype=torch.float32)
    total = sum(t.numel() * t.element_size() for t in state.values())
    print(f"state: {len(state)} tensors, {total / (1 << 20):.0f} MiB, saved under {directory}")
    methods = ["torch.save"] + ["threads"] + (["io_uring"] if probe_io_uring().usable else [])
    saves: dict[str, list[float]] = {m: [] for m in methods}
    loads: dict[str, list[float]] = {m: [] for m in methods}
    print(f"{args.rounds} interleaved round(s), page cache dropped before each save and load (when root)")
    try:
        for r in range(args.rounds):
            for name in methods[r % len(methods) :] + methods[: r % len(methods)]:
                save_s, load_s, same = _demo_once(name, state, directory)
                if not same:
                    print(f"{name}: the loaded state differs from the saved one", file=sys.stderr)
                    return 1
                saves[name].append(save_s)
                loads[name].append(load_s)
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    gib = total / (1 << 30)
    base_save, base_load = statistics.median(saves["torch.save"]), statistics.median(loads["torch.save"])
    cols = ("method", "save s", "GiB/s", "speedup", "load s", "GiB/s", "speedup")
    print("{:<11} {:>7} {:>6} {:>8} {:>7} {:>6} {:>8}  identical".format(*cols))
    for name in methods:
        s_med, l_med = statistics.median(saves[name]), statistics.median(loads[name])
        print(
            f"{name:<11} {s_med:>7.2f} {gib / s_med:>6.2f} {base_save / s_med:>7.2f}x "
            f"{l_med:>7.2f} {gib / l_med:>6.2f} {base_load / l_med:>7.2f}x  yes"
        )
    print("medians; torch.save is followed by an fsync so that both sides are durable")
    return 0


def _demo_once(name: str, state: dict[str, torch.Tensor], directory: str) -> tuple[float, float, bool]:
    """One save and one load by ``name``: seconds for each, and whether the state came back."""
    import torch

    from ._api import load, save

    if name == "torch.save":
        target = os.path.join(directory, "torch-save.pt")
        _drop_caches()
        t0 = time.perf_counter()
        with open(target, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        save_s = time.perf_counter() - t0
        _drop_caches()
        t0 = time.perf_counter()
        loaded = torch.load(target, weights_only=True)
        load_s = time.perf_counter() - t0
    else:
        target = os.path.join(directory, f"ckpt-{name}")
        _drop_caches()
        info = asyncio.run(save(state, target, backend=name, overwrite=True))
        save_s = info.seconds
        _drop_caches()
        t0 = time.perf_counter()
        loaded = asyncio.run(load(target, backend=name))
        load_s = time.perf_counter() - t0
    same = loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    return save_s, load_s, same


def _drop_caches() -> None:
    """Drop the page cache (root only) so that reads come from the disk, not memory."""
    if os.geteuid() != 0:
        return
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def _bench_raw(args: argparse.Namespace) -> int:
    from ._bench import format_raw, run_raw

    directory = os.path.abspath(args.dir)
    os.makedirs(directory, exist_ok=True)
    report = run_raw(
        directory,
        size_bytes=int(args.size_gib * (1 << 30)),
        rounds=args.rounds,
        chunk_bytes=args.chunk_mib << 20 if args.chunk_mib else None,
        buffers=args.buffers,
    )
    print(format_raw(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiopersist", description="Fast, asynchronous, crash-safe checkpoints."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine decides")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser(
        "doctor", help="what this machine supports: io_uring, O_DIRECT, alignment, backend"
    )
    doctor.add_argument("path", nargs="?", default=".", help="directory to probe for O_DIRECT (default: .)")
    doctor.set_defaults(func=_doctor)

    demo = sub.add_parser("demo", help="save and load a generated state with each backend; print throughput")
    demo.add_argument("--dir", help="where to write (default: a temporary directory)")
    demo.add_argument("--size-mib", type=int, default=1024, help="approximate state size (default: 1024)")
    demo.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    demo.add_argument("--keep", action="store_true", help="keep the checkpoints")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    raw = bench_sub.add_parser("raw", help="sequential write/read: io_uring, threads, buffered, against fio")
    raw.add_argument("--dir", default="bench-data", help="scratch directory on the disk to measure")
    raw.add_argument("--size-gib", type=float, default=2.0, help="file size per method (default: 2)")
    raw.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    raw.add_argument("--chunk-mib", type=int, help="request size in MiB (default: the staging buffer size)")
    raw.add_argument("--buffers", type=int, help="staging buffers, i.e. requests in flight")
    raw.set_defaults(func=_bench_raw)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(args.func(args))
    except (AiopersistError, OSError, ValueError, RuntimeError) as exc:
        print(f"aiopersist: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
