"""The report's charts (tasks/report/charts.py) and the matplotlib set-up every chart of the run shares."""

from __future__ import annotations

import struct

from tasks.report import charts
from tasks.report import store as reports
from tests.tasks.report.test_store import document


def png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return struct.unpack(">II", data[16:24])


def test_a_chart_is_drawn_without_a_display_and_its_figure_closed_once_written():
    plot = charts.pyplot()
    figure, axes = plot.subplots(figsize=(4, 2))
    axes.plot([0, 1], [1, 0])
    assert plot.get_backend().lower() == "agg"
    assert png_size(charts.png(plot, figure)) == (440, 220)
    assert figure.number not in plot.get_fignums()


def test_charts_are_pngs_even_without_data():
    curve = [{"step": s, "loss": 8.0 - s / 10, "tokens_seen": s * 1024} for s in range(1, 30)]
    assert png_size(charts.loss_chart({"baseline": curve, "distributed": curve}, "loss")) == (825, 462)
    with_evals = charts.loss_chart({"baseline": curve, "distributed": curve}, "loss",
                                   eval_points={"baseline": (29 * 1024, 5.3), "distributed": (29 * 1024, 5.31)})
    assert png_size(with_evals) == (825, 462) and with_evals != charts.loss_chart(
        {"baseline": curve, "distributed": curve}, "loss")
    assert png_size(charts.loss_chart({"distributed": []}, "no metrics"))[0] > 0
    history = reports.history_point(document("a", 2, 0.45)) + reports.history_point(document("b", 4, 0.2))
    assert png_size(charts.scaling_chart(history, current_run_id="b")) == (1100, 462)
