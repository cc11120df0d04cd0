"""Bounds on what a checkpoint may state, on both backends: a shape has at most
`MAX_DIMS` dimensions (refused by every reader, and by `save` before anything is
written); the JSON documents (manifest, index, safetensors header) are bounded before
they are parsed; one file is never read under two names; a load never allocates more
host memory than the machine has. Every refusal is a typed error naming the fault."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import aiopersist
from aiopersist._format import MAX_DIMS
from tests.io.test_corruption import _rewrite_manifest

pytestmark = pytest.mark.asyncio


async def _refused(path: Any, backend: str, match: str) -> None:
    """load and verify both refuse, with CheckpointCorruptError matching ``match``."""
    with pytest.raises(aiopersist.CheckpointCorruptError, match=match):
        await aiopersist.load(path, backend=backend)
    with pytest.raises(aiopersist.CheckpointCorruptError, match=match):
        await aiopersist.verify(path, backend=backend)


# -- dimensions -------------------------------------------------------------------------------


async def test_save_takes_max_dims_dimensions_and_refuses_more(backend_name: str, tmp_path: Path) -> None:
    widest = torch.arange(6, dtype=torch.float32).reshape([2, 3] + [1] * (MAX_DIMS - 2))
    await aiopersist.save({"w": widest, "v": widest[1:]}, tmp_path / "ok", backend=backend_name)
    back = await aiopersist.load(tmp_path / "ok", backend=backend_name)
    assert torch.equal(back["w"], widest)
    assert torch.equal(back["v"], widest[1:])
    for state in ({"m": {"w": torch.zeros([1] * (MAX_DIMS + 1))}}, {"m": {"w": widest[None]}}):
        with pytest.raises(
            aiopersist.UnsupportedStateError,
            match=rf"state\['m'\]\['w'\]: its shape .* has {MAX_DIMS + 1} dim",
        ):
            await aiopersist.save(state, tmp_path / "no", backend=backend_name)
        assert not (tmp_path / "no").exists()


async def test_a_model_with_a_shape_of_too_many_dimensions_is_refused(
    backend_name: str, tmp_path: Path
) -> None:
    """The hf-model layout, and extra safetensors files, refuse it too."""
    with pytest.raises(aiopersist.UnsupportedStateError, match=rf"has {MAX_DIMS + 1} dimensions"):
        await aiopersist.save({"w": torch.zeros([1] * (MAX_DIMS + 1))}, tmp_path / "m", backend=backend_name)
    assert not (tmp_path / "m").exists()
    extra = {"x.safetensors": aiopersist.SafetensorsSave({"w": torch.zeros([1] * (MAX_DIMS + 1))})}
    with pytest.raises(ValueError, match=rf"'x\.safetensors'.*tensor 'w'.* has {MAX_DIMS + 1} dimensions"):
        await aiopersist.save({"n": 1}, tmp_path / "e", backend=backend_name, extra_files=extra)
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("dims", [[8] + [1] * MAX_DIMS, [1 << 62] * 200_000, [8] + [1] * 400_000])
async def test_a_manifest_shape_of_too_many_dimensions_is_refused(
    backend_name: str, tmp_path: Path, dims: list[int]
) -> None:
    ckpt = tmp_path / "c"
    await aiopersist.save({"model": {"b": torch.ones(8)}}, ckpt, backend=backend_name)
    _rewrite_manifest(ckpt, lambda d: d["tensors"]["model.b"].update(shape=dims))
    await _refused(
        ckpt, backend_name, rf"tensors\['model\.b'\]\.shape .* has {len(dims)} dimensions \(at most"
    )


async def test_a_header_shape_of_too_many_dimensions_is_refused(backend_name: str, tmp_path: Path) -> None:
    for dims in ([8] + [1] * MAX_DIMS, [1 << 62] * 200_000):
        header = json.dumps({"w": {"dtype": "U8", "shape": dims, "data_offsets": [0, 8]}}).encode()
        path = tmp_path / "x.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
        await _refused(
            path, backend_name, rf"x\.safetensors: tensor 'w' has an invalid shape .* has {len(dims)} dim"
        )
