"""The benchmarks' reports: the ratios they judge their targets by."""

from __future__ import annotations

import pytest

from aiopersist._bench.dcp import DcpReport, format_dcp
from aiopersist._bench.train import TrainReport, TrainResult, dcp_overhead_ratio, format_train


def _train(*results: TrainResult) -> TrainReport:
    return TrainReport(50_000_000, 600 << 20, 32, 6, 3, 32 << 20, results)


def test_dcp_overhead_ratio_of_medians_and_by_round() -> None:
    report = _train(
        TrainResult("none", 0.4, 0.0, 0.0, 0.0, 30.0, ()),
        TrainResult("dcp", 0.8, 1.0, 0.4, 0.8, 900.0, (0.8, 1.2, 1.0)),
        TrainResult("dcp-aiopersist", 0.48, 0.2, 0.06, 0.5, 60.0, (0.2, 0.24, 0.5)),
    )
    ratio = dcp_overhead_ratio(report)
    assert ratio is not None
    median, rounds = ratio
    assert median == pytest.approx(0.2)
    assert rounds == pytest.approx((0.25, 0.2, 0.5))
    text = format_train(report)
    assert "dcp-aiopersist overhead 0.20 of stock dcp's (target <= 0.25) met; by round 0.25 0.20 0.50" in text


def test_dcp_overhead_ratio_missed_and_absent() -> None:
    none = TrainResult("none", 0.4, 0.0, 0.0, 0.0, 30.0, ())
    stock = TrainResult("dcp", 0.6, 0.5, 0.2, 0.6, 900.0, (0.5,))
    ours = TrainResult("dcp-aiopersist", 0.56, 0.4, 0.1, 0.5, 60.0, (0.4,))
    assert "0.80 of stock dcp's (target <= 0.25) MISSED" in format_train(_train(none, stock, ours))
    assert dcp_overhead_ratio(_train(none, ours)) is None
    free = TrainResult("dcp", 0.4, 0.0, 0.0, 0.4, 900.0, (0.0,))  # stock cost nothing: no ratio
    assert dcp_overhead_ratio(_train(none, free, ours)) is None
    assert "of stock dcp's" not in format_train(_train(none, free, ours))


def test_dcp_report_states_the_ceiling_fio_sets() -> None:
    report = DcpReport(
        2,
        2 << 30,
        {"fs-t1": (3.0, 3.2), "fs-t4": (1.6, 1.5), "aiopersist": (1.0, 1.1), "fio": (0.9, 1.0)},
        True,
    )
    text = format_dcp(report)
    assert "ceiling fio is 1.63x the best FileSystemWriter on this disk" in text
    assert "(fs-t4): 1.48x  MISSED" in text
    assert ">= 0.90x fio: 0.90x  met" in text
    without_fio = format_dcp(DcpReport(2, 2 << 30, {"fs-t4": (1.5,), "aiopersist": (1.0,)}, False))
    assert "ceiling" not in without_fio
    assert "(fs-t4): 1.50x  met" in without_fio
