"""A script for ``torchrun --nproc_per_node 2``: an ``Accelerator`` with an FSDP2 plugin
(``SHARDED_STATE_DICT``) on CPU over gloo (made to take the plugin: `_cpu_fsdp`) prepares
two models, each with its optimizer (``pytorch_model_fsdp_0/``, ``_1/``, ``optimizer_0/``,
``_1/``), a scheduler and a save hook that writes into a subdirectory, and saves the
same state twice: with the stock ``accelerator.save_state`` and with aiopersist's
``save_state_blocking`` (or, with ``async``, ``save_state``), training one step while
ours is in flight. Then each is loaded
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


class _Progress:
    """A registered object whose ``state_dict()`` is its live ``__dict__``."""

    def __init__(self) -> None:
        self.step = 100
        self.history = [1, 2, 3]

    def advance(self) -> None:
        self.step += 1
        self.history.append(self.step)

    def state_dict(self) -> dict[str, Any]:
        return self.__dict__

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


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
    head = torch.nn.Linear(8, 6)  # a second model (a critic, a head), with its own optimizer
    head_opt = torch.optim.SGD(head.parameters(), lr=1e-2, momentum=0.9)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    head, head_opt = accelerator.prepare(head, head_opt)  # FSDP2: one model per prepare()
    torch.manual_seed(100 + accelerator.process_index)  # a different RNG state per rank
    hook_loads: list[str] = []

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        # A hook that writes into a subdirectory, as a diffusers-style hook does.
        os.makedirs(os.path.join(output_dir, "hooked", "nested"), exist_ok=True)  # every rank
        with open(os.path.join(output_dir, "hooked", "nested", "note.json"), "w") as f:
            json.dump({"models": len(models)}, f)

    def load_hook(models: list[Any], input_dir: str) -> None:
        with open(os.path.join(input_dir, "hooked", "nested", "note.json")) as f:
            hook_loads.append(json.dumps(json.load(f)))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    progress = _Progress()  # a registered object, changed right after the save is staged
    accelerator.register_for_checkpointing(progress)

    def step() -> None:
        accelerator.backward(head(model(torch.randn(4, 32))).pow(2).mean())
        for o in (opt, head_opt):
            o.step()
        sched.step()
        for o in (opt, head_opt):
            o.zero_grad()

    def weights() -> dict[str, torch.Tensor]:
        out = {}
        for i, m in enumerate((model, head)):
            out.update({f"{i}.{k}": v.full_tensor().clone() for k, v in m.state_dict().items()})
        for i, o in enumerate((opt, head_opt)):  # the optimizers' state: what a resume needs
            for p, st in o.state.items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        out[f"opt{i}.{id(p)}.{k}"] = v.full_tensor().clone()
        return out

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
            progress.advance()
            step()
            ck._portal.call(wait, started.done)
        else:
            handle = save_state_blocking(accelerator, ours, checkpointer=ck)
            handle.wait_staged()
            progress.advance()
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
    report["hook_loads"] = hook_loads
    report["lr"] = sched.get_last_lr()
    if accelerator.process_index == 0:
        report["verify"] = len(asyncio.run(aiopersist.verify(ours)).files)
        report["custom"] = [
            torch.load(os.path.join(out, name, "custom_checkpoint_0.pkl"), weights_only=True)
            for name in ("stock", "ours")
        ]
    path = os.path.join(out, f"report-{accelerator.process_index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    torch.distributed.destroy_process_group()
    # As in _dcp_worker: torch keeps the default group alive past destroy_process_group()
    # under FSDP2, and its gloo threads can abort the interpreter's exit now and then.
    os._exit(0)
