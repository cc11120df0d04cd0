"""``load(..., into=target)``: put a loaded state into live objects, in place.

Two passes over the target and the loaded state side by side: the first only checks
(keys, shapes, dtypes, optimizer parameter groups, every part of an `RNGState`'s state:
a forged one is a `CheckpointCorruptError`) and collects every mismatch, so that nothing
is touched unless everything fits (missing and unexpected keys count only with
``strict``); the second copies tensors in place and hands state dicts to
``load_state_dict``. An object's own ``load_state_dict`` may still refuse in the second
pass (its checks are its own); that error comes as `StateMismatchError`, chained.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any, cast

import torch

from ._exceptions import AiopersistError, StateMismatchError
from ._rng import RNGState, check_rng_state


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class _Check:
    def __init__(self) -> None:
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.wrong: list[str] = []

    def walk(self, target: object, saved: object, where: str) -> None:
        if isinstance(target, torch.nn.Module):
            own = target.state_dict()
            self.mapping(own, wrapper_aligned(own, saved), where)
        elif _is_stateful(target):
            if not isinstance(saved, Mapping):
                self.wrong.append(f"{where}: saved a {type(saved).__name__}, not a state dict")
            elif isinstance(target, torch.optim.Optimizer):
                self.optimizer(target, saved, where)
            elif isinstance(target, RNGState):
                check_rng_state(saved, where)  # a forged state: CheckpointCorruptError, now
        elif isinstance(target, torch.Tensor):
            if not isinstance(saved, torch.Tensor):
                self.wrong.append(f"{where}: saved a {type(saved).__name__}, not a tensor")
            elif saved.shape != target.shape:
                self.wrong.append(f"{where}: shape {tuple(saved.shape)} saved, {tuple(target.shape)} here")
            elif saved.dtype != target.dtype:
                self.wrong.append(f"{where}: dtype {saved.dtype} saved, {target.dtype} here")
        elif isinstance(target, Mapping):
            self.mapping(target, saved, where)
        elif isinstance(target, MutableSequence | tuple):
            if not isinstance(saved, list | tuple) or len(saved) != len(target):
                self.wrong.append(f"{where}: a list of {len(target)} here, saved {_describe(saved)}")
            else:
                for i, (t, s) in enumerate(zip(target, saved, strict=True)):
                    self.walk(t, s, f"{where}[{i}]")

    def optimizer(self, target: torch.optim.Optimizer, saved: Mapping[Any, Any], where: str) -> None:
        # The checks load_state_dict makes, made before anything is loaded anywhere.
        groups = saved.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(target.param_groups):
            self.wrong.append(
                f"{where}: {len(target.param_groups)} parameter groups here, saved {_describe(groups)}"
            )
            return
        for i, (mine, theirs) in enumerate(zip(target.param_groups, groups, strict=True)):
            if not isinstance(theirs, Mapping) or len(theirs.get("params", ())) != len(mine["params"]):
                self.wrong.append(f"{where}['param_groups'][{i}]: the number of parameters differs")

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


WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""What wrapping a module adds to its state dict's keys: ``DistributedDataParallel`` (and
``DataParallel``) ``module.``, ``torch.compile`` ``_orig_mod.``."""


def wrapper_aligned(own: Mapping[str, Any], saved: object) -> object:
    """``saved`` with its keys matched to a module's own: a state saved from a wrapped
    module (``module.w``) loads into the bare one (``w``) and the other way round. Only
    when adding or removing one wrapper's prefix on every key gives exactly the module's
    keys; otherwise ``saved`` as it is (and the mismatch is reported as such)."""
    if not isinstance(saved, Mapping) or not saved or set(saved) == set(own):
        return saved
    keys = list(saved)
    if not all(isinstance(k, str) for k in keys):
        return saved
    mine = set(own)
    for prefix in WRAPPER_PREFIXES:
        if all(k.startswith(prefix) for k in keys) and {k[len(prefix) :] for k in keys} == mine:
            return {k[len(prefix) :]: v for k, v in saved.items()}
        if {prefix + k for k in keys} == mine:
            return {prefix + k: v for k, v in saved.items()}
    return saved


def _wrapper_hint(missing: list[str], unexpected: list[str]) -> str | None:
    for prefix in WRAPPER_PREFIXES:
        marker = f"['{prefix}"
        if unexpected and all(marker in u for u in unexpected):
            return (
                f"the checkpoint's keys start with {prefix!r} (saved from a wrapped module: "
                f"{'DistributedDataParallel' if prefix == 'module.' else 'torch.compile'}) and some do not "
                "match this module even without it"
            )
        if missing and all(marker in m for m in missing):
            return (
                f"this module's keys start with {prefix!r} and some do not match the checkpoint even with it"
            )
    return None


def _describe(obj: object) -> str:
    if isinstance(obj, list | tuple):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__name__}"


def _apply(target: object, saved: Any, strict: bool) -> object:
    """Load ``saved`` into ``target``; returns what should stand in the parent container."""
    if isinstance(target, torch.nn.Module):
        target.load_state_dict(
            cast(Mapping[str, Any], wrapper_aligned(target.state_dict(), saved)), strict=strict
        )
        return target
    if _is_stateful(target):
        try:
            target.load_state_dict(saved)  # type: ignore[attr-defined]
        except AiopersistError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise StateMismatchError(
                f"{type(target).__name__}.load_state_dict refused the saved state: {exc}"
            ) from exc
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
    if isinstance(target, tuple) and isinstance(saved, list | tuple) and len(saved) == len(target):
        # A tuple cannot change, but what it holds can be loaded in place; plain values in
        # it stay as they are.
        for t, s in zip(target, saved, strict=True):
            _apply(t, s, strict)
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
        hint = _wrapper_hint(check.missing, check.unexpected)
        if hint is not None:
            lines.append(hint)
        raise StateMismatchError(
            "the checkpoint does not fit the target; nothing was loaded:\n  " + "\n  ".join(lines),
            check.missing,
            check.unexpected,
        )
    _apply(target, saved, strict)
