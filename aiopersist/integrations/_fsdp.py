"""FSDP checkpoints of the Hugging Face Trainer and Accelerate, in their own layout,
written asynchronously through aiopersist.

Stock FSDP saving with ``SHARDED_STATE_DICT`` writes into the checkpoint directory one
``torch.distributed.checkpoint`` (DCP) directory per model, ``pytorch_model_fsdp_<i>/``
(the model's state dict under ``"model"``), and one per optimizer, ``optimizer_<i>/``
(under ``"optimizer"``), every rank writing its shards, beside the framework's own files
(the scheduler, the RNG states, ``trainer_state.json``...). `ShardedSaver` writes the same
directory, so that the stock Trainer's ``resume_from_checkpoint`` and
``accelerator.load_state`` read it unchanged, but:

1. ``save`` (every rank, on the training thread) takes the state dicts and the files as
   they are at that moment and returns at once, with one fence per DCP directory armed;
2. a background thread per rank (one save at a time) does the rest over the saver's own
   gloo group (training's collectives go on meanwhile on theirs): process 0 claims the
   temporary directory ``.<name>.aiopersist-tmp-<token>`` beside the checkpoint and tells
   the others; each DCP directory is written in it, in place, by ``dcp.save`` through
   `AiopersistWriter` (``publish=False``: every byte checksummed, fsynced);
3. process 0 writes the framework's files and aiopersist's manifest (layout ``fsdp``,
   listing every file of the checkpoint, the DCP directories' included, with their
   checksums), then publishes the whole directory with one atomic rename; every rank
   learns the outcome.

The tensors are read where they live (no copy): `ShardedSave.wait_staged` returns once
every byte of this rank's shards has left them, which the next optimizer step must wait
for. The optimizer's DCP directory is written after the model's, so its fence comes later.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from .. import _knobs
from .._backends import open_backend, resolve_backend_name
from .._commit import make_temp, publish, remove_path
from .._direct import probe_directory
from .._dist import GroupRef
from .._exceptions import RankFailedError
from .._locate import absolute_path, read_small
from .._manifest import (
    MAX_MANIFEST_BYTES,
    EntryRecord,
    FileRecord,
    Manifest,
    dump_manifest,
    new_hasher,
    parse_manifest,
    safe_file_name,
)
from .._names import MANIFEST_NAME
from .._save import SafetensorsSave, SaveInfo, TorchSave, check_file_names, write_extra_files, write_file
from .._staging import StagingPool
from .._workers import DaemonThreadPool
from ._common import torch_bytes, with_buffers_copied
from .dcp import AiopersistWriter, _dcp_manifest, _Fence, _new_fence, _on_engine

Files = Mapping[str, "bytes | TorchSave | SafetensorsSave"]


class ShardedSave:
    """One save in flight (`ShardedSaver.save`): the handle every rank gets."""

    def __init__(self, path: str, fences: list[_Fence], future: concurrent.futures.Future[SaveInfo]) -> None:
        self.path = path
        self._fences = fences
        self.future = future
        """Resolves to the `SaveInfo` of this rank once the checkpoint is published."""

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until this rank's tensors may change again (every byte of its shards has
        left them); raises the save's error if it failed before that."""
        for fence in self._fences:
            if not fence.wait(timeout):
                raise TimeoutError(f"{self.path}: the save did not stage within {timeout} s")
            if fence.error is not None:
                raise fence.error

    def wait(self) -> SaveInfo:
        """Block until the checkpoint is published and durable (on every rank: the outcome
        is process 0's); raises the save's error."""
        return self.future.result()

    @property
    def staged(self) -> bool:
        return all(f.wait(0) for f in self._fences)

    @property
    def done(self) -> bool:
        return self.future.done()


class ShardedSaver:
    """Saves FSDP checkpoints in the Trainer's and Accelerate's layout (see the module
    docstring). Every rank makes one, with the same ``group`` (a gloo group of every
    rank, made for the saver: its collectives run in a background thread while training
    runs its own)."""

    def __init__(self, group: Any, *, backend: str = "auto") -> None:
        self._group = GroupRef(group)  # not kept alive past destroy_process_group()
        self.backend = resolve_backend_name(backend)
        self._last: concurrent.futures.Future[SaveInfo] | None = None
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._source = dist.get_global_rank(group, 0)
        self._thread = DaemonThreadPool(1, thread_name_prefix="aiopersist-fsdp")

    def save(
        self,
        path: str | os.PathLike[str],
        states: Mapping[str, dict[str, Any]],
        files: Files | None = None,
        *,
        overwrite: bool = False,
    ) -> ShardedSave:
        """Start saving ``states`` (DCP directory name → the state dict ``dcp.save`` takes,
        in the order written) and, on process 0, ``files`` (name → ``bytes`` or
        `TorchSave`) as the checkpoint ``path``. Every rank calls it, with the same
        directory names, in the same order as its other saves. An existing checkpoint is
        refused (`CheckpointExistsError`, from every rank's handle) unless ``overwrite``,
        which replaces it atomically once the new one is durable."""
        final = absolute_path(path)
        names = list(states)
        for name in names:
            safe_file_name(name, "the checkpoint")
        if files and self.rank != 0:
            raise ValueError("ShardedSaver.save: only process 0 writes the checkpoint's files")
        check_file_names(files or {}, (MANIFEST_NAME,), "ShardedSaver.save: files")
        for name in files or {}:
            if name.split("/")[0] in states:
                raise ValueError(f"ShardedSaver.save: the file {name!r} would be in a DCP directory's place")
        # The files are written last, after the shards' fences have let training go on: a
        # `TorchSave` is pickled now, so that it holds what it held at the save.
        taken = {n: torch_bytes(c.obj) if isinstance(c, TorchSave) else c for n, c in (files or {}).items()}
        fences = [_new_fence() for _ in names]
        future = self._thread.submit(self._run, final, dict(states), taken, fences, overwrite)
        self._last = future

        def settle(f: concurrent.futures.Future[SaveInfo]) -> None:
            error = None if f.cancelled() else f.exception()
            for fence in fences:
                fence.fail(error)  # a save that ended without staging ends the waits too

        future.add_done_callback(settle)
        return ShardedSave(final, fences, future)

    @property
    def group(self) -> Any:
        """The saver's group (`RuntimeError` once it has been destroyed)."""
        return self._group.get()

    def drain(self) -> None:
        """Wait until the last save started has ended (its outcome is its handle's)."""
        if self._last is not None:
            concurrent.futures.wait([self._last])

    def close(self) -> None:
        self._thread.shutdown(wait=False)

    # -- the background thread ------------------------------------------------------------

    def _run(
        self,
        final: str,
        states: dict[str, dict[str, Any]],
        files: Files,
        fences: list[_Fence],
        overwrite: bool,
    ) -> SaveInfo:
        start = time.monotonic()
        group = self.group  # raises here, not as a collective's failure, once destroyed
        tmp = self._claim(final, overwrite, group)
        written: list[FileRecord] = []
        try:
            for (name, state), fence in zip(states.items(), fences, strict=True):
                writer = AiopersistWriter(os.path.join(tmp, name), backend=self.backend, publish=False)
                writer.checkpoint_id = Path(final, name)  # as the stock save records it
                writer._fence = fence
                with self._collective(f"writing {name}/"):
                    dcp_save(state, storage_writer=writer, process_group=group)
                written += [dataclasses.replace(r, name=f"{name}/{r.name}") for r in writer.written]
            error: BaseException | None = None
            if self.rank == 0:
                try:
                    written += self._publish(tmp, final, list(states), files, overwrite)
                except BaseException as exc:
                    error = exc
            self._outcome(error, group)
        except BaseException:
            if self.rank == 0:
                remove_path(tmp)
            raise
        return SaveInfo(
            path=final,
            bytes_written=sum(r.nbytes for r in written),
            files=tuple(r.name for r in written),
            seconds=time.monotonic() - start,
            backend=self.backend,
        )

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """The errors of the save's collectives, as aiopersist's: DCP's
        ``CheckpointException`` (a ``BaseException``, which ``except Exception`` would let
        through) becomes this rank's own error where it failed itself, `RankFailedError`
        naming the rank where another failed; gloo's ``RuntimeError`` (a rank died, or did
        not take part within ``AIOPERSIST_DIST_TIMEOUT``) becomes `RankFailedError`."""
        try:
            yield
        except CheckpointException as exc:
            raise _rank_error(exc, self.rank) from None
        except RuntimeError as exc:
            raise RankFailedError(
                f"rank {self.rank}: {what} with the other ranks failed (a rank died or did not save "
                f"within {_knobs.dist_timeout():.0f} s): {exc}"
            ) from exc

    def _claim(self, final: str, overwrite: bool, group: Any) -> str:
        """Process 0 makes the temporary directory; every rank gets its path (or the error)."""
        message: list[Any] = [None]
        if self.rank == 0:
            try:
                message[0] = ("ok", make_temp(final, overwrite, uuid.uuid4().hex[:12]).tmp)
            except Exception as exc:
                message[0] = ("error", exc)
        try:
            with self._collective("claiming the temporary directory"):
                dist.broadcast_object_list(message, src=self._source, group=group)
        except BaseException:
            if self.rank == 0 and message[0] is not None and message[0][0] == "ok":  # never told
                remove_path(message[0][1])
            raise
        kind, value = message[0]
        if kind != "ok":
            raise value
        return str(value)

    def _outcome(self, error: BaseException | None, group: Any) -> None:
        """Every rank raises process 0's publishing error, or none."""
        message: list[Any] = [error]
        with self._collective("learning the outcome"):
            dist.broadcast_object_list(message, src=self._source, group=group)
        if message[0] is not None:
            raise message[0]

    def _publish(
        self, tmp: str, final: str, subdirectories: list[str], files: Files, overwrite: bool
    ) -> list[FileRecord]:
        """On process 0: the files and the manifest into ``tmp``, then ``tmp`` published."""
        backend, world_size = self.backend, self.world_size

        async def write() -> list[FileRecord]:
            dio = await asyncio.to_thread(probe_directory, tmp)
            pool = StagingPool()
            try:
                async with open_backend(backend) as be:
                    own = await write_extra_files(be, tmp, dio, pool, files)
                    manifest = await asyncio.to_thread(_manifest, tmp, subdirectories, own, world_size)
                    data = await asyncio.to_thread(dump_manifest, manifest)
                    own.append(await write_file(be, os.path.join(tmp, MANIFEST_NAME), dio, pool, [data]))
                    return own
            finally:
                pool.close()

        own = _on_engine(write).result()
        publish(tmp, final, overwrite)
        return own


def _rank_error(exc: CheckpointException, rank: int) -> Exception:
    """What this rank raises for DCP's ``CheckpointException``: its own error if it failed
    itself, else `RankFailedError` naming the first rank that did."""
    failures = exc.failures
    own = failures.get(rank)
    if own is not None and isinstance(own[0], Exception):
        return own[0]
    if not failures:
        return RankFailedError(f"the save failed: {exc}")
    first = min(failures)
    error = failures[first][0]
    more = f" (and on {len(failures) - 1} more ranks)" if len(failures) > 1 else ""
    return RankFailedError(f"the save failed on rank {first}: {type(error).__name__}: {error}{more}")


def _manifest(tmp: str, subdirectories: list[str], own: list[FileRecord], world_size: int) -> Manifest:
    """The checkpoint's manifest: ``own`` files, and every file of each DCP directory, by
    ``<directory>/<name>`` with its entries, its own manifest included (checked byte for
    byte: what the directory's reader trusts is covered too)."""
    records = {r.name: r for r in own}
    entries: dict[str, tuple[EntryRecord, ...]] = {}
    for sub in subdirectories:
        where = os.path.join(tmp, sub, MANIFEST_NAME)
        raw = read_small(where, MAX_MANIFEST_BYTES)
        inner = parse_manifest(raw, where)
        for name, rec in inner.files.items():
            records[f"{sub}/{name}"] = dataclasses.replace(rec, name=f"{sub}/{name}")
        for name, listed in inner.entries.items():
            entries[f"{sub}/{name}"] = listed
        hasher = new_hasher()
        hasher.update(raw)
        records[f"{sub}/{MANIFEST_NAME}"] = FileRecord(f"{sub}/{MANIFEST_NAME}", len(raw), hasher.hexdigest())
    return _dcp_manifest(records, entries, world_size, layout="fsdp")


def sharded_state_options(plugin: Any) -> Any:
    """The ``StateDictOptions`` Accelerate's FSDP2 saving takes from its plugin (sharded:
    ``full_state_dict=False``), so that the state dicts are the ones the stock save writes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(
        full_state_dict=False,
        cpu_offload=getattr(plugin.state_dict_config, "offload_to_cpu", False),
        broadcast_from_rank0=getattr(plugin.state_dict_config, "rank0_only", False),
    )


def fsdp_states(models: list[Any], optimizers: list[Any], plugin: Any) -> dict[str, Any]:
    """The DCP directories stock FSDP saving writes, as `ShardedSaver.save` takes them:
    ``pytorch_model_fsdp_<i>`` for the ``i``-th model, ``optimizer_<i>`` for the ``i``-th
    optimizer (whose parameters are the ``i``-th model's, as Accelerate pairs them)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = sharded_state_options(plugin)
    states: dict[str, Any] = {}
    for i, model in enumerate(models):
        # Buffers copied: the next step's forward changes them in place (BatchNorm's running
        # statistics) while the shards are written; the parameters wait for the fence.
        states[f"pytorch_model_fsdp_{i}"] = {
            "model": with_buffers_copied(model, get_model_state_dict(model, options=options))
        }
    for i, optimizer in enumerate(optimizers):
        states[f"optimizer_{i}"] = {
            "optimizer": get_optimizer_state_dict(models[i], optimizer, options=options)
        }
    return states


def check_plugin(plugin: Any, who: str) -> Any:
    """``plugin`` (Accelerate's FSDP plugin) if ``who`` writes what it asks for: FSDP2 and
    ``SHARDED_STATE_DICT``; `ValueError` saying what to use otherwise."""
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(f"{who} supports FSDP2 (fsdp_version=2); this run uses FSDP1")
    if "SHARDED_STATE_DICT" not in str(plugin.state_dict_type):
        raise ValueError(
            f"{who} under FSDP writes the sharded layout (state_dict_type='SHARDED_STATE_DICT'); this "
            f"run's state_dict_type is {plugin.state_dict_type}, which gathers the whole state to "
            "process 0 at every save"
        )
    return plugin
