"""Random-number-generator states as one stateful object."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._exceptions import CheckpointCorruptError, StateMismatchError

MT_N = 624
"""Words of a Mersenne Twister's state (Python's ``random`` and numpy's legacy generator);
its position is from 0 to this (``MT_N``: every word used, the next draw regenerates)."""

_UINT32_MAX = (1 << 32) - 1


class RNGState:
    """Every RNG a training loop draws from: torch (CPU and each CUDA device), Python's
    ``random`` and numpy's global generator.

    ``state_dict()`` captures them now; ``load_state_dict()`` puts them back. Save it with
    the rest of the state (``{"model": model, "rng": aiopersist.RNGState()}``) and restore
    with ``load(path, into={"model": model, "rng": aiopersist.RNGState()})``.

    ``load_state_dict()`` checks every part of the state before it sets any generator, so
    a state that is not one this class saves changes nothing: a malformed part (a numpy
    position past the key, which numpy itself accepts and then reads memory out of bounds
    with; a Python ``random`` word over 32 bits; a torch state of the wrong size...) is a
    `CheckpointCorruptError` naming it, and CUDA states of more devices than this process
    has a `StateMismatchError`. ``load(into=...)`` makes the same checks in its first
    pass, before anything in the target is loaded.
    """

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "random": random.getstate(),
            "numpy": np.random.get_state(legacy=True),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        checked = check_rng_state(state)
        torch.set_rng_state(checked.torch_state)
        random.setstate(checked.random_state)
        np.random.set_state(checked.numpy_state)
        if checked.cuda_states is not None:
            for device, cuda_state in enumerate(checked.cuda_states):
                torch.cuda.set_rng_state(cuda_state, device)


NumpyState = tuple[str, "np.ndarray[Any, np.dtype[np.uint32]]", int, int, float]
"""numpy's legacy state: ``("MT19937", key, pos, has_gauss, cached_gaussian)``."""


@dataclass(frozen=True)
class CheckedRNGState:
    """An `RNGState` state, every part checked and copied (nothing in it shares memory
    with what was given): what ``torch.set_rng_state``, ``random.setstate``,
    ``np.random.set_state`` and ``torch.cuda.set_rng_state`` take."""

    torch_state: torch.Tensor
    random_state: tuple[int, tuple[int, ...], float | None]
    numpy_state: NumpyState
    cuda_states: tuple[torch.Tensor, ...] | None
    """``None``: none saved, or no CUDA here (then they are not restored)."""


def check_rng_state(state: object, where: str = "RNG state") -> CheckedRNGState:
    """``state`` (an `RNGState` state dict) checked part by part, as `CheckedRNGState`.

    Raises `CheckpointCorruptError` naming ``where`` and the part for anything that is not
    a state the generators could have had; `StateMismatchError` for CUDA states of more
    devices than this process has.
    """
    if not isinstance(state, Mapping):
        raise CheckpointCorruptError(f"{where}: {_a(type(state).__name__)}, not a state dict")
    for key in ("torch", "random", "numpy"):
        if key not in state:
            raise CheckpointCorruptError(f"{where}: no {key!r} part")
    torch_state = _torch_state(state["torch"], f"{where}['torch']", torch.get_rng_state().numel())
    _check_torch_generator(torch.Generator(), torch_state, f"{where}['torch']")
    random_state = _random_state(state["random"], f"{where}['random']")
    numpy_state = _numpy_state(state["numpy"], f"{where}['numpy']")
    cuda: tuple[torch.Tensor, ...] | None = None
    if "cuda" in state:
        cuda = _cuda_states(state["cuda"], f"{where}['cuda']")
    return CheckedRNGState(torch_state, random_state, numpy_state, cuda)


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_float(value: object) -> bool:
    return isinstance(value, float | np.floating) and math.isfinite(value)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor | np.ndarray):
        what = "a tensor" if isinstance(value, torch.Tensor) else "a numpy array"
        return f"{what} of dtype {value.dtype} and shape {list(value.shape)}"
    if isinstance(value, list | tuple):
        return f"{_a(type(value).__name__)} of {len(value)}"
    return _short(value)


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiouAEIOU' else 'a'} {noun}"


def _torch_state(value: object, where: str, numel: int) -> torch.Tensor:
    """A copy of a generator's state: a one-dimensional uint8 tensor of ``numel`` bytes
    (copied element by element: a view with odd strides cannot make torch read past its
    storage)."""
    if (
        not isinstance(value, torch.Tensor)
        or value.layout != torch.strided
        or value.is_nested
        or value.dtype != torch.uint8
        or value.dim() != 1
        or value.numel() != numel
    ):
        raise CheckpointCorruptError(
            f"{where}: {_describe(value)}, not a generator state (a uint8 tensor of {numel} bytes)"
        )
    copy = torch.empty(numel, dtype=torch.uint8)
    try:
        copy.copy_(value.detach())
    except (RuntimeError, NotImplementedError) as exc:  # a meta tensor, ...
        raise CheckpointCorruptError(f"{where}: cannot be read as a generator state: {exc}") from exc
    return copy


def _check_torch_generator(generator: torch.Generator, state: torch.Tensor, where: str) -> None:
    """What torch itself checks of a state (its Mersenne Twister's position, ...), on a
    scratch generator: the process's own are not touched."""
    try:
        generator.set_state(state)
    except RuntimeError as exc:
        raise CheckpointCorruptError(f"{where}: torch refuses it: {exc}") from exc


def _random_state(value: object, where: str) -> tuple[int, tuple[int, ...], float | None]:
    """Python's ``random.getstate()``: ``(3, 624 words and a position, gauss_next)``."""
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise CheckpointCorruptError(
            f"{where}: {_describe(value)}, not (version, internal state, gauss_next)"
        )
    version, internal, gauss = value
    if not _is_int(version) or version != 3:
        raise CheckpointCorruptError(f"{where}: version {_short(version)}, not 3")
    if not isinstance(internal, list | tuple) or len(internal) != MT_N + 1:
        raise CheckpointCorruptError(
            f"{where}: internal state {_describe(internal)}, not a tuple of {MT_N + 1} integers"
        )
    for i, word in enumerate(internal[:MT_N]):
        if not _is_int(word) or not 0 <= word <= _UINT32_MAX:
            raise CheckpointCorruptError(f"{where}: internal state[{i}] {_short(word)} is not in 0..2**32-1")
    index = internal[MT_N]
    if not _is_int(index) or not 0 <= index <= MT_N:
        raise CheckpointCorruptError(f"{where}: position {_short(index)} is not in 0..{MT_N}")
    if gauss is not None and not _is_float(gauss):
        raise CheckpointCorruptError(f"{where}: gauss_next {_short(gauss)} is not None or a finite float")
    return 3, tuple(int(w) for w in internal), None if gauss is None else float(gauss)


def _numpy_state(value: object, where: str) -> NumpyState:
    """numpy's legacy generator state: the tuple ``np.random.get_state()`` returns
    (``("MT19937", key, pos, has_gauss, cached_gaussian)``) or the dict of
    ``get_state(legacy=False)``."""
    if isinstance(value, Mapping):
        inner = value.get("state")
        if set(value) != {"bit_generator", "state", "has_gauss", "gauss"} or not isinstance(inner, Mapping):
            raise CheckpointCorruptError(
                f"{where}: keys {_short(sorted(map(str, value)))}, not bit_generator, state, has_gauss, gauss"
            )
        if set(inner) != {"key", "pos"}:
            keys = _short(sorted(map(str, inner)))
            raise CheckpointCorruptError(f"{where}['state']: keys {keys}, not key, pos")
        name, key, pos, has_gauss, gauss = (
            value["bit_generator"],
            inner["key"],
            inner["pos"],
            value["has_gauss"],
            value["gauss"],
        )
    elif isinstance(value, list | tuple) and len(value) == 5:
        name, key, pos, has_gauss, gauss = value
    else:
        raise CheckpointCorruptError(
            f"{where}: {_describe(value)}, not ('MT19937', key, pos, has_gauss, cached_gaussian)"
        )
    if not isinstance(name, str) or name != "MT19937":
        raise CheckpointCorruptError(f"{where}: generator {_short(name)}, not 'MT19937'")
    words = _key(key, f"{where}: key")
    if not _is_int(pos) or not 0 <= pos <= MT_N:
        raise CheckpointCorruptError(f"{where}: pos {_short(pos)} is not in 0..{MT_N}")
    if not _is_int(has_gauss) or has_gauss not in (0, 1):
        raise CheckpointCorruptError(f"{where}: has_gauss {_short(has_gauss)} is not 0 or 1")
    if not _is_float(gauss):
        raise CheckpointCorruptError(f"{where}: cached_gaussian {_short(gauss)} is not a finite float")
    return "MT19937", words, int(pos), int(has_gauss), float(gauss)


def _key(key: object, where: str) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """A copy of a Mersenne Twister key: exactly `MT_N` integers from 0 to 2**32-1."""
    if isinstance(key, np.ndarray):
        if key.dtype.kind in "iu" and key.shape == (MT_N,) and key.min() >= 0 and key.max() <= _UINT32_MAX:
            return np.array(key, dtype=np.uint32)  # a copy, contiguous
    elif (
        isinstance(key, list | tuple)
        and len(key) == MT_N
        and all(_is_int(w) and 0 <= w <= _UINT32_MAX for w in key)
    ):
        return np.array([int(w) for w in key], dtype=np.uint32)
    raise CheckpointCorruptError(f"{where} {_describe(key)}, not {MT_N} integers from 0 to 2**32-1")


def _cuda_states(value: object, where: str) -> tuple[torch.Tensor, ...] | None:
    """One state per CUDA device (``torch.cuda.get_rng_state_all()``); checked against
    this process's devices when it has CUDA (``None`` otherwise: not restored)."""
    if not isinstance(value, list | tuple) or not all(isinstance(t, torch.Tensor) for t in value):
        raise CheckpointCorruptError(f"{where}: {_describe(value)}, not a list of generator states")
    if not torch.cuda.is_available():
        for i, t in enumerate(value):
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise CheckpointCorruptError(f"{where}[{i}]: {_describe(t)}, not a generator state")
        return None
    devices = torch.cuda.device_count()
    if len(value) > devices:
        raise StateMismatchError(
            f"{where}: the RNG states of {len(value)} CUDA devices, {devices} here; nothing was loaded"
        )
    states = []
    for i, t in enumerate(value):
        checked = _torch_state(t, f"{where}[{i}]", torch.cuda.get_rng_state(i).numel())
        _check_torch_generator(torch.Generator(device=f"cuda:{i}"), checked, f"{where}[{i}]")
        states.append(checked)
    return tuple(states)
