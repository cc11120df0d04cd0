"""Why io_uring is unusable, told apart and explained, in real processes: `aiopersist doctor`,
the fallback warning, `BackendUnavailableError` and ``probe_io_uring().problem``.

Each situation is made for real in a child process only: a copy of the package without
the compiled module (an install without liburing-dev), one with a module for another
Python, a private mount namespace where ``liburing.so.N`` is gone, and a seccomp filter
that makes ``io_uring_setup`` fail with a chosen errno.
"""

from __future__ import annotations

import errno
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

import aiopersist
from tests.conftest import IS_ROOT, needs_native

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "aiopersist" / "_native"
DENY = ROOT / "tests" / "_deny_io_uring.py"

# doctor, then the warning of backend="auto", the error of backend="io_uring" and the cause.
SCRIPT = textwrap.dedent(
    """
    import asyncio, logging, sys
    logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
    import aiopersist
    from aiopersist._cli.main import main
    assert main(["doctor", sys.argv[1]]) == 0
    async def backends():
        await aiopersist.create_backend("auto").aclose()
        try:
            aiopersist.create_backend("io_uring")
        except aiopersist.BackendUnavailableError as exc:
            print("explicit", exc)
    asyncio.run(backends())
    problem = aiopersist.probe_io_uring().problem
    print("cause", problem.cause.name if problem else None)
    print("module", aiopersist.__file__)
    """
)


def _report(tmp_path: Path, *, prefix: Sequence[str] = (), package: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "AIOPERSIST_NATIVE"}
    env["PYTHONPATH"] = str(package if package is not None else ROOT)
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # not the repository, whose aiopersist/ would shadow a copy
        timeout=120,
    )
    if proc.returncode == 77:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "circular import" not in out
    expected = (package if package is not None else ROOT) / "aiopersist" / "__init__.py"
    assert f"module {expected}" in out
    return out


def _row(out: str, key: str) -> str:
    found = re.search(rf"^{key}\s\s+(.*)$", out, re.M)
    assert found, (key, out)
    return found.group(1)


def _fell_back(out: str, cause: str, *said: str) -> None:
    """The three places say the same, and what to do."""
    assert f"cause {cause}" in out
    assert _row(out, "auto backend") == "threads"
    fix = _row(out, "fix")
    (warning,) = [
        line for line in out.splitlines() if line.startswith("LOG aiopersist: io_uring unavailable")
    ]
    assert warning.startswith("LOG aiopersist: io_uring unavailable, using the threads backend: ")
    (explicit,) = [line for line in out.splitlines() if line.startswith("explicit ")]
    for text in said:
        assert text in _row(out, "io_uring") + fix, text
        assert text in warning, text
        assert text in explicit, text
    assert fix in warning
    assert fix in explicit


def _copy_package(tmp_path: Path, native_files: dict[str, bytes]) -> Path:
    """The package's Python files, and in _native/ only ``native_files``."""
    site = tmp_path / "site"
    shutil.copytree(
        ROOT / "aiopersist", site / "aiopersist", ignore=shutil.ignore_patterns("__pycache__", "_liburing.*")
    )
    for name, data in native_files.items():
        (site / "aiopersist" / "_native" / name).write_bytes(data)
    return site


def test_an_install_without_liburing_headers_says_so_and_how_to_fix_it(tmp_path: Path) -> None:
    # What an install without liburing-dev leaves (tests/e2e/test_build.py builds one): no module.
    out = _report(tmp_path, package=_copy_package(tmp_path, {}))
    _fell_back(out, "NOT_BUILT", "not built", "headers", "liburing-dev", "--force-reinstall")
    assert _row(out, "liburing") == "not built"
    assert _row(out, "native module").startswith("unavailable: the native io_uring module was not built")


def test_a_module_for_another_python_is_named(tmp_path: Path) -> None:
    ours = sysconfig.get_config_var("EXT_SUFFIX")
    other_tag = f"cpython-3{sys.version_info.minor - 1}"
    theirs = ours.replace(f"cpython-3{sys.version_info.minor}", other_tag)
    if theirs == ours:
        pytest.skip(f"no version tag in this Python's extension suffix {ours!r}")
    built = sorted(NATIVE.glob("_liburing.*.so"))
    out = _report(
        tmp_path,
        package=_copy_package(tmp_path, {f"_liburing{theirs}": built[0].read_bytes() if built else b""}),
    )
    _fell_back(out, "OTHER_PYTHON", "another Python", f"_liburing{theirs}", "reinstall aiopersist")


def _liburing_path() -> Path:
    """The liburing.so this process loaded (through the native module)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if re.search(r"/liburing\.so[.\d]*$", path):
            return Path(path)
    raise AssertionError("liburing.so is not mapped although the native module is loaded")


@needs_native
@pytest.mark.root
def test_a_missing_liburing_runtime_library_is_named(tmp_path: Path) -> None:
    if not IS_ROOT or shutil.which("unshare") is None:
        pytest.skip("hiding liburing.so needs root and unshare(1)")
    libdir = _liburing_path().parent
    upper, work = tmp_path / "upper", tmp_path / "work"
    upper.mkdir()
    work.mkdir()
    # In a private mount namespace, an overlay of the library directory in which liburing's
    # files are deleted: there, as after `apt remove liburing2`, the loader cannot find it.
    hide = (
        f"mount -t overlay overlay -o lowerdir={libdir},upperdir={upper},workdir={work} {libdir} "
        f"|| {{ echo 'cannot mount an overlay here' >&2; exit 77; }}; "
        f'rm -f {libdir}/liburing.so*; exec "$@"'
    )
    out = _report(tmp_path, prefix=["unshare", "-m", "sh", "-c", hide, "sh"])
    soname = re.search(r"shared library (liburing\.so\.\d+) it needs", out)
    assert soname, out
    _fell_back(out, "LIBRARY_MISSING", soname.group(1), "cannot open shared object file", "liburing2")
    assert _row(out, "liburing") == "shared library missing at run time"
    assert "not built" not in out
    assert (libdir / soname.group(1)).exists()  # only hidden in the namespace


@needs_native
@pytest.mark.skipif(not aiopersist.probe_io_uring().usable, reason="io_uring is unusable here anyway")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="io_uring_setup is 425 there")
@pytest.mark.parametrize(
    ("err", "cause", "said"),
    [
        (errno.ENOSYS, "KERNEL_NO_IO_URING", ("has no io_uring", "Function not implemented", "5.6 or later")),
        (errno.EPERM, "KERNEL_DENIED", ("seccomp filter on this process", "io_uring_setup", "seccomp=")),
        (errno.ENOMEM, "KERNEL_MEMLOCK", ("Cannot allocate memory", "ulimit -l")),
    ],
)
def test_a_kernel_refusal_is_explained(tmp_path: Path, err: int, cause: str, said: tuple[str, ...]) -> None:
    out = _report(tmp_path, prefix=[sys.executable, str(DENY), str(err)])
    _fell_back(out, cause, *said, "the threads backend is used meanwhile")
    assert _row(out, "native module") == "built"
    assert _row(out, "liburing") == aiopersist.probe_io_uring().liburing_version
