"""A script for ``accelerate launch``: prepares a model and optimizer with an
``Accelerator`` on CPU (DDP over gloo), saves them with aiopersist over two directories
(or, with ``save-state``, with aiopersist's ``save_state`` and a save pre-hook that
writes a file naming its rank; with ``own-directories``, each rank into a directory of its
own), and prints one JSON line per rank."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from accelerate import Accelerator

import aiopersist
from tests._dist_worker import model_state


def save_state_and_restore(base: str) -> None:
    """Every rank: an async save_state through aiopersist, more training, then
    accelerate's own load_state, which must bring back the weights, the optimizer and
    this rank's RNG state."""
    import torch

    from aiopersist.integrations.accelerate import save_state_blocking

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(100 + accelerator.process_index)  # a different RNG state per rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    hooked: list[str] = []

    def save_hook(
        models: list[torch.nn.Module], weights: list[dict[str, torch.Tensor]], output_dir: str
    ) -> None:
        hooked.append(output_dir)
        with open(os.path.join(output_dir, "hook.json"), "w") as f:
            json.dump({"rank": accelerator.process_index}, f)

    accelerator.register_save_state_pre_hook(save_hook)

    def step() -> None:
        accelerator.backward(model(torch.randn(4, 32)).pow(2).mean())
        opt.step()
        opt.zero_grad()

    step()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state().clone()
    with aiopersist.BlockingCheckpointer() as ck:
        handle = save_state_blocking(accelerator, os.path.join(base, "ck"), checkpointer=ck)
        handle.wait_staged()
        step()
        handle.wait()
    accelerator.wait_for_everyone()
    step()
    accelerator.load_state(os.path.join(base, "ck"))
    restored = all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    restored = restored and torch.equal(torch.get_rng_state(), rng)
    line = {"rank": accelerator.process_index, "restored": bool(restored), "hooked": len(hooked)}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    accelerator.wait_for_everyone()


def own_directories(base: str) -> None:
    """Every rank names a directory of its own (as a ``tempfile.TemporaryDirectory()``
    made on each rank does), with no model: the stock ``save_state`` writes into each
    what its process writes (its RNG state, its save hook's file), and so must aiopersist's,
    for each rank's ``load_state`` of its own directory to bring back its RNG state."""
    import torch

    from aiopersist.integrations.accelerate import save_state_blocking

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index

    def save_hook(
        models: list[torch.nn.Module], weights: list[dict[str, torch.Tensor]], output_dir: str
    ) -> None:
        with open(os.path.join(output_dir, f"hook-{rank}.json"), "w") as f:
            json.dump({"rank": rank}, f)

    accelerator.register_save_state_pre_hook(save_hook)
    torch.manual_seed(100 + rank)  # a different RNG state per rank
    rng = torch.get_rng_state().clone()
    accelerator.save_state(os.path.join(base, f"stock-{rank}"))
    with aiopersist.BlockingCheckpointer() as ck:
        save_state_blocking(accelerator, os.path.join(base, f"ours-{rank}"), checkpointer=ck).wait()
    torch.rand(3)
    accelerator.load_state(os.path.join(base, f"ours-{rank}"))
    line = {"rank": rank, "restored": bool(torch.equal(torch.get_rng_state(), rng))}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    accelerator.wait_for_everyone()


def one_directory_taken(base: str) -> None:
    """Rank 1's directory is taken (not empty): its save_state raises, and rank 0's raises
    RankFailedError naming it at once, instead of waiting for rank 1 at the next
    collective until the timeout. Then both save again, together."""
    from aiopersist.integrations.accelerate import save_state_blocking

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    target = os.path.join(base, f"ck-{rank}")
    if rank == 1:
        os.makedirs(target)
        with open(os.path.join(target, "mine.txt"), "w") as f:
            f.write("kept")
    outcome = {}
    with aiopersist.BlockingCheckpointer() as ck:
        for attempt, directory in (("first", target), ("second", os.path.join(base, f"again-{rank}"))):
            try:
                save_state_blocking(accelerator, directory, checkpointer=ck).wait()
                outcome[attempt] = "ok"
            except Exception as exc:
                outcome[attempt] = f"{type(exc).__name__}: {exc}"
    sys.stdout.write(json.dumps({"rank": rank, **outcome}) + "\n")
    sys.stdout.flush()
    accelerator.wait_for_everyone()


def stopped_after_check(base: str) -> None:
    """Automatic naming. Process 1 is stopped (SIGSTOP) right after the check that its
    save_state's directory is free: process 0 must fail with RankFailedError within
    AIOPERSIST_DIST_TIMEOUT (the training's own barrier there waited for the process
    group's timeout, here 30 s; 30 minutes by default). Process 0 prints what it got,
    then kills process 1."""
    import datetime
    import signal

    import torch
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    import aiopersist._dist as dist_module
    from aiopersist.integrations.accelerate import save_state_blocking

    config = ProjectConfiguration(os.path.join(base, "project"), automatic_checkpoint_naming=True)
    accelerator = Accelerator(
        cpu=True,
        project_config=config,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=30))],
    )
    rank = accelerator.process_index
    model = accelerator.prepare(torch.nn.Linear(8, 8))
    del model
    outcome: dict[str, Any] = {}
    with aiopersist.BlockingCheckpointer() as ck:
        save_state_blocking(accelerator, checkpointer=ck).wait()
        if rank == 1:
            check_all = dist_module.Coordinator.check_all

            def stopped(self: Any, *args: Any) -> None:
                check_all(self, *args)
                with open(os.path.join(base, "pid-1"), "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)

            dist_module.Coordinator.check_all = stopped  # type: ignore[method-assign]
        try:
            save_state_blocking(accelerator, checkpointer=ck).wait()
            outcome["second"] = "ok"
        except Exception as exc:
            outcome["second"] = f"{type(exc).__name__}: {exc}"
    sys.stdout.write(json.dumps({"rank": rank, **outcome}) + "\n")
    sys.stdout.flush()
    with open(os.path.join(base, "pid-1")) as f:
        os.kill(int(f.read()), signal.SIGKILL)


def main() -> None:
    base = sys.argv[1]
    if sys.argv[2:] == ["one-directory-taken"]:
        one_directory_taken(base)
        return
    if sys.argv[2:] == ["stopped-after-check"]:
        stopped_after_check(base)
        return
    if sys.argv[2:] == ["save-state"]:
        save_state_and_restore(base)
        return
    if sys.argv[2:] == ["own-directories"]:
        own_directories(base)
        return
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
    try:
        main()
    finally:
        # As in _hf_ddp_worker: a gloo group left to the interpreter's teardown can abort it.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
