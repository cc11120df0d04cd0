"""RNGState.load_state_dict checks every part of a state before it sets any generator."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import aiopersist


def generators() -> tuple[torch.Tensor, object, tuple[Any, ...]]:
    """What the process's generators are now (torch CPU, random, numpy)."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=True)


def same_generators(a: tuple[torch.Tensor, object, tuple[Any, ...]], b: Any) -> bool:
    return (
        torch.equal(a[0], b[0])
        and a[1] == b[1]
        and a[2][0] == b[2][0]
        and np.array_equal(a[2][1], b[2][1])
        and a[2][2:] == b[2][2:]
    )


@pytest.fixture(autouse=True)
def _generators_restored() -> Iterator[None]:
    """Whatever a test (or the code before the fix) leaves, the next one draws from sane
    generators: a numpy position past the key would read memory out of bounds."""
    torch_state, random_state, numpy_state = generators()
    yield
    torch.set_rng_state(torch_state)
    random.setstate(random_state)  # type: ignore[arg-type]
    np.random.set_state(numpy_state)


def _state() -> dict[str, Any]:
    # Generators moved away from where the test starts, so that a partial load shows.
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    state = aiopersist.RNGState().state_dict()
    torch.manual_seed(2)
    random.seed(2)
    np.random.seed(2)
    return state


def _numpy(i: int, value: object) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        parts = list(state["numpy"])
        parts[i] = value
        state["numpy"] = tuple(parts)

    return change


def _random_word(i: int, value: object) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        version, internal, gauss = state["random"]
        words = list(internal)
        words[i] = value
        state["random"] = (version, tuple(words), gauss)

    return change


def _random(i: int, value: object) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        parts = list(state["random"])
        parts[i] = value
        state["random"] = tuple(parts)

    return change


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        state[key] = value

    return change


def _invalid_torch_state(state: dict[str, Any]) -> None:
    # The right size, but a Mersenne Twister whose position is past its state: torch
    # refuses it (checked on a scratch generator, not the process's).
    bad = torch.zeros_like(state["torch"])
    state["torch"] = bad


FORGED: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("numpy pos far out", _numpy(2, 10**9), r"\['numpy'\]: pos 1000000000 is not in 0\.\.624"),
    ("numpy pos 625", _numpy(2, 625), r"\['numpy'\]: pos 625 "),
    ("numpy pos -1", _numpy(2, -1), r"\['numpy'\]: pos -1 "),
    ("numpy pos float", _numpy(2, 3.0), r"\['numpy'\]: pos 3\.0 "),
    ("numpy pos bool", _numpy(2, True), r"\['numpy'\]: pos True "),
    ("numpy has_gauss 2", _numpy(3, 2), r"\['numpy'\]: has_gauss 2 is not 0 or 1"),
    ("numpy gaussian str", _numpy(4, "0.5"), r"\['numpy'\]: cached_gaussian '0\.5' is not a finite float"),
    ("numpy gaussian nan", _numpy(4, float("nan")), r"\['numpy'\]: cached_gaussian nan "),
    ("numpy generator", _numpy(0, "PCG64"), r"\['numpy'\]: generator 'PCG64', not 'MT19937'"),
    ("numpy key short", _numpy(1, np.zeros(623, dtype=np.uint32)), r"\['numpy'\]: key .* shape \[623\]"),
    ("numpy key long", _numpy(1, np.zeros(625, dtype=np.uint32)), r"\['numpy'\]: key .* shape \[625\]"),
    ("numpy key float", _numpy(1, np.zeros(624)), r"\['numpy'\]: key .* dtype float64"),
    ("numpy key negative", _numpy(1, np.full(624, -1, dtype=np.int64)), r"\['numpy'\]: key "),
    ("numpy key over 32 bits", _numpy(1, [1 << 32] * 624), r"\['numpy'\]: key a list of 624"),
    ("numpy key 2-d", _numpy(1, np.zeros((624, 1), dtype=np.uint32)), r"\['numpy'\]: key "),
    ("numpy short tuple", _set("numpy", ("MT19937", np.zeros(624, dtype=np.uint32), 0)), r"\['numpy'\]: a "),
    ("numpy not a tuple", _set("numpy", 7), r"\['numpy'\]: 7, not"),
    ("random version 2", _random(0, 2), r"\['random'\]: version 2, not 3"),
    (
        "random word over 32 bits",
        _random_word(5, 1 << 40),
        r"\['random'\]: internal state\[5\] 1099511627776 ",
    ),
    ("random word negative", _random_word(0, -1), r"\['random'\]: internal state\[0\] -1 "),
    ("random word float", _random_word(3, 1.0), r"\['random'\]: internal state\[3\] 1\.0 "),
    ("random position 625", _random_word(624, 625), r"\['random'\]: position 625 is not in 0\.\.624"),
    ("random gauss str", _random(2, "x"), r"\['random'\]: gauss_next 'x' is not None or a finite float"),
    ("random words short", _random(1, tuple(range(624))), r"\['random'\]: internal state a tuple of 624"),
    ("random not a tuple", _set("random", None), r"\['random'\]: None, not"),
    ("torch float", _set("torch", torch.zeros(5056)), r"\['torch'\]: a tensor of dtype torch\.float32"),
    ("torch short", _set("torch", torch.zeros(100, dtype=torch.uint8)), r"\['torch'\]: .* shape \[100\]"),
    (
        "torch 2-d",
        _set("torch", torch.zeros(1, 5056, dtype=torch.uint8)),
        r"\['torch'\]: .* shape \[1, 5056\]",
    ),
    ("torch not a tensor", _set("torch", b"\x00" * 5056), r"\['torch'\]: b'"),
    ("torch refuses it", _invalid_torch_state, r"\['torch'\]: torch refuses it"),
    ("cuda not a list", _set("cuda", "x"), r"\['cuda'\]: 'x', not a list of generator states"),
    ("cuda not tensors", _set("cuda", [1, 2]), r"\['cuda'\]: a list of 2, not a list of generator states"),
]


@pytest.mark.parametrize(("change", "match"), [f[1:] for f in FORGED], ids=[f[0] for f in FORGED])
def test_a_forged_part_is_refused_and_no_generator_changes(
    change: Callable[[dict[str, Any]], None], match: str
) -> None:
    state = _state()
    change(state)
    before = generators()
    with pytest.raises(aiopersist.CheckpointCorruptError, match=match):
        aiopersist.RNGState().load_state_dict(state)
    assert same_generators(generators(), before)
    np.random.random(3)  # a sane generator still


@pytest.mark.parametrize("missing", ["torch", "random", "numpy"])
def test_a_missing_part_is_refused(missing: str) -> None:
    state = _state()
    del state[missing]
    with pytest.raises(aiopersist.CheckpointCorruptError, match=f"no '{missing}' part"):
        aiopersist.RNGState().load_state_dict(state)


def test_a_state_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(aiopersist.CheckpointCorruptError, match="RNG state: a list, not a state dict"):
        aiopersist.RNGState().load_state_dict([1, 2])  # type: ignore[arg-type]


def test_a_valid_state_puts_every_generator_back() -> None:
    state = _state()
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    expected = (torch.rand(3), random.random(), np.random.random(3))
    aiopersist.RNGState().load_state_dict(state)
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1]
    assert np.array_equal(np.random.random(3), expected[2])


def test_the_state_is_copied_not_kept() -> None:
    from aiopersist._rng import check_rng_state

    state = _state()
    checked = check_rng_state(state)
    assert checked.torch_state.data_ptr() != state["torch"].data_ptr()
    assert not np.shares_memory(checked.numpy_state[1], state["numpy"][1])


def _key_as_list(state: tuple[Any, ...]) -> tuple[Any, ...]:
    return (state[0], [int(w) for w in state[1]], *state[2:])


@pytest.mark.parametrize(
    "numpy_state",
    [
        pytest.param(lambda: np.random.get_state(legacy=False), id="dict"),
        pytest.param(lambda: list(np.random.get_state()), id="list"),
        pytest.param(
            lambda: (lambda s: (s[0], [int(w) for w in s[1]], *s[2:]))(np.random.get_state()),
            id="key as list",
        ),
    ],
)
def test_numpys_other_forms_of_its_state_load(numpy_state: Callable[[], Any]) -> None:
    state = _state()
    np.random.seed(1)
    np.random.random(7)  # a position inside the key, a cached gaussian
    np.random.standard_normal(1)
    state["numpy"] = numpy_state()
    expected = np.random.random(3), np.random.standard_normal(3)
    aiopersist.RNGState().load_state_dict(state)
    assert np.array_equal(np.random.random(3), expected[0])
    assert np.array_equal(np.random.standard_normal(3), expected[1])


def test_a_forged_numpy_dict_is_refused() -> None:
    state = _state()
    forged = np.random.get_state(legacy=False)
    forged["state"]["pos"] = 10**9
    state["numpy"] = forged
    with pytest.raises(aiopersist.CheckpointCorruptError, match=r"\['numpy'\]: pos 1000000000"):
        aiopersist.RNGState().load_state_dict(state)
    forged["state"]["extra"] = 1
    with pytest.raises(aiopersist.CheckpointCorruptError, match=r"\['numpy'\]\['state'\]: keys"):
        aiopersist.RNGState().load_state_dict(state)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA states are restored here")
def test_well_formed_cuda_states_are_left_alone_without_cuda() -> None:
    state = _state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    aiopersist.RNGState().load_state_dict(state)
    state["cuda"] = [torch.zeros(16)]
    with pytest.raises(
        aiopersist.CheckpointCorruptError, match=r"\['cuda'\]\[0\]: a tensor of dtype torch.float32"
    ):
        aiopersist.RNGState().load_state_dict(state)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_states_are_checked_per_device_before_any_is_set() -> None:
    state = _state()
    cuda_before = torch.cuda.get_rng_state_all()
    size = torch.cuda.get_rng_state(0).numel()
    state["cuda"] = [torch.zeros(size + 1, dtype=torch.uint8)]
    with pytest.raises(aiopersist.CheckpointCorruptError, match=rf"\['cuda'\]\[0\]: .* shape \[{size + 1}\]"):
        aiopersist.RNGState().load_state_dict(state)
    state["cuda"] = [torch.zeros(size, dtype=torch.uint8)] * (torch.cuda.device_count() + 1)
    with pytest.raises(aiopersist.StateMismatchError, match="CUDA devices"):
        aiopersist.RNGState().load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda_before, strict=True))
    torch.cuda.manual_seed_all(3)
    saved = aiopersist.RNGState().state_dict()
    expected = torch.rand(3, device="cuda")
    aiopersist.RNGState().load_state_dict(saved)
    assert torch.equal(torch.rand(3, device="cuda"), expected)
