"""Extra files in subdirectories of a checkpoint (a tokenizer's
``additional_chat_templates/``, a save hook's ``unet/config.json``): written durably,
listed and checked by the manifest, copied to a mirror; names that would escape the
checkpoint, or clash, are refused before anything is written; a link put in place of one
of the subdirectories is refused on load."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import aiopersist
from aiopersist import _commit, _save
from aiopersist._manager import copy_step
from aiopersist.integrations._common import files_written_by
from tests.conftest import deep_tree

pytestmark = pytest.mark.asyncio

FILES = {
    "top.json": b"{}",
    "additional_chat_templates/tool_use.jinja": b"{{ tools }}",
    "unet/config.json": b'{"layers": 2}',
    "unet/deeper/still/weights.pt": aiopersist.TorchSave({"w": torch.arange(6.0)}),
}


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


async def test_extra_files_in_subdirectories_are_saved_listed_and_checked(
    backend_name: str, tmp_path: Path
) -> None:
    ck = tmp_path / "ck"
    info = await aiopersist.save({"w": torch.ones(4)}, ck, extra_files=FILES, backend=backend_name)
    assert set(FILES) <= set(info.files)
    assert _tree(ck) == {*FILES, "model.safetensors", "aiopersist.json"}
    manifest = json.loads((ck / "aiopersist.json").read_text())
    assert manifest["version"] == 3  # a version 2 reader takes names one subdirectory deep
    assert set(FILES) <= set(manifest["files"])
    assert (ck / "unet" / "config.json").read_bytes() == b'{"layers": 2}'
    w = torch.load(ck / "unet" / "deeper" / "still" / "weights.pt", weights_only=True)["w"]
    assert torch.equal(w, torch.arange(6.0))
    assert torch.equal((await aiopersist.load(ck, backend=backend_name))["w"], torch.ones(4))
    report = await aiopersist.verify(ck, backend=backend_name)
    assert set(FILES) <= {str(Path(f).relative_to(ck)) for f in report.files}

    (ck / "unet" / "config.json").write_bytes(b'{"layers": 3}')  # damaged in a subdirectory
    with pytest.raises(aiopersist.CheckpointCorruptError, match=r"unet/config\.json"):
        await aiopersist.verify(ck, backend=backend_name)


@pytest.mark.parametrize(
    ("files", "version"),
    [({"top.json": b"{}"}, 1), ({"templates/tool.jinja": b"{}"}, 2), ({"a/b/c.json": b"{}"}, 3)],
)
async def test_the_format_version_is_the_oldest_that_reads_the_names(
    backend_name: str, tmp_path: Path, files: dict[str, bytes], version: int
) -> None:
    ck = tmp_path / "ck"
    await aiopersist.save({"w": torch.ones(4)}, ck, extra_files=files, backend=backend_name)
    assert json.loads((ck / "aiopersist.json").read_text())["version"] == version
    await aiopersist.verify(ck, backend=backend_name)


async def test_the_subdirectories_are_made_durable(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each subdirectory's entry in its parent, and its own entries once its files are
    written, are fsynced before the checkpoint is published."""
    synced: list[str] = []
    real = _commit.fsync_directory

    def record(path: str) -> None:
        synced.append(os.path.basename(os.path.abspath(path)))
        real(path)

    monkeypatch.setattr(_commit, "fsync_directory", record)
    monkeypatch.setattr(_save, "fsync_directory", record)
    await aiopersist.save({"w": torch.ones(4)}, tmp_path / "ck", extra_files=FILES, backend=backend_name)
    for d in ("additional_chat_templates", "unet", "deeper", "still"):
        assert d in synced, d  # its own entries
    # The parents of the new directories: the temporary checkpoint, unet, deeper.
    assert sum(name.startswith(".ck.aiopersist-tmp-") for name in synced) >= 2


async def test_a_mirror_copy_keeps_the_subdirectories(backend_name: str, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    await aiopersist.save({"w": torch.ones(4)}, ck, extra_files=FILES, backend=backend_name)
    copy = Path(copy_step(ck, str(tmp_path / "mirror"), 7))
    assert _tree(copy) == _tree(ck)
    await aiopersist.verify(copy, backend=backend_name)


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"../escape.json": b""}, "would escape the checkpoint directory"),
        ({"a/../../escape.json": b""}, "would escape the checkpoint directory"),
        ({"/abs/x.json": b""}, "would escape the checkpoint directory"),
        ({"a//x.json": b""}, "would escape the checkpoint directory"),
        ({"a/": b""}, "would escape the checkpoint directory"),
        ({"a": b"", "a/b.json": b""}, "'a' is a file and also the directory that holds 'a/b.json'"),
        ({"model.safetensors/x": b""}, "'model.safetensors' is a file and also the directory"),
        ({"aiopersist.json": b""}, "a name the checkpoint itself uses"),
        ({"aiopersist.json/x": b""}, "'aiopersist.json' is a file and also the directory"),
        ({"pickled.bin/x": b""}, "'pickled.bin' is a file and also the directory"),
        ({"model.safetensors.index.json/x": b""}, "'model.safetensors.index.json' is a file and also"),
        ({"a/" * 17 + "f": b""}, "deeper than 16 subdirectories"),
        ({"a/" * 1000 + "f": b""}, "deeper than 16 subdirectories"),
        ({("x" * 200 + "/") * 6 + "f": b""}, "longer than 1024 bytes"),
        ({"x" * 256: b""}, "is not a name a file can have"),
        ({"t/\ud800.json": b""}, "is not a name a file can have"),
    ],
)
async def test_bad_names_are_refused_before_anything_is_written(
    backend_name: str, tmp_path: Path, files: dict[str, bytes], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        await aiopersist.save({"w": torch.ones(4)}, tmp_path / "ck", extra_files=files, backend=backend_name)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("swapped", ["unet", "unet/deeper", "unet/deeper/still"])
async def test_a_link_in_place_of_a_subdirectory_is_refused(
    backend_name: str, tmp_path: Path, swapped: str
) -> None:
    """A subdirectory at any depth replaced by a link to a copy of itself: the files
    behind it match their checksums, but nothing the checkpoint lists may lead outside
    it, so load and verify refuse it."""
    ck = tmp_path / "ck"
    await aiopersist.save({"w": torch.ones(4)}, ck, extra_files=FILES, backend=backend_name)
    os.rename(ck / swapped, tmp_path / "outside")
    os.symlink(tmp_path / "outside", ck / swapped)
    for act in (aiopersist.load, aiopersist.verify):
        with pytest.raises(
            aiopersist.CheckpointCorruptError, match=f"{swapped}: a symbolic link, not a subdirectory"
        ):
            await act(ck, backend=backend_name)


def _writes(kind: str) -> Callable[[str], None]:
    def write(directory: str) -> None:
        os.makedirs(os.path.join(directory, "sub", "deeper"))
        Path(directory, "sub", "deeper", "ok.json").write_text("{}")
        if kind == "link":
            os.symlink("/etc/hostname", os.path.join(directory, "sub", "link"))
        elif kind == "fifo":
            os.mkfifo(os.path.join(directory, "sub", "fifo"))
        elif kind == "empty":
            os.mkdir(os.path.join(directory, "sub", "empty"))
        elif kind == "deep":
            deep = os.path.join(directory, *["d"] * 17)
            os.makedirs(deep)
            Path(deep, "f.json").write_text("{}")
        elif kind == "very deep":  # deeper than a recursive walk (or removal) can go
            deep_tree(Path(directory, "sub", "deeper", "tree"))

    return write


async def test_files_written_for_a_checkpoint_are_read_by_their_paths(tmp_path: Path) -> None:
    files = await asyncio.to_thread(files_written_by, _writes("plain"), str(tmp_path / "ck"))
    assert files == {"sub/deeper/ok.json": b"{}"}
    assert os.listdir(tmp_path) == []  # the staging directory is gone


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("link", "'sub/link' was written .* not a plain file or a directory"),
        ("fifo", "'sub/fifo' was written .* not a plain file or a directory"),
        ("empty", "'sub/empty/' was written .* as an empty directory"),
        ("deep", "at most 16 subdirectories deep"),
        ("very deep", "at most 16 subdirectories deep"),
    ],
)
async def test_what_a_checkpoint_cannot_hold_is_refused_not_dropped(
    deep_trees_removed: Path, kind: str, match: str
) -> None:
    tmp_path = deep_trees_removed
    with pytest.raises(ValueError, match=match):
        await asyncio.to_thread(files_written_by, _writes(kind), str(tmp_path / "ck"))
    assert os.listdir(tmp_path) == []
