"""Random-number-generator states as one stateful object."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """Every RNG a training loop draws from: torch (CPU and each CUDA device), Python's
    ``random`` and numpy's global generator.

    ``state_dict()`` captures them now; ``load_state_dict()`` puts them back. Save it with
    the rest of the state (``{"model": model, "rng": aiopersist.RNGState()}``) and restore
    with ``load(path, into={"model": model, "rng": aiopersist.RNGState()})``.
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        version, internal, gauss = state["random"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(tuple(state["numpy"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
