"""``load(..., into=target)``: put a loaded state into live objects, in place.

Two passes over the target and the loaded state side by side: the first only checks
(keys, shapes, dtypes) and collects every mismatch, so that with ``strict`` nothing is
touched unless everything fits; the second copies tensors in place and hands state dicts
to ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any

import torch

from ._exceptions import StateMismatchError


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class _Check:
    def __init__(self) -> None:
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.wrong: list[str] = []

    def walk(self, target: object, saved: object, where: str) -> None:
        if isinstance(target, torch.nn.Module):
            self.mapping(target.state_dict(), saved, where)
        elif _is_stateful(target):
            if not isinstance(saved, Mapping):
                self.wrong.append(f"{where}: saved a {type(saved).__name__}, not a state dict")
        elif isinstance(target, torch.Tensor):
            if not isinstance(saved, torch.Tensor):
                self.wrong.append(f"{where}: saved a {type(saved).__name__}, not a tensor")
            elif saved.shape != target.shape:
                self.wrong.append(f"{where}: shape {tuple(saved.shape)} saved, {tuple(target.shape)} here")
        elif isinstance(target, Mapping):
            self.mapping(target, saved, where)
        elif isinstance(target, MutableSequence):
            if not isinstance(saved, list | tuple) or len(saved) != len(target):
                self.wrong.append(f"{where}: a list of {len(target)} here, saved {_describe(saved)}")
            else:
                for i, (t, s) in enumerate(zip(target, saved, strict=True)):
                    self.walk(t, s, f"{where}[{i}]")

    def mapping(self, target: Mapping[Any, Any], saved: object, where: str) -> None:
        if not isinstance(saved, Mapping):
            self.wrong.append(f"{where}: a mapping here, saved {_describe(saved)}")
            return
        for key in target:
            if key not in saved:
                self.missing.append(f"{where}[{key!r}]")
        for key in saved:
            if key not in target:
                self.unexpected.append(f"{where}[{key!r}]")
        for key in target:
            if key in saved:
                self.walk(target[key], saved[key], f"{where}[{key!r}]")


def _describe(obj: object) -> str:
    if isinstance(obj, list | tuple):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__name__}"


def _apply(target: object, saved: Any, strict: bool) -> object:
    """Load ``saved`` into ``target``; returns what should stand in the parent container."""
    if isinstance(target, torch.nn.Module):
        target.load_state_dict(saved, strict=strict)
        return target
    if _is_stateful(target):
        target.load_state_dict(saved)  # type: ignore[attr-defined]
        return target
    if isinstance(target, torch.Tensor):
        if isinstance(saved, torch.Tensor) and saved.shape == target.shape:
            with torch.no_grad():
                target.copy_(saved)
        return target
    if isinstance(target, MutableMapping):
        for key in list(target):
            if key in saved:
                target[key] = _apply(target[key], saved[key], strict)
        return target
    if isinstance(target, MutableSequence) and isinstance(saved, list | tuple) and len(saved) == len(target):
        for i in range(len(target)):
            target[i] = _apply(target[i], saved[i], strict)
        return target
    return saved  # a plain value: the saved one replaces it in its container


def load_into(target: object, saved: Any, *, strict: bool) -> None:
    """See the module docstring. Raises `StateMismatchError` listing every mismatch."""
    check = _Check()
    check.walk(target, saved, "state")
    if check.wrong or (strict and (check.missing or check.unexpected)):
        lines = []
        if check.missing:
            lines.append("missing in the checkpoint: " + ", ".join(check.missing))
        if check.unexpected:
            lines.append("unexpected in the checkpoint: " + ", ".join(check.unexpected))
        lines.extend(check.wrong)
        raise StateMismatchError(
            "the checkpoint does not fit the target; nothing was loaded:\n  " + "\n  ".join(lines),
            check.missing,
            check.unexpected,
        )
    _apply(target, saved, strict)
