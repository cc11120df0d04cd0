"""Atomic publication of a checkpoint directory.

A checkpoint is written into a temporary directory beside its final name, every file is
fsynced, then the directory, then it is renamed into place (``renameat2``: swapped
atomically with an older one when overwriting, never clobbering one otherwise) and the
parent is fsynced.
A crash at any point leaves either nothing or a complete checkpoint under the final name;
leftover temporary directories carry `TMP_MARKER` in their name (every on-disk name is
in `_names`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import stat
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

from ._exceptions import CheckpointExistsError, DiskFullError, from_os_error, io_error
from ._names import OLD_MARKER, beside, is_work_place, temp_path
from ._units import human

T = TypeVar("T")


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


def check_room(directory: str, needed: int, call: str, filename: str | None = None, detail: str = "") -> None:
    """`DiskFullError` (``ENOSPC``) when the file system of ``directory`` has fewer free
    bytes than ``needed``: said before anything is written, rather than after writing
    until it is full (a view of a few bytes may claim terabytes, written in full). What
    others write meanwhile is still caught when it happens. ``filename`` (``directory``
    by default) is named in the error, ``detail`` said in its message."""
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise from_os_error(exc, call, directory) from exc
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise DiskFullError(
            errno.ENOSPC,
            f"writing it needs {needed} bytes ({human(needed)}), its file system has {free} "
            f"({human(free)}) free; {detail + '; ' if detail else ''}nothing was written",
            filename if filename is not None else directory,
            call=call,
        )


def make_directories(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, durably: every directory it creates is
    fsynced into its parent, so that after a power loss a checkpoint reported durable is
    still reachable (a fresh ``ckpt/run7`` whose entry in ``ckpt`` was never flushed would
    vanish with everything under it). A parent removed meanwhile (a work place another
    save released, `release_work_place`) is made again."""
    path = os.path.abspath(path)
    for attempt in range(_RETRIES):
        try:
            _make_missing(path)
            return
        except FileNotFoundError as exc:
            if attempt == _RETRIES - 1:
                raise from_os_error(exc, "mkdir", path) from exc


_RETRIES = 100
"""How often work in a work place is retried when the place was released meanwhile."""


def _make_missing(path: str) -> None:
    missing: list[str] = []
    probe = path
    while not os.path.isdir(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            try:
                is_directory = stat.S_ISDIR(os.stat(directory).st_mode)
            except FileNotFoundError:  # made by another save, and released since
                raise FileNotFoundError(errno.ENOENT, "made and removed meanwhile", directory) from None
            if not is_directory:
                raise from_os_error(
                    FileExistsError(errno.EEXIST, "exists and is not a directory"), "mkdir", directory
                ) from None
        except FileNotFoundError:
            raise  # a parent went meanwhile: make_directories starts again
        except OSError as exc:
            raise from_os_error(exc, "mkdir", directory) from exc
        # Also when another process made it meanwhile: it may not have flushed it yet.
        fsync_directory(os.path.dirname(directory))


def in_work_place(path: str, make: Callable[[], T]) -> T:
    """``make()``, which creates ``path`` (a directory made or renamed there), after making
    its parent. Where that parent is a work place (`work_elsewhere`) that another save
    released meanwhile (`release_work_place`: ``make`` raises ``FileNotFoundError``), it
    is made again and ``make`` retried. (Whether the place went cannot be told afterwards:
    a third save may have made it again since.)"""
    parent = os.path.dirname(os.path.abspath(path))
    for attempt in range(_RETRIES):
        make_directories(parent)
        try:
            return make()
        except FileNotFoundError:
            if attempt == _RETRIES - 1 or not is_work_place(parent):
                raise
    raise AssertionError("unreachable")


def release_work_place(path: str) -> None:
    """Once the work in progress ``path`` is gone (published or removed): remove the work
    place holding it (`work_elsewhere`) if nothing else is in it, so that between saves
    nothing of aiopersist's lies beside the checkpoints (Accelerate's ``project_dir`` holds
    ``checkpoints/`` alone, as after a stock ``save_state``). Whoever works there next
    makes it again (`in_work_place`, `make_directories`)."""
    parent = os.path.dirname(os.path.abspath(path))
    if is_work_place(parent):
        with contextlib.suppress(OSError):
            os.rmdir(parent)


def mount_of(path: str) -> str:
    """The mount point of the mount holding the directory ``path`` (its real path), from
    ``/proc/self/mountinfo``: two directories can be renamed one into the other only on
    the same mount (a bind mount of a directory of the same disk has the same device
    number, and a rename across it still fails with ``EXDEV``). An ``OSError`` where the
    mounts cannot be read."""
    real = os.path.realpath(path)
    best = ""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ")
            if len(fields) < 5:
                continue
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best = point  # the last of equal ones is on top
    if not best:
        raise OSError(errno.ENOENT, "no mount holds it", path)
    return best


RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _load_renameat2() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast(Callable[..., int], fn)


_renameat2_fn = _load_renameat2()


def renameat2(src: str, dst: str, flags: int) -> bool:
    """``renameat2(2)`` with ``RENAME_EXCHANGE`` or ``RENAME_NOREPLACE``.

    Returns ``False`` when the C library, the kernel or the file system cannot do it (the
    caller then falls back to plain renames); raises the typed error for real failures.
    """
    if _renameat2_fn is None:
        return False
    if _renameat2_fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    if err == errno.EEXIST:
        raise CheckpointExistsError(f"{dst} already exists (pass overwrite=True to replace it)")
    raise io_error(err, "renameat2", src)


def remove_path(path: str) -> None:
    """Remove a file, a link (not what it names) or a directory tree, as far as it can be
    (best effort, as ``shutil.rmtree(ignore_errors=True)``; what cannot be removed stays),
    then the work place that held it if it is left empty (`release_work_place`).
    The tree is walked without recursion and without following a link, so a tree nested
    thousands of levels deep (stuffed into a checkpoint by hand) neither raises
    ``RecursionError`` nor needs a path longer than ``PATH_MAX``."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        with contextlib.suppress(OSError):  # not a directory (a file, a link), or gone
            os.unlink(path)
    else:
        _empty_tree(fd)
        with contextlib.suppress(OSError):
            os.rmdir(path)
    release_work_place(path)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _empty_tree(top: int) -> None:
    """Remove what the directory open as ``top`` holds; closes ``top``.

    Depth-first with one directory open at a time: it goes down through a subdirectory
    (opened relative to its parent, never through a link) and back up through ``..``,
    checked to be the directory it came from (a tree moved meanwhile is left as it is).
    Entries that cannot be removed are skipped, not retried."""
    fd = top
    ancestors: list[tuple[int, int, str]] = []  # (st_dev, st_ino) of each parent, and our name there
    stuck: set[tuple[int, int]] = set()  # directories that could not be emptied
    try:
        while True:
            here = os.fstat(fd)
            child = None
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        try:
                            if entry.is_dir(follow_symlinks=False):
                                st = entry.stat(follow_symlinks=False)
                                if (st.st_dev, st.st_ino) not in stuck:
                                    child = entry.name
                                    break
                            else:
                                os.unlink(entry.name, dir_fd=fd)
                        except FileNotFoundError:
                            pass
                        except OSError:
                            stuck.add((here.st_dev, here.st_ino))
            except OSError:  # unreadable
                stuck.add((here.st_dev, here.st_ino))
            if child is not None:
                try:
                    down = os.open(child, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    with contextlib.suppress(OSError):
                        st = os.stat(child, dir_fd=fd, follow_symlinks=False)
                        stuck.add((st.st_dev, st.st_ino))
                    continue
                ancestors.append((here.st_dev, here.st_ino, child))
                fd, parent = down, fd
                os.close(parent)
                continue
            if not ancestors:
                return
            dev, ino, name = ancestors.pop()
            fd, below = os.open("..", _DIR_FLAGS, dir_fd=fd), fd
            os.close(below)
            back = os.fstat(fd)
            if (back.st_dev, back.st_ino) != (dev, ino):
                return  # moved away while it was being emptied
            try:
                os.rmdir(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError:
                stuck.add((here.st_dev, here.st_ino))
    except OSError:
        return
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _exchange(tmp: str, final: str, discard: Callable[[str], None]) -> bool:
    """Swap the new checkpoint in; afterwards ``tmp`` holds the old one, then goes."""
    if not renameat2(tmp, final, RENAME_EXCHANGE):
        return False
    try:
        fsync_directory(os.path.dirname(final))
    except BaseException:
        # Not durable: swap back, so that the failed save leaves the old checkpoint in
        # place (the caller's cleanup then removes the new one from tmp).
        renameat2(tmp, final, RENAME_EXCHANGE)
        raise
    discard(tmp)
    return True


def publish(tmp: str, final: str, overwrite: bool, discard: Callable[[str], None] = remove_path) -> None:
    """Make the complete directory ``tmp`` the checkpoint ``final`` (see the module
    docstring); the work place that held ``tmp`` goes if nothing else is in it."""
    _publish(tmp, final, overwrite, discard)
    release_work_place(tmp)


def _publish(tmp: str, final: str, overwrite: bool, discard: Callable[[str], None]) -> None:
    parent = os.path.dirname(final)
    fsync_directory(tmp)
    if overwrite and os.path.lexists(final):
        # One atomic swap: the new checkpoint takes the final name and the old one the
        # temporary name, in a single step. A crash leaves one or the other complete
        # under the final name, never neither.
        if not _exchange(tmp, final, discard):
            _publish_by_two_renames(tmp, final, discard)
        return
    # No clobbering of a checkpoint that appeared since the check in make_temp.
    try:
        placed = renameat2(tmp, final, RENAME_NOREPLACE)
    except CheckpointExistsError:
        if not overwrite:
            raise
        placed = _exchange(tmp, final, discard)  # it appeared meanwhile, and we may replace it
        if placed:
            return
    if not placed:
        if os.path.lexists(final):
            if not overwrite:
                raise CheckpointExistsError(f"{final} already exists (pass overwrite=True to replace it)")
            _publish_by_two_renames(tmp, final, discard)
            return
        try:
            os.rename(tmp, final)
        except OSError as exc:
            raise from_os_error(exc, "rename", tmp) from exc
    fsync_directory(parent)


def publish_with_parts(
    tmp: str, final: str, parts: Sequence[str], overwrite: bool, discard: Callable[[str], None] = remove_path
) -> None:
    """`publish` a checkpoint whose files are also in the part directories ``parts``: their
    entries are fsynced first (the parts themselves and the directories above them were
    made durable when `make_directories` created them)."""
    for part in parts:
        if os.path.isdir(part):
            fsync_directory(part)
    publish(tmp, final, overwrite, discard)


def _publish_by_two_renames(tmp: str, final: str, discard: Callable[[str], None]) -> None:
    """Without renameat2: move the old one aside, move the new one in. A crash between
    the two leaves the old checkpoint complete under its moved-aside name."""
    parent = os.path.dirname(final)
    old = beside(final, OLD_MARKER, uuid.uuid4().hex[:12])
    try:
        in_work_place(old, lambda: os.rename(final, old))
    except OSError as exc:
        raise from_os_error(exc, "rename", final) from exc
    try:
        os.rename(tmp, final)
    except OSError as exc:
        os.rename(old, final)
        raise from_os_error(exc, "rename", tmp) from exc
    fsync_directory(parent)
    discard(old)


@dataclass(frozen=True)
class PendingDirectory:
    """A checkpoint being written: files go into ``tmp``; ``final`` is where it will appear."""

    tmp: str
    final: str


def make_temp(final: str | os.PathLike[str], overwrite: bool, token: str | None = None) -> PendingDirectory:
    """Create the temporary directory of a new checkpoint ``final`` (checked not to exist
    unless ``overwrite``); its parents are made durably."""
    target = os.path.abspath(os.fspath(final))
    parent = os.path.dirname(target)
    if os.path.lexists(target) and not overwrite:
        raise CheckpointExistsError(f"{target} already exists (pass overwrite=True to replace it)")
    make_directories(parent)
    tmp = temp_path(target, token or uuid.uuid4().hex[:12])
    try:
        in_work_place(tmp, lambda: os.mkdir(tmp))
    except OSError as exc:
        raise from_os_error(exc, "mkdir", tmp) from exc
    return PendingDirectory(tmp, target)


def remove_empty_directory(path: str) -> None:
    """Remove a directory just made and still empty (one system call); quietly."""
    with contextlib.suppress(OSError):
        os.rmdir(path)
