"""Asynchronous checkpoints for the Hugging Face ``Trainer``.

``Trainer(..., callbacks=[AioPersistCallback()])`` checkpoints where the stock Trainer
saves, without stopping training for the write:

1. at the start of training the callback finds its Trainer and routes the Trainer's
   checkpoint save (``Trainer._save_checkpoint``) through aiopersist. The Trainer calls it
   where it always does: after the step's logging and evaluation, once the best metric is
   known, for every ``save_strategy`` (``"best"`` included) and for just-in-time
   checkpoints (``enable_jit_checkpoint``);
2. that save records the best checkpoint as the stock one does, takes the small files
   (``trainer_state.json``, the scheduler, the RNG states, ``training_args.bin``) at
   once, and starts an asynchronous save of the model and the optimizer;
3. the next step's forward and backward run while it is written; right before the next
   optimizer step (``on_pre_optimizer_step``) the callback waits until every byte has
   left the live tensors (the fence). When another callback's ``on_save`` may read the
   checkpoint, it is waited for before the Trainer calls ``on_save`` instead;
4. once the checkpoint is committed, ``save_total_limit`` is applied in the background;
5. where training stops, the last checkpoint is durable (and the older ones rotated)
   before the Trainer goes on, so ``load_best_model_at_end`` reads a complete checkpoint.

The checkpoint is the Trainer's own layout, ``checkpoint-N/`` with ``model.safetensors``,
``config.json``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` (with a gradient
scaler), ``rng_state.pth``, ``trainer_state.json`` and ``training_args.bin`` (plus
aiopersist's manifest with checksums), so a stock ``Trainer`` resumes from it with
``train(resume_from_checkpoint=...)``. ``optimizer.pt`` is the byte stream of
``torch.save``, written through the engine as torch produces it. A checkpoint takes its
``checkpoint-N`` name only once complete and durable, so ``get_last_checkpoint`` never
picks one a crash left half-written; and ``train(resume_from_checkpoint=...)`` checks the
checkpoint against its checksums before the Trainer loads it (``verify_on_resume``).
``save_total_limit`` keeps the newest complete checkpoints by step
number and the best one, as the stock rotation does, but only complete checkpoints count;
incomplete ones (a stock save that crashed) older than the newest complete one are
deleted too.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import json
import logging
import os
import re
import tempfile
import threading
from typing import Any, cast

import torch

try:
    from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]
    from transformers import (
        PreTrainedModel,
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
    from transformers.training_args import ParallelMode
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.split(".")[0] not in ("transformers", "accelerate"):
        raise
    raise ModuleNotFoundError(
        "aiopersist.integrations.transformers needs the transformers package: "
        "pip install 'aiopersist[hf]' (transformers, accelerate, safetensors)",
        name=exc.name,
    ) from exc

from .. import _knobs
from .._blocking import BlockingCheckpointer, BlockingSaveHandle
from .._checkpointer import Mode
from .._commit import remove_path
from .._dist import GroupRef, background_group, coordinator, process0_group
from .._exceptions import CheckpointCorruptError
from .._manager import StepInfo, scan
from .._names import TMP_MARKER, TRAINER_STEPS, TRASH_MARKER
from .._retention import SaveTotalLimit, to_delete
from .._save import SaveInfo, TorchSave
from ._common import (
    agreed_checkpoints,
    checkpoint_problem,
    delete_checkpoints,
    files_written_by,
    gather_objects,
    with_buffers_copied,
)
from ._fsdp import ShardedSave, ShardedSaver, check_plugin, fsdp_states

log = logging.getLogger("aiopersist")

# The save strategies under which the stock Trainer records the best checkpoint.
_TRACKS_BEST = ("steps", "epoch", "best")


def _torch_file(obj: object, name: str) -> bytes:
    """``obj`` as ``torch.save(obj, ".../name")`` writes it, byte for byte: torch names the
    records of the archive after the file (``scheduler/data.pkl``), where ``torch.save``
    into a buffer names them ``archive/``. Written to a temporary file and read back
    (these files are small)."""
    with tempfile.TemporaryDirectory(prefix="aiopersist-") as directory:
        torch.save(obj, os.path.join(directory, name))
        with open(os.path.join(directory, name), "rb") as f:
            return f.read()


def _stock_rng_file(trainer: Trainer) -> tuple[str, bytes]:
    """The RNG state file this process's stock save writes, and its name: written by the
    Trainer's own ``_save_rng_state`` (every device's generator it knows of, CUDA's as the
    parallel mode has it) into a temporary directory and read back."""
    with tempfile.TemporaryDirectory(prefix="aiopersist-") as directory:
        cast(Any, trainer)._save_rng_state(directory)
        (name,) = os.listdir(directory)
        with open(os.path.join(directory, name), "rb") as f:
            return name, f.read()


def _checkpoints(run_dir: str) -> list[StepInfo]:
    """Every ``checkpoint-N`` directory, by step, complete or not (`scan` of the Trainer's
    layout: one with ``aiopersist.json`` is complete when that manifest checks out and
    every file it lists has its size, no data read; one without, the stock Trainer's, when
    it has ``trainer_state.json``, which the Trainer writes after the weights and the
    optimizer)."""
    return scan(run_dir, layout=TRAINER_STEPS)


def to_rotate(checkpoints: list[StepInfo], limit: int, best: str | None = None) -> list[str]:
    """What ``save_total_limit=limit`` deletes, by the stock Trainer's rules counting only
    complete checkpoints (`SaveTotalLimit`, in the stock order, see `_stock_order`): the
    oldest complete ones go until ``limit`` remain, never the newest (resuming needs it) nor ``best``
    (``state.best_model_checkpoint``, known by its ``checkpoint-N`` name), so that
    ``limit=1`` with an older best keeps two. Incomplete ones older than the newest
    complete one go too when they are proven broken (`StepInfo.damaged`: nothing can
    resume from them); newer ones are left alone, and so are ``best`` whatever its state
    and those that could not be told (a newer format, an I/O error)."""
    best_step = TRAINER_STEPS.step_at(best) if best is not None else None
    complete = _stock_order([c for c in checkpoints if c.complete])
    # The policy runs over the complete ones' places in that order (oldest first).
    place = {c.step: i for i, c in enumerate(complete)}
    best_place = None if best_step is None else place.get(best_step, -1)  # -1: counted, absent
    doomed = to_delete(
        list(range(len(complete))),
        SaveTotalLimit(limit, best_place),
        protected=() if best_place is None else (best_place,),
    )
    newest = max((c.step for c in complete), default=None)
    gone = {complete[i].path for i in doomed} | {
        c.path
        for c in checkpoints
        if not c.complete and c.damaged and newest is not None and c.step < newest and c.step != best_step
    }
    return [c.path for c in checkpoints if c.path in gone]


def _stock_order(checkpoints: list[StepInfo]) -> list[StepInfo]:
    """Oldest first, as the stock rotation orders them (``sort_checkpoints`` with
    ``use_mtime=True``): by modification time, unless they all lie within a second of
    each other (times it does not trust), then by step. So a rerun into an
    ``output_dir`` that holds a longer, older run's checkpoints keeps its own newest ones
    rather than the older run's higher steps."""
    by_step = sorted(checkpoints, key=lambda c: c.step)
    times: dict[str, float] = {}
    for c in by_step:
        try:
            times[c.path] = os.stat(c.path).st_mtime
        except OSError:
            return by_step  # gone meanwhile: the step order, which needs no stat
    if len(by_step) < 2 or max(times.values()) - min(times.values()) < 1.0:
        return by_step
    return sorted(by_step, key=lambda c: (times[c.path], c.path))


class AioPersistCallback(TrainerCallback):
    """Route the Trainer's checkpoint saves through aiopersist and make them asynchronous.

    ``backend`` and ``mode`` are as for `aiopersist.Checkpointer` (``fence``: no copy of
    the state, the next optimizer step waits until it is staged; ``snapshot``: a host
    copy first, within ``snapshot_bytes``).

    At ``on_train_begin`` the callback finds the ``Trainer`` running it (a callback is not
    handed its Trainer: it is the caller of the event) and replaces that Trainer's
    ``_save_checkpoint``, on the instance only, until ``on_train_end``. So checkpoints are
    saved at exactly the stock point: after logging and evaluation, with the best metric
    and ``best_model_checkpoint`` recorded as the stock save records them, for every
    ``save_strategy`` (``"best"`` too) and for just-in-time checkpoints. Other
    callbacks' ``on_save`` runs after the save, and their exported state
    (``ExportableState``) goes into ``trainer_state.json`` as with stock saves.

    ``durable_on_save``: whether the save is waited for (committed, ``save_total_limit``
    applied) before the Trainer calls the other callbacks' ``on_save``, so that one that
    reads ``checkpoint-N`` there (uploads it, copies it, logs it as an artifact) finds it
    complete, as after a stock save. ``None`` (the default): when another callback's
    ``on_save`` may read it (`reads_checkpoint_on_save`); ``True``: always; ``False``:
    never (``on_save`` then runs while the checkpoint is written, and the next step
    overlaps it).

    ``save_total_limit`` is applied in a background thread as soon as each checkpoint is
    committed, keeping the best one. Where training stops, the last checkpoint is waited
    for (durable, rotation done) before the Trainer goes on, so ``load_best_model_at_end``
    and the stock end-of-training cleanup see every checkpoint complete; for a stop
    decided after the last save, at the Trainer's closing log and in its
    ``_load_best_model``, which the callback wraps on the instance too.

    Under DistributedDataParallel (``torchrun``) every rank runs the callback; process 0
    writes the checkpoint, with every rank's RNG state gathered to it, as the stock save
    lays it out.

    Under FSDP2 with ``SHARDED_STATE_DICT`` every rank writes its shards of the model and
    the optimizer, in the stock FSDP layout (``pytorch_model_fsdp_0/``, ``optimizer_0/``,
    see `aiopersist.integrations._fsdp`), and process 0 the other files.

    ``verify_on_resume`` (the default): ``train(resume_from_checkpoint=...)`` first checks
    the checkpoint it resumes from against its manifest (every file's size and checksum,
    as ``aiopersist verify``), before the Trainer loads anything from it: a checkpoint
    named by its path that fails raises `CheckpointCorruptError`; with ``True`` the
    newest checkpoint that checks out is taken, with a warning naming those passed over
    (the Trainer alone takes the newest by its name, damaged or not). A checkpoint without
    a manifest (a stock save's) is the Trainer's to load, unchecked. Under DDP or FSDP
    the first process of each node checks it and every process takes the same one. The
    check reads the checkpoint once more; ``False`` leaves resuming to the Trainer alone.
    Only a callback given to the ``Trainer`` when it is made (``callbacks=[...]``) is in
    place for the first ``train()``.

    Limits (checked at the start of training, with a clear error): one process, DDP or
    FSDP2 with ``SHARDED_STATE_DICT`` (not FSDP1, not ``FULL_STATE_DICT``, not
    ``save_on_each_node`` across nodes), no DeepSpeed (its optimizer step runs inside
    ``backward``, before any fence could be waited on), a ``Trainer`` whose class keeps
    the stock ``_save_checkpoint`` (an override would be bypassed). With ``push_to_hub``
    the checkpoints are not pushed (a warning says so).
    """

    def __init__(
        self,
        *,
        backend: str = "auto",
        mode: Mode = "fence",
        snapshot_bytes: int | None = None,
        durable_on_save: bool | None = None,
        verify_on_resume: bool = True,
    ) -> None:
        self.backend = backend
        self.verify_on_resume = verify_on_resume
        self.mode = mode
        self.snapshot_bytes = snapshot_bytes
        self.durable_on_save = durable_on_save
        self._said_durable = False
        self._ckpt: BlockingCheckpointer | None = None
        self._sharded: ShardedSaver | None = None
        """Under FSDP: writes every rank's shards (see `_fsdp`)."""
        self._fsdp: Any = None
        """Under FSDP: Accelerate's FSDP plugin, whose state dict options the save takes."""
        self._trainer: Trainer | None = None
        self._jit_manager: Any = None
        self._handle: BlockingSaveHandle | ShardedSave | None = None
        # Waits for the save in flight to commit, then rotates; each one joins the one before.
        self._committer: threading.Thread | None = None
        self._group: GroupRef | None = None
        # The checkpoints this training has started to save (on every rank): a save in
        # flight has no directory yet, but counts as one for the best checkpoint.
        self._started: set[str] = set()
        self._early_fence: str | None = None
        """Why this run's parameters change before the optimizer step (`_early_fence_reason`),
        if they do: the fence is then waited on at each step's beginning."""
        self.saved: list[str] = []
        """Paths of the checkpoints committed so far, oldest first."""
        self.infos: list[SaveInfo] = []
        """What each committed save did (its `SaveInfo`), oldest first."""

    # -- events ---------------------------------------------------------------------------

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = _calling_trainer(self)
        if trainer is not None:
            self._guard(trainer)

    def _guard(self, trainer: Trainer) -> None:
        """Make ``trainer.train()`` finish this callback's save in flight before an error
        leaves it, as the stock save is over by then: what the caller does next (a retry
        with ``resume_from_checkpoint``, which loads older weights into the model before
        any callback runs; its own clean-up) must neither change the tensors the save
        still reads nor miss the checkpoint it makes. Installed when the Trainer is made
        (a callback added later guards the ``train()`` calls after its first)."""
        if getattr(vars(trainer).get("train"), "_aiopersist_guard", None) is self:
            return
        train = trainer.train

        @functools.wraps(train)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.verify_on_resume:
                args, kwargs = self._checked_resume(trainer, args, kwargs)
            try:
                return train(*args, **kwargs)
            except BaseException:
                if self._trainer is trainer:  # this run never reached on_train_end
                    self._settle_previous_run()
                    self._detach()
                raise

        guarded._aiopersist_guard = self  # type: ignore[attr-defined]
        vars(trainer)["train"] = guarded

    def _checked_resume(
        self, trainer: Trainer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``train()``'s arguments, with ``resume_from_checkpoint`` checked (see
        ``verify_on_resume``): unchanged, or ``True`` replaced by the newest checkpoint
        that checks out when the newest does not."""
        positional = bool(args)
        resume = args[0] if positional else kwargs.get("resume_from_checkpoint")
        if resume is None or resume is False:
            return args, kwargs
        if resume is not True:
            path = os.fspath(resume)
            problem = self._agreed_problem(trainer, path)
            if problem is not None:
                raise CheckpointCorruptError(
                    f"resume_from_checkpoint={path!r}: {problem}; nothing was loaded from it"
                )
            return args, kwargs
        folder = str(trainer.args.output_dir)
        candidates = agreed_checkpoints(_stock_checkpoints(folder), trainer.args.world_size > 1)
        passed_over: list[str] = []
        for path in candidates:
            problem = self._agreed_problem(trainer, path)
            if problem is None:
                if not passed_over:
                    return args, kwargs  # the Trainer's own choice checks out
                log.warning(
                    "aiopersist: resume_from_checkpoint=True: resuming from %s, the newest checkpoint that "
                    "checks out; passed over: %s",
                    path,
                    "; ".join(passed_over),
                )
                if positional:
                    return (path, *args[1:]), kwargs
                return args, {**kwargs, "resume_from_checkpoint": path}
            passed_over.append(f"{os.path.basename(path)} ({problem})")
        if not passed_over:
            return args, kwargs  # none at all: the Trainer says so
        raise CheckpointCorruptError(
            f"resume_from_checkpoint=True: no checkpoint in {folder} checks out: {'; '.join(passed_over)}"
        )

    def _agreed_problem(self, trainer: Trainer, path: str) -> str | None:
        """What is wrong with checkpoint ``path``, the same on every process (see
        `checkpoint_problem`)."""
        return checkpoint_problem(path, self.backend, trainer.args.world_size > 1)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = _running_trainer(self)
        fsdp = _fsdp_plugin(trainer)
        if args.world_size > 1:
            if args.parallel_mode != ParallelMode.DISTRIBUTED:
                raise ValueError(
                    "AioPersistCallback supports one process, DistributedDataParallel and FSDP2; this "
                    f"run's parallel mode is {args.parallel_mode.value}"
                )
            if args.save_on_each_node:
                _check_one_saver(args)
        if getattr(args, "deepspeed", None):
            raise ValueError(
                "AioPersistCallback cannot be used with DeepSpeed: its optimizer step runs inside "
                "backward(), so there is no point before it where the fence could be waited on"
            )
        if fsdp is None and _has_dtensor_parameters(trainer.model):
            # Tensor parallelism (a model loaded with tp_plan, or sharded by hand): the stock
            # save gathers the full tensors on every process first; this callback writes
            # process 0's state dict and would save local shards for whole tensors.
            raise ValueError(
                "AioPersistCallback does not save tensor-parallel (DTensor) parameters outside "
                "FSDP; this model has some: use the stock save"
            )
        if type(trainer)._save_checkpoint is not Trainer._save_checkpoint:
            raise ValueError(
                f"AioPersistCallback replaces Trainer._save_checkpoint, which {type(trainer).__name__} "
                "overrides: its own save would be bypassed"
            )
        if args.world_size > 1:
            coord = coordinator()
            assert coord is not None
            if fsdp is not None:
                # Every rank writes its shards, from a background thread, over a group of the
                # saves' own. Making it is a collective: every rank makes it here.
                self._sharded = ShardedSaver(background_group(coord), backend=self.backend)
                self._fsdp = fsdp
            else:
                # Process 0 writes every checkpoint alone, in a group of its own. Making the
                # group is a collective, so every rank makes it here, even when it never saves.
                self._group = GroupRef(process0_group(coord))
        if args.push_to_hub:
            log.warning("aiopersist: checkpoints saved by AioPersistCallback are not pushed to the Hub")
        if self._ckpt is None:
            self._ckpt = BlockingCheckpointer(
                backend=self.backend,
                mode=self.mode,
                snapshot_bytes=self.snapshot_bytes,
                max_shard_bytes=_stock_shard_bytes(),
            )
        self._settle_previous_run()
        if args.should_save and args.output_dir:
            _remove_leftovers(str(args.output_dir))
        self._started = set()
        # The optimizer is made (and wrapped) before on_train_begin.
        self._early_fence = _early_fence_reason(trainer)
        if self._early_fence is not None:
            log.info(
                "aiopersist: %s: each save is waited for (every byte out of the parameters) before the "
                "next step begins, so the step's forward and backward do not overlap it",
                self._early_fence,
            )
        self._guard(trainer)
        self._attach(trainer)

    def _settle_previous_run(self) -> None:
        """A ``train()`` that raised never reached ``on_train_end``: its last save may still
        be in flight. Wait for it here, so that it neither races the cleanup below nor
        raises its error into this run's first save."""
        handle, self._handle = self._handle, None
        committer, self._committer = self._committer, None
        if handle is not None:
            try:
                handle.wait()
            except Exception as exc:
                log.warning("aiopersist: the last save of the previous training run failed: %s", exc)
        if committer is not None:
            committer.join()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Where something changes the parameters before the optimizer step (the fence's
        # point), the save must have left them before the step's forward.
        if self._early_fence is not None and self._handle is not None:
            self._handle.wait_staged()

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._handle is not None:
            self._handle.wait_staged()  # the fence: raises the save's error, if any

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The last epoch's end: what follows (the epoch's own save, if any, then the end of
        # training, with load_best_model_at_end) must find the checkpoints complete.
        if control.should_training_stop:
            self._drain(args)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # The Trainer's closing log (the one with "train_runtime") comes after the last save
        # and before what reads the checkpoints at the end: load_best_model_at_end
        # (transformers 5) and the deletion, with save_total_limit=1, of all but the best.
        # Training can stop after the last on_epoch_end with its last checkpoint still being
        # written: a stop that a callback decides in on_save, after an epoch's save.
        if self._trainer is not None and logs is not None and "train_runtime" in logs:
            self._drain(args)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        try:
            self._drain(args)
        finally:
            self._detach()
            if self._ckpt is not None:
                self._ckpt.close()
                self._ckpt = None
            if self._sharded is not None:
                self._sharded.close()
                self._sharded = self._fsdp = None

    # -- the Trainer's save, taken over -----------------------------------------------------

    def _attach(self, trainer: Trainer) -> None:
        """Route ``trainer``'s checkpoint saves, and its just-in-time checkpoints, here."""
        self._trainer = trainer
        # An instance attribute shadows the class's method: the Trainer's own calls
        # (self._save_checkpoint) and the JIT manager's reach it; other Trainers do not.
        vars(trainer)["_save_checkpoint"] = functools.partial(self._save_checkpoint, trainer)
        vars(trainer)["_load_best_model"] = functools.partial(self._load_best_model, trainer)
        for cb in trainer.callback_handler.callbacks:
            manager = getattr(cb, "jit_manager", None)
            if type(cb).__name__ == "JITCheckpointCallback" and manager is not None:
                vars(manager)["execute_jit_checkpoint"] = functools.partial(
                    self._jit_checkpoint, trainer, manager
                )
                self._jit_manager = manager

    def _detach(self) -> None:
        if self._trainer is not None:
            vars(self._trainer).pop("_save_checkpoint", None)
            vars(self._trainer).pop("_load_best_model", None)
            self._trainer = None
        if self._jit_manager is not None:
            vars(self._jit_manager).pop("execute_jit_checkpoint", None)
            self._jit_manager = None

    def _save_checkpoint(self, trainer: Trainer, model: Any, trial: Any) -> None:
        """``Trainer._save_checkpoint``, step for step, with aiopersist doing the writing."""
        if self._ckpt is None or self not in trainer.callback_handler.callbacks:
            # Left behind on a Trainer whose training ended with an error (on_train_end never
            # ran) and that no longer runs this callback: nothing would wait on the fence.
            Trainer._save_checkpoint(trainer, model, trial)
            return
        t = cast(Any, trainer)  # transformers leaves these methods unannotated
        args, state = trainer.args, trainer.state
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        run_dir = str(t._get_output_dir(trial=trial))
        path = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self._record_best(args, state, run_dir, path)
        rng_files = self._gather_rng_states(trainer)  # every rank takes part; process 0 gets them
        if args.should_save or self._sharded is not None:
            files = None
            weights: object = None
            if args.should_save:
                _export_callback_states(trainer)
                model_files: dict[str, bytes | TorchSave] = {}
                if self._sharded is None:  # under FSDP the model is a DCP directory
                    weights, model_files = _model_save(
                        trainer.model, path, _unwrapped(trainer), safe=_saves_safetensors(args)
                    )
                files = self._checkpoint_files(trainer, path, rng_files, model_files)
            previous, self._handle = self._handle, None
            if previous is not None:
                # The save would wait for it anyway (one in flight); its error is raised here.
                previous.wait()
            handle: BlockingSaveHandle | ShardedSave
            if self._sharded is not None:
                # FSDP: every rank writes its shards of the model and the optimizer, as the
                # stock FSDP save lays them out; process 0 adds the files and publishes.
                states = fsdp_states([trainer.model], [trainer.optimizer], self._fsdp)
                handle = self._sharded.save(path, states, files, overwrite=True)
            else:
                # Under DDP process 0 writes alone, in a group of its own: no other rank takes part.
                handle = self._ckpt.save(
                    weights,
                    path,
                    overwrite=True,
                    extra_files=files,
                    group=None if self._group is None else self._group.get(),
                )
            self._handle = handle
            if args.should_save:  # process 0 records the commits and rotates
                self._committer = threading.Thread(
                    target=self._commit,
                    args=(
                        handle,
                        self._committer,
                        run_dir,
                        args.save_total_limit,
                        state.best_model_checkpoint,
                    ),
                    name="aiopersist-commit",
                    daemon=True,
                )
                self._committer.start()
        self._started.add(path)
        if trainer.control.should_training_stop:
            # Nothing overlaps the last save: what comes next (load_best_model_at_end, the
            # stock cleanup of save_total_limit=1, the caller) needs it complete.
            self._drain(args)
        elif self._durable_for_on_save(trainer):
            # The Trainer calls on_save next: a callback that reads checkpoint-N there finds
            # it complete and rotated, as after a stock save. Only this process waits, as
            # the stock save has no barrier before on_save either.
            self._drain(args, barrier=False)

    def _load_best_model(self, trainer: Trainer) -> None:
        """``Trainer._load_best_model`` (its class's), once the save in flight is durable:
        transformers 4 loads the best model before the closing log (see `on_log`), with no
        event in between."""
        self._drain(trainer.args)
        cast(Any, type(trainer))._load_best_model(trainer)

    def _durable_for_on_save(self, trainer: Trainer) -> bool:
        """Whether the save must be durable before the other callbacks' ``on_save``
        (``durable_on_save``, by default `reads_checkpoint_on_save` of each)."""
        if self.durable_on_save is not None:
            return self.durable_on_save
        others = [cb for cb in trainer.callback_handler.callbacks if cb is not self]
        readers = [type(cb).__name__ for cb in others if reads_checkpoint_on_save(cb)]
        if readers and not self._said_durable:
            self._said_durable = True
            log.warning(
                "aiopersist: %s.on_save may read the checkpoint, so each save is waited for before it "
                "(it does not overlap the next step); pass AioPersistCallback(durable_on_save=False) "
                "if it does not read checkpoint-N",
                ", ".join(readers),
            )
        return bool(readers)

    def _jit_checkpoint(self, trainer: Trainer, manager: Any) -> None:
        """``CheckpointManager.execute_jit_checkpoint`` (``enable_jit_checkpoint``), taken
        over: the stock one creates ``checkpoint-N`` and a sentinel file in it, then saves
        into it, which would write into a checkpoint this callback committed. Here a
        checkpoint of this step already started is waited for; otherwise one is saved.
        Either way it is durable when this returns, as the stock JIT save is."""
        manager.is_checkpoint_requested = False  # one checkpoint per request, as the stock one
        step = trainer.state.global_step
        path = os.path.join(
            str(cast(Any, trainer)._get_output_dir(trial=None)), f"{PREFIX_CHECKPOINT_DIR}-{step}"
        )
        log.info("aiopersist: just-in-time checkpoint at step %d", step)
        if path not in self._started:
            self._save_checkpoint(trainer, trainer.model, None)
        self._drain(trainer.args)

    def _record_best(self, args: TrainingArguments, state: TrainerState, run_dir: str, path: str) -> None:
        """``state.best_model_checkpoint`` as the stock save sets it: the best step's
        checkpoint, if it exists. The stock save checks the disk after writing (and a
        barrier under DDP); here the checkpoint being saved, and those in flight, count as
        existing on every rank."""
        step = getattr(state, "best_global_step", None)
        if args.save_strategy not in _TRACKS_BEST or not step:
            return
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if best == path or best in self._started or os.path.exists(best):
            state.best_model_checkpoint = best

    def _checkpoint_files(
        self,
        trainer: Trainer,
        path: str,
        rng_files: dict[str, bytes],
        model_files: dict[str, bytes | TorchSave],
    ) -> dict[str, bytes | TorchSave]:
        """Every file of the checkpoint but the weights, as the stock save writes them (under
        FSDP, where the model and the optimizer are DCP directories, the stock save writes
        neither the model's files nor ``training_args.bin`` nor the tokenizer's)."""
        args, state = trainer.args, trainer.state
        sharded = self._sharded is not None
        files = dict(model_files)  # the model's files but its weights (`_model_save`)
        if not args.save_only_model:
            if trainer.optimizer is not None and not sharded:
                files["optimizer.pt"] = TorchSave(trainer.optimizer.state_dict())
            if trainer.lr_scheduler is not None:
                files["scheduler.pt"] = _torch_file(trainer.lr_scheduler.state_dict(), "scheduler.pt")
            scaler = getattr(trainer.accelerator, "scaler", None)  # fp16 on GPU
            if scaler is not None:
                files["scaler.pt"] = _torch_file(scaler.state_dict(), "scaler.pt")
            files.update(rng_files)
        # As TrainerState.save_to_json writes it, at this moment: later steps change the state.
        files["trainer_state.json"] = (
            json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"
        ).encode()
        if sharded:
            return files
        files["training_args.bin"] = _torch_file(args, "training_args.bin")
        tokenizer = trainer.processing_class
        if tokenizer is None:
            # As Trainer._save: the data collator's tokenizer when there is no processing class.
            tokenizer = getattr(trainer.data_collator, "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            files.update(_processing_files(tokenizer, path))
        return files

    def _gather_rng_states(self, trainer: Trainer) -> dict[str, bytes]:
        """The ``rng_state*.pth`` files the Trainer's own save writes, byte for byte
        (`_stock_rng_file`): ``rng_state.pth`` in one process; under DDP
        ``rng_state_<i>.pth`` for every process ``i``, gathered to process 0 (the only one
        that writes), where the stock save has each rank write its own. Empty on the other
        ranks, and when ``save_only_model``."""
        args = trainer.args
        if args.save_only_model:
            return {}
        if args.world_size <= 1:
            return dict([_stock_rng_file(trainer)])
        everyone = gather_objects(_stock_rng_file(trainer))
        if args.process_index != 0:
            return {}
        return dict(cast(list[tuple[str, bytes]], everyone))

    # -- after the save ---------------------------------------------------------------------

    def _commit(
        self,
        handle: BlockingSaveHandle | ShardedSave,
        before: threading.Thread | None,
        run_dir: str,
        limit: int | None,
        best: str | None,
    ) -> None:
        """In the background: wait for the save to commit, then apply ``save_total_limit``
        with the best checkpoint of that save's moment, as the stock save does right after
        writing. A failed save is left to the training thread, which raises its error."""
        if before is not None:
            before.join()  # commits are recorded, and rotations run, in order
        try:
            info = handle.wait()
        except BaseException:
            return
        if info is None:
            return
        self.saved.append(info.path)
        self.infos.append(info)
        log.info(
            "aiopersist: %s committed (%.2f s, %.2f GiB/s)", info.path, info.seconds, info.gib_per_second
        )
        if limit is not None and limit > 0:
            delete_checkpoints(to_rotate(_checkpoints(run_dir), limit, best))

    def _drain(self, args: TrainingArguments, *, barrier: bool = True) -> None:
        """Wait until the save in flight is durable (raising its error) and rotated; under
        DDP every rank then waits for process 0 (unless ``barrier=False``), so that none
        reads a checkpoint (the best model) before it is there."""
        handle, self._handle = self._handle, None
        committer, self._committer = self._committer, None
        try:
            try:
                if handle is not None:
                    handle.wait()
            finally:
                if committer is not None:
                    committer.join()
        finally:
            if barrier and args.world_size > 1:
                coord = coordinator()
                assert coord is not None
                coord.barrier()


# Transformers' own callbacks whose ``on_save`` reads ``checkpoint-N`` only when they are
# configured to (their attribute, checked at each save, says whether): an unknown value,
# or a missing attribute, counts as reading it.
_READS_WHEN: dict[str, tuple[str, Any]] = {
    "WandbCallback": ("_log_model", lambda v: getattr(v, "value", v) == "checkpoint"),  # WANDB_LOG_MODEL
    "MLflowCallback": ("_log_artifacts", bool),  # HF_MLFLOW_LOG_ARTIFACTS
    "NeptuneCallback": ("_should_upload_checkpoint", bool),  # log_checkpoints
    "ClearMLCallback": ("_log_model", bool),  # CLEARML_LOG_MODEL
    "FlyteCallback": ("sync_checkpoints", bool),
    "DVCLiveCallback": ("_log_model", lambda v: v == "all"),  # log_model="all"
}
# Transformers' own callbacks whose ``on_save`` never reads the checkpoint.
_NEVER_READS = ("TrackioCallback", "SwanLabCallback")
_MISSING = object()


def reads_checkpoint_on_save(callback: TrainerCallback) -> bool:
    """Whether ``callback.on_save`` may read the checkpoint just saved: ``False`` when its
    class keeps `TrainerCallback`'s ``on_save`` (which does nothing), or runs the
    ``on_save`` of one of transformers' integrations (Weights & Biases, MLflow and
    DagsHub, Neptune, ClearML, Flyte, DVCLive, Trackio, SwanLab) configured not to log
    checkpoints; ``True`` for any other ``on_save``, which could (upload the directory,
    copy it, read its files)."""
    # The class whose on_save it runs (an integration's subclass runs the integration's).
    cls = next((c for c in type(callback).__mro__ if "on_save" in vars(c)), TrainerCallback)
    if cls is TrainerCallback:
        return False
    if not cls.__module__.startswith("transformers."):
        return True
    if cls.__name__ in _NEVER_READS:
        return False
    rule = _READS_WHEN.get(cls.__name__)
    if rule is None:
        return True
    attribute, reads = rule
    value = getattr(callback, attribute, _MISSING)
    return value is _MISSING or bool(reads(value))


_LEFTOVER_RE = re.compile(
    rf"^\.{PREFIX_CHECKPOINT_DIR}-\d+({re.escape(TMP_MARKER)}|{re.escape(TRASH_MARKER)})"
)


def _remove_leftovers(run_dir: str) -> None:
    """Remove what saves and rotations of an earlier run left when its process died
    (``.checkpoint-N.aiopersist-tmp-*``, ``.checkpoint-N.aiopersist-trash-*``): nothing is
    writing them now, since this process writes every checkpoint of the run."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return
    for name in names:
        if _LEFTOVER_RE.match(name):
            path = os.path.join(run_dir, name)
            log.info("aiopersist: removing %s, left by an interrupted save or deletion", path)
            remove_path(path)


def _check_one_saver(args: TrainingArguments) -> None:
    """Under ``save_on_each_node`` the stock save writes a whole checkpoint from the first
    process of every node (``should_save``). On one node that is process 0 alone, as with
    the callback; across nodes it is refused, on every process (the processes tell each
    other which of them save): process 0 writes the checkpoint, with every process's RNG
    state, and the other nodes would have none of their own."""
    savers = gather_objects(args.process_index if args.should_save else None)
    others = sorted(i for i in savers if i not in (None, 0))
    if others:
        raise ValueError(
            "AioPersistCallback does not support save_on_each_node across nodes: process 0 writes the "
            "checkpoint, with every process's RNG state, where the stock save also writes one from "
            f"processes {others} (the first of their nodes); run without save_on_each_node on a shared "
            "file system, or use the stock save"
        )


def _has_dtensor_parameters(model: Any) -> bool:
    """Whether any of ``model``'s parameters is a DTensor (tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    params = getattr(model, "parameters", None)
    return callable(params) and any(isinstance(p, DTensor) for p in params())


def _fsdp_plugin(trainer: Trainer) -> Any:
    """Accelerate's FSDP plugin when the Trainer shards the model with FSDP (``None``
    otherwise); `ValueError` for the FSDP configurations the callback does not write."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    return check_plugin(cast(Any, trainer).accelerator.state.fsdp_plugin, "AioPersistCallback")


def _early_fence_reason(trainer: Trainer) -> str | None:
    """Why ``trainer``'s parameters change before the optimizer step, where the fence
    holds a save's tensors by default, if they do: an optimizer with ``train()`` (the
    Trainer calls it before each step's forward; a schedule-free optimizer moves the
    parameters there), one that steps inside ``backward()`` (transformers' layerwise
    GaLore/APOLLO, LOMO), or an embedding with ``max_norm`` (its forward renormalises the
    rows it looks up, in place)."""
    optimizer = trainer.optimizer
    while isinstance(optimizer, AcceleratedOptimizer):  # it forwards train() whatever it wraps
        optimizer = optimizer.optimizer
    if callable(getattr(optimizer, "train", None)):
        return f"the optimizer ({type(optimizer).__name__}) has train(), which may move the parameters"
    if hasattr(optimizer, "optimizer_dict") or trainer.args.optim in ("lomo", "adalomo"):  # a str enum
        return f"the optimizer ({type(optimizer).__name__}) steps inside backward()"
    model = trainer.model
    if isinstance(model, torch.nn.Module):
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag) and module.max_norm is not None:
                kind = type(module).__name__
                return f"{name or 'the model'} ({kind} with max_norm) renormalises rows in the forward"
    return None


_STOCK_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}\-(\d+)$")
"""A checkpoint's name as ``get_last_checkpoint`` matches it (its ``$`` included)."""


def _stock_checkpoints(folder: str) -> list[str]:
    """The checkpoints ``get_last_checkpoint(folder)`` chooses among, its choice first:
    directories (or links to one) named ``checkpoint-N``, newest step first."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = []
    for name in names:
        match = _STOCK_CHECKPOINT.search(name)
        if match is not None and os.path.isdir(os.path.join(folder, name)):
            found.append((int(match.group(1)), name))
    # Stable: among equal numbers (checkpoint-100, checkpoint-0100) the first listed comes
    # first, as get_last_checkpoint's max() takes it.
    return [os.path.join(folder, name) for _, name in sorted(found, key=lambda f: f[0], reverse=True)]


def _running_trainer(callback: AioPersistCallback) -> Trainer:
    """The Trainer whose ``train()`` is calling ``callback`` now (see `_calling_trainer`)."""
    trainer = _calling_trainer(callback)
    if trainer is None:
        raise ValueError(
            "AioPersistCallback must be passed to a transformers Trainer (callbacks=[...]) and run by its "
            "train(); no Trainer holding it is calling it"
        )
    return trainer


def _calling_trainer(callback: AioPersistCallback) -> Trainer | None:
    """The Trainer whose ``train()`` (or ``__init__``) is calling ``callback`` now: a
    caller's ``self`` that is a Trainer holding this callback; ``None`` if there is none."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None)  # not yet made in __init__
            callbacks = getattr(handler, "callbacks", ())
            if isinstance(candidate, Trainer) and any(cb is callback for cb in callbacks):
                return candidate
            frame = frame.f_back
    finally:
        del frame
    return None


def _export_callback_states(trainer: Trainer) -> None:
    """As the stock save does before writing ``trainer_state.json``: the state of every
    ``ExportableState`` callback, and of the ``TrainerControl``, as it is now."""
    stateful = cast(dict[str, Any], trainer.state.stateful_callbacks)
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(cb, ExportableState):
            name = type(cb).__name__
            if isinstance(stateful[name], list):
                stateful[name].append(cb.state())
            else:
                stateful[name] = cb.state()


def _stock_shard_bytes() -> int:
    """The most bytes per weights file ``save_pretrained`` writes by default, as the stock
    save calls it ("50GB" in transformers 5), unless ``AIOPERSIST_SHARD_BYTES`` says."""
    if os.environ.get("AIOPERSIST_SHARD_BYTES"):
        return _knobs.shard_bytes()
    default = inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    if isinstance(default, int):
        return default
    from huggingface_hub.serialization._base import parse_size_to_int

    return int(parse_size_to_int(default))


def _saves_safetensors(args: TrainingArguments) -> bool:
    """Whether the stock save writes the weights as safetensors: always in transformers 5,
    as ``save_safetensors`` says in 4 (``False``: ``pytorch_model.bin``, which is then the
    file that ``load_best_model_at_end`` and resuming look for)."""
    return getattr(args, "save_safetensors", True) is not False


def _model_save(
    model: Any, path: str, unwrapped: Any = None, *, safe: bool = True
) -> tuple[object, dict[str, bytes | TorchSave]]:
    """What the stock save writes for the model, as ``save_pretrained`` writes it: the
    weights aiopersist writes (``None``: none), and the model's other files.
    ``unwrapped`` is ``model`` unwrapped as ``Trainer._save`` unwraps it (``None``: as is).
    ``safe=False`` (``save_safetensors=False``, transformers 4): the weights as
    ``pytorch_model.bin``, as the stock save writes them then: a model's own
    ``save_pretrained(safe_serialization=False)`` writes them (into the staging directory
    below), and any other module's state dict is ``torch.save``'d, through the engine.

    - A ``PreTrainedModel``: the state dict ``save_pretrained`` writes, without the
      ``_keys_to_ignore_on_save``, tied weights once under the name it keeps, and weight
      conversions reverted (a Mixtral's fused experts back to ``experts.N.w1``...);
      ``config.json`` (``auto_map`` and the model's code files for a custom-code model)
      and ``generation_config.json``.
    - A model that ``save_pretrained`` writes in another form (PEFT adapters, a
      ``PeftModel``, a quantized or offloaded model), or a transformers without the
      functions above: ``save_pretrained`` itself writes into a staging directory, and
      its files (the adapter's small weights included) go into the checkpoint.
    - A wrapper of one of those (a model compiled with ``torch.compile`` before it was
      given to the Trainer): as ``Trainer._save``, the wrapper's state dict, under the
      wrapper's names, written as the wrapped model's ``save_pretrained`` writes it, with
      its config and the rest.
    - Any other module: its weights, as the stock save writes its state dict alone.

    The buffers among the weights are copies (`with_buffers_copied`): the next step's
    forward runs while the weights are written, and may change them."""
    inner = model if unwrapped is None else unwrapped
    # save_pretrained of transformers 4 takes safe_serialization; 5 writes safetensors only.
    options: dict[str, Any] = {} if safe else {"safe_serialization": False}
    if inner is not model and (isinstance(inner, PreTrainedModel) or _is_peft(inner)):
        state = model.state_dict()
        if not safe or _saved_by_itself(inner):
            return None, dict(
                files_written_by(lambda d: inner.save_pretrained(d, state_dict=state, **options), path)
            )
        return _pretrained_save(inner, state, path)
    if (not safe and isinstance(model, PreTrainedModel)) or _saved_by_itself(model):
        return None, dict(files_written_by(lambda d: model.save_pretrained(d, **options), path))
    if not isinstance(model, PreTrainedModel):
        if not isinstance(model, torch.nn.Module):
            return model, {}
        live = model.state_dict()
        state = with_buffers_copied(model, live)
        if not safe:
            return None, {"pytorch_model.bin": TorchSave(_as_state_dict(state, live))}
        return state, {}
    return _pretrained_save(model, model.state_dict(), path)


def _as_state_dict(state: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """``state`` pickled as ``like`` (a module's ``state_dict()``) is: an ``OrderedDict``
    with the modules' versions (``_metadata``), which ``load_state_dict`` reads."""
    out: Any = collections.OrderedDict(state)
    metadata = getattr(like, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return cast(dict[str, Any], out)


def _pretrained_save(
    model: Any, state: dict[str, Any], path: str
) -> tuple[object, dict[str, bytes | TorchSave]]:
    """`_model_save` of a ``PreTrainedModel`` whose state dict is ``state``."""
    # save_pretrained records these in the model's own config before writing it.
    config = cast(Any, model.config)
    config.dtype = str(model.dtype).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]

    def write(directory: str) -> None:
        # As save_pretrained, by the same calls: a custom-code model's code files (and
        # auto_map in its config), the config, the generation config.
        if model.is_remote_code():
            from transformers.dynamic_module_utils import custom_object_save

            custom_object_save(model, directory, config=config)
        config.save_pretrained(directory)
        if model.can_generate():
            cast(Any, model.generation_config).save_pretrained(directory)

    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    state = with_buffers_copied(model, revert_weight_conversion(model, state))
    return state, dict(files_written_by(write, path))


def _saved_by_itself(model: Any) -> bool:
    """Whether ``save_pretrained`` writes ``model`` in a form of its own, or this
    transformers lacks what `_model_save` follows it with."""
    if _is_peft(model):
        return True
    if not isinstance(model, PreTrainedModel):
        return False
    device_map = getattr(model, "hf_device_map", None) or {}
    if (
        getattr(model, "_hf_peft_config_loaded", False)
        or getattr(model, "hf_quantizer", None) is not None
        or "cpu" in device_map.values()
        or "disk" in device_map.values()
    ):
        return True
    try:
        from transformers.core_model_loading import revert_weight_conversion  # noqa: F401
        from transformers.modeling_utils import remove_tied_weights_from_state_dict  # noqa: F401
    except ImportError:
        return True
    return False


def _unwrapped(trainer: Trainer) -> Any:
    """``trainer.model`` unwrapped as ``Trainer._save`` unwraps it: by its accelerator,
    out of ``torch.compile`` too (an Accelerate older than ``keep_torch_compile`` always
    unwraps it)."""
    unwrap = cast(Any, trainer).accelerator.unwrap_model
    if "keep_torch_compile" in inspect.signature(unwrap).parameters:
        return unwrap(trainer.model, keep_torch_compile=False)
    return unwrap(trainer.model)


def _is_peft(model: Any) -> bool:
    """Whether ``model`` is a PEFT model (``PeftModel`` or one of its task classes)."""
    return type(model).__name__ in ("PeftModel", "PeftModelForCausalLM") or any(
        c.__module__.startswith("peft.") for c in type(model).__mro__
    )


def _processing_files(processing_class: Any, path: str) -> dict[str, bytes | TorchSave]:
    """A tokenizer's (or processor's) files, as its ``save_pretrained`` writes them into the
    checkpoint ``path``."""
    return dict(files_written_by(processing_class.save_pretrained, path))
