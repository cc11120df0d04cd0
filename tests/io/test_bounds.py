"""Bounds on what a checkpoint may state, on both backends: a shape has at most
`MAX_DIMS` dimensions (refused by every reader, and by `save` before anything is
written); the JSON documents (manifest, index, safetensors header) are bounded before
they are parsed; one file is never read under two names; a load never allocates more
host memory than the machine has. Every refusal is a typed error naming the fault."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import aiopersist
from aiopersist import _format, _load, _manifest, _memory, _plan
from aiopersist._format import MAX_DIMS, MAX_JSON_ITEMS
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


# -- JSON documents ---------------------------------------------------------------------------


async def test_json_documents_of_too_many_values_are_refused_before_they_are_parsed(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest, an index or a header of 25 MB of empty objects (600 MB to parse) is
    refused from a count of its bytes; nothing parses it."""
    many = b"[" + b"{}," * MAX_JSON_ITEMS + b"{}]"
    ckpt = tmp_path / "c"
    await aiopersist.save({"w": torch.ones(4), "n": 1}, ckpt, backend=backend_name)
    manifest = (ckpt / "aiopersist.json").read_bytes()
    (ckpt / "aiopersist.json").write_bytes(manifest.replace(b'"metadata":{}', b'"metadata":' + many))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_bytes(
        b'{"weight_map":{"w":"a.safetensors"},"x":' + many + b"}"
    )
    header = b'{"w":' + many + b"}"
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    monkeypatch.setattr(json, "loads", _never)
    await _refused(ckpt, backend_name, r"aiopersist\.json: \d+ JSON objects, lists and commas, more than")
    await _refused(hf, backend_name, r"index\.json: \d+ JSON objects, lists and commas, more than")
    await _refused(tmp_path / "x.safetensors", backend_name, r"x\.safetensors: header: \d+ JSON objects")


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("parsed")


@pytest.mark.parametrize("document", ["manifest", "header"])
async def test_save_refuses_a_manifest_or_header_a_reader_would_refuse(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, document: str
) -> None:
    state = {"model": {f"w{i}": torch.ones(2) for i in range(100)}, "n": 1}
    await aiopersist.save(state, tmp_path / "ok", backend=backend_name)
    size = (tmp_path / "ok" / "aiopersist.json").stat().st_size
    module = _manifest if document == "manifest" else _format
    monkeypatch.setattr(_plan, "_PLANS", {})  # plans made under the real limits are kept
    monkeypatch.setattr(module, "MAX_MANIFEST_BYTES" if document == "manifest" else "MAX_JSON_ITEMS", 100)
    match = (
        "the manifest of these 100 tensors"
        if document == "manifest"
        else r"state\.safetensors: the safetensors header"
    )
    with pytest.raises(aiopersist.UnsupportedStateError, match=match):
        await aiopersist.save(state, tmp_path / "no", backend=backend_name)
    assert not (tmp_path / "no").exists()
    assert size > 100


# -- one file under two names -----------------------------------------------------------------


async def test_one_file_under_two_listed_names_is_refused(backend_name: str, tmp_path: Path) -> None:
    """Hard links (a tarball keeps them): every name passes every check on its own, and a
    load would read and allocate the file once per name. Nothing of an empty file is read:
    two names for one are harmless."""
    ckpt = tmp_path / "c"
    extra = {"a.txt": b"", "b.txt": b""}
    await aiopersist.save({"w": torch.zeros(1024), "n": 1}, ckpt, backend=backend_name, extra_files=extra)
    (ckpt / "b.txt").unlink()
    os.link(ckpt / "a.txt", ckpt / "b.txt")
    assert torch.equal((await aiopersist.load(ckpt, backend=backend_name))["w"], torch.zeros(1024))

    def forge(doc: dict[str, Any]) -> None:
        for i in range(3):
            os.link(ckpt / "state.safetensors", ckpt / f"s{i}.safetensors")
            doc["files"][f"s{i}.safetensors"] = dict(doc["files"]["state.safetensors"])
            doc["tensors"][f"w{i}"] = {**doc["tensors"]["w"], "file": f"s{i}.safetensors"}
            doc["skeleton"][f"w{i}"] = {"__tensor__": f"w{i}"}

    _rewrite_manifest(ckpt, forge)
    await _refused(
        ckpt,
        backend_name,
        r"c/s0\.safetensors: the same file as .*c/state\.safetensors \(hard links\): .*aiopersist\.json "
        "lists one file under two names",
    )


async def test_one_shard_under_two_names_in_an_index_is_refused(backend_name: str, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    header = json.dumps({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}).encode()
    (hf / "one.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    os.link(hf / "one.safetensors", hf / "two.safetensors")
    index = {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    await _refused(hf, backend_name, r"two\.safetensors: the same file as .*one\.safetensors \(hard links\)")


# -- host memory ------------------------------------------------------------------------------


def _sparse_checkpoint_claiming(ckpt: Path, nbytes: int) -> None:
    """A forged checkpoint whose one tensor claims ``nbytes``, in a sparse file (a few
    blocks on disk, a tiny tarball): its checksum can only fail once it is read."""

    def forge(doc: dict[str, Any]) -> None:
        f, t = doc["files"]["state.safetensors"], doc["tensors"]["w"]
        begin = t["offsets"][0]
        t.update(offsets=[begin, begin + nbytes], shape=[nbytes // 4])
        f["bytes"] = begin + nbytes
        os.truncate(ckpt / "state.safetensors", begin + nbytes)

    _rewrite_manifest(ckpt, forge)


def _never_allocate(*args: object, **kwargs: object) -> None:
    raise AssertionError("allocated")


async def test_a_load_that_needs_more_host_memory_than_is_available_is_refused_before_allocating(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "c"
    await aiopersist.save({"w": torch.zeros(1024), "n": 1}, ckpt, backend=backend_name)
    _sparse_checkpoint_claiming(ckpt, 256 << 20)
    monkeypatch.setattr(_memory, "available_bytes", lambda: 64 << 20)
    with monkeypatch.context() as m:
        m.setattr(_load, "_allocate", _never_allocate)
        for into in (None, {"w": torch.zeros(1)}):  # into= reads into host memory first too
            with pytest.raises(
                aiopersist.NotEnoughMemoryError, match=r"c: loading it needs 26\d+ bytes"
            ) as info:
                await aiopersist.load(ckpt, backend=backend_name, into=into)
            assert isinstance(info.value, MemoryError)
            assert (info.value.needed, info.value.available) == (_plan_bytes(ckpt), 64 << 20)
            assert "67108864 (0.1 GiB) are available" in str(info.value)
    # verify streams the files through the staging pool: it allocates none of it.
    with pytest.raises(aiopersist.CheckpointCorruptError, match="checksum mismatch"):
        await aiopersist.verify(ckpt, backend=backend_name)
    # The check can be turned off; the load then fails on the checksum.
    monkeypatch.setenv("AIOPERSIST_MEMORY_CHECK", "0")
    with pytest.raises(aiopersist.CheckpointCorruptError, match="checksum mismatch"):
        await aiopersist.load(ckpt, backend=backend_name)


def _plan_bytes(ckpt: Path) -> int:
    """What a load of ``ckpt`` allocates: the data file's header and its tensors."""
    doc = json.loads((ckpt / "aiopersist.json").read_text())
    return int(doc["files"]["state.safetensors"]["bytes"])


async def test_a_plain_safetensors_file_claiming_more_than_the_memory_available_is_refused(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [256 << 20], "data_offsets": [0, 256 << 20]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    os.truncate(path, 8 + len(header) + (256 << 20))
    monkeypatch.setattr(_memory, "available_bytes", lambda: 64 << 20)
    monkeypatch.setattr(_load, "_allocate", _never_allocate)
    with pytest.raises(
        aiopersist.NotEnoughMemoryError, match=rf"x\.safetensors: loading it needs {256 << 20} bytes"
    ):
        await aiopersist.load(path, backend=backend_name)
