"""Checkpoints holding a tree nested deeper than Python recurses (stuffed in by hand): an
overwrite, the manager's retention, the DCP writer's background deletion and a hook's
staging cleanup remove it, where ``shutil.rmtree`` raised ``RecursionError``, and a scan
sizes it. A link inside is removed, never followed; what cannot be removed (a mount
point) stays and the rest goes. Every I/O test runs on both backends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import aiopersist
from aiopersist._commit import remove_path
from aiopersist._manager import scan
from aiopersist._names import LOCK_NAME, TRAINER_STEPS
from tests.conftest import BACKENDS, deep_tree, mounted_tmpfs

pytestmark = pytest.mark.usefixtures("deep_trees_removed")


def test_remove_path_takes_a_tree_deeper_than_the_recursion_limit(tmp_path: Path) -> None:
    deep_tree(tmp_path / "t")
    remove_path(str(tmp_path / "t"))
    assert os.listdir(tmp_path) == []


def test_remove_path_removes_links_and_never_follows_them(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "keep").write_bytes(b"k")
    tree = tmp_path / "t"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_bytes(b"x")
    (tree / "a" / "to-dir").symlink_to(outside)
    (tree / "to-sub").symlink_to(outside / "sub")
    (tree / "dangling").symlink_to(tmp_path / "nothing")
    os.mkfifo(tree / "fifo")
    remove_path(str(tree))
    assert sorted(os.listdir(tmp_path)) == ["outside"]
    assert (outside / "sub" / "keep").read_bytes() == b"k"
    # A link given as the path itself is removed, not what it names.
    (tmp_path / "link").symlink_to(outside)
    remove_path(str(tmp_path / "link"))
    assert sorted(os.listdir(tmp_path)) == ["outside"]
    assert (outside / "sub" / "keep").exists()
    remove_path(str(tmp_path / "never-was"))  # nothing there: nothing to do


def test_remove_path_leaves_what_cannot_be_removed_and_takes_the_rest(tmp_path: Path) -> None:
    tree = tmp_path / "t"
    (tree / "a" / "mnt").mkdir(parents=True)
    (tree / "a" / "before").write_bytes(b"x")
    (tree / "z" / "y").mkdir(parents=True)
    (tree / "z" / "y" / "f").write_bytes(b"x")
    with mounted_tmpfs(tree / "a" / "mnt", "size=1m") as mnt:
        (mnt / "inside").mkdir()
        (mnt / "inside" / "f").write_bytes(b"x")
        remove_path(str(tree))  # returns: the mount point cannot go (EBUSY), the rest does
        assert os.listdir(tree) == ["a"]
        assert os.listdir(tree / "a") == ["mnt"]
        assert os.listdir(mnt) == []  # emptied, as rmtree would
    remove_path(str(tree))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_an_overwrite_replaces_a_checkpoint_holding_adeep_tree(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "c"
    await aiopersist.save({"w": torch.zeros(8)}, path, backend=backend)
    deep_tree(path / "stuffed")
    await aiopersist.save({"w": torch.ones(8)}, path, backend=backend, overwrite=True)
    assert torch.equal((await aiopersist.load(path, backend=backend))["w"], torch.ones(8))
    assert not (path / "stuffed").exists()
    assert sorted(os.listdir(tmp_path)) == ["c"]  # the replaced checkpoint is gone whole


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_retention_deletes_a_step_holding_adeep_tree(tmp_path: Path, backend: str) -> None:
    async with aiopersist.CheckpointManager(tmp_path, keep_last=1, backend=backend) as mgr:
        await (await mgr.save(1, {"w": torch.zeros(8)})).done
        deep_tree(tmp_path / "step-1" / "stuffed")
        await (await mgr.save(2, {"w": torch.ones(8)})).done
        await mgr.wait()
        assert mgr.steps() == [2]
    assert not (tmp_path / "step-1").exists()
    assert sorted(os.listdir(tmp_path)) == sorted([LOCK_NAME, "step-2"])  # no trash left behind


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, as DCP allows
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dcp_overwrite_keeps_a_checkpoint_holding_a_deep_tree(tmp_path: Path, backend: str) -> None:
    """A DCP checkpoint directory holding a deep tree besides the checkpoint's files:
    overwrite=True, which replaces the directory whole, refuses rather than delete what is
    not the checkpoint's (FileSystemWriter writes beside it); everything is kept."""
    import torch.distributed.checkpoint as dcp

    from aiopersist.integrations.dcp import AiopersistReader, AiopersistWriter, _wait_deletions

    path = tmp_path / "dcp"
    dcp.save({"w": torch.zeros(8)}, storage_writer=AiopersistWriter(path, backend=backend))
    deep_tree(path / "stuffed")
    with pytest.raises(BaseException, match="stuffed"):  # DCP's CheckpointException wraps it
        dcp.save({"w": torch.ones(8)}, storage_writer=AiopersistWriter(path, backend=backend, overwrite=True))
    _wait_deletions()
    back = {"w": torch.empty(8)}
    dcp.load(back, storage_reader=AiopersistReader(path, backend=backend))
    assert torch.equal(back["w"], torch.zeros(8))
    assert (path / "stuffed").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["dcp"]


def test_scan_sizes_a_stock_checkpoint_holding_a_deep_tree(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoint-5"
    ck.mkdir()
    (ck / "trainer_state.json").write_text("{}")
    (ck / "model.safetensors").write_bytes(b"\0" * 1000)
    deep_tree(ck / "stuffed")
    (ck / "link").symlink_to(tmp_path / "checkpoint-5" / "model.safetensors")  # not counted
    [info] = scan(str(tmp_path), layout=TRAINER_STEPS)
    assert (info.step, info.kind, info.complete) == (5, "stock", True)
    assert info.nbytes == 1000 + 2  # the tree's files are empty; the link is not followed


# -- a work place exists only while work is in progress there -------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_work_place_goes_between_saves_and_comes_back_for_concurrent_ones(
    tmp_path: Path, backend: str
) -> None:
    """A place `work_elsewhere` names is removed once the work in it is over (published
    saves, deletions, a hook's staging), and made again by whoever works there next, also
    when several saves, deletions and stagings race its removal: none of them fails."""
    import asyncio
    import threading

    from aiopersist._manager import delete_step
    from aiopersist._names import work_elsewhere
    from aiopersist.integrations._common import files_written_by

    base, place = tmp_path / "checkpoints", tmp_path / ".staging"
    base.mkdir()
    work_elsewhere(str(base), str(place))
    try:
        await aiopersist.save({"w": torch.zeros(8)}, base / "c0", backend=backend)
        assert sorted(os.listdir(tmp_path)) == ["checkpoints"]  # the place went with the save
        errors: list[BaseException] = []

        def stage(i: int) -> None:
            try:
                for j in range(20):
                    files = files_written_by(
                        lambda d, j=j: Path(d, "f").write_bytes(b"%d" % j), str(base / f"h{i}")
                    )
                    assert files == {"f": b"%d" % j}
            except BaseException as exc:  # reported below
                errors.append(exc)

        stagers = [threading.Thread(target=stage, args=(i,)) for i in range(2)]
        for t in stagers:
            t.start()
        async with aiopersist.Checkpointer(backend=backend) as ck:
            for round_ in range(6):
                handles = [
                    await ck.save({"w": torch.full((8,), float(i))}, base / f"c{round_}-{i}")
                    for i in range(4)
                ]
                await asyncio.gather(*(h.done for h in handles))
                await asyncio.to_thread(delete_step, str(base / f"c{round_}-0"))
        for t in stagers:
            t.join()
        assert errors == []
        assert sorted(os.listdir(tmp_path)) == ["checkpoints"]
        assert len(os.listdir(base)) == 1 + 6 * 3
        back = await aiopersist.load(base / "c5-3", backend=backend)
        assert torch.equal(back["w"], torch.full((8,), 3.0))
    finally:
        from aiopersist import _names

        _names._WORK_PLACES.pop(str(base), None)
