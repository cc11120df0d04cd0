"""A script for ``torchrun --nproc_per_node 2``: the tiny GPT-2 of `_hf_ddp_worker`
trained by a Hugging Face Trainer under FSDP2 (``fully_shard``, ``SHARDED_STATE_DICT``)
over gloo on CPU, Accelerate made to take the FSDP plugin on CPU (`_cpu_fsdp`).

``python -m tests._hf_fsdp_worker OUT BACKEND`` runs, in the same two processes:

1. ``stock``: the stock Trainer, checkpoints every 2 steps (``save_total_limit=2``);
2. ``callback``: the same with `AioPersistCallback`;
3. ``resume``: a stock Trainer resuming from ``callback/checkpoint-6``;
4. ``full``: ``state_dict_type=FULL_STATE_DICT`` with the callback, which it refuses.

Process 0 writes each run's final weights (whole tensors) to ``OUT/<run>.pt``; process
``i`` writes its report to ``OUT/report-i.json``."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import transformers

from aiopersist._bench.demo_trainer import Tokens
from aiopersist.integrations.transformers import AioPersistCallback
from tests._cpu_fsdp import force_fsdp_on_cpu
from tests._hf_ddp_worker import Diverge, cpu_training_args, tiny_gpt2


def _trainer(run: str, callback: AioPersistCallback | None, state_dict_type: str) -> transformers.Trainer:
    args = cpu_training_args(
        run,
        save_strategy="steps",
        save_total_limit=2,
        fsdp=True,
        fsdp_config={"fsdp_version": 2, "state_dict_type": state_dict_type, "reshard_after_forward": True},
    )
    callbacks: list[Any] = [Diverge(), *([callback] if callback is not None else [])]
    return transformers.Trainer(
        model=tiny_gpt2(), args=args, train_dataset=Tokens(64, 16, 128), callbacks=callbacks
    )


def _weights(trainer: transformers.Trainer) -> dict[str, torch.Tensor]:
    """The model's whole tensors (a collective: every rank calls it)."""
    out = {}
    for name, value in trainer.model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def main(out: str, backend: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    force_fsdp_on_cpu()
    rank = int(os.environ["RANK"])
    report: dict[str, Any] = {"rank": rank}
    for run, callback, resume in [
        ("stock", None, None),
        ("callback", AioPersistCallback(backend=backend), None),
        ("resume", None, os.path.join(out, "callback", "checkpoint-6")),
    ]:
        trainer = _trainer(os.path.join(out, run), callback, "SHARDED_STATE_DICT")
        trainer.train(resume_from_checkpoint=resume)
        if run == "stock":
            report["sharded"] = type(next(trainer.model.parameters())).__name__  # DTensor: FSDP ran
        weights = _weights(trainer)
        if rank == 0:
            torch.save(weights, os.path.join(out, f"{run}.pt"))
        if callback is not None:
            report["saved"] = [os.path.basename(p) for p in callback.saved]
    trainer = _trainer(os.path.join(out, "full"), AioPersistCallback(backend=backend), "FULL_STATE_DICT")
    try:
        trainer.train()
    except ValueError as exc:
        report["full"] = str(exc)
    path = os.path.join(out, f"report-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    torch.distributed.destroy_process_group()
    # As in _dcp_worker: torch keeps the default group alive past destroy_process_group()
    # under FSDP2, and its gloo threads can abort the interpreter's exit now and then.
    os._exit(0)
