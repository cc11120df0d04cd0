"""The package builds and works without liburing: the native module is optional."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import IS_ROOT

ROOT = Path(__file__).resolve().parents[2]
HEADER = Path("/usr/include/liburing.h")


@pytest.mark.root
@pytest.mark.slow
def test_wheel_without_liburing_headers_installs_and_falls_back(tmp_path: Path) -> None:
    if not IS_ROOT or shutil.which("unshare") is None:
        pytest.skip("hiding the liburing header needs root and unshare(1)")
    if not HEADER.exists():
        pytest.skip("liburing-dev is not installed: nothing to hide")
    out = tmp_path / "wheel"
    # In a private mount namespace, the header is replaced by an empty file: the C build
    # of the native module fails there, exactly as on a machine without liburing-dev.
    build = (
        f"mount --bind /dev/null {HEADER} && "
        f"{sys.executable} -m pip wheel -v --no-deps --no-build-isolation -w {out} {ROOT}"
    )
    proc = subprocess.run(["unshare", "-m", "sh", "-c", build], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "unshare failed" in proc.stderr:
        pytest.skip(f"no mount namespaces here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "installing without it" in proc.stdout + proc.stderr
    (wheel,) = out.glob("aiopersist-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "aiopersist/_native/binding.py" in names
    assert not [n for n in names if "_liburing" in n and n.endswith(".so")]

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    check = (
        "import asyncio, tempfile, torch, aiopersist\n"
        "from aiopersist import _native\n"
        "assert aiopersist.__file__.startswith(SITE), aiopersist.__file__\n"
        "print('native', _native.has_liburing)\n"
        "async def main():\n"
        "    with tempfile.TemporaryDirectory() as d:\n"
        "        info = await aiopersist.save({'x': torch.arange(5)}, d + '/c')\n"
        "        print('backend', info.backend)\n"
        "        assert torch.equal((await aiopersist.load(d + '/c'))['x'], torch.arange(5))\n"
        "asyncio.run(main())\n"
    ).replace("SITE", repr(str(site)))
    run = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,  # not the repository, whose aiopersist/ would shadow the wheel's
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "native False" in run.stdout
    assert "backend threads" in run.stdout
    # The warning of that fallback, and doctor in that install, say why and what to do.
    assert "io_uring unavailable, using the threads backend: the native io_uring module was not built" in (
        run.stderr
    )
    doctor = subprocess.run(
        [sys.executable, "-m", "aiopersist", "doctor", str(tmp_path)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        timeout=120,
    )
    assert doctor.returncode == 0, doctor.stderr
    assert "circular import" not in doctor.stdout
    assert re.search(
        r"^io_uring\s+unusable: the native io_uring module was not built: liburing's headers",
        doctor.stdout,
        re.M,
    )
    assert re.search(r"^liburing\s+not built$", doctor.stdout, re.M)
    assert re.search(r"^fix\s+install liburing-dev .*reinstall aiopersist", doctor.stdout, re.M)
