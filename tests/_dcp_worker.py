"""One rank of a DCP test: ``python -m tests._dcp_worker SCENARIO RANK WORLD PORT DIR BACKEND``.

A real gloo process group over TCP on localhost; ``torch.distributed.checkpoint`` saves
and loads DTensor-sharded state through aiopersist's writer and reader (and DCP's own, to
check that each reads what the other wrote). Prints one JSON line per rank.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import aiopersist
from aiopersist.integrations.dcp import AiopersistReader, AiopersistWriter


def full_state(seed: int = 3) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {
        "w": torch.randn(13, 24),  # rows that do not split evenly
        "e": torch.randn(300, 64),
        "h": torch.randn(7, 5).to(torch.bfloat16),
        "b": torch.randn(5),  # replicated
        "step": 11,
        "cfg": {"lr": 0.5, "names": ["a", "b"]},
    }


def sharded(world: int, source: dict[str, Any] | None) -> dict[str, Any]:
    """The state as DTensors over ``world`` ranks: ``source``'s values, or zeros."""
    mesh = init_device_mesh("cpu", (world,))
    full = full_state()
    out: dict[str, Any] = {}
    for k in ("w", "e", "h"):
        t = full[k] if source is not None else torch.zeros_like(full[k])
        out[k] = distribute_tensor(t, mesh, [Shard(0)])
    b = full["b"] if source is not None else torch.zeros_like(full["b"])
    out["b"] = distribute_tensor(b, mesh, [Replicate()])
    out["step"] = full["step"] if source is not None else 0
    out["cfg"] = full["cfg"] if source is not None else {"lr": 0.0, "names": []}
    return out


def same_as_full(state: dict[str, Any]) -> list[str]:
    full = full_state()
    bad = []
    for k in ("w", "e", "h", "b"):
        got = state[k].full_tensor() if isinstance(state[k], DTensor) else state[k]
        if got.dtype != full[k].dtype or not torch.equal(got, full[k]):
            bad.append(k)
    if state["step"] != full["step"] or state["cfg"] != full["cfg"]:
        bad.append("values")
    return bad


def fsdp2_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP sharded with FSDP2 (``fully_shard``) over every rank, and AdamW."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 40),
        torch.nn.ReLU(),
        torch.nn.Linear(40, 40),
        torch.nn.ReLU(),
        torch.nn.Linear(40, 8),
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)  # the same batch on every rank, whatever their number
    model(torch.randn(6, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def full_tensors(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict, whole (DTensors gathered), by dotted path."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, DTensor):
            out[prefix] = node.full_tensor()
        elif isinstance(node, torch.Tensor):
            out[prefix] = node.clone()

    walk("", sd)
    return out


def scenario(name: str, rank: int, world: int, base: str, backend: str) -> Any:
    path = os.path.join(base, "ck")
    if name in ("fsdp-save", "fsdp-load"):
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, opt = fsdp2_model(seed=0 if name == "fsdp-save" else 99)
        train_step(model, opt, 1)  # AdamW's state exists (and differs between the two runs)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        ref_path = os.path.join(base, "fsdp-ref.pt")
        if name == "fsdp-save":
            dcp.save(state, checkpoint_id=path, storage_writer=AiopersistWriter(backend=backend))
            ref = full_tensors(state)
            if rank == 0:
                torch.save(ref, ref_path)
            return {"tensors": len(ref)}
        dcp.load(state, checkpoint_id=path, storage_reader=AiopersistReader(backend=backend))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        model_sd, optim_sd = get_state_dict(model, opt)
        got = full_tensors({"model": model_sd, "optim": optim_sd})
        ref = torch.load(ref_path, weights_only=True)
        differ = sorted(k for k in ref if k not in got or not torch.equal(got[k], ref[k]))
        train_step(model, opt, 2)  # and training goes on from it
        return {"tensors": len(got), "mismatch": differ + sorted(set(got) - set(ref))}
    if name == "save":
        dcp.save(
            sharded(world, full_state()), checkpoint_id=path, storage_writer=AiopersistWriter(backend=backend)
        )
        return {"files": sorted(os.listdir(path))}
    if name in ("save-disks", "resave-disks"):
        writer = AiopersistWriter(
            backend=backend, disks=[os.path.join(base, "disk1")], overwrite=name == "resave-disks"
        )
        dcp.save(sharded(world, full_state()), checkpoint_id=path, storage_writer=writer)
        return {"files": sorted(os.listdir(path))}
    if name == "save-stock":
        dcp.save(sharded(world, full_state()), checkpoint_id=path, storage_writer=FileSystemWriter(path))
        return {}
    if name == "async-save":
        fut = dcp.async_save(
            sharded(world, full_state()), checkpoint_id=path, storage_writer=AiopersistWriter(backend=backend)
        )
        result = fut.upload_completion.result() if hasattr(fut, "upload_completion") else fut.result()
        return {"metadata": type(result).__name__}
    if name == "fence-rank-dies-in-planning":
        # Rank 1 dies in DCP's planning, before the writer writes anything anywhere: rank
        # 0's fence, waited on without the upload future, must end (not wait for good).
        from torch.distributed.checkpoint import DefaultSavePlanner

        from aiopersist.integrations.dcp import FenceStager

        class DiesInPlanning(DefaultSavePlanner):
            def create_local_plan(self) -> Any:
                os._exit(3)

        writer = AiopersistWriter(backend=backend)
        stager = FenceStager(writer)
        dcp.async_save(
            sharded(world, full_state()),
            checkpoint_id=path,
            storage_writer=writer,
            async_stager=stager,
            planner=DiesInPlanning() if rank == 1 else None,
        )
        try:
            stager.wait_staged(timeout=120)
        except aiopersist.RankFailedError as exc:
            return {"fence": type(exc).__name__, "left": sorted(os.listdir(base))}
        return {"fence": "staged"}
    if name in ("load", "load-stock"):
        target = sharded(world, None)
        reader = AiopersistReader(backend=backend) if name == "load" else FileSystemReader(path)
        dcp.load(target, checkpoint_id=path, storage_reader=reader)
        return {"mismatch": same_as_full(target)}
    raise SystemExit(f"unknown scenario {name}")


def main() -> None:
    warnings.simplefilter("ignore")
    name, rank, world, port, base, backend = sys.argv[1:7]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=int(rank),
        world_size=int(world),
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        out = {"ok": scenario(name, int(rank), int(world), base, backend)}
    except BaseException as exc:  # DCP raises CheckpointException, a BaseException
        out = {"error": type(exc).__name__, "message": str(exc)[-2000:]}
    sys.stdout.write(json.dumps({"rank": int(rank), **out}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    # Torch keeps the default group alive past destroy_process_group() once a device mesh
    # has sharded a module (fully_shard's caches), so its gloo threads run on into
    # interpreter shutdown, where one that frees a finished collective's tensors aborts
    # the exit now and then ("terminate called without an active exception"), after
    # everything above was done and said. aiopersist's own groups do not outlive it
    # (tests/e2e/test_distributed.py checks), so this is torch's; end the process here.
    os._exit(0)


if __name__ == "__main__":
    main()
