"""Whole states: modules, optimizers, schedulers, scalars, views; round trips on both backends."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiopersist
from aiopersist._format import _DTYPES

pytestmark = pytest.mark.asyncio


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
            )
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


def _training_state() -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 50))
    model[2].weight = model[0].weight  # tied, as a language model's head and embedding
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=10)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    for _ in range(2):
        model(torch.randint(0, 50, (4,))).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    state = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "scaler": scaler,
        "rng": aiopersist.RNGState(),
        "step": 2,
        "epoch_loss": [1.5, float("nan"), float("inf"), -math.inf],
        "note": "hello",
        "flags": (True, None, 3),
        "raw": b"\x00\xffbytes",
        "np": np.arange(12, dtype=np.float32).reshape(3, 4),
        "int_keys": {0: "a", 7: "b"},
    }
    return state, model, opt


async def test_training_state_round_trip(backend_name: str, tmp_path: Path) -> None:
    state, model, opt = _training_state()
    expected = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": state["sched"].state_dict(),
        "scaler": state["scaler"].state_dict(),
    }
    await aiopersist.save(state, tmp_path / "c", backend=backend_name)
    back = await aiopersist.load(tmp_path / "c", backend=backend_name)
    for key in expected:
        assert _equal(dict(expected[key]), back[key]), key
    for key in ("step", "epoch_loss", "note", "flags", "raw", "np", "int_keys"):
        assert _equal(state[key], back[key]), key
    # tied weights come back tied, stored once
    assert back["model"]["0.weight"] is back["model"]["2.weight"]
    manifest = (tmp_path / "c" / "aiopersist.json").read_text()
    assert '"model.2.weight":"model.0.weight"' in manifest


async def test_load_into_live_objects_resumes_training_exactly(backend_name: str, tmp_path: Path) -> None:
    state, model, opt = _training_state()
    await aiopersist.save(state, tmp_path / "c", backend=backend_name)
    x = torch.randint(0, 50, (4,))
    random_draw = random.random()

    def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> torch.Tensor:
        m(x).sum().backward()
        o.step()
        o.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    after = step(model, opt)
    fresh_state, fresh_model, fresh_opt = _training_state()
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.add_(1.0)  # make sure the load is what brings it back
    random.random()
    returned = await aiopersist.load(tmp_path / "c", into=fresh_state, backend=backend_name)
    assert returned is fresh_state
    assert random.random() == random_draw  # the RNG state was restored too
    assert fresh_model[0].weight is fresh_model[2].weight
    assert torch.equal(step(fresh_model, fresh_opt), after)


async def test_strict_load_into_reports_every_mismatch_and_changes_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 4)
    await aiopersist.save({"model": saved, "extra": 1}, tmp_path / "c")
    target = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = [p.clone() for p in target.parameters()]
    with pytest.raises(aiopersist.StateMismatchError) as info:
        await aiopersist.load(tmp_path / "c", into={"model": target, "other": 0})
    err = info.value
    assert "state['model']['0.weight']" in err.missing
    assert "state['model']['weight']" in err.unexpected
    assert "state['other']" in err.missing
    assert "state['extra']" in err.unexpected
    assert "nothing was loaded" in str(err)
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters(), strict=True))
    shape = torch.nn.Linear(4, 5)
    with pytest.raises(aiopersist.StateMismatchError, match=r"shape \(4, 4\) saved, \(5, 4\) here"):
        await aiopersist.load(tmp_path / "c", into={"model": shape}, strict=False)


async def test_views_of_one_storage_stay_views(backend_name: str, tmp_path: Path) -> None:
    base = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    state = {
        "base": base,
        "row": base[1],
        "col": base[:, 3],
        "t": base.t(),
        "same": base,
        "bytes": base.view(torch.int32),
    }
    # nested, so not a model's flat weights (those are stored tensor by tensor, as HF wants)
    await aiopersist.save({"views": state}, tmp_path / "c", backend=backend_name)
    back = (await aiopersist.load(tmp_path / "c", backend=backend_name))["views"]
    for k in state:
        assert _equal(state[k], back[k]), k
    assert back["same"] is back["base"]
    back["base"][1, 3] = -1.0
    assert back["row"][3] == -1.0
    assert back["col"][1] == -1.0
    assert back["t"][3, 1] == -1.0


async def test_flat_weights_with_views_are_stored_under_their_own_names(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    weights = {"w": base, "w_t": base.t(), "tied": base}
    await aiopersist.save(weights, tmp_path / "c")
    on_disk = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert sorted(on_disk) == ["w", "w_t"]  # "tied" is an alias in the manifest
    back = await aiopersist.load(tmp_path / "c")
    assert _equal(weights["w_t"], back["w_t"])
    assert back["tied"] is back["w"]


async def test_pickle_only_when_both_sides_opt_in(tmp_path: Path) -> None:
    state = {"w": torch.ones(2), "obj": {1, 2, 3}}
    with pytest.raises(aiopersist.UnsupportedStateError, match=r"allow_pickle=True"):
        await aiopersist.save(state, tmp_path / "c")
    info = await aiopersist.save(state, tmp_path / "c", allow_pickle=True)
    assert "pickled.bin" in info.files
    with pytest.raises(aiopersist.UnsupportedStateError, match=r"allow_pickle=True to load"):
        await aiopersist.load(tmp_path / "c")
    back = await aiopersist.load(tmp_path / "c", allow_pickle=True)
    assert back["obj"] == {1, 2, 3}
    assert torch.equal(back["w"], torch.ones(2))


async def test_sharded_model_uses_the_hf_index(backend_name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)}  # 16 KiB each
    info = await aiopersist.save(weights, tmp_path / "c", backend=backend_name, max_shard_bytes=40_000)
    shards = sorted(f for f in info.files if f.startswith("model-"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert "model.safetensors.index.json" in info.files
    back = await aiopersist.load(tmp_path / "c", backend=backend_name)
    assert _equal(weights, back)
    # and as a plain Hugging Face directory, without the manifest
    (tmp_path / "c" / "aiopersist.json").unlink()
    assert _equal(weights, await aiopersist.load(tmp_path / "c", backend=backend_name))


async def test_safetensors_interop_both_ways(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    weights = {
        "a": torch.randn(100, 3),
        "b": torch.randint(0, 9, (7,)),
        "c": torch.randn(2, dtype=torch.bfloat16),
    }
    await aiopersist.save(weights, tmp_path / "ours")
    assert _equal(weights, load_file(str(tmp_path / "ours" / "model.safetensors")))
    save_file(weights, str(tmp_path / "theirs.safetensors"))
    assert _equal(weights, await aiopersist.load(tmp_path / "theirs.safetensors"))


async def test_from_pretrained_reads_a_model_save(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    await aiopersist.save(model, tmp_path / "m")
    config.save_pretrained(tmp_path / "m")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "m").eval()
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    assert again.lm_head.weight is again.transformer.wte.weight


async def test_blocking_twins(tmp_path: Path) -> None:
    import asyncio

    state = {"x": torch.arange(4)}

    def in_a_thread() -> Any:
        aiopersist.save_sync(state, tmp_path / "c")
        return aiopersist.load_sync(tmp_path / "c")

    assert _equal(state, await asyncio.to_thread(in_a_thread))
    with pytest.raises(RuntimeError, match="running event loop"):
        aiopersist.save_sync(state, tmp_path / "d")


async def test_map_location_meta(tmp_path: Path) -> None:
    state = {"x": torch.arange(4.0), "y": {"z": torch.ones(2)}}
    await aiopersist.save(state, tmp_path / "c")
    back = await aiopersist.load(tmp_path / "c", map_location="meta")
    assert back["x"].device.type == "meta"
    assert back["y"]["z"].shape == (2,)


# -- property-based round trips ---------------------------------------------------------------

_dtype_names = sorted(_DTYPES)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = _DTYPES[draw(st.sampled_from(_dtype_names))]
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    t = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        if n
        else torch.empty(shape, dtype=dtype)
    )
    if dtype == torch.bool:
        t = t.view(torch.uint8).remainder(2).to(torch.bool)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, -1)  # non-contiguous
    return t


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
values = st.recursive(
    st.one_of(scalars, tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=5), children, max_size=3),
        st.dictionaries(st.integers(-5, 5), children, max_size=3),
    ),
    max_leaves=8,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=values)
async def test_property_round_trip(
    backend_name: str, tmp_path_factory: pytest.TempPathFactory, obj: Any
) -> None:
    path = tmp_path_factory.mktemp("prop") / "c"
    await aiopersist.save({"root": obj}, path, backend=backend_name)
    back = await aiopersist.load(path, backend=backend_name)
    assert _equal({"root": obj}, back)


async def test_into_checks_dtypes_tuples_and_optimizer_groups_before_touching_anything(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    await aiopersist.save({"pair": (model, opt), "t": torch.zeros(2, dtype=torch.int64)}, tmp_path / "c")

    fresh = torch.nn.Linear(3, 3)
    before = fresh.weight.detach().clone()
    one_group = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(aiopersist.StateMismatchError, match=r"1 parameter groups here, saved a list of 2"):
        await aiopersist.load(
            tmp_path / "c", into={"pair": (fresh, one_group), "t": torch.zeros(2, dtype=torch.int64)}
        )
    assert torch.equal(fresh.weight, before)  # the model next to it was not loaded either
    with pytest.raises(aiopersist.StateMismatchError, match=r"dtype torch\.int64 saved, torch\.float32 here"):
        await aiopersist.load(tmp_path / "c", into={"pair": (fresh, opt), "t": torch.zeros(2)})

    two_groups = torch.optim.SGD([{"params": [fresh.weight]}, {"params": [fresh.bias]}], lr=0.1, momentum=0.9)
    target = {"pair": (fresh, two_groups), "t": torch.ones(2, dtype=torch.int64)}
    await aiopersist.load(tmp_path / "c", into=target)  # a tuple of live objects, loaded in place
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(
        two_groups.state_dict()["state"][0]["momentum_buffer"],
        opt.state_dict()["state"][0]["momentum_buffer"],
    )
    assert torch.equal(target["t"], torch.zeros(2, dtype=torch.int64))


async def test_numpy_scalars_keep_their_dtype(tmp_path: Path) -> None:
    state = {"loss": np.float32(0.25), "step": np.int64(7), "ok": np.bool_(True), "name": "x"}
    await aiopersist.save(state, tmp_path / "c")
    back = await aiopersist.load(tmp_path / "c")
    assert type(back["loss"]) is np.float32
    assert back["loss"] == np.float32(0.25)
    assert type(back["step"]) is np.int64
    assert back["step"] == 7
    assert type(back["ok"]) is np.bool_
    assert bool(back["ok"])


async def test_large_views_land_aligned_for_their_dtype(tmp_path: Path) -> None:
    base = torch.randn(2048, 1024)  # 8 MiB: read straight into its memory
    odd = torch.zeros(3, dtype=torch.uint8)
    await aiopersist.save({"v": {"a": base, "b": base[1:], "odd": odd}}, tmp_path / "c")
    back = (await aiopersist.load(tmp_path / "c"))["v"]
    for t in (back["a"], back["b"]):
        assert t.data_ptr() % t.element_size() == 0
    assert torch.equal(back["b"], base[1:])


async def test_awkward_names_and_paths(tmp_path: Path) -> None:
    state = {"__metadata__": torch.ones(2), "x": 1}  # safetensors reserves that key in a file
    await aiopersist.save(state, tmp_path / "c")
    back = await aiopersist.load(tmp_path / "c" / "aiopersist.json")  # the manifest stands for it
    assert torch.equal(back["__metadata__"], torch.ones(2))
    (tmp_path / "f").write_text("not a checkpoint")
    await aiopersist.save({"w": torch.ones(1)}, tmp_path / "f", overwrite=True)  # replaces a file
    assert (tmp_path / "f" / "aiopersist.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["c", "f"]
    with pytest.raises(ValueError, match="max_shard_bytes must be positive"):
        await aiopersist.save({"w": torch.ones(1)}, tmp_path / "g", max_shard_bytes=0)


async def test_a_data_parallel_models_checkpoint_loads_into_the_bare_model(
    backend_name: str, tmp_path: Path
) -> None:
    """Saved from a wrapped module (``module.`` keys, as DDP and DataParallel save), loaded
    into the bare one: the prefix is matched, with ``strict``."""
    torch.manual_seed(0)
    bare = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    wrapped = torch.nn.DataParallel(bare)  # on the CPU: a wrapper that adds "module."
    await aiopersist.save({"model": wrapped}, tmp_path / "ck", backend=backend_name)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    await aiopersist.load(tmp_path / "ck", into={"model": fresh}, backend=backend_name)
    for k, v in bare.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
