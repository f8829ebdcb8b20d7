"""The comparison's pure parts (tasks/report/comparison.py): figures, speedup and the hardware line, without storage."""

from dataclasses import replace

from core.config import RunConfig
from core.summary import TrainSummary
from tasks.report import comparison
from tasks.report.document import RunFigures


def test_speedup_compares_time_per_step_so_a_resumed_job_is_measured_fairly():
    work = {"num_workers": 1, "global_batch_size": 8, "tokens_seen": 0, "wall_time_s": 60.0, "tokens_per_s": None,
            "final_loss": None}
    baseline = {**work, "steps": 40, "steps_timed": 39, "train_time_s": 39.0, "resumed_from_step": 0}
    resumed = {**work, "steps": 40, "steps_timed": 19, "train_time_s": 9.5, "resumed_from_step": 20}  # 0.5 s/step
    older = {key: value for key, value in resumed.items() if key != "steps_timed"}  # before the field: 20 steps

    def per_step(summary):
        return TrainSummary.from_json(summary, "summary.json").seconds_per_step

    assert (per_step(baseline), per_step(resumed), per_step(older)) == (1.0, 0.5, 9.5 / 20)
    assert per_step({**resumed, "steps_timed": 0}) is None
    run = figures(num_workers=4, eval_loss=5.0, seconds_per_step=0.5)
    result = comparison.compare(run, replace(run, num_workers=1, seconds_per_step=1.0), 0.02)
    assert (result.speedup, result.efficiency, result.loss_delta) == (2.0, 0.5, 0.0)


def test_the_hardware_line_says_what_bounds_the_scaling():
    cpu = {"cpu_count": 8, "cpu": "Xeon"}
    assert comparison.hardware_line(RunConfig(num_workers=1), figures(hardware=cpu)) == (
        "1 worker on a 8-core CPU (Xeon).")
    line = comparison.hardware_line(RunConfig(num_workers=4), figures(hardware=cpu))
    assert line.startswith("4 workers on a 8-core CPU: efficiency is bounded by cores") and "1/N = 25%" in line
    gpu = comparison.hardware_line(RunConfig(num_workers=2, use_gpu=True),
                                   figures(hardware={"gpu": "H200", "host": "h"}))
    assert gpu == "2 workers x 1 GPU (H200), chief on h; the baseline trained on 1 GPU of the same kind."


def figures(**changes) -> RunFigures:
    """A trained model's figures, `changes` applied."""
    return replace(RunFigures(
        label="distributed", num_workers=2, global_batch_size=16, steps=40, tokens_seen=40960, train_time_s=40.0,
        wall_time_s=50.0, tokens_per_s=1000.0, final_loss=5.2, eval_loss=5.3, perplexity=200.3, eval_tokens=4096,
        eval_time_s=2.0, output_url="/s/train", model_url="/s/train/model", summary_url="/s/train/summary.json"),
        **changes)
