"""The classification of why io_uring is unusable, for the failures a test cannot cause for
real without touching the machine: a sysctl set for every process, a liburing older than
the one the module was built against. The texts are the dynamic loader's and the kernel's.
The situations that can be made for real are in tests/e2e/test_doctor.py."""

from __future__ import annotations

import errno
from pathlib import Path

from aiopersist import UringCause
from aiopersist._native.status import classify_import_error, classify_setup_error

QUAL = "aiopersist._native._liburing"


def test_the_sysctl_is_named_with_its_fix() -> None:
    off = classify_setup_error(errno.EPERM, "io_uring_queue_init: [Errno 1] Operation not permitted", 2)
    assert off.cause is UringCause.KERNEL_DISABLED
    assert "kernel.io_uring_disabled=2" in off.detail
    assert "[Errno 1] Operation not permitted" in off.detail
    assert "sysctl -w kernel.io_uring_disabled=0" in off.advice
    group = classify_setup_error(errno.EPERM, "io_uring_queue_init: [Errno 1] Operation not permitted", 1)
    assert group.cause is UringCause.KERNEL_DISABLED
    assert "kernel.io_uring_disabled=1" in group.detail
    assert "kernel.io_uring_group" in group.detail
    policy = classify_setup_error(errno.EACCES, "io_uring_queue_init: [Errno 13] Permission denied", 0)
    assert policy.cause is UringCause.KERNEL_DENIED
    assert "the threads backend is used meanwhile" in str(policy)


def test_an_unknown_errno_keeps_its_text() -> None:
    other = classify_setup_error(errno.EINVAL, "io_uring_queue_init: [Errno 22] Invalid argument", 0)
    assert other.cause is UringCause.KERNEL_FAILED
    assert "[Errno 22] Invalid argument" in other.detail
    assert "EINVAL" in other.advice


def test_an_older_runtime_liburing_is_a_mismatch_not_a_missing_module(tmp_path: Path) -> None:
    texts = [
        "/lib/x86_64-linux-gnu/liburing.so.2: version `LIBURING_2.4' not found "
        "(required by /site/aiopersist/_native/_liburing.abi3.so)",
        "/site/aiopersist/_native/_liburing.abi3.so: undefined symbol: io_uring_prep_openat",
    ]
    for text in texts:
        found = classify_import_error(ImportError(text), tmp_path, QUAL)
        assert found.cause is UringCause.LIBRARY_MISMATCH, text
        assert text in found.detail
        assert "liburing.so" in found.detail
        assert "liburing2" in found.advice


def test_a_missing_other_library_or_python_module_is_named(tmp_path: Path) -> None:
    lib = classify_import_error(
        ImportError("libfoo.so.1: cannot open shared object file: No such file or directory"), tmp_path, QUAL
    )
    assert lib.cause is UringCause.LOAD_FAILED
    assert "libfoo.so.1" in lib.detail
    cffi = classify_import_error(
        ModuleNotFoundError("No module named '_cffi_backend'", name="_cffi_backend"), tmp_path, QUAL
    )
    assert cffi.cause is UringCause.LOAD_FAILED
    assert cffi.advice == "pip install cffi"
    absent = classify_import_error(
        ModuleNotFoundError(f"No module named '{QUAL}'", name=QUAL), tmp_path, QUAL
    )
    assert absent.cause is UringCause.NOT_BUILT
