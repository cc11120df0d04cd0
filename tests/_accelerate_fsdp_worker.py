"""A script for ``torchrun --nproc_per_node 2``: an ``Accelerator`` with an FSDP2 plugin
(``SHARDED_STATE_DICT``) on CPU over gloo (made to take the plugin: `_cpu_fsdp`) prepares
a model, an optimizer and a scheduler, and saves the same state twice: with the stock
``accelerator.save_state`` and with aiopersist's ``save_state_blocking`` (or, with
``async``, ``save_state``), training one step while ours is in flight. Then each is loaded
back with the stock ``accelerator.load_state`` and one more step taken: both must end
with the same weights, bit for bit, and restore the saved ones and the RNG state.

``python -m tests._accelerate_fsdp_worker OUT BACKEND {blocking,async}``; process ``i``
writes its report to ``OUT/report-i.json``."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import torch

from tests._cpu_fsdp import force_fsdp_on_cpu


def main(out: str, backend: str, api: str) -> None:
    force_fsdp_on_cpu()
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    import aiopersist
    from aiopersist.integrations.accelerate import save_state, save_state_blocking

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    torch.manual_seed(100 + accelerator.process_index)  # a different RNG state per rank

    def step() -> None:
        accelerator.backward(model(torch.randn(4, 32)).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()

    def weights() -> dict[str, torch.Tensor]:
        return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}

    step()
    saved, rng = weights(), torch.get_rng_state()
    accelerator.save_state(os.path.join(out, "stock"))
    ours = os.path.join(out, "ours")
    with aiopersist.BlockingCheckpointer(backend=backend) as ck:
        if api == "async":
            # The coroutines run on the checkpointer's own event loop, as an asyncio loop would.
            async def start() -> Any:
                return await save_state(accelerator, ours, checkpointer=ck.checkpointer)

            async def wait(future: Any) -> None:
                await future

            started = ck._portal.call(start)
            ck._portal.call(wait, started.staged)
            step()
            ck._portal.call(wait, started.done)
        else:
            handle = save_state_blocking(accelerator, ours, checkpointer=ck)
            handle.wait_staged()
            step()  # the optimizer step mutates the shards: after the fence
            handle.wait()
    accelerator.wait_for_everyone()
    report: dict[str, Any] = {"rank": accelerator.process_index}
    ends = {}
    for name in ("stock", "ours"):
        step()  # away from the saved state
        accelerator.load_state(os.path.join(out, name))
        report[f"{name}_restored"] = all(torch.equal(v, saved[k]) for k, v in weights().items())
        report[f"{name}_rng"] = torch.equal(torch.get_rng_state(), rng)
        step()
        ends[name] = weights()
    report["same_end"] = all(torch.equal(ends["stock"][k], ends["ours"][k]) for k in saved)
    report["lr"] = sched.get_last_lr()
    if accelerator.process_index == 0:
        report["verify"] = len(asyncio.run(aiopersist.verify(ours)).files)
    path = os.path.join(out, f"report-{accelerator.process_index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    torch.distributed.destroy_process_group()
    # As in _dcp_worker: now and then torch's C++ teardown of the device mesh's gloo state
    # aborts the interpreter's exit ("terminate called without an active exception"),
    # after everything was done and reported (1 run in 5 or so under load; not traced).
    os._exit(0)
