"""Checkpointer: saves that overlap training, on both backends."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import aiopersist
from tests._launch import run
from tests.conftest import GATE_KEY, Gate

pytestmark = pytest.mark.asyncio


def _state(seed: int = 0, n: int = 8) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"weights": {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(n)}, "step": seed}


@pytest.mark.parametrize("mode", ["fence", "snapshot"])
async def test_mutation_after_staged_does_not_change_the_checkpoint(
    backend_name: str, tmp_path: Path, mode: str
) -> None:
    state = _state()
    expected = {k: v.clone() for k, v in state["weights"].items()}  # type: ignore[union-attr]
    async with aiopersist.Checkpointer(backend=backend_name, mode=mode) as ck:  # type: ignore[arg-type]
        handle = await ck.save(state, tmp_path / "c")
        await handle.staged
        for t in state["weights"].values():  # type: ignore[union-attr]
            t.fill_(-1.0)  # what the optimizer step would do
        info = await handle.done
    assert info is not None
    back = await aiopersist.load(tmp_path / "c")
    for k, t in expected.items():
        assert torch.equal(back["weights"][k], t)


async def test_done_only_once_durable_and_published(backend_name: str, tmp_path: Path) -> None:
    seen: list[bool] = []
    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        handle = await ck.save(_state(), tmp_path / "c")
        handle.done.add_done_callback(lambda _f: seen.append((tmp_path / "c" / "aiopersist.json").exists()))
        assert not handle.done.done()
        await handle.done
    assert seen == [True]
    await aiopersist.verify(tmp_path / "c")


async def test_staged_seconds_is_set_when_staged_and_not_for_a_save_that_failed_before(
    backend_name: str, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("x")
    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        handle = await ck.save(_state(), tmp_path / "c")
        await handle.staged
        assert handle.staged_seconds is not None
        await handle.done
        failed = await ck.save(_state(), tmp_path / "file" / "c")  # the parent is a file
        with pytest.raises(aiopersist.CheckpointIOError):
            await failed.done
        assert failed.staged_seconds is None


async def test_errors_reach_both_futures_with_their_type(backend_name: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        handle = await ck.save(_state(), tmp_path / "file" / "c")  # the parent is a file
        with pytest.raises(aiopersist.CheckpointIOError) as staged:
            await handle.staged
        with pytest.raises(aiopersist.CheckpointIOError) as done:
            await handle.done
        assert staged.value is done.value
        with pytest.raises(aiopersist.UnsupportedStateError, match=r"state\['x'\]"):
            await ck.save({"x": object()}, tmp_path / "d")
        # the Checkpointer goes on after a failed save
        ok = await ck.save(_state(), tmp_path / "e")
        assert (await ok.done) is not None


@pytest.mark.root
async def test_disk_full_during_a_save(backend_name: str, small_fs: Path, space_check: str) -> None:
    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        handle = await ck.save(_state(n=4), small_fs / "c")  # 8 MiB into 4 MiB
        with pytest.raises(aiopersist.DiskFullError) as info:
            await handle.done
    assert ("nothing was written" in str(info.value)) == (space_check == "checked"), info.value
    assert os.listdir(small_fs) == []


async def test_on_busy_skip_and_wait(backend_name: str, tmp_path: Path) -> None:
    async with aiopersist.Checkpointer(backend=backend_name, on_busy="skip") as ck:
        first = await ck.save(_state(1), tmp_path / "a")
        second = await ck.save(_state(2), tmp_path / "b")
        assert second.skipped
        assert await second.done is None
        await first.done
    assert not (tmp_path / "b").exists()
    async with aiopersist.Checkpointer(backend=backend_name, on_busy="skip") as ck:
        for name in ("e", "f"):  # once `done` has resolved, the next save is not skipped
            handle = await ck.save(_state(3), tmp_path / name)
            assert not handle.skipped
            await handle.done
    assert (await aiopersist.load(tmp_path / "f"))["step"] == 3
    async with aiopersist.Checkpointer(backend=backend_name, on_busy="wait") as ck:
        first = await ck.save(_state(1), tmp_path / "c")
        second = await ck.save(_state(2), tmp_path / "d")  # waits for the first: no interleaving
        assert first.done.done()
        assert not second.done.done()
        assert (await first.done) is not None
        await second.done
    assert (await aiopersist.load(tmp_path / "d"))["step"] == 2


async def test_staging_pool_is_never_exceeded(backend_name: str, tmp_path: Path) -> None:
    async with aiopersist.Checkpointer(backend=backend_name, staging_bytes=8 << 20) as ck:
        for i in range(3):
            h = await ck.save(_state(i), tmp_path / f"c{i}")
            await h.done
        assert ck.pool.count == 2
        assert ck.pool.peak_in_use <= ck.pool.count
        assert ck.pool.acquisitions >= 3 * 4  # each 16 MiB state streamed through its 4 MiB buffers


async def test_snapshot_budget_is_enforced(tmp_path: Path) -> None:
    async with aiopersist.Checkpointer(mode="snapshot", snapshot_bytes=1 << 20) as ck:
        with pytest.raises(aiopersist.SnapshotBudgetError, match="snapshot_bytes=1048576"):
            await ck.save(_state(), tmp_path / "c")
        h = await ck.save({"small": torch.ones(100)}, tmp_path / "d")
        await h.done


async def test_snapshot_saves_in_flight_each_have_their_own_copy(
    backend_name: str, tmp_path: Path, gated_torch_save: Gate
) -> None:
    """Snapshot mode with two saves in flight: the second snapshot is taken while the
    first save is still writing from its own (held open by a gate in its extra files),
    and must not land in that memory."""
    t = torch.full((4 << 20,), 1.0)
    gate = gated_torch_save
    async with aiopersist.Checkpointer(backend=backend_name, mode="snapshot", max_in_flight=2) as ck:
        held = {"gate.pt": aiopersist.TorchSave({GATE_KEY: 0})}
        first = await ck.save({"t": t}, tmp_path / "a", extra_files=held)
        await first.staged
        t.fill_(2.0)
        second = await ck.save({"t": t}, tmp_path / "b")
        await second.staged
        t.fill_(3.0)
        await second.done
        assert not first.done.done()  # the two really were in flight together
        gate.go.set()
        await first.done
    assert torch.equal((await aiopersist.load(tmp_path / "a"))["t"], torch.full((4 << 20,), 1.0))
    assert torch.equal((await aiopersist.load(tmp_path / "b"))["t"], torch.full((4 << 20,), 2.0))


async def test_snapshot_save_returns_before_the_copy_is_taken(backend_name: str, tmp_path: Path) -> None:
    """In snapshot mode `save` returns at once; the copy is the save's first step, and
    `staged` resolves after it, so the caller waits (if at all) at the fence."""
    state = {f"w{i}": torch.randn(1 << 20) for i in range(64)}  # 256 MiB to copy
    expected = {k: v.clone() for k, v in state.items()}
    async with aiopersist.Checkpointer(backend=backend_name, mode="snapshot") as ck:
        handle = await ck.save(state, tmp_path / "c")
        assert not handle.staged.done()
        await handle.staged
        for v in state.values():
            v.zero_()
        await handle.done
    back = await aiopersist.load(tmp_path / "c")
    assert all(torch.equal(back[k], v) for k, v in expected.items())


async def test_cancelled_save_leaves_no_final_directory(backend_name: str, tmp_path: Path) -> None:
    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        await (await ck.save(_state(0), tmp_path / "c")).done
        handle = await ck.save(_state(1), tmp_path / "c", overwrite=True)
        for task in list(ck._tasks):
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle.done
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert (await aiopersist.load(tmp_path / "c"))["step"] == 0  # the older one, intact


async def test_aclose_refuses_a_save_that_waited_for_a_slot(backend_name: str, tmp_path: Path) -> None:
    gate = Gate()
    ck = aiopersist.Checkpointer(backend=backend_name)
    first = await ck.save(_state(1), tmp_path / "a", extra_files={"gate.pt": aiopersist.TorchSave(gate)})
    queued = asyncio.ensure_future(ck.save(_state(2), tmp_path / "b"))  # waits for the slot
    await asyncio.to_thread(gate.entered.wait, 30)
    closing = asyncio.ensure_future(ck.aclose())
    await asyncio.sleep(0.05)
    gate.go.set()
    await closing
    with pytest.raises(RuntimeError, match="closed while this save waited"):
        await queued
    assert (await first.done) is not None
    assert sorted(os.listdir(tmp_path)) == ["a"]


async def test_cancelled_aclose_cancels_the_saves_before_releasing(backend_name: str, tmp_path: Path) -> None:
    gate = Gate()
    ck = aiopersist.Checkpointer(backend=backend_name)
    handle = await ck.save(_state(1), tmp_path / "a", extra_files={"gate.pt": aiopersist.TorchSave(gate)})
    await asyncio.to_thread(gate.entered.wait, 30)
    closing = asyncio.ensure_future(ck.aclose())
    await asyncio.sleep(0.05)
    closing.cancel()
    await asyncio.sleep(0.05)
    gate.go.set()  # the pickling thread cannot be stopped: aclose waits for it
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not ck._tasks  # nothing still running on the backend it released
    with pytest.raises(asyncio.CancelledError):
        await handle.done
    assert os.listdir(tmp_path) == []


async def test_aclose_drains_saves_in_flight(backend_name: str, tmp_path: Path) -> None:
    ck = aiopersist.Checkpointer(backend=backend_name)
    handle = await ck.save(_state(3), tmp_path / "c")
    await ck.aclose()
    assert handle.done.done()
    assert (await aiopersist.load(tmp_path / "c"))["step"] == 3
    with pytest.raises(RuntimeError, match="closed"):
        await ck.save(_state(), tmp_path / "d")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_state_snapshot_round_trip(tmp_path: Path) -> None:
    state = {"w": torch.randn(1024, 1024, device="cuda")}
    expected = state["w"].cpu()
    async with aiopersist.Checkpointer(mode="snapshot") as ck:
        h = await ck.save(state, tmp_path / "c")
        await h.staged
        state["w"].zero_()
        await h.done
    assert torch.equal((await aiopersist.load(tmp_path / "c"))["w"], expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_state_fence_streams_through_pinned_buffers(backend_name: str, tmp_path: Path) -> None:
    w = torch.randn(3000, 1000, device="cuda")  # 12 MiB: several chunks, an uneven last one
    state = {"w": w, "t": w.t(), "small": torch.arange(5, device="cuda")}
    expected = {k: v.cpu() for k, v in state.items()}
    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        h = await ck.save({"s": state}, tmp_path / "c")
        await h.staged
        w.zero_()
        await h.done
    back = (await aiopersist.load(tmp_path / "c"))["s"]
    for k, v in expected.items():
        assert torch.equal(back[k], v)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["fence", "snapshot"])
async def test_cuda_state_made_on_a_side_stream_is_saved_as_the_caller_left_it(
    backend_name: str, tmp_path: Path, mode: str
) -> None:
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    w = torch.zeros(4 << 20, device="cuda")
    torch.cuda.synchronize()
    async with aiopersist.Checkpointer(backend=backend_name, mode=mode) as ck:  # type: ignore[arg-type]
        with torch.cuda.stream(side):  # the training's own stream, not the default one
            torch.cuda._sleep(500_000_000)  # type: ignore[no-untyped-call]  # the fill comes late
            w.fill_(7.0)
            handle = await ck.save({"w": w}, tmp_path / "c")
        await handle.done
    assert torch.equal((await aiopersist.load(tmp_path / "c"))["w"], torch.full((4 << 20,), 7.0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["fence", "snapshot"])
async def test_cuda_save_waits_for_nothing_queued_after_it(
    backend_name: str, tmp_path: Path, mode: str
) -> None:
    """The copies wait for the state as the save found it, not for the next step's work:
    `staged` resolves while a long kernel queued after `save` still runs. A lone strided
    tensor (gathered on the side stream, not behind that kernel) is saved whole."""
    big = torch.randn(2048, 2048, device="cuda")
    state = {"w": torch.randn(4 << 20, device="cuda"), "strided": big[:, ::2]}
    expected = {k: v.cpu() for k, v in state.items()}
    async with aiopersist.Checkpointer(backend=backend_name, mode=mode) as ck:  # type: ignore[arg-type]
        handle = await ck.save(state, tmp_path / "c")
        torch.cuda._sleep(5_000_000_000)  # type: ignore[no-untyped-call]  # the next step: seconds
        await handle.staged
        assert not torch.cuda.current_stream().query()  # still running
        await handle.done
    back = await aiopersist.load(tmp_path / "c")
    for k, v in expected.items():
        assert torch.equal(back[k], v), k


async def test_replaced_checkpoint_is_deleted_after_done(backend_name: str, tmp_path: Path) -> None:
    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        for step in range(3):
            h = await ck.save(_state(step), tmp_path / "c", overwrite=True)
            assert await h.done is not None
    # after aclose every replaced checkpoint is gone; the newest is in place
    assert os.listdir(tmp_path) == ["c"]
    assert (await aiopersist.load(tmp_path / "c"))["step"] == 2


async def test_extra_files_torch_save_stream_and_fence(tmp_path: Path, backend_name: str) -> None:
    """A TorchSave in extra_files is written through the engine, loads with
    torch.load(weights_only=True), is checksummed, and counts for `staged`."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    expected = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    backend = backend_name
    async with aiopersist.Checkpointer(backend=backend) as ck:
        handle = await ck.save(
            model,
            tmp_path / "ck",
            extra_files={"optimizer.pt": aiopersist.TorchSave(opt.state_dict()), "config.json": b"{}"},
        )
        await handle.staged
        with torch.no_grad():
            for st in opt.state.values():
                st["exp_avg"].add_(1.0)  # the optimizer moves on once staged
        info = await handle.done
    assert info is not None
    assert {"model.safetensors", "optimizer.pt", "config.json", "aiopersist.json"} == set(info.files)
    back = torch.load(tmp_path / "ck" / "optimizer.pt", weights_only=True)
    for k, v in expected.items():
        assert torch.equal(back["state"][0][k], v), k
    report = await aiopersist.verify(tmp_path / "ck", backend=backend)
    assert len(report.files) == 3
    with pytest.raises(ValueError, match="uses"):
        async with aiopersist.Checkpointer(backend=backend) as ck:
            await (await ck.save(model, tmp_path / "x", extra_files={"aiopersist.json": b"{}"})).done


@pytest.mark.parametrize("mode", ["fence", "snapshot"])
async def test_what_a_torch_save_holds_besides_tensors_is_taken_at_the_save(
    backend_name: str, tmp_path: Path, mode: str
) -> None:
    """A TorchSave of a live state (an object's ``__dict__``, a history list, an
    optimizer whose per-parameter ``step`` is an int): a change right after `save`
    returns, before ``staged``, is not in the checkpoint, as a change to the state's own
    skeleton is not; with or without tensors in it, in either mode. Its tensors are read
    until ``staged`` (fence) or copied (snapshot), as before."""
    live: dict[str, Any] = {"step": 100, "history": [1, 2, 3], "meta": {"lr": 0.5}}
    plain: dict[str, Any] = {"epoch": 7, "seen": [0]}
    big = torch.ones(1 << 20)
    async with aiopersist.Checkpointer(backend=backend_name, mode=mode) as ck:
        handle = await ck.save(
            {"w": big},
            tmp_path / "ck",
            extra_files={
                "live.pt": aiopersist.TorchSave({**live, "t": big}),
                "plain.pt": aiopersist.TorchSave(plain),
            },
        )
        live["step"] += 1
        live["history"].append(4)
        live["meta"]["lr"] = 0.25
        plain["epoch"] += 1
        plain["seen"].append(1)
        await handle.wait()
    back = torch.load(tmp_path / "ck" / "live.pt", weights_only=True)
    assert (back["step"], back["history"], back["meta"]) == (100, [1, 2, 3], {"lr": 0.5})
    assert torch.equal(back["t"], big)
    assert torch.load(tmp_path / "ck" / "plain.pt", weights_only=True) == {"epoch": 7, "seen": [0]}


class _Moments(NamedTuple):
    avg: torch.Tensor
    sq: torch.Tensor


async def test_snapshot_copies_the_torch_save_extra_files_too(backend_name: str, tmp_path: Path) -> None:
    """Snapshot mode: `staged` resolves once the TorchSave objects' tensors are copied as
    well (an optimizer state, written by torch.save after `staged`, must not be torn by
    the optimizer step that follows); the object keeps its structure and tensor types."""
    big = torch.randn(8 << 20)  # 32 MiB: torch.save of it outlasts the mutation below
    shared = torch.arange(10.0)
    param = torch.nn.Parameter(torch.ones(3, 4))
    strided = torch.randn(64, 64).t()
    state = {
        "state": {0: {"step": torch.tensor(7.0), "exp_avg": big}},
        "param_groups": [{"lr": 1e-3, "params": [0]}],
        "moments": _Moments(shared, shared),
        "param": param,
        "strided": strided,
        "empty": torch.empty(0),
    }
    expected = {"big": big.clone(), "shared": shared.clone(), "strided": strided.clone()}
    async with aiopersist.Checkpointer(backend=backend_name, mode="snapshot") as ck:
        handle = await ck.save(
            {"w": torch.ones(4)}, tmp_path / "c", extra_files={"optimizer.pt": aiopersist.TorchSave(state)}
        )
        await handle.staged
        with torch.no_grad():
            for t in (big, shared, param, strided):
                t.fill_(-1.0)  # the optimizer step
            state["state"][0]["step"].add_(1)  # type: ignore[index]
        await handle.done
    back = torch.load(tmp_path / "c" / "optimizer.pt", weights_only=False)
    assert torch.equal(back["state"][0]["exp_avg"], expected["big"])
    assert back["state"][0]["step"].item() == 7.0
    assert back["param_groups"] == [{"lr": 1e-3, "params": [0]}]
    assert isinstance(back["moments"], _Moments)
    assert torch.equal(back["moments"].avg, expected["shared"])
    assert back["moments"].avg is back["moments"].sq  # one tensor in, one tensor out
    assert isinstance(back["param"], torch.nn.Parameter)
    assert back["param"].requires_grad
    assert torch.equal(back["param"], torch.ones(3, 4))
    assert torch.equal(back["strided"], expected["strided"])
    assert back["empty"].shape == (0,)
    await aiopersist.verify(tmp_path / "c")


@dataclasses.dataclass
class _Holder:
    """Not a dict, list or tuple: snapshot mode cannot rebuild it around copies."""

    t: torch.Tensor


async def test_snapshot_serializes_torch_save_objects_it_cannot_rebuild(
    backend_name: str, tmp_path: Path
) -> None:
    """A module, a dataclass: snapshot mode serializes such a `TorchSave` whole before
    `staged`, so the optimizer step after it does not reach the file."""
    module = torch.nn.Linear(256, 256)
    holder = _Holder(torch.randn(4 << 20))  # 16 MiB
    expected = {"weight": module.weight.detach().clone(), "held": holder.t.clone()}
    extra = {
        "module.pt": aiopersist.TorchSave(module),
        "holder.pt": aiopersist.TorchSave({"h": holder}),
        "plain.pt": aiopersist.TorchSave({"m": torch.ones(3)}),
    }
    async with aiopersist.Checkpointer(backend=backend_name, mode="snapshot") as ck:
        handle = await ck.save({"w": torch.ones(4)}, tmp_path / "c", extra_files=extra)
        await handle.staged
        with torch.no_grad():
            module.weight.fill_(-1.0)
            holder.t.fill_(-1.0)
        await handle.done
    back = torch.load(tmp_path / "c" / "module.pt", weights_only=False)
    assert isinstance(back, torch.nn.Linear)
    assert torch.equal(back.weight, expected["weight"])
    assert torch.equal(torch.load(tmp_path / "c" / "holder.pt", weights_only=False)["h"].t, expected["held"])
    assert torch.equal(torch.load(tmp_path / "c" / "plain.pt")["m"], torch.ones(3))
    await aiopersist.verify(tmp_path / "c")


class _Tagged(dict[str, object]):
    """A dict with a tensor of its own beside its items."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__()
        self.t = t


async def test_what_snapshot_mode_can_rebuild_around_copies() -> None:
    from aiopersist._checkpointer import rebuildable

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
    optimizer.step()
    cyclic: dict[str, object] = {"t": torch.ones(2)}
    cyclic["self"] = cyclic
    shared = {"t": torch.ones(2)}
    assert rebuildable(optimizer.state_dict())
    assert rebuildable({"m": _Moments(torch.ones(1), torch.ones(1)), "p": torch.nn.Parameter(torch.ones(1))})
    assert not rebuildable(cyclic)  # a rebuild would never end
    assert not rebuildable({"a": shared, "b": shared})  # a rebuild would make two of it
    assert not rebuildable(_Tagged(torch.ones(2)))  # its tensor is no item
    assert not rebuildable({torch.ones(1): 1})  # tensor keys are not replaced
    assert not rebuildable([torch.ones(2).to_sparse()])
    assert not rebuildable([_Holder(torch.ones(1))])


async def test_snapshot_copies_what_hides_in_a_dict_subclass(backend_name: str, tmp_path: Path) -> None:
    tagged = _Tagged(torch.full((4 << 20,), 1.0))
    tagged["m"] = torch.ones(3)
    cyclic: dict[str, object] = {"t": torch.ones(2)}
    cyclic["self"] = cyclic
    extra = {"tagged.pt": aiopersist.TorchSave(tagged), "cyclic.pt": aiopersist.TorchSave(cyclic)}
    async with aiopersist.Checkpointer(backend=backend_name, mode="snapshot") as ck:
        handle = await ck.save({"w": torch.ones(4)}, tmp_path / "c", extra_files=extra)
        await handle.staged
        tagged.t.fill_(-1.0)
        await handle.done
    back = torch.load(tmp_path / "c" / "tagged.pt", weights_only=False)
    assert torch.equal(back.t, torch.full((4 << 20,), 1.0))
    loop = torch.load(tmp_path / "c" / "cyclic.pt", weights_only=False)
    assert loop["self"] is loop


async def test_snapshot_budget_bounds_what_it_serializes_whole(backend_name: str, tmp_path: Path) -> None:
    async with aiopersist.Checkpointer(backend=backend_name, mode="snapshot", snapshot_bytes=8 << 20) as ck:
        extra = {"holder.pt": aiopersist.TorchSave(_Holder(torch.zeros(4 << 20)))}  # 16 MiB
        handle = await ck.save({"w": torch.ones(16)}, tmp_path / "c", extra_files=extra)
        with pytest.raises(aiopersist.SnapshotBudgetError, match=r"'holder\.pt'"):
            await handle.staged
        with pytest.raises(aiopersist.SnapshotBudgetError):
            await handle.done
        assert not (tmp_path / "c").exists()
        await (await ck.save({"w": torch.ones(16)}, tmp_path / "d")).done


async def test_snapshot_budget_counts_the_torch_save_extra_files(tmp_path: Path) -> None:
    async with aiopersist.Checkpointer(mode="snapshot", snapshot_bytes=1 << 20) as ck:
        extra = {"optimizer.pt": aiopersist.TorchSave({"m": torch.zeros(1 << 18)})}  # exactly 1 MiB
        with pytest.raises(aiopersist.SnapshotBudgetError, match="TorchSave"):
            await ck.save({"w": torch.ones(16)}, tmp_path / "c", extra_files=extra)
        assert not (tmp_path / "c").exists()
        await (await ck.save({"w": torch.ones(16)}, tmp_path / "d")).done


async def test_cancelling_a_snapshot_copy_waits_for_it(
    backend_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while its copy runs (in a thread, which cannot be interrupted), a
    snapshot save ends only once the copy is over: its memory is then free to reuse."""
    from aiopersist import _checkpointer

    copying = threading.Event()
    real = _checkpointer._copy_all

    def copy_all(*args: Any, **kwargs: Any) -> None:
        copying.set()
        real(*args, **kwargs)

    monkeypatch.setattr(_checkpointer, "_copy_all", copy_all)
    source = torch.randn(64 << 20)  # 256 MiB to copy
    async with aiopersist.Checkpointer(backend=backend_name, mode="snapshot") as ck:
        handle = await ck.save({"t": source}, tmp_path / "c")
        # The save's task has started its copy (a fixed sleep was not always enough under
        # load: cancelled while its memory was still being mapped, the save drops it).
        assert await asyncio.to_thread(copying.wait, 60)
        for task in list(ck._tasks):
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle.done
        (memory,) = ck._snapshots  # given back: nobody writes into it any more
        copy = torch.frombuffer(memory.view, dtype=torch.float32, count=source.numel())
        assert torch.equal(copy, source)
    assert not (tmp_path / "c").exists()


_ROOT = Path(__file__).resolve().parents[2]
_RECANCELLED = """
import asyncio, sys, time
import torch
import aiopersist

class Slow:
    def __reduce__(self):
        time.sleep(1)
        return (int, (0,))

async def main():
    ck = aiopersist.Checkpointer(backend=sys.argv[1])
    await ck.save({"w": torch.ones(8)}, sys.argv[2], extra_files={"x.pt": aiopersist.TorchSave(Slow())})
    closing = asyncio.ensure_future(ck.aclose())
    loop = asyncio.get_running_loop()
    stop = time.monotonic() + 5

    def recancel():  # as an anyio cancel scope delivers it: again at every turn of the loop
        if not closing.done():
            closing.cancel()
            if time.monotonic() < stop:
                loop.call_soon(recancel)

    await asyncio.sleep(0.1)
    recancel()
    try:
        await closing
    except asyncio.CancelledError:
        pass
    print("closed", len(ck._tasks), flush=True)

asyncio.run(main())
"""


async def test_aclose_cancelled_at_every_turn_still_ends(backend_name: str, tmp_path: Path) -> None:
    """A caller cancelled at every await (anyio's cancel scopes, a second Ctrl-C through
    the blocking facade) while a save is in flight: ``aclose`` waits for the save's thread
    and ends; it used to spin on the done task forever, the loop never turning again."""
    proc = await asyncio.to_thread(
        run,
        [sys.executable, "-c", _RECANCELLED, backend_name, str(tmp_path / "ck")],
        text=True,
        timeout=60,
        cwd=_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "closed 0"
    assert not (tmp_path / "ck").exists()  # cancelled: nothing published


async def test_a_timed_out_wait_on_a_handle_leaves_the_handle_as_the_save_ends(
    backend_name: str, tmp_path: Path
) -> None:
    """``wait_for(handle.done, t)`` timing out (or any cancelled awaiter) cancelled the
    handle's own futures: ``done`` and ``staged`` then said CancelledError for good though
    the checkpoint was committed. Now each wait is the caller's own: the handle resolves
    as the save does, and a cancelled view is replaced by a fresh one."""
    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        handle = await ck.save(_state(), tmp_path / "ck")
        first = handle.done
        with pytest.raises(TimeoutError):  # the save has not run yet: nothing has resolved
            await asyncio.wait_for(handle.done, 0)
        assert first.cancelled()  # the view the wait cancelled ...
        assert handle.done is not first  # ... is replaced
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(handle.staged, 0)
        await handle.staged
        info = await handle.done
        assert info is not None
        assert handle.done.result() is info
    await aiopersist.verify(tmp_path / "ck", backend=backend_name)


async def test_a_second_aclose_while_the_first_runs_waits_for_it(backend_name: str, tmp_path: Path) -> None:
    """Two ``aclose`` at once (a shutdown path and an ``async with``, say): the second
    returned at once, while the saves in flight were not yet durable (found by the
    cancellation helper). Now it waits for the first; after, a close returns at once.
    The same for a manager, and for the blocking facades' ``close`` from two threads."""
    state = {f"t{i}": torch.randn(4 << 20) for i in range(4)}  # 64 MiB
    ck = aiopersist.Checkpointer(backend=backend_name)
    handle = await ck.save(state, tmp_path / "a")
    first = asyncio.ensure_future(ck.aclose())
    await asyncio.sleep(0)
    await ck.aclose()
    assert handle.done.done()
    await first
    await ck.aclose()

    mgr = aiopersist.CheckpointManager(tmp_path / "run", backend=backend_name)
    managed = await mgr.save(1, state)
    first = asyncio.ensure_future(mgr.aclose())
    await asyncio.sleep(0)
    await mgr.aclose()
    assert managed.done.done()
    await first

    blocking = aiopersist.BlockingCheckpointer(backend=backend_name)
    bhandle = blocking.save(state, tmp_path / "b")
    closer = threading.Thread(target=blocking.close)
    closer.start()
    for _ in range(10_000):  # until the first close has begun
        if blocking._closed:
            break
        await asyncio.sleep(0.001)
    await asyncio.to_thread(blocking.close)
    assert bhandle.done()
    closer.join()
    for path in ("a", "b", "run/step-1"):
        await aiopersist.verify(tmp_path / path, backend=backend_name)


class _Blocks:
    """Pickled in the save's own time (a `TorchSave` extra file): holds the save in flight
    until ``release`` is set."""

    release = threading.Event()

    def __reduce__(self) -> Any:
        type(self).release.wait(60)
        return (int, (0,))


async def test_one_checkpointer_from_two_event_loops_at_once_is_refused(
    backend_name: str, tmp_path: Path
) -> None:
    """A `Checkpointer` (or manager) used from another thread's event loop while a save
    runs on the first: the second save waited for good on a slot the first loop's thread
    released without waking it (found by the cancellation helper). Now a call from
    another loop while work is in flight raises ``RuntimeError`` at once; once the work
    is over, another loop may close them (their lock, ring and pool let go)."""
    state = {"w": torch.randn(1 << 20)}
    ck = aiopersist.Checkpointer(backend=backend_name)
    mgr = aiopersist.CheckpointManager(tmp_path / "run", checkpointer=ck)
    in_flight = threading.Event()
    _Blocks.release.clear()

    async def first() -> None:  # another thread's loop, a save in flight on it meanwhile
        handle = await ck.save(state, tmp_path / "a", extra_files={"x.pt": aiopersist.TorchSave(_Blocks())})
        in_flight.set()
        await handle.done
        await ck.wait()

    thread = threading.Thread(target=lambda: asyncio.run(first()))
    thread.start()
    errors: list[BaseException] = []
    try:
        assert await asyncio.to_thread(in_flight.wait, 60)
        for call in (
            lambda: ck.save(state, tmp_path / "b"),
            ck.fence,
            ck.wait,
            ck.aclose,
            lambda: mgr.save(2, state),
            mgr.wait,
            mgr.aclose,
        ):
            try:
                await asyncio.wait_for(call(), 30)  # a hang fails the test, not the suite
            except BaseException as exc:
                errors.append(exc)
    finally:
        _Blocks.release.set()
        await asyncio.to_thread(thread.join, 60)
    assert len(errors) == 7
    for exc in errors:
        assert isinstance(exc, RuntimeError), repr(exc)
        assert "in use on another event loop" in str(exc)
    assert not (tmp_path / "b").exists()
    # The first loop's work is over (its loop too): this loop may close them.
    await mgr.aclose()
    await ck.aclose()
    async with aiopersist.CheckpointManager(tmp_path / "run", backend=backend_name) as again:
        assert again.steps() == []  # the directory's lock was let go
    await aiopersist.verify(tmp_path / "a", backend=backend_name)


async def test_the_callers_views_keep_their_identity_and_log_no_handled_error(
    backend_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller's views of a save's futures (see the test above) are one object while
    they last, before and after the save settles (``asyncio.wait`` over a set of them
    finds them in its result), and a failed save whose error the caller handled logs no
    "Future exception was never retrieved" for a view it only polled (found by the
    review helper)."""
    import gc
    import logging

    async with aiopersist.Checkpointer(backend=backend_name) as ck:
        handles = [await ck.save(_state(i), tmp_path / f"ck{i}") for i in range(2)]
        done, _ = await asyncio.wait({h.done for h in handles})
        assert all(h.done in done for h in handles)
        (tmp_path / "file").write_text("")
        failed = await ck.save(_state(), tmp_path / "file" / "step-1")
        assert not failed.staged.done()  # polled: a view made while the save ran
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            with pytest.raises(aiopersist.AiopersistError):
                await failed.wait()
            del failed
            gc.collect()
            await asyncio.sleep(0.05)
            gc.collect()
        assert "never retrieved" not in caplog.text
