"""FSDP under Accelerate on a machine without GPUs, for the tests.

Accelerate turns an FSDP plugin into FSDP only on GPU-like devices: on CPU (``cpu=True``,
``use_cpu=True``) it silently runs DDP (``MULTI_CPU``) instead. FSDP2 itself runs on CPU
with gloo, so the tests make Accelerate take the plugin as it would on GPUs:
`force_fsdp_on_cpu` wraps ``AcceleratorState.__init__`` so that, when an FSDP plugin is
given and Accelerate chose ``MULTI_CPU``, the state says ``FSDP`` with that plugin, as
Accelerate's own GPU branch sets it. Everything after that (``fully_shard`` of the
model, the Trainer's and Accelerate's FSDP saving and loading) is the libraries' own code.
"""

from __future__ import annotations

import functools
from typing import Any


def force_fsdp_on_cpu() -> None:
    import accelerate.state as state
    from accelerate.utils import DistributedType

    original = state.AcceleratorState.__init__
    if getattr(original, "_aiopersist_forced", False):
        return

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # PartialState's shared state answers distributed_type for every state object.
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    init._aiopersist_forced = True  # type: ignore[attr-defined]
    state.AcceleratorState.__init__ = init  # type: ignore[method-assign]
