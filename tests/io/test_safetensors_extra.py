"""`SafetensorsSave` extra files (a second model's ``model_1.safetensors``): streamed
from the tensors, read by safetensors itself with the values saved, checksummed in the
manifest, staged and snapshotted like the checkpoint's own tensors; what safetensors
cannot hold is refused, naming the file and the tensor, before anything is written."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import aiopersist
from aiopersist import SafetensorsSave

pytestmark = pytest.mark.asyncio


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(64, 48)
    pair = torch.arange(10.0)
    return {
        "weight": torch.randn(300, 257),  # a length that is no multiple of anything
        "transposed": base.t(),  # not contiguous: gathered, not copied whole
        "half": torch.randn(33).to(torch.bfloat16),
        "first": pair[:5],  # two disjoint slices of one storage: safetensors takes them
        "second": pair[5:],
        "empty": torch.empty(0, 3),
        "conj": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),  # a lazy view
        "count": torch.tensor(7),
    }


def _expected(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.resolve_conj().clone() for k, v in tensors.items()}


async def test_read_by_safetensors_with_the_values_saved_and_checksummed(
    backend_name: str, tmp_path: Path
) -> None:
    tensors = _tensors()
    await aiopersist.save(
        {"w": torch.ones(3)},
        tmp_path / "ck",
        backend=backend_name,
        extra_files={"model_1.safetensors": SafetensorsSave(tensors, {"format": "pt"})},
    )
    path = tmp_path / "ck" / "model_1.safetensors"
    loaded = load_file(path)
    expected = _expected(tensors)
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert loaded[k].dtype == v.dtype, k
        assert torch.equal(loaded[k], v), k
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    report = await aiopersist.verify(tmp_path / "ck")
    assert str(path) in report.files
    # The manifest's checksum covers the file: a flipped byte is found.
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(aiopersist.CheckpointCorruptError, match=r"model_1\.safetensors"):
        await aiopersist.verify(tmp_path / "ck")


@pytest.mark.parametrize("mode", ["fence", "snapshot"])
async def test_a_checkpointer_stages_and_snapshots_them_like_its_own(
    backend_name: str, tmp_path: Path, mode: str
) -> None:
    """Once ``staged``, the tensors may change: the file holds them as they were."""
    tensors = _tensors()
    expected = _expected(tensors)
    async with aiopersist.Checkpointer(backend=backend_name, mode=mode) as ck:
        handle = await ck.save(
            {"w": torch.ones(3)},
            tmp_path / "ck",
            extra_files={"model_1.safetensors": SafetensorsSave(tensors)},
        )
        await handle.staged
        for t in tensors.values():
            if t.dtype.is_floating_point and t.numel():
                t.add_(100)  # training goes on
        await handle.done
    loaded = load_file(tmp_path / "ck" / "model_1.safetensors")
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k


def _sparse() -> Any:
    return torch.eye(3).to_sparse()


_BASE = torch.arange(6.0)


@pytest.mark.parametrize(
    ("content", "error", "says"),
    [
        (SafetensorsSave({"a": torch.ones(2), "b": None}), TypeError, "'b' is a NoneType"),  # type: ignore[dict-item]
        (SafetensorsSave({1: torch.ones(2)}), TypeError, "must be a str"),  # type: ignore[dict-item]
        (SafetensorsSave({"s": _sparse()}), TypeError, "'s' is a torch.sparse_coo tensor"),
        (SafetensorsSave({"q": torch.ones(2, dtype=torch.complex128)}), TypeError, "'q' has dtype"),
        (SafetensorsSave({"a": _BASE[:4], "b": _BASE[2:]}), ValueError, "'a' and 'b' share memory"),
        (SafetensorsSave({"a": torch.ones(2)}, {"format": 1}), TypeError, "metadata"),  # type: ignore[dict-item]
        (SafetensorsSave([torch.ones(2)]), TypeError, "mapping"),  # type: ignore[arg-type]
    ],
    ids=["not-a-tensor", "name-not-str", "sparse", "dtype", "shared-memory", "metadata", "not-a-mapping"],
)
async def test_what_safetensors_cannot_hold_is_refused_before_anything_is_written(
    backend_name: str, tmp_path: Path, content: SafetensorsSave, error: type[Exception], says: str
) -> None:
    """An existing checkpoint stays as it was (``overwrite=True`` does not get to replace it)."""
    await aiopersist.save({"kept": torch.arange(3.0)}, tmp_path / "ck", backend=backend_name)
    before = sorted(os.listdir(tmp_path / "ck"))
    with pytest.raises(error) as info:
        await aiopersist.save(
            {"w": torch.ones(3)},
            tmp_path / "ck",
            backend=backend_name,
            overwrite=True,
            extra_files={"model_1.safetensors": content},
        )
    assert "model_1.safetensors" in str(info.value)
    assert says in str(info.value)
    assert sorted(os.listdir(tmp_path / "ck")) == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary directory left either
    assert torch.equal((await aiopersist.load(tmp_path / "ck"))["kept"], torch.arange(3.0))


async def test_blocking_facade_writes_them_too(tmp_path: Path) -> None:
    def save() -> None:
        with aiopersist.BlockingCheckpointer() as ck:
            ck.save(
                {"w": torch.ones(3)},
                tmp_path / "ck",
                extra_files={"m.safetensors": SafetensorsSave({"x": torch.arange(4)})},
            ).wait()

    await asyncio.to_thread(save)
    assert torch.equal(load_file(tmp_path / "ck" / "m.safetensors")["x"], torch.arange(4))
