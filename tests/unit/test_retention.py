"""Retention policies (pure): what each keeps, how they combine, what is never deleted."""

from __future__ import annotations

import pytest

from aiopersist import KeepAll, KeepAny, KeepEvery, KeepLast, KeepSteps, Retention
from aiopersist._retention import SaveTotalLimit, policy_of, to_delete

STEPS = [10, 20, 30, 40, 50, 60]


def test_each_policy_keeps_what_it_says() -> None:
    assert KeepLast(2).keep(STEPS) == {50, 60}
    assert KeepLast(10).keep(STEPS) == set(STEPS)
    assert KeepEvery(20).keep(STEPS) == {20, 40, 60}
    assert KeepSteps({30, 35}).keep(STEPS) == {30}
    assert KeepAll().keep(STEPS) == set(STEPS)


def test_policies_combine_with_or_and_flatten() -> None:
    policy = KeepLast(1) | KeepEvery(20) | KeepSteps({10})
    assert isinstance(policy, KeepAny)
    assert len(policy.policies) == 3  # a | b | c is one union, not nested ones
    assert policy.keep(STEPS) == {10, 20, 40, 60}
    assert to_delete(STEPS, policy) == [30, 50]


def test_the_newest_and_the_protected_steps_are_never_deleted() -> None:
    # A policy that keeps nothing of these steps still leaves the newest, and the protected.
    assert to_delete(STEPS, KeepSteps({1})) == [10, 20, 30, 40, 50]
    assert to_delete(STEPS, KeepLast(1), protected={20}) == [10, 30, 40, 50]
    assert to_delete([], KeepLast(1)) == []
    assert to_delete([5, 5, 3], KeepLast(1)) == [3]  # distinct, ascending


def test_the_managers_shorthands_name_these_policies() -> None:
    assert to_delete(STEPS, policy_of(None, None)) == []
    assert to_delete(STEPS, policy_of(None, 20)) == []  # keep_every alone deletes nothing
    assert to_delete(STEPS, policy_of(2, None)) == [10, 20, 30, 40]
    assert to_delete(STEPS, policy_of(2, 20)) == [10, 30]
    assert to_delete([5], policy_of(1, 7)) == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: KeepLast(0),
        lambda: KeepLast(True),
        lambda: KeepLast(2.0),
        lambda: KeepEvery(-1),
        lambda: KeepSteps({-1}),
        lambda: KeepSteps({"3"}),
        lambda: KeepAny(()),
        lambda: KeepAny((KeepLast(1), 3)),
        lambda: SaveTotalLimit(0, 3),
    ],
)
def test_bad_policies_are_refused_when_made(make: object) -> None:
    with pytest.raises(ValueError, match=r"KeepLast|KeepEvery|KeepSteps|KeepAny|SaveTotalLimit"):
        make()  # type: ignore[operator]


def test_a_policy_is_a_retention_and_or_refuses_anything_else() -> None:
    assert isinstance(KeepLast(1), Retention)
    with pytest.raises(TypeError):
        KeepLast(1) | 3  # type: ignore[operator]


def test_save_total_limit_counts_the_best_among_those_kept() -> None:
    """The Trainer's rule (checked against transformers' own rotation on real directories
    in tests/e2e/test_cli_trainer.py)."""
    assert SaveTotalLimit(2).keep(STEPS) == KeepLast(2).keep(STEPS)  # no best: the newest
    assert SaveTotalLimit(2, best=50).keep(STEPS) == {50, 60}  # among the newest: as KeepLast
    assert SaveTotalLimit(3, best=10).keep(STEPS) == {10, 50, 60}  # it replaces the oldest of them
    assert SaveTotalLimit(1, best=10).keep(STEPS) == {10, 60}  # with n=1, the newest stays beside it
    assert SaveTotalLimit(1, best=99).keep(STEPS) == {50, 60}  # a best that is gone still counts
    assert SaveTotalLimit(1, best=60).keep(STEPS) == {60}
    assert SaveTotalLimit(3).keep([]) == set()
    assert to_delete(STEPS, policy_of(2, 30, best=10)) == [20, 40, 50]  # with keep_every: either keeps


def test_incomplete_steps_older_than_the_newest_complete_one_go() -> None:
    assert to_delete([10, 30], KeepLast(5), incomplete=[5, 20, 40]) == [5, 20]  # 40 may be being written
    assert to_delete([10, 30], KeepLast(5), protected={20}, incomplete=[20]) == []
    assert to_delete([], KeepLast(1), incomplete=[5]) == []  # no complete step: nothing goes
