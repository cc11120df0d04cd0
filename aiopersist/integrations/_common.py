"""What the integrations share: the small files they write the way their framework does,
the per-process states gathered for process 0 (which writes alone), the files a
framework's own writer produces, the crash-safe deletion of checkpoints, and the check of
a checkpoint before a framework resumes from it.

Nothing here imports a framework: each integration module imports its own.
"""

from __future__ import annotations

import copy
import io
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .._backends import to_thread_to_the_end
from .._blocking import run_loop
from .._commit import in_work_place, remove_path
from .._dist import coordinator
from .._exceptions import AiopersistError, LinkedFileError, NewerFormatError
from .._load import verify
from .._manager import delete_step
from .._manifest import MAX_MEMBER_DEPTH
from .._names import MANIFEST_NAME, TMP_MARKER, work_place

log = logging.getLogger("aiopersist")

T = TypeVar("T")


async def off_loop_as_caller(fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)`` in a worker thread, awaited to its end, on the caller's current CUDA
    device and stream: for the framework's own code that a save runs (state dicts, save
    hooks, pickling, collectives) that must not hold the event loop's thread, and whose
    GPU work must be ordered as if the caller had run it."""
    stream = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        stream = torch.cuda.current_stream()

    def run() -> T:
        if stream is None:
            return fn(*args)
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            return fn(*args)

    return await to_thread_to_the_end(run)


def torch_bytes(obj: object) -> bytes:
    """``obj`` as ``torch.save`` writes it to a file (for the small pickled files that
    Trainer and Accelerate checkpoints hold: scheduler, scaler, RNG states, arguments)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def gather_objects(obj: object) -> list[Any]:
    """Every process's ``obj``, in rank order, on every process: gathered over the
    checkpoint's own gloo mesh, whatever backend the training uses. One process: ``[obj]``."""
    coord = coordinator()
    if coord is None or coord.world_size == 1:
        return [obj]
    return coord.all_gather(obj)


def files_written_by(write: Callable[[str], None], beside: str, *, keep: bool = True) -> dict[str, bytes]:
    """Run ``write(directory)`` (a ``save_pretrained``, a save hook) on a fresh staging
    directory beside the checkpoint ``beside`` (or where its work in progress goes,
    `work_elsewhere`), hidden and marked temporary so that an interrupted run's is
    cleaned up like any other leftover. Returns the files it wrote there, by their paths
    in it (``additional_chat_templates/tool_use.jinja``), to be written into the
    checkpoint itself; the staging directory is removed. With ``keep=False`` the writer
    runs (it may have effects the framework relies on) and nothing is read.

    The checkpoint takes files, in subdirectories up to `MAX_MEMBER_DEPTH` deep: anything
    it cannot hold (a link, a FIFO, an empty directory, a file deeper than that) raises
    `ValueError` naming it, rather than being dropped."""
    parent, name = os.path.split(os.path.abspath(beside))
    place = work_place(parent)
    prefix = f".{name}{TMP_MARKER}files-"
    staging = in_work_place(os.path.join(place, prefix), lambda: tempfile.mkdtemp(prefix=prefix, dir=place))
    try:
        write(staging)
        if not keep:
            return {}
        files: dict[str, bytes] = {}
        _read_tree(staging, "", files, beside)
        return files
    finally:
        remove_path(staging)


def _read_tree(root: str, prefix: str, files: dict[str, bytes], beside: str) -> None:
    """Every file under ``root/prefix`` into ``files``, by its path under ``root``."""
    if prefix.count("/") > MAX_MEMBER_DEPTH:
        raise ValueError(
            f"{prefix!r} was written for the checkpoint {beside}: a checkpoint's files lie at most "
            f"{MAX_MEMBER_DEPTH} subdirectories deep"
        )
    entries = sorted(os.scandir(os.path.join(root, prefix)), key=lambda e: e.name)
    if prefix and not entries:
        raise ValueError(
            f"{prefix!r} was written for the checkpoint {beside} as an empty directory: "
            "aiopersist checkpoints list files, and would lose it"
        )
    for entry in entries:
        name = prefix + entry.name
        if entry.is_dir(follow_symlinks=False):
            _read_tree(root, name + "/", files, beside)
        elif entry.is_file(follow_symlinks=False):
            with open(entry.path, "rb") as f:
                files[name] = f.read()
        else:
            raise ValueError(
                f"{name!r} was written for the checkpoint {beside} but is not a plain file or a "
                "directory: aiopersist checkpoints take files and the directories that hold them"
            )


def delete_checkpoints(paths: Sequence[str], done: Callable[[str], None] | None = None) -> list[str]:
    """Delete checkpoints crash-safely (`delete_step`: renamed to a trash name, then
    removed), in the calling thread (never an event loop's); one that cannot be is logged
    and removed as far as it can be. ``done(path)`` is called after each one. Returns the
    paths that could not be deleted cleanly."""
    failed = []
    for path in paths:
        try:
            delete_step(path)
        except OSError as exc:
            log.warning("aiopersist: could not delete %s: %s", path, exc)
            remove_path(path)
            failed.append(path)
        if done is not None:
            done(path)
    return failed


def _plain(t: object) -> bool:
    """A tensor of this process's own (not a DTensor or another subclass's view)."""
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter)


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def with_buffers_copied(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (the model's state dict) with a copy of every tensor that is one of the
    model's buffers. In fence mode the weights are read from the live tensors until the
    next optimizer step, and the optimizer changes only parameters; but the next step's
    forward changes buffers in place (BatchNorm's running statistics and
    ``num_batches_tracked``, a counter), which the stock save wrote as they were at the
    save. Buffers are small beside the parameters; the copy is made on their device.

    The copy is as the stock save sees the state: of the same mapping type, with its
    attributes (an ``OrderedDict``'s ``_metadata``, the modules' versions, which
    ``torch.save`` keeps and ``load_state_dict`` reads), and with the tensors that shared
    memory still sharing it (each memory a buffer lies in is copied once, every entry in it
    made a view of the copy), so that the stock rules on shared tensors
    (``clean_state_dict_for_safetensors``, ``save_pretrained``'s) drop the same names."""
    live = {_storage_key(b) for b in model.buffers() if _plain(b) and b.numel() and b.device.type != "meta"}
    if not live:
        return state
    copies: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
    out = copy.copy(state)
    for name, value in state.items():
        if not (_plain(value) and value.numel()):
            continue
        key = _storage_key(value)
        if key not in live:
            continue
        if key not in copies:
            copies[key] = value.untyped_storage().clone()
        view = torch.empty(0, dtype=value.dtype, device=value.device)
        out[name] = view.set_(copies[key], value.storage_offset(), value.size(), value.stride())
    return out


def checkpoint_problem(path: str, backend: str, distributed: bool) -> str | None:
    """Why checkpoint ``path`` cannot be trusted to resume from, or ``None``: it checks out
    against its manifest (`aiopersist.verify`: every file's size and checksum; and the
    ``.metadata`` of its DCP directories read as `AiopersistReader` reads them), or it has
    no manifest (a stock save's: nothing to check it against), or it cannot be checked but
    its framework can load it (a newer format's manifest, a file linked from elsewhere:
    said in the log).

    ``distributed``: every process calls this, in the same order; the first process of
    each node checks (a node may read the checkpoint from a disk of its own) and every
    process gets every verdict, so that all take the same decision. The nodes are told
    apart by the processes themselves (`node_identity`), not by ``LOCAL_RANK``: a launcher
    that does not set it (``srun``, ``mpirun``) left every node but process 0's
    unchecked."""
    coord = coordinator() if distributed else None
    if coord is None:
        return _verified(path, backend)
    nodes = coord.all_gather(node_identity(), "finding the first process of each node")
    mine = None
    error: Exception | None = None
    if nodes.index(nodes[coord.rank]) == coord.rank:
        try:
            mine = _verified(path, backend)
        except Exception as exc:  # told to the others (who would wait for it), then raised
            error = exc
            mine = f"could not be checked: {type(exc).__name__}: {exc}"
    found = coord.all_gather(mine, "checking the checkpoint to resume from")
    if error is not None:
        raise error
    problems = [f"process {rank}: {problem}" for rank, problem in enumerate(found) if problem is not None]
    return "; ".join(problems) or None


def node_identity() -> tuple[str, str]:
    """The machine this process runs on, as its disks go: its host name and its kernel's
    boot id (containers of one host share the boot id and differ by name; hosts given one
    name differ by boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def agreed_checkpoints(paths: list[str], distributed: bool) -> list[str]:
    """The checkpoints to try, newest first, the same on every process: process 0's list
    (a process that lists its own disk may see others), so that every process checks the
    same ones in the same order (`checkpoint_problem` gathers once per checkpoint)."""
    coord = coordinator() if distributed else None
    if coord is None:
        return paths
    return list(coord.all_gather(paths, "listing the checkpoints to resume from")[0])


def _verified(path: str, backend: str) -> str | None:
    """`checkpoint_problem` on this process. The check runs on an event loop of its own, in
    a thread: the caller may be on a running loop (a notebook)."""
    if not os.path.lexists(os.path.join(path, MANIFEST_NAME)):
        return None
    out: list[Any] = []

    def check() -> None:
        try:
            report = run_loop(verify(path, backend=backend), "aiopersist-verify")
            # The sharded state of an FSDP checkpoint is loaded by DCP's own reader, which
            # unpickles its .metadata whole: forged with its checksums, it is refused here.
            from .dcp import check_metadata_of

            check_metadata_of(path)
            out.append(report)
        except BaseException as exc:  # handed to the caller
            out.append(exc)

    thread = threading.Thread(target=check, name="aiopersist-verify", daemon=True)
    thread.start()
    thread.join()
    (result,) = out
    if isinstance(result, (LinkedFileError, NewerFormatError)):
        log.warning("aiopersist: %s is not checked before resuming from it: %s", path, result)
        return None
    if isinstance(result, AiopersistError):
        return str(result)
    if isinstance(result, BaseException):
        raise result
    return None
