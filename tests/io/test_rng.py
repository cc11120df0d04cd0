"""A forged RNG state in a checkpoint: ``load(into=...)`` refuses it before anything is
loaded (numpy itself takes a position past its key, and then reads memory out of bounds)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiopersist
from tests.io.test_corruption import _rewrite_manifest
from tests.unit.test_rng import _generators_restored, generators, same_generators

pytestmark = pytest.mark.asyncio

__all__ = ["_generators_restored"]  # autouse: every test here ends with sane generators


def _rng(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["skeleton"]["rng"]["state"]


def _numpy_pos(doc: dict[str, Any]) -> None:
    _rng(doc)["numpy"]["__tuple__"][2] = 10**9


def _random_word(doc: dict[str, Any]) -> None:
    _rng(doc)["random"]["__tuple__"][1]["__tuple__"][7] = 1 << 40


def _random_position(doc: dict[str, Any]) -> None:
    _rng(doc)["random"]["__tuple__"][1]["__tuple__"][624] = 10**6


def _numpy_has_gauss(doc: dict[str, Any]) -> None:
    _rng(doc)["numpy"]["__tuple__"][3] = 7


def _tensors_swapped(doc: dict[str, Any]) -> None:
    # The torch state and numpy's key trade places: each the wrong dtype and size.
    state = _rng(doc)
    torch_ref = state["torch"]
    state["torch"] = state["numpy"]["__tuple__"][1]
    state["numpy"]["__tuple__"][1] = torch_ref


FORGED: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("numpy pos", _numpy_pos, r"state\['rng'\]\['numpy'\]: pos 1000000000 is not in 0\.\.624"),
    ("numpy has_gauss", _numpy_has_gauss, r"state\['rng'\]\['numpy'\]: has_gauss 7"),
    ("random word", _random_word, r"state\['rng'\]\['random'\]: internal state\[7\] 1099511627776"),
    ("random position", _random_position, r"state\['rng'\]\['random'\]: position 1000000 "),
    (
        "tensors swapped",
        _tensors_swapped,
        r"state\['rng'\]\['torch'\]: a numpy array of dtype uint32 and shape \[624\]",
    ),
]


@pytest.fixture
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


@pytest.mark.parametrize(("forge", "match"), [f[1:] for f in FORGED], ids=[f[0] for f in FORGED])
async def test_a_forged_rng_state_is_refused_before_anything_is_loaded(
    backend_name: str,
    tmp_path: Path,
    model: torch.nn.Module,
    forge: Callable[[dict[str, Any]], None],
    match: str,
) -> None:
    ckpt = tmp_path / "c"
    await aiopersist.save({"model": model, "rng": aiopersist.RNGState()}, ckpt, backend=backend_name)
    _rewrite_manifest(ckpt, forge)
    await aiopersist.verify(
        ckpt, backend=backend_name
    )  # the manifest is sealed again: only its content is wrong
    target = torch.nn.Linear(4, 4)
    weights = [p.detach().clone() for p in target.parameters()]
    before = generators()
    with pytest.raises(aiopersist.CheckpointCorruptError, match=match):
        await aiopersist.load(
            ckpt, into={"model": target, "rng": aiopersist.RNGState()}, backend=backend_name
        )
    assert all(torch.equal(p, w) for p, w in zip(target.parameters(), weights, strict=True))
    assert same_generators(generators(), before)
    np.random.random(3)  # numpy still draws from its own key
    # Without into=, the state comes back as data; RNGState refuses it the same way.
    loaded = await aiopersist.load(ckpt, backend=backend_name)
    before = generators()
    with pytest.raises(
        aiopersist.CheckpointCorruptError, match=match.replace(r"state\['rng'\]", "RNG state")
    ):
        aiopersist.RNGState().load_state_dict(loaded["rng"])
    assert same_generators(generators(), before)


async def test_a_saved_rng_state_loads_back(
    backend_name: str, tmp_path: Path, model: torch.nn.Module
) -> None:
    ckpt = tmp_path / "c"
    await aiopersist.save({"model": model, "rng": aiopersist.RNGState()}, ckpt, backend=backend_name)
    expected = generators()
    np.random.random(5)
    torch.rand(5)
    await aiopersist.load(ckpt, into={"model": model, "rng": aiopersist.RNGState()}, backend=backend_name)
    assert same_generators(generators(), expected)
