"""The command line on checkpoints that claim more than they hold: each command checks
before it allocates or writes, and fails with a typed error naming the tensor, leaving
what exists untouched.

Every command runs in a process of its own under an address-space limit
(``RLIMIT_AS``) and a timeout, so that a regression fails the test instead of taking
the machine's memory or disk."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from safetensors import safe_open

import aiopersist
from aiopersist._manifest import _canonical

ROOT = Path(__file__).resolve().parents[2]
ADDRESS_SPACE = 8 << 30
"""What a command may map: far less than any claim below, far more than it needs."""

_RUN = """
import resource, sys
from aiopersist._cli.main import main
rc = main(sys.argv[1:])
sys.stdout.flush()
print(f"maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
sys.exit(rc)
"""


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _cli(*args: str) -> tuple[int, str, str, int]:
    """``aiopersist ARGS`` in a process of its own, its address space limited: exit
    status, stdout, stderr (without the last line) and its peak resident memory in bytes."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        preexec_fn=_limit,
    )
    err, _, last = proc.stderr.rstrip("\n").rpartition("\n")
    if not last.startswith("maxrss "):  # died before it could say
        return proc.returncode, proc.stdout, proc.stderr, -1
    return proc.returncode, proc.stdout, err, int(last.split()[1]) * 1024


def _viewed(path: Path, backend: str, elements: int) -> torch.Tensor:
    """A checkpoint of a 4-element tensor and a view of its first element ``elements``
    times (stride 0), as ``save`` writes one: 16 bytes stored."""
    base = torch.arange(4, dtype=torch.float32)
    aiopersist.save_sync({"m": {"huge": base[:1].expand(elements), "base": base}}, path, backend=backend)
    views = json.loads((path / "aiopersist.json").read_text())["views"]
    assert views["m.huge"]["stride"] == [0]
    return base


def _as_ndarray(path: Path, name: str) -> None:
    """The manifest re-sealed with ``name`` marked a numpy array, as a forger would."""
    manifest = path / "aiopersist.json"
    doc = json.loads(manifest.read_text())
    doc.pop("manifest_checksum")
    doc["skeleton"]["m"][name.split(".")[1]] = {"__ndarray__": name}
    doc["manifest_checksum"] = xxhash.xxh3_64_hexdigest(_canonical(doc))
    manifest.write_text(json.dumps(doc))


def _untouched(out: Path, before: dict[str, Any]) -> None:
    assert out.read_bytes() == b"keep me"
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(before)


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_convert_refuses_a_view_claiming_more_than_the_disk_holds(
    backend_name: str, tmp_path: Path, to: str
) -> None:
    ckpt = tmp_path / "ckpt"
    _viewed(ckpt, backend_name, 1 << 40)  # 4 TiB of float32, 16 bytes stored
    _as_ndarray(ckpt, "m.huge")  # torch.save pickles a numpy array whole: 4 TiB too
    out = tmp_path / "out" / "x"
    out.parent.mkdir()
    out.write_bytes(b"keep me")
    before = {p.name: p.stat() for p in out.parent.iterdir()}
    rc, _, err, _ = _cli("convert", str(ckpt), "--to", to, str(out), "--force", "--backend", backend_name)
    assert rc == 1, err
    assert err.count("\n") == 0, err  # one line, no traceback
    assert "'m.huge': 4 TiB, a view of 4 B of stored data" in err, err
    if to == "safetensors":
        assert "[Errno 28] writing it needs 4398046" in err, err
        assert "nothing was written" in err, err
    else:  # NotEnoughMemoryError
        assert "converting it to a torch.save file, which pickles its numpy arrays whole" in err, err
        assert "nothing was allocated" in err, err
    _untouched(out, before)


def test_convert_to_torch_keeps_a_view_a_view(backend_name: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    base = _viewed(ckpt, backend_name, 1 << 40)
    out = tmp_path / "x.pt"
    rc, _, err, _ = _cli("convert", str(ckpt), "--to", "torch", str(out), "--backend", backend_name)
    assert rc == 0, err
    got = torch.load(out, weights_only=True)
    assert got["m"]["huge"].shape == (1 << 40,)
    assert got["m"]["huge"].stride() == (0,)
    assert torch.equal(got["m"]["base"], base)
    assert out.stat().st_size < 1 << 20


def test_convert_refuses_a_view_larger_than_a_small_file_system(
    backend_name: str, small_fs: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    _viewed(ckpt, backend_name, 16 << 20)  # 64 MiB, in memory easily; the file system has 4 MiB
    out = small_fs / "x.safetensors"
    out.write_bytes(b"keep me")
    before = {p.name: p.stat() for p in small_fs.iterdir()}
    rc, _, err, _ = _cli(
        "convert", str(ckpt), "--to", "safetensors", str(out), "--force", "--backend", backend_name
    )
    assert rc == 1, err
    assert "[Errno 28] writing it needs 671" in err, err
    assert re.search(r"its file system has \d+ \(\d+\.\d MiB\) free", err), err
    assert "'m.huge': 64 MiB, a view of 4 B of stored data; nothing was written" in err, err
    _untouched(out, before)


def test_convert_writes_a_view_a_piece_at_a_time(backend_name: str, tmp_path: Path) -> None:
    """A view of one element claiming 256 MiB is written in full, without its 256 MiB
    ever being in memory: the peak is a small one's, and one piece."""
    peaks = []
    for elements in (1024, 64 << 20):
        ckpt = tmp_path / f"ckpt-{elements}"
        _viewed(ckpt, backend_name, elements)
        out = tmp_path / f"{elements}.safetensors"
        rc, _, err, peak = _cli(
            "convert", str(ckpt), "--to", "safetensors", str(out), "--backend", backend_name
        )
        assert rc == 0, err
        peaks.append(peak)
        with safe_open(str(out), "pt") as f:
            assert f.get_slice("m.huge").get_shape() == [elements]
            assert torch.equal(f.get_slice("m.huge")[elements - 3 :], torch.zeros(3))
            assert torch.equal(f.get_tensor("m.base"), torch.arange(4, dtype=torch.float32))
        out.unlink()
    assert peaks[1] - peaks[0] < 64 << 20, peaks  # one 16 MiB piece, and some slack


def test_convert_names_a_tensor_whose_name_safetensors_cannot_hold(tmp_path: Path) -> None:
    """A skeleton key that is a lone surrogate (JSON can hold one, UTF-8 cannot)."""
    ckpt = tmp_path / "ckpt"
    aiopersist.save_sync({"m": {"w": torch.ones(3)}}, ckpt)
    manifest = ckpt / "aiopersist.json"
    doc = json.loads(manifest.read_text())
    doc.pop("manifest_checksum")
    doc["skeleton"]["m"]["\ud800x"] = doc["skeleton"]["m"].pop("w")
    doc["manifest_checksum"] = xxhash.xxh3_64_hexdigest(_canonical(doc))
    manifest.write_text(json.dumps(doc))
    out = tmp_path / "x.safetensors"
    rc, _, err, _ = _cli("convert", str(ckpt), "--to", "safetensors", str(out))
    assert rc == 1, err
    assert "m.\\ud800x: a name a safetensors file cannot hold (not UTF-8)" in err, err
    assert not out.exists()
