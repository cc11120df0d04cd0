"""The exceptions aiopersist raises.

Every error has one root, so ``except aiopersist.AiopersistError`` catches them all::

    AiopersistError
    ├── BackendUnavailableError        an I/O backend cannot be used here (and why)
    ├── CheckpointIOError (OSError)    an I/O call failed; keeps errno and the file name
    │   └── DiskFullError              ENOSPC / EDQUOT: the file system is full
    ├── CheckpointNotFoundError (FileNotFoundError)
    ├── CheckpointExistsError (FileExistsError)
    ├── CheckpointCorruptError (ValueError)   what is on disk is not a valid checkpoint
    ├── UnsupportedStateError (TypeError)     the object to save holds something unstorable
    ├── StateMismatchError (KeyError)         load(into=...): the saved state does not fit
    ├── RankFailedError                       a distributed save failed on another rank
    ├── ClosedError (RuntimeError)            the backend, Checkpointer or manager is closed
    ├── NotEnoughMemoryError (MemoryError)    a load needs more host memory than is available
    └── SnapshotBudgetError (MemoryError)     Checkpointer(mode="snapshot"): over the budget
                                              (defined in _checkpointer)

Lower-level errors (``OSError`` from the system, errno codes returned by io_uring) are
mapped to these in one place: `io_error` and `from_os_error` build the typed error, and
every public entry point runs under `maps_os_errors`, so an ``OSError`` from anywhere
below comes out as a `CheckpointIOError` (errno kept), raised ``from`` the original.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import functools
import inspect
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import ParamSpec, TypeVar, cast


class AiopersistError(Exception):
    """Root of every exception raised by aiopersist."""


class BackendUnavailableError(AiopersistError):
    """The requested I/O backend cannot run on this machine; the message says why."""


class CheckpointIOError(AiopersistError, OSError):
    """An I/O operation failed.

    It is an ``OSError``: ``errno``, ``strerror`` and ``filename`` are set as the system
    reported them, and ``call`` names the operation that failed (for example
    ``"io_uring write"`` or ``"open"``).
    """

    call: str | None

    def __init__(
        self, errno: int, strerror: str, filename: str | None = None, *, call: str | None = None
    ) -> None:
        if filename is None:
            super().__init__(errno, strerror)
        else:
            super().__init__(errno, strerror, filename)
        self.call = call

    def __str__(self) -> str:
        base = super().__str__()
        return f"{self.call}: {base}" if self.call else base

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_io_error, (type(self), self.errno, self.strerror, self.filename, self.call))


class DiskFullError(CheckpointIOError):
    """The file system ran out of space (``ENOSPC``) or quota (``EDQUOT``)."""


class CheckpointNotFoundError(AiopersistError, FileNotFoundError):
    """There is no checkpoint at the given path."""


class CheckpointExistsError(AiopersistError, FileExistsError):
    """A checkpoint already exists at the target path and ``overwrite`` was not given."""


class CheckpointCorruptError(AiopersistError, ValueError):
    """What is on disk is not a valid checkpoint: the message names the file and the fault."""


class NewerFormatError(CheckpointCorruptError):
    """The checkpoint was written in a format version newer than this aiopersist reads:
    not damaged, only unreadable here (upgrade aiopersist). Retention, ``gc`` and the
    Trainer's rotation never delete such a checkpoint as broken."""


class LinkedFileError(CheckpointCorruptError):
    """A file or directory of the checkpoint is a symbolic link, or two of its files are
    one file under two names (hard links): refused, since a load never reads through a
    link, but not proof that the checkpoint is broken (its data may be intact where the
    link leads: a DVC or git-annex checkout, a deduplicating copy). Retention, ``gc`` and
    the Trainer's rotation never delete such a checkpoint as broken. A manager's lock file
    that is a symbolic link is refused with it too (never written through)."""


class UnsupportedStateError(AiopersistError, TypeError):
    """The object to save contains something aiopersist cannot store; names its path."""


class StateMismatchError(AiopersistError, KeyError):
    """``load(into=...)`` with ``strict``: keys missing or unexpected, or shapes that differ.

    ``missing`` and ``unexpected`` list the paths; nothing was loaded into the target.
    """

    def __init__(self, message: str, missing: list[str] | None = None, unexpected: list[str] | None = None):
        super().__init__(message)
        self.message = message
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])

    def __str__(self) -> str:  # KeyError would print the message quoted
        return self.message


class RankFailedError(AiopersistError):
    """A distributed save failed on another rank (or a rank stopped answering): this rank
    raises it so that the save fails everywhere and nothing is committed. The message
    names the rank and its error."""


class ClosedError(AiopersistError, RuntimeError):
    """The I/O backend, `Checkpointer` or `CheckpointManager` was closed: a request made
    after ``aclose``, or one that was still waiting for a free slot when it came, fails
    with this (nothing of it was submitted)."""


class NotEnoughMemoryError(AiopersistError, MemoryError):
    """A load would allocate more host memory than this process has available (free
    memory and swap, within its memory cgroup): refused before anything is allocated or
    read. ``needed`` and ``available`` are the bytes; the message names the checkpoint."""

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available

    def __reduce__(self) -> tuple[type[NotEnoughMemoryError], tuple[str, int, int]]:
        return type(self), (str(self), self.needed, self.available)


_DISK_FULL = {_errno.ENOSPC, _errno.EDQUOT}


def _rebuild_io_error(
    cls: type[CheckpointIOError], err: int, strerror: str, filename: str | None, call: str | None
) -> CheckpointIOError:
    return cls(err, strerror, filename, call=call)


def io_error(err: int, call: str, filename: str | os.PathLike[str] | None = None) -> CheckpointIOError:
    """Build the typed error for a failed I/O call that returned ``err`` (a positive errno)."""
    cls = DiskFullError if err in _DISK_FULL else CheckpointIOError
    name = os.fspath(filename) if filename is not None else None
    return cls(err, os.strerror(err), name, call=call)


def from_os_error(
    exc: OSError, call: str, filename: str | os.PathLike[str] | None = None
) -> CheckpointIOError:
    """Map an ``OSError`` from the standard library to aiopersist's typed error (to raise ``from exc``)."""
    if isinstance(exc, CheckpointIOError):
        return exc
    err = exc.errno if exc.errno is not None else _errno.EIO
    return io_error(err, call, filename if filename is not None else exc.filename)


def typed_error(exc: BaseException, call: str) -> BaseException:
    """``exc`` as aiopersist raises it: an ``OSError`` that is not aiopersist's own becomes a
    `CheckpointIOError` naming ``call``, caused by ``exc``; anything else is returned as is.
    For errors handed over rather than raised (on a save's handle, a future)."""
    if not isinstance(exc, OSError) or isinstance(exc, AiopersistError):
        return exc
    typed = from_os_error(exc, call)
    typed.__cause__ = exc
    return typed


@contextlib.contextmanager
def mapped_os_errors(call: str) -> Iterator[None]:
    """Turn an ``OSError`` that is not aiopersist's own into a `CheckpointIOError` naming
    ``call`` (the operation), raised ``from`` it; aiopersist's errors pass unchanged."""
    try:
        yield
    except AiopersistError:
        raise
    except OSError as exc:
        raise from_os_error(exc, call) from exc


P = ParamSpec("P")
R = TypeVar("R")


def maps_os_errors(call: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a public entry point (a function or a coroutine function) so that no bare
    ``OSError`` leaves it: see `mapped_os_errors`."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: P.args, **kwargs: P.kwargs) -> object:
                with mapped_os_errors(call):
                    return await cast(Callable[P, Awaitable[object]], fn)(*args, **kwargs)

            return cast(Callable[P, R], run_async)

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with mapped_os_errors(call):
                return fn(*args, **kwargs)

        return run

    return decorate


class DirectoryInUseError(AiopersistError):
    """Another `CheckpointManager` holds this directory: its start-up cleanup and retention
    would delete the other's saves in progress. ``holder`` says which process, as the
    holder wrote it (``pid N on HOST``), or is empty when it could not be read."""

    def __init__(self, directory: str, holder: str) -> None:
        self.directory = directory
        self.holder = holder
        who = f" ({holder})" if holder else ""
        super().__init__(
            f"{directory} is managed by another CheckpointManager{who}; one manager per directory: "
            "close the other one (aclose) or use another directory"
        )

    def __reduce__(self) -> tuple[type[DirectoryInUseError], tuple[str, str]]:
        return type(self), (self.directory, self.holder)
