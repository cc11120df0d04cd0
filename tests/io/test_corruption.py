"""Bad checkpoints on disk: every fault is a typed error naming the file, never a wrong tensor."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import aiopersist
from aiopersist._manifest import _canonical
from tests.conftest import flip_byte

pytestmark = pytest.mark.asyncio


async def _checkpoint(tmp_path: Path, backend_name: str) -> Path:
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(256, 256), "b": torch.randn(256)}, "step": 3}
    await aiopersist.save(state, tmp_path / "c", backend=backend_name)
    return tmp_path / "c"


def _rewrite_manifest(ckpt: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest and re-seal it, as a forger (or a buggy writer) would."""
    doc = json.loads((ckpt / "aiopersist.json").read_text())
    doc.pop("manifest_checksum")
    change(doc)
    doc["manifest_checksum"] = xxhash.xxh3_64_hexdigest(_canonical(doc))
    (ckpt / "aiopersist.json").write_text(json.dumps(doc))


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


async def _both_fail(
    ckpt: Path, backend_name: str, match: str, exc: type[Exception] = aiopersist.CheckpointCorruptError
) -> None:
    with pytest.raises(exc, match=match):
        await aiopersist.load(ckpt, backend=backend_name)
    with pytest.raises(exc, match=match):
        await aiopersist.verify(ckpt, backend=backend_name)


async def test_intact_checkpoint_verifies(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)
    report = await aiopersist.verify(ckpt, backend=backend_name)
    assert report.kind == "aiopersist"
    assert report.bytes_checked == (ckpt / "state.safetensors").stat().st_size


async def test_flipped_data_byte(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)
    _flip(ckpt / "state.safetensors", 4096 + 1000)
    await _both_fail(ckpt, backend_name, r"state\.safetensors: checksum mismatch")


async def test_flipped_header_byte(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)
    _flip(ckpt / "state.safetensors", 20)
    await _both_fail(ckpt, backend_name, r"state\.safetensors: checksum mismatch")


async def test_flipped_manifest_byte(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)
    raw = (ckpt / "aiopersist.json").read_bytes()
    at = raw.index(b'"step":3') + len(b'"step":')
    (ckpt / "aiopersist.json").write_bytes(raw[:at] + b"4" + raw[at + 1 :])  # still valid JSON
    await _both_fail(ckpt, backend_name, r"aiopersist\.json: manifest checksum mismatch")


async def test_a_header_that_disagrees_with_the_manifest_fails_verify(
    backend_name: str, tmp_path: Path
) -> None:
    """The file is intact (its checksum matches) but the manifest, resealed, cuts its data
    differently from the file's own header: a safetensors reader would see other tensors
    than aiopersist does, so verify refuses it."""
    ckpt = await _checkpoint(tmp_path, backend_name)

    def recut(doc: dict[str, Any]) -> None:
        b = doc["tensors"]["model.b"]  # 256 float32s: cut in two with the same bytes
        begin, end = b["offsets"]
        w = doc["tensors"]["model.w"]
        assert w["offsets"][1] == begin or w["offsets"][0] == end
        doc["tensors"]["model.b"] = {**b, "offsets": [begin, begin + 512], "shape": [128]}
        doc["tensors"]["model.c"] = {**b, "offsets": [begin + 512, end], "shape": [128]}
        doc["skeleton"]["model"]["c"] = {"__tensor__": "model.c"}

    _rewrite_manifest(ckpt, recut)
    with pytest.raises(aiopersist.CheckpointCorruptError, match="its header does not match the manifest"):
        await aiopersist.verify(ckpt, backend=backend_name)


async def test_truncated_file(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)
    f = ckpt / "state.safetensors"
    os.truncate(f, f.stat().st_size - 1)
    await _both_fail(ckpt, backend_name, r"state\.safetensors: \d+ bytes, the manifest says \d+")


async def test_missing_file(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)
    (ckpt / "state.safetensors").unlink()
    await _both_fail(ckpt, backend_name, r"state\.safetensors: missing")


async def test_newer_format_version(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)
    _rewrite_manifest(ckpt, lambda d: d.update(version=99))
    await _both_fail(ckpt, backend_name, r"format version 99 is newer")


@pytest.mark.parametrize("bad", [0, [], "", False, None, ["a"], {"k": 1}])
async def test_metadata_that_is_not_an_object_of_strings_is_refused(
    backend_name: str, tmp_path: Path, bad: object
) -> None:
    """The writer always writes an object: a falsy non-object (``0``, ``[]``) is as wrong
    as any other."""
    ckpt = await _checkpoint(tmp_path, backend_name)
    _rewrite_manifest(ckpt, lambda d: d.update(metadata=bad))
    await _both_fail(ckpt, backend_name, r"metadata must map strings to strings")


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "sub/dir.safetensors", ".."])
async def test_manifest_paths_cannot_escape(backend_name: str, tmp_path: Path, bad: str) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)

    def rename(doc: dict[str, Any]) -> None:
        doc["files"][bad] = doc["files"].pop("state.safetensors")
        for t in doc["tensors"].values():
            t["file"] = bad

    _rewrite_manifest(ckpt, rename)
    await _both_fail(ckpt, backend_name, r"would escape the checkpoint directory")


async def test_symlink_out_of_the_checkpoint(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)
    outside = tmp_path / "elsewhere.safetensors"
    (ckpt / "state.safetensors").rename(outside)
    (ckpt / "state.safetensors").symlink_to(outside)
    await _both_fail(ckpt, backend_name, r"state\.safetensors: a symbolic link, not a regular file")


async def test_offsets_past_the_file(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)

    def stretch(doc: dict[str, Any]) -> None:
        t = doc["tensors"]["model.b"]
        t["offsets"] = [t["offsets"][0] + 10**9, t["offsets"][1] + 10**9]

    _rewrite_manifest(ckpt, stretch)
    await _both_fail(ckpt, backend_name, r"tensors\['model\.b'\]\.offsets start at byte \d+ of 'state\.safet")


async def test_skeleton_pointing_nowhere(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)
    _rewrite_manifest(ckpt, lambda d: d["skeleton"]["model"].update(w={"__tensor__": "nope"}))
    with pytest.raises(aiopersist.CheckpointCorruptError, match="unknown tensor 'nope'"):
        await aiopersist.load(ckpt, backend=backend_name)


async def test_views_and_aliases_no_skeleton_names_are_not_made(backend_name: str, tmp_path: Path) -> None:
    """A manifest over two directories (version 2: only what the skeleton names is read)
    listing views and aliases that no skeleton names (re-sealed, as a forger or a buggy
    writer would leave it): load and a manager's restore used to raise a bare KeyError
    (restore then fell back to nothing); now the state the skeleton names loads, as
    verify passes it."""
    base = torch.arange(16.0).reshape(4, 4)
    state = {"w": torch.randn(8), "views": {"base": base, "tr": base.t(), "same": base}}
    dirs = [tmp_path / "d0" / "ck", tmp_path / "d1" / "ck"]
    await aiopersist.save(state, dirs, backend=backend_name)
    doc = json.loads((dirs[0] / "aiopersist.json").read_text())
    assert doc["version"] >= 2, doc  # the case at hand: views and aliases in a version 2
    assert doc["views"], doc
    assert doc["aliases"], doc
    _rewrite_manifest(dirs[0], lambda d: d["skeleton"].pop("views"))
    await aiopersist.verify(dirs[0], backend=backend_name)
    loaded = await aiopersist.load(dirs[0], backend=backend_name)
    assert list(loaded) == ["w"]
    assert torch.equal(loaded["w"], state["w"])


async def test_a_view_and_its_aliases_load_as_one_tensor(backend_name: str, tmp_path: Path) -> None:
    """What the skeleton names through views and aliases loads sharing memory as saved:
    an alias of a view is the view itself."""
    base = torch.arange(16.0).reshape(4, 4)
    tr = base.t()
    state = {"step": 1, "t": {"base": base, "tr": tr, "tr2": tr, "same": base}}  # a general state
    await aiopersist.save(state, tmp_path / "c", backend=backend_name)
    loaded = (await aiopersist.load(tmp_path / "c", backend=backend_name))["t"]
    assert loaded["tr"] is loaded["tr2"]
    assert loaded["same"] is loaded["base"]
    assert torch.equal(loaded["tr"], tr)
    loaded["base"][0, 1] = 100.0
    assert loaded["tr"][1, 0] == 100.0


async def test_not_json_manifest(backend_name: str, tmp_path: Path) -> None:
    ckpt = await _checkpoint(tmp_path, backend_name)
    (ckpt / "aiopersist.json").write_bytes(b"\x00garbage")
    await _both_fail(ckpt, backend_name, r"aiopersist\.json: not valid JSON")


async def test_absurd_header_length_in_plain_file(backend_name: str, tmp_path: Path) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    await _both_fail(f, backend_name, r"x\.safetensors: header length \d+ is absurd")


async def test_a_file_of_a_checkpoint_named_directly_is_checked_against_its_manifest(
    backend_name: str, tmp_path: Path
) -> None:
    """``load("ck/state.safetensors")`` reads the file as a plain safetensors file (no
    checksums of its own), but the manifest beside it lists it: it is read whole and
    checked against it. A flipped byte used to load as a wrong tensor."""
    ckpt = await _checkpoint(tmp_path, backend_name)
    f = ckpt / "state.safetensors"
    whole = await aiopersist.load(ckpt, backend=backend_name)
    flat = await aiopersist.load(f, backend=backend_name)
    assert torch.equal(flat["model.w"], whole["model"]["w"])
    report = await aiopersist.verify(f, backend=backend_name)
    assert report.bytes_checked == f.stat().st_size  # the whole file, not its header
    assert report.checksummed == (str(f),)
    flip_byte(f)
    with pytest.raises(aiopersist.CheckpointCorruptError, match=r"state\.safetensors: checksum mismatch"):
        await aiopersist.load(f, backend=backend_name)
    with pytest.raises(aiopersist.CheckpointCorruptError, match=r"state\.safetensors: checksum mismatch"):
        await aiopersist.verify(f, backend=backend_name)
    os.truncate(f, f.stat().st_size - 8)
    with pytest.raises(aiopersist.CheckpointCorruptError, match=r"where .*aiopersist\.json lists"):
        await aiopersist.load(f, backend=backend_name)


async def test_a_model_directory_inside_a_checkpoint_is_checked_against_its_manifest(
    backend_name: str, tmp_path: Path
) -> None:
    """A Hugging Face directory among a checkpoint's files (an extra file ``hf/model.safetensors``)
    loaded by its own path: the checkpoint's manifest lists its file, so it is checked."""
    w = torch.randn(64, 64)
    extra = {"hf/model.safetensors": aiopersist.SafetensorsSave({"w": w})}
    await aiopersist.save({"step": 1}, tmp_path / "c", backend=backend_name, extra_files=extra)
    hf = tmp_path / "c" / "hf"
    assert torch.equal((await aiopersist.load(hf, backend=backend_name))["w"], w)
    flip_byte(hf / "model.safetensors")
    with pytest.raises(aiopersist.CheckpointCorruptError, match="checksum mismatch"):
        await aiopersist.load(hf, backend=backend_name)


async def test_a_file_whose_checkpoint_manifest_is_damaged_or_gone(backend_name: str, tmp_path: Path) -> None:
    """Damaged, the manifest beside the file cannot say what the file should be: refused.
    Gone, there is nothing to check the file against: read as a plain file, as before."""
    ckpt = await _checkpoint(tmp_path, backend_name)
    f = ckpt / "state.safetensors"
    manifest = ckpt / "aiopersist.json"
    good = manifest.read_bytes()
    flip_byte(manifest)
    with pytest.raises(aiopersist.CheckpointCorruptError, match=r"aiopersist\.json"):
        await aiopersist.load(f, backend=backend_name)
    manifest.unlink()
    assert "model.w" in await aiopersist.load(f, backend=backend_name)
    manifest.write_bytes(good)
    assert "model.w" in await aiopersist.load(f, backend=backend_name)


async def test_corrupt_save_never_replaces_the_good_one(backend_name: str, tmp_path: Path) -> None:
    """overwrite=True with bad input: the old checkpoint stays, byte for byte."""
    ckpt = await _checkpoint(tmp_path, backend_name)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(aiopersist.UnsupportedStateError):
        await aiopersist.save({"bad": object()}, ckpt, backend=backend_name, overwrite=True)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["c"]
