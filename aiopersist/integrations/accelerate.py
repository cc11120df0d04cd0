"""An asynchronous ``accelerator.save_state()`` for Accelerate training loops.

``handle = await save_state(accelerator, "ckpt/step-100", checkpointer=ckpt)`` writes
what ``accelerator.save_state`` writes, in Accelerate's own layout, so that
``accelerator.load_state("ckpt/step-100")`` restores it (`load_state` here checks it
against its checksums first):

- ``model.safetensors``: the prepared model's state dict (``get_state_dict(model,
  unwrap=False)``, as ``save_state`` takes it), and ``model_1.safetensors``... for more
  models (`SafetensorsSave`); with ``safe_serialization=False``, ``torch.save`` of each
  model's into ``pytorch_model.bin``, ``pytorch_model_1.bin``...;
- ``optimizer.bin``, ``scheduler.bin``: ``torch.save`` of their state dicts (the
  optimizer's streamed through the engine);
- ``random_states_<rank>.pkl`` for every process;
- ``scaler.pt`` with mixed precision, and ``custom_checkpoint_<i>.pkl`` for objects
  registered with ``register_for_checkpointing``;
- ``sampler.bin`` and ``dl_state_dict.bin`` where ``save_state`` writes them (the sampler
  of a sharded iterable dataset, the state of a stateful data loader);
- what the hooks registered with ``register_save_state_pre_hook`` write. They are called
  as ``save_state`` calls them, ``hook(accelerator._models, weights, output_dir)``, and
  may take weights out of the list (saving them themselves); the weights left are the
  ones written. Their ``output_dir`` is a staging directory beside the checkpoint, whose
  files (in subdirectories too) go into the checkpoint.

Where it goes is decided as ``save_state`` decides: an existing empty directory is
taken; with ``automatic_checkpoint_naming`` the checkpoint is
``<project_dir>/checkpoints/checkpoint_<iteration>`` (``output_dir`` may be left out),
after the oldest ones beyond ``total_limit`` are deleted; every save started counts an
iteration. Nothing but complete checkpoints ever appears in ``checkpoints/``, which
``load_state()`` and the rotation take entry by entry: the work in progress is in
``<project_dir>/.aiopersist-staging/`` (`_work_outside_checkpoints`). Unlike
``save_state``, which writes into an existing directory, a non-empty one raises
`CheckpointExistsError` unless ``overwrite=True`` replaces it as a whole.

It returns once the save is started. Call ``await handle.staged`` (or
``handle.wait_staged()`` from a synchronous loop with `save_state_blocking`) before the
next ``optimizer.step()``, and ``await handle.done`` when it must be durable. The
directory appears only once complete (atomic rename).

With several processes, every process calls it (and runs the save hooks). Their RNG
states are gathered to process 0 (a few KiB over the checkpoint's gloo group), which
writes the whole directory, with the files of its own hooks. The model and optimizer are
those of process 0, as with ``save_state`` under DDP. On other processes the handle is
already resolved. Processes that name different directories get what ``save_state``
writes into each (`_directories`): a process that names one of its own writes there its
RNG state, its data loaders' states, the scaler and its hooks' files. Processes that name
one directory share it (``save_on_each_node`` is not followed): on several machines it
must be on storage they all see.

Under FSDP2 with ``SHARDED_STATE_DICT`` every process writes its shards, in the layout of
Accelerate's own FSDP saving (``pytorch_model_fsdp_<i>/`` and ``optimizer_<i>/`` DCP
directories, see `aiopersist.integrations._fsdp`), and every process's handle resolves
when the checkpoint is published. FSDP1, ``FULL_STATE_DICT``, DeepSpeed and Megatron-LM
raise `ValueError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import random
import re
import weakref
from collections import OrderedDict
from typing import Any, cast

import numpy as np
import torch

from .._blocking import BlockingCheckpointer, BlockingSaveHandle
from .._checkpointer import Checkpointer, SaveHandle, rebuildable
from .._commit import make_directories, mount_of, remove_path
from .._dist import _derived_group, background_group, coordinator, process0_group
from .._exceptions import CheckpointCorruptError, CheckpointExistsError, UnsupportedStateError
from .._locate import absolute_path
from .._names import LEFTOVER_MARKERS, TMP_MARKER, TRASH_MARKER, work_elsewhere, work_place
from .._save import SafetensorsSave, SaveInfo, TorchSave
from ._common import (
    agreed_checkpoints,
    checkpoint_problem,
    delete_checkpoints,
    files_written_by,
    gather_objects,
    off_loop_as_caller,
    torch_bytes,
    with_buffers_copied,
)
from ._fsdp import ShardedSave, ShardedSaver, check_plugin, fsdp_states

log = logging.getLogger("aiopersist")


def _rng_states(step: int) -> dict[str, Any]:
    """What Accelerate's ``save_accelerator_state`` writes to ``random_states_<rank>.pkl``:
    the host's generators, and those of every accelerator kind that Accelerate finds here
    (by its own tests, under its own keys: ``load_state`` restores each kind it finds)."""
    from accelerate import utils  # type: ignore[import-untyped]

    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }

    def devices(kind: str) -> Any:
        return getattr(torch, kind).get_rng_state_all()

    if utils.is_xpu_available():
        states["torch_xpu_manual_seed"] = devices("xpu")
    # One of these three at most, in this order, as Accelerate takes them.
    for kind in ("mlu", "sdaa", "musa"):
        if getattr(utils, f"is_{kind}_available")():
            states[f"torch_{kind}_manual_seed"] = devices(kind)
            break
    for kind in ("hpu", "neuron", "cuda"):
        if getattr(utils, f"is_{kind}_available")():
            states[f"torch_{kind}_manual_seed"] = devices(kind)
    if utils.is_torch_xla_available():
        import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

        states["xm_seed"] = xm.get_rng_state()
    return states


def _rotates(accelerator: Any) -> bool:
    """Whether this save deletes old checkpoints first (automatic naming with a
    ``total_limit``), on the process that deletes them."""
    config = accelerator.project_configuration
    return bool(
        config.automatic_checkpoint_naming and config.total_limit is not None and accelerator.is_main_process
    )


WORK_PLACE = ".aiopersist-staging"
"""With automatic naming: where the work in progress of the checkpoints in
``<project_dir>/checkpoints/`` goes, ``<project_dir>/.aiopersist-staging/``."""


def _work_outside_checkpoints(accelerator: Any) -> None:
    """With automatic naming, put the work in progress of the checkpoints in
    ``<project_dir>/checkpoints/`` (temporary directories, the staging of the hooks' files,
    deletions) into `WORK_PLACE` (`work_elsewhere`): ``save_state`` and ``load_state`` take
    every entry of ``checkpoints/`` for a checkpoint, hidden ones too (``load_state()``
    loads the one with the highest number, the rotation counts and deletes them), so a
    save in flight or killed must leave nothing there. The first time in a process,
    process 0 removes what interrupted saves and deletions left in `WORK_PLACE`, before the
    barrier of `_prepare`'s check (no process stages anything there before it).

    Only where a directory made there can be renamed into ``checkpoints/``: both on the
    same mount (a bind mount of the same disk has the same device number, and still
    refuses the rename with ``EXDEV``), and the project directory writable. Nothing is
    tried in ``checkpoints/`` to find out (a kill would leave it there for a stock
    ``load_state()`` to take): the mounts are read from ``/proc/self/mountinfo``.
    Elsewhere the work stays beside the checkpoints, with a warning, as the docs say."""
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        return
    base = os.path.abspath(os.path.join(accelerator.project_dir, "checkpoints"))
    place = os.path.abspath(os.path.join(accelerator.project_dir, WORK_PLACE))
    if work_place(base) == place or base in _beside:
        return
    make_directories(base)
    try:
        make_directories(place)
        base_mount, place_mount = mount_of(base), mount_of(place)
        if base_mount != place_mount:
            raise OSError(errno.EXDEV, f"another mount ({base_mount} and {place_mount})")
    except OSError as exc:
        _beside.add(base)
        log.warning(
            "aiopersist: the work in progress of the checkpoints in %s cannot be done in %s (%s): "
            "their temporary directories stay beside them, where a stock load_state() may take one "
            "that a killed save left for a checkpoint",
            base,
            place,
            exc,
        )
        return
    work_elsewhere(base, place)
    if accelerator.is_main_process:
        _remove_leftovers(place)
        # Made to learn its mount: gone again until a save works there (a save that fails
        # before, a name taken say, leaves the project directory holding checkpoints/ alone).
        with contextlib.suppress(OSError):
            os.rmdir(place)  # only if empty


_beside: set[str] = set()
"""``checkpoints/`` directories whose work stays beside them (`_work_outside_checkpoints`)."""


def _remove_leftovers(place: str) -> None:
    """What interrupted saves and deletions left in ``place``."""
    try:
        names = os.listdir(place)
    except FileNotFoundError:  # released meanwhile (empty: nothing left there)
        return
    leftovers = [n for n in names if any(m in n for m in (TMP_MARKER, TRASH_MARKER))]
    for name in leftovers:
        remove_path(os.path.join(place, name))
    if leftovers:
        log.info("aiopersist: removed %d leftovers of interrupted saves from %s", len(leftovers), place)


def _outdated(accelerator: Any) -> list[str]:
    """The checkpoints ``save_state`` deletes before this save (automatic naming with a
    ``total_limit``): the oldest, until ``total_limit`` remain with the new one."""
    if not _rotates(accelerator):
        return []
    config = accelerator.project_configuration
    base = os.path.join(accelerator.project_dir, "checkpoints")
    if not os.path.isdir(base):
        return []
    # Every entry counts, hidden ones too, as save_state counts them; but not aiopersist's
    # own work in progress, where it stays beside the checkpoints (`_beside`).
    folders = [os.path.join(base, n) for n in os.listdir(base) if not any(m in n for m in LEFTOVER_MARKERS)]
    if len(folders) + 1 <= config.total_limit:
        return []  # sorted by number only when over the limit, as save_state sorts them
    outdated = sorted(folders, key=_iteration_of)[: len(folders) + 1 - config.total_limit]
    for path in outdated:
        # save_state's shutil.rmtree fails on them (NotADirectoryError, OSError): so does
        # this, before anything is deleted rather than after the older ones.
        if os.path.islink(path):
            raise OSError(f"{path}: save_state would delete it as an old checkpoint; it is a symbolic link")
        if not os.path.isdir(path):
            raise NotADirectoryError(
                errno.ENOTDIR, "save_state would delete it as an old checkpoint; it is not a directory", path
            )
    return outdated


def _delete_outdated(accelerator: Any) -> None:
    delete_checkpoints(_outdated(accelerator))


def _target(accelerator: Any, output_dir: str | os.PathLike[str] | None, overwrite: bool) -> tuple[str, bool]:
    """Where the checkpoint goes, and whether the save may replace what is there, as
    ``save_state`` decides: with ``automatic_checkpoint_naming``,
    ``<project_dir>/checkpoints/checkpoint_<iteration>`` (which must not exist; the
    outdated ones were deleted before, see `_outdated`); otherwise ``output_dir``, where an
    existing empty directory is replaced (``save_state`` writes into it)."""
    config = accelerator.project_configuration
    if config.automatic_checkpoint_naming:
        base = os.path.join(accelerator.project_dir, "checkpoints")
        os.makedirs(base, exist_ok=True)
        target = os.path.join(base, f"checkpoint_{accelerator.save_iteration}")
        if os.path.exists(target):
            raise ValueError(
                f"Checkpoint directory {target} ({accelerator.save_iteration}) already exists. Please "
                "manually override `self.save_iteration` with what iteration to start with."
            )
        return target, False
    if output_dir is None:  # as save_state's os.makedirs(None) fails, with a word on why
        raise TypeError("save_state needs output_dir unless the Accelerator names checkpoints automatically")
    target = absolute_path(output_dir, "output_dir")
    if os.path.islink(target) and os.path.isdir(target):
        # save_state writes through a link to a directory: so does this, the link left as
        # it is and the directory it names replaced.
        target = os.path.realpath(target)
    if not overwrite and os.path.lexists(target):
        if os.path.isdir(target) and not os.listdir(target):
            return target, True  # nothing in it to keep: replaced, as if it were not there
        # save_state would write into it, beside what is there: a checkpoint is replaced
        # as a whole or not at all. Said here, before the hooks run and anything is read.
        raise CheckpointExistsError(f"{target} already exists (pass overwrite=True to replace it)")
    return target, overwrite


def _iteration_of(folder: str) -> int:
    """The number in a checkpoint folder's name, as ``save_state`` sorts them."""
    return int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)[0])


def _run_save_hooks(
    accelerator: Any, weights: list[dict[str, Any]], target: str, *, keep: bool
) -> dict[str, bytes]:
    """Call the hooks registered with ``register_save_state_pre_hook`` as ``save_state``
    does, ``hook(accelerator._models, weights, directory)``: they may take weights out of
    the list and write files of their own. The directory is a staging one beside the
    checkpoint (the checkpoint itself appears only once complete); with ``keep``, the
    files they write there are returned, to be written into the checkpoint (by the
    process that writes it)."""
    hooks = list(accelerator._save_model_state_pre_hook.values())
    if not hooks:
        return {}

    def run_hooks(staging: str) -> None:
        for hook in hooks:
            hook(accelerator._models, weights, staging)

    return files_written_by(run_hooks, target, keep=keep)


def _directories(accelerator: Any, target: str) -> list[str]:
    """Every process's checkpoint directory, by rank (a collective: every process calls
    it). ``save_state`` writes into each process's own ``output_dir`` what that process
    writes (its ``random_states_<rank>.pkl``, its data loaders' states), so processes
    that name different directories (a ``tempfile.TemporaryDirectory()`` each) get
    different checkpoints. Each directory is written once, by the first process that names
    it (`_writer`)."""
    return gather_objects(os.path.abspath(target))


def _writer(directories: list[str], rank: int) -> int:
    """The process that writes ``rank``'s directory: the first one that names it."""
    return directories.index(directories[rank])


def _plan(
    accelerator: Any, target: str, safe_serialization: bool, max_shard_bytes: int
) -> tuple[object, dict[str, bytes | TorchSave | SafetensorsSave], Any, bool]:
    """The model's state dict (``None`` with ``safe_serialization=False``: the weights go
    into ``pytorch_model.bin``), the other files, the group this process saves in, and
    whether it writes a directory (`_directories`). Process 0 writes its directory with
    everything; another process that names a directory of its own writes there what
    ``save_state`` writes on it."""
    from accelerate.utils import DistributedType  # type: ignore[import-untyped]

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"aiopersist's save_state does not write {accelerator.distributed_type.value} checkpoints: "
            "use accelerator.save_state (their engines save their own sharded states)"
        )
    rank = accelerator.process_index
    directories = _directories(accelerator, target)
    writes = _writer(directories, rank) == rank
    # The buffers copied: the next step's forward changes them in place (BatchNorm's
    # running statistics) before the optimizer step that the fence holds back.
    weights = [
        with_buffers_copied(model, accelerator.get_state_dict(model, unwrap=False))
        for model in accelerator._models
    ]
    hooked = _run_save_hooks(accelerator, weights, target, keep=writes)
    group = None
    if accelerator.num_processes > 1:
        coord = coordinator()
        assert coord is not None
        group = process0_group(coord)
        # The others' groups, of the processes that write a directory of their own: made
        # by every process, in the same order (making a group is a collective).
        for other in sorted({_writer(directories, r) for r in range(len(directories))} - {0}):
            other_group = _derived_group(coord, f"process {other}", [other])
            if other == rank:
                group = other_group
    extra: dict[str, bytes | TorchSave | SafetensorsSave] = dict(hooked)
    optimizers = [opt.state_dict() for opt in accelerator._optimizers]  # on every process, as there
    if rank != 0:
        # What save_state writes on a process other than the main one: its own files.
        extra.update(_state_files(accelerator, directories))
        return None, extra, group, writes
    # With no weights left (the hooks saved them), there is no data file: the checkpoint
    # holds what save_state writes.
    model_state: object = None
    if not safe_serialization:
        # As save_state: torch.save of each model's state dict, pytorch_model.bin then
        # pytorch_model_1.bin..., streamed through the engine; over a hook's file of that name.
        for i, state in enumerate(weights):
            extra["pytorch_model.bin" if i == 0 else f"pytorch_model_{i}.bin"] = TorchSave(state)
    elif weights:
        # save_state writes the weights after the hooks: over a file of theirs of that name.
        extra.pop("model.safetensors", None)
        states = [_for_safetensors(state, i) for i, state in enumerate(weights)]
        nbytes = sum(t.numel() * t.element_size() for t in states[0].values())
        if nbytes <= max_shard_bytes:
            model_state = states[0]  # the checkpoint's own state: its tensors listed in the manifest
        else:
            # load_state reads one model.safetensors, whatever its size; the checkpoint's own
            # state would be split in shards past max_shard_bytes.
            extra["model.safetensors"] = SafetensorsSave(states[0], {"format": "pt"})
        # The other models: model_1.safetensors, model_2.safetensors..., streamed.
        for i, state in enumerate(states[1:], start=1):
            extra[f"model_{i}.safetensors"] = SafetensorsSave(state, {"format": "pt"})
    for i, state in enumerate(optimizers):
        extra["optimizer.bin" if i == 0 else f"optimizer_{i}.bin"] = TorchSave(state)
    extra.update(_state_files(accelerator, directories))
    return model_state, extra, group, writes


def _for_safetensors(state: dict[str, Any], index: int) -> dict[str, torch.Tensor]:
    """A model's state dict as Accelerate's ``save`` writes it into a safetensors file:
    of a state dict (an ``OrderedDict``), the names of tensors sharing memory with an
    earlier one dropped (``clean_state_dict_for_safetensors``). A value that is not a
    tensor (a module's ``get_extra_state()``) is refused, naming it: ``save_state`` fails
    on it too (an ``AttributeError`` of the cleaning, or safetensors' own error); with
    ``safe_serialization=False`` the state is pickled whole."""
    from accelerate.utils.other import clean_state_dict_for_safetensors  # type: ignore[import-untyped]

    file = "model.safetensors" if index == 0 else f"model_{index}.safetensors"
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise UnsupportedStateError(
                f"save_state: {file} holds tensors only, and the state dict of model {index} has "
                f"{name!r} = {type(value).__name__}; pass safe_serialization=False to pickle it, as "
                "save_state does then"
            )
    if isinstance(state, OrderedDict):  # as Accelerate's save
        return cast(dict[str, torch.Tensor], clean_state_dict_for_safetensors(state))
    return state


def _state_files(
    accelerator: Any, directories: list[str] | None = None
) -> dict[str, bytes | TorchSave | SafetensorsSave]:
    """What ``save_accelerator_state`` and the custom objects' saving write beside the
    models and optimizers into this process's directory, in the order ``save_state``
    takes them (a ``state_dict()`` that draws random numbers leaves the RNG states as
    there): the schedulers, samplers, data loader states and the scaler, every process's
    RNG states (gathered: a collective, every process calls it), then the custom objects.

    Process 0 writes them all. Another process writes only what ``save_state`` writes on
    every process (its data loaders' states, the scaler, its RNG state), and only into a
    directory of its own (``directories``, by rank, `_directories`): the RNG states of
    the processes that name a directory go into it. ``directories=None``: every process
    names process 0's."""
    extra: dict[str, bytes | TorchSave | SafetensorsSave] = {}
    rank = accelerator.process_index
    main = rank == 0
    # Every process takes every state_dict(), as save_state does (one may draw random
    # numbers, or be a collective), and keeps what its directory holds.
    for i, sched in enumerate(accelerator._schedulers):
        state = sched.state_dict()
        if main:
            extra["scheduler.bin" if i == 0 else f"scheduler_{i}.bin"] = torch_bytes(state)
    for i, loader in enumerate(accelerator._dataloaders):
        # As save_accelerator_state does: the seedable sampler of a sharded iterable
        # dataset (on the main process), and the state of a stateful data loader.
        from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler  # type: ignore[import-untyped]

        if isinstance(loader.dataset, IterableDatasetShard):
            sampler = loader.get_sampler()
            if main and isinstance(sampler, SeedableRandomSampler):
                extra["sampler.bin" if i == 0 else f"sampler_{i}.bin"] = torch_bytes(sampler)
        if getattr(loader, "use_stateful_dataloader", False):
            extra["dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin"] = torch_bytes(
                loader.state_dict()
            )
    if accelerator.scaler is not None:
        extra["scaler.pt"] = torch_bytes(accelerator.scaler.state_dict())
    everyone = gather_objects(_rng_states(accelerator.step))
    mine = directories[rank] if directories is not None else None
    for other, states in enumerate(everyone):
        if directories is None or directories[other] == mine:
            extra[f"random_states_{other}.pkl"] = torch_bytes(states)
    for i, obj in enumerate(accelerator._custom_objects):
        state = obj.state_dict()
        if main:
            # Its tensors streamed (the Checkpointer copies the containers around them at
            # the save); a state of other objects is pickled now, as save_state pickles it,
            # so that what the loop changes next is not in the checkpoint.
            name = f"custom_checkpoint_{i}.pkl"
            extra[name] = TorchSave(state) if rebuildable(state) else torch_bytes(state)
    return extra


def _is_fsdp(accelerator: Any) -> bool:
    from accelerate.utils import DistributedType

    return bool(accelerator.distributed_type == DistributedType.FSDP)


_savers: weakref.WeakKeyDictionary[Checkpointer, ShardedSaver] = weakref.WeakKeyDictionary()
"""The FSDP saver that goes with each checkpointer (made at its first FSDP save)."""


def _save_fsdp(accelerator: Any, checkpointer: Checkpointer, target: str, overwrite: bool) -> ShardedSave:
    """``save_state`` under FSDP: every process writes its shards of each model
    (``pytorch_model_fsdp_<i>/``) and optimizer (``optimizer_<i>/``), as Accelerate's FSDP
    saving lays them out, from a background thread; process 0 adds the other files and
    publishes the checkpoint (see `aiopersist.integrations._fsdp`)."""
    plugin = check_plugin(accelerator.state.fsdp_plugin, "aiopersist's save_state")
    # As save_state: under FSDP no weights.
    hooked = _run_save_hooks(accelerator, [], target, keep=accelerator.process_index == 0)
    states = fsdp_states(accelerator._models, accelerator._optimizers, plugin)
    extra: dict[str, bytes | TorchSave | SafetensorsSave] = {**hooked, **_state_files(accelerator)}
    saver = _savers.get(checkpointer)
    if saver is None:
        coord = coordinator()
        assert coord is not None
        saver = _savers[checkpointer] = ShardedSaver(
            background_group(coord), backend=checkpointer._backend_name
        )
    return saver.save(target, states, extra if accelerator.process_index == 0 else None, overwrite=overwrite)


def _drain_fsdp(checkpointer: Checkpointer) -> None:
    saver = _savers.get(checkpointer)
    if saver is not None:
        saver.drain()


async def _as_handle(save: ShardedSave) -> SaveHandle:
    """An FSDP save as the `SaveHandle` the rest of the API hands out."""
    staged = asyncio.ensure_future(asyncio.to_thread(save.wait_staged))
    done: asyncio.Future[SaveInfo | None] = asyncio.wrap_future(cast(Any, save.future))
    return SaveHandle(save.path, staged, done)


@dataclasses.dataclass
class _Prepared:
    """What a save writes, prepared as ``save_state`` prepares it (`_prepare`)."""

    target: str
    replace: bool
    sharded: ShardedSave | None = None
    """Under FSDP: the sharded save, already started."""
    model_state: object = None
    extra: dict[str, bytes | TorchSave | SafetensorsSave] = dataclasses.field(default_factory=dict)
    group: Any = None
    writes: bool = True
    """Whether this process writes a directory (`_directories`); under FSDP every process
    takes part in the sharded save."""


def _prepare(
    accelerator: Any, checkpointer: Checkpointer, output_dir: Any, overwrite: bool, safe_serialization: bool
) -> _Prepared:
    """Where the checkpoint goes, the hooks run, the states taken and pickled (under FSDP
    the sharded save started): everything of a save that runs Accelerate's and the user's
    code, and the collectives (a barrier, the RNG states' gather). The asynchronous
    `save_state` runs it in a worker thread, off the event loop."""
    error: Exception | None = None
    try:
        target, replace = _target(accelerator, output_dir, overwrite)
    except Exception as exc:  # this process's directory: it may fail here alone
        error = exc
    if accelerator.num_processes > 1:
        # Every process hears of a failure here (one whose output_dir is taken) rather than
        # wait for the failed one at the next collective, as the stock save_state would.
        coord = coordinator()
        assert coord is not None
        # Also the barrier that save_state makes with automatic naming once the directory
        # is known free: every process has checked its own when this returns. (The
        # training's own barrier there, accelerator.wait_for_everyone(), waited for a
        # stopped process until the process group's timeout, 30 minutes by default.)
        coord.check_all(error, "save_state")
    elif error is not None:
        raise error
    if _is_fsdp(accelerator):
        return _Prepared(target, replace, sharded=_save_fsdp(accelerator, checkpointer, target, replace))
    model_state, extra, group, writes = _plan(
        accelerator, target, safe_serialization, checkpointer._max_shard
    )
    return _Prepared(target, replace, model_state=model_state, extra=extra, group=group, writes=writes)


async def save_state(
    accelerator: Any,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    checkpointer: Checkpointer,
    overwrite: bool = False,
    safe_serialization: bool = True,
) -> SaveHandle:
    """Start an asynchronous ``accelerator.save_state(output_dir)``; see the module
    docstring. ``checkpointer`` does the saving (keep one for the whole run).
    ``safe_serialization=False`` writes the weights as ``save_state`` then does, with
    ``torch.save`` into ``pytorch_model.bin`` (``pytorch_model_<i>.bin`` for more models).

    The event loop's thread only orchestrates: the hooks, the state dicts, their pickling
    and the collectives run in a worker thread (on the caller's CUDA device and stream)."""
    await asyncio.to_thread(_work_outside_checkpoints, accelerator)
    if _rotates(accelerator):
        await checkpointer.wait()  # the checkpoints in flight count, and are complete, before any goes
        await asyncio.to_thread(_drain_fsdp, checkpointer)
        await asyncio.to_thread(_delete_outdated, accelerator)  # the scan and deletions off the loop
    p = await off_loop_as_caller(
        _prepare, accelerator, checkpointer, output_dir, overwrite, safe_serialization
    )
    if p.sharded is not None:
        handle = await _as_handle(p.sharded)
    elif not p.writes:
        handle = _done(p.target)
    else:
        handle = await checkpointer.save(
            p.model_state, p.target, overwrite=p.replace, extra_files=p.extra, group=p.group
        )
    accelerator.project_configuration.iteration += 1  # as save_state, on every process
    return handle


def save_state_blocking(
    accelerator: Any,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    checkpointer: BlockingCheckpointer,
    overwrite: bool = False,
    safe_serialization: bool = True,
) -> BlockingSaveHandle:
    """`save_state` for synchronous training loops, with a `BlockingCheckpointer`:
    ``handle.wait_staged()`` before the next optimizer step, ``handle.wait()`` for
    durability."""
    _work_outside_checkpoints(accelerator)
    if _rotates(accelerator):
        checkpointer.wait()
        _drain_fsdp(checkpointer.checkpointer)
        _delete_outdated(accelerator)
    p = _prepare(accelerator, checkpointer.checkpointer, output_dir, overwrite, safe_serialization)
    portal = checkpointer._portal
    if p.sharded is not None:
        handle = BlockingSaveHandle(portal, portal.call(_as_handle, p.sharded))
    elif not p.writes:
        handle = BlockingSaveHandle(portal, portal.call(_done_async, p.target))
    else:
        handle = checkpointer.save(
            p.model_state, p.target, overwrite=p.replace, extra_files=p.extra, group=p.group
        )
    accelerator.project_configuration.iteration += 1  # as save_state, on every process
    return handle


def load_state(
    accelerator: Any,
    input_dir: str | os.PathLike[str] | None = None,
    *,
    backend: str = "auto",
    **kwargs: Any,
) -> None:
    """``accelerator.load_state(input_dir, **kwargs)``, once the checkpoint is checked
    against its manifest (every file's size and checksum, as ``aiopersist verify``), before
    Accelerate loads anything from it (under FSDP its model and optimizer load first of
    all, before any hook could look). Accelerate alone loads a damaged checkpoint without
    a word: flipped weights, a lost RNG state.

    A checkpoint named by ``input_dir`` that fails raises `CheckpointCorruptError`. With
    ``input_dir=None`` and ``automatic_checkpoint_naming``, the newest checkpoint of
    ``<project_dir>/checkpoints`` that checks out is loaded (a warning names those passed
    over and why; none: `CheckpointCorruptError` listing each). A checkpoint without a
    manifest (``save_state``'s own) is loaded unchecked, as Accelerate would. Every process
    calls it; the first of each node checks, and all load the same checkpoint. The check
    reads the checkpoint once more."""
    distributed = accelerator.num_processes > 1
    if input_dir is not None:
        path = os.path.expanduser(os.fspath(input_dir))
        problem = checkpoint_problem(path, backend, distributed)
        if problem is not None:
            raise CheckpointCorruptError(f"{path}: {problem}; nothing was loaded from it")
        accelerator.load_state(input_dir, **kwargs)
        return
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        accelerator.load_state(None, **kwargs)  # Accelerate's own error
        return
    base = os.path.join(accelerator.project_dir, "checkpoints")
    passed_over: list[str] = []
    for path in agreed_checkpoints(_newest_first(base), distributed):
        problem = checkpoint_problem(path, backend, distributed)
        if problem is None:
            if passed_over:
                log.warning(
                    "aiopersist: load_state: loading %s, the newest checkpoint that checks out; "
                    "passed over: %s",
                    path,
                    "; ".join(passed_over),
                )
            accelerator.load_state(path, **kwargs)
            return
        passed_over.append(f"{os.path.basename(path)} ({problem})")
    if not passed_over:
        accelerator.load_state(None, **kwargs)  # none to check: Accelerate's own choice, or error
        return
    raise CheckpointCorruptError(f"load_state: no checkpoint in {base} checks out: {'; '.join(passed_over)}")


def _newest_first(base: str) -> list[str]:
    """The checkpoints ``load_state()`` chooses among in ``base`` (automatic naming), its
    choice first: the entries numbered in their names, by that number; aiopersist's own
    work in progress and what is not a directory left out."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(base, name)
        ours = any(m in name for m in LEFTOVER_MARKERS)
        if ours or not re.search(r"[0-9]", name) or not os.path.isdir(path):
            continue
        found.append((_iteration_of(path), path))
    # load_state() sorts by number (stably) and takes the last: its choice first.
    return [path for _, path in reversed(sorted(found, key=lambda f: f[0]))]


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
