"""``aiopersist bench save --ranks R --dirs D``: a save spread over ranks and directories.

R worker processes join a gloo process group on localhost and build the same
transformer-shaped state (as DDP ranks hold the same weights). Each round, interleaved
and in alternating order, times two saves between barriers, page cache dropped before
each (as root):

- ``1x1``: rank 0 alone writes the whole state to the first directory;
- ``RxD``: every rank saves with ``replicated=True`` over the D directories, so each
  writes its share, balanced by the partitioner, to its own directory.

Reported: the median wall time and aggregate GiB/s of each, their ratio, and the bytes
each rank wrote (max over mean). Directories ``DIR/disk0``, ``DIR/disk1``, ... stand for
the SSDs; on one disk they share its bandwidth, so the ratio shows the cost of the
coordination rather than the gain of more disks.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from .ranks import drop_caches, join_workers, run_workers

_GiB = 1 << 30


@dataclass(frozen=True)
class SpreadReport:
    ranks: int
    dirs: int
    state_bytes: int
    single_seconds: tuple[float, ...]
    spread_seconds: tuple[float, ...]
    rank_bytes: tuple[int, ...]
    """Bytes each rank wrote in the last spread save."""

    @property
    def single_gib_s(self) -> float:
        return self.state_bytes / _GiB / statistics.median(self.single_seconds)

    @property
    def spread_gib_s(self) -> float:
        return self.state_bytes / _GiB / statistics.median(self.spread_seconds)

    @property
    def balance(self) -> float:
        mean = sum(self.rank_bytes) / len(self.rank_bytes)
        return max(self.rank_bytes) / mean if mean else 1.0


def _worker(rank: int, world: int, port: int, base: str, size: int, dirs: int, rounds: int) -> None:
    import torch.distributed as dist

    import aiopersist

    from .ckpt import _state_bytes, transformer_state

    join_workers(rank, world, port, timeout_s=600)
    solo = dist.new_group([0])
    state = transformer_state(size)
    disks = [os.path.join(base, f"disk{d}") for d in range(dirs)]
    single: list[float] = []
    spread: list[float] = []
    rank_bytes = 0

    def timed(run: Any) -> float:
        if rank == 0:
            drop_caches()
        dist.barrier()
        t0 = time.perf_counter()
        run()
        dist.barrier()
        return time.perf_counter() - t0

    def one() -> None:
        if rank == 0:
            asyncio.run(aiopersist.save(state, os.path.join(disks[0], "single"), group=solo))

    def many() -> None:
        nonlocal rank_bytes
        paths = [os.path.join(d, "spread") for d in disks]
        info = asyncio.run(aiopersist.save(state, paths, replicated=True))
        rank_bytes = info.bytes_written

    for r in range(rounds):
        order = [("single", one), ("spread", many)]
        if r % 2:
            order.reverse()
        for name, run in order:
            seconds = timed(run)
            (single if name == "single" else spread).append(seconds)
            dist.barrier()
            if rank == 0:
                for d in disks:
                    shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
    print(
        json.dumps(
            {
                "rank": rank,
                "single": single,
                "spread": spread,
                "bytes": rank_bytes,
                "state": _state_bytes(state),
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()


def run_spread(
    directory: str, *, size_bytes: int, ranks: int, dirs: int, rounds: int, out: TextIO = sys.stdout
) -> SpreadReport:
    """Run the benchmark with ``ranks`` worker processes; see the module docstring."""
    if ranks < 1 or dirs < 1:
        raise ValueError(f"--ranks and --dirs must be at least 1, got {ranks} and {dirs}")
    work = os.path.join(directory, f".aiopersist-bench-spread-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    out.write(
        f"{ranks} ranks x {dirs} directories against 1 x 1, {size_bytes / _GiB:.2f} GiB, {rounds} rounds\n"
    )
    out.flush()
    try:
        results = run_workers("aiopersist._bench.spread", ranks, (work, size_bytes, dirs, rounds))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return SpreadReport(
        ranks,
        dirs,
        int(results[0]["state"]),
        tuple(results[0]["single"]),
        tuple(results[0]["spread"]),
        tuple(int(d["bytes"]) for d in results),
    )


def format_spread(report: SpreadReport) -> str:
    single = statistics.median(report.single_seconds)
    spread = statistics.median(report.spread_seconds)
    label = f"{report.ranks}x{report.dirs}"
    return "\n".join(
        [
            f"aiopersist bench save --ranks {report.ranks} --dirs {report.dirs}: "
            f"{report.state_bytes / _GiB:.2f} GiB, medians",
            "",
            f"{'layout':<8} {'seconds':>8} {'GiB/s':>7} {'vs 1x1':>7}",
            f"{'1x1':<8} {single:>8.3f} {report.single_gib_s:>7.3f} {1.0:>6.2f}x",
            f"{label:<8} {spread:>8.3f} {report.spread_gib_s:>7.3f} {single / spread:>6.2f}x",
            "",
            "bytes per rank: "
            + ", ".join(f"{b / _GiB:.3f} GiB" for b in report.rank_bytes)
            + f" (max/mean {report.balance:.3f})",
        ]
    )


if __name__ == "__main__":
    a = sys.argv[1:]
    _worker(int(a[0]), int(a[1]), int(a[2]), a[3], int(a[4]), int(a[5]), int(a[6]))
