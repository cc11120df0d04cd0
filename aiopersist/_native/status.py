"""Why io_uring cannot be used here, as one structured answer.

Two places find out: ``aiopersist._native`` when it imports the compiled module (was it
built, can the dynamic loader find ``liburing.so``, is it for this Python?), and
`probe_io_uring` when the kernel refuses to set up a ring. Both classify the failure where
it happens into an `UringUnavailable`: a `UringCause`, the original error's text, and what to do.
``aiopersist doctor``, ``probe_io_uring().reason``, `BackendUnavailableError` and the
fallback warning all print that same object.
"""

from __future__ import annotations

import enum
import errno as _errno
import importlib.machinery
import platform
import re
from dataclasses import dataclass
from pathlib import Path


class UringCause(enum.Enum):
    """Why io_uring is unusable in this process (``UringProbe.cause``)."""

    SWITCHED_OFF = "switched off"
    """``AIOPERSIST_NATIVE=0``."""
    NOT_BUILT = "not built"
    """The native module was never compiled: liburing's headers (liburing-dev) were
    missing when aiopersist was installed."""
    OTHER_PYTHON = "built for another Python"
    """A native module is there, but for another Python version or ABI."""
    LIBRARY_MISSING = "liburing library missing"
    """The native module is built, but the shared ``liburing.so.N`` it links cannot be
    loaded (the runtime package, such as liburing2, is not installed)."""
    LIBRARY_MISMATCH = "liburing library mismatch"
    """``liburing.so.N`` loads but lacks a symbol or version the module was built against."""
    LOAD_FAILED = "cannot load"
    """The native module exists but cannot be loaded for another reason."""
    KERNEL_NO_IO_URING = "kernel without io_uring"
    """``io_uring_setup`` fails with ENOSYS."""
    KERNEL_DISABLED = "disabled by sysctl"
    """``kernel.io_uring_disabled`` is 2, or 1 and this process is not in the allowed group."""
    KERNEL_DENIED = "denied by policy"
    """EPERM/EACCES with the sysctl allowing it: seccomp, a container's or an LSM's policy."""
    KERNEL_MEMLOCK = "out of locked memory"
    """ENOMEM: the locked-memory limit (kernels before 5.12 charge rings to it), or no memory."""
    KERNEL_FAILED = "kernel refused"
    """Any other failure of the kernel to set up a ring or to complete a NOP on it."""


@dataclass(frozen=True)
class UringUnavailable:
    """A classified failure: ``detail`` says what happened (keeping the original error's
    text), ``advice`` what to do about it."""

    cause: UringCause
    detail: str
    advice: str

    def __str__(self) -> str:
        return f"{self.detail}; {self.advice}"


HEADERS_ADVICE = (
    "install liburing-dev (Debian/Ubuntu) or liburing-devel (Fedora/RHEL), then reinstall aiopersist so "
    "that the module is compiled: pip install --force-reinstall --no-deps . in its source directory, "
    "or make setup in a clone"
)
REBUILD_ADVICE = (
    "reinstall aiopersist on this machine, for this Python, so that the module is compiled here: "
    "pip install --force-reinstall --no-deps . in its source directory, or make setup in a clone "
    "(liburing-dev needed)"
)

_MODULE = "_liburing"
_CANNOT_OPEN = re.compile(r"(\S+?): cannot open shared object file")
_LIBURING = re.compile(r"(?<![\w.])(liburing\.so(?:\.\d+)*)")


def switched_off() -> UringUnavailable:
    return UringUnavailable(
        UringCause.SWITCHED_OFF,
        "the native module is switched off (AIOPERSIST_NATIVE=0)",
        "unset AIOPERSIST_NATIVE (or set it to 1) before importing aiopersist to use io_uring",
    )


def _other_builds(native_dir: Path) -> list[str]:
    """Files that look like a build of the module but that this interpreter does not take."""
    ours = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return sorted(
        p.name
        for p in native_dir.glob(f"{_MODULE}.*")
        if p.name.endswith((".so", ".pyd")) and not any(p.name == _MODULE + s for s in ours)
    )


def classify_import_error(exc: ImportError, native_dir: Path, qualname: str) -> UringUnavailable:
    """Why ``import qualname`` (the compiled module, in ``native_dir``) failed."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ModuleNotFoundError) and exc.name == qualname:
        others = _other_builds(native_dir)
        if others:
            return UringUnavailable(
                UringCause.OTHER_PYTHON,
                f"the native io_uring module was built for another Python ({', '.join(others)} in "
                f"{native_dir}; this Python {platform.python_version()} loads "
                f"{', '.join(_MODULE + s for s in importlib.machinery.EXTENSION_SUFFIXES)})",
                REBUILD_ADVICE,
            )
        return UringUnavailable(
            UringCause.NOT_BUILT,
            "the native io_uring module was not built: liburing's headers (liburing-dev) were missing "
            "when aiopersist was installed",
            HEADERS_ADVICE,
        )
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        package = "cffi" if exc.name == "_cffi_backend" else exc.name
        return UringUnavailable(
            UringCause.LOAD_FAILED,
            f"the native io_uring module needs the Python module {exc.name}, which is missing ({text})",
            f"pip install {package}",
        )
    missing = _CANNOT_OPEN.search(text)
    if missing:
        library = missing.group(1)
        if Path(library).name.startswith("liburing"):
            return UringUnavailable(
                UringCause.LIBRARY_MISSING,
                f"the native io_uring module is built, but the shared library {library} it needs "
                f"cannot be loaded ({text})",
                f"install liburing's runtime package providing {library} (liburing2 on Debian/Ubuntu, "
                "liburing on Fedora/RHEL), or reinstall aiopersist against the liburing installed here",
            )
        return UringUnavailable(
            UringCause.LOAD_FAILED,
            f"the native io_uring module cannot be loaded: the shared library {library} is missing ({text})",
            f"install the package that provides {library}, or {REBUILD_ADVICE}",
        )
    if "undefined symbol" in text or re.search(r"version `[^']*' not found", text):
        soname = _LIBURING.search(text)
        where = soname.group(1) if soname else "liburing.so"
        return UringUnavailable(
            UringCause.LIBRARY_MISMATCH,
            f"the native io_uring module was built against a newer liburing than the {where} "
            f"installed here ({text})",
            f"upgrade liburing (liburing2) to the version it was built with, or {REBUILD_ADVICE}",
        )
    return UringUnavailable(
        UringCause.LOAD_FAILED,
        f"the native io_uring module cannot be loaded ({type(exc).__name__}: {text})",
        REBUILD_ADVICE,
    )


def _kernel_before(major: int, minor: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return found is not None and (int(found.group(1)), int(found.group(2))) < (major, minor)


def _under_seccomp() -> bool:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    found = re.search(r"^Seccomp:\s*(\d+)", status, re.M)
    return found is not None and found.group(1) != "0"


def _group() -> str:
    try:
        gid = Path("/proc/sys/kernel/io_uring_group").read_text().strip()
    except OSError:
        return "the group in kernel.io_uring_group"
    return f"the group kernel.io_uring_group={gid}"


def classify_setup_error(err: int, text: str, disabled_sysctl: int | None) -> UringUnavailable:
    """Why setting up a ring failed with ``err`` (an errno; ``text`` the error as raised),
    given ``kernel.io_uring_disabled`` (``None`` when the kernel has no such sysctl)."""
    refused = f"the kernel refused to set up an io_uring ({text})"
    if err == _errno.ENOSYS:
        return UringUnavailable(
            UringCause.KERNEL_NO_IO_URING,
            f"this kernel has no io_uring ({text}): it is older than 5.1, built without "
            "CONFIG_IO_URING, or a sandbox (such as gVisor) that does not provide it",
            "use a kernel of 5.6 or later with io_uring; the threads backend is used meanwhile",
        )
    if err in (_errno.EPERM, _errno.EACCES):
        if disabled_sysctl == 2:
            return UringUnavailable(
                UringCause.KERNEL_DISABLED,
                f"io_uring is disabled by sysctl kernel.io_uring_disabled=2 ({text})",
                "as root, sysctl -w kernel.io_uring_disabled=0 (or set it in /etc/sysctl.d); "
                "the threads backend is used meanwhile",
            )
        if disabled_sysctl == 1:
            return UringUnavailable(
                UringCause.KERNEL_DISABLED,
                f"io_uring is restricted by sysctl kernel.io_uring_disabled=1 to {_group()} ({text})",
                "run as a member of that group, or as root sysctl -w kernel.io_uring_disabled=0; "
                "the threads backend is used meanwhile",
            )
        who = (
            "a seccomp filter on this process (a container runtime's default profile, for one)"
            if _under_seccomp()
            else "a security policy (a container runtime's seccomp profile, SELinux, AppArmor)"
        )
        return UringUnavailable(
            UringCause.KERNEL_DENIED,
            f"{refused}: {who} denies io_uring_setup",
            "allow io_uring_setup, io_uring_enter and io_uring_register in that policy (for a container: "
            "docker run --security-opt seccomp=<a profile allowing them>); "
            "the threads backend is used meanwhile",
        )
    if err == _errno.ENOMEM:
        if _kernel_before(5, 12):
            return UringUnavailable(
                UringCause.KERNEL_MEMLOCK,
                f"{refused}: kernels before 5.12 charge a ring to the locked-memory limit "
                "(RLIMIT_MEMLOCK), which is too small",
                "raise it (ulimit -l unlimited, LimitMEMLOCK= in a systemd unit, docker run --ulimit "
                "memlock=-1) or use a kernel of 5.12 or later; the threads backend is used meanwhile",
            )
        return UringUnavailable(
            UringCause.KERNEL_MEMLOCK,
            f"{refused}: out of memory for the ring",
            "free memory or raise the locked-memory limit (ulimit -l); the threads backend is used meanwhile",
        )
    return UringUnavailable(
        UringCause.KERNEL_FAILED,
        refused,
        f"check the kernel's io_uring support and its log (dmesg) for why it answers "
        f"{_errno.errorcode.get(err, err)}; the threads backend is used meanwhile",
    )


def ring_broken(text: str) -> UringUnavailable:
    """A ring was set up, but a NOP on it did not complete as it should."""
    return UringUnavailable(
        UringCause.KERNEL_FAILED,
        f"an io_uring was set up but did not complete a NOP ({text})",
        "the kernel's io_uring is not usable here (see dmesg); the threads backend is used meanwhile",
    )
