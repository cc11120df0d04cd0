"""A torchtitan-style FSDP2 training loop that checkpoints through DCP on aiopersist.

Every rank shards a small transformer-like MLP with ``fully_shard`` and trains it with
AdamW on synthetic data. Every ``--every`` steps it starts ``dcp.async_save`` of the
model's and optimizer's sharded state (``get_state_dict``) with aiopersist's
`FenceStager` and `AiopersistWriter`: no copy of the state, the save overlaps the next
forward and backward, and the optimizer step waits on the fence. On start it resumes
from the newest ``step-N`` under ``--out`` that loads (``set_state_dict``; a damaged one
is passed over, and replaced when training reaches its step again), on any number of
ranks (DCP reshards).

    torchrun --nproc-per-node 2 integrations/dcp/train_fsdp2.py --out /tmp/run --steps 20 --every 5

Runs on CPU (gloo); on GPUs (``--device cuda``, NCCL with a gloo CPU group for the
checkpoint) the same way. Prints one line per checkpoint and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import aiopersist
from aiopersist.integrations.dcp import AiopersistReader, AiopersistWriter, FenceStager

STEP_RE = re.compile(r"^step-(\d+)$")


def build(width: int, depth: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(device)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def saved_steps(out: str) -> list[int]:
    """The checkpoints under ``out``, newest first: those with aiopersist's manifest (an
    interrupted save never has its final name)."""
    steps = []
    for name in os.listdir(out) if os.path.isdir(out) else []:
        m = STEP_RE.match(name)
        if m and os.path.exists(os.path.join(out, name, "aiopersist.json")):
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def newest_step(out: str) -> int | None:
    steps = saved_steps(out)
    return steps[0] if steps else None


def damage(path: str) -> str | None:
    """Why the checkpoint at ``path`` is damaged (a checksum, a size, a file missing), or
    ``None``: it checks out, or cannot be told damaged (a newer format, a linked file)."""
    try:
        asyncio.run(aiopersist.verify(path))
    except (aiopersist.LinkedFileError, aiopersist.NewerFormatError):
        return None
    except aiopersist.CheckpointCorruptError as exc:
        return str(exc)
    return None


def resume(out: str, model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> int:
    """Load the newest checkpoint that loads (``AiopersistReader`` checks every byte it
    reads, and refuses a damaged checkpoint before the state is changed); the step it is
    of, 0 when none. DCP raises a load's failure on every rank alike; a checkpoint is passed
    over only when it is proven damaged (every rank checks it the same way), any other
    failure (a model of another shape, an interrupt) is raised: this run will overwrite
    the checkpoints it passes over when it reaches their steps."""
    for step in saved_steps(out):
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        path = os.path.join(out, f"step-{step}")
        try:
            dcp_load(state, checkpoint_id=path, storage_reader=AiopersistReader())
        except CheckpointException:  # a BaseException: what each rank's reader raised
            why = damage(path)
            if why is None:
                raise
            if rank == 0:
                print(f"step {step}: damaged, trying an older one: {why[:500]}", flush=True)
            continue
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from step {step}", flush=True)
        return step
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # The save's collectives run in DCP's upload thread while training's run in this one:
    # they need a process group of their own (gloo: DCP's are CPU objects), as torchtitan does.
    ckpt_group = dist.new_group(backend="gloo")
    model = build(args.width, args.depth, args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    start = resume(args.out, model, opt, rank)

    # One writer and stager for the run: a save that fails in DCP's write step leaves its
    # temporary directory, which the same writer's next save removes. overwrite=True: the
    # run resumed from the newest checkpoint that loads, so a newer one is proven damaged,
    # and is replaced when training comes back to its step.
    writer = AiopersistWriter(overwrite=True)
    stager = FenceStager(writer)
    upload = None
    fence_due = False
    loss = torch.tensor(0.0)
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step)  # the same batch for a step, however many ranks
        x = torch.randn(32, args.width, generator=g).to(args.device)
        loss = model(x).pow(2).mean()
        loss.backward()
        if fence_due:
            stager.wait_staged(upload)  # the fence: the save has every byte it needs
            fence_due = False
        opt.step()
        opt.zero_grad()
        if step % args.every == 0:
            if upload is not None:
                upload.result()  # DCP runs one save at a time
            model_sd, optim_sd = get_state_dict(model, opt)
            upload = async_save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=os.path.join(args.out, f"step-{step}"),
                storage_writer=writer,
                async_stager=stager,
                process_group=ckpt_group,
            )
            fence_due = True
            if rank == 0:
                print(f"step {step}: checkpoint started (loss {loss.item():.6f})", flush=True)
    if fence_due:
        stager.wait_staged(upload)
    if upload is not None:
        upload.result()
    if rank == 0:
        print(
            json.dumps(
                {"start": start, "last": args.steps, "newest": newest_step(args.out), "loss": loss.item()}
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
