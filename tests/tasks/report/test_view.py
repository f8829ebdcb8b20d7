"""The report's view (tasks/report/view.py): the sections report.md and the run's page both write, from any JSON."""

import pytest

from tasks.report import blocks
from tasks.report import view as report_view
from tasks.report.store import render_markdown
from tests.tasks.report.test_store import report, view_of


def _titles(view: blocks.ReportView) -> list[str | None]:
    return [section.title for section in view.sections]


def test_sections_in_report_order_with_the_optional_ones_only_when_present():
    data = report()
    assert _titles(report_view.report_view(view_of(data))) == [None, "Gates", "Promotion", "Charts", "Versions"]
    data["samples"] = [{"model": "distributed", "eval_loss": 5.31, "samples": [
        {"prompt": "To be", "greedy": " or not", "top_k": "  \n"}]}]
    view = report_view.report_view(view_of(data))
    assert _titles(view) == [None, "Gates", "Promotion", "Samples", "Charts", "Versions"]
    prompt_table = view.sections[3].blocks[-1]
    assert prompt_table.rows == (("distributed", " or not", "(empty)"),)  # generated text kept as it is


def test_the_verdicts_and_where_the_page_anchors_them():
    view = report_view.report_view(view_of(report(), release={"clean": False}))
    headline, *_ = view.sections[0].blocks
    verdicts = [mark for mark in headline.line if isinstance(mark, blocks.Verdict)]
    assert verdicts == [blocks.Verdict("PASSED", True, "Gates"),
                        blocks.Verdict("no", False, "Released", anchor="released")]
    (gate,) = view.sections[1].blocks[0].rows
    assert gate[1] == blocks.Verdict("pass", True)


def test_the_parts_other_tasks_own_are_shown_whatever_their_shape():
    """report.json is read checked (tasks/report/document.py); promotion.json's verdict and release's ledger are shown
    as they are: missing fields read as dashes, wrong types as text, never an error."""
    for promotion in ({}, {"promoted": "yes", "reason": ["x"]}, {"unreadable": 3}):
        for release in ({}, {"clean": "yes", "usage": {"held_gpu_h": "lots", "per_slot": [1, {"slot": 2}]}}):
            markdown = render_markdown(view_of(report(), promotion, release))
            assert "**Released: no**" in markdown and "## Promotion" in markdown
    usage = {"held_gpu_h": "lots", "busy_share": None, "idle_by_cause_gpu_h": {"startup": "x"}, "attempts": [[]]}
    assert "worker slots held lots worker-h" in render_markdown(view_of(report(), None, {"usage": usage}))


def test_gpu_memory_shows_tensorflows_peak_beside_the_memory_in_use_on_gpu_runs_only():
    cpu = render_markdown(view_of(report()))
    assert "GPU memory" not in cpu
    data = report()
    data["runs"]["distributed"].update(gpu_mem_peak_mb=3210.4, gpu_mem_reserved_mb=139812.0)
    data["runs"]["baseline"].update(gpu_mem_peak_mb=5120.0, gpu_mem_reserved_mb=None)
    assert ("GPU memory of rank 0: distributed peak 3,210 MiB used by TensorFlow, 139,812 MiB in use on the GPU; "
            "baseline peak 5,120 MiB used by TensorFlow, — in use on the GPU (TensorFlow reserves nearly all of "
            "the GPU at start-up; the peak is what training needed)") in render_markdown(view_of(data))


def test_the_report_says_how_the_gradients_crossed_the_network():
    """summary.json's `allreduce` (trainer/train.py) reaches the report through the run's figures
    (tasks/report/comparison.py): the implementation `communication` resolved to, the wire dtype and the packs."""
    from core.eval_result import EvalResult
    from core.layout import TrainOutput
    from core.summary import TrainSummary
    from tasks.report.comparison import run_figures

    summary = {"num_workers": 2, "global_batch_size": 16, "steps": 4, "tokens_seen": 4096, "train_time_s": 2.0,
               "wall_time_s": 3.0, "tokens_per_s": 2048.0, "final_loss": 5.0,
               "allreduce": {"implementation": "nccl", "dtype": "float32", "pack_mb": 32.0, "packs": 3,
                             "overlap": True}}
    evaluation = EvalResult.from_json({"eval_loss": 5.0, "perplexity": 148.4, "eval_tokens": 100, "eval_time_s": 1.0},
                                      "eval.json")
    data = report()
    data["runs"]["distributed"] = run_figures("distributed", TrainOutput("storage/run"),
                                              TrainSummary.from_json(summary, "summary.json"), evaluation).to_json()
    data["config"] = {"communication": "auto"}
    assert ("Gradient all-reduce: float32 over NCCL ('communication' = 'auto'), 3 pack(s) of >= 32 MiB, "
            "overlapping the backward pass") in render_markdown(view_of(data))
    data["runs"]["distributed"]["allreduce"] = {"implementation": "ring", "dtype": "bfloat16", "pack_mb": 0.0,
                                                "packs": None, "overlap": False}
    assert ("Gradient all-reduce: bfloat16 over RING ('communication' = 'auto'), one worker: nothing crossed the "
            "network") in render_markdown(view_of(data))
    del data["runs"]["distributed"]["allreduce"]  # a summary written before the field
    assert "Gradient all-reduce" not in render_markdown(view_of(data))


def test_the_memory_forecast_is_shown_beside_the_measured_peak_from_the_summary_to_report_md():
    """summary.json's `memory` (trainer/memory_forecast.py) reaches report.md through the run's figures: the
    forecast total and activations beside TensorFlow's GPU peak, or the peak resident memory on the CPU."""
    from core.eval_result import EvalResult
    from core.layout import TrainOutput
    from core.summary import SummaryError, TrainSummary
    from tasks.report.comparison import run_figures

    summary = {"num_workers": 2, "global_batch_size": 16, "steps": 4, "tokens_seen": 4096, "train_time_s": 2.0,
               "wall_time_s": 3.0, "tokens_per_s": 2048.0, "final_loss": 5.0,
               "memory": {"forecast_mb": {"weights": 1.0, "gradients": 2.0, "optimizer": 2.0, "activations": 1234.6,
                                          "logits": 3.0, "total": 3388.4}, "peak_rss_mb": 3400.2}}
    evaluation = EvalResult.from_json({"eval_loss": 5.0, "perplexity": 148.4, "eval_tokens": 100, "eval_time_s": 1.0},
                                      "eval.json")
    data = report()

    def shown(summary_value):
        figures = run_figures("distributed", TrainOutput("storage/run"),
                              TrainSummary.from_json(summary_value, "summary.json"), evaluation)
        data["runs"]["distributed"] = figures.to_json()
        return render_markdown(view_of(data))

    assert ("Memory per worker, rank 0: distributed forecast 3,388 MiB (activations 1,235 MiB), peak resident "
            "memory 3,400 MiB, TensorFlow itself included") in shown(summary)
    on_gpu = {**summary, "memory": {"forecast_mb": {"total": 70000.0, "activations": 50000.0},
                                    "gpu_mem_peak_mb": 65000.0}}
    assert "forecast 70,000 MiB (activations 50,000 MiB), TensorFlow's peak on the GPU 65,000 MiB" in shown(on_gpu)
    assert "Memory per worker" not in shown({k: v for k, v in summary.items() if k != "memory"})  # an older summary
    with pytest.raises(SummaryError, match="memory"):
        TrainSummary.from_json({**summary, "memory": {"forecast_mb": "lots"}}, "summary.json")
