"""Atomic publication of a checkpoint directory.

A checkpoint is written into a temporary directory beside its final name, every file is
fsynced, then the directory, then it is renamed into place and the parent is fsynced.
A crash at any point leaves either nothing or a complete checkpoint under the final name;
leftover temporary directories carry `TMP_MARKER` in their name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ._backends import wait_uncancellable
from ._exceptions import CheckpointExistsError, from_os_error

TMP_MARKER = ".aiopersist-tmp-"
OLD_MARKER = ".aiopersist-old-"


def fsync_directory(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise from_os_error(exc, "open", path) from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        raise from_os_error(exc, "fsync", path) from exc
    finally:
        os.close(fd)


def _publish(tmp: str, final: str, overwrite: bool) -> None:
    parent = os.path.dirname(final)
    fsync_directory(tmp)
    old: str | None = None
    if os.path.lexists(final):
        if not overwrite:
            raise CheckpointExistsError(f"{final} already exists (pass overwrite=True to replace it)")
        # The old checkpoint stays valid until the new one is durable; it is moved aside
        # only now, and deleted only after the new one is in place.
        old = os.path.join(parent, f".{os.path.basename(final)}{OLD_MARKER}{uuid.uuid4().hex[:12]}")
        try:
            os.rename(final, old)
        except OSError as exc:
            raise from_os_error(exc, "rename", final) from exc
    try:
        os.rename(tmp, final)
    except OSError as exc:
        if old is not None:
            os.rename(old, final)
        raise from_os_error(exc, "rename", tmp) from exc
    fsync_directory(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class PendingDirectory:
    """A checkpoint being written: files go into ``tmp``; ``final`` is where it will appear."""

    tmp: str
    final: str


def _make_temp(final: str | os.PathLike[str], overwrite: bool) -> PendingDirectory:
    target = os.path.abspath(os.fspath(final))
    parent = os.path.dirname(target)
    if os.path.lexists(target) and not overwrite:
        raise CheckpointExistsError(f"{target} already exists (pass overwrite=True to replace it)")
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(target)}{TMP_MARKER}{uuid.uuid4().hex[:12]}")
        os.mkdir(tmp)
    except OSError as exc:
        raise from_os_error(exc, "mkdir", parent) from exc
    return PendingDirectory(tmp, target)


@contextlib.asynccontextmanager
async def atomic_directory(
    final: str | os.PathLike[str], *, overwrite: bool = False
) -> AsyncIterator[PendingDirectory]:
    """Yield a fresh temporary directory; on success publish it as ``final`` atomically.

    On error or cancellation the temporary directory is removed and nothing under
    ``final`` changes. ``overwrite=False`` and an existing ``final`` raise
    [`CheckpointExistsError`][aiopersist.CheckpointExistsError] before anything is written.
    """
    pending = await asyncio.to_thread(_make_temp, final, overwrite)
    try:
        yield pending
        # Publication runs to its end even if we are cancelled meanwhile: the worker
        # thread would go on renaming while the cleanup below deleted its files.
        await wait_uncancellable(
            asyncio.ensure_future(asyncio.to_thread(_publish, pending.tmp, pending.final, overwrite))
        )
    except BaseException:
        shutil.rmtree(pending.tmp, ignore_errors=True)
        raise
