"""``load(into=...)``'s checks and copies (pure: live objects and state dicts in memory)."""

from __future__ import annotations

import pytest
import torch

from aiopersist import StateMismatchError
from aiopersist._into import load_into


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod."])
def test_a_wrapped_modules_state_loads_into_the_bare_module_and_back(prefix: str) -> None:
    saved = _model(0).state_dict()
    wrapped = {prefix + k: v for k, v in saved.items()}  # what DDP / torch.compile save
    bare = _model(1)
    load_into(bare, wrapped, strict=True)
    assert all(torch.equal(bare.state_dict()[k], v) for k, v in saved.items())
    # And the other way: a bare state into a wrapped module (DDP on one process is enough
    # for its keys; a plain holder with the same prefix stands in for it here).
    holder = torch.nn.Module()
    holder.add_module(prefix.rstrip("."), _model(2))
    load_into(holder, saved, strict=True)
    inner = getattr(holder, prefix.rstrip("."))
    assert all(torch.equal(inner.state_dict()[k], v) for k, v in saved.items())


def test_a_prefix_that_does_not_explain_the_keys_is_reported_with_a_hint() -> None:
    saved = {"module." + k: v for k, v in _model(0).state_dict().items()}
    saved["module.extra"] = torch.zeros(1)
    target = _model(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"start with 'module\.' \(saved from a wrapped module"):
        load_into(target, saved, strict=True)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())  # nothing loaded
