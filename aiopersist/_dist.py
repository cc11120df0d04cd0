"""Coordination of a save between ranks, through ``torch.distributed``.

Only metadata travels between ranks (``all_gather_object`` on a gloo group of the
checkpoint's own, made once per process group): the tensors never leave their rank. The
collectives run in worker threads, so the event loop goes on writing meanwhile, and they
have a timeout (`AIOPERSIST_DIST_TIMEOUT`, seconds), so a rank that died cannot hang the
others forever.

Every phase of a distributed save ends with one exchange in which each rank says whether
it got through. If any rank failed, every rank raises: the failed rank its own error, the
others [`RankFailedError`][aiopersist.RankFailedError] naming the rank and its error. So a
save either commits on every rank or on none.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import _knobs
from ._backends._base import to_thread_to_the_end
from ._exceptions import RankFailedError

# The checkpoint's own gloo groups, by the group they serve (None: the default group),
# each as (the default group, the served group, the gloo group), all held weakly. Torch's
# registry holds the groups until destroy_process_group(), and so does nothing here: a
# group kept alive past it keeps its gloo threads running into interpreter shutdown,
# where a thread dropping the last reference to a finished collective's tensors needs the
# GIL, cannot have it, and aborts the process ("terminate called without an active
# exception"). After destroy_process_group() and a new init_process_group(), the weak
# references are dead, so a group of the old world is never used, nor one cached under
# a recycled id().
_groups: dict[object, tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]] = {}


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj``; a strong one to what takes none (``None``, and the
    ``int`` torch gives ranks outside a group)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class GroupRef:
    """Holds a process group without keeping it alive past ``destroy_process_group()``
    (see `_groups`); `get` returns it, or raises once it has been destroyed."""

    def __init__(self, group: Any) -> None:
        self._ref = _weak(group)

    def get(self) -> Any:
        group = self._ref()
        if group is None:
            raise RuntimeError(
                "the process group this checkpoint was set up with has been destroyed "
                "(torch.distributed.destroy_process_group): no rank can save through it any more"
            )
        return group


@dataclass(frozen=True)
class _Outcome:
    rank: int
    value: Any = None
    error: str | None = None
    """``"TypeName: message"`` of the exception this rank raised, or ``None``."""
    tag: Any = None
    """Which save and which of its exchanges this is: every rank must be at the same."""


class Coordinator:
    """The ranks of one save: ``rank`` of ``world_size``, exchanging metadata over a
    gloo group."""

    def __init__(self, rank: int, world_size: int, local_rank: int, group: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.group = group

    async def exchange(self, value: Any, error: BaseException | None = None, tag: Any = None) -> list[Any]:
        """Every rank's ``value``, by rank. If any rank reports an error (``error`` here),
        every rank raises: this rank its own ``error``, the others `RankFailedError`.
        ``tag`` names the save and the exchange: ranks at different ones (one retried
        another save after failing alone, or was cancelled) all raise `RankFailedError`
        rather than take each other's values."""
        text = None if error is None else f"{type(error).__name__}: {error}"
        outcome = _Outcome(self.rank, None if error is not None else value, text, tag)
        # In a worker thread: the event loop goes on writing meanwhile. A save makes its
        # exchanges one after another; concurrent saves over the same ranks are not
        # supported (a Checkpointer with several ranks runs one at a time). Awaited to its
        # end even if the caller is cancelled: a gather left running on the group would
        # meet the next save's and make gloo abort the process.
        gathered = await to_thread_to_the_end(self._all_gather, outcome)
        # Every rank raises unless all are at the same exchange and none failed; a failure
        # is named first (also one at another save: a rank whose path was what failed).
        if error is not None:
            raise error
        failed = [o for o in gathered if o.error is not None]
        if failed:
            first = failed[0]
            raise RankFailedError(
                f"the save failed on rank {first.rank}: {first.error}"
                + (f" (and on {len(failed) - 1} more ranks)" if len(failed) > 1 else "")
            )
        tags = {repr(o.tag) for o in gathered}
        if len(tags) > 1:
            raise RankFailedError(
                "the ranks are not at the same save: "
                + ", ".join(f"rank {o.rank} at {o.tag!r}" for o in gathered)
                + " (a rank failed or was cancelled alone, then saved again)"
            )
        return [o.value for o in gathered]

    def _all_gather(self, outcome: _Outcome) -> list[_Outcome]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, outcome, group=self.group)
        except RuntimeError as exc:  # gloo's timeouts and lost peers
            raise RankFailedError(
                f"rank {self.rank}: exchanging checkpoint metadata with the other ranks failed "
                f"(a rank died or did not call save within {_knobs.dist_timeout():.0f} s): {exc}"
            ) from exc
        return out


def coordinator(group: Any = None) -> Coordinator | None:
    """The coordinator for ``group`` (the default process group when ``None``), or ``None``
    when ``torch.distributed`` is not initialised or the group has one rank.

    Must be called by every rank of the group, in the same order, from the thread that
    issues the training's collectives: the first call makes the checkpoint's gloo group,
    which is itself a collective.
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        if group is not None:
            raise ValueError("group= given, but torch.distributed is not initialised")
        return None
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world <= 1:
        return None
    key = id(group) if group is not None else None
    world_group = dist.group.WORLD
    entry = _groups.get(key)
    gloo = None
    if entry is not None and entry[0]() is world_group and entry[1]() is group:
        gloo = entry[2]()
    if gloo is None:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        timeout = datetime.timedelta(seconds=_knobs.dist_timeout())
        # A group of the checkpoint's own: gloo whatever the training uses (NCCL on GPUs),
        # with the checkpoint's timeout, and never in the way of the training's collectives.
        try:
            # For a subgroup only its members call save: they alone make the group.
            gloo = dist.new_group(
                ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=group is not None
            )
        except RuntimeError as exc:  # the store's timeout: a rank never came
            raise RankFailedError(
                f"making the checkpoint's gloo group failed (a rank died or did not call save within "
                f"{timeout.total_seconds():.0f} s): {exc}"
            ) from exc
        _groups[key] = (_weak(world_group), _weak(group), _weak(gloo))
    rank = dist.get_rank(group)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return Coordinator(rank, world, local_rank, gloo)


_derived_groups: dict[tuple[object, str], tuple[Callable[[], Any], Callable[[], Any]]] = {}
"""(id(checkpoint group), which) -> (that group, the group made from it), held weakly as
`_groups` are."""


def _derived_group(coord: Coordinator, which: str, ranks: list[int] | None) -> Any:
    import torch.distributed as dist

    key = (id(coord.group), which)
    entry = _derived_groups.get(key)
    group = entry[1]() if entry is not None and entry[0]() is coord.group else None
    if group is None:
        # With the checkpoint's timeout, as the checkpoint group: a rank that died fails
        # the others' saves after AIOPERSIST_DIST_TIMEOUT, not torch's 30 minutes.
        group = dist.new_group(
            ranks, backend="gloo", timeout=datetime.timedelta(seconds=_knobs.dist_timeout())
        )
        _derived_groups[key] = (_weak(coord.group), _weak(group))
    return group


def process0_group(coord: Coordinator) -> Any:
    """A gloo group holding process 0 alone, for saves that process 0 writes by itself
    (the Hugging Face layouts): given as ``group=``, the save needs no other rank.

    Made once per checkpoint group. Making a group is a collective: every rank calls
    this, in the same order, from the thread that issues the training's collectives.
    """
    return _derived_group(coord, "process 0", [0])


def background_group(coord: Coordinator) -> Any:
    """A gloo group of every rank for the collectives of saves that run in a background
    thread (the FSDP checkpoints of the Hugging Face integrations): its own, so that they
    never interleave with the training's or the checkpoint group's. Made once per
    checkpoint group, as `process0_group` is (a collective: every rank calls it, in the
    same order)."""
    return _derived_group(coord, "background", None)


@atexit.register
def _release_groups() -> None:
    """At exit, while the interpreter is still whole: destroy the checkpoint's own groups
    that the program left alive (it never called ``destroy_process_group()``), so that
    their gloo threads are joined now rather than during interpreter shutdown (see
    `_groups`). The training's groups are the program's, and are left alone."""
    import torch.distributed as dist

    ours = [entry[2]() for entry in _groups.values()]
    ours += [entry[1]() for entry in _derived_groups.values()]
    _groups.clear()
    _derived_groups.clear()
    if not dist.is_available() or not dist.is_initialized():
        return
    for group in ours:
        if isinstance(group, dist.ProcessGroup):
            # Destroyed already (ValueError), or failing: the process is exiting anyway.
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
