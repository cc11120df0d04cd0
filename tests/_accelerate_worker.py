"""A script for ``accelerate launch``: prepares a model and optimizer with an
``Accelerator`` on CPU (DDP over gloo), saves them with aiopersist over two directories,
and prints one JSON line per rank."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from accelerate import Accelerator

import aiopersist
from tests._dist_worker import model_state


def main() -> None:
    base = sys.argv[1]
    accelerator = Accelerator(cpu=True)
    state = model_state()
    model, optim = accelerator.prepare(state["model"], state["optim"])
    paths = [os.path.join(base, "a", "ck"), os.path.join(base, "b", "ck")]
    info = asyncio.run(
        aiopersist.save({"model": accelerator.unwrap_model(model), "optim": optim}, paths, replicated=True)
    )
    line = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "distributed": str(accelerator.distributed_type),
        "bytes": info.bytes_written,
    }
    sys.stdout.write(json.dumps(line) + "\n")  # one write: the ranks share one pipe
    sys.stdout.flush()
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
