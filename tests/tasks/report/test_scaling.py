"""The report's scaling parts: segments of an elastic run from its launch record and metrics, and the advisor's
prediction next to the measured figures (tasks/report/scaling.py)."""

import pytest

from tasks.report import scaling
from tasks.report.document import Comparison
from tasks.report.store import render_markdown
from tests.tasks.report.test_store import report as base_report
from tests.tasks.report.test_store import view_of
from tests.tasks.run_fixtures import ELASTIC_RECORD, step_metrics


def test_segments_name_each_launch_that_trained_with_its_throughput():
    metrics = step_metrics(range(1, 21), 0.1) + step_metrics(range(21, 41), 0.2)
    rows = scaling.segments(ELASTIC_RECORD, metrics, final_step=40)
    assert [(r.from_step, r.to_step, r.num_workers, r.grad_accum_steps) for r in rows] == [
        (0, 20, 4, 1), (20, 40, 2, 2)]
    assert rows[0].tokens_per_s == pytest.approx(5120) and rows[1].tokens_per_s == pytest.approx(2560)
    assert rows[1].line == "continued on 2 of 4 workers from step 20: host h unreachable"
    assert scaling.is_elastic(rows, 4) and not scaling.is_elastic(rows[:1], 4)
    assert scaling.segments(None, metrics, 40) == []


def test_the_report_marks_an_elastic_run_and_shows_predicted_next_to_measured():
    rows = scaling.segments(ELASTIC_RECORD, step_metrics(range(1, 41), 0.1), final_step=40)
    advice = {"rows": [{"num_workers": n, "speedup": s, "efficiency": s / n, "tokens_per_s": 1000.0 * s}
                       for n, s in ((1, 1.0), (2, 1.6), (3, 2.0), (4, 2.2))],
              "recommendation": "4 workers: predicted 55% efficiency (2.20x); 2 workers reach 1.60x at 80%",
              "inputs": {"step_source": "probe"}}
    comparison = Comparison(speedup=1.5, efficiency=0.75, loss_delta=0.001, loss_tolerance=0.02)
    predicted = scaling.prediction({"advisor": advice}, 2, comparison)
    assert predicted.predicted_speedup == 1.6 and predicted.speedup_error == pytest.approx(0.1 / 1.5)
    assert scaling.prediction({}, 2, comparison) is None
    report = base_report(workers=4, baseline=False)
    report.update(comparison=comparison.to_json(), segments=[row.to_json() for row in rows], elastic=True,
                  prediction=predicted.to_json())
    markdown = render_markdown(view_of(report))
    assert "**elastic**: continued on 2 of 4 workers from step 20: host h unreachable" in markdown
    assert "| 1-20 | 4 of 4 | 1 | 5,120 | started on 4 of 4 workers |" in markdown
    assert "| 2 | 1.60x | 1.50x | 80% | 75% |" in markdown and "2 workers reach 1.60x at 80%" in markdown
    plain = {key: value for key, value in report.items() if key not in ("segments", "elastic", "prediction")}
    assert "elastic" not in render_markdown(view_of(plain)) and "predicted" not in render_markdown(view_of(plain))
