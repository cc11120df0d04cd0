"""``aiopersist inspect``, ``verify`` and ``convert``, run as a user runs them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import aiopersist
from aiopersist._cli.progress import human
from tests._forkserver import aiopersist_cli
from tests.conftest import flip_byte


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m aiopersist ARGS``, in a process forked from one that has imported torch
    and the Hugging Face libraries once (tests/_forkserver.py)."""
    return aiopersist_cli(*args)


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 64)
        self.head = torch.nn.Linear(64, 256)
        self.head.weight = self.emb.weight  # tied: saved once, as an alias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def _nested_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Tied()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([1, 2, 3])).sum().backward()
    optim.step()
    return {
        "model": model,
        "optim": optim,
        "step": 7,
        "loss": 0.25,
        "tag": "run-1",
        "mask": np.arange(10, dtype=np.int64),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A nested checkpoint (module with tied weights, optimizer, scalars, a numpy array)."""
    state = _nested_state()
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    aiopersist.save_sync(state, path, metadata={"step": "7"})
    return path, state


@pytest.fixture
def fresh_copy(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    """A copy of the checkpoint that a test may damage."""
    return Path(shutil.copytree(saved[0], tmp_path / "ckpt"))


def _row(out: str, name: str) -> list[str]:
    """The cells of the inspect table's row for tensor ``name``."""
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == name:
            return cells
    raise AssertionError(f"no row for {name!r} in:\n{out}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and bool(a == b)


# -- inspect ----------------------------------------------------------------------------------


def test_inspect_lists_tensors_aliases_and_totals(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    proc = _cli("inspect", str(path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"^kind\s+aiopersist$", out, re.M)
    assert re.search(r"^version\s+1$", out, re.M)
    assert re.search(r"^layout\s+state$", out, re.M)
    assert re.search(r"^created\s+\d{4}-\d\d-\d\dT", out, re.M)
    assert re.search(r"^metadata\s+step: 7$", out, re.M)
    checksum = json.loads((path / "aiopersist.json").read_text())["files"]["state.safetensors"]["checksum"]
    size = (path / "state.safetensors").stat().st_size
    assert re.search(rf"^\s+state\.safetensors\s+{re.escape(human(size))}\s+{checksum}$", out, re.M)
    assert _row(out, "model.emb.weight") == [
        "model.emb.weight",
        "F32",
        "[256, 64]",
        "64 KiB",
        "state.safetensors",
    ]
    assert _row(out, "model.head.weight")[-1] == "-> model.emb.weight"
    assert _row(out, "model.head.bias")[1:4] == ["F32", "[256]", "1 KiB"]
    assert _row(out, "optim.state.0.momentum_buffer")[1:3] == ["F32", "[256, 64]"]
    assert _row(out, "mask")[1:4] + _row(out, "mask")[-1:] == ["I64", "[10]", "80 B", "numpy array"]
    # 65536 + 1024 + 65536 + 1024 + 80 bytes
    assert re.search(r"^total: 6 tensors \(5 stored, 1 alias\), 130\.1 KiB of tensor data$", out, re.M)


def test_inspect_json(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    proc = _cli("inspect", "--json", str(path))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["kind"], doc["version"], doc["layout"], doc["metadata"]) == (
        "aiopersist",
        1,
        "state",
        {"step": "7"},
    )
    assert [f["name"] for f in doc["files"]] == ["state.safetensors"]
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["model.head.weight"]["alias_of"] == "model.emb.weight"
    assert tensors["model.head.weight"]["kind"] == "alias"
    assert tensors["model.emb.weight"]["shape"] == [256, 64]
    assert doc["totals"] == {
        "tensors": 6,
        "stored": 5,
        "aliases": 1,
        "views": 0,
        "storage_spans": 0,
        "bytes": 65536 + 1024 + 65536 + 1024 + 80,
    }


def test_inspect_plain_safetensors_file(tmp_path: Path) -> None:
    target = tmp_path / "weights.safetensors"
    save_file(
        {"a": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}, str(target), metadata={"k": "v"}
    )
    proc = _cli("inspect", str(target))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"^kind\s+safetensors$", out, re.M)
    assert re.search(r"^metadata\s+k: v$", out, re.M)
    assert _row(out, "a") == ["a", "F32", "[3, 4]", "48 B", "weights.safetensors"]
    assert _row(out, "b") == ["b", "BF16", "[5]", "10 B", "weights.safetensors"]
    assert re.search(r"^total: 2 tensors \(2 stored\), 58 B of tensor data$", out, re.M)


# -- verify -----------------------------------------------------------------------------------


def test_verify_ok(saved: tuple[Path, dict[str, Any]], backend_name: str) -> None:
    path, _ = saved
    proc = _cli("verify", "--backend", backend_name, str(path))
    size = (path / "state.safetensors").stat().st_size
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"ok: aiopersist, 1 file, {human(size)} checked"
    assert proc.stderr == ""  # no progress line: stderr is a pipe


def test_verify_detects_a_flipped_byte(fresh_copy: Path, backend_name: str) -> None:
    data = fresh_copy / "state.safetensors"
    with open(data, "r+b") as f:
        middle = os.path.getsize(data) // 2
        f.seek(middle)
        byte = f.read(1)[0]
        f.seek(middle)
        f.write(bytes([byte ^ 0x40]))
    proc = _cli("verify", "--backend", backend_name, str(fresh_copy))
    assert proc.returncode == 1
    assert proc.stdout.startswith("corrupt: ")
    assert str(data) in proc.stdout
    assert "checksum" in proc.stdout


def test_verify_of_a_file_inside_a_checkpoint_uses_its_manifest(fresh_copy: Path, backend_name: str) -> None:
    """A data file named on its own is checked against the checksums of the checkpoint
    around it (it used to get a header check, and a flipped byte passed)."""
    data = fresh_copy / "state.safetensors"
    proc = _cli("verify", "--backend", backend_name, str(data))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == (
        f"ok: safetensors, 1 file, {human(data.stat().st_size)} checked "
        "(checksums from the aiopersist checkpoint around it)"
    )
    flip_byte(data)
    proc = _cli("verify", "--backend", backend_name, str(data))
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"corrupt: {data}: checksum mismatch"), proc.stdout


def test_verify_detects_truncation(fresh_copy: Path) -> None:
    data = fresh_copy / "state.safetensors"
    os.truncate(data, os.path.getsize(data) - 100)
    proc = _cli("verify", str(fresh_copy))
    assert proc.returncode == 1
    assert proc.stdout.startswith("corrupt: ")
    assert str(data) in proc.stdout
    assert "truncated" in proc.stdout


def test_verify_and_inspect_take_a_file_named_metadata_for_a_file(tmp_path: Path, backend_name: str) -> None:
    """Only the DCP directories a checkpoint's saver wrote are read as DCP checkpoints:
    an extra file that happens to be named ``.metadata`` (in a subdirectory too) is a file
    like any other, checked by its checksum."""
    ck = tmp_path / "ck"
    extra = {"notes/.metadata": b"free text", "deeper/still/.metadata": b"more"}
    aiopersist.save_sync({"w": torch.ones(3)}, ck, extra_files=extra, backend=backend_name)
    proc = _cli("verify", "--backend", backend_name, str(ck))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok: aiopersist, 3 files")  # the data file and the two
    proc = _cli("inspect", str(ck))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "deeper/still/.metadata" in proc.stdout


def test_inspect_reports_a_subdirectory_replaced_by_a_link_without_following_it(tmp_path: Path) -> None:
    from aiopersist._cli.main import describe

    ck = tmp_path / "ck"
    aiopersist.save_sync({"w": torch.ones(3)}, ck, extra_files={"sub/deeper/x.json": b"{}"})
    os.rename(ck / "sub", tmp_path / "outside")
    os.symlink(tmp_path / "outside", ck / "sub")
    files = {f["name"]: f for f in describe(ck)["files"]}
    assert files["sub/deeper/x.json"]["problem"] == "sub is a symbolic link, not a subdirectory"
    assert files["model.safetensors"]["problem"] is None


def test_verify_missing_path(tmp_path: Path) -> None:
    proc = _cli("verify", str(tmp_path / "missing"))
    assert proc.returncode == 1
    assert proc.stdout.startswith("not found: ")


# -- convert ----------------------------------------------------------------------------------


def test_convert_to_safetensors(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, state = saved
    out = tmp_path / "flat.safetensors"
    proc = _cli("convert", str(path), "--to", "safetensors", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}: safetensors, 6 tensors" in proc.stdout
    loaded = load_file(str(out))
    expected = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for i, s in state["optim"].state_dict()["state"].items():
        expected[f"optim.state.{i}.momentum_buffer"] = s["momentum_buffer"]
    expected["mask"] = torch.from_numpy(state["mask"])
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    # The tied weight is written twice, as separate tensors.
    assert loaded["model.head.weight"].data_ptr() != loaded["model.emb.weight"].data_ptr()
    # A new file's usual mode (0666 less the umask), not the writer's private 0600.
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask


def test_convert_to_torch(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, _ = saved
    out = tmp_path / "state.pt"
    proc = _cli("convert", str(path), "--to", "torch", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "numpy arrays kept as numpy arrays: 1" in proc.stdout
    reconstruct = np.zeros(1).__reduce__()[0]
    allowed = [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.int64))]
    with torch.serialization.safe_globals(allowed):
        got = torch.load(out, weights_only=True)
    assert _same(aiopersist.load_sync(path), got)


def test_convert_refuses_an_existing_output(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, _ = saved
    out = tmp_path / "exists.safetensors"
    out.write_bytes(b"keep me")
    proc = _cli("convert", str(path), "--to", "safetensors", str(out))
    assert proc.returncode == 1
    assert "--force" in proc.stderr
    assert out.read_bytes() == b"keep me"
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left behind
    proc = _cli("convert", str(path), "--to", "safetensors", "--force", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "model.emb.weight" in load_file(str(out))


def test_convert_refuses_a_state_without_tensors(tmp_path: Path) -> None:
    aiopersist.save_sync({"step": 3, "name": "x"}, tmp_path / "ckpt")
    out = tmp_path / "out.safetensors"
    proc = _cli("convert", str(tmp_path / "ckpt"), "--to", "safetensors", str(out))
    assert proc.returncode == 1
    assert "holds no tensors" in proc.stderr
    assert not out.exists()


# -- progress ---------------------------------------------------------------------------------


def _cli_on_a_terminal(*args: str) -> tuple[int, str, str]:
    """Run the command with stderr on a pseudo-terminal (stdout a pipe): exit status,
    stdout, and what the terminal received."""
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aiopersist", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
        )
    finally:
        os.close(slave)
    received = bytearray()
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: every end of the terminal is closed
            break
        if not chunk:
            break
        received += chunk
    os.close(master)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    proc.stdout.close()
    return proc.wait(), out, received.decode()


def test_progress_is_drawn_on_a_terminal_and_never_in_a_pipe(tmp_path: Path) -> None:
    big = tmp_path / "big"
    aiopersist.save_sync({"w": torch.randn(6 << 20), "v": torch.arange(10)}, big)  # 24 MiB
    size = sum(p.stat().st_size for p in big.iterdir() if p.name != "aiopersist.json")

    rc, out, tty = _cli_on_a_terminal("verify", str(big))
    assert rc == 0, tty
    assert out.strip() == f"ok: aiopersist, 1 file, {human(size)} checked"
    # The last figures, from the bytes the checksum read, then a new line.
    assert f"\rverify: {human(size)} / {human(size)} (100%), " in tty
    assert tty.endswith("\r\n")  # the terminal's end of line
    piped = _cli("verify", str(big))
    assert (piped.returncode, piped.stdout, piped.stderr) == (0, out, "")

    for to, name in (("safetensors", "out.safetensors"), ("torch", "out.pt")):
        rc, out, tty = _cli_on_a_terminal("convert", str(big), "--to", to, str(tmp_path / name))
        assert rc == 0, tty
        written = (tmp_path / name).stat().st_size
        assert f"convert: {human(written)}" in tty, tty  # every byte written, counted
        piped = _cli("convert", str(big), "--to", to, "--force", str(tmp_path / name))
        assert piped.returncode == 0
        assert piped.stderr == ""
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["w"], aiopersist.load_sync(big)["w"])

    with aiopersist.BlockingCheckpointManager(tmp_path / "ck") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((1 << 18,), float(step))}).wait()
    rc, out, tty = _cli_on_a_terminal("gc", str(tmp_path / "ck"), "--keep-last", "1", "--apply")
    assert rc == 0, tty
    assert "deleting step-1" in out
    assert ", 2 of 2 deleted" in tty  # after each deletion
    assert "(100%)" in tty
    assert sorted(n for n in os.listdir(tmp_path / "ck") if n.startswith("step-")) == ["step-3"]
