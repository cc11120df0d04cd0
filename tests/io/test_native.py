"""The cffi binding itself: calls, return-code checks, typed errors with errno."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import aiopersist
from tests.conftest import needs_native

pytestmark = needs_native


def _binding():  # type: ignore[no-untyped-def]
    from aiopersist._native import binding

    return binding


def test_version_is_reported() -> None:
    assert _binding().liburing_version() not in ("", None)


def test_queue_init_error_carries_errno() -> None:
    b = _binding()
    with pytest.raises(aiopersist.CheckpointIOError) as info:
        b.io_uring_queue_init(0)  # zero entries: EINVAL from the kernel
    assert info.value.errno == errno.EINVAL
    assert info.value.call == "io_uring_queue_init"
    assert isinstance(info.value, OSError)


def _wait(b, ring):  # type: ignore[no-untyped-def]
    b.io_uring_submit(ring)
    user_data, res = b.io_uring_wait_cqe(ring)
    b.io_uring_cqe_seen(ring)
    return user_data, res


def test_write_read_fsync_round_trip(tmp_path: Path) -> None:
    b = _binding()
    ring = b.io_uring_queue_init(8)
    try:
        fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
        try:
            data = os.urandom(10_000)
            sqe = b.io_uring_get_sqe(ring)
            keep = b.io_uring_prep_write(sqe, fd, data, 0)
            b.io_uring_sqe_set_data64(sqe, 7)
            assert _wait(b, ring) == (7, len(data))
            del keep
            sqe = b.io_uring_get_sqe(ring)
            b.io_uring_prep_fsync(sqe, fd)
            b.io_uring_sqe_set_data64(sqe, 8)
            assert _wait(b, ring) == (8, 0)
            out = bytearray(len(data))
            sqe = b.io_uring_get_sqe(ring)
            keep = b.io_uring_prep_read(sqe, fd, out, 0)
            b.io_uring_sqe_set_data64(sqe, 9)
            assert _wait(b, ring) == (9, len(data))
            del keep
            assert bytes(out) == data
        finally:
            os.close(fd)
    finally:
        b.io_uring_queue_exit(ring)


def test_bad_fd_completes_with_ebadf() -> None:
    b = _binding()
    ring = b.io_uring_queue_init(4)
    try:
        sqe = b.io_uring_get_sqe(ring)
        b.io_uring_prep_write(sqe, 9999, b"x", 0)
        b.io_uring_sqe_set_data64(sqe, 1)
        assert _wait(b, ring) == (1, -errno.EBADF)
    finally:
        b.io_uring_queue_exit(ring)


def test_eventfd_registration_signals_completion(tmp_path: Path) -> None:
    b = _binding()
    ring = b.io_uring_queue_init(4)
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        b.io_uring_register_eventfd(ring, efd)
        sqe = b.io_uring_get_sqe(ring)
        b.io_uring_prep_nop(sqe)
        b.io_uring_sqe_set_data64(sqe, 5)
        b.io_uring_submit(ring)
        assert os.eventfd_read(efd) >= 1
        assert b.io_uring_peek_batch_cqe(ring) == [(5, 0)]
        b.io_uring_cq_advance(ring, 1)
        assert b.io_uring_peek_cqe(ring) is None
        b.io_uring_unregister_eventfd(ring)
    finally:
        os.close(efd)
        b.io_uring_queue_exit(ring)


def test_statx_dioalign(tmp_path: Path) -> None:
    b = _binding()
    f = tmp_path / "f"
    f.write_bytes(b"")
    got = b.statx_dioalign(str(f))
    if got is not None:  # the kernel or file system may not report it
        mem, off = got
        assert mem > 0
        assert off > 0
        assert (off & (off - 1)) == 0
    with pytest.raises(aiopersist.CheckpointIOError) as info:
        b.statx_dioalign(str(tmp_path / "missing"))
    assert info.value.errno == errno.ENOENT


def test_the_binding_has_no_functions_the_engine_does_not_use() -> None:
    """A binding function no engine code calls is dead weight (registered buffers were
    removed: the staging pool is shared by the saves of several rings)."""
    import inspect

    b = _binding()
    root = Path(aiopersist.__file__).parent
    engine = "".join(p.read_text() for p in root.rglob("*.py") if p.parent.name != "_native")
    public = [
        n
        for n, f in inspect.getmembers(b, inspect.isfunction)
        if f.__module__ == b.__name__ and not n.startswith("_")
    ]
    # Kept for the tests' own probing of the kernel: the non-blocking peek, the teardown.
    kept = ("io_uring_peek_cqe", "io_uring_unregister_eventfd")
    unused = [n for n in public if n not in engine and n not in kept]
    assert unused == []
