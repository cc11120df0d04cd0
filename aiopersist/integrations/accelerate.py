"""An asynchronous ``accelerator.save_state()`` for Accelerate training loops.

``handle = await save_state(accelerator, "ckpt/step-100")`` writes what
``accelerator.save_state`` writes, in Accelerate's own layout, so that
``accelerator.load_state("ckpt/step-100")`` restores it:

- ``model.safetensors``: the prepared model's state dict (``get_state_dict(model,
  unwrap=False)``, as ``save_state`` takes it);
- ``optimizer.bin``, ``scheduler.bin``: ``torch.save`` of their state dicts (the
  optimizer's streamed through the engine);
- ``random_states_<rank>.pkl`` for every process;
- ``scaler.pt`` with mixed precision, and ``custom_checkpoint_<i>.pkl`` for objects
  registered with ``register_for_checkpointing``;
- ``sampler.bin`` and ``dl_state_dict.bin`` where ``save_state`` writes them (the sampler
  of a sharded iterable dataset, the state of a stateful data loader).

It returns once the save is started. Call ``await handle.staged`` (or
``handle.wait_staged()`` from a synchronous loop with `save_state_blocking`) before the
next ``optimizer.step()``, and ``await handle.done`` when it must be durable. The
directory appears only once complete (atomic rename).

With several processes, every process calls it. Their RNG states are gathered to
process 0 (a few KiB over the checkpoint's gloo group), which writes the whole
directory. The model and optimizer are those of process 0, as with
``save_state`` under DDP. On other processes the handle is already resolved.
"""

from __future__ import annotations

import io
import os
import random
from typing import Any

import numpy as np
import torch

from .. import _knobs
from .._api import TorchSave
from .._blocking import BlockingCheckpointer, BlockingSaveHandle
from .._checkpointer import Checkpointer, SaveHandle


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rng_states(step: int) -> dict[str, Any]:
    """What Accelerate's ``save_accelerator_state`` writes to ``random_states_<rank>.pkl``."""
    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def _plan(accelerator: Any) -> tuple[object, dict[str, bytes | TorchSave], Any]:
    """The model's state dict, the other files, and the group process 0 saves in."""
    models = list(accelerator._models)
    if len(models) != 1:
        raise ValueError(
            f"aiopersist's save_state supports one prepared model; this Accelerator has {len(models)}"
        )
    model_state = accelerator.get_state_dict(models[0], unwrap=False)
    nbytes = sum(t.numel() * t.element_size() for t in model_state.values() if isinstance(t, torch.Tensor))
    if nbytes > _knobs.shard_bytes():
        # load_state reads one model.safetensors; a bigger model would be split in shards.
        raise ValueError(
            f"the model's state is {nbytes} bytes, more than one safetensors file holds here "
            f"({_knobs.shard_bytes()}); set AIOPERSIST_SHARD_BYTES above it"
        )
    extra: dict[str, bytes | TorchSave] = {}
    for i, opt in enumerate(accelerator._optimizers):
        extra["optimizer.bin" if i == 0 else f"optimizer_{i}.bin"] = TorchSave(opt.state_dict())
    for i, sched in enumerate(accelerator._schedulers):
        extra["scheduler.bin" if i == 0 else f"scheduler_{i}.bin"] = _torch_bytes(sched.state_dict())
    for i, loader in enumerate(accelerator._dataloaders):
        # As save_accelerator_state does: the seedable sampler of a sharded iterable
        # dataset, and the state of a stateful data loader.
        from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler  # type: ignore[import-untyped]

        if isinstance(loader.dataset, IterableDatasetShard):
            sampler = loader.get_sampler()
            if isinstance(sampler, SeedableRandomSampler):
                extra["sampler.bin" if i == 0 else f"sampler_{i}.bin"] = _torch_bytes(sampler)
        if getattr(loader, "use_stateful_dataloader", False):
            extra["dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin"] = _torch_bytes(
                loader.state_dict()
            )
    if accelerator.scaler is not None:
        extra["scaler.pt"] = _torch_bytes(accelerator.scaler.state_dict())
    for i, obj in enumerate(accelerator._custom_objects):
        extra[f"custom_checkpoint_{i}.pkl"] = TorchSave(obj.state_dict())
    mine = _rng_states(accelerator.step)
    group = None
    world = accelerator.num_processes
    if world > 1:
        import torch.distributed as dist

        from .._dist import coordinator, process0_group

        coord = coordinator()
        everyone: list[Any] = [None] * world
        assert coord is not None
        dist.all_gather_object(everyone, mine, group=coord.group)
        for rank, states in enumerate(everyone):
            extra[f"random_states_{rank}.pkl"] = _torch_bytes(states)
        group = process0_group(coord)
    else:
        extra["random_states_0.pkl"] = _torch_bytes(mine)
    return model_state, extra, group


async def save_state(
    accelerator: Any,
    output_dir: str | os.PathLike[str],
    *,
    checkpointer: Checkpointer,
    overwrite: bool = False,
) -> SaveHandle:
    """Start an asynchronous ``accelerator.save_state(output_dir)``; see the module
    docstring. ``checkpointer`` does the saving (keep one for the whole run)."""
    model_state, extra, group = _plan(accelerator)
    if accelerator.process_index != 0:
        return _done(os.fspath(output_dir))
    return await checkpointer.save(
        model_state, output_dir, overwrite=overwrite, extra_files=extra, group=group
    )


def save_state_blocking(
    accelerator: Any,
    output_dir: str | os.PathLike[str],
    *,
    checkpointer: BlockingCheckpointer,
    overwrite: bool = False,
) -> BlockingSaveHandle:
    """`save_state` for synchronous training loops, with a `BlockingCheckpointer`:
    ``handle.wait_staged()`` before the next optimizer step, ``handle.wait()`` for
    durability."""
    model_state, extra, group = _plan(accelerator)
    if accelerator.process_index != 0:
        return BlockingSaveHandle(
            checkpointer._portal, checkpointer._portal.call(_done_async, os.fspath(output_dir))
        )
    return checkpointer.save(model_state, output_dir, overwrite=overwrite, extra_files=extra, group=group)


def _done(path: str) -> SaveHandle:
    import asyncio

    loop = asyncio.get_running_loop()
    staged: asyncio.Future[None] = loop.create_future()
    done: asyncio.Future[Any] = loop.create_future()
    staged.set_result(None)
    done.set_result(None)
    return SaveHandle(path, staged, done, skipped=True)


async def _done_async(path: str) -> SaveHandle:
    return _done(path)
