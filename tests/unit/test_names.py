"""The names of work in progress: beside a checkpoint, or in the place given to its
directory (pure: no I/O)."""

from __future__ import annotations

from aiopersist._names import (
    OLD_MARKER,
    TMP_MARKER,
    TRASH_MARKER,
    beside,
    temp_path,
    work_elsewhere,
    work_place,
)


def test_work_in_progress_is_beside_the_checkpoint_by_default() -> None:
    assert temp_path("/runs/a/checkpoint-3", "abc") == f"/runs/a/.checkpoint-3{TMP_MARKER}abc"
    assert work_place("/runs/a") == "/runs/a"


def test_work_elsewhere_moves_every_kind_of_work_of_that_directory_only() -> None:
    work_elsewhere("/proj/x/checkpoints/", "/proj/x/.staging")
    for marker in (TMP_MARKER, OLD_MARKER, TRASH_MARKER):
        got = beside("/proj/x/checkpoints/checkpoint_7", marker, "t0")
        assert got == f"/proj/x/.staging/.checkpoint_7{marker}t0"
    assert work_place("/proj/x/checkpoints") == "/proj/x/.staging"
    assert temp_path("/proj/x/other/checkpoint_7", "t0") == f"/proj/x/other/.checkpoint_7{TMP_MARKER}t0"
    assert temp_path("/proj/x/checkpoints/sub/c", "t0") == f"/proj/x/checkpoints/sub/.c{TMP_MARKER}t0"
