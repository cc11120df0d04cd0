"""Retention policies (pure): which complete steps a `CheckpointManager` keeps.

A policy says which of the complete steps it keeps; policies combine with ``|`` (a step
stays if any of them keeps it). Whatever the policy, retention never deletes the newest
complete step, a step being written or restored, or one waiting to be mirrored: those
are added by `to_delete`, not left to the policy.

    KeepLast(3)                      the newest three
    KeepLast(3) | KeepEvery(1000)    and every thousandth step, for good
    KeepSteps({500})                 a step pinned by hand (with another policy)

`SaveTotalLimit` is the Hugging Face Trainer's ``save_total_limit`` rule (the best
checkpoint counted among those kept), which the Trainer integration and ``aiopersist gc``
on a Trainer's ``output_dir`` apply; `to_delete`'s ``incomplete`` covers the broken
checkpoints that such a directory may hold.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from dataclasses import dataclass


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class Retention(abc.ABC):
    """A retention policy: which of the complete steps to keep."""

    @abc.abstractmethod
    def keep(self, steps: Sequence[int]) -> set[int]:
        """The steps to keep, of ``steps`` (distinct, ascending)."""

    def __or__(self, other: Retention) -> Retention:
        if not isinstance(other, Retention):
            return NotImplemented
        mine = self.policies if isinstance(self, KeepAny) else (self,)
        theirs = other.policies if isinstance(other, KeepAny) else (other,)
        return KeepAny((*mine, *theirs))


@dataclass(frozen=True)
class KeepLast(Retention):
    """The newest ``n`` complete steps."""

    n: int

    def __post_init__(self) -> None:
        _positive("KeepLast(n)", self.n)

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(steps[-self.n :])


@dataclass(frozen=True)
class KeepEvery(Retention):
    """Every step divisible by ``k`` (kept for good: milestones)."""

    k: int

    def __post_init__(self) -> None:
        _positive("KeepEvery(k)", self.k)

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.k == 0}


@dataclass(frozen=True)
class KeepSteps(Retention):
    """These steps, by number."""

    steps: frozenset[int]

    def __init__(self, steps: Collection[int]) -> None:
        for s in steps:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(f"KeepSteps: a step is a non-negative int, got {s!r}")
        object.__setattr__(self, "steps", frozenset(steps))

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s in self.steps}


@dataclass(frozen=True)
class SaveTotalLimit(Retention):
    """The Hugging Face Trainer's ``save_total_limit=n``: ``n`` steps in all, the newest,
    with the ``best`` step (``best_model_checkpoint``) among them. The newest and the best
    are protected, the oldest others go until ``n`` remain; so a best older than the
    newest ``n`` takes the place of the oldest of them, and with ``n=1`` the newest stays
    beside it. A ``best`` that is not among the steps still counts as one kept, as in the
    stock rule (``transformers.trainer_utils.rotate_checkpoints``). Without ``best``,
    this is `KeepLast` ``(n)``."""

    n: int
    best: int | None = None

    def __post_init__(self) -> None:
        _positive("SaveTotalLimit(n)", self.n)

    def keep(self, steps: Sequence[int]) -> set[int]:
        if not steps:
            return set()
        protected = {steps[-1]} if self.best is None else {steps[-1], self.best}
        kept = protected & set(steps)
        others = [s for s in steps if s not in protected]
        room = max(self.n, len(protected)) - len(kept)
        return kept | set(others[len(others) - room :] if room > 0 else [])


@dataclass(frozen=True)
class KeepAll(Retention):
    """Every step: nothing is deleted."""

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(steps)


@dataclass(frozen=True)
class KeepAny(Retention):
    """The steps any of ``policies`` keeps (what ``a | b`` makes)."""

    policies: tuple[Retention, ...]

    def __post_init__(self) -> None:
        if not self.policies or not all(isinstance(p, Retention) for p in self.policies):
            raise ValueError(f"KeepAny needs one or more Retention policies, got {self.policies!r}")

    def keep(self, steps: Sequence[int]) -> set[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(steps)
        return kept


def policy_of(keep_last: int | None, keep_every: int | None, *, best: int | None = None) -> Retention:
    """The policy the manager's ``keep_last``/``keep_every`` shorthands name: the newest
    ``keep_last`` and every multiple of ``keep_every``; without ``keep_last``, every step
    (``keep_every`` alone deletes nothing). With ``best`` (a Trainer's best checkpoint),
    ``keep_last`` is the Trainer's ``save_total_limit``: `SaveTotalLimit`."""
    if keep_last is None:
        return KeepAll()
    policy: Retention = KeepLast(keep_last) if best is None else SaveTotalLimit(keep_last, best)
    if keep_every is not None:
        policy = policy | KeepEvery(keep_every)
    return policy


def to_delete(
    steps: Sequence[int],
    policy: Retention,
    protected: Collection[int] = (),
    *,
    incomplete: Collection[int] = (),
) -> list[int]:
    """The complete ``steps`` that ``policy`` lets go, ascending: never the newest, nor
    any of ``protected``. The ``incomplete`` steps (broken checkpoints, which nothing can
    resume from) older than the newest complete one go too, unless protected; newer ones
    are left alone (a save may be writing them), and without a complete step none goes."""
    ordered = sorted(set(steps))
    if not ordered:
        return []
    keep = policy.keep(ordered)
    keep.add(ordered[-1])  # never the newest complete one
    keep |= set(protected)
    doomed = {s for s in ordered if s not in keep}
    doomed |= {s for s in incomplete if s < ordered[-1] and s not in protected}
    return sorted(doomed)
