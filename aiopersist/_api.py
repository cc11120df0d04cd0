"""``save`` and ``load``: the one-shot entry points.

This first version stores a flat mapping of names to CPU tensors as one safetensors file
(``model.safetensors``) in a checkpoint directory, written through the engine with direct
I/O and published atomically; ``load`` reads such a directory or any safetensors file.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ._backends import open_backend
from ._commit import atomic_directory
from ._direct import DirectIOInfo, empty_for_direct_read, probe_directory, probe_file_for_read
from ._exceptions import CheckpointCorruptError, CheckpointNotFoundError, UnsupportedStateError
from ._format import header_length, layout_file, parse_header, supported_dtype
from ._staging import StagingPool
from ._stream import FileWriter, read_segments

MODEL_FILE = "model.safetensors"


@dataclass(frozen=True)
class SaveInfo:
    """What a save did."""

    path: str
    """Absolute path of the published checkpoint directory."""
    bytes_written: int
    """Bytes this process wrote (headers included, alignment padding excluded)."""
    files: tuple[str, ...]
    """The files written, relative to `path`."""
    seconds: float
    """Wall time of the whole save, publication included."""
    backend: str
    """The I/O backend that did the work (`io_uring` or `threads`)."""

    @property
    def gib_per_second(self) -> float:
        """`bytes_written` over `seconds`, in GiB/s."""
        return self.bytes_written / (1 << 30) / self.seconds if self.seconds > 0 else float("inf")


def _check_state(obj: object) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(obj, Mapping):
        raise UnsupportedStateError(
            f"state: expected a mapping of names to tensors, got {type(obj).__name__}"
        )
    items: list[tuple[str, torch.Tensor]] = []
    for key, value in obj.items():
        where = f"state[{key!r}]"
        if not isinstance(key, str):
            raise UnsupportedStateError(f"{where}: keys must be str, got {type(key).__name__}")
        if not isinstance(value, torch.Tensor):
            raise UnsupportedStateError(f"{where}: expected a tensor, got {type(value).__name__}")
        if value.device.type != "cpu":
            raise UnsupportedStateError(
                f"{where}: tensor is on {value.device}; only CPU tensors are supported yet"
            )
        if value.layout != torch.strided:
            raise UnsupportedStateError(f"{where}: {value.layout} tensors are not supported")
        if not supported_dtype(value.dtype):
            raise UnsupportedStateError(f"{where}: dtype {value.dtype} has no safetensors equivalent")
        items.append((key, value))
    return items


async def save(
    obj: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    backend: str = "auto",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> SaveInfo:
    """Save a mapping of names to CPU tensors as a checkpoint directory at ``path``.

    Durable when it returns: the file and the directory are fsynced and the directory is
    renamed into place. An existing ``path`` raises
    [`CheckpointExistsError`][aiopersist.CheckpointExistsError] unless ``overwrite=True``, which replaces
    it only once the new checkpoint is durable.
    """
    items = _check_state(obj)
    start = time.perf_counter()
    layout = layout_file([(k, t.dtype, t.shape) for k, t in items], metadata)
    pool = StagingPool()
    try:
        async with open_backend(backend) as be, atomic_directory(path, overwrite=overwrite) as pending:
            dio = await asyncio.to_thread(probe_directory, pending.tmp)
            async with FileWriter(be, os.path.join(pending.tmp, MODEL_FILE), dio, pool) as writer:
                await writer.write(layout.header)
                for _, tensor in items:
                    await writer.write(tensor)
            written = writer.bytes_written
            backend_name = be.name
    finally:
        pool.close()
    return SaveInfo(pending.final, written, (MODEL_FILE,), time.perf_counter() - start, backend_name)


def _locate(path: str | os.PathLike[str]) -> tuple[str, DirectIOInfo, int]:
    """The safetensors file to read, how to read it, and its size."""
    name = _resolve_file(os.path.abspath(os.fspath(path)))
    return name, probe_file_for_read(name), os.stat(name).st_size


def _resolve_file(path: str) -> str:
    if os.path.isdir(path):
        candidate = os.path.join(path, MODEL_FILE)
        if not os.path.isfile(candidate):
            raise CheckpointNotFoundError(f"{path}: no {MODEL_FILE} in this directory")
        return candidate
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such checkpoint")
    return path


async def load(path: str | os.PathLike[str], *, backend: str = "auto") -> dict[str, torch.Tensor]:
    """Load a checkpoint saved by `save` (or any safetensors file) as a dict of CPU tensors."""
    name, dio, size = await asyncio.to_thread(_locate, path)
    pool = StagingPool()
    try:
        async with open_backend(backend) as be:
            fd = await be.open(name, os.O_RDONLY)
            try:
                prefix = bytearray(8)
                got = await be.read(fd, prefix, 0)
                n = header_length(bytes(prefix[:got]), size, name)
                raw = bytearray(n)
                if await be.read(fd, raw, 8) != n:
                    raise CheckpointCorruptError(f"{name}: header is truncated")
            finally:
                await be.close(fd)
            layout = parse_header(bytes(raw), size, name)
            out: dict[str, torch.Tensor] = {}
            segments = []
            for e in layout.entries:
                offset = layout.data_offset + e.begin
                # Large tensors get memory the kernel can read into directly (no staging copy).
                if dio.direct and e.nbytes >= pool.buffer_bytes:
                    t = empty_for_direct_read(e.shape, e.dtype, offset)
                else:
                    t = torch.empty(e.shape, dtype=e.dtype)
                out[e.name] = t
                segments.append((offset, t.reshape(-1).view(torch.uint8)))
            await read_segments(be, name, dio, pool, segments)
    finally:
        pool.close()
    return out
