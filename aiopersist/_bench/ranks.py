"""What the multi-rank benchmarks share: worker processes on a gloo group over localhost,
and the page cache dropped before a timed run."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def drop_caches() -> None:
    """Sync, then (as root) drop the page cache: the next run reads and writes the disk."""
    os.sync()
    with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_workers(rank: int, ranks: int, port: int, timeout_s: float) -> None:
    """In a worker that `run_workers` started: join the gloo group of all of them, over
    localhost on ``port``."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def run_workers(module: str, ranks: int, args: Sequence[object]) -> list[dict[str, Any]]:
    """``python -m module RANK RANKS PORT *args`` for every rank, on a fresh port; each
    worker prints its result as its last JSON line. Their results, by rank."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *(str(v) for v in (r, ranks, port, *args))],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    results = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"a bench worker failed (exit status {p.returncode})")
        results.append(json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1]))
    return sorted(results, key=lambda d: int(d["rank"]))
