"""Asynchronous checkpoints for the Hugging Face ``Trainer``.

``Trainer(..., callbacks=[AioPersistCallback()])`` checkpoints when the Trainer's own
``save_strategy`` / ``save_steps`` say so, without stopping training for the write:

1. at the end of a step (or epoch) where the Trainer would save, the callback takes the
   save over (it clears ``control.should_save``) and starts an asynchronous save of the
   model, the optimizer, the scheduler, the RNG states, ``trainer_state.json`` and
   ``training_args.bin``;
2. the next step's forward and backward run while it is written;
3. right before the next optimizer step (``on_pre_optimizer_step``) it waits until every
   byte has left the live tensors (the fence);
4. at the end of training it waits until the last checkpoint is durable.

The checkpoint is the Trainer's own layout, ``checkpoint-N/`` with ``model.safetensors``,
``config.json``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` (with a gradient
scaler), ``rng_state.pth``,
``trainer_state.json`` and ``training_args.bin`` (plus aiopersist's manifest with
checksums), so a stock ``Trainer`` resumes from it with
``train(resume_from_checkpoint=...)``. ``optimizer.pt`` is the byte stream of
``torch.save``, written through the engine as torch produces it. A checkpoint takes its
``checkpoint-N`` name only once complete and durable, so ``get_last_checkpoint`` never
picks a broken one. ``save_total_limit`` is honoured by step number, and only complete
checkpoints count; incomplete ones (a stock save that crashed) older than the newest
complete one are deleted too.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import shutil
import threading
from typing import Any, cast

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.training_args import ParallelMode

from .._api import SaveInfo, TorchSave
from .._blocking import BlockingCheckpointer, BlockingSaveHandle
from .._checkpointer import Mode
from .._dist import coordinator, process0_group
from .._manager import check_step, delete_step
from .._manifest import MANIFEST_NAME

log = logging.getLogger("aiopersist")

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rng_states(distributed: bool = False) -> dict[str, Any]:
    """What ``Trainer._save_rng_state`` saves for this process."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        # As the Trainer does: every device's state under DDP, the current one's otherwise.
        states["cuda"] = (
            torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
        )
    return states


def _checkpoints(run_dir: str) -> list[tuple[int, str, bool]]:
    """Every ``checkpoint-N`` directory: its step, its path, and whether it is complete.

    One with ``aiopersist.json`` is complete when that manifest checks out and every file
    it lists has its size (no data is read); one without (the stock Trainer's) when it
    has ``trainer_state.json``, which the Trainer writes after the weights and the
    optimizer.
    """
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = CHECKPOINT_RE.match(name)
        path = os.path.join(run_dir, name)
        if m is None or not os.path.isdir(path):
            continue
        if os.path.exists(os.path.join(path, MANIFEST_NAME)):
            complete = check_step(path)[0]
        else:
            complete = os.path.isfile(os.path.join(path, "trainer_state.json"))
        found.append((int(m.group(1)), path, complete))
    return sorted(found)


def to_rotate(checkpoints: list[tuple[int, str, bool]], limit: int) -> list[str]:
    """What ``save_total_limit=limit`` deletes: complete checkpoints beyond the newest
    ``limit``, and incomplete ones older than the newest complete one (nothing can resume
    from them). Incomplete ones newer than that are left alone."""
    complete = [(step, path) for step, path, ok in checkpoints if ok]
    if not complete:
        return []
    newest = complete[-1][0]
    doomed = {path for _, path in complete[:-limit]}
    doomed |= {path for step, path, ok in checkpoints if not ok and step < newest}
    return [path for _, path, _ in checkpoints if path in doomed]


class AioPersistCallback(TrainerCallback):
    """Take over the Trainer's checkpoint saves and make them asynchronous.

    ``backend`` and ``mode`` are as for `aiopersist.Checkpointer` (``fence``: no copy of
    the state, the next optimizer step waits until it is staged; ``snapshot``: a host
    copy first, within ``snapshot_bytes``).

    Under DistributedDataParallel (``torchrun``) every rank runs the callback; process 0
    writes the checkpoint, with every rank's RNG state gathered to it, as the stock save
    lays it out.

    Limits (checked at the start of training, with a clear error): one process or DDP
    (not FSDP, not ``save_on_each_node``), no DeepSpeed (its optimizer step runs inside ``backward``,
    before any fence could be waited on), no ``load_best_model_at_end`` (the Trainer
    tracks the best checkpoint inside the save this callback replaces). With
    ``push_to_hub`` the checkpoints are not pushed (a warning says so). Other callbacks'
    ``on_save`` is not called for these saves.
    """

    def __init__(
        self, *, backend: str = "auto", mode: Mode = "fence", snapshot_bytes: int | None = None
    ) -> None:
        self.backend = backend
        self.mode = mode
        self.snapshot_bytes = snapshot_bytes
        self._ckpt: BlockingCheckpointer | None = None
        self._handle: BlockingSaveHandle | None = None
        self._deleter: threading.Thread | None = None
        self._group: Any = None
        self.saved: list[str] = []
        """Paths of the checkpoints committed so far, oldest first."""
        self.infos: list[SaveInfo] = []
        """What each committed save did (its `SaveInfo`), oldest first."""

    # -- events ---------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if args.world_size > 1:
            if args.parallel_mode != ParallelMode.DISTRIBUTED or args.fsdp:
                raise ValueError(
                    "AioPersistCallback supports one process or DistributedDataParallel (every rank holds "
                    f"the whole state); this run's parallel mode is {args.parallel_mode.value}"
                    + (" with FSDP" if args.fsdp else "")
                )
            if args.save_on_each_node:
                raise ValueError(
                    "AioPersistCallback does not support save_on_each_node: process 0 writes the checkpoint, "
                    "with every rank's RNG state"
                )
            # Process 0 writes every checkpoint alone, in a group of its own. Making the group
            # is a collective, so every rank makes it here, even when it never saves.
            coord = coordinator()
            assert coord is not None
            self._group = process0_group(coord)
        if getattr(args, "deepspeed", None):
            raise ValueError(
                "AioPersistCallback cannot be used with DeepSpeed: its optimizer step runs inside "
                "backward(), so there is no point before it where the fence could be waited on"
            )
        if args.load_best_model_at_end:
            raise ValueError(
                "AioPersistCallback does not support load_best_model_at_end: the Trainer tracks the best "
                "checkpoint inside the save this callback takes over"
            )
        if args.push_to_hub:
            log.warning("aiopersist: checkpoints saved by AioPersistCallback are not pushed to the Hub")
        if self._ckpt is None:
            self._ckpt = BlockingCheckpointer(
                backend=self.backend, mode=self.mode, snapshot_bytes=self.snapshot_bytes
            )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._maybe_save(args, state, control, **kwargs)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._maybe_save(args, state, control, **kwargs)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._handle is not None:
            self._handle.wait_staged()  # the fence: raises the save's error, if any

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        try:
            self._finish_last(args)
        finally:
            if self._deleter is not None:
                self._deleter.join()
            if self._ckpt is not None:
                self._ckpt.close()
                self._ckpt = None

    # -- the save -------------------------------------------------------------------------

    def _maybe_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        processing_class: Any = None,
        **_: Any,
    ) -> None:
        if not control.should_save:
            return
        control_state = control.state()  # as the Trainer's own save would record it
        control.should_save = False  # the Trainer's own save is taken over
        rng_files = self._gather_rng_states(args)  # every rank takes part; process 0 gets them
        if not args.should_save or self._ckpt is None or model is None:
            return
        path = os.path.join(_output_dir(args), f"checkpoint-{state.global_step}")
        extra: dict[str, bytes | TorchSave] = {}
        config = getattr(model, "config", None)
        if config is not None:
            extra["config.json"] = config.to_json_string().encode()
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            extra["generation_config.json"] = generation.to_json_string().encode()
        if not args.save_only_model:
            if optimizer is not None:
                extra["optimizer.pt"] = TorchSave(optimizer.state_dict())
            if lr_scheduler is not None:
                extra["scheduler.pt"] = _torch_bytes(lr_scheduler.state_dict())
            # The Trainer's GradScaler (fp16 on GPU) hangs on its AcceleratedOptimizer.
            scaler = getattr(optimizer, "scaler", None)
            if scaler is not None:
                extra["scaler.pt"] = _torch_bytes(scaler.state_dict())
            extra.update(rng_files)
        # As the Trainer's own save does (the field is a dict once the state is built).
        trainer_state = cast(Any, state)
        if trainer_state.stateful_callbacks is None:
            trainer_state.stateful_callbacks = {}
        trainer_state.stateful_callbacks["TrainerControl"] = control_state
        extra["trainer_state.json"] = (
            json.dumps(_state_dict(state), indent=2, sort_keys=True) + "\n"
        ).encode()
        extra["training_args.bin"] = _torch_bytes(args)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            extra.update(_processing_files(processing_class))
        previous = self._handle
        # Waits here for the previous save if it is still being written (one in flight).
        # Under DDP process 0 writes alone, in a group of its own: no other rank takes part.
        self._handle = self._ckpt.save(model, path, overwrite=True, extra_files=extra, group=self._group)
        if previous is not None:
            self._committed(args, previous)

    def _gather_rng_states(self, args: TrainingArguments) -> dict[str, bytes]:
        """The ``rng_state*.pth`` files the Trainer's own save writes: ``rng_state.pth`` in
        one process; under DDP ``rng_state_<i>.pth`` for every process ``i``, gathered to
        process 0 (the only one that writes), where the stock save has each rank write its
        own. Empty on the other ranks, and when ``save_only_model``."""
        if args.save_only_model:
            return {}
        if args.world_size <= 1:
            return {"rng_state.pth": _torch_bytes(_rng_states())}
        coord = coordinator()
        assert coord is not None
        # Over the checkpoint's own gloo group, whatever the training's backend is.
        mine = _torch_bytes(_rng_states(distributed=True))
        everyone: list[Any] = [None] * coord.world_size
        torch.distributed.all_gather_object(everyone, mine, group=coord.group)
        if args.process_index != 0:
            return {}
        return {f"rng_state_{i}.pth": cast(bytes, b) for i, b in enumerate(everyone)}

    def _finish_last(self, args: TrainingArguments) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._committed(args, handle)

    def _committed(self, args: TrainingArguments, handle: BlockingSaveHandle) -> None:
        info = handle.wait()  # raises the save's error
        if info is None:
            return
        self.saved.append(info.path)
        self.infos.append(info)
        log.info(
            "aiopersist: %s committed (%.2f s, %.2f GiB/s)", info.path, info.seconds, info.gib_per_second
        )
        self._rotate(args)

    def _rotate(self, args: TrainingArguments) -> None:
        """``save_total_limit``, by step number: only complete checkpoints count (see
        `to_rotate`)."""
        limit = args.save_total_limit
        if not limit or limit < 1:
            return
        doomed = to_rotate(_checkpoints(_output_dir(args)), limit)
        if not doomed:
            return
        if self._deleter is not None:
            self._deleter.join()
        self._deleter = threading.Thread(
            target=_delete_all, args=(doomed,), name="aiopersist-rotate", daemon=True
        )
        self._deleter.start()


def _output_dir(args: TrainingArguments) -> str:
    if not args.output_dir:
        raise ValueError("AioPersistCallback needs TrainingArguments.output_dir")
    return str(args.output_dir)


def _state_dict(state: TrainerState) -> dict[str, Any]:
    """What ``TrainerState.save_to_json`` writes."""
    import dataclasses

    return dataclasses.asdict(state)


def _processing_files(processing_class: Any) -> dict[str, bytes | TorchSave]:
    """A tokenizer's (or processor's) files, as ``save_pretrained`` writes them."""
    import tempfile

    out: dict[str, bytes | TorchSave] = {}
    with tempfile.TemporaryDirectory() as tmp:
        processing_class.save_pretrained(tmp)
        for name in os.listdir(tmp):
            full = os.path.join(tmp, name)
            if os.path.isfile(full):
                with open(full, "rb") as f:
                    out[name] = f.read()
    return out


def _delete_all(paths: list[str]) -> None:
    for path in paths:
        try:
            delete_step(path)
        except OSError as exc:
            log.warning("aiopersist: could not delete %s: %s", path, exc)
            shutil.rmtree(path, ignore_errors=True)
