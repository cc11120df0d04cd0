"""I/O backends: selection, the io_uring probe, and one shared backend per event loop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import platform
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from .. import _knobs, _native
from .._exceptions import BackendUnavailableError, CheckpointIOError
from .._native.status import UringCause, UringUnavailable, classify_setup_error, ring_broken
from ._base import IOBackend, to_thread_to_the_end, wait_uncancellable
from ._threads import ThreadsBackend

log = logging.getLogger("aiopersist")

BackendName = Literal["auto", "io_uring", "threads"]
BACKEND_NAMES: tuple[str, ...] = ("auto", "io_uring", "threads")


@dataclass(frozen=True)
class UringProbe:
    """Whether io_uring works in this process, and if not, why and what to do.

    ``reason`` is one sentence: what works, or what failed followed by the fix. When
    unusable, ``problem`` holds the same as fields: its ``cause`` (a
    [`UringCause`][aiopersist.UringCause]), ``detail`` (with the original error's text)
    and ``advice``.
    """

    usable: bool
    reason: str
    liburing_version: str | None
    problem: UringUnavailable | None = None


_probe_cache: UringProbe | None = None
_fallback_logged = False


def _unusable(problem: UringUnavailable, version: str | None) -> UringProbe:
    return UringProbe(False, str(problem), version, problem)


def probe_io_uring() -> UringProbe:
    """Check that io_uring really works here: build a ring and complete a NOP on it.

    The kernel can refuse at several levels (``kernel.io_uring_disabled``, seccomp, gVisor
    or an old kernel), so the only honest probe is to try; a refusal is classified by its
    errno. The answer is cached.
    """
    global _probe_cache
    if _probe_cache is None:
        _probe_cache = _probe()
    return _probe_cache


def _probe() -> UringProbe:
    if _native.unavailable is not None:
        return _unusable(_native.unavailable, None)
    from .._native import binding as uring

    version = uring.liburing_version()
    try:
        ring = uring.io_uring_queue_init(4)
    except CheckpointIOError as exc:
        return _unusable(
            classify_setup_error(exc.errno or errno.EIO, str(exc), uring.io_uring_disabled_sysctl()), version
        )
    try:
        sqe = uring.io_uring_get_sqe(ring)
        if sqe is None:
            raise RuntimeError("no submission entry on a fresh ring")
        uring.io_uring_prep_nop(sqe)
        uring.io_uring_sqe_set_data64(sqe, 42)
        uring.io_uring_submit(ring)
        user_data, res = uring.io_uring_wait_cqe(ring)
        uring.io_uring_cqe_seen(ring)
        if user_data != 42 or res != 0:
            raise RuntimeError(f"NOP completed wrongly (user_data={user_data}, res={res})")
    except (CheckpointIOError, RuntimeError) as exc:
        return _unusable(ring_broken(str(exc)), version)
    finally:
        uring.io_uring_queue_exit(ring)
    return UringProbe(True, f"io_uring works (liburing {version}, kernel {platform.release()})", version)


def resolve_backend_name(name: str) -> str:
    """Turn ``"auto"`` into the backend that works here; check explicit names.

    ``"io_uring"`` when it is unusable raises `BackendUnavailableError` with the
    reason; ``"auto"`` falls back to ``"threads"`` and says so once in the log.
    """
    global _fallback_logged
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
    if name == "threads":
        return name
    probe = probe_io_uring()
    if probe.usable:
        return "io_uring"
    if name == "io_uring":
        raise BackendUnavailableError(f"io_uring backend unavailable: {probe.reason}")
    if not _fallback_logged:
        _fallback_logged = True
        log.warning("aiopersist: io_uring unavailable, using the threads backend: %s", probe.reason)
    return "threads"


def create_backend(name: str = "auto", *, queue_depth: int | None = None) -> IOBackend:
    """A new backend owned by the caller (close it with ``aclose``). Call inside a running loop."""
    resolved = resolve_backend_name(name)
    depth = queue_depth if queue_depth is not None else _knobs.queue_depth()
    if resolved == "io_uring":
        from ._uring import UringBackend

        return UringBackend(depth)
    return ThreadsBackend(depth)


@dataclass(eq=False)
class _Shared:
    backend: IOBackend
    users: int = 0


_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int], _Shared]] = (
    weakref.WeakKeyDictionary()
)


@contextlib.asynccontextmanager
async def open_backend(name: str = "auto", *, queue_depth: int | None = None) -> AsyncIterator[IOBackend]:
    """The event loop's shared backend of that kind, as an async context manager.

    ``async with open_backend("auto") as backend: ...`` — one ring per loop however many
    saves and loads use it at once; closed when its last user leaves.
    """
    resolved = resolve_backend_name(name)
    depth = queue_depth if queue_depth is not None else _knobs.queue_depth()
    loop = asyncio.get_running_loop()
    table = _shared.setdefault(loop, {})
    key = (resolved, depth)
    entry = table.get(key)
    if entry is None:
        entry = table[key] = _Shared(create_backend(resolved, queue_depth=depth))
    entry.users += 1
    try:
        yield entry.backend
    finally:
        entry.users -= 1
        if entry.users == 0:
            if table.get(key) is entry:
                del table[key]
            await entry.backend.aclose()


_LIBURING_ROW = {
    UringCause.SWITCHED_OFF: "not loaded (AIOPERSIST_NATIVE=0)",
    UringCause.NOT_BUILT: "not built",
    UringCause.LIBRARY_MISSING: "shared library missing at run time",
    UringCause.LIBRARY_MISMATCH: "the installed library is older than the module's",
}


def describe_platform() -> dict[str, str]:
    """What ``aiopersist doctor`` reports about the kernel and the native module; a ``fix``
    row says what to do when io_uring is unusable."""
    probe = probe_io_uring()
    problem, native = probe.problem, _native.unavailable
    if probe.liburing_version is not None:
        liburing = probe.liburing_version
    elif native is not None:
        liburing = _LIBURING_ROW.get(native.cause, "unknown (the native module is not loaded)")
    else:
        liburing = "unknown"
    rows = {
        "kernel": f"{platform.system()} {platform.release()}",
        "io_uring": "usable" if probe.usable else f"unusable: {problem.detail if problem else probe.reason}",
        "liburing": liburing,
        "native module": "built" if native is None else f"unavailable: {native.detail}",
        "auto backend": "io_uring" if probe.usable else "threads",
    }
    if problem is not None:
        rows["fix"] = problem.advice
    rows["queue depth"] = str(_knobs.queue_depth())
    return rows


__all__ = [
    "BACKEND_NAMES",
    "BackendName",
    "IOBackend",
    "ThreadsBackend",
    "UringCause",
    "UringProbe",
    "UringUnavailable",
    "create_backend",
    "describe_platform",
    "open_backend",
    "probe_io_uring",
    "resolve_backend_name",
    "to_thread_to_the_end",
    "wait_uncancellable",
]
