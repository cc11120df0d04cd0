"""``aiopersist bench dcp``: ``torch.distributed.checkpoint.save`` of one sharded state on
R ranks, through DCP's ``FileSystemWriter`` and through aiopersist's writer, against fio.

R worker processes join a gloo process group on localhost and hold a transformer-shaped
state as DTensors over a 1-D mesh (matrices sharded by rows, vectors replicated: DCP
writes a replicated tensor once). Each round, in an order that rotates from round to
round, every method saves the state once between barriers, with the page cache dropped
before each (as root) and the checkpoint deleted after each (untimed):

- ``fs-tN``: DCP's ``FileSystemWriter(sync_files=True, thread_count=N)`` for N in 1, 2, 4
  (its best thread count is the baseline);
- ``aiopersist``: `AiopersistWriter` (checksummed, published atomically);
- ``fio``: on rank 0 alone, sequential ``O_DIRECT`` writes of the same number of bytes
  (4 MiB requests, 8 in flight, ``fsync`` at the end), as ``bench raw`` runs it, timed by
  its own bandwidth (its process start-up left out).

Reported: each method's median wall time and GiB/s (the state's bytes over the time),
aiopersist's ratios to the best ``FileSystemWriter`` and to fio, and fio's own ratio to
the best ``FileSystemWriter`` (the ceiling of the first ratio on this disk). The per-step
training loop with ``dcp.async_save`` on each writer is ``aiopersist bench train --modes
none,dcp,dcp-aiopersist``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, TextIO

from .ranks import drop_caches, join_workers, run_workers

_GiB = 1 << 30
METHODS = ("fs-t1", "fs-t2", "fs-t4", "aiopersist", "fio")
DCP_VS_FILESYSTEM = 1.5
DCP_VS_FIO = 0.9


@dataclass(frozen=True)
class DcpReport:
    ranks: int
    state_bytes: int
    seconds: dict[str, tuple[float, ...]]
    fio_huge: bool

    def median(self, method: str) -> float:
        return statistics.median(self.seconds[method])

    def gib_s(self, method: str) -> float:
        return self.state_bytes / _GiB / self.median(method)

    @property
    def best_filesystem(self) -> str | None:
        fs = [m for m in self.seconds if m.startswith("fs-")]
        return min(fs, key=self.median) if fs else None


def _sharded(state: dict[str, Any], world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {
        k: distribute_tensor(t, mesh, [Shard(0)] if t.dim() >= 2 and t.shape[0] >= world else [Replicate()])
        for k, t in state.items()
    }


def _worker(rank: int, world: int, port: int, base: str, size: int, rounds: int, methods: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from ..integrations.dcp import AiopersistWriter
    from .ckpt import _state_bytes, transformer_state
    from .raw import _fio_run, _HugePages

    warnings.simplefilter("ignore")
    join_workers(rank, world, port, timeout_s=900)
    full = transformer_state(size)
    total = _state_bytes(full)
    state = _sharded(full, world)
    del full
    path = os.path.join(base, "ck")
    fio = shutil.which("fio")
    chunk, nbuf = 4 << 20, 8
    fio_bytes = -(-total // chunk) * chunk
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    fio_seconds: list[float] = []  # by fio's own bandwidth: not its start-up, as in bench raw

    def run(method: str) -> None:
        if method == "aiopersist":
            dcp_save(state, checkpoint_id=path, storage_writer=AiopersistWriter())
        elif method.startswith("fs-t"):
            writer = FileSystemWriter(path, sync_files=True, thread_count=int(method[4:]))
            dcp_save(state, checkpoint_id=path, storage_writer=writer)
        elif method == "fio":
            if rank == 0:
                assert fio is not None
                os.makedirs(base, exist_ok=True)
                gibs = _fio_run(fio, os.path.join(base, "fio.bin"), "write", fio_bytes, chunk, nbuf, huge.ok)
                fio_seconds.append(fio_bytes / _GiB / gibs)
        else:
            raise ValueError(method)

    with _HugePages(chunk * nbuf) as huge:
        for r in range(rounds):
            k = r % len(methods)
            for method in methods[k:] + methods[:k]:
                if rank == 0:
                    drop_caches()
                dist.barrier()
                t0 = time.perf_counter()
                run(method)
                dist.barrier()
                seconds[method].append(time.perf_counter() - t0)
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(base, "fio.bin"))
                dist.barrier()
        fio_huge = huge.ok
    if "fio" in seconds and rank == 0:
        seconds["fio"] = fio_seconds
    print(json.dumps({"rank": rank, "seconds": seconds, "state": total, "huge": fio_huge}), flush=True)
    dist.destroy_process_group()


def run_dcp(
    directory: str,
    *,
    size_bytes: int,
    ranks: int = 2,
    rounds: int = 3,
    methods: tuple[str, ...] = METHODS,
    out: TextIO = sys.stdout,
) -> DcpReport:
    """Run the benchmark with ``ranks`` worker processes; see the module docstring."""
    if ranks < 1:
        raise ValueError(f"--ranks must be at least 1, got {ranks}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")
    if "fio" in methods and shutil.which("fio") is None:
        methods = tuple(m for m in methods if m != "fio")
        out.write("fio is not installed: left out\n")
    work = os.path.join(directory, f".aiopersist-bench-dcp-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    out.write(
        f"dcp.save of {size_bytes / _GiB:.2f} GiB sharded over {ranks} ranks, {rounds} rounds, "
        f"methods {', '.join(methods)}, in {work}\n"
    )
    out.flush()
    try:
        results = run_workers("aiopersist._bench.dcp", ranks, (work, size_bytes, rounds, ",".join(methods)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    first = results[0]
    return DcpReport(
        ranks,
        int(first["state"]),
        {m: tuple(v) for m, v in first["seconds"].items()},
        bool(first["huge"]),
    )


def format_dcp(report: DcpReport) -> str:
    lines = [
        f"aiopersist bench dcp: {report.state_bytes / _GiB:.2f} GiB over {report.ranks} ranks, "
        f"{len(next(iter(report.seconds.values())))} rounds, medians",
        "",
        f"{'method':<12} {'seconds':>8} {'GiB/s':>7}  per round (s)",
    ]
    for m, secs in report.seconds.items():
        lines.append(
            f"{m:<12} {report.median(m):>8.3f} {report.gib_s(m):>7.3f}  " + " ".join(f"{s:.2f}" for s in secs)
        )
    lines.append("")
    best = report.best_filesystem
    if "aiopersist" in report.seconds and best is not None:
        ratio = report.median(best) / report.median("aiopersist")
        met = "met" if ratio >= DCP_VS_FILESYSTEM else "MISSED"
        lines.append(
            f"target  aiopersist >= {DCP_VS_FILESYSTEM:.2f}x the best FileSystemWriter ({best}): "
            f"{ratio:.2f}x  {met}"
        )
    if best is not None and "fio" in report.seconds:
        lines.append(
            f"ceiling fio is {report.median(best) / report.median('fio'):.2f}x the best FileSystemWriter "
            "on this disk: the most any writer reaches against it"
        )
    if "aiopersist" in report.seconds and "fio" in report.seconds:
        ratio = report.median("fio") / report.median("aiopersist")
        met = "met" if ratio >= DCP_VS_FIO else "MISSED"
        lines.append(f"target  aiopersist >= {DCP_VS_FIO:.2f}x fio: {ratio:.2f}x  {met}")
        lines.append(
            "note: fio's buffers were on hugetlb pages"
            if report.fio_huge
            else "note: fio's buffers were on ordinary pages (no hugetlb reservation)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    a = sys.argv[1:]
    _worker(int(a[0]), int(a[1]), int(a[2]), a[3], int(a[4]), int(a[5]), a[6].split(","))
