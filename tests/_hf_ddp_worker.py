"""A script for ``torchrun --nproc_per_node 2``: a tiny GPT-2 (from a config, offline)
trained by a Hugging Face Trainer under DDP over gloo on CPU.

``python -m tests._hf_ddp_worker OUT MODE [BACKEND]`` with MODE ``stock`` (no
checkpoints), ``callback`` (AioPersistCallback saves every 2 steps), ``model-only`` (the
same with ``save_only_model``), ``resume`` (a stock Trainer resumes from
``OUT/callback/checkpoint-4``), ``each-node`` (``save_on_each_node`` on one node: a
stock run, reported as ``each-node-stock``, then one with the callback, in the same
processes), ``each-node-nodes`` (``save_on_each_node``, launched as two nodes of one
process each: the callback refuses it) or ``best`` (evaluation every 2 steps, the first
checkpoint the best, ``save_total_limit=1`` and ``load_best_model_at_end``: a stock run,
reported as ``best-stock``, then one with the callback, in the same processes to save a
launch).
Process 0 writes the final weights to ``OUT/MODE.pt``; process ``i`` writes its report to
``OUT/MODE-i.json`` (a file, not a line on the stdout both processes share with the
Trainer's own prints)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import transformers

from aiopersist._bench.demo_trainer import Tokens
from aiopersist.integrations.transformers import AioPersistCallback


def cpu_training_args(run: str, **overrides: Any) -> transformers.TrainingArguments:
    """The arguments every Trainer of these workers runs with (8 steps of batch 4 on the
    CPU over gloo, a save every 2 steps where saving is on), plus ``overrides``."""
    return transformers.TrainingArguments(
        output_dir=run,
        max_steps=8,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_steps=2,
        logging_steps=1000,
        report_to=[],
        seed=0,
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **overrides,
    )


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    """A 2-layer GPT-2 from a config (no download), with dropout, seeded."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32, resid_pdrop=0.1, embd_pdrop=0.1
    )
    return transformers.GPT2LMHeadModel(config)


class Diverge(transformers.TrainerCallback):  # type: ignore[misc]
    """Rank 1 draws one extra number before each step, so the two ranks' RNG states (and
    their dropout masks) differ: a resume is exact only if each gets its own back."""

    def on_step_begin(self, args: transformers.TrainingArguments, *_: object, **__: object) -> None:
        if args.process_index == 1:
            torch.rand(1)


def main(out: str, mode: str, backend: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if mode in ("best", "each-node"):
        _train(out, f"{mode}-stock", backend)
    _train(out, mode, backend)


def _train(out: str, mode: str, backend: str) -> None:
    model = tiny_gpt2()
    run = os.path.join(out, "callback" if mode in ("callback", "resume", "resume-checked") else mode)
    best = mode in ("best", "best-stock")
    # The highest loss is "better": the first checkpoint is the best, and only it stays.
    best_args = {
        "eval_strategy": "steps",
        "eval_steps": 2,
        "metric_for_best_model": "loss",
        "greater_is_better": True,
        "save_total_limit": 1,
        "load_best_model_at_end": True,
    }
    each_node = mode.startswith("each-node")
    args = cpu_training_args(
        run,
        save_strategy="steps"
        if mode in ("callback", "resume-checked", "model-only", "best", "best-stock") or each_node
        else "no",
        save_on_each_node=each_node,
        save_only_model=mode == "model-only",
        **(best_args if best else {"save_total_limit": 2} if each_node else {}),
    )
    saving = mode in ("callback", "resume-checked", "model-only", "each-node", "each-node-nodes", "best")
    callbacks = [Diverge(), *([AioPersistCallback(backend=backend)] if saving else [])]
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(64, 16, 128),
        eval_dataset=Tokens(8, 16, 128) if best else None,
        callbacks=callbacks,
    )
    # resume-checked: the newest checkpoint, found and checked by the callback.
    resumes: dict[str, str | bool] = {"resume": os.path.join(run, "checkpoint-4"), "resume-checked": True}
    resume = resumes.get(mode)
    if mode == "each-node-nodes":
        try:
            trainer.train()
        except ValueError as exc:
            _report(out, mode, {"rank": trainer.args.process_index, "refused": str(exc)})
        return
    trainer.train(resume_from_checkpoint=resume)
    if trainer.args.process_index == 0:
        torch.save(
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            os.path.join(out, f"{mode}.pt"),
        )
    best_checkpoint = trainer.state.best_model_checkpoint
    _report(
        out,
        mode,
        {
            "rank": trainer.args.process_index,
            "world": trainer.args.world_size,
            "mode": mode,
            "best": os.path.basename(best_checkpoint) if best_checkpoint else None,
            "best_metric": trainer.state.best_metric,
            # Process 0 saves and rotates: another rank could list the directory before
            # process 0's end-of-training cleanup.
            "checkpoints": sorted(n for n in os.listdir(run) if n.startswith("checkpoint-"))
            if trainer.args.process_index == 0 and os.path.isdir(run)
            else None,
            "should_save": trainer.args.should_save,
        },
    )


def _report(out: str, mode: str, report: dict[str, object]) -> None:
    path = os.path.join(out, f"{mode}-{report['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "auto")
    finally:
        # A gloo group left to the interpreter's teardown sometimes aborts the process
        # ("terminate called without an active exception": its threads are destroyed while
        # joinable), after the work is done; seen with and without aiopersist. End it here.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
