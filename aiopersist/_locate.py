"""What kind of checkpoint is at a path, and where its files are, checked before any read.

A path is an aiopersist checkpoint (a directory with ``aiopersist.json``), a Hugging Face
model directory (``model.safetensors``, or shards named by ``model.safetensors.index.json``)
or a single safetensors file. Everything the manifest or the index says is validated by
the pure parsers first (`parse_manifest`, `parse_index`); then every file they name is
checked to be a regular file, not a link, a FIFO or a device (``lstat``: a FIFO would hang
the reader, a link could lead anywhere), with the size the manifest states. Only then is
anything opened for reading, and then with ``O_NOFOLLOW``.

The one exception is a path the caller names directly: a safetensors file given as the
path may be a link (the Hugging Face cache links its snapshots to blobs); it is resolved
and must lead to a regular file.

A safetensors file, or a Hugging Face directory, inside an aiopersist checkpoint (named
directly, ``ck/model.safetensors``, or a directory that lost its manifest inside one) is
checked against the nearest manifest above it that lists it (`Located.records`): its size
here, its checksum as it is read. A manifest there that cannot be read refuses the load.

A checkpoint spread over several directories has its parts in ``part-<token>``
directories. Given only the checkpoint, they are found where the manifest says (relative
paths, checked to end in the part's own name). Given the list of directories the save was
given (as `CheckpointManager` does), they are found in those directories instead, never
where the manifest points: a copied or forked run reads its own parts, and a list of one
directory has none (a checkpoint that says it has parts elsewhere is not found whole).

A symbolic link where a file or directory of the checkpoint should be, or one file under
two names, is refused with `LinkedFileError`: nothing is read through it, but it is not
proof of damage (the data may be intact where it leads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from ._direct import DirectIOInfo, open_regular, probe_file_for_read
from ._exceptions import (
    AiopersistError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    LinkedFileError,
    NewerFormatError,
    from_os_error,
)
from ._format import load_json
from ._manifest import (
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_MEMBER_DEPTH,
    FileRecord,
    Manifest,
    member_directories,
    parse_index,
    parse_manifest,
)
from ._names import MANIFEST_NAME, MODEL_FILE, MODEL_INDEX, part_dir

log = logging.getLogger("aiopersist")

READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
"""Flags of every open of a checkpoint's file for reading (plus ``O_DIRECT`` where used)."""

PathArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def absolute_path(path: str | os.PathLike[str], what: str = "path") -> str:
    """``path`` made absolute. An empty path is refused (`CheckpointNotFoundError`, a
    ``FileNotFoundError``, as ``open("")`` and ``os.makedirs("")`` refuse it):
    ``os.path.abspath("")`` is the current directory, which a save with ``overwrite=True``
    would replace whole."""
    raw = os.fspath(path)
    if not raw:
        raise CheckpointNotFoundError(
            f"{what}: an empty path names no checkpoint or directory (it is not taken for the current one)"
        )
    return os.path.abspath(raw)


def checkpoint_paths(path: PathArg) -> list[str]:
    """``path`` as a list of absolute paths: the checkpoint, then its parts' directories."""
    if isinstance(path, str | os.PathLike):
        return [absolute_path(path)]
    paths = [absolute_path(p) for p in path]
    if not paths:
        raise ValueError("path: an empty list of directories")
    if len(set(paths)) != len(paths):
        raise ValueError(f"path: the same directory is listed twice: {paths}")
    return paths


@dataclass(frozen=True)
class Located:
    """A checkpoint found and checked (see the module docstring)."""

    kind: str
    """``manifest``, ``hf-dir`` or ``safetensors``."""
    directory: str
    files: tuple[str, ...]
    """Absolute paths of the data files (``hf-dir`` and ``safetensors``)."""
    manifest: Manifest | None
    dio: DirectIOInfo
    sizes: dict[str, int]
    """Size of each file: by name (``manifest``), by absolute path otherwise."""
    places: tuple[str, ...] = ()
    """``manifest``: the absolute directory of each of `Manifest.directories`."""
    records: dict[str, FileRecord] = dataclasses.field(default_factory=dict)
    """``hf-dir`` and ``safetensors``: the files that an aiopersist checkpoint around them
    lists, by path, with their records there (`records_above`): read whole and checked."""

    def path_of(self, rec: FileRecord) -> str:
        """Where a file of the manifest is."""
        return os.path.join(self.places[rec.directory], rec.name)


def _kind_of(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def file_problem(path: str, nbytes: int | None = None, root: str | None = None) -> str | None:
    """What is wrong with a file a checkpoint lists (``None``: a regular file, of
    ``nbytes`` bytes when given). Follows no link: neither the file, nor (given the
    directory ``root`` the file's name is relative to) a subdirectory on the way to it."""
    return _checked_file(path, nbytes, root)[0]


def _checked_file(
    path: str, nbytes: int | None = None, root: str | None = None
) -> tuple[str | None, os.stat_result | None, bool]:
    """`file_problem`, the file's ``lstat`` when there is none, and whether the problem is
    a symbolic link (on the way or the file itself: refused, not proof of damage)."""
    subdirectories = member_directories([os.path.relpath(path, root)]) if root is not None else []
    for sub in subdirectories:  # parents first
        place = os.path.join(root or "", sub)
        try:
            mode = os.lstat(place).st_mode
        except FileNotFoundError:
            return f"missing (no subdirectory {sub})", None, False
        except OSError as exc:
            raise from_os_error(exc, "lstat", place) from exc
        if not stat.S_ISDIR(mode):
            return f"{sub} is {_kind_of(mode)}, not a subdirectory", None, stat.S_ISLNK(mode)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing", None, False
    except OSError as exc:
        raise from_os_error(exc, "lstat", path) from exc
    if not stat.S_ISREG(st.st_mode):
        return f"{_kind_of(st.st_mode)}, not a regular file", None, stat.S_ISLNK(st.st_mode)
    if nbytes is not None and st.st_size != nbytes:
        return f"{st.st_size} bytes, the manifest says {nbytes} (truncated or replaced)", None, False
    return None, st, False


def regular_stat(path: str, where: str, nbytes: int | None = None) -> os.stat_result:
    """The ``lstat`` of ``path``, a regular file (not a link) of ``nbytes`` bytes when
    given; `CheckpointCorruptError` naming ``where`` (what listed it) otherwise
    (`LinkedFileError` for a link)."""
    problem, st, linked = _checked_file(path, nbytes)
    if problem == "missing":
        raise CheckpointCorruptError(f"{path}: missing ({where} lists it)")
    if problem is not None or st is None:
        raise (LinkedFileError if linked else CheckpointCorruptError)(f"{path}: {problem} ({where} lists it)")
    return st


def regular_size(path: str, where: str, nbytes: int | None = None) -> int:
    """The size of ``path``, a regular file (not a link) of ``nbytes`` bytes when given;
    `CheckpointCorruptError` naming ``where`` (what listed it) otherwise."""
    return regular_stat(path, where, nbytes).st_size


def distinct_files(found: Sequence[tuple[str, os.stat_result]], where: str) -> None:
    """No two of the files ``found`` (path and ``lstat``) are one file under two names (hard
    links, or one directory reached twice): `LinkedFileError` naming both. A load
    would read it, and allocate its size, once for each name (a tarball keeps the links:
    one file of 16 MiB under 100 names loaded as 1.6 GiB). Empty files are not read, and
    may be one."""
    seen: dict[tuple[int, int], str] = {}
    for path, st in found:
        if st.st_size == 0:
            continue
        first = seen.setdefault((st.st_dev, st.st_ino), path)
        if first != path:
            raise LinkedFileError(
                f"{path}: the same file as {first} (hard links): {where} lists one file under two names"
            )


def read_small(path: str, limit: int) -> bytes:
    """A small file (manifest, index) read whole: a regular file, not a link, at most
    ``limit`` bytes. Opened without blocking (a FIFO cannot hang it) or following links."""
    try:
        fd = open_regular(path, READ_FLAGS)
        if fd is None:
            raise CheckpointCorruptError(f"{path}: {_kind_of(os.lstat(path).st_mode)}, not a regular file")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LinkedFileError(f"{path}: a symbolic link, not a regular file") from None
        if exc.errno == errno.ENXIO:  # a socket cannot be opened: what it is, not an I/O error
            with contextlib.suppress(OSError):
                mode = os.lstat(path).st_mode
                if not stat.S_ISREG(mode):
                    raise CheckpointCorruptError(f"{path}: {_kind_of(mode)}, not a regular file") from None
        raise from_os_error(exc, "open", path) from exc
    try:
        if os.fstat(fd).st_size > limit:  # refused before reading any of it
            raise CheckpointCorruptError(f"{path}: larger than {limit} bytes")
        chunks = []
        total = 0
        while total <= limit:  # and if it grows meanwhile, no more than the limit is read
            chunk = os.read(fd, min(1 << 24, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise from_os_error(exc, "read", path) from exc
    finally:
        os.close(fd)
    if total > limit:
        raise CheckpointCorruptError(f"{path}: larger than {limit} bytes")
    return b"".join(chunks)


def read_json(path: str, limit: int) -> object:
    """A small JSON file of a checkpoint (a Trainer's ``trainer_state.json``) read with
    `read_small` (a regular file, not a link, at most ``limit`` bytes) and parsed with
    `load_json` (bounded values; `CheckpointCorruptError` naming ``path`` for anything
    that is not UTF-8 JSON, or nests too deep to parse)."""
    return load_json(read_small(path, limit), path)


def read_manifest(directory: str) -> Manifest:
    """The parsed, validated manifest of the checkpoint at ``directory`` (its files are not
    looked at)."""
    mpath = os.path.join(directory, MANIFEST_NAME)
    return parse_manifest(read_small(mpath, MAX_MANIFEST_BYTES), mpath)


def own_parts(paths: Sequence[str], token: str | None) -> list[str]:
    """The part directories of the save ``token`` in the directories ``paths[1:]`` (the
    places a save to ``paths`` put them): found by the token, never at a path a manifest
    gives."""
    return [] if token is None else [part_dir(p, token) for p in paths[1:]]


def token_at(directory: str) -> str | None:
    """The save token of the checkpoint at ``directory`` (``None``: none there, one
    directory only, or a manifest that cannot be read)."""
    try:
        return read_manifest(directory).token
    except (AiopersistError, OSError):
        return None


def part_places(primary: str, manifest: Manifest, given: Sequence[str] = ()) -> tuple[str, ...]:
    """The absolute directory of each of the manifest's directories: the checkpoint, then
    its parts, in the directories ``given`` (the save's list, the checkpoint's own first)
    when it is given, even a list of one (a checkpoint with files in more directories than
    that is then `CheckpointNotFoundError`), else where the manifest's relative paths lead
    (as for a directory past the list that holds none of its files: nothing is read there)."""
    places = [primary]
    used = {rec.directory for rec in manifest.files.values()}
    for i, rel in enumerate(manifest.directories[1:], 1):
        if given and (i < len(given) or i in used):
            if i >= len(given):
                raise CheckpointNotFoundError(
                    f"{primary}: the checkpoint has parts in {len(manifest.directories) - 1} more "
                    f"directories, {len(given) - 1} given"
                )
            places.append(os.path.join(given[i], os.path.basename(rel)))
        else:
            places.append(os.path.normpath(os.path.join(primary, rel)))
    return tuple(places)


def _check_part(place: str, where: str, what: str = "part directory") -> None:
    """``place`` is a directory itself, not a link to one (nothing the checkpoint lists
    may lead outside it)."""
    try:
        st = os.lstat(place)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{place}: missing ({where} lists this {what})") from None
    except OSError as exc:
        raise from_os_error(exc, "lstat", place) from exc
    if not stat.S_ISDIR(st.st_mode):
        error = LinkedFileError if stat.S_ISLNK(st.st_mode) else CheckpointCorruptError
        raise error(f"{place}: {_kind_of(st.st_mode)}, not a {what} ({where})")


def locate(path: PathArg) -> Located:
    """Find the checkpoint at ``path`` and check everything about it but its data (see the
    module docstring). ``path`` may be the list of directories it was saved to: its parts
    are then looked for there only (a list of one: it has none)."""
    listed = not isinstance(path, str | os.PathLike)
    paths = checkpoint_paths(path)
    target = paths[0]
    if os.path.basename(target) == MANIFEST_NAME and file_problem(target) is None:
        target = os.path.dirname(target)  # the manifest stands for its checkpoint
        paths[0] = target
    if os.path.isdir(target):
        mpath = os.path.join(target, MANIFEST_NAME)
        if os.path.lexists(mpath):
            manifest = read_manifest(target)
            places = part_places(target, manifest, paths if listed else ())
            for i in sorted({rec.directory for rec in manifest.files.values()} - {0}):
                _check_part(places[i], mpath)  # a directory the save wrote nothing to was not made
            by_directory: dict[int, list[str]] = {}
            for name, rec in manifest.files.items():
                by_directory.setdefault(rec.directory, []).append(name)
            for i, names in sorted(by_directory.items()):
                for sub in member_directories(names):  # parents first: no link on the way
                    _check_part(os.path.join(places[i], sub), mpath, "subdirectory")
            paths_of = {
                name: os.path.join(places[rec.directory], name) for name, rec in manifest.files.items()
            }
            found = [
                (paths_of[n], regular_stat(paths_of[n], mpath, r.nbytes)) for n, r in manifest.files.items()
            ]
            distinct_files(found, mpath)
            sizes = {name: st.st_size for name, (_, st) in zip(manifest.files, found, strict=True)}
            return Located("manifest", target, (), manifest, probe_file_for_read(mpath), sizes, places)
        index = os.path.join(target, MODEL_INDEX)
        if os.path.lexists(index):
            names = parse_index(read_small(index, MAX_INDEX_BYTES), index)
            files = tuple(os.path.join(target, n) for n in names)
            where = index
        elif os.path.lexists(os.path.join(target, MODEL_FILE)):
            files = (os.path.join(target, MODEL_FILE),)
            where = "the directory"
        else:
            raise CheckpointNotFoundError(f"{target}: no {MANIFEST_NAME}, {MODEL_FILE} or {MODEL_INDEX} here")
        found = [(f, regular_stat(f, where)) for f in files]
        distinct_files(found, where)
        sizes = {f: st.st_size for f, st in found}
        records = records_above(os.path.dirname(os.path.abspath(target)), {f: f for f in files}, sizes)
        return Located("hf-dir", target, files, None, probe_file_for_read(files[0]), sizes, records=records)
    if not os.path.lexists(target):
        raise CheckpointNotFoundError(f"{target}: no such checkpoint")
    # A file named by the caller: links are followed (the caller chose it), to a regular file.
    real = os.path.realpath(target)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{target}: a link to nothing") from None
    except OSError as exc:
        raise from_os_error(exc, "stat", real) from exc
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorruptError(f"{target}: {_kind_of(st.st_mode)}, not a checkpoint")
    sizes = {real: st.st_size}
    records = records_above(os.path.dirname(os.path.abspath(target)), {real: os.path.abspath(target)}, sizes)
    return Located(
        "safetensors", os.path.dirname(real), (real,), None, probe_file_for_read(real), sizes, records=records
    )


def records_above(start: str, named: dict[str, str], sizes: dict[str, int]) -> dict[str, FileRecord]:
    """The manifest records of files found without one (``named``: each file's path, to
    the path the caller reached it by), when they belong to an aiopersist checkpoint: the
    nearest directory from ``start`` up (at most `MAX_MEMBER_DEPTH` levels) that holds a
    manifest. Each file it lists in its own directory must have the listed size
    (``sizes``), and is checked as it is read; the others are read as they are. A
    manifest there that cannot be read raises (`CheckpointCorruptError`: what it would
    say of the file is unknown); a newer format's is passed over, said in the log."""
    d = start
    for _ in range(MAX_MEMBER_DEPTH + 1):
        if os.path.lexists(os.path.join(d, MANIFEST_NAME)):
            break
        parent = os.path.dirname(d)
        if parent == d:
            return {}
        d = parent
    else:
        return {}
    mpath = os.path.join(d, MANIFEST_NAME)
    try:
        manifest = read_manifest(d)
    except NewerFormatError as exc:
        log.warning("aiopersist: %s is read unchecked: the checkpoint around it is newer: %s", start, exc)
        return {}
    records = {}
    for f, via in named.items():
        rec = manifest.files.get(os.path.relpath(via, d))
        if rec is None or rec.directory != 0:
            continue
        if sizes[f] != rec.nbytes:
            raise CheckpointCorruptError(
                f"{via}: {sizes[f]} bytes, where {mpath} lists {rec.nbytes} (truncated or overwritten)"
            )
        records[f] = rec
    return records
