"""backend="auto": io_uring where it works, threads otherwise, said once in the log."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tests._launch import run
from tests.conftest import URING_OK

SCRIPT = textwrap.dedent(
    """
    import asyncio, logging, tempfile, torch, aiopersist
    from aiopersist import _native
    logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
    print("native", _native.has_liburing)
    async def main():
        with tempfile.TemporaryDirectory() as d:
            for i in range(2):
                info = await aiopersist.save({"x": torch.arange(10)}, f"{d}/c{i}")
                print("backend", info.backend)
                assert torch.equal((await aiopersist.load(f"{d}/c{i}"))["x"], torch.arange(10))
        try:
            aiopersist.create_backend("io_uring")
        except aiopersist.BackendUnavailableError as exc:
            print("explicit", type(exc).__name__, exc)
    asyncio.run(main())
    """
)


def _run(env_extra: dict[str, str]) -> str:
    env = {**os.environ, **env_extra}
    proc = run([sys.executable, "-c", SCRIPT], text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_auto_falls_back_when_native_is_off() -> None:
    out = _run({"AIOPERSIST_NATIVE": "0"})
    assert "native False" in out
    assert out.count("backend threads") == 2
    assert out.count("LOG aiopersist: io_uring unavailable") == 1  # said once, not per save
    assert "AIOPERSIST_NATIVE=0" in out
    assert "explicit BackendUnavailableError" in out


@pytest.mark.skipif(not URING_OK, reason="io_uring unusable here")
def test_auto_picks_io_uring_when_it_works() -> None:
    out = _run({})
    assert out.count("backend io_uring") == 2
    assert "LOG" not in out
