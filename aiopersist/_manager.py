"""`CheckpointManager`: numbered checkpoints in a directory, with retention, a mirror tier,
resume from the newest complete one, and cleanup of what a crash left behind.

Layout: ``DIRECTORY/step-N`` for step ``N`` (a checkpoint directory as `save` writes
it). A step counts only when it is *complete*: its manifest parses and checks out (it
seals itself with a checksum) and every file it lists has the listed size. That takes
reading the manifest, never the data.

- **Retention**, after each commit, in the background, by a policy (`_retention`):
  ``retention=KeepLast(3) | KeepEvery(1000)`` keeps the newest three complete steps and
  every thousandth for good (``keep_last=3, keep_every=1000`` is the shorthand; with
  neither, every step stays); the newest complete step, any step being written, and any
  step being restored are never deleted, whatever the policy.
  A deletion first renames the step to a trash name (atomic), then removes it: a crash
  midway leaves trash, which the next start removes, never a half-deleted step under
  its name.
- **Mirror**: after a local commit, every complete local step the mirror lacks (and its
  own retention would keep) is copied there in the background with the same protocol
  (temporary directory, every file and the directory fsynced, rename). A checkpoint
  spread over several directories is gathered into one directory in the mirror. A
  mirror that fails (missing, read-only, full) never stops local saves: the error is
  logged and set on the save's ``mirrored`` future, and the next save tries again.
- **Start**: leftovers of crashed saves and deletions are removed (temporary, trash and
  replaced directories, parts that no checkpoint lists).

With several ranks, every rank calls `save` (the checkpoint is spread over the ranks as
in `aiopersist.save`), and rank 0 alone cleans up, applies retention and mirrors. Make the
manager after ``init_process_group``: its start-up cleanup runs on rank 0 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import shutil
import socket
import stat
import time
import traceback
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._checkpointer import Checkpointer, Mode, OneClose, OwnLoop, SaveHandle, caller_view, pending
from ._commit import (
    fsync_directory,
    in_work_place,
    make_directories,
    make_temp,
    publish,
    release_work_place,
    remove_path,
)
from ._dist import FAILURES, Exchanges, coordinator
from ._exceptions import (
    AiopersistError,
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointNotFoundError,
    ClosedError,
    DirectoryInUseError,
    LinkedFileError,
    NewerFormatError,
    from_os_error,
    maps_os_errors,
    typed_error,
)
from ._load import UNLOADABLE_LAYOUTS, load
from ._locate import (
    READ_FLAGS,
    PathArg,
    absolute_path,
    checkpoint_paths,
    file_problem,
    locate,
    own_parts,
    token_at,
)
from ._manifest import dump_manifest, member_directories
from ._names import (
    LEFTOVER_MARKERS,
    LOCK_NAME,
    MANAGER_STEPS,
    MANIFEST_NAME,
    MAX_STEP,
    OLD_MARKER,
    PART_RE,
    STEP_LAYOUTS,
    TRASH_MARKER,
    StepLayout,
    beside,
    step_name,
)
from ._retention import Retention, policy_of, to_delete
from ._save import SaveInfo, fail_together
from ._stream import CudaReady

log = logging.getLogger("aiopersist")


_held_locks: dict[int, weakref.finalize[Any, Any]] = {}
"""The lock files this process holds open, by descriptor, with what closes each."""


def _close_lock(fd: int) -> None:
    _held_locks.pop(fd, None)
    os.close(fd)


def _forget_locks_after_fork() -> None:
    # The child shares each lock with the parent (one open file): closing its copy drops
    # only its reference (an unlock here would drop the parent's lock too).
    for fd, closer in list(_held_locks.items()):
        closer.detach()
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_locks.clear()


os.register_at_fork(after_in_child=_forget_locks_after_fork)


class DirectoryLock:
    """An exclusive ``flock`` on ``DIRECTORY/.aiopersist-manager.lock``, held until
    `release` (or until the process ends: the kernel drops it, so a killed manager never
    leaves a stale lock). The holder writes ``pid N on HOST`` into the file, for the error
    the next one gets. The file itself stays: removing it would race with a new holder.

    Raises `DirectoryInUseError` when another holder has it. A directory where the lock
    file cannot be made (read-only: EROFS, EACCES, EPERM) or a file system without
    ``flock`` (some FUSE and network mounts answer ENOLCK or EOPNOTSUPP) gets a warning
    and no lock. A process forked while the lock is held closes its copy of the file at
    once, so the lock never outlives its holder in a child (a DataLoader worker, say).

    The lock file is untrusted like everything else in the directory: a symbolic link
    there (planted, or in a copied run) is refused with `LinkedFileError`, never
    followed, and anything but a regular file with `CheckpointIOError`; the holder's line
    is not written into a file with other names (hard links), which may lie outside.
    """

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_NAME)
        self._release: Callable[[], None] = lambda: None
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LinkedFileError(
                    f"{self.path}: the manager's lock file is a symbolic link; refused (it is never "
                    "followed): remove it"
                ) from None
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise from_os_error(exc, "open", self.path) from exc
            self._unlocked(directory, exc)
            return
        try:
            info = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            raise from_os_error(exc, "fstat", self.path) from exc
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise CheckpointIOError(
                errno.EINVAL, "the manager's lock file is not a regular file", self.path, call="open"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            finally:
                os.close(fd)
            raise DirectoryInUseError(directory, holder) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise from_os_error(exc, "flock", self.path) from exc
            self._unlocked(directory, exc)
            return
        if info.st_nlink == 1:  # a file of its own: another name of it may be outside
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        closer = weakref.finalize(self, _close_lock, fd)
        _held_locks[fd] = closer
        self._release = closer

    @staticmethod
    def _unlocked(directory: str, exc: OSError) -> None:
        log.warning(
            "aiopersist: %s cannot be locked (%s): one manager per directory is not enforced",
            directory,
            exc.strerror,
        )

    def release(self) -> None:
        """Drop the lock (closing the file drops it); a second call does nothing."""
        self._release()


# -- what is on disk -----------------------------------------------------------------------


@dataclass(frozen=True)
class StepInfo:
    """One ``step-N`` directory (or a Trainer's ``checkpoint-N``), as found on disk."""

    step: int
    path: str
    tier: str
    """``local`` or ``mirror``."""
    complete: bool
    nbytes: int
    """Bytes of its files (all parts included), by the manifest (for a stock checkpoint,
    of every regular file under it); 0 when incomplete."""
    problem: str | None = None
    """Why it is not complete."""
    kind: str = "aiopersist"
    """``aiopersist``, or ``stock`` for a checkpoint without a manifest that its
    framework's own save wrote (see `StepLayout.stock_file`)."""
    damaged: bool = False
    """Incomplete, and proven broken (no manifest, a file missing or of the wrong size, a
    manifest that fails its checks): the only incomplete checkpoints that ``gc`` and the
    Trainer's rotation delete. One that could not be told (a newer format, an I/O error,
    a manifest recording another step than its name) or that is refused for a link (the
    step directory, a file or a subdirectory of it, or files hard-linked to each other:
    `LinkedFileError`) is reported and left alone."""
    layout: str = ""
    """The manifest's layout: ``state`` (what `aiopersist.save` writes), ``hf-model``,
    ``dcp`` (a ``torch.distributed.checkpoint`` directory) or ``fsdp``; ``""`` when it
    has none (a stock checkpoint, or an incomplete one)."""


def check_step(path: PathArg) -> tuple[bool, int, str | None]:
    """Whether the checkpoint at ``path`` is complete (manifest valid, every file present
    with its size), its size, and what is wrong otherwise. Reads no tensor data. ``path``
    may be the list of directories it was saved to (its parts are then looked for there).
    Never raises for a damaged checkpoint: whatever is wrong is the answer."""
    complete, nbytes, problem, _, _ = _checked_step(path)
    return complete, nbytes, problem


def _checked_step(path: PathArg, step: int | None = None) -> tuple[bool, int, str | None, bool, str]:
    """`check_step`, whether an incomplete checkpoint is proven damaged (see
    `StepInfo.damaged`), and the manifest's layout when it is complete. With ``step``, a
    manifest that records another step (a copy put under another name) is not taken for
    it."""
    try:
        loc = locate(path)
    except (NewerFormatError, LinkedFileError) as exc:  # refused, not proven broken
        return False, 0, str(exc), False, ""
    except CheckpointCorruptError as exc:
        return False, 0, str(exc), True, ""
    except AiopersistError as exc:  # an I/O error (permissions, descriptors): not proof of damage
        return False, 0, str(exc), False, ""
    except Exception as exc:  # whatever it is, it is reported, never stops a listing
        log.debug("aiopersist: checking %s raised", path, exc_info=True)
        return False, 0, f"{type(exc).__name__}: {exc}", False, ""
    if loc.manifest is None:
        return False, 0, f"no {MANIFEST_NAME}", True, ""
    recorded = loc.manifest.metadata.get("step")
    if step is not None and recorded is not None and recorded != str(step):
        return (
            False,
            0,
            f"its manifest records step {recorded!r}, not {step} (a copy under another name?)",
            False,
            "",
        )
    return True, sum(loc.sizes.values()), None, False, loc.manifest.layout


def linked_step_directory(paths: Sequence[str]) -> str | None:
    """The first of a step's directories (its name in each of the directories it is
    spread over) that is there but is not a directory of its own: a symbolic link (to
    another run's step, or anywhere), or a file. A manager neither reads, writes nor
    deletes through such a name: the step is someone else's. ``None``: there is none."""
    for path in paths:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise from_os_error(exc, "lstat", path) from exc
        if not stat.S_ISDIR(mode):
            return path
    return None


def step_paths(directories: Sequence[str], name: str) -> list[str]:
    """Where a step is: ``name`` in each of the directories (the first holds the manifest)."""
    return [os.path.join(d, name) for d in directories]


def scan(
    directories: str | Sequence[str], tier: str = "local", layout: StepLayout = MANAGER_STEPS
) -> list[StepInfo]:
    """Every ``step-N`` in ``directories`` (one, or the list a save spreads over: each step's
    parts are looked for in those only, even in a list of one; given one directory as a
    string, where its manifest says, as `aiopersist.load` of a path looks), by step. With
    ``layout=TRAINER_STEPS``, every ``checkpoint-N`` of a Trainer's ``output_dir`` instead:
    one with a manifest is checked as any aiopersist checkpoint, one without is the stock
    save's (``kind="stock"``), complete once it has ``trainer_state.json``. A step whose
    name is a link (in any of the directories) is listed incomplete and left alone."""
    dirs = [directories] if isinstance(directories, str) else list(directories)
    directory = dirs[0]
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise from_os_error(exc, "listdir", directory) from exc
    out = []
    for name in names:
        step = layout.step_of(name)
        if step is None:
            continue
        path = os.path.join(directory, name)
        if not os.path.isdir(path):
            continue  # a file, a link to nothing or to no directory: not a checkpoint
        where = step_paths(dirs, name)
        linked = linked_step_directory(where)
        if linked is not None:
            why = f"{linked} is a symbolic link or a file, not a directory of its own: left alone"
            out.append(StepInfo(step, path, tier, False, 0, why))
            continue
        if layout.stock_file is not None and not os.path.lexists(os.path.join(path, MANIFEST_NAME)):
            out.append(_stock_step(step, path, tier, layout.stock_file))
            continue
        listed = where if not isinstance(directories, str) else where[0]
        complete, nbytes, problem, damaged, kind = _checked_step(listed, step)
        out.append(StepInfo(step, path, tier, complete, nbytes, problem, damaged=damaged, layout=kind))
    return sorted(out, key=lambda s: s.step)


def _stock_step(step: int, path: str, tier: str, stock_file: str) -> StepInfo:
    """A checkpoint its framework's own save wrote: complete once ``stock_file`` (written
    last) is there, its size that of every regular file under it (links not followed)."""
    if not os.path.isfile(os.path.join(path, stock_file)):
        return StepInfo(
            step, path, tier, False, 0, f"no {MANIFEST_NAME} nor {stock_file}", "stock", damaged=True
        )
    return StepInfo(step, path, tier, True, _tree_bytes(path), None, "stock")


def _tree_bytes(path: str) -> int:
    """The size of every regular file under ``path``, links not followed; walked without
    recursion (a tree stuffed in by hand may be nested deeper than Python recurses)."""
    nbytes = 0
    pending = [path]
    while pending:
        with contextlib.suppress(OSError), os.scandir(pending.pop()) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        nbytes += entry.stat(follow_symlinks=False).st_size
    return nbytes


def delete_step(path: PathArg) -> None:
    """Delete a checkpoint, crash-safely: renamed to a trash name first (atomic), then its
    parts removed (those of its save in the directories after the first, when ``path`` is
    the list it was saved to), then the trash. A crash midway leaves trash and parts whose
    checkpoint is gone: the next manager start removes them."""
    paths = checkpoint_paths(path)
    primary = paths[0]
    parent = os.path.dirname(primary)
    trash = beside(primary, TRASH_MARKER, uuid.uuid4().hex[:12])
    parts = [
        part
        for part in (own_parts(paths, token_at(primary)) if len(paths) > 1 else [])
        if _is_real_directory(os.path.dirname(part))  # never through a link to another run's step
    ]
    try:
        in_work_place(trash, lambda: os.rename(primary, trash))
    except FileNotFoundError:
        release_work_place(trash)
        return
    except OSError as exc:
        raise from_os_error(exc, "rename", primary) from exc
    fsync_directory(parent)
    for part in parts:
        remove_path(part)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(part))  # the step's directory on that disk, if now empty
    remove_path(trash)


def clean_leftovers(directories: Sequence[str]) -> list[str]:
    """Remove what crashed saves and deletions left: temporary, trash and replaced
    directories in the first directory, and in the others the parts that belong to no
    checkpoint (of a step whose checkpoint is gone, or of another save than the one its
    checkpoint records). Parts of a step whose manifest cannot be read are left alone.
    Returns what was removed."""
    removed = []
    primary = directories[0]
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(primary)):
            if OLD_MARKER in name:
                # Overwriting without renameat2 moves the old step aside, then the new one
                # in: a crash between the two leaves the old one complete under this name.
                step = name[1:].split(OLD_MARKER)[0]
                final = os.path.join(primary, step)
                named = any(layout.step_of(step) is not None for layout in STEP_LAYOUTS)
                moved = os.path.join(primary, name)
                if named and not os.path.lexists(final) and _is_real_directory(moved):
                    os.rename(moved, final)
                    fsync_directory(primary)
                    continue
        for name in os.listdir(primary):
            if any(marker in name for marker in LEFTOVER_MARKERS):
                path = os.path.join(primary, name)
                remove_path(path)
                removed.append(path)
    for extra in directories[1:]:
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(extra):
                step_dir = os.path.join(extra, name)
                if MANAGER_STEPS.step_of(name) is None or not _is_real_directory(step_dir):
                    continue
                checkpoint = os.path.join(primary, name)
                if os.path.lexists(checkpoint):
                    wanted = token_at(checkpoint)
                    if wanted is None:
                        log.warning(
                            "aiopersist: %s cannot be read; its parts in %s are left alone", checkpoint, extra
                        )
                        continue
                else:
                    wanted = None  # the checkpoint is gone: every part of it is a leftover
                for part in os.listdir(step_dir):
                    match = PART_RE.match(part)
                    if match is not None and match.group(1) != wanted:
                        path = os.path.join(step_dir, part)
                        remove_path(path)
                        removed.append(path)
                with contextlib.suppress(OSError):
                    os.rmdir(step_dir)  # only if empty
    return removed


def _is_real_directory(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def copy_step(src: PathArg, mirror: str, step: int) -> str:
    """Copy the complete checkpoint ``src`` (a path, or the list it was saved to) to
    ``mirror/step-N``, atomically and durably, gathered into one directory. Only what the
    checkpoint holds is copied: the files its manifest lists, from where they were
    located, and the regular files beside them (an index); never a link. Returns the new
    path."""
    loc = locate(src)
    manifest = loc.manifest
    if manifest is None:
        raise CheckpointNotFoundError(f"{loc.directory}: not an aiopersist checkpoint (no {MANIFEST_NAME})")
    pending = make_temp(os.path.join(mirror, step_name(step)), overwrite=True)
    tmp, final = pending.tmp, pending.final
    try:
        subdirectories = [os.path.join(tmp, d) for d in member_directories(manifest.files)]
        for sub in subdirectories:
            make_directories(sub)
        for rec in manifest.files.values():
            _copy_file(loc.path_of(rec), os.path.join(tmp, rec.name), rec.nbytes)
        for sub in reversed(subdirectories):
            fsync_directory(sub)
        gathered = dataclasses.replace(
            manifest,
            files={n: dataclasses.replace(r, directory=0) for n, r in manifest.files.items()},
            directories=(".",),
        )
        _write_durably(os.path.join(tmp, MANIFEST_NAME), dump_manifest(gathered))
        for extra in os.listdir(loc.directory):  # an index or anything else beside the data
            path = os.path.join(loc.directory, extra)
            if extra != MANIFEST_NAME and extra not in manifest.files and file_problem(path) is None:
                _copy_file(path, os.path.join(tmp, extra))
        publish(tmp, final, overwrite=True)
    except BaseException:
        remove_path(tmp)
        raise
    return final


def _copy_file(src: str, dst: str, nbytes: int | None = None) -> None:
    """Copy a regular file (never through a link), fsynced; ``nbytes``: the size it must have."""
    try:
        fd = os.open(src, READ_FLAGS | os.O_NONBLOCK)
    except OSError as exc:
        raise from_os_error(exc, "open", src) from exc
    with open(fd, "rb") as fin:
        try:
            st = os.fstat(fin.fileno())
        except OSError as exc:
            raise from_os_error(exc, "fstat", src) from exc
        if not stat.S_ISREG(st.st_mode) or (nbytes is not None and st.st_size != nbytes):
            raise CheckpointCorruptError(f"{src}: changed since it was checked (not the regular file listed)")
        try:
            with open(dst, "wb") as fout:
                shutil.copyfileobj(fin, fout, 8 << 20)
                fout.flush()
                os.fsync(fout.fileno())
        except OSError as exc:
            raise from_os_error(exc, "copy", dst) from exc


def _write_durably(path: str, data: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise from_os_error(exc, "write", path) from exc


# -- the manager ---------------------------------------------------------------------------


@dataclass(eq=False)
class ManagedSaveHandle:
    """A `CheckpointManager` save in progress: ``staged`` and ``done`` as for
    `SaveHandle`; ``mirrored`` resolves once the mirror has the step (with its path,
    ``None`` without a mirror or on ranks other than 0), or raises why it could not."""

    step: int
    handle: SaveHandle
    _mirrored: asyncio.Future[str | None] = field(repr=False)
    _views: dict[str, asyncio.Future[Any]] = field(default_factory=dict, repr=False)

    @property
    def mirrored(self) -> asyncio.Future[str | None]:
        """The caller's view, as ``staged`` and ``done`` (see `SaveHandle`)."""
        return caller_view(self._views, "mirrored", self._mirrored)

    @property
    def staged(self) -> asyncio.Future[None]:
        return self.handle.staged

    @property
    def done(self) -> asyncio.Future[SaveInfo | None]:
        return self.handle.done

    @property
    def skipped(self) -> bool:
        return self.handle.skipped

    async def wait(self) -> SaveInfo | None:
        return await self.handle.done


def _is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class CheckpointManager:
    """Numbered checkpoints under ``directory``: see the module docstring.

    ``directory`` may be a list of directories, one per disk, as for `save`'s ``path``
    (the first holds the manifests). ``checkpointer`` is used for the saves (by default
    a new `Checkpointer` with ``backend`` and ``mode``, closed by `aclose`).
    """

    @maps_os_errors("CheckpointManager")
    def __init__(
        self,
        directory: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        mirror: str | os.PathLike[str] | None = None,
        mirror_keep_last: int | None = None,
        checkpointer: Checkpointer | None = None,
        backend: str = "auto",
        mode: Mode = "fence",
        retention: Retention | None = None,
        mirror_retention: Retention | None = None,
    ) -> None:
        for name, value in (
            ("keep_last", keep_last),
            ("keep_every", keep_every),
            ("mirror_keep_last", mirror_keep_last),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        for name, policy in (("retention", retention), ("mirror_retention", mirror_retention)):
            if policy is not None and not isinstance(policy, Retention):
                raise TypeError(
                    f"{name} must be a Retention policy (KeepLast(3) | KeepEvery(1000)), got {policy!r}"
                )
        if retention is not None and (keep_last is not None or keep_every is not None):
            raise ValueError("pass retention, or its shorthands keep_last/keep_every, not both")
        if mirror_retention is not None and mirror_keep_last is not None:
            raise ValueError("pass mirror_retention, or its shorthand mirror_keep_last, not both")
        if isinstance(directory, str | os.PathLike):
            dirs = [absolute_path(directory, "directory")]
        else:
            dirs = [absolute_path(d, "directory") for d in directory]
            if not dirs:
                raise ValueError("directory: an empty list")
        self.directories = dirs
        self.directory = dirs[0]
        self.retention: Retention = retention if retention is not None else policy_of(keep_last, keep_every)
        """Which complete local steps stay (a `Retention` policy)."""
        self.mirror = absolute_path(mirror, "mirror") if mirror is not None else None
        self.mirror_retention: Retention = (
            mirror_retention if mirror_retention is not None else policy_of(mirror_keep_last, keep_every)
        )
        """Which complete steps stay in the mirror."""
        self._backend = backend
        self._rank0 = _is_rank0()
        self._reading: set[str] = set()
        self._writing: set[int] = set()
        self._unloadable: dict[int, str] = {}
        """Steps whose local copy `restore` found damaged (it fell back past them), with
        why: a save of that step replaces the copy (`_replaceable`)."""
        self._mirror_damaged: set[int] = set()
        """Steps whose mirror copy `restore` found damaged."""
        self._remirror: set[int] = set()
        """Steps saved again over a damaged local copy whose mirror copy is damaged too: the
        mirror's copy is replaced at the next catch-up, though complete by its manifest."""
        self._said_broken: set[str] = set()
        """The damaged steps `latest` has warned of (once each)."""
        self._mirroring: set[int] = set()
        self._unmirrored: set[int] = set()
        """Steps committed locally whose own mirroring has not been tried yet: the local
        retention of a later step leaves them (the mirror's copy claims them only once it
        starts, which may be after that retention)."""
        self._tasks: set[asyncio.Future[None]] = set()
        self._pass_steps: list[int] = []
        """Steps committed since the running pass of retention and mirroring began: the
        next pass follows them all (`_pass_after`)."""
        self._pass_next: asyncio.Future[None] | None = None
        self._pass_running = False
        self._mirror_retry: set[int] = set()
        """The steps of the last pass, when their mirroring failed: the local retention
        spares them (`_unmirrored`) until the next pass has tried them again."""
        self._mirror_lock: asyncio.Lock | None = None
        self._closed = False
        self._closing = OneClose()
        self._loop = OwnLoop("CheckpointManager", lambda: pending(self._tasks))
        self._locks: list[DirectoryLock] = []
        self.restored_step: int | None = None
        """The step the last `restore` loaded."""
        if self._rank0:
            for d in dirs:
                make_directories(d)  # durable: a power loss keeps what was saved in it
            self._lock_directories()
            try:
                removed = clean_leftovers(dirs)
                if self.mirror is not None:
                    with contextlib.suppress(OSError):
                        removed += clean_leftovers([self.mirror])
            except BaseException:
                self._unlock()
                raise
            for path in removed:
                log.info("aiopersist: removed %s, left by an interrupted save or deletion", path)
        # Made once the directories are ours: a refused manager leaves nothing to close.
        self._own = checkpointer is None
        try:
            self.checkpointer = (
                checkpointer if checkpointer is not None else Checkpointer(backend=backend, mode=mode)
            )
        except BaseException:
            self._unlock()
            raise

    def _lock_directories(self) -> None:
        """One manager per directory: its start-up cleanup, retention and mirroring would
        delete another manager's saves in progress. Every local directory is locked, and
        the mirror when it can be reached now (one that cannot is not locked later)."""
        try:
            for d in self.directories:
                self._locks.append(DirectoryLock(d))
            if self.mirror is not None and os.path.isdir(self.mirror):
                try:
                    self._locks.append(DirectoryLock(self.mirror))
                except DirectoryInUseError:
                    raise
                except AiopersistError as exc:  # read-only or gone: the mirror is optional
                    log.warning("aiopersist: the mirror %s is not locked: %s", self.mirror, exc)
        except BaseException:
            self._unlock()
            raise

    def _unlock(self) -> None:
        locks, self._locks = self._locks, []
        for lock in locks:
            lock.release()

    # -- what there is ------------------------------------------------------------------

    @maps_os_errors("CheckpointManager.scan")
    def scan(self) -> list[StepInfo]:
        """Every ``step-N`` in both tiers, complete or not (local first within a step)."""
        found = scan(self.directories, "local")
        if self.mirror is not None:
            try:
                found += scan([self.mirror], "mirror")
            except AiopersistError as exc:  # an unavailable mirror hides nothing local
                log.warning("aiopersist: the mirror %s cannot be read: %s", self.mirror, exc)
        return sorted(found, key=lambda s: (s.step, s.tier != "local"))

    @maps_os_errors("CheckpointManager.steps")
    def steps(self) -> list[int]:
        """The complete steps, in either tier, oldest first."""
        return sorted({s.step for s in self.scan() if s.complete})

    @maps_os_errors("CheckpointManager.latest")
    def latest(self) -> int | None:
        """The newest complete step, or ``None``. Newer steps that are proven damaged
        (`StepInfo.damaged`) are passed over with a warning, once each: a run that starts
        afresh (or from an older step) does so knowingly, and its save of such a step
        replaces it."""
        infos = self.scan()
        steps = sorted({s.step for s in infos if s.complete})
        newest = steps[-1] if steps else None
        for info in infos:
            if info.damaged and (newest is None or info.step > newest) and info.path not in self._said_broken:
                self._said_broken.add(info.path)
                log.warning(
                    "aiopersist: latest() passes over step %d (%s): damaged: %s; "
                    "a save of step %d replaces it",
                    info.step,
                    info.path,
                    info.problem,
                    info.step,
                )
        return newest

    # The scans read every step's manifest (seconds for many large steps): in a coroutine,
    # use these, which run them in a worker thread and leave the event loop free.

    async def ascan(self) -> list[StepInfo]:
        """`scan`, in a worker thread."""
        return await asyncio.to_thread(self.scan)

    async def asteps(self) -> list[int]:
        """`steps`, in a worker thread."""
        return await asyncio.to_thread(self.steps)

    async def alatest(self) -> int | None:
        """`latest`, in a worker thread."""
        return await asyncio.to_thread(self.latest)

    # -- saving -------------------------------------------------------------------------

    @maps_os_errors("CheckpointManager.save")
    async def save(
        self,
        step: int,
        state: object,
        *,
        metadata: Mapping[str, str] | None = None,
        overwrite: bool = False,
        replicated: bool | Callable[[str], bool] | None = None,
        group: Any = None,
        cuda_ready: CudaReady | None = None,
    ) -> ManagedSaveHandle:
        """Start saving ``state`` as step ``step``; returns once the save is started (see
        `Checkpointer.save`). Retention and the mirror follow the commit, in the
        background."""
        self._check_loop()
        try:
            if self._closed:
                raise ClosedError("the CheckpointManager is closed")
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise TypeError(f"step must be a non-negative int, got {step!r}")
            if step > MAX_STEP:
                raise ValueError(f"step must be at most {MAX_STEP} (18 digits), got {step}")
            if metadata is not None and metadata.get("step", str(step)) != str(step):
                raise ValueError(
                    f"metadata: 'step' is the manager's ({step}), got {metadata['step']!r}: name it otherwise"
                )
            paths = step_paths(self.directories, step_name(step))
            linked = await asyncio.to_thread(linked_step_directory, paths)
            if linked is not None:
                raise CheckpointExistsError(
                    f"{linked}: a symbolic link or a file where step {step}'s directory goes: the manager "
                    "writes and deletes only in directories of its own, never through a link; remove it"
                )
            if not overwrite:
                broken = await asyncio.to_thread(self._replaceable, step, paths)
                if broken is not None:
                    log.warning(
                        "aiopersist: step %d replaces %s, which is damaged: %s", step, paths[0], broken
                    )
                    overwrite = True
                    if step in self._mirror_damaged:
                        self._mirror_damaged.discard(step)
                        self._remirror.add(step)
        except Exception as exc:
            # With several ranks the others are told at the save's first exchange, rather
            # than wait there for this rank until AIOPERSIST_DIST_TIMEOUT: in this save's
            # turn, once the saves in flight are over (their exchanges come first).
            coord = coordinator(group)
            if coord is not None:
                await self.checkpointer.wait()
            await fail_together(coord, os.path.join(self.directory, f"step-{step}"), exc)
        loop = asyncio.get_running_loop()
        meta = {**(metadata or {}), "step": str(step)}
        if overwrite and self.mirror is not None:
            # The mirror's copy (complete by its manifest, so the catch-up would pass it
            # over) is the replaced one: it is copied again once this save commits.
            self._remirror.add(step)
        self._writing.add(step)
        try:
            handle = await self.checkpointer.save(
                state,
                paths,
                metadata=meta,
                overwrite=overwrite,
                replicated=replicated,
                group=group,
                cuda_ready=cuda_ready,
            )
        except BaseException:
            self._writing.discard(step)
            raise
        managed = ManagedSaveHandle(step, handle, loop.create_future())
        task = asyncio.ensure_future(self._after(managed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return managed

    def _check_loop(self) -> None:
        """`OwnLoop.check` of the manager and of its checkpointer (which may be busy on
        another loop with saves of its own)."""
        self.checkpointer._loop.check()
        self._loop.check()

    def _replaceable(self, step: int, paths: list[str]) -> str | None:
        """Why the step already at ``paths`` may be replaced by a save of ``step`` without
        ``overwrite``: its local copy is damaged (`restore` fell back past it, or it is
        incomplete and proven broken, `StepInfo.damaged`, as retention and ``gc`` judge
        it). ``None``: it is absent, or complete, or cannot be told broken (a newer format,
        a link, a read that failed), or not wholly there (a directory without its manifest:
        it may not be the manager's; a disk of the step's not mounted): the save refuses as
        ever. A run that falls back to an older step, or starts afresh, would otherwise fail
        at that step's save, every time it is run again. Restore's verdict serves one save."""
        why = self._unloadable.pop(step, None)
        if not os.path.lexists(paths[0]):
            return None
        if not os.path.isfile(os.path.join(paths[0], MANIFEST_NAME)) or not all(map(os.path.isdir, paths)):
            return None
        if why is not None:
            return why
        complete, _, problem, damaged, _ = _checked_step(paths, step)
        return problem if not complete and damaged else None

    async def _after(self, managed: ManagedSaveHandle) -> None:
        mirrored = managed._mirrored
        try:
            try:
                info = await asyncio.shield(managed.handle._done)  # the save's own: never the caller's view
            except BaseException as exc:
                self._writing.discard(managed.step)
                _fail_quietly(mirrored, exc)
                return
            if self.mirror is not None and info is not None:
                self._unmirrored.add(managed.step)  # before the writing set lets go of it
            self._writing.discard(managed.step)
            if info is None or not _is_rank0():
                self._unmirrored.discard(managed.step)
                _resolve(mirrored, None)
                return
            try:
                await self._pass_after(managed.step)
            except Exception as exc:
                _fail_quietly(mirrored, exc)  # the mirror's failure (said in the log by the pass)
                return
            if self.mirror is None:
                _resolve(mirrored, None)
                return
            path = os.path.join(self.mirror, step_name(managed.step))
            # Absent: the mirror's retention dropped it (or a link there kept it from being copied).
            there = await asyncio.to_thread(_is_real_directory, path)
            _resolve(mirrored, path if there else None)
        except BaseException as exc:
            _fail_quietly(mirrored, exc)
            raise

    async def _pass_after(self, step: int) -> None:
        """Wait for a pass of retention and mirroring that starts after ``step``'s commit;
        raises the mirroring's failure. One pass runs at a time, and the commits that come
        while it runs share the next: each pass scans every step of both tiers, so a pass
        per commit fell behind saves made faster than it (400 saves 20 ms apart, 400 steps
        kept: the close waited 62 s for the passes left)."""
        self._pass_steps.append(step)
        if self._pass_next is None:
            self._pass_next = asyncio.get_running_loop().create_future()
        outcome = self._pass_next
        if not self._pass_running:
            self._start_pass()
        await asyncio.shield(outcome)

    def _start_pass(self) -> None:
        steps, self._pass_steps = self._pass_steps, []
        outcome, self._pass_next = self._pass_next, None
        assert outcome is not None
        self._pass_running = True
        task = asyncio.ensure_future(self._one_pass(steps, outcome))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

        def never_ran(t: asyncio.Future[None]) -> None:
            # Cancelled before its first step (the manager closed in the same turn): its
            # own cleanup never ran, so it is done here.
            if t.cancelled() and not outcome.done():
                self._pass_running = False
                self._unmirrored.difference_update(steps)
                _fail_quietly(outcome, asyncio.CancelledError())
                self._end_queued()

        task.add_done_callback(never_ran)

    def _end_queued(self) -> None:
        """The manager is being torn down: the commits queued for the next pass end too."""
        nxt, self._pass_next = self._pass_next, None
        self._unmirrored.difference_update(self._pass_steps)
        self._pass_steps = []
        if nxt is not None:
            _fail_quietly(nxt, asyncio.CancelledError())

    async def _one_pass(self, steps: list[int], outcome: asyncio.Future[None]) -> None:
        """Retention of the local steps, the mirror's catch-up, then the local retention
        again (it spared the steps that waited to be mirrored). ``steps``: the commits this
        pass follows, in order. The last is spared, as a pass per commit spared its own
        (a save is never deleted by its own retention); the earlier ones are not, as the
        later commits' passes would not have spared them.

        A step whose mirroring fails stays spared by the local retention until the next
        pass has tried it again; failing twice, it is left to the local retention (said in
        the log). A failure is the commits' (on their handles' ``mirrored``), never the
        pass task's: nothing is left for asyncio to report."""
        cancelled = False
        last = steps[-1:]
        retried, self._mirror_retry = self._mirror_retry, set()
        try:
            error: Exception | None = None
            try:
                await asyncio.to_thread(self._retain, self.directories, self.retention, "local", last)
                if self.mirror is not None:
                    try:
                        await self._sync_mirror()
                    except Exception as exc:
                        error = exc
                        self._mirror_retry = set(steps)  # spared until the next pass tries them
                        log.warning(
                            "aiopersist: mirroring %s to %s failed (tried again after the next save; "
                            "spared by the local retention until then): %s",
                            _steps_text(steps),
                            self.mirror,
                            exc,
                        )
                    if error is not None and (given_up := sorted(retried - self._mirror_retry)):
                        log.warning(
                            "aiopersist: %s not mirrored to %s after a second try: left to local retention",
                            _steps_text(given_up),
                            self.mirror,
                        )
                    self._unmirrored.difference_update((set(steps) | retried) - self._mirror_retry)
                    await asyncio.to_thread(self._retain, self.directories, self.retention, "local", last)
            except Exception as exc:  # the local tier's scan failed: told on the handles
                log.warning("aiopersist: retention after step %d failed: %s", steps[-1], exc)
                error = error or exc
            if error is not None:
                _fail_quietly(outcome, error)
            else:
                _resolve(outcome, None)
        except BaseException as exc:
            cancelled = True
            _fail_quietly(outcome, exc)
            raise
        finally:
            if cancelled:
                self._mirror_retry = set()
            self._unmirrored.difference_update((set(steps) | retried) - self._mirror_retry)
            self._pass_running = False
            if cancelled:
                self._end_queued()
            elif self._pass_steps:
                self._start_pass()

    def _retain(
        self, directories: Sequence[str], policy: Retention, tier: str, committed: Sequence[int] = ()
    ) -> None:
        """Apply ``policy`` to the complete steps in ``directories``; never to one being
        written, mirrored or read, nor to ``committed`` (the steps whose commits this pass
        follows: a save is never deleted by its own retention, even below a higher step)."""
        complete = [s for s in scan(directories, tier) if s.complete]
        protected = (
            set(self._writing)
            | set(self._mirroring)
            | set(self._unmirrored)
            | {s.step for s in complete if os.path.normpath(s.path) in self._reading}
            | set(committed)
        )
        names = {s.step: os.path.basename(s.path) for s in complete}
        for step in to_delete([s.step for s in complete], policy, protected):
            paths = step_paths(directories, names[step])
            log.info("aiopersist: retention deletes %s", paths[0])
            try:
                delete_step(paths)
            except (OSError, AiopersistError) as exc:
                # One step that cannot go (a permission, a failing disk) stops neither the
                # others' deletion nor the mirror: it is tried again at the next pass.
                log.warning(
                    "aiopersist: retention could not delete %s (tried again later): %s", paths[0], exc
                )

    async def _sync_mirror(self) -> None:
        """Copy every complete local step the mirror lacks (and would keep) to it, oldest
        first, then apply the mirror's retention."""
        assert self.mirror is not None
        if self._mirror_lock is None:
            self._mirror_lock = asyncio.Lock()
        async with self._mirror_lock:
            # The scans read every step's manifest: in a worker thread.
            local = [s for s in await asyncio.to_thread(scan, self.directories, "local") if s.complete]
            mirrored = await asyncio.to_thread(scan, [self.mirror], "mirror")
            there = {s.step for s in mirrored if s.complete} - self._remirror
            # A step name in the mirror that is a link (to a directory, a file, or nothing: a
            # step on a disk not mounted now) or a file is someone else's: never replaced.
            mirror = self.mirror
            linked = await asyncio.to_thread(
                lambda: {
                    s.step
                    for s in local
                    if linked_step_directory([os.path.join(mirror, step_name(s.step))]) is not None
                }
            )
            for step in sorted(linked):
                log.warning(
                    "aiopersist: not mirroring step %d: %s is a symbolic link or a file, left alone",
                    step,
                    os.path.join(self.mirror, step_name(step)),
                )
            # A step being saved again (overwrite, or replacing a damaged copy) is copied by
            # its own commit's pass: its local copy now is the one being replaced.
            skipped = there | linked | set(self._writing)
            wanted = [s.step for s in local if s.step not in skipped]
            self._mirroring.update(wanted)  # local retention leaves them until copied
            keep = set(wanted) - set(to_delete(sorted(there | set(wanted)), self.mirror_retention))
            copies = [s for s in local if s.step in keep]
            total = sum(s.nbytes for s in copies)
            if len(copies) > 1:  # a catch-up (a mirror that was away, a new one): say how far it is
                log.info("mirror %s: copying %d steps (%d bytes)", self.mirror, len(copies), total)
            try:
                done = 0
                for i, s in enumerate(copies, 1):
                    src = step_paths(self.directories, step_name(s.step))
                    started = time.monotonic()
                    await asyncio.to_thread(copy_step, src, self.mirror, s.step)
                    self._remirror.discard(s.step)
                    done += s.nbytes
                    seconds = time.monotonic() - started
                    log.info(
                        "mirror %s: step %d copied (%d bytes in %.1f s); %d of %d steps, %d of %d bytes",
                        self.mirror, s.step, s.nbytes, seconds, i, len(copies), done, total,
                    )  # fmt: skip
            finally:
                self._mirroring.difference_update(wanted)
            await asyncio.to_thread(self._retain, [self.mirror], self.mirror_retention, "mirror")

    # -- restoring ----------------------------------------------------------------------

    @maps_os_errors("CheckpointManager.path_of")
    def path_of(self, step: int | None = None) -> str:
        """Where the complete ``step`` (the newest by default) is: the local tier when it
        has it, else the mirror. Raises `CheckpointNotFoundError`."""
        found = [s for s in self.scan() if s.complete and (step is None or s.step == step)]
        if not found:
            what = "no complete checkpoint" if step is None else f"no complete checkpoint of step {step}"
            tiers = self.directory + (f" or {self.mirror}" if self.mirror else "")
            raise CheckpointNotFoundError(f"{what} in {tiers}")
        newest = max(s.step for s in found)
        return next(s.path for s in found if s.step == newest)  # local sorts first

    def _sources(self, info: StepInfo) -> list[str]:
        """What to load a step from: its directories in this manager's tiers."""
        if info.tier == "mirror":
            return [info.path]
        return step_paths(self.directories, os.path.basename(info.path))

    @maps_os_errors("CheckpointManager.restore")
    async def restore(
        self, step: int | None = None, *, into: object = None, group: Any = None, **kwargs: Any
    ) -> Any:
        """Load the newest step that loads and checks out (or ``step``), from either tier,
        local first; arguments as for `aiopersist.load`. Retention does not delete a step
        while it is read.

        A step that is incomplete, or whose data fails its checksums (or cannot be read),
        is skipped with a warning saying why, and the next one tried: the same step in
        the mirror, then older steps (only the given ``step``'s copies when one is
        given). `restored_step` tells which step was loaded. Raises
        `CheckpointNotFoundError` when there is no step, `CheckpointCorruptError` when
        none could be loaded (or the only steps are damaged). An ``into`` object is only
        changed by a step that loads. A later `save` of a step found damaged replaces it.

        Under ``torch.distributed`` every rank of ``group`` (the default group when
        ``None``) calls `restore`, and the ranks restore the same step: the newest that
        is complete, and loads, on every one of them (each rank reads only what it needs,
        so one can find damage another does not). A rank that cannot load a step makes
        every rank go on to the next; an error that is not about the checkpoint (a
        mismatched ``into``), or the restore cancelled on one rank, makes every rank
        raise, the others `RankFailedError`.
        """
        if self._closed:
            raise ClosedError("the CheckpointManager is closed")
        coord = coordinator(group)
        backend = kwargs.pop("backend", self._backend)
        tiers = self.directory + (f" or {self.mirror}" if self.mirror else "")
        agree = Exchanges(coord, ("restore", os.path.basename(self.directory)), "the restore")

        found: list[StepInfo] = []
        error: BaseException | None = None
        try:
            if coord is not None:
                # The ranks' exchanges must not meet those of this manager's saves in flight.
                await self.checkpointer.wait()
            found = [
                _restorable(s) for s in await asyncio.to_thread(self.scan) if step is None or s.step == step
            ]
        except FAILURES as exc:  # a cancellation too: told to the others, then raised
            error = exc
        complete = sorted({s.step for s in found if s.complete}, reverse=True)
        damaged_here = any(s.damaged for s in found)
        exchanged = await agree((complete, damaged_here), error)
        everywhere = [steps for steps, _ in exchanged]
        damaged_somewhere = any(damaged for _, damaged in exchanged)
        common = set(complete).intersection(*map(set, everywhere))
        failures = [f"step {s.step} ({s.tier}): {s.problem}" for s in found if not s.complete]
        for info in found:
            if not info.complete:
                log.warning("aiopersist: not restoring %s: incomplete: %s", info.path, info.problem)
        for lacking in sorted(set().union(*map(set, everywhere)) - common, reverse=True):
            ranks = [r for r, steps in enumerate(everywhere) if lacking not in steps]
            failures.append(f"step {lacking}: not complete on rank {', '.join(map(str, ranks))}")
            log.warning("aiopersist: not restoring step %d: not complete on rank %s", lacking, ranks)
        if not common:
            what = "no complete checkpoint" if step is None else f"no complete checkpoint of step {step}"
            where = " on every rank" if coord is not None and any(everywhere) else ""
            if damaged_somewhere:  # every rank raises the same
                # Checkpoints were there and are broken: not a run to start afresh unawares.
                raise CheckpointCorruptError(
                    f"{what} in {tiers}{where}; damaged:\n  " + "\n  ".join(failures)
                )
            raise CheckpointNotFoundError(f"{what} in {tiers}{where}")
        last: BaseException | None = None
        for number in sorted(common, reverse=True):
            result: Any = None
            failed: BaseException | None = None
            source = ""
            error = None
            try:
                result, failed, source, local_damage = await self._restore_step(
                    [s for s in found if s.step == number and s.complete], into, backend, kwargs, failures
                )
            except FAILURES as exc:  # not about the checkpoint (or cancelled): every rank raises
                error = exc
            # Why this rank could not load it, and what proves its local copy damaged (a
            # checksum or size that fails; not a link, a newer format or a failed read:
            # such a step is never replaced unasked).
            verdict = None if failed is None else (str(failed), local_damage)
            problems = await agree(verdict, error)
            if all(p is None for p in problems):
                if failures:
                    log.warning("aiopersist: restored step %d from %s", number, source)
                self.restored_step = number
                self._unloadable.pop(number, None)
                return result
            last = failed or last
            said = [p for p in problems if p is not None]
            if all(damage is not None for _, damage in said):
                self._unloadable[number] = said[0][1]
            for r, p in enumerate(problems):
                if p is not None and coord is not None and r != coord.rank:
                    failures.append(f"step {number} on rank {r}: {p[0]}")
                    log.warning(
                        "aiopersist: not restoring step %d: rank %d could not load it: %s", number, r, p[0]
                    )
        raise CheckpointCorruptError(
            f"no checkpoint in {tiers} could be restored:\n  " + "\n  ".join(failures)
        ) from last

    async def _restore_step(
        self, copies: list[StepInfo], into: object, backend: str, kwargs: dict[str, Any], failures: list[str]
    ) -> tuple[Any, BaseException | None, str, str | None]:
        """Load one step from the first of its ``copies`` (local, then mirror) that loads:
        (the state, ``None``, its path, ``None``), or (``None``, the last copy's error,
        ``""``, why its local copy is damaged, if that is what stopped it), each failure
        added to ``failures``. Errors that are not about the checkpoint are raised."""
        failed: BaseException | None = None
        local_damage: str | None = None
        for info in copies:
            key = _norm(info.path)
            self._reading.add(key)
            try:
                loaded = await load(self._sources(info), into=into, backend=backend, **kwargs)
                return loaded, None, info.path, None
            except (CheckpointCorruptError, CheckpointNotFoundError, CheckpointIOError) as exc:
                damage = isinstance(exc, CheckpointCorruptError) and not isinstance(exc, _NOT_DAMAGE)
                if info.tier == "local" and damage:
                    local_damage = str(exc)
                elif damage:
                    self._mirror_damaged.add(info.step)
                failures.append(f"step {info.step} ({info.tier}): {exc}")
                log.warning("aiopersist: not restoring %s: %s; trying the next one", info.path, exc)
                # Kept for its message and type only: its frames held the failed load's
                # tensors, as much memory again as the next step needs.
                _clear_frames(exc)
                failed = exc
            finally:
                self._reading.discard(key)
        return None, failed, "", local_damage

    # -- the end ------------------------------------------------------------------------

    @maps_os_errors("CheckpointManager.wait")
    async def wait(self) -> None:
        """Wait for the saves in flight, their retention and their mirroring."""
        self._check_loop()
        await self.checkpointer.wait()
        while pending := [t for t in self._tasks if not t.done()]:
            await asyncio.wait(pending)

    @maps_os_errors("CheckpointManager.aclose")
    async def aclose(self) -> None:
        """Finish what is in flight (saves, retention, mirror), then release the
        checkpointer if the manager made it. A second ``aclose`` while the first runs
        waits for it."""
        self._check_loop()
        if not self._closing.begin():
            await self._closing.wait()
            return
        self._closed = True
        try:
            await self.wait()
        except BaseException:
            # Cancelled (by the caller, or at interpreter exit): retention and mirroring stop
            # waiting (a deletion or copy already in a thread ends there, or is abandoned at
            # exit: both are crash-safe), and the saves in flight are cancelled.
            for task in list(self._tasks):
                task.cancel()
            if self._own:
                await self.checkpointer._abort()
            raise
        finally:
            try:
                if self._own:
                    await self.checkpointer.aclose()
            finally:
                self._unlock()
                self._closing.end()

    async def __aenter__(self) -> CheckpointManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _clear_frames(exc: BaseException) -> None:
    """Let go of the locals of every frame in the tracebacks of ``exc`` and of the errors
    it chains to (the lines stay, for the message)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


_NOT_DAMAGE = (LinkedFileError, NewerFormatError)
"""Load errors that refuse a checkpoint without proving it broken."""


def _restorable(info: StepInfo) -> StepInfo:
    """``info``, or, for a checkpoint `load` does not read (`UNLOADABLE_LAYOUTS`: a manager's
    directory may hold one, and retention and ``gc`` count it), the same marked incomplete
    for the restore, saying why (it is not damaged)."""
    why = UNLOADABLE_LAYOUTS.get(info.layout)
    return info if why is None else dataclasses.replace(info, complete=False, problem=why)


def _norm(path: str) -> str:
    return os.path.normpath(path)


def _steps_text(steps: Sequence[int]) -> str:
    """``step 3`` or ``steps 3, 4`` (for the log)."""
    return ("steps " if len(steps) > 1 else "step ") + ", ".join(map(str, steps))


def _resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail_quietly(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if fut.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        fut.cancel()
        return
    fut.set_exception(typed_error(exc, "CheckpointManager (retention and mirror)"))
    fut.exception()  # the error is on the handle for whoever asks; asyncio need not log it
