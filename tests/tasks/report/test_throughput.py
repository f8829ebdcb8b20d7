"""tasks.report.throughput: a run well below the advisor's prediction or the last comparable run is warned about."""

from __future__ import annotations

from tasks.report import throughput
from tasks.report.document import RunReport
from tests.tasks.report.test_store import report as base_report

CPU = {"cpu": "Xeon", "cpu_count": 2, "device": "CPU", "gpu": None}


def report(run_id: str, tokens_per_s: float | None, *, created: str = "2026-12-01T02:00:00", predicted=None,
           cpu_count: int = 2, **config) -> RunReport:
    settings = {"num_workers": 2, "backend": "local", "model": "tiny", "block_size": 64, "batch_size_per_worker": 8,
                "grad_accum_steps": 1, "mixed_precision": "no", "xla": False, "use_gpu": False,
                "communication": "auto", "tokenizer": "bpe:2048", "workers_per_host": 0, **config}
    data = {**base_report(run_id, settings["num_workers"], baseline=False), "created_at": created, "config": settings,
            "hardware": {"line": "cpu", "distributed": {**CPU, "cpu_count": cpu_count}},
            "prediction": {"num_workers": settings["num_workers"], "predicted_tokens_per_s": predicted}
            if predicted else None}
    data["runs"]["distributed"]["tokens_per_s"] = tokens_per_s
    return RunReport.from_json(data, f"{run_id}/report.json")


def test_below_half_the_prediction_is_warned_with_both_figures_and_the_setting():
    (warning,) = throughput.assess(report("now", 4_000, predicted=10_000), [], min_ratio=0.5).warnings
    assert warning.startswith("4,000 tokens/s is 40% of the 10,000 the preflight advisor predicted for 2 workers")
    assert "setting 'min_throughput_ratio'" in warning
    assert throughput.assess(report("now", 6_000, predicted=10_000), [], min_ratio=0.5).warnings == []
    assert throughput.assess(report("now", 4_000, predicted=10_000), [], min_ratio=0.0).warnings == []  # off


def test_the_latest_comparable_run_is_the_reference():
    older = report("older", 20_000, created="2026-11-01T02:00:00")
    latest = report("latest", 9_000, created="2026-12-02T02:00:00")
    other_model = report("gpt2", 90_000, created="2026-12-02T03:00:00", model="gpt2-124m")
    other_host = report("bigger", 90_000, created="2026-12-02T04:00:00", cpu_count=64)
    now = report("now", 4_000)

    assert throughput.last_comparable(now, [older, latest, other_model, other_host]).run_id == "latest"
    (warning,) = throughput.assess(now, [older, latest, other_model, other_host], min_ratio=0.5).warnings
    assert warning.startswith("4,000 tokens/s is 44% of the 9,000 of the last comparable run latest")
    assert throughput.assess(now, [latest], min_ratio=0.5).ratio == 4_000 / 9_000


def test_both_expectations_warn_separately_and_the_lower_ratio_is_the_metric():
    now = report("now", 2_000, predicted=10_000)
    assert len(throughput.assess(now, [report("before", 5_000)], min_ratio=0.5).warnings) == 2
    assert throughput.assess(now, [report("before", 5_000)], min_ratio=0.5).ratio == 0.2


def test_no_expectation_no_warning():
    assert throughput.assess(report("now", 1), [report("untimed", None)], min_ratio=0.5).warnings == []
    assert throughput.assess(report("now", 1), [], min_ratio=0.5).ratio is None
