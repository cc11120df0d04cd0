"""Tunables, in one place.

Each knob has a default and an ``AIOPERSIST_*`` environment override (read when the knob
is asked for, so tests can set it); an explicit argument to an API always wins.
"""

from __future__ import annotations

import os

_MiB = 1 << 20


def _env_int(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw, 0)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(
            f"environment variable {name}={raw!r} must be "
            + ("positive" if minimum == 1 else f"at least {minimum}")
        )
    return value


def queue_depth() -> int:
    """Requests in flight per ring (and worker threads for the threads backend)."""
    return _env_int("AIOPERSIST_QUEUE_DEPTH", 32)


def chunk_bytes() -> int:
    """Size of one staging buffer, and so of one write or read request."""
    return _env_int("AIOPERSIST_CHUNK_BYTES", 4 * _MiB)


def staging_buffers() -> int:
    """Staging buffers per file stream: one fills while the others are written."""
    return _env_int("AIOPERSIST_STAGING_BUFFERS", 8)


def staging_keep_bytes() -> int:
    """Idle staging memory kept between saves and loads for the next one to reuse
    (``AIOPERSIST_STAGING_KEEP_BYTES``; default one default pool, 32 MiB; 0 keeps none)."""
    return _env_int("AIOPERSIST_STAGING_KEEP_BYTES", chunk_bytes() * staging_buffers(), minimum=0)


def shard_bytes() -> int:
    """Largest safetensors file a save writes before starting the next (5 GB, the default of
    ``save_pretrained`` before transformers 5, which has 50 GB)."""
    return _env_int("AIOPERSIST_SHARD_BYTES", 5 * 1000**3)


def native_enabled() -> bool:
    """``AIOPERSIST_NATIVE=0`` turns the compiled io_uring module off, as if it were not built."""
    return os.environ.get("AIOPERSIST_NATIVE", "1").strip().lower() not in {"0", "false", "no", "off"}


DEFAULT_ALIGNMENT = 4096
"""Direct-I/O alignment assumed when the kernel does not report one (``STATX_DIOALIGN``)."""


def direct_io_enabled() -> bool:
    """``AIOPERSIST_DIRECT_IO=0`` forces buffered I/O plus fsync even where ``O_DIRECT`` works."""
    return os.environ.get("AIOPERSIST_DIRECT_IO", "1").strip().lower() not in {"0", "false", "no", "off"}


def memory_check_enabled() -> bool:
    """``AIOPERSIST_MEMORY_CHECK=0`` lets a load allocate more host memory than the system
    reports available (where its estimate is wrong: memory that is not counted as
    available but can be had)."""
    return os.environ.get("AIOPERSIST_MEMORY_CHECK", "1").strip().lower() not in {"0", "false", "no", "off"}


def space_check_enabled() -> bool:
    """``AIOPERSIST_SPACE_CHECK=0`` lets a save start writing files bigger than the free
    space its file system reports (where the report is wrong: a compressing or
    deduplicating file system); the write then fails with ``ENOSPC`` when the space runs
    out, as it does when others fill the disk meanwhile."""
    return os.environ.get("AIOPERSIST_SPACE_CHECK", "1").strip().lower() not in {"0", "false", "no", "off"}


def preallocate_enabled() -> bool:
    """``AIOPERSIST_PREALLOCATE=0`` lets a direct write of a file whose size is known
    allocate its blocks as it goes, instead of all at its start (`preallocate`): on ext4
    the requests then run one at a time."""
    return os.environ.get("AIOPERSIST_PREALLOCATE", "1").strip().lower() not in {"0", "false", "no", "off"}


def snapshot_bytes() -> int:
    """Most host memory ``Checkpointer(mode="snapshot")`` may copy a state into."""
    return _env_int("AIOPERSIST_SNAPSHOT_BYTES", 8 << 30)


def dist_timeout() -> float:
    """Seconds a distributed save waits for the other ranks at each exchange."""
    return float(_env_int("AIOPERSIST_DIST_TIMEOUT", 600))


def exit_grace() -> float:
    """Seconds a blocking facade still open at interpreter exit (a crash, Ctrl-C, a script
    that never closed it) gives its saves in flight to finish before they are abandoned
    (``AIOPERSIST_EXIT_GRACE``; 0 abandons at once). An abandoned save leaves no
    checkpoint, only a temporary directory that the next start removes."""
    raw = os.environ.get("AIOPERSIST_EXIT_GRACE")
    if raw is None or raw == "":
        return 30.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable AIOPERSIST_EXIT_GRACE={raw!r} is not a number") from None
    if not value >= 0:
        raise ValueError(f"environment variable AIOPERSIST_EXIT_GRACE={raw!r} must be 0 or more")
    return value
