from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

import aiopersist
from aiopersist import _native
from tests._launch import popen

URING_OK = aiopersist.probe_io_uring().usable
IS_ROOT = os.geteuid() == 0

BACKENDS = [
    pytest.param(
        "io_uring",
        marks=pytest.mark.skipif(
            not URING_OK, reason=f"io_uring unusable: {aiopersist.probe_io_uring().reason}"
        ),
    ),
    pytest.param("threads"),
]

needs_native = pytest.mark.skipif(not _native.has_liburing, reason=f"{_native.unavailable_reason}")


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_the_basetemp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The session's temporary files, and its child processes' (``torchrun`` leaves a
    ``torchelastic_*`` directory behind at each launch, the fork server its spool), go
    under pytest's base temporary directory, which pytest prunes (it keeps the last
    three runs'), instead of piling up in /tmp."""
    tmp = tmp_path_factory.mktemp("tmp", numbered=False)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # tempfile reads TMPDIR again
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest_asyncio.fixture
async def backend(backend_name: str) -> AsyncIterator[aiopersist.IOBackend]:
    be = aiopersist.create_backend(backend_name, queue_depth=8)
    try:
        yield be
    finally:
        await be.aclose()


@pytest.fixture(params=["direct", "buffered"])
def io_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Direct I/O where the file system takes it, and forced buffered I/O plus fsync."""
    if request.param == "buffered":
        monkeypatch.setenv("AIOPERSIST_DIRECT_IO", "0")
    return str(request.param)


@contextlib.contextmanager
def mounted_tmpfs(where: Path, *options: str) -> Iterator[Path]:
    """A real small file system for disk-full and read-only tests (root only)."""
    opts = ",".join(options)
    with _mounted(["-t", "tmpfs", "-o", opts, f"aiopersist-test-{uuid.uuid4().hex[:8]}"], where, "tmpfs"):
        yield where


@contextlib.contextmanager
def _mounted(args: list[str], where: Path, what: str) -> Iterator[None]:
    """``mount ARGS WHERE`` for the block (root only; skipped where it cannot be done)."""
    if not IS_ROOT:
        pytest.skip(f"mounting {what} needs root")
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", *args, str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount {what} here: {proc.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextlib.contextmanager
def bind_mounted(source: Path, where: Path) -> Iterator[Path]:
    """``source`` bind-mounted at ``where`` (root only): the same file system and device
    number, but a rename across it fails with ``EXDEV``."""
    with _mounted(["--bind", str(source)], where, "a bind mount"):
        yield where


@contextlib.contextmanager
def mounted_image(where: Path, size: int, fstype: str = "ext4") -> Iterator[Path]:
    """A real file system of ``size`` bytes made by ``mkfs.<fstype>`` in an image file and
    loop-mounted (root only): unlike tmpfs, ext4 and ext2 take ``O_DIRECT``, so the
    direct-I/O write path meets their limits (ext2 cannot ``fallocate``)."""
    image = where.with_name(where.name + ".img")
    with open(image, "wb") as f:
        f.truncate(size)
    proc = subprocess.run([f"mkfs.{fstype}", "-q", "-F", str(image)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot make an {fstype} file system here: {proc.stderr.strip()}")
    with _mounted(["-o", "loop", str(image)], where, f"a loop-mounted {fstype} image"):
        (where / "lost+found").rmdir()  # an empty file system, as a tmpfs one
        yield where


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB file system that fills up fast: tmpfs (buffered writes: it does not take
    ``O_DIRECT``) and ext4 (direct writes, about 2.4 MiB free)."""
    if request.param == "tmpfs":
        with mounted_tmpfs(tmp_path / "small", "size=4m", "mode=0755") as p:
            yield p
    else:
        with mounted_image(tmp_path / "small", 4 << 20) as p:
            yield p


@pytest.fixture(params=["checked", "unchecked"])
def space_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A save's free-space check before it writes (``checked``: a full disk is refused
    before anything is written), or none (``unchecked``, AIOPERSIST_SPACE_CHECK=0: the
    write itself meets ENOSPC, as when others fill the disk meanwhile)."""
    monkeypatch.setenv("AIOPERSIST_SPACE_CHECK", "1" if request.param == "checked" else "0")
    return str(request.param)


@pytest.fixture
def readonly_fs(tmp_path: Path) -> Iterator[Path]:
    """A read-only file system: even root cannot create files there."""
    with mounted_tmpfs(tmp_path / "ro", "ro", "size=1m") as p:
        yield p


@contextlib.contextmanager
def fifo_opened_after(fifo: Path, seconds: float = 10.0) -> Iterator[threading.Event]:
    """Within the block, a thread stands ready to open ``fifo`` for writing (and write a
    few bytes) if the block has not ended after ``seconds``: code that must never block
    opening a FIFO then fails on a regression instead of hanging. Yields the event set
    when the writer had to open it: assert it is not set (nothing waited for a writer)."""
    stop = threading.Event()
    opened = threading.Event()

    def unblock() -> None:
        if not stop.wait(seconds):
            opened.set()
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"x" * 64)
            os.close(fd)

    threading.Thread(target=unblock, daemon=True).start()
    try:
        yield opened
    finally:
        stop.set()


def run_forking_script(script: str, env: dict[str, str] | None = None, timeout: float = 60) -> str:
    """Run ``python -c script`` (which forks) in a session of its own, so that a child that
    hangs on a regression is killed with it; its stdout, once it exited 0."""
    import signal
    import sys

    proc = popen(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[1],
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    return out


class Gate:
    """An object that holds the thread pickling it (``torch.save`` of it, in a `TorchSave`)
    until ``go`` is set: a save that stays in flight until the test lets it go."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        self.entered.set()
        self.go.wait(30)
        return (int, (0,))


GATE_KEY = "aiopersist-test-gate"


@pytest.fixture
def gated_torch_save(monkeypatch: pytest.MonkeyPatch) -> Gate:
    """A `Gate` for snapshot mode, which serializes any object it cannot rebuild (a `Gate`
    too) before ``staged``: ``torch.save`` of a dict holding `GATE_KEY` (a plain state
    dict, so copied and written after ``staged``) waits for the gate, then runs as usual."""
    gate = Gate()
    real = torch.save

    def save(obj: object, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(obj, dict) and GATE_KEY in obj:
            gate.entered.set()
            gate.go.wait(30)
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return gate


DEEP_TREE_DEPTH = sys.getrecursionlimit() + 200  # deeper than a recursive walk can go


@pytest.fixture
def deep_trees_removed(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``, emptied after the test without recursion: a deep tree that a failed
    test left would make pytest's own cleanup of old temporary directories fail later."""
    yield tmp_path
    from aiopersist._commit import remove_path

    for name in os.listdir(tmp_path):
        remove_path(str(tmp_path / name))


def deep_tree(root: Path, depth: int = DEEP_TREE_DEPTH) -> None:
    """``root/d/d/.../d`` with a file at every level, made relative to an open directory
    (its path would pass PATH_MAX)."""
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
            fd, above = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
            os.close(above)
    finally:
        os.close(fd)


def flip_byte(path: str | os.PathLike[str]) -> None:
    """One byte in the middle of the file at ``path`` flipped, in place (damage as a
    disk's bit rot makes it: the size stays, the checksum fails)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
